"""``nftpolicy trace``: one real packet's path through our chains, mapped to pods, policies and rules.

For the trace, our own table gets one base chain per hook, hooked just before our base chains
(:func:`~nftpolicy.translators.layout.trace_chains`), whose rule sets ``meta nftrace set 1`` on
the chosen connection; libnftables' ``monitor trace`` (:class:`~nftpolicy.agent.dataplane.nftables.TraceMonitor`)
reports the packet's walk, and every event in our table is printed with the comment of the rule
that matched (``<ns>/<name> ...``: the pod, or the policy, direction and rule index). The trace
chains are deleted afterwards, also on an error, Ctrl-C or SIGTERM (:mod:`nftpolicy.agent.interrupts`).

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
  packet of the connection, given by addresses, through our table.
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
from typing import Any, Iterable

from nftpolicy.translators import layout
from nftpolicy.translators.model import family_of
from nftpolicy.translators.rules import Config
from nftpolicy.translators.transaction import ChainRule, Transaction
from nftpolicy.translators.verdict import Connection, enforcement_of, rule_index

from nftpolicy.agent.cli.flags import LOWEST_PRIORITY, UsageError, check_exists, config_from
from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.dataplane.nftables import NftDataplane, NftError, TraceMonitor
from nftpolicy.agent.testbed.probes import ProbeSpec, sctp_supported
from nftpolicy.agent.testbed.sandbox import Sandbox
from . import read_manifests
from .explain import connections, parse_port

_EVENT = re.compile(r"^trace id (\S+) inet (\S+) (\S+) (.*)$")
_RULE = re.compile(r"^(?:rule (?P<text>.*?)|unknown rule handle (?P<handle>\d+)) \(verdict (?P<verdict>[^)]*)\)\s*$")
_COMMENT = re.compile(r'comment "([^"]*)"')


@dataclass(frozen=True)
class Step:
    """One trace event in our table: ``chain``, what matched (``rule`` comment, or ``policy``
    for a base chain's end) and the verdict."""

    chain: str
    what: str
    verdict: str


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


def follow(lines: Iterable[str], table: str, token: str, comments: dict[int, str], owners: dict[str, str]) -> list[Step]:
    """The steps of the first packet in ``table`` that the chains of trace ``token`` marked
    (every trace chain left out: another trace's packets are not this one's), up to the base
    chain's end or a final verdict. ``comments``: rule handle -> comment, for the rules the
    monitor did not know yet (``unknown rule handle``); ``owners``: policy chain -> ``<policy>
    <direction>``, to name a policy chain that the packet left without a match (the kernel
    reports no event for that)."""
    steps: list[Step] = []
    first = None
    for line in lines:
        if steps and steps[-1].verdict.startswith("jump KUBE-NWPLCY-") and f" {steps[-1].verdict[5:]} " not in line:
            target = steps[-1].verdict[5:]
            what = "common: not invalid, no essential ICMP" if target == layout.COMMON_CHAIN else \
                f"policy {owners.get(target, '(no rules: deny all)')}: no rule matched"
            steps.append(Step(target, what, "return"))
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
            text = rule.group("text")
            found = _COMMENT.search(text) if text is not None else None
            what = found.group(1) if found else comments.get(int(rule.group("handle") or -1), text or "a rule")
            steps.append(Step(chain, what, rule.group("verdict")))
            if rule.group("verdict") in ("accept", "drop"):
                break
        elif rest.startswith("policy "):
            steps.append(Step(chain, "end of chain, policy", rest.split()[1]))
            if chain in layout.BASE_CHAINS:
                break
    return steps


def step_text(step: Step) -> str:
    """``KUBE-NWPLCY-... : policy shop/api-ingress ingress rule 0 -> return``: a policy rule
    named with its index, a pod chain rule with its pod, a base chain rule with its comment."""
    what = step.what
    if step.chain.startswith("KUBE-NWPLCY-") and rule_index(what) is not None and not what.startswith("policy "):
        what = f"policy {what} (allows)"
    elif step.chain.startswith("KUBE-POD-FW-"):
        what = f"pod {what}"
    return f"  {step.chain}: {what} -> {step.verdict}"


def _steps(monitor: TraceMonitor, dataplane: NftDataplane, table: str, token: str, timeout: float) -> list[Step]:
    rules = [o["rule"] for o in dataplane.listing() if "rule" in o]
    owners: dict[str, str] = {}
    for rule in rules:  # a policy chain's rules say "<policy> <direction> rule <i>"
        if rule["chain"].startswith("KUBE-NWPLCY-") and rule_index(rule.get("comment", "")) is not None:
            owners.setdefault(rule["chain"], rule["comment"].rsplit(" rule ", 1)[0])
    return follow(monitor.lines(timeout), table, token, {r["handle"]: r.get("comment", "") for r in rules}, owners)


def cmd_trace(args: argparse.Namespace) -> int:
    """Print the path; exit 0 when the packet passed, 1 when it was refused or never seen, 2 on bad input."""
    config = config_from(args)
    if config.priority == LOWEST_PRIORITY:
        raise UsageError(f"--priority {config.priority}: trace hooks its chains just below the base chains (priority - 1), "
                         "and no priority is lower: give the table's priority")
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
                token = stack.enter_context(traced(dataplane, config, conn))
                monitors[node] = (stack.enter_context(TraceMonitor(sandbox.node_netns(node))), dataplane, token)
            # Every monitor listens once entered, so this one connection's first packet is the first traced.
            connected = sandbox.connect(source.key, conn.destination, spec)
            monitor, dataplane, token = monitors[nodes[0]]
            first = _steps(monitor, dataplane, config.table, token, 1.0)
            head = f"TRACE  {engine.name(conn.source)} -> {engine.name(conn.destination)} {conn.text()}: " \
                   f"{'connected' if connected else 'refused'}"
            _print(head, nodes[0], first)
            for node in nodes[1:]:
                monitor, dataplane, token = monitors[node]
                _print("", node, _steps(monitor, dataplane, config.table, token, 1.0))
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
    with traced(dataplane, config, conn) as token, TraceMonitor(args.netns) as monitor:
        print(f"waiting up to {args.timeout:g} s for {conn.source} -> {conn.destination} {conn.text()}", file=sys.stderr)
        steps = _steps(monitor, dataplane, config.table, token, args.timeout)
    _print(f"TRACE  {conn.source} -> {conn.destination} {conn.text()}", args.netns or "(this node)", steps)
    passed = bool(steps) and steps[-1].verdict not in ("drop",)
    return 0 if passed else 1
