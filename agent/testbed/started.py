"""The context-manager protocol that the test bed's environments share (:class:`Sandbox`,
:class:`ControlPlane`, :class:`RealCluster`): build on entry, remove everything on exit, and also
when the build itself fails half way."""

from __future__ import annotations

from typing import Self


class Started:
    """``with X(...) as x:`` runs :meth:`start`, then the block, then :meth:`close`; a failed
    :meth:`start` (an exception, or Ctrl-C) is followed by :meth:`close` before it propagates, so
    nothing half-built is left. Subclasses give both; :meth:`close` must be idempotent."""

    def start(self) -> None:
        """Build the environment; raises what the subclass documents."""
        raise NotImplementedError

    def close(self) -> None:
        """Remove everything :meth:`start` made, as far as it got (idempotent)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
