"""The time the daemon's loops read and wait on, in one object they are given.

The reconcile loop and the API source schedule everything (coalescing, resyncs, retries,
backoff, how long a kind has failed) from :meth:`Clock.now` and :meth:`Clock.wait`; tests give
a clock of their own (``tests/fakeclock.py``) whose time moves only when the test says, so
that minutes of delays are read, not waited out. What a sync costs is measured in real time
(``time.monotonic``) whatever the clock.
"""

from __future__ import annotations

import threading
import time


class Clock:
    """The system's monotonic clock."""

    def now(self) -> float:
        """Seconds on the monotonic clock (only differences mean anything)."""
        return time.monotonic()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Block until ``event`` is set or ``seconds`` have passed; True when ``event`` is set
        (:meth:`threading.Event.wait`)."""
        return event.wait(seconds)


REAL_TIME = Clock()
