"""A clock for tests (:class:`nftpolicy.agent.daemon.clock.Clock`): its time moves only by
:meth:`FakeClock.advance`, so a loop's delays are read, not waited out."""

from __future__ import annotations

import threading

from nftpolicy.agent.daemon.clock import Clock


class FakeClock(Clock):
    """Virtual monotonic time starting at ``start`` seconds. ``wait(event, seconds)`` returns
    when ``event`` is set (polled every 2 ms of real time) or once :meth:`advance` has
    moved the time ``seconds`` past the call; ``waited`` lists every wait's ``seconds``."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._moved = threading.Condition()
        self.waited: list[float] = []

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the time ``seconds`` on and wake the waits that are due."""
        with self._moved:
            self._now += seconds
            self._moved.notify_all()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        with self._moved:
            self.waited.append(seconds)
            deadline = self._now + seconds
            while not event.is_set() and self._now < deadline:
                self._moved.wait(0.002)
        return event.is_set()


class InstantClock(FakeClock):
    """Every wait lasts its whole time, at once (for code that waits in the test's own thread)."""

    def wait(self, event: threading.Event, seconds: float) -> bool:
        self.waited.append(seconds)
        self.advance(seconds)
        return False
