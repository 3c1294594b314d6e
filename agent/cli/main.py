"""``nftpolicy``'s :func:`main`: runs one command of :mod:`nftpolicy.agent.cli.commands` (imported
when it runs, so a command loads only what it uses) and turns its errors into one line and an
exit code (:data:`~nftpolicy.agent.cli.flags.EXIT_CODES`)."""

from __future__ import annotations

import importlib
import os
import sys

from nftpolicy.translators.errors import OneLineError

from nftpolicy.agent import interrupts
from .flags import parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``nftpolicy`` command; returns its exit code (:data:`EXIT_CODES`). Every mistake
    the user can make ends as one ``nftpolicy: ...`` line on stderr; a SIGINT or SIGTERM that
    :mod:`nftpolicy.agent.interrupts` handled ends it with that signal's line and code, however
    the command unwound."""
    args = parser().parse_args(argv)
    guard = interrupts.guard()
    try:
        with interrupts.deferred():  # see interrupts.Guard.deferred
            command = importlib.import_module(f"nftpolicy.agent.cli.commands.{args.command}")
        code = int(getattr(command, f"cmd_{args.command}")(args))
    except KeyboardInterrupt:
        code = 130
        if guard.signum is None:  # Ctrl-C without the guard (main() called in-process)
            print("nftpolicy: interrupted", file=sys.stderr)
    except BrokenPipeError:
        # The reader (``| head``) has gone: end quietly, and keep the interpreter's final flush
        # of stdout from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    except (FileNotFoundError, OneLineError) as exc:
        if guard.signum is None:  # else an effect of the interrupt: its line says it all
            print(f"nftpolicy: {exc}", file=sys.stderr)
        code = 2
    except Exception:
        if guard.signum is None:
            raise
        code = guard.code  # an effect of the interrupt on the way out: no traceback
    if guard.signum is not None:
        guard.announce()
        return guard.code
    return code
