"""The ``nftpolicy`` command line: :func:`run` is the command and the ``kubectl-nftpolicy``
plugin (``nftpolicy`` beside this file is their launcher, ``kubectl-nftpolicy`` a symlink to
it), :mod:`.main` runs one command, :mod:`.kubectl` is the plugin, :mod:`.flags` parses, :mod:`.commands` holds one
module per subcommand. This module imports only :mod:`nftpolicy.agent.interrupts`, so that the
signal handlers are in place before any heavy import."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys

from nftpolicy.agent import interrupts


def run(plugin: bool = False) -> None:
    """The ``nftpolicy`` command, or with ``plugin`` the ``kubectl nftpolicy`` plugin (the Python
    part of their launcher, ``agent/cli/nftpolicy``, which passes ``plugin`` when it was started
    as ``kubectl-nftpolicy``): install the guard and unblock the signals (one that came while
    Python started is raised once the command line's imports are done), run
    :func:`nftpolicy.agent.cli.main.main` (or :func:`nftpolicy.agent.cli.kubectl.main`), remove
    any leftover that an interrupt cut short, exit with the command's code (or the signal's)."""
    guard = interrupts.guard()
    try:
        with interrupts.deferred():  # a signal from the handlers on waits for the end of the imports
            guard.prog = "kubectl nftpolicy" if plugin else "nftpolicy"
            interrupts.install()
            # The launcher started the interpreter with both signals blocked: one that came
            # while Python started is delivered now, to the guard.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, set(interrupts.MESSAGES))
            if plugin:
                from .kubectl import main
            else:
                from .main import main
        code = main()
    except KeyboardInterrupt:  # the guard's, raised before main() could catch it, or Python's own
        code = 130
        if guard.signum is None:  # Python's: the command was started without the launcher
            guard.signum = signal.SIGINT
    except SystemExit as exc:  # a command's own exit (SystemExit(2) for --strict): leftovers still go
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    if guard.signum is not None:
        guard.announce()
    guard.finished = True  # a signal from now on exits at once, with its code
    interrupts.clean_leftovers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader that went away was main()'s to report
            stream.flush()
    logging.shutdown()
    # Not sys.exit(): the interpreter's finalization puts the default handlers back, and a signal
    # then would end the process without its code. Nothing is left to do but leave.
    guard.exit(guard.code or code)
