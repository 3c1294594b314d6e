"""``kubectl nftpolicy``, the kubectl plugin (the script ``kubectl-nftpolicy``: ``nftpolicy``'s
launcher under that name, see :func:`nftpolicy.agent.cli.run`; krew manifest
``plugins/krew/nftpolicy.yaml``): ``explain``, ``status`` and ``trace`` against the live cluster
of the current kubeconfig context (``--kubeconfig``, ``--context`` as kubectl's own), with the
user's own RBAC.

* ``explain SRC DST[:PORT/PROTO]``: :mod:`.explain`, ``nftpolicy explain`` on the listed objects;
* ``status``: :mod:`.status`, every node's agent through the pod proxy;
* ``trace SRC DST[:PORT/PROTO]``: :mod:`.trace`, ``nftpolicy trace`` in the deciding nodes' agents.

Every failure is one ``kubectl nftpolicy: ...`` line on stderr and exit 2: a flag, a refusal
(naming the verb and the resource to ask for), an API server that does not answer.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import version
from typing import Any, NoReturn

from nftpolicy.translators.errors import OneLineError

from nftpolicy.agent import interrupts
from nftpolicy.agent.cli.flags import Parser, _seconds, add_config_arguments, add_input_arguments

PROG = "kubectl nftpolicy"
# The chart's selector labels of the agent pods (charts/nftpolicy/templates/_helpers.tpl).
AGENT_SELECTOR = "app.kubernetes.io/name=nftpolicy,app.kubernetes.io/component=agent"


class PluginParser(Parser):
    """:class:`~nftpolicy.agent.cli.flags.Parser` whose one-line errors name ``kubectl nftpolicy``."""

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message.replace("nftpolicy: ", f"{PROG}: ", 1) if message.startswith("nftpolicy: ") else message)
        raise SystemExit(status)


class _Version(argparse.Action):
    """``--version``: the package's version, looked up only when asked (the lookup scans every
    installed distribution: a third of a plugin call)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{PROG} {version('nftpolicy')}")
        parser.exit()


def parser() -> argparse.ArgumentParser:
    """The plugin's flags: kubectl's connection flags, then one subcommand each."""
    top = PluginParser(prog=PROG, description="nftpolicy on the live cluster: explain a connection, the agents' status, trace a packet.",
                       epilog="exit codes: 0 allowed / every agent ready / the traced packet passed; "
                              "1 denied / an agent not ready / the traced packet refused or never seen; "
                              "2 a flag, a refusal (RBAC) or no API server; 3 explain left objects out (--accept-skipped); "
                              "130 interrupted (SIGINT), 143 terminated (SIGTERM)")
    top.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    connection = PluginParser(add_help=False)
    connection.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")
    connection.add_argument("--context", help="kubeconfig context (default: the current one)")
    connection.add_argument("--request-timeout", type=_seconds(0, inclusive=False), default=30.0,
                            help="seconds of one API request (default %(default)s)")
    agents = PluginParser(add_help=False)
    agents.add_argument("-n", "--namespace", help="the agents' namespace (default: every namespace)")
    agents.add_argument("-l", "--selector", default=AGENT_SELECTOR,
                        help="label selector of the agent pods (default: the chart's, %(default)s)")
    sub = top.add_subparsers(dest="command", required=True, parser_class=PluginParser)

    explain = sub.add_parser("explain", parents=[connection], help="why traffic from SRC to DST is allowed or denied, from the live objects")
    explain.add_argument("source", metavar="SRC", help="NS/POD (a unique name prefix will do) or an address")
    explain.add_argument("destination", metavar="DST[:PORT/PROTO]",
                         help="NS/POD, svc/NS/NAME (its pods and target ports) or an address ([ADDR]:PORT for IPv6), "
                              "optionally with :5432/TCP, :53/UDP, :8080 or :NAME")
    explain.add_argument("--port", action="append", metavar="[PROTO/]PORT", help="more ports, as nftpolicy explain --port takes them (repeatable)")
    explain.add_argument("-o", "--output", choices=("text", "json"), default="text", help="plain lines, or JSON (default %(default)s)")
    explain.add_argument("--ipv6", action="store_true", help="ask over IPv6 where both ends have both families (default: IPv4 first)")
    add_input_arguments(explain)
    add_config_arguments(explain, table=False)

    status = sub.add_parser("status", parents=[connection, agents], help="every node's agent: ready, last sync, generation, table, drops, version")
    status.add_argument("-o", "--output", choices=("text", "json"), default="text", help="a table, or JSON (default %(default)s)")

    trace = sub.add_parser("trace", parents=[connection, agents], help="follow one real packet in the agents of the nodes that decide")
    trace.add_argument("source", metavar="SRC", help="NS/POD or an address")
    trace.add_argument("destination", metavar="DST[:PORT/PROTO]", help="NS/POD or an address, optionally with :8080/TCP (default: as nftpolicy trace)")
    trace.add_argument("--port", metavar="[PROTO/]PORT", help="the port, when DST has none")
    trace.add_argument("--node", action="append", help="trace on this node (repeatable; default: the nodes of the two pods)")
    trace.add_argument("--timeout", type=_seconds(0, inclusive=False), default=30.0, help="seconds to wait for the packet (default %(default)s)")
    return top


def main(argv: list[str] | None = None) -> int:
    """Run one plugin command; returns its exit code. Every failure is one line (exit 2); a SIGINT
    or SIGTERM that :mod:`nftpolicy.agent.interrupts` handled ends it with that signal's line and
    code (130, 143)."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    guard = interrupts.guard()
    try:
        with interrupts.deferred():  # see interrupts.Guard.deferred
            from .api import Api  # after the flags: --help needs no Kubernetes client
            command = importlib.import_module(f"{__name__}.{args.command}")
        api = Api(args.kubeconfig, args.context, args.request_timeout)
        code = int(getattr(command, f"cmd_{args.command}")(api, args))
    except OneLineError as exc:
        if guard.signum is None:  # else an effect of the interrupt: its line says it all
            print(f"{PROG}: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
        if guard.signum is None:  # Ctrl-C without the guard (main() called in-process)
            print(f"{PROG}: interrupted", file=sys.stderr)
    except BrokenPipeError:
        code = 141
    if guard.signum is not None:
        guard.announce()
        return guard.code
    return code
