"""``nftpolicy trace``: one real packet's path through our chains, mapped to pods, policies and rules.

For the trace, our own table gets one base chain per hook, hooked just before our base chains
(:func:`~nftpolicy.translators.layout.trace_chains`), whose rule sets ``meta nftrace set 1`` on
the chosen connection; libnftables' ``monitor trace`` (:class:`~nftpolicy.agent.dataplane.nftables.TraceMonitor`)
reports the packet's walk, and every event in our table is printed with the comment of the rule
that matched: a policy chain's rule by its policy, direction and rule index, read from the rule
model (:class:`~nftpolicy.translators.rules.RuleOrigin` of the layout rule at that place in its
chain, found by the rule handle the monitor reports), a pod chain's rule by its pod, any other by
its comment (a description only). The trace chains are deleted afterwards, also on an error,
Ctrl-C or SIGTERM (:mod:`nftpolicy.agent.interrupts`).

* With manifests: the cluster is built as a sandbox (:class:`~nftpolicy.agent.testbed.sandbox.Sandbox`),
  and one connection is sent from the ``--from`` pod; each node it crosses is traced.
* Without: on this node (``--netns``: in that namespace), wait up to ``--timeout`` seconds for one
  packet of the connection, given by addresses, through our table; ``--agent`` names the policy
  rules from the model the agent committed (its debug endpoint), else rules show their comments.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from nftpolicy.translators import layout, nft
from nftpolicy.translators.model import family_of
from nftpolicy.translators.rules import ChainOwner, Config, RuleModel, chain_owners
from nftpolicy.translators.verdict import Connection, enforcement_of

from nftpolicy.agent.cli.flags import UsageError, check_exists, config_from
from nftpolicy.agent.dataplane.nftables import NftDataplane, TraceMonitor
from nftpolicy.agent.testbed.probes import ProbeSpec, sctp_supported
from nftpolicy.agent.testbed.sandbox import Sandbox
from . import read_manifests
from .explain import _agent, connections, parse_port

# A monitor event (``trace id <id> inet <table> <chain> <rest>``), and a rule event's rest: the
# monitor prints handles, so both a rule it knows and one it does not end in the rule's handle.
_EVENT = re.compile(r"^trace id (\S+) inet (\S+) (\S+) (.*)$")
_RULE = re.compile(r"^(?:rule .*? # handle |unknown rule handle )(?P<handle>\d+) \(verdict (?P<verdict>[^)]*)\)\s*$")


@dataclass(frozen=True)
class Step:
    """One trace event in our table: ``chain``, what matched (``rule`` comment, or ``policy``
    for a base chain's end) and the verdict."""

    chain: str
    what: str
    verdict: str


@contextlib.contextmanager
def traced(dataplane: NftDataplane, config: Config, conn: Connection) -> Any:
    """Our table with the trace chains for ``conn`` while the body runs, then without them (those
    still there: the agent's full resync replaces the table, trace chains included)."""
    chains = layout.trace_chains(conn.source, conn.destination, conn.protocol, conn.port)
    objects = [o for c in chains for o in nft.chain_json(config.table, config.priority - 1, c)]
    dataplane.run({"nftables": [{"add": o} for o in objects]})
    try:
        yield
    finally:
        listed = {o["chain"]["name"] for o in dataplane.listing(terse=True) if "chain" in o}
        refs = [{"family": "inet", "table": config.table, "name": c.name} for c in chains if c.name in listed]
        if refs:
            dataplane.run({"nftables": [{"flush": {"chain": r}} for r in refs] + [{"delete": {"chain": r}} for r in refs]})


@dataclass(frozen=True)
class Listed:
    """A rule of our table as the kernel lists it: ``chain``, ``comment`` and, when the model
    the table was made from is known, the layout ``rule`` at its place (with its origin)."""

    chain: str
    comment: str
    rule: layout.Rule | None = None


def listed_rules(listing: Iterable[dict[str, Any]], model: RuleModel | None) -> dict[int, Listed]:
    """Rule handle -> :class:`Listed` for the rules of a kernel listing; a chain's rules are
    matched to ``model``'s layout by place, where the chain has as many rules as its layout."""
    chains = {c.name: c.rules for c in layout.table(model).chains} if model is not None else {}
    by_chain: dict[str, list[dict[str, Any]]] = {}
    for item in listing:
        if "rule" in item:
            by_chain.setdefault(item["rule"]["chain"], []).append(item["rule"])
    found = {}
    for chain, rules in by_chain.items():
        decided = chains.get(chain, ())
        for i, rule in enumerate(rules):
            found[int(rule["handle"])] = Listed(chain, rule.get("comment", ""), decided[i] if len(decided) == len(rules) else None)
    return found


def rule_text(listed: Listed | None) -> str:
    """A matched rule in words: a policy rule ``policy <policy> <direction> rule <i> (allows)``
    (from its origin), a pod chain's rule ``pod <comment>``, any other its comment."""
    if listed is None:
        return "a rule"
    origin = listed.rule.origin if listed.rule is not None else None
    if origin is not None and origin.tier is None:
        return f"policy {origin.policy} {origin.direction} rule {origin.index} (allows)"
    if listed.chain.startswith("KUBE-POD-FW-"):
        return f"pod {listed.comment}"
    return listed.comment or "a rule"


def _unmatched(target: str, owners: Mapping[str, ChainOwner]) -> str:
    """The step of a policy chain left without a match (the kernel reports no event for it)."""
    if target == layout.COMMON_CHAIN:
        return "common: not invalid, no essential ICMP"
    owner = owners.get(target)
    if owner is None or owner.policy is None:
        return "policy (unknown here: give --agent): no rule matched"
    return f"policy {owner.policy} {owner.direction}: no rule matched"


def follow(lines: Iterable[str], table: str, rules: Mapping[int, Listed], owners: Mapping[str, ChainOwner]) -> list[Step]:
    """The steps of the first traced packet in ``table`` (our trace chains left out), up to the
    base chain's end or a final verdict. ``rules``: rule handle -> the listed rule
    (:func:`listed_rules`); ``owners``: chain -> what it enforces, to name a policy chain that
    the packet left without a match."""
    steps: list[Step] = []
    first = None
    for line in lines:
        if steps and steps[-1].verdict.startswith("jump KUBE-NWPLCY-") and f" {steps[-1].verdict[5:]} " not in line:
            target = steps[-1].verdict[5:]
            steps.append(Step(target, _unmatched(target, owners), "return"))
        event = _EVENT.match(line)
        if not event or event.group(2) != table or event.group(3) in layout.TRACE_CHAINS:
            continue
        trace_id, chain, rest = event.group(1), event.group(3), event.group(4)
        if first is None:
            first = trace_id
        if trace_id != first or rest.startswith("packet:"):
            continue
        rule = _RULE.match(rest)
        if rule:
            steps.append(Step(chain, rule_text(rules.get(int(rule.group("handle")))), rule.group("verdict")))
            if rule.group("verdict") in ("accept", "drop"):
                break
        elif rest.startswith("policy "):
            steps.append(Step(chain, "end of chain, policy", rest.split()[1]))
            if chain in layout.BASE_CHAINS:
                break
    return steps


def step_text(step: Step) -> str:
    """``  KUBE-NWPLCY-...: policy shop/api-ingress ingress rule 0 (allows) -> return``."""
    return f"  {step.chain}: {step.what} -> {step.verdict}"


def _steps(monitor: TraceMonitor, dataplane: NftDataplane, table: str, timeout: float, model: RuleModel | None) -> list[Step]:
    owners = chain_owners(model) if model is not None else {}
    return follow(monitor.lines(timeout), table, listed_rules(dataplane.listing(), model), owners)


def cmd_trace(args: argparse.Namespace) -> int:
    """Print the path; exit 0 when the packet passed, 1 when it was refused or never seen, 2 on bad input."""
    config = config_from(args)
    if args.paths:
        return _trace_sandbox(args, config)
    return _trace_node(args, config)


def _print(head: str, node: str, steps: list[Step]) -> None:
    print(f"{head}\nnode {node}:" if head else f"node {node}:")
    print("\n".join(step_text(s) for s in steps) if steps else "  (no packet of it in our table here)")


def _trace_sandbox(args: argparse.Namespace, config: Config) -> int:
    read = read_manifests(args, args.node or ["node1"])
    cluster = read.cluster
    families = sorted({family_of(ip) for p in cluster.pods.values() for ip in p.ips}) or ["ipv4"]
    node_addresses = {n.name: n.addresses for n in cluster.nodes.values()}
    with Sandbox(cluster.pods.values(), args.node or ["node1"], families, node_addresses, config) as sandbox:
        cluster = sandbox.with_sandbox_pods(cluster)
        sandbox.apply(cluster)
        engine = enforcement_of(cluster, list(sandbox.nodes), config)
        conn = connections(engine, args.source, args.destination, [args.port] if args.port else [], cluster.pods)[0]
        source, target = engine.pod_at(conn.source), engine.pod_at(conn.destination)
        if source is None or source.key not in sandbox.pods:
            raise UsageError(f"--from {args.source}: the sandbox sends from a pod; give one")
        if conn.protocol == "SCTP" and not sctp_supported():
            raise UsageError(f"--port {args.port or conn.text().lower()}: this kernel has no SCTP, so the sandbox cannot send it")
        nodes = list(dict.fromkeys(p.node for p in (source, target) if p is not None and p.node))
        spec = ProbeSpec(conn.port or 0, conn.protocol)
        with contextlib.ExitStack() as stack:
            monitors = {}
            for node in nodes:
                dataplane = NftDataplane(config.table, sandbox.node_netns(node))
                stack.enter_context(traced(dataplane, config, conn))
                monitors[node] = (stack.enter_context(TraceMonitor(sandbox.node_netns(node))), dataplane)
            # Every monitor listens once entered, so this one connection's first packet is the first traced.
            connected = sandbox.connect(source.key, conn.destination, spec)
            first = _steps(*monitors[nodes[0]], config.table, 1.0, engine.models[nodes[0]])
            head = f"TRACE  {engine.name(conn.source)} -> {engine.name(conn.destination)} {conn.text()}: " \
                   f"{'connected' if connected else 'refused'}"
            _print(head, nodes[0], first)
            for node in nodes[1:]:
                _print("", node, _steps(*monitors[node], config.table, 1.0, engine.models[node]))
    return read.finish(args, 0 if connected else 1)


def _trace_node(args: argparse.Namespace, config: Config) -> int:
    addresses = []
    for text, flag in ((args.source, "--from"), (args.destination, "--to")):
        try:
            addresses.append(str(ipaddress.ip_address(text)))
        except ValueError:
            raise UsageError(f"{flag} {text}: on a node, give an address (names need manifests)") from None
    protocol, port = parse_port(args.port or "icmp")
    conn = Connection(addresses[0], addresses[1], protocol, port)
    check_exists("--netns", args.netns)
    dataplane = NftDataplane(config.table, args.netns)
    if not dataplane.has_table():
        raise UsageError(f"no table inet {config.table}{' in ' + args.netns if args.netns else ''}: nothing to trace")
    model = next(iter(_agent(args.agent).models.values()), None) if args.agent else None
    with traced(dataplane, config, conn), TraceMonitor(args.netns) as monitor:
        print(f"waiting up to {args.timeout:g} s for {conn.source} -> {conn.destination} {conn.text()}", file=sys.stderr)
        steps = _steps(monitor, dataplane, config.table, args.timeout, model)
    _print(f"TRACE  {conn.source} -> {conn.destination} {conn.text()}", args.netns or "(this node)", steps)
    passed = bool(steps) and steps[-1].verdict not in ("drop",)
    return 0 if passed else 1
