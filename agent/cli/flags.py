"""The ``nftpolicy`` command line's flags: their types, their ``NFTPOLICY_*`` environment
variables, the parser of every subcommand (:func:`parser`) and the helpers the commands share
(:func:`config_from`, :func:`check_exists`)."""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import itertools
import math
import os
import re
import sys
from importlib.metadata import version
from typing import Any, Callable, NoReturn, Sequence

from nftpolicy.translators.layout import HOLD_QUEUE_PRIORITY
from nftpolicy.translators.objectcost import ObjectLimits
from nftpolicy.translators.rules import DENY_ACTIONS, UNKNOWN_PODS, Config

from nftpolicy.translators.errors import OneLineError
from nftpolicy.agent.daemon.podhold import DEFAULT_MAX_HELD
from nftpolicy.agent.dataplane.netns import NETNS_DIR, RUN_TAG_ENV


ENV_PREFIX = "NFTPOLICY_"


class UsageError(OneLineError, ValueError):
    """Flags that parse one by one but do not fit together."""


def env_name(flag: str) -> str:
    """The environment variable that sets ``--flag``: ``NFTPOLICY_`` + upper-case, ``-`` -> ``_``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


# NFTPOLICY_* variables of the project that are not flags: the sandbox's run tag.
NOT_FLAGS = frozenset({RUN_TAG_ENV})


class _FromEnvironment(list[Any]):
    """The list a repeatable flag got from its variable: the first use on the command line replaces it."""


class _Append(argparse._AppendAction):
    """``action="append"``, where the command line replaces a list from the environment."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if isinstance(getattr(namespace, self.dest, None), _FromEnvironment):
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes are one line on stderr and exit 2. With
    ``environment=True`` (the agent's: the Helm chart gives every setting as an environment
    variable, and no other command reads them, so that a variable set for the agent never changes
    what ``render`` or ``trace`` do) its options take their default from ``NFTPOLICY_<FLAG>`` when
    it is set. Repeatable flags read a comma-separated list. A bad environment value is refused
    as a bad flag is, naming the variable:
    ``nftpolicy: --min-sync-interval: must be >= 0 seconds, got -1 (from NFTPOLICY_MIN_SYNC_INTERVAL)``;
    so is a variable that names no flag (``NFTPOLICY_LOG_FORMT``), but the project's own
    :data:`NOT_FLAGS` and ``NFTPOLICY_CI_*`` (the tests' settings). The environment is read when
    the arguments are parsed; a flag on the command line wins."""

    def __init__(self, *args: Any, environment: bool = False, **kwargs: Any) -> None:
        # No abbreviated flags: `explain --node node1` was read as --node-port-range.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.environment = environment
        self.register("action", "append", _Append)

    def error(self, message: str) -> NoReturn:  # argparse's "usage: ..." block, then the message
        message = re.sub(r"^argument ([^:]*?)(/\S+)?: ", r"\1: ", message)  # "argument --x/-x: " -> "--x: "
        flag_named = message.startswith("-")
        hint = "" if flag_named else f" (see '{self.prog} --help')"
        self.exit(2, f"nftpolicy: {message}{hint}\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: None = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # named with the command's own --help
            command = getattr(parsed, "command", None)
            self.prog = f"{self.prog} {command}" if command else self.prog
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: None = None) -> tuple[argparse.Namespace, list[str]]:
        if not self.environment:
            return super().parse_known_args(args, namespace)
        given = list(sys.argv[1:] if args is None else args)
        flags = {env_name(f) for a in self._actions for f in a.option_strings if f.startswith("--")}
        for name in sorted(os.environ):
            if name.startswith(ENV_PREFIX) and name not in flags | NOT_FLAGS and not name.startswith(ENV_PREFIX + "CI_"):
                near = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), sorted(f.removeprefix(ENV_PREFIX) for f in flags), 1)
                self.error(f"{name}: no such setting of {self.prog}" + (f" (did you mean {ENV_PREFIX}{near[0]}?)" if near else ""))
        for action in self._actions:
            flag = next((o for o in action.option_strings if o.startswith("--")), None)
            if flag is None or action.dest in ("help", "version"):
                continue
            env = env_name(flag)
            if action.help is not argparse.SUPPRESS and f"[env {env}]" not in (action.help or ""):
                action.help = (action.help or "") + f" [env {env}]"
            on_command_line = any(word == flag or word.startswith(flag + "=") for word in given)
            if env in os.environ and not on_command_line:  # the flag wins, also over a bad variable
                action.default = self._from_env(action, flag, env, os.environ[env])
                action.required = False
        return super().parse_known_args(args, namespace)

    def _from_env(self, action: argparse.Action, flag: str, env: str, raw: str) -> Any:
        """The value of ``flag`` given as ``raw`` in variable ``env``; a bad one ends the command."""
        try:
            values = [v.strip() for v in raw.split(",") if v.strip()] if isinstance(action, argparse._AppendAction) else [raw]
            converted = []
            for value in values:
                if action.choices is not None and value not in action.choices:
                    raise argparse.ArgumentTypeError(
                        f"invalid choice: {value!r} (choose from {', '.join(map(repr, action.choices))})")
                converted.append(action.type(value) if callable(action.type) else value)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            self.error(f"{flag}: {exc} (from {env})")
        return _FromEnvironment(converted) if isinstance(action, argparse._AppendAction) else converted[0]


def _port_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        first, last = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port range {text!r} (expected LOW-HIGH)") from None
    if not 1 <= first <= last <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port range {text!r} (expected LOW-HIGH, 1 <= LOW <= HIGH <= 65535)")
    return first, last


def _cidr(text: str) -> str:
    try:
        return str(ipaddress.ip_network(text, strict=False)) if "/" in text and "%" not in text else _bad_cidr(text)
    except ValueError:
        return _bad_cidr(text)


def _bad_cidr(text: str) -> str:
    raise argparse.ArgumentTypeError(f"invalid CIDR {text!r} (expected ADDRESS/PREFIX)")


def _resolvers(text: str) -> tuple[str, ...] | None:
    """The resolvers ``--dns-learn-from`` trusts: comma-separated addresses (each its /32 or
    /128) or CIDRs, normalised; or ``any`` (None)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if items == ["any"]:
        return None
    if "any" in items:
        raise argparse.ArgumentTypeError(f"'any' with resolvers ({', '.join(i for i in items if i != 'any')}): give one or the other")
    if not items:
        raise argparse.ArgumentTypeError("no resolver (expected addresses or CIDRs, comma-separated, or 'any')")
    networks = []
    for item in items:
        try:
            networks.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid resolver {item!r} (expected an address, a CIDR or 'any')") from None
    return tuple(networks)


def _seconds(minimum: float, inclusive: bool = True) -> Callable[[str], float]:
    """An argparse type: a number of seconds >= minimum (> minimum when not inclusive)."""
    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
        if not math.isfinite(value) or value < minimum or (not inclusive and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {minimum:g} seconds, got {text}")
        return value
    return seconds


def _whole_seconds(text: str) -> int:
    """A whole number of seconds, at least 1 (the API's ``timeoutSeconds``)."""
    value = _seconds(1)(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole number of seconds, got {text}")
    return int(value)


def _count(minimum: int, maximum: int) -> Callable[[str], int]:
    """A whole number from ``minimum`` to ``maximum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number {minimum}-{maximum}, got {text}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be a whole number {minimum}-{maximum}, got {text}")
        return value
    return parse


LOWEST_PRIORITY = -2**31  # a base chain's priority is a signed 32-bit integer


def _priority(text: str) -> int:
    """A base chain priority: a signed 32-bit integer (decimal or 0x...)."""
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid priority {text!r} (expected an integer)") from None
    if not LOWEST_PRIORITY <= value < 2**31:
        raise argparse.ArgumentTypeError(f"must be a signed 32-bit integer, got {text}")
    return value


def _node(text: str) -> str:
    """A node name: a lower-case RFC 1123 subdomain, as the API server validates Node names."""
    if not re.fullmatch(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", text):
        raise argparse.ArgumentTypeError(f"invalid node name {text!r} (a lower-case RFC 1123 name, as Node objects have)")
    return text


def _table(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,63}", text):
        raise argparse.ArgumentTypeError(f"invalid table name {text!r} (a letter, then letters, digits, '-' or '_')")
    return text


def _mark(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid mark {text!r} (expected one bit, as 0x... or a decimal number)") from None
    if value <= 0 or value & (value - 1) or value > 0x80000000:
        raise argparse.ArgumentTypeError(f"a mark must be one bit of 32, got {text}")
    return value


_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def _http_address(text: str) -> str:
    """``HOST:PORT``: HOST an IPv4 address, ``[IPv6]``, a host name or empty (every address),
    PORT 0 to 65535 (0: any free port)."""
    host, colon, port = text.rpartition(":")
    expected = "expected HOST:PORT, HOST an IPv4 address, [IPv6 address], a name or empty"
    if not colon or not port.isdigit():
        raise argparse.ArgumentTypeError(f"invalid address {text!r} ({expected})")
    if int(port) > 65535:
        raise argparse.ArgumentTypeError(f"invalid port {port} in {text!r} (0 to 65535)")
    if host.startswith("["):
        try:
            if not host.endswith("]") or ipaddress.ip_address(host[1:-1]).version != 6:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid IPv6 address {host} in {text!r} ({expected})") from None
    elif host and not _HOST_NAME.fullmatch(host):
        raise argparse.ArgumentTypeError(f"invalid host {host!r} in {text!r} ({expected})")
    elif host and re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid IPv4 address {host!r} in {text!r}") from None
    return text


# The agent's /debug/model: a Unix socket (mode 0600) only the agent's container reaches.
DEFAULT_DEBUG_ADDRESS = "unix:/run/nftpolicy/debug.sock"
UNIX_PREFIX = "unix:"


def _debug_address(text: str) -> str:
    """``unix:PATH`` (an absolute path), :func:`_http_address`, or ``''``: no debug endpoint."""
    if text.startswith(UNIX_PREFIX):
        path = text[len(UNIX_PREFIX):]
        # sun_path holds 108 bytes with its terminating NUL (unix(7))
        if not path.startswith("/") or len(path.encode()) > 107 or "\0" in path:
            raise argparse.ArgumentTypeError(f"invalid Unix socket {text!r} (expected unix:/ABSOLUTE/PATH, at most 107 bytes)")
        return text
    return text and _http_address(text)


def _boolean(text: str) -> bool:
    """``true`` or ``false`` (any case), as Kubernetes components' boolean flags take them."""
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")
    return text.lower() == "true"


def check_exists(flag: str, value: str | None) -> None:
    """Raise UsageError when the file (``--kubeconfig``, ``--tls-*-file``), directory (``--manifests``) or named
    network namespace (``--netns``) given to ``flag`` is not there (checked when the command
    runs, not when it parses: the chart's paths exist only in its container)."""
    if not value:
        return
    what, exists = {"--kubeconfig": ("no such file", os.path.isfile), "--manifests": ("no such directory", os.path.isdir),
                    "--tls-cert-file": ("no such file", os.path.isfile), "--tls-private-key-file": ("no such file", os.path.isfile),
                    "--netns": ("no such network namespace (see 'ip netns list')",
                                lambda name: "/" not in name and os.path.exists(os.path.join(NETNS_DIR, name)))}[flag]
    if not exists(value):
        env = env_name(flag)
        raise UsageError(f"{flag}: {what}: {value}" + (f" (from {env})" if os.environ.get(env) == value else ""))


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """``--strict`` and ``--accept-skipped``: what a command that reads manifests does with
    input it left out (see :func:`nftpolicy.agent.cli.commands.finish`)."""
    parser.add_argument("--strict", action="store_true", help="exit 2 at once when any object is invalid or the input draws a warning")
    parser.add_argument("--accept-skipped", action="store_true",
                        help="exit as if nothing was skipped when objects, documents or files were left out or no object was found "
                             "(default: a summary line and exit 3)")


def add_config_arguments(parser: argparse.ArgumentParser, table: bool = True, unknown: bool = False) -> None:
    """Flags that shape the ruleset (DESIGN.md section 2); they build a :class:`Config`.
    ``table=False``: only the deny action and the exemptions (service, node-port and external
    ranges), for a command whose answer the table's name, priority and marks do not change
    (``explain``); ``unknown``: also what unknown pods get and the pod CIDRs (``agent``,
    ``explain``, ``trace``: docs/design.md "A new pod from its first packet"), and with ``table``
    the budget of each source towards their hold."""
    defaults = Config()
    if table:
        parser.add_argument("--table", type=_table, default=defaults.table, help="name of our inet table (default %(default)s)")
        parser.add_argument("--priority", type=_priority, default=defaults.priority, help="base chain priority (default %(default)s, nft's 'filter')")
        parser.add_argument("--policy-mark", type=_mark, default=defaults.policy_mark, help="mark bit set by an allowing policy (default 0x10000)")
        parser.add_argument("--passed-mark", type=_mark, default=defaults.passed_mark, help="mark bit set on traffic that passed a pod chain (default 0x20000)")
        parser.add_argument("--pass-mark", type=_mark, default=defaults.pass_mark,
                            help="mark bit a ClusterNetworkPolicy Pass rule sets, cleared before its pod chain ends (default 0x40000)")
    parser.add_argument("--deny-action", choices=DENY_ACTIONS, default=defaults.deny_action,
                        help="what a pod chain does with traffic no NetworkPolicy allowed: reject (a TCP reset, else ICMP port "
                             "unreachable: the client fails at once, as with kube-router) or drop (the client times out); "
                             "a ClusterNetworkPolicy Deny always drops (default %(default)s)")
    if unknown:
        parser.add_argument("--unknown-pods", choices=UNKNOWN_PODS, default="hold",
                            help="a packet from or to an address of the node's pod CIDRs that is no pod programmed yet (a new pod "
                                 "before its rules): hold it until the pod is programmed, then let its rules decide, dropping it after "
                                 "--unknown-pod-hold (while no agent reads the hold queue it is dropped); drop it at once; or off: let "
                                 "it through as a pod no policy selects (default %(default)s)")
        parser.add_argument("--pod-cidr", action="append", type=_cidr, default=[],
                            help="the node's pod CIDR, for a CNI whose IPAM does not follow Node.spec.podCIDRs (repeatable; "
                                 "default: Node.spec.podCIDRs)")
    if unknown and table:  # the hold's budget shapes the table, not explain's answer
        parser.add_argument("--unknown-pod-rate", type=_count(1, 10**6), default=defaults.unknown_pod_rate,
                            help="packets a second one source address may send towards the hold of unknown pods, after a burst of "
                                 "this plus --unknown-pod-burst; the kernel drops more (counted: "
                                 "nftpolicy_unknown_pod_over_budget_packets_total), so one pod cannot fill the hold's queue for the "
                                 "other new pods (default %(default)s)")
        parser.add_argument("--unknown-pod-burst", type=_count(1, 10**6), default=defaults.unknown_pod_burst,
                            help="the burst above --unknown-pod-rate a source may send towards the hold at once (default %(default)s)")
    parser.add_argument("--service-cidr", action="append", type=_cidr, help="service cluster IP range exempted in INPUT (repeatable; default 10.96.0.0/12)")
    parser.add_argument("--node-port-range", type=_port_range, default=defaults.node_port_range, help="node port range exempted in INPUT (default 30000-32767)")
    parser.add_argument("--external-cidr", action="append", type=_cidr, default=[], help="external/load-balancer IP range exempted in INPUT (repeatable)")


def config_from(args: argparse.Namespace) -> Config:
    """Build the :class:`Config` from parsed flags (the defaults for the flags a command lacks,
    see :func:`add_config_arguments`). Raises UsageError when two marks are the same bit."""
    defaults = Config()
    for name in ("table", "priority", "policy_mark", "passed_mark", "pass_mark", "unknown_pods"):
        if not hasattr(args, name):
            setattr(args, name, getattr(defaults, name))
    marks = {"--policy-mark": args.policy_mark, "--passed-mark": args.passed_mark, "--pass-mark": args.pass_mark}
    if hasattr(args, "dns_hold_mark"):  # the agent's
        marks["--dns-hold-mark"] = args.dns_hold_mark
    if args.unknown_pods != "off":  # the unknown pods' marks are fixed: a mark flag must not take one of them
        marks.update({"the unknown ingress mark": defaults.unknown_ingress_mark, "the unknown egress mark": defaults.unknown_egress_mark,
                      "the released mark": defaults.released_mark})
    for (flag, mark), (other, other_mark) in itertools.combinations(marks.items(), 2):
        if mark == other_mark:
            raise UsageError(f"{flag} and {other} must differ (both {mark:#x})")
    if args.unknown_pods == "hold" and args.priority >= HOLD_QUEUE_PRIORITY:
        raise UsageError(f"--unknown-pods hold: --priority must be below {HOLD_QUEUE_PRIORITY} (iptables-nft's security table, "
                         f"where the hold queues), got {args.priority}")
    return Config(
        table=args.table, priority=args.priority, policy_mark=args.policy_mark, passed_mark=args.passed_mark, pass_mark=args.pass_mark,
        service_cidrs=tuple(args.service_cidr) if args.service_cidr is not None else Config().service_cidrs,
        node_port_range=args.node_port_range, external_cidrs=tuple(args.external_cidr), deny_action=args.deny_action,
        unknown_pods=args.unknown_pods, pod_cidrs=tuple(getattr(args, "pod_cidr", ())),
        unknown_pod_rate=getattr(args, "unknown_pod_rate", defaults.unknown_pod_rate),
        unknown_pod_burst=getattr(args, "unknown_pod_burst", defaults.unknown_pod_burst),
    )


DATAPLANE_CHOICES = {"nft": ("nft",), "iptables": ("iptables",), "kube-router": ("kube-router",),
                     "both": ("nft", "kube-router"), "nft,iptables": ("nft", "iptables")}



def _probe_spec(text: str) -> tuple[int, str]:
    """``[PROTO/]PORT`` as (port, protocol); TCP when no protocol is given."""
    protocol, _, port = text.upper().partition("/")
    if not port:
        protocol, port = "TCP", protocol
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r} (expected [TCP|UDP|SCTP/]PORT)") from None
    if protocol not in ("TCP", "UDP", "SCTP") or not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {text!r} (expected [TCP|UDP|SCTP/]PORT)")
    return number, protocol



def parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    top = Parser(prog="nftpolicy", description="Kubernetes NetworkPolicy on nftables, in kube-router's chain topology.",
                 epilog=EXIT_CODES)
    top.add_argument("--version", action="version", version=f"nftpolicy {version('nftpolicy')}")
    sub = top.add_subparsers(dest="command", required=True, parser_class=Parser)

    render = sub.add_parser("render", help="print the ruleset for one node's pods")
    render.add_argument("paths", nargs="+", metavar="PATH", help="manifest files or directories, '-' for stdin")
    render.add_argument("--node", type=_node, help="node whose pods are rendered (default: every pod counts as local)")
    render.add_argument("--format", choices=("nft", "json", "iptables", "ip6tables", "ipset"), default="nft",
                        help="nft -f text, libnftables JSON, or the iptables variant: iptables-restore / ip6tables-restore input "
                             "(the filter table) and ipset restore input (its sets; load them first)")
    add_input_arguments(render)
    add_config_arguments(render)

    sandbox = sub.add_parser("sandbox", help="build the cluster from network namespaces, enforce, probe every pod pair")
    sandbox.add_argument("paths", nargs="+", metavar="PATH",
                         help="manifests, or conformance case files (several: replayed in order as live steps)")
    sandbox.add_argument("--node", action="append", type=_node,
                         help="node for pods without spec.nodeName (repeatable: round-robin; default: the manifests' Node objects, else node1)")
    stack = sandbox.add_mutually_exclusive_group()
    stack.add_argument("--dual-stack", action="store_true", help="allocate IPv4 and IPv6 addresses and probe both")
    stack.add_argument("--ipv6", action="store_true", help="allocate IPv6 addresses only")
    sandbox.add_argument("--timeout", type=_seconds(0, inclusive=False), default=1.0, help="seconds per probe (default %(default)s)")
    add_input_arguments(sandbox)
    sandbox.add_argument("--dataplane", choices=tuple(DATAPLANE_CHOICES), default="nft", metavar="|".join(DATAPLANE_CHOICES),
                         help="nft ruleset, the iptables variant, the real kube-router (implies --control-plane), or two in twin "
                              "sandboxes: both = nft,kube-router; nft,iptables (every disagreeing cell printed, exit 1)")
    sandbox.add_argument("--control-plane", action="store_true",
                         help="run a real etcd and kube-apiserver on loopback, load the cluster into it and enforce with one "
                              "'nftpolicy agent' per node (steps become API updates)")
    sandbox.add_argument("--kube-router", metavar="PATH",
                         help="the kube-router binary for --dataplane kube-router|both (default .tools/bin/kube-router, then $PATH)")
    sandbox.add_argument("--iptables-loader", choices=("nft", "legacy"), default="nft",
                         help="iptables-nft-restore or iptables-legacy-restore for the iptables variant (default %(default)s)")
    sandbox.add_argument("--output", choices=("text", "json"), default="text", help="matrices as a compact table with a legend (default) or one JSON object")
    sandbox.add_argument("--report", metavar="FILE.html", help="also write the matrices as a self-contained HTML page")
    add_config_arguments(sandbox)

    cmp = sub.add_parser("compare", help="replay a kube-router node's iptables-save/ipset dump and nftpolicy's ruleset in twin sandboxes, report every difference")
    cmp.add_argument("paths", nargs="+", metavar="MANIFESTS", help="kubectl get pods,namespaces,networkpolicies,nodes -A -o yaml output (files, directories, '-')")
    cmp.add_argument("--node", required=True, type=_node, help="the node the dump was taken on")
    cmp.add_argument("--iptables-save", metavar="FILE", help="iptables-save output of that node")
    cmp.add_argument("--ip6tables-save", metavar="FILE", help="ip6tables-save output of that node (dual-stack / IPv6)")
    cmp.add_argument("--ipset-save", metavar="FILE", required=True, help="ipset save output of that node")
    cmp.add_argument("--loader", choices=("nft", "legacy"), help="iptables-restore flavour for the dump (default: as its header says, else nft)")
    cmp.add_argument("--port", action="append", type=_probe_spec, metavar="[PROTO/]PORT",
                     help="also probe this port (repeatable; container ports and policy ports are always probed)")
    cmp.add_argument("--icmp", action="store_true",
                     help="also probe ICMP echo (kube-router v2.1.0 has no ICMP rule: its policies decide, as ours do; "
                          "where a dump accepts every echo request before its policies, as later kube-router sources do, "
                          "the cells are noted as deliberate)")
    cmp.add_argument("--timeout", type=_seconds(0, inclusive=False), default=1.0, help="seconds per probe (default %(default)s)")
    add_input_arguments(cmp)
    add_config_arguments(cmp)

    agent = sub.add_parser("agent", environment=True, help="the node agent: reconcile our nftables table from the Kubernetes API (or a manifests directory)")
    agent.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster configuration)")
    agent.add_argument("--manifests", metavar="DIR", help="read the cluster from manifests in DIR, re-read when files change, instead of the API")
    agent.add_argument("--node", type=_node, default=os.environ.get("NODE_NAME"), help="this node's name (default: $NODE_NAME)")
    agent.add_argument("--min-sync-interval", type=_seconds(0), default=0.2, help="seconds between two syncs; bursts of events within it are coalesced (default %(default)s)")
    agent.add_argument("--resync-interval", type=_seconds(0, inclusive=False), default=300.0, help="seconds between full resyncs of the whole table (default %(default)s)")
    agent.add_argument("--api-timeout", type=_seconds(0, inclusive=False), default=10.0, help="client-side timeout of one API request, seconds (default %(default)s)")
    agent.add_argument("--watch-timeout", type=_whole_seconds, default=300, help="server-side timeoutSeconds of one watch, seconds (default %(default)s)")
    agent.add_argument("--watch-idle-timeout", type=_seconds(0, inclusive=False), default=130.0,  # sources.WATCH_IDLE_TIMEOUT
                       help="seconds a watch may bring nothing, not even a bookmark (kube-apiserver sends one about every 60 s), "
                            "before it counts as dead (a stuck proxy) and is watched again from its resourceVersion "
                            "(default %(default)s: two bookmark periods and 10 s)")
    agent.add_argument("--http-address", type=_http_address, default="0.0.0.0:9476", help="address of /healthz, /readyz and /metrics (default %(default)s)")
    agent.add_argument("--counters-interval", type=_seconds(1), default=5.0,
                       help="seconds between two reads of the kernel's rule counters, which /metrics serves from the last read "
                            "(one listing of the table each, whatever the number of scrapers; default %(default)s)")
    agent.add_argument("--metrics-secure", type=_boolean, default=False, metavar="true|false",
                       help="serve --http-address over TLS, and /metrics only to a bearer token whose user may get /metrics "
                            "(TokenReview and SubjectAccessReview; needs the API, not --manifests); /healthz and /readyz "
                            "stay open (default false)")
    agent.add_argument("--tls-cert-file", metavar="FILE",
                       help="with --metrics-secure: the PEM certificate (chain) to serve, read again when it changes "
                            "(default: a self-signed one made at start)")
    agent.add_argument("--tls-private-key-file", metavar="FILE", help="with --tls-cert-file: its PEM private key")
    agent.add_argument("--debug-address", type=_debug_address, default=DEFAULT_DEBUG_ADDRESS,
                       help="address of the read-only /debug/model for explain, trace and status --agent, with /healthz, "
                            "/readyz and /metrics, without a token: unix:PATH (a socket of mode 0600) or HOST:PORT (it names "
                            "every pod, label and policy: never a network address; '' turns it off; default %(default)s)")
    agent.add_argument("--max-object-rules", type=_count(1, 10**7), default=ObjectLimits().rules,
                       help="rules one NetworkPolicy or ClusterNetworkPolicy may cost (peer chains included); one beyond is enforced "
                            "fail-closed, with an Event and a metric (default %(default)s)")
    agent.add_argument("--max-object-elements", type=_count(1, 10**8), default=ObjectLimits().elements,
                       help="set elements one policy may cost: the networks of its ipBlocks after their excepts, and the "
                            "addresses of the pods and nodes its peers select, counted on the cluster; one beyond is enforced "
                            "fail-closed, with an Event and a metric (default %(default)s)")
    agent.add_argument("--log-format", choices=("text", "json"), default="text", help="log line format (default %(default)s)")
    agent.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info", help="(default %(default)s)")
    agent.add_argument("--netns", help="apply the ruleset inside this named network namespace (testing; default: the agent's own)")
    agent.add_argument("--dns-hold", choices=("off", "bypass", "fail-closed"), default="bypass",
                       help="domainNames peers: hold DNS answers to pods in an nfqueue until what they teach is committed; while the agent "
                            "does not read it, answers pass unheld (bypass) or are dropped (fail-closed); off: learn nothing, "
                            "domainNames rules match no address (default %(default)s)")
    agent.add_argument("--dns-queue", type=_count(0, 65535), default=5300, help="nfqueue number of the DNS hold (default %(default)s)")
    agent.add_argument("--unknown-pod-hold", type=_seconds(0, inclusive=False), default=2.0,
                       help="seconds a held packet of an unknown pod waits for the pod to be programmed before it is dropped "
                            "(default %(default)s)")
    agent.add_argument("--unknown-pod-queue", type=_count(0, 65535), default=5310,
                       help="nfqueue number of the hold of unknown pods' packets (default %(default)s)")
    agent.add_argument("--unknown-pod-max-held", type=_count(1, 1024), default=DEFAULT_MAX_HELD,
                       help="packets the hold keeps waiting for one unknown pod's address (per direction) at most; more are dropped at once "
                            "(counted: nftpolicy_unknown_pod_packets_total{result=\"over_limit\"}), so the packets of one "
                            "address cannot fill the hold's queue of 1,024 (default %(default)s)")
    agent.add_argument("--dns-ttl-floor", type=_whole_seconds, default=5,
                       help="seconds a learned address stays at least, whatever its record's TTL (default %(default)s)")
    agent.add_argument("--dns-ttl-cap", type=_whole_seconds, default=3600,
                       help="seconds a learned address stays at most, whatever its record's TTL (default %(default)s)")
    agent.add_argument("--dns-max-per-set", type=_count(1, 10**7), default=10000,
                       help="learned addresses one domainNames peer holds at most; more are dropped and counted (default %(default)s)")
    agent.add_argument("--dns-max-per-pod", type=_count(1, 10**7), default=1000,
                       help="learned addresses the answers to one pod add at most; more are dropped and counted (default %(default)s)")
    agent.add_argument("--dns-hold-mark", type=_mark, default=0x800000,
                       help="mark bit our table sets on packets to the subject pods of domainNames peers: the hold queues only "
                            "answers with it (default 0x800000)")
    agent.add_argument("--dns-max-records", type=_count(1, 65535), default=100,
                       help="answer records read of one DNS message; the rest are not read, and teach nothing (default %(default)s)")
    agent.add_argument("--dns-pod-rate", type=_count(1, 10**6), default=200,
                       help="DNS answers a second to one pod that the kernel queues for the hold at most, after a burst of as "
                            "many plus --dns-pod-budget; more pass unheld and unread (default %(default)s)")
    agent.add_argument("--dns-learn-from", type=_resolvers, default="any", metavar="ADDRESS|CIDR,...|any",
                       help="learn domainNames addresses only from the answers to questions a pod sent to these resolvers (the "
                            "address it asked, before DNAT: the cluster DNS Service's IP, a node-local cache's; comma-separated); "
                            "the others pass unheld and unlearned (default any: every server a subject pod can reach, which lets a "
                            "pod that reaches a DNS server of its own add addresses for every policy with the same names)")
    agent.add_argument("--dns-pod-budget", type=_count(1, 1024), default=32,
                       help="DNS answers one pod may have waiting in the hold; more pass at once, unheld and unread (what they teach "
                            "is not learned), so one pod's flood cannot delay other pods' answers (default %(default)s)")
    add_config_arguments(agent, unknown=True)

    cleanup = sub.add_parser("cleanup", help="remove our table and the DNS hold chain (and nothing else)")
    cleanup.add_argument("--table", type=_table, default=Config().table, help="name of our inet table (default %(default)s)")
    cleanup.add_argument("--netns", help="inside this named network namespace (default: the current one)")

    explain = sub.add_parser("explain", help="why traffic from one pod (or address) to another is allowed or denied")
    explain.add_argument("paths", nargs="*", metavar="PATH", help="manifest files or directories, '-' for stdin (not with --agent)")
    explain.add_argument("--from", dest="source", required=True, metavar="NS/POD|CIDR", help="the source pod (a unique name prefix will do) or address")
    explain.add_argument("--to", dest="destination", required=True, metavar="NS/POD|CIDR", help="the destination pod (a unique name prefix will do), a Service's NS/NAME (every pod it selects) or address")
    explain.add_argument("--port", action="append", metavar="[PROTO/]PORT",
                         help="TCP/5432, udp/53, 8080 (TCP), a container port's name (http) or icmp (echo); for a Service, "
                              "one of its ports by number or name; repeatable (default: the destination's container ports, else icmp)")
    explain.add_argument("--agent", metavar="unix:PATH|http://ADDR",
                         help="ask a running agent's debug endpoint (its --debug-address: its node's rules right now) instead of manifests")
    explain.add_argument("--output", choices=("text", "json"), default="text", help="plain lines, or JSON for tools (default %(default)s)")
    explain.add_argument("--ipv6", action="store_true", help="ask over IPv6 where both ends have both families (default: IPv4 first)")
    explain.add_argument("--node", action="append", type=_node, metavar="NAME",
                         help="node for pods without spec.nodeName, as sandbox --node (repeatable: round-robin; default: the "
                              "manifests' Node objects, else node1)")
    add_input_arguments(explain)
    add_config_arguments(explain, table=False, unknown=True)

    status = sub.add_parser("status", help="this node's agent: ready or why not, last sync, generation, table, drops, version")
    status.add_argument("--agent", metavar="unix:PATH|http://ADDR", default=DEFAULT_DEBUG_ADDRESS,
                        help="the agent's debug endpoint (its --debug-address; default %(default)s)")
    status.add_argument("--output", choices=("text", "json"), default="text", help="a table, or JSON (default %(default)s)")

    trace = sub.add_parser("trace", help="follow one real packet through our chains (nftrace), mapped to pods, policies and rules")
    trace.add_argument("paths", nargs="*", metavar="PATH", help="manifests: build them as a sandbox and send the packet (none: wait for it on this node)")
    trace.add_argument("--from", dest="source", required=True, metavar="NS/POD|ADDRESS", help="the source pod (sandbox) or address")
    trace.add_argument("--to", dest="destination", required=True, metavar="NS/POD|ADDRESS", help="the destination pod (sandbox) or address")
    trace.add_argument("--port", metavar="[PROTO/]PORT", help="TCP/8080, udp/53, icmp (default: the destination's first container port, else icmp)")
    trace.add_argument("--node", action="append", type=_node, help="sandbox node for pods without spec.nodeName (repeatable; default node1)")
    trace.add_argument("--netns", help="on a node: trace in this named network namespace (default: the current one)")
    trace.add_argument("--timeout", type=_seconds(0, inclusive=False), default=30.0, help="on a node: seconds to wait for the packet (default %(default)s)")
    trace.add_argument("--agent", metavar="unix:PATH|http://ADDR", help="on a node: name the policy rules from this running agent's debug endpoint (its committed model)")
    add_input_arguments(trace)
    add_config_arguments(trace, unknown=True)
    return top


EXIT_CODES = """exit codes: 0 success; 1 a difference was found (sandbox, compare), a connection is not
allowed (explain), the packet was refused or never seen (trace), the agent is not ready (status), or
the agent cannot run (a missing nftables feature, the HTTP address cannot be bound); 2 bad input: a flag or NFTPOLICY_* variable, a
file that cannot be read, an invalid object with --strict; 3 incomplete input: an object, document
or file was skipped, or no object was found (--accept-skipped: the code it would give otherwise);
130 interrupted (SIGINT), 143 terminated (SIGTERM); 141 the reader of the output went away (| head)"""


