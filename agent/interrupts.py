"""SIGINT and SIGTERM: every command ends within :data:`GRACE` seconds of the first signal, with
one line on stderr, no traceback, exit 130 (SIGINT) or 143 (SIGTERM) (128 + the signal number, as
a shell reports a process a signal ended), and what it made removed.

* The ``nftpolicy`` command and the ``kubectl-nftpolicy`` plugin are one launcher
  (``agent/cli/nftpolicy``, ``agent/cli/kubectl-nftpolicy`` a symlink to it) that starts the
  interpreter with both signals blocked; :func:`nftpolicy.agent.cli.run` installs the guard, then unblocks
  them, so a signal that came while Python started (site-packages, the imports: tens of
  milliseconds) is handled as any later one. Only one in the launcher's first millisecond,
  before it blocks them, ends the process the default way (no line; a shell shows 130 or 143
  all the same).
* :class:`Guard` (installed by :func:`install`, which :func:`nftpolicy.agent.cli.run` calls
  first) handles both signals. The first one raises :class:`Interrupted` in the main thread, so every
  ``with`` and ``finally`` on the way out removes what it made; while an asyncio loop runs (the
  sandbox's probes) it cancels the loop's tasks instead (an exception raised inside asyncio's own
  code leaves the loop unusable: this is how :class:`asyncio.Runner` handles Ctrl-C), and the
  code that ran the loop calls :func:`raise_pending` (as do the steps of a long command, for a
  signal whose exception a ``__del__`` swallowed). The agent asks for a callback instead
  (:meth:`Guard.stop_with`): it stops its loop itself; and it has its signals handled in a thread
  of their own (:meth:`Guard.handle_in_thread`): Python runs a handler in the main thread only,
  so a signal that the kernel gave another thread (any thread may take a process's signal; the
  agent has one per HTTP request) waited for the end of whatever the main thread was blocked in
  (the loop's wait of up to 5 s, a C call), and the watchdog with it: under scrape load a SIGTERM
  took up to 5 s more to act on.
* A watchdog armed by the first signal, and any second signal at once, end the process the hard
  way (:meth:`Guard.force`): the leftovers still registered are removed, the line printed, and
  ``os._exit`` with the signal's code. Children that the sandbox started die with it
  (``PR_SET_PDEATHSIG``).
* Leftovers (:func:`remember`, :func:`forget`, :func:`clean_leftovers`): what this process made
  and has not removed yet (network namespaces, the control plane's directory), with how to
  remove it. :func:`clean_leftovers` also runs when a command ends, so an interrupt that cut a
  cleanup short is completed there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Hashable, Iterator

GRACE = 5.0  # seconds from the first signal to the end of the process, at most
MESSAGES = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}

_leftovers: dict[Hashable, Callable[[], None]] = {}
_leftovers_lock = threading.RLock()  # reentrant: a second signal may force() inside it


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by the first SIGINT or SIGTERM. ``signum``: that signal;
    ``code``: the exit code it gives (128 + ``signum``: 130 or 143)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def code(self) -> int:
        """128 + the signal number."""
        return 128 + self.signum


def remember(key: Hashable, cleanup: Callable[[], None]) -> None:
    """Register ``cleanup`` (quick, idempotent, never raising for what is already gone) as the way
    to remove the thing named ``key`` that this process made; :func:`forget` it once removed."""
    with _leftovers_lock:
        _leftovers[key] = cleanup


def forget(key: Hashable) -> None:
    """The thing named ``key`` is removed (or never was registered): nothing left to do for it."""
    with _leftovers_lock:
        _leftovers.pop(key, None)


def clean_leftovers() -> int:
    """Run and forget every registered cleanup, the last registered first; each is forgotten
    only once it has run, so a second signal that cuts this short and calls it again finishes the
    job (each one's errors are ignored: the others still run). Returns how many ran; from any
    thread."""
    ran = 0
    while True:
        with _leftovers_lock:
            if not _leftovers:
                return ran
            key = next(reversed(_leftovers))  # the last made first: a process before its directory
            cleanup = _leftovers[key]
        try:
            cleanup()
        except Exception:  # a last resort: the next one must still run
            pass
        forget(key)
        ran += 1


class Guard:
    """The SIGINT/SIGTERM handler of one command (see the module's text).

    ``grace``: seconds from the first signal to :meth:`force`; ``timer``: makes the watchdog
    (``threading.Timer``'s signature; tests inject one they fire themselves); ``exit``: ends the
    process with a code, at once (``os._exit``; tests inject a recorder); ``stderr_fd``: where
    the one line goes, written with ``os.write`` (no lock a stuck main thread could hold).
    """

    def __init__(self, grace: float = GRACE, timer: Callable[[float, Callable[[], None]], Any] = threading.Timer,
                 exit: Callable[[int], None] = os._exit, stderr_fd: int = 2) -> None:
        self.grace, self._timer_factory, self.exit, self._stderr_fd = grace, timer, exit, stderr_fd
        self.signum: int | None = None
        self.pending = False  # a signal whose Interrupted is still to be raised in the main thread
        self.timer: Any = None
        self._callback: Callable[[int], None] | None = None
        self._previous_hook: Callable[[Any], Any] = sys.unraisablehook
        self._announced = False
        self._lock = threading.RLock()
        self.finished = False  # set once the command has returned (see run())
        self.deferring = 0  # depth of deferred() blocks
        self.prog = "nftpolicy"

    @property
    def code(self) -> int:
        """The exit code of the signal received (128 + its number); 0 before any."""
        return 128 + self.signum if self.signum is not None else 0

    def install(self) -> None:
        """Handle SIGINT and SIGTERM from now on (main thread only). After a signal, exceptions
        in a ``__del__`` or a callback print no ``Exception ignored in ...``: one that the signal
        raised there becomes pending again (:meth:`raise_pending`), others (an object the signal
        left half made) are dropped."""
        signal.signal(signal.SIGINT, self.handle)
        signal.signal(signal.SIGTERM, self.handle)
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self.unraisable

    def unraisable(self, info: Any) -> None:
        """``sys.unraisablehook`` (``info``: its ``UnraisableHookArgs``) once installed: see
        :meth:`install`."""
        if self.signum is None:
            self._previous_hook(info)
        elif isinstance(info.exc_value, Interrupted):
            # Raised again by the next raise_pending() (not from here: Python would print it as
            # "Exception ignored in sys.unraisablehook"); the watchdog bounds the wait for one.
            self.pending = True
        # else an object half made when the signal came fails in its __del__: we are leaving

    def stop_with(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(signum)`` on the first signal instead of raising (a daemon that
        stops its own loop); the watchdog still bounds the time, and the daemon prints its own
        line (nothing is announced)."""
        self._callback = callback
        self._announced = True

    def handle_in_thread(self) -> threading.Thread:
        """Handle SIGINT and SIGTERM from now on in a daemon thread called ``signals`` (returned),
        whichever thread the kernel gives them to, however long the main thread is busy (module
        text); for a daemon that :meth:`stop_with` a callback. Call it from the main thread,
        before any other thread starts: the C-level handler writes each signal's number to a
        pipe (:func:`signal.set_wakeup_fd`) that the thread reads; the handler Python would run
        in the main thread does nothing. Both are swapped with the signals blocked, so none is
        lost or handled twice."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(MESSAGES))
        try:
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            for signum in MESSAGES:
                signal.signal(signum, _ignored)

            def run() -> None:
                while True:
                    for signum in os.read(read, 64):
                        if signum in MESSAGES:
                            self.handle(signum)

            thread = threading.Thread(target=run, name="signals", daemon=True)
            thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # one that came meanwhile is written to the pipe now
        return thread

    def handle(self, signum: int, _frame: object = None) -> None:
        """The signal handler (see the module's text)."""
        if self.finished:  # the command is done: nothing to unwind any more
            self.signum = signum if self.signum is None else self.signum
            self.force()
            return
        if self.signum is not None:
            self.force()  # a second signal: no more waiting
            return
        else:
            self.signum, self.pending = signum, True
            # Cancelled probes must not report themselves ("Task was destroyed but it is pending!").
            logging.getLogger("asyncio").disabled = True
            self.timer = self._timer_factory(self.grace, self.force)
            self.timer.daemon = True
            self.timer.start()
        if self._callback is not None:
            self.pending = False
            self._callback(signum)
            return
        if self.deferring:
            return  # raised when the deferred block ends
        if _cancel_running_loop():
            return  # raise_pending() raises once the loop has returned
        self.raise_pending()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A block that a signal does not interrupt: it is raised when the block ends. For
        imports: an exception raised inside a compiled module's initialisation can crash the
        interpreter (orjson's does: SIGSEGV)."""
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
        self.raise_pending()

    def raise_pending(self) -> None:
        """Raise :class:`Interrupted` when a signal was received and not raised yet (main thread;
        not inside :meth:`deferred`)."""
        if self.pending and self.signum is not None and not self.deferring:
            self.pending = False
            raise Interrupted(self.signum)

    def announce(self) -> None:
        """Print ``nftpolicy: interrupted`` (SIGINT) or ``nftpolicy: terminated`` (SIGTERM), once
        (``kubectl nftpolicy: ...`` in the plugin: :attr:`prog`)."""
        with self._lock:
            if self._announced or self.signum is None:
                return
            self._announced = True
        os.write(self._stderr_fd, f"{self.prog}: {MESSAGES[signal.Signals(self.signum)]}\n".encode())

    def force(self) -> None:
        """End the process now: remove the leftovers, print the line, exit with the code."""
        clean_leftovers()
        self.announce()
        self.exit(self.code or 130)

    def cancel_timer(self) -> None:
        """Disarm the watchdog (the command has ended by itself)."""
        if self.timer is not None:
            self.timer.cancel()


def _ignored(signum: int, frame: object) -> None:
    """The Python-level handler left once :meth:`Guard.handle_in_thread` handles the signals."""


def _cancel_running_loop() -> bool:
    """Cancel every task of the asyncio loop running in this thread, if one is; True if one was."""
    asyncio = sys.modules.get("asyncio")
    if asyncio is None or not hasattr(asyncio, "all_tasks"):  # not imported, or the signal came while it was
        return False
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.call_soon_threadsafe(lambda: None)  # wake the selector: the cancellations run at once
    return True


_guard = Guard()


def install() -> Guard:
    """Install the process's :class:`Guard` (once, from the main thread) and return it."""
    _guard.install()
    return _guard


def guard() -> Guard:
    """The process's :class:`Guard`."""
    return _guard


def raise_pending() -> None:
    """:meth:`Guard.raise_pending` of the process's guard: called after an asyncio loop returns."""
    _guard.raise_pending()


def deferred() -> contextlib.AbstractContextManager[None]:
    """:meth:`Guard.deferred` of the process's guard (around imports)."""
    return _guard.deferred()
