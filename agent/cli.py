"""The ``nftpolicy`` command line: ``render`` and ``sandbox``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from importlib.metadata import version

from pathlib import Path

import yaml

from nftpolicy.translators import nft
from nftpolicy.translators.cases import Case, CaseError, format_matrix, is_case, parse_case
from nftpolicy.translators.rules import Config, build_rule_model

from .manifests import load_cluster, manifest_files
from .nftables import NftError, remove_table
from .sandbox import ProbeSpec, Sandbox, SandboxError, replay


ENV_PREFIX = "NFTPOLICY_"


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


def _mark(text: str) -> int:
    value = int(text, 0)
    if value <= 0 or value & (value - 1) or value > 0x80000000:
        raise argparse.ArgumentTypeError(f"a mark must be one bit, got {text}")
    return value


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that shape the ruleset (DESIGN.md section 2); they build a :class:`Config`."""
    defaults = Config()
    parser.add_argument("--table", default=defaults.table, help="name of our inet table (default %(default)s)")
    parser.add_argument("--priority", type=lambda t: int(t, 0), default=defaults.priority, help="base chain priority (default %(default)s, nft's 'filter')")
    parser.add_argument("--policy-mark", type=_mark, default=defaults.policy_mark, help="mark bit set by an allowing policy (default 0x10000)")
    parser.add_argument("--passed-mark", type=_mark, default=defaults.passed_mark, help="mark bit set on traffic that passed a pod chain (default 0x20000)")
    parser.add_argument("--service-cidr", action="append", help="service cluster IP range exempted in INPUT (repeatable; default 10.96.0.0/12)")
    parser.add_argument("--node-port-range", type=_port_range, default=defaults.node_port_range, help="node port range exempted in INPUT (default 30000-32767)")
    parser.add_argument("--external-cidr", action="append", default=[], help="external/load-balancer IP range exempted in INPUT (repeatable)")


def config_from(args: argparse.Namespace) -> Config:
    """Build the :class:`Config` from parsed flags."""
    return Config(
        table=args.table, priority=args.priority, policy_mark=args.policy_mark, passed_mark=args.passed_mark,
        service_cidrs=tuple(args.service_cidr) if args.service_cidr is not None else Config().service_cidrs,
        node_port_range=args.node_port_range, external_cidrs=tuple(args.external_cidr),
    )


def _load(args: argparse.Namespace):
    cluster, errors = load_cluster(args.paths)
    for error in errors:
        print(f"nftpolicy: skipped {error}", file=sys.stderr)
    if errors and args.strict:
        raise SystemExit(2)
    return cluster


def cmd_render(args: argparse.Namespace) -> int:
    cluster = _load(args)
    model = build_rule_model(cluster, args.node, config_from(args))
    sys.stdout.write(nft.to_text(model) if args.format == "nft" else nft.to_json(model) + "\n")
    return 0


def _read_cases(paths: list[str]) -> list[Case] | None:
    """The paths as conformance cases in order, or None when they are manifests."""
    documents = []
    for name in manifest_files(paths):
        if name == "-":
            return None
        try:
            docs = [d for d in yaml.safe_load_all(Path(name).read_text()) if d is not None]
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


def cmd_sandbox(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C, so the sandbox's namespaces are always removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cases = _read_cases(args.paths)
    families = ("ipv4", "ipv6") if args.dual_stack else ("ipv6",) if args.ipv6 else ("ipv4",)
    nodes = args.node or ["node1"]
    config = config_from(args)
    if cases is None:
        cluster = _load(args)
        node_addresses = {n.name: n.addresses for n in cluster.nodes.values()}
        with Sandbox(cluster.pods.values(), nodes, families, node_addresses, config, args.timeout) as sandbox:
            sandbox.apply(cluster)
            specs = sorted({ProbeSpec(p.port, p.protocol) for pod in sandbox.pods.values() for p in pod.ports},
                           key=lambda s: (s.port, s.protocol))
            _print_matrices(sandbox, sandbox.probe(specs, families))
        return 0
    failures = 0
    for sandbox, step in replay(cases, nodes, families, config, args.timeout):
        for error in step.errors:
            print(f"nftpolicy: skipped {error}", file=sys.stderr)
        print(f"== {step.case.name}")
        _print_matrices(sandbox, step.results)
        for spec, family in step.not_probed:
            print(f"{spec.protocol}/{spec.port} {family}: not probed (the kernel has no {spec.protocol})")
        for spec, family, src, dst, want, got in step.differences:
            failures += 1
            print(f"DIFF {step.case.name} {spec.protocol}/{spec.port} {family} {src} -> {dst}: "
                  f"expected {'allowed' if want else 'blocked'}, got {'allowed' if got else 'blocked'}")
    print(f"\n{failures} cells differ from the expected matrices" if failures else "\nall cells match the expected matrices")
    return 1 if failures else 0


def cmd_agent(args: argparse.Namespace) -> int:
    from .daemon import run_agent  # imports the Kubernetes client only for this command

    if not args.node:
        print("nftpolicy: --node (or $NODE_NAME) is required", file=sys.stderr)
        return 2
    return run_agent(args, config_from(args))


def cmd_cleanup(args: argparse.Namespace) -> int:
    removed = remove_table(args.table, args.netns)
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
    render.add_argument("--format", choices=("nft", "json"), default="nft", help="nft -f text or libnftables JSON")
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
    add_config_arguments(sandbox)
    sandbox.set_defaults(func=cmd_sandbox)

    agent = sub.add_parser("agent", help="the node agent: reconcile our nftables table from the Kubernetes API (or a manifests directory)")
    source = agent.add_mutually_exclusive_group()
    source.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster configuration)")
    source.add_argument("--manifests", metavar="DIR", help="read the cluster from manifests in DIR, re-read when files change, instead of the API")
    agent.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this node's name (default: $NODE_NAME)")
    agent.add_argument("--min-sync-interval", type=float, default=0.2, help="seconds between two syncs; bursts of events within it are coalesced (default %(default)s)")
    agent.add_argument("--resync-interval", type=float, default=300.0, help="seconds between full resyncs of the whole table (default %(default)s)")
    agent.add_argument("--api-timeout", type=float, default=10.0, help="client-side timeout of one API request, seconds (default %(default)s)")
    agent.add_argument("--watch-timeout", type=int, default=300, help="server-side timeoutSeconds of one watch, seconds (default %(default)s)")
    agent.add_argument("--http-address", default="0.0.0.0:9476", help="address of /healthz, /readyz and /metrics (default %(default)s)")
    agent.add_argument("--log-format", choices=("text", "json"), default="text", help="log line format (default %(default)s)")
    agent.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info", help="(default %(default)s)")
    agent.add_argument("--netns", help="apply the ruleset inside this named network namespace (testing; default: the agent's own)")
    add_config_arguments(agent)
    agent.set_defaults(func=cmd_agent)

    cleanup = sub.add_parser("cleanup", help="remove our table (and nothing else)")
    cleanup.add_argument("--table", default=Config().table, help="name of our inet table (default %(default)s)")
    cleanup.add_argument("--netns", help="inside this named network namespace (default: the current one)")
    cleanup.set_defaults(func=cmd_cleanup)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, CaseError, NftError, SandboxError) as exc:
        print(f"nftpolicy: {exc}", file=sys.stderr)
        return 2


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
