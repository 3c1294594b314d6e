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

Each trace's chains carry a token of its own (two traces at once on one node never share a
chain), which the trace holds as an abstract unix socket in the network namespace of the table
(``@nftpolicy-trace-<token>``: the kernel releases it when the process ends, SIGKILL included,
and the name is seen by every process in that namespace, whatever its pid namespace or
filesystem). A trace starts by deleting the chains of every token no process holds: those of
a trace killed before it could clean up. The agent's full sync at its start replaces the whole
table, so it removes them too.

* With manifests: the cluster is built as a sandbox (:class:`~nftpolicy.agent.testbed.sandbox.Sandbox`),
  and one connection is sent from the ``--from`` pod; each node it crosses is traced.
* Without: on this node (``--netns``: in that namespace), wait up to ``--timeout`` seconds for one
  packet of the connection, given by addresses, through our table; ``--agent`` names the policy
  rules from the model the agent committed (its debug endpoint), else rules show their comments.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import re
import secrets
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from nftpolicy.translators import layout
from nftpolicy.translators.chainbuilders import POD_CHAIN_PREFIX
from nftpolicy.translators.model import family_of
from nftpolicy.translators.rules import ChainOwner, Config, PolicyChain, RuleModel, TierChain, UnknownPods, chain_owners
from nftpolicy.translators.transaction import ChainRule, Transaction
from nftpolicy.translators.verdict import Connection, enforcement_of, unknown_pod_text

from nftpolicy.agent.cli.flags import LOWEST_PRIORITY, UsageError, check_exists, config_from
from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.dataplane.nftables import NftDataplane, NftError, TraceMonitor
from nftpolicy.agent.testbed.probes import ProbeSpec, sctp_supported
from nftpolicy.agent.testbed.sandbox import Sandbox
from nftpolicy.translators.workloads import services_from

from . import placement_nodes, read_manifests, report_skipped
from .explain import _agent, asked, connections, parse_port, service_targets, workload_pod

# A monitor event (``trace id <id> inet <table> <chain> <rest>``), and a rule event's rest: the
# monitor prints handles, so both a rule it knows and one it does not end in the rule's handle (the
# last one: a comment never decides it).
_EVENT = re.compile(r"^trace id (\S+) inet (\S+) (\S+) (.*)$")
_RULE = re.compile(r"^(?:rule .* # handle |unknown rule handle )(?P<handle>\d+) \(verdict (?P<verdict>[^)]*)\)\s*$")


@dataclass(frozen=True)
class Step:
    """One trace event in our table: ``chain``, what matched (``rule`` comment, or ``policy``
    for a base chain's end) and the verdict (the kernel's: a reject's is ``drop``); ``answer``:
    what a rejecting rule sent back first (``tcp reset``, ``icmpx port-unreachable``: nft's
    words), "" for any other."""

    chain: str
    what: str
    verdict: str
    answer: str = ""


QUEUED = "queue"  # a Step's verdict where our table let the packet on to the hold of unknown pods (nft's word for a queue verdict)
GUARD = "nftpolicy-trace-"  # + token: the abstract unix socket a running trace holds


def _guard_socket(netns_name: str | None, token: str) -> socket.socket | None:
    """The guard of ``token`` bound in network namespace ``netns_name`` (None: this process's
    own), or None when a live process holds it already."""
    with netns.entered(netns_name) if netns_name else contextlib.nullcontext():
        guard = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            guard.bind(f"\0{GUARD}{token}")
        except OSError as exc:
            guard.close()
            if exc.errno == errno.EADDRINUSE:
                return None
            raise
    return guard


@contextlib.contextmanager
def _token(netns_name: str | None) -> Any:
    """A token that no live trace in ``netns_name`` holds, held while the body runs."""
    while True:
        token = secrets.token_hex(4)
        guard = _guard_socket(netns_name, token)
        if guard is not None:
            break
    try:
        yield token
    finally:
        guard.close()


def remove_stale(dataplane: NftDataplane) -> list[str]:
    """Delete the trace chains in our table whose trace has ended (no process holds their
    token: a trace killed with SIGKILL); returns the chains deleted. A chain that another trace
    deleted meanwhile is no error."""
    chains = [o["chain"]["name"] for o in dataplane.listing(terse=True) if "chain" in o]
    tokens = {token for token in map(layout.trace_token, chains) if token is not None}
    stale = []
    for token in sorted(tokens):
        guard = _guard_socket(dataplane.netns, token)
        if guard is not None:  # free: its trace is gone
            guard.close()
            stale += [c for c in chains if layout.trace_token(c) == token]
    for name in stale:
        removing = Transaction(dataplane.table, 0)
        removing.flush(layout.Chain(name, ()))
        removing.delete(layout.Chain(name, ()))
        with contextlib.suppress(NftError):
            dataplane.run(removing)
    return stale


@contextlib.contextmanager
def traced(dataplane: NftDataplane, config: Config, conn: Connection) -> Any:
    """Our table with this trace's chains for ``conn`` while the body runs (the token of their
    names is the context's value), then without them (those still there: the agent's full
    resync replaces the table, trace chains included). Stale chains of ended traces are deleted
    first (:func:`remove_stale`)."""
    with _token(dataplane.netns) as token:
        stale = remove_stale(dataplane)
        if stale:
            print(f"removed {len(stale)} chains of a trace that ended without cleaning up: {' '.join(stale)}", file=sys.stderr)
        chains = layout.trace_chains(token, conn.source, conn.destination, conn.protocol, conn.port)
        adding = Transaction(config.table, config.priority - 1)  # hooked just before our base chains
        for chain in chains:
            adding.add(chain)
            for rule in chain.rules:
                adding.add(ChainRule(chain.name, rule))
        dataplane.run(adding)
        try:
            yield token
        finally:
            listed = {o["chain"]["name"] for o in dataplane.listing(terse=True) if "chain" in o}
            left = [c for c in chains if c.name in listed]
            if left:
                removing = Transaction(config.table, config.priority - 1)
                for chain in left:
                    removing.flush(chain)
                for chain in left:
                    removing.delete(chain)
                dataplane.run(removing)


@dataclass(frozen=True)
class Listed:
    """A rule of our table as the kernel lists it: ``chain``, ``comment`` and, when the model
    the table was made from is known, the layout ``rule`` at its place (with its origin);
    ``taught``: for a rule that matches the traced address in a domainNames peer's set, the DNS
    name whose answer put it there (the agent's, from ``--agent``); ``answer``: what the rule
    sends back when it rejects (:func:`reject_answer`), "" for any other; ``peer``: for a rule
    of a rule's peer chain, or one that looks its peer up in a union set, what its peer set
    selects (the model's set comment; a union set's: its peers that give the traced address);
    ``unknown``: for a rule that holds or drops the traced connection's packet as an unknown
    pod's, what it does and to which address (:func:`unknown_text`)."""

    chain: str
    comment: str
    rule: layout.Rule | None = None
    taught: str = ""
    answer: str = ""
    peer: str = ""
    unknown: str = ""


def listed_rules(listing: Iterable[dict[str, Any]], model: RuleModel | None,
                 learned: Mapping[str, Mapping[str, str]] | None = None, conn: Connection | None = None,
                 config: Config | None = None) -> dict[int, Listed]:
    """Rule handle -> :class:`Listed` for the rules of a kernel listing; a chain's rules are
    matched to ``model``'s layout by place, where the chain has as many rules as its layout
    (without a model: the chains ``config`` alone decides, the base chains and those of the
    hold of unknown pods). ``learned`` (domain set -> address -> DNS name) and ``conn``: the
    traced connection, whose address a rule matching a domain set was taught by that name, and
    whose packet a rule of the unknown pods holds or drops (:func:`unknown_text`)."""
    laid = layout.table(model).chains if model is not None else \
        [*layout.to_hold_chain(config), *layout.base_chains(config), *layout.released_chains(config)] if config is not None else []
    chains = {c.name: c.rules for c in laid}
    ruled: list[PolicyChain | TierChain] = [*model.policy_chains, *model.tier_chains] if model is not None else []
    peer_chains = {p.name for c in ruled for p in c.peer_chains}
    selects = {s.name: s.comment for s in model.sets} if model is not None else {}
    unions = {u.name: u for u in model.unions} if model is not None else {}

    def peer_text(statement: layout.AddressInSet) -> str:
        union = unions.get(statement.name)
        if union is None or conn is None:
            return selects.get(statement.name, statement.name)
        return " or ".join(union.matching(conn.address(statement.field))) or selects.get(statement.name, statement.name)
    by_chain: dict[str, list[dict[str, Any]]] = {}
    for item in listing:
        if "rule" in item:
            by_chain.setdefault(item["rule"]["chain"], []).append(item["rule"])
    found = {}
    for chain, rules in by_chain.items():
        decided = chains.get(chain, ())
        for i, rule in enumerate(rules):
            decided_rule = decided[i] if len(decided) == len(rules) else None
            peer = next((peer_text(st) for st in decided_rule.statements if isinstance(st, layout.AddressInSet)
                         and (chain in peer_chains or st.name in unions)), "") if decided_rule is not None else ""
            found[int(rule["handle"])] = Listed(chain, rule.get("comment", ""), decided_rule, _taught(decided_rule, learned, conn),
                                                reject_answer(rule), peer, unknown_text(chain, decided_rule, conn))
    return found


def unknown_text(chain: str, rule: layout.Rule | None, conn: Connection | None) -> str:
    """For a rule of the unknown pods that the traced connection ``conn`` can meet, what it does
    to its packet (explain's words, :func:`~nftpolicy.translators.verdict.unknown_pod_text`):
    a base chain's rule that marks it for the hold or drops it (``egress of 10.0.1.5: an
    unknown pod (...): held until the agent programs its pod, ...``), or the drop of
    :data:`~nftpolicy.translators.layout.TO_HOLD_CHAIN` (``10.0.1.6 sent more than its budget
    towards the hold ...``: the budget is the source's, whichever address is unknown);
    "" for any other rule, or without ``rule`` or ``conn``."""
    if rule is None or conn is None:
        return ""
    if chain == layout.TO_HOLD_CHAIN and layout.VerdictStatement("drop") in rule.statements:
        return (f"{conn.source} sent more than its budget towards the hold (--unknown-pod-rate, --unknown-pod-burst): "
                "dropped, not held")
    field = layout.unknown_pod_field(rule)
    if field is None:
        return ""
    mode: UnknownPods = "drop" if layout.VerdictStatement("drop") in rule.statements else "hold"
    return unknown_pod_text(layout.FIELD_DIRECTION[field], conn.source if field == "saddr" else conn.destination, mode, None)


def reject_answer(rule: Mapping[str, Any]) -> str:
    """What a listed rule (libnftables JSON) sends back when it rejects, in nft's words: ``tcp
    reset``, ``icmpx port-unreachable`` (its type and code); "" for a rule that does not reject.
    The trace monitor gives a reject's verdict as ``drop``: this tells the two apart."""
    for expr in rule.get("expr") or ():
        if "reject" in expr:
            how = expr["reject"] or {}
            return " ".join(str(how[k]) for k in ("type", "expr") if how.get(k)) or "icmpx port-unreachable"
    return ""


def _taught(rule: layout.Rule | None, learned: Mapping[str, Mapping[str, str]] | None, conn: Connection | None) -> str:
    """``93.184.216.34 learned from the DNS answer for api.example`` when ``rule`` tests the
    traced connection's address in a set the agent learned it into, else ``""``."""
    if rule is None or not learned or conn is None:
        return ""
    for statement in rule.statements:
        if isinstance(statement, layout.AddressInSet) and statement.name in learned:
            address = conn.destination if statement.field == "daddr" else conn.source
            name = learned[statement.name].get(address)
            if name is not None:
                return f"{address} learned from the DNS answer for {name}"
    return ""


def rule_text(listed: Listed | None) -> str:
    """A matched rule in words: a policy rule ``policy <policy> <direction> rule <i> (allows)``
    (from its origin; in a rule's peer chain with what its peer set selects, ``(allows pods in
    x: app=web)``, and the match of a port that jumps there ``...: a port of it, to its
    peers``), a pod chain's rule ``pod <comment>``, any other its comment."""
    if listed is None:
        return "a rule"
    if listed.unknown:
        return listed.unknown
    origin = listed.rule.origin if listed.rule is not None else None
    if origin is not None and origin.tier is None:
        if any(isinstance(s, layout.Jump) for s in listed.rule.statements):  # type: ignore[union-attr]
            return f"policy {origin.policy} {origin.direction} rule {origin.index}: a port of it, to its peers"
        return f"policy {origin.policy} {origin.direction} rule {origin.index} (allows{' ' + listed.peer if listed.peer else ''})"
    if listed.chain.startswith(tuple(POD_CHAIN_PREFIX.values())):
        return f"pod {listed.comment}"
    return f"{listed.comment or 'a rule'}; {listed.taught}" if listed.taught else listed.comment or "a rule"


def _unmatched(target: str, owners: Mapping[str, ChainOwner]) -> str:
    """The step of a policy chain left without a match (the kernel reports no event for it)."""
    if target == layout.COMMON_CHAIN:
        return "common: not invalid, no essential ICMP"
    owner = owners.get(target)
    if owner is None or owner.policy is None:
        return "policy (unknown here: give --agent): no rule matched"
    return f"policy {owner.policy} {owner.direction}: no rule matched"


def follow(lines: Iterable[str], table: str, token: str, rules: Mapping[int, Listed], owners: Mapping[str, ChainOwner],
           relist: Callable[[], Mapping[int, Listed]] | None = None) -> list[Step]:
    """The steps of the first packet in ``table`` that the chains of trace ``token`` marked
    (every trace chain left out: another trace's packets are not this one's), up to the base
    chain's end or a final verdict; a packet on to the hold of unknown pods is followed on
    through its release. ``rules``: rule handle -> the listed rule (:func:`listed_rules`),
    listed again with ``relist`` where a rule is not in it (one the agent committed since: a
    held packet's pod's chains); ``owners``: chain -> what it enforces, to name a policy chain
    that the packet left without a match (the kernel reports no event for that)."""
    steps: list[Step] = []
    first = None
    for line in lines:
        if steps and steps[-1].verdict.startswith("jump KUBE-NWPLCY-") and f" {steps[-1].verdict[5:]} " not in line:
            target = steps[-1].verdict[5:]
            steps.append(Step(target, _unmatched(target, owners), "return"))
        event = _EVENT.match(line)
        if not event or event.group(2) != table:
            continue
        trace_id, chain, rest = event.group(1), event.group(3), event.group(4)
        if layout.trace_token(chain) is not None:
            if first is None and layout.trace_token(chain) == token:
                first = trace_id
            continue
        if trace_id != first or rest.startswith("packet:"):
            continue
        rule = _RULE.match(rest)
        if rule:
            handle = int(rule.group("handle"))
            if handle not in rules and relist is not None:
                rules = relist()
            listed = rules.get(handle)
            verdict = rule.group("verdict")
            if chain == layout.TO_HOLD_CHAIN and verdict == "accept":  # on to the hold's queue: its release walks on
                verdict = QUEUED
            steps.append(Step(chain, rule_text(listed), verdict, listed.answer if listed is not None else ""))
            if verdict in ("accept", "drop"):
                break
        elif rest.startswith("policy "):
            steps.append(Step(chain, "end of chain, policy", rest.split()[1]))
            if chain in layout.BASE_CHAINS or chain in layout.RELEASED_CHAINS:
                break
    return steps


def step_text(step: Step) -> str:
    """``  KUBE-NWPLCY-...: policy shop/api-ingress ingress rule 0 (allows) -> return``; a
    refusal says what the kernel did: ``-> reject with tcp reset`` (it answered, then dropped),
    ``-> drop`` (no answer); a packet on to the hold of unknown pods ``-> queued to the hold``."""
    verdict = f"reject with {step.answer}" if step.answer and step.verdict == "drop" else \
        "queued to the hold" if step.verdict == QUEUED else step.verdict
    return f"  {step.chain}: {step.what} -> {verdict}"


def steps_lines(steps: list[Step]) -> list[str]:
    """The lines of one node's steps (:func:`step_text`); a packet still held when the trace
    ended says so: the agent releases it once the pod is programmed, and drops it after the hold."""
    if not steps:
        return ["  (no packet of it in our table here)"]
    lines = [step_text(s) for s in steps]
    if steps[-1].verdict == QUEUED:
        lines.append("  (still held when the trace ended: released to its rules once its pod is programmed, "
                     "dropped after the agent's --unknown-pod-hold)")
    return lines


def passed(steps: list[Step]) -> bool:
    """True when the packet went through: seen, and neither refused nor still held at the end."""
    return bool(steps) and steps[-1].verdict not in ("drop", QUEUED)


def _steps(monitor: TraceMonitor, dataplane: NftDataplane, table: str, token: str, timeout: float,
           model: RuleModel | None, learned: Mapping[str, Mapping[str, str]] | None = None,
           conn: Connection | None = None, config: Config | None = None) -> list[Step]:
    owners = chain_owners(model) if model is not None else {}
    def relist() -> dict[int, Listed]:
        return listed_rules(dataplane.listing(), model, learned, conn, config)
    return follow(monitor.lines(timeout), table, token, relist(), owners, relist)


def cmd_trace(args: argparse.Namespace) -> int:
    """Print the path; exit 0 when the packet passed, 1 when it was refused or never seen, 2 on bad input."""
    config = config_from(args)
    if args.paths and args.agent:
        raise UsageError("--agent: only on a node; with manifests the sandbox knows its own model")
    if config.priority == LOWEST_PRIORITY:
        raise UsageError(f"--priority {config.priority}: trace hooks its chains just below the base chains (priority - 1), "
                         "and no priority is lower: give the table's priority")
    if args.paths:
        return _trace_sandbox(args, config)
    return _trace_node(args, config)


def _print(head: str, node: str, steps: list[Step]) -> None:
    print(f"{head}\nnode {node}:" if head else f"node {node}:")
    print("\n".join(steps_lines(steps)))


def _trace_sandbox(args: argparse.Namespace, config: Config) -> int:
    read = read_manifests(args, args.node or [], keep_objects=True, say_stand_ins=False)
    stop = read.stop_when_empty(args)
    if stop is not None:
        return stop
    cluster = read.cluster
    destination, ports = asked(args.destination, [args.port] if args.port else [])
    services, unread = services_from(read.objects)
    report_skipped(unread, args.strict)
    read.skipped += unread
    service = services.get(destination) if destination not in cluster.pods else None
    sender = workload_pod(args.source, read.stand_ins, cluster, "--from")
    destination = destination if service is not None else workload_pod(destination, read.stand_ins, cluster, "--to")
    placed_on = placement_nodes(cluster, args.node or [])
    families = sorted({family_of(ip) for p in cluster.pods.values() for ip in p.ips}) or ["ipv4"]
    node_addresses = {n.name: n.addresses for n in cluster.nodes.values()}
    # every Node of the manifests answers on its addresses (a host-network server in its namespace)
    with Sandbox(cluster.pods.values(), placed_on, families, node_addresses, config, served_nodes=sorted(cluster.nodes),
                 pod_cidrs={n.name: n.pod_cidrs for n in cluster.nodes.values()}) as sandbox:
        cluster = sandbox.with_sandbox_pods(cluster)
        sandbox.apply(cluster)
        engine = enforcement_of(cluster, list(sandbox.nodes), config)
        if service is not None:  # a Service: the packet goes to its first pod, on the target port (kube-proxy's choice)
            selected, targets = service_targets(service, cluster, ports)
            destination, ports = selected[0], targets[:1]
        conn = connections(engine, sender, destination, ports, cluster.pods)[0]
        source, target = engine.pod_at(conn.source), engine.pod_at(conn.destination)
        if source is None or source.key not in sandbox.pods:
            raise UsageError(f"--from {sender}: the sandbox sends from a pod; give one")
        if conn.protocol == "SCTP" and not sctp_supported():
            raise UsageError(f"--port {args.port or conn.text().lower()}: this kernel has no SCTP, so the sandbox cannot send it")
        nodes = list(dict.fromkeys([*(p.node for p in (source, target) if p is not None and p.node),
                                    *filter(None, [engine.node_at(conn.destination)])]))
        spec = ProbeSpec(conn.port or 0, conn.protocol)
        with contextlib.ExitStack() as stack:
            monitors = {}
            for node in nodes:
                dataplane = NftDataplane(config.table, sandbox.node_netns(node))
                token = stack.enter_context(traced(dataplane, config, conn))
                monitors[node] = (stack.enter_context(TraceMonitor(sandbox.node_netns(node))), dataplane, token)
            # Every monitor listens once entered, so this one connection's first packet is the first traced.
            connected = sandbox.connect(source.key, conn.destination, spec)
            walks = {node: _steps(monitor, dataplane, config.table, token, 1.0, engine.models[node], conn=conn)
                     for node, (monitor, dataplane, token) in monitors.items()}
        # A packet that no node's table saw was not refused by it (an address outside the
        # sandbox, which has no route out): "never seen", as docs/commands.md says.
        outcome = "connected" if connected else "refused" if any(walks.values()) else "never seen"
        head = f"TRACE  {engine.name(conn.source)} -> {engine.name(conn.destination)} {conn.text()}: {outcome}"
        for node, steps in walks.items():
            _print(head if node == nodes[0] else "", node, steps)
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
    enforcement = _agent(args.agent) if args.agent else None
    model = next(iter(enforcement.models.values()), None) if enforcement is not None else None
    learned = next(iter(enforcement.learned.values()), None) if enforcement is not None else None
    with traced(dataplane, config, conn) as token, TraceMonitor(args.netns) as monitor:
        print(f"waiting up to {args.timeout:g} s for {conn.source} -> {conn.destination} {conn.text()}", file=sys.stderr)
        steps = _steps(monitor, dataplane, config.table, token, args.timeout, model, learned, conn, config)
    _print(f"TRACE  {conn.source} -> {conn.destination} {conn.text()}", args.netns or "(this node)", steps)
    return 0 if passed(steps) else 1
