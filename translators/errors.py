"""The one base class of every error a command reports as one line (``nftpolicy: <message>``,
exit 2; see :func:`nftpolicy.agent.cli.main.main`): bad input, a refused batch, a missing tool.
It lives with the pure translators so that both they and the agent can derive from it, and the
command line catches it without importing the modules that raise it."""


class OneLineError(Exception):
    """An error whose message, on one line, tells the user what to do; no traceback."""
