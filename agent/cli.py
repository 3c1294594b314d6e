"""The ``nftpolicy`` command line: ``render``, ``sandbox``, ``compare`` and the node agent."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import re
import signal
import sys
import threading
import time
from importlib.metadata import version

from pathlib import Path

import yaml

from nftpolicy.translators import iptables as iptables_render
from nftpolicy.translators import nft, nfttext
from nftpolicy.translators.kuberouter import DumpError, select
from nftpolicy.translators.cases import Case, CaseError, format_matrix, is_case, parse_case
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import Config, RuleModel

from nftpolicy.translators.manifests import ManifestError, build_cluster, load_yaml_documents
from nftpolicy.translators.model import Cluster, Family

from .compare import compare, explain, format_report
from .controlplane import ControlPlane, ControlPlaneError, find_binary
from .manifests import load_cluster, manifest_files, read_objects
from .netns import NetnsError
from .dataplane import DataplaneError
from .nftables import NftDataplane
from .ops import gc_paused
from .probes import ProbeSpec
from .replay import Disagreement, disagreements, replay_twins, start_daemons
from .sandbox import Sandbox, SandboxError


ENV_PREFIX = "NFTPOLICY_"


class UsageError(ValueError):
    """Flags that parse one by one but do not fit together."""


def env_name(flag: str) -> str:
    """The environment variable that sets ``--flag``: ``NFTPOLICY_`` + upper-case, ``-`` -> ``_``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


class EnvDefaults(argparse.ArgumentParser):
    """An ArgumentParser whose options take their default from ``NFTPOLICY_<FLAG>`` when set
    (so every flag can be given by the Helm chart as an environment variable). Repeatable flags
    read a comma-separated list; boolean flags read ``true``/``false``."""

    def add_argument(self, *names, **kwargs):  # type: ignore[override]
        flag = next((n for n in names if n.startswith("--")), None)
        if flag and flag not in ("--help", "--version"):
            env = env_name(flag)
            kwargs["help"] = (kwargs.get("help") or "") + f" [env {env}]"
            if env in os.environ:
                raw = os.environ[env]
                convert = kwargs.get("type") or str
                if kwargs.get("action") == "append":
                    kwargs["default"] = [convert(v) for v in raw.split(",") if v]
                elif kwargs.get("action") == "store_true":
                    kwargs["default"] = raw.lower() in ("1", "true", "yes")
                else:
                    kwargs["default"] = convert(raw)
                kwargs.pop("required", None)
        return super().add_argument(*names, **kwargs)


def _port_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        first, last = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port range {text!r} (expected LOW-HIGH)") from None
    if not 1 <= first <= last <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port range {text!r}")
    return first, last


def _cidr(text: str) -> str:
    try:
        return str(ipaddress.ip_network(text, strict=False)) if "/" in text and "%" not in text else _bad_cidr(text)
    except ValueError:
        return _bad_cidr(text)


def _bad_cidr(text: str) -> str:
    raise argparse.ArgumentTypeError(f"invalid CIDR {text!r} (expected ADDRESS/PREFIX)")


def _seconds(minimum: float, inclusive: bool = True):
    """An argparse type: a number of seconds >= minimum (> minimum when not inclusive)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
        if value < minimum or (not inclusive and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {minimum:g} seconds, got {text}")
        return value
    return parse


def _table(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,63}", text):
        raise argparse.ArgumentTypeError(f"invalid table name {text!r} (a letter, then letters, digits, '-' or '_')")
    return text


def _mark(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid mark {text!r}") from None
    if value <= 0 or value & (value - 1) or value > 0x80000000:
        raise argparse.ArgumentTypeError(f"a mark must be one bit, got {text}")
    return value


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that shape the ruleset (DESIGN.md section 2); they build a :class:`Config`."""
    defaults = Config()
    parser.add_argument("--table", type=_table, default=defaults.table, help="name of our inet table (default %(default)s)")
    parser.add_argument("--priority", type=lambda t: int(t, 0), default=defaults.priority, help="base chain priority (default %(default)s, nft's 'filter')")
    parser.add_argument("--policy-mark", type=_mark, default=defaults.policy_mark, help="mark bit set by an allowing policy (default 0x10000)")
    parser.add_argument("--passed-mark", type=_mark, default=defaults.passed_mark, help="mark bit set on traffic that passed a pod chain (default 0x20000)")
    parser.add_argument("--service-cidr", action="append", type=_cidr, help="service cluster IP range exempted in INPUT (repeatable; default 10.96.0.0/12)")
    parser.add_argument("--node-port-range", type=_port_range, default=defaults.node_port_range, help="node port range exempted in INPUT (default 30000-32767)")
    parser.add_argument("--external-cidr", action="append", type=_cidr, default=[], help="external/load-balancer IP range exempted in INPUT (repeatable)")


def config_from(args: argparse.Namespace) -> Config:
    """Build the :class:`Config` from parsed flags. Raises UsageError when the marks collide."""
    if args.policy_mark == args.passed_mark:
        raise UsageError(f"--policy-mark and --passed-mark must differ (both {args.policy_mark:#x})")
    if Config.pass_mark in (args.policy_mark, args.passed_mark):
        raise UsageError(f"--policy-mark and --passed-mark must differ from the ClusterNetworkPolicy pass mark {Config.pass_mark:#x}")
    return Config(
        table=args.table, priority=args.priority, policy_mark=args.policy_mark, passed_mark=args.passed_mark,
        service_cidrs=tuple(args.service_cidr) if args.service_cidr is not None else Config().service_cidrs,
        node_port_range=args.node_port_range, external_cidrs=tuple(args.external_cidr),
    )


def _report_skipped(errors: list[ManifestError], strict: bool) -> None:
    """One line per object left out; with ``--strict`` any of them ends the command (exit 2)."""
    for error in errors:
        print(f"nftpolicy: skipped {error}", file=sys.stderr)
    if errors and strict:
        raise SystemExit(2)


def _load(args: argparse.Namespace) -> Cluster:
    cluster, errors = load_cluster(args.paths)
    _report_skipped(errors, args.strict)
    return cluster


class Progress:
    """One status line on stderr, rewritten in place, for steps that take a while; only when
    stderr is a terminal (never in logs or pipes). :meth:`done` erases it."""

    def __init__(self) -> None:
        self.shown = sys.stderr.isatty()
        self.started = time.monotonic()

    def step(self, text: str) -> None:
        if self.shown:
            sys.stderr.write(f"\r\033[Knftpolicy: {text} ({time.monotonic() - self.started:.1f} s)")
            sys.stderr.flush()

    def done(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def cmd_render(args: argparse.Namespace) -> int:
    progress = Progress()
    try:
        with gc_paused():  # one bulk load whose objects all live to the end
            progress.step("reading the manifests")
            cluster = _load(args)
            progress.step(f"rendering {len(cluster.pods):,} pods, {len(cluster.policies):,} policies")
            model = build_rule_model(cluster, args.node, config_from(args))
            progress.step("printing")
            _print_model(args.format, model)
    finally:
        progress.done()
    return 0


def _print_model(format: str, model: RuleModel) -> None:
    if format == "iptables":
        sys.stdout.write(iptables_render.to_restore(model, "ipv4"))
    elif format == "ip6tables":
        sys.stdout.write(iptables_render.to_restore(model, "ipv6"))
    elif format == "ipset":
        sys.stdout.write(iptables_render.to_ipset(model))
    else:
        sys.stdout.write(nfttext.to_text(model) if format == "nft" else nft.to_json(model) + "\n")


def _read_cases(paths: list[str]) -> list[Case] | None:
    """The paths as conformance cases in order, or None when they are manifests."""
    documents = []
    for name in manifest_files(paths):
        if name == "-":
            return None
        try:
            docs = load_yaml_documents(Path(name).read_text())
        except yaml.YAMLError:
            return None
        if len(docs) != 1 or not is_case(docs[0]):
            return None
        documents.append(docs[0])
    return [parse_case(d) for d in documents] if documents else None


def _print_matrices(sandbox: Sandbox, results: dict) -> None:
    pods = list(sandbox.pods)
    for (spec, family), matrix in sorted(results.items(), key=lambda kv: (kv[0][0].port, kv[0][0].protocol, kv[0][1])):
        print(f"\n{spec.protocol}/{spec.port} {family}")
        print(format_matrix(pods, matrix))


DATAPLANE_CHOICES = {"nft": ("nft",), "iptables": ("iptables",), "kube-router": ("kube-router",),
                     "both": ("nft", "kube-router"), "nft,iptables": ("nft", "iptables")}


def _dataplanes(args: argparse.Namespace) -> tuple[str, ...]:
    iptables = f"iptables-{args.iptables_loader}"
    return tuple(iptables if d == "iptables" else d for d in DATAPLANE_CHOICES[args.dataplane])


def _print_disagreements(label: str, dataplanes: tuple[str, ...], cells: list[Disagreement], cluster: Cluster) -> int:
    """Print each cell where the twins differ; against kube-router, with the documented
    deliberate difference that explains it (:func:`compare.explain`), if one does."""
    for spec, family, src, dst, a, b in cells:
        why = explain(cluster, spec, src, dst, b, a) if dataplanes[1] == "kube-router" else None
        print(f"DISAGREE {label}{spec.protocol}/{spec.port} {family} {src} -> {dst}: "
              f"{dataplanes[0]} {_verdict(a)}, {dataplanes[1]} {_verdict(b)}" + (f" ({why})" if why else ""))
    return len(cells)


def _verdict(value: bool | None) -> str:
    return "not probed" if value is None else "allowed" if value else "blocked"


def _sandbox_control_plane(args: argparse.Namespace, dataplanes: tuple[str, ...]) -> bool:
    """True when this sandbox run goes through a real API server (asked for, or kube-router)."""
    live = args.control_plane or "kube-router" in dataplanes
    if live and any(d.startswith("iptables") for d in dataplanes):
        raise UsageError("the iptables variant has no agent: --control-plane and kube-router go with nft only")
    if args.kube_router and "kube-router" not in dataplanes:
        raise UsageError("--kube-router needs --dataplane kube-router or both")
    if "kube-router" in dataplanes:
        find_binary("kube-router", args.kube_router)  # before anything starts
    return live


def cmd_sandbox(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C, so the sandbox's namespaces are always removed; an interrupt
    # that Python swallowed (raised inside a __del__ or a weakref callback) stops the next step.
    interrupted = threading.Event()

    def interrupt(signum: int, _frame: object) -> None:
        interrupted.set()
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(143)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    cases = _read_cases(args.paths)
    families = ("ipv4", "ipv6") if args.dual_stack else ("ipv6",) if args.ipv6 else ("ipv4",)
    nodes = args.node or ["node1"]
    config = config_from(args)
    dataplanes = _dataplanes(args)
    live = _sandbox_control_plane(args, dataplanes)
    with contextlib.ExitStack() as stack:
        control_plane = stack.enter_context(ControlPlane()) if live else None
        if cases is None:
            return _sandbox_manifests(args, stack, control_plane, nodes, families, config, dataplanes)
        return _sandbox_cases(args, cases, control_plane, nodes, families, config, dataplanes, interrupted)


def _sandbox_manifests(args: argparse.Namespace, stack: contextlib.ExitStack, control_plane: ControlPlane | None,
                       nodes: list[str], families: tuple[Family, ...], config: Config, dataplanes: tuple[str, ...]) -> int:
    objects, unreadable = read_objects(args.paths)
    cluster, invalid = build_cluster(objects)
    _report_skipped(unreadable + ([] if control_plane else invalid), args.strict)
    node_addresses = {n.name: n.addresses for n in cluster.nodes.values()}
    sandboxes = [stack.enter_context(Sandbox(cluster.pods.values(), nodes, families, node_addresses, config, args.timeout, d))
                 for d in dataplanes]
    if control_plane is None:
        for sandbox in sandboxes:
            sandbox.apply(cluster)
    else:
        _report_skipped(sandboxes[0].publish(control_plane, objects), args.strict)
        for daemon in start_daemons(stack, sandboxes, control_plane, args.kube_router):
            daemon.wait_synced()
    specs = sorted({ProbeSpec(p.port, p.protocol) for pod in sandboxes[0].pods.values() for p in pod.ports},
                   key=lambda s: (s.port, s.protocol))
    results = [sandbox.probe(specs, families) for sandbox in sandboxes]
    for family in families:
        if not any(pod.addresses(family) for pod in sandboxes[0].pods.values()):
            print(f"nothing probed over {family}: no pod has an {family} address (pods keep the addresses "
                  f"their manifests give)", file=sys.stderr)
    if len(dataplanes) > 1:
        print(f"dataplanes: {' and '.join(dataplanes)} (twin sandboxes); matrices of {dataplanes[0]}")
    _print_matrices(sandboxes[0], results[0])
    if len(dataplanes) > 1:
        disagree = _print_disagreements("", dataplanes, disagreements(results[0], results[1]),
                                        sandboxes[0].with_sandbox_pods(cluster))
        print(f"\n{disagree} cells differ between {dataplanes[0]} and {dataplanes[1]}" if disagree
              else f"\n{dataplanes[0]} and {dataplanes[1]} agree on every cell")
        return 1 if disagree else 0
    return 0


def _sandbox_cases(args: argparse.Namespace, cases: list[Case], control_plane: ControlPlane | None, nodes: list[str],
                   families: tuple[Family, ...], config: Config, dataplanes: tuple[str, ...], interrupted: threading.Event) -> int:
    failures = disagree = compared = 0
    with contextlib.closing(replay_twins(cases, nodes, families, config, args.timeout, dataplanes,
                                         control_plane, args.kube_router)) as replayed:  # cleaned up on any exception
        for sandboxes, steps, cells in replayed:
            if interrupted.is_set():
                raise KeyboardInterrupt
            for error in steps[0].errors:
                print(f"nftpolicy: skipped {error}", file=sys.stderr)
            print(f"== {steps[0].case.name}")
            _print_matrices(sandboxes[0], steps[0].results)
            compared += sum(1 for matrix in steps[0].results.values() for src, dst in matrix if src != dst)
            for spec, family in steps[0].not_probed:
                print(f"{spec.protocol}/{spec.port} {family}: not probed (the kernel has no {spec.protocol})")
            for dataplane, step in zip(dataplanes, steps):
                for spec, family, src, dst, want, got in step.differences:
                    failures += 1
                    where = f" ({dataplane})" if len(dataplanes) > 1 else ""
                    print(f"DIFF {step.case.name} {spec.protocol}/{spec.port} {family} {src} -> {dst}: "
                          f"expected {'allowed' if want else 'blocked'}, got {'allowed' if got else 'blocked'}{where}")
            for other in cells:
                disagree += _print_disagreements(f"{steps[0].case.name} ", dataplanes, other, steps[0].cluster)
    print(f"\n{failures} cells differ from the expected matrices" if failures
          else f"\nall {compared} probed cells match the expected matrices" if compared else "\nno cell could be probed")
    if len(dataplanes) > 1:
        print(f"{disagree} cells differ between {dataplanes[0]} and {dataplanes[1]}" if disagree
              else f"{dataplanes[0]} and {dataplanes[1]} agree on every cell")
    return 1 if failures or disagree else 0


def _probe_spec(text: str) -> ProbeSpec:
    protocol, _, port = text.upper().partition("/")
    if not port:
        protocol, port = "TCP", protocol
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r} (expected [TCP|UDP|SCTP/]PORT)") from None
    if protocol not in ("TCP", "UDP", "SCTP") or not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {text!r} (expected [TCP|UDP|SCTP/]PORT)")
    return ProbeSpec(number, protocol)


def cmd_compare(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cluster = _load(args)
    saves = {"ipv4": Path(args.iptables_save).read_text()} if args.iptables_save else {}
    if args.ip6tables_save:
        saves["ipv6"] = Path(args.ip6tables_save).read_text()
    if not saves:
        print("nftpolicy: give --iptables-save and/or --ip6tables-save", file=sys.stderr)
        return 2
    dump = select(saves, Path(args.ipset_save).read_text(), args.ipset_save)
    report = compare(cluster, args.node, dump, config_from(args), args.timeout, args.loader, args.port or (), args.icmp)
    print(format_report(report))
    return 1 if report.differences else 0


def cmd_agent(args: argparse.Namespace) -> int:
    from .daemon import run_agent  # imports the Kubernetes client only for this command

    if not args.node:
        print("nftpolicy: --node (or $NODE_NAME) is required", file=sys.stderr)
        return 2
    if args.kubeconfig and args.manifests:
        print("nftpolicy: --kubeconfig and --manifests exclude each other", file=sys.stderr)
        return 2
    return run_agent(args, config_from(args))


def cmd_cleanup(args: argparse.Namespace) -> int:
    removed = NftDataplane(args.table, args.netns).remove()
    print(f"removed table inet {args.table}" if removed else f"no table inet {args.table}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    top = argparse.ArgumentParser(prog="nftpolicy", description="Kubernetes NetworkPolicy on nftables, in kube-router's chain topology.")
    top.add_argument("--version", action="version", version=f"nftpolicy {version('nftpolicy')}")
    sub = top.add_subparsers(dest="command", required=True, parser_class=EnvDefaults)

    render = sub.add_parser("render", help="print the ruleset for one node's pods")
    render.add_argument("paths", nargs="+", metavar="PATH", help="manifest files or directories, '-' for stdin")
    render.add_argument("--node", help="node whose pods are rendered (default: every pod counts as local)")
    render.add_argument("--format", choices=("nft", "json", "iptables", "ip6tables", "ipset"), default="nft",
                        help="nft -f text, libnftables JSON, or the iptables variant: iptables-restore / ip6tables-restore input "
                             "(the filter table) and ipset restore input (its sets; load them first)")
    render.add_argument("--strict", action="store_true", help="exit 2 when any object is invalid")
    add_config_arguments(render)
    render.set_defaults(func=cmd_render)

    sandbox = sub.add_parser("sandbox", help="build the cluster from network namespaces, enforce, probe every pod pair")
    sandbox.add_argument("paths", nargs="+", metavar="PATH",
                         help="manifests, or conformance case files (several: replayed in order as live steps)")
    sandbox.add_argument("--node", action="append", help="node for pods without spec.nodeName (repeatable: round-robin; default node1)")
    stack = sandbox.add_mutually_exclusive_group()
    stack.add_argument("--dual-stack", action="store_true", help="allocate IPv4 and IPv6 addresses and probe both")
    stack.add_argument("--ipv6", action="store_true", help="allocate IPv6 addresses only")
    sandbox.add_argument("--timeout", type=float, default=1.0, help="seconds per probe (default %(default)s)")
    sandbox.add_argument("--strict", action="store_true", help="exit 2 when any object is invalid")
    sandbox.add_argument("--dataplane", choices=tuple(DATAPLANE_CHOICES), default="nft",
                         help="nft ruleset, the iptables variant, the real kube-router (implies --control-plane), or two in twin "
                              "sandboxes: both = nft,kube-router; nft,iptables (every disagreeing cell printed, exit 1)")
    sandbox.add_argument("--control-plane", action="store_true",
                         help="run a real etcd and kube-apiserver on loopback, load the cluster into it and enforce with one "
                              "'nftpolicy agent' per node (steps become API updates)")
    sandbox.add_argument("--kube-router", metavar="PATH",
                         help="the kube-router binary for --dataplane kube-router|both (default .tools/bin/kube-router, then $PATH)")
    sandbox.add_argument("--iptables-loader", choices=("nft", "legacy"), default="nft",
                         help="iptables-nft-restore or iptables-legacy-restore for the iptables variant (default %(default)s)")
    add_config_arguments(sandbox)
    sandbox.set_defaults(func=cmd_sandbox)

    cmp = sub.add_parser("compare", help="replay a kube-router node's iptables-save/ipset dump and nftpolicy's ruleset in twin sandboxes, report every difference")
    cmp.add_argument("paths", nargs="+", metavar="MANIFESTS", help="kubectl get pods,namespaces,networkpolicies,nodes -A -o yaml output (files, directories, '-')")
    cmp.add_argument("--node", required=True, help="the node the dump was taken on")
    cmp.add_argument("--iptables-save", metavar="FILE", help="iptables-save output of that node")
    cmp.add_argument("--ip6tables-save", metavar="FILE", help="ip6tables-save output of that node (dual-stack / IPv6)")
    cmp.add_argument("--ipset-save", metavar="FILE", required=True, help="ipset save output of that node")
    cmp.add_argument("--loader", choices=("nft", "legacy"), help="iptables-restore flavour for the dump (default: as its header says, else nft)")
    cmp.add_argument("--port", action="append", type=_probe_spec, metavar="[PROTO/]PORT",
                     help="also probe this port (repeatable; container ports and policy ports are always probed)")
    cmp.add_argument("--icmp", action="store_true", help="also probe ICMP echo (kube-router always allows it: a deliberate difference)")
    cmp.add_argument("--timeout", type=float, default=1.0, help="seconds per probe (default %(default)s)")
    cmp.add_argument("--strict", action="store_true", help="exit 2 when any object is invalid")
    add_config_arguments(cmp)
    cmp.set_defaults(func=cmd_compare)

    agent = sub.add_parser("agent", help="the node agent: reconcile our nftables table from the Kubernetes API (or a manifests directory)")
    agent.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster configuration)")
    agent.add_argument("--manifests", metavar="DIR", help="read the cluster from manifests in DIR, re-read when files change, instead of the API")
    agent.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this node's name (default: $NODE_NAME)")
    agent.add_argument("--min-sync-interval", type=_seconds(0), default=0.2, help="seconds between two syncs; bursts of events within it are coalesced (default %(default)s)")
    agent.add_argument("--resync-interval", type=_seconds(0, inclusive=False), default=300.0, help="seconds between full resyncs of the whole table (default %(default)s)")
    agent.add_argument("--api-timeout", type=_seconds(0, inclusive=False), default=10.0, help="client-side timeout of one API request, seconds (default %(default)s)")
    agent.add_argument("--watch-timeout", type=lambda t: int(_seconds(1)(t)), default=300, help="server-side timeoutSeconds of one watch, seconds (default %(default)s)")
    agent.add_argument("--http-address", default="0.0.0.0:9476", help="address of /healthz, /readyz and /metrics (default %(default)s)")
    agent.add_argument("--log-format", choices=("text", "json"), default="text", help="log line format (default %(default)s)")
    agent.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info", help="(default %(default)s)")
    agent.add_argument("--netns", help="apply the ruleset inside this named network namespace (testing; default: the agent's own)")
    add_config_arguments(agent)
    agent.set_defaults(func=cmd_agent)

    cleanup = sub.add_parser("cleanup", help="remove our table (and nothing else)")
    cleanup.add_argument("--table", type=_table, default=Config().table, help="name of our inet table (default %(default)s)")
    cleanup.add_argument("--netns", help="inside this named network namespace (default: the current one)")
    cleanup.set_defaults(func=cmd_cleanup)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("nftpolicy: interrupted", file=sys.stderr)
        return 130
    except (FileNotFoundError, CaseError, DataplaneError, SandboxError, DumpError, NetnsError, UsageError,
            ControlPlaneError, iptables_render.Unsupported) as exc:
        print(f"nftpolicy: {exc}", file=sys.stderr)
        return 2


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
