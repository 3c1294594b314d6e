#!/usr/bin/env python3
"""Benchmark: the packet path. New TCP connections per second between two sandbox pods on one
node, with no rules, with connection tracking only, with the nft ruleset (one policy and 50
selecting the server), with the iptables variant (iptables-nft and iptables-legacy) and with
the real kube-router v2.1.0's own rules for the same cluster, side by side in one run.

Usage (as root)::

    .venv/bin/python bench/packet_path.py                 # table on stdout
    .venv/bin/python bench/packet_path.py --json          # + JSON on stdout (the table goes to stderr)
    .venv/bin/python bench/packet_path.py --seconds 2 --rounds 3
    .venv/bin/python bench/packet_path.py --no-kube-router  # no control plane (2-3 minutes less)

A run at the defaults takes 6-8 minutes on this project's 2-core machine (8 min 11 s at load
average 11-27): 8 sandboxes of 110 pods, the cluster loaded through kube-router's API server
(1-2 minutes) and its sync (15-25 s), 7 rounds of 8 variants of 3.5 s.

The cluster is ``synthetic.generate(10,000 pods, 1,000 policies, 100 namespaces)`` with 110 pods
on ``node-0`` (see ``synthetic.py``). One sandbox per variant is built with the same 110 local pods
(one network namespace per pod, routed through the node's namespace, as ``nftpolicy sandbox``
builds them):

* ``none``: no ruleset at all (so no connection tracking in the node's namespace either);
* ``conntrack``: one table with one rule, ``ct state established,related accept`` in the forward
  hook: the connection tracking that every stateful policy needs (kube-router's rules too) and
  that every node running kube-proxy has anyway;
* ``nft``: our table (``transaction.full``, through libnftables);
* ``nft-hold``: the same table with ``--unknown-pods hold`` (issue 31) and the local pods' /16s as
  the node's pod CIDRs: every new connection's first packet looks its two addresses up in the
  pod CIDRs and the known pods, and every packet passes the released chains' mark tests (the
  pair is known: nothing is held);
* ``nft-no-counters``: the same table without its ``counter`` statements (each allow rule, each
  reject and each Deny has one), to measure what counting costs;
* ``nft-50-policies``: the same with 49 more policies that select the server and allow the pair
  (the first allow ends the walk through the pod chain);
* ``iptables-nft`` and ``iptables-legacy``: the iptables variant of the same rule model, with its
  ipsets, loaded with that ``iptables-restore``;
* ``kube-router``: the real kube-router v2.1.0 (``.tools/bin/kube-router``, built by ``bash
  .ci/install --test``) writes its own iptables rules (iptables-nft) and ipsets for the same
  cluster into the sandbox node's namespace (:func:`kube_router_rules`: etcd and kube-apiserver
  hold the whole cluster, loaded through the API as ``kube_router_side_by_side.py`` loads it;
  kube-router runs as ``nftpolicy sandbox --dataplane kube-router`` runs it until its rules are
  complete, then it and the control plane stop and its rules stay, as on a node whose
  kube-router restarts). ``--no-kube-router`` leaves it out.

The client and the server are two local pods that policies isolate in both directions
and that a policy allows on a TCP port, so every new connection walks the dispatch, both pods'
chains and their policy chains with set lookups.

Load: ``--clients`` processes in the client pod's namespace open and close (SO_LINGER 0, so RST and
no TIME_WAIT) TCP connections in a loop; one process in the server pod accepts and closes. Each
measurement is ``--warmup`` seconds not counted, then ``--seconds`` counted; ``--rounds`` rounds
run the variants in rotating order, and the median of each is reported with its ratios to
``none`` and to ``conntrack``; the two targets are judged on those ratios of medians. Beside
each, the paired ratios show the noise: nft over conntrack (and 50 policies over one) within each
round, where the two ran back to back, their median, lowest and highest.

The traffic only goes between namespaces this script creates (``nftp-<run>-*``), is bounded in
time, and everything is removed at the end, also on Ctrl-C and SIGTERM.

Beside the rates (a 3 s rate varies by +-15 % between rounds on a shared machine), the
deterministic cost of one new connection, counted by walking the decided table
(:mod:`nftpolicy.translators.tablewalk`) from ``KUBE-ROUTER-FORWARD``: rules evaluated, set and
verdict-map look-ups, jumps taken and counters reached, for the ingress (the server's ingress
chain, dispatch on the destination) and the egress (the client's egress chain, on the source) each walked alone (the
base chain's rules count in both), and for the whole walk the kernel does. The iptables
variant's cost is the same walk over the table as ``translators/iptables.py`` prints it: the
dispatch one rule per local pod address, a rule per address and protocol, a mark-and-return as
MARK then a mark-matching RETURN, no "allowed" returns, and the jump from ``FORWARD``; its
dispatch is rules, not verdict-map look-ups the walk can limit to one direction, so only its
whole walk is counted, and it has no counter statements (iptables counts every rule).

The loaded rulesets of ``nft``, ``iptables-nft`` and ``kube-router`` are also counted from the
kernel (the "traced" rows, :func:`trace_connection`): one connection of the pair, every packet of
it marked for ``nft monitor trace`` in the node's namespace, each packet's walk counted against
the ruleset's listing (:func:`traced_costs`: the kernel reports the rules that matched, so a
chain visit evaluated the rules up to its last match when that ended the visit, else the whole
chain). The first packet is the new connection's walk, counted as the table walk counts it (for
``nft`` and ``iptables-nft`` the two agree, a check of both); set look-ups are the evaluated
rules' set references, an upper bound (one behind a match that failed is counted too); counters
are the matched rules that have one (iptables-nft gives every rule one). The later packets
(SYN-ACK, ACK, reset) show what each packet of an established connection costs: kube-router
accepts them in the pod's chain, after the dispatch rules before it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import os
import platform
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic  # noqa: E402

from nftpolicy.agent.dataplane import netns  # noqa: E402
from nftpolicy.agent.dataplane.nftables import NftDataplane, TraceMonitor  # noqa: E402
from nftpolicy.agent.testbed.sandbox import Sandbox  # noqa: E402
from nftpolicy.translators import iptables as iptables_render  # noqa: E402
from nftpolicy.translators import layout  # noqa: E402
from nftpolicy.translators.noderender import build_rule_model  # noqa: E402
from nftpolicy.translators.rules import RuleModel  # noqa: E402
from nftpolicy.translators.tablewalk import TableWalker  # noqa: E402
from nftpolicy.translators.transaction import ChainRule, OurTable, Transaction, replacing  # noqa: E402
from nftpolicy.translators.verdict import Connection, Enforcement  # noqa: E402

VARIANTS = ("none", "conntrack", "nft", "nft-hold", "nft-no-counters", "nft-50-policies", "iptables-nft", "iptables-legacy", "kube-router")
TRACED = ("nft", "iptables-nft", "kube-router")  # variants whose loaded ruleset is also traced
BENCH_TABLE = "nftpolicy-bench-conntrack"
TARGET_RATIO = 0.98  # of the conntrack-only rate
POLICIES_TARGET = 0.98  # 50 policies selecting the destination, against one


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


# ---- choosing the pair ------------------------------------------------------------------------

def choose_pair(cluster, model: RuleModel) -> tuple[str, str, int]:
    """(client pod, server pod, TCP port): both isolated by policies in the direction they are used,
    and allowed by both (the verdict engine on the node's model), first in name order."""
    engine = Enforcement({None: model})
    isolated = {(c.pod, c.direction) for c in model.pod_chains if c.policies}
    for server_key in sorted({pod for pod, direction in isolated if direction == "ingress"}):
        dst = cluster.pods[server_key].addresses("ipv4")[0]
        ports = sorted({p.port for p in cluster.pods[server_key].ports if p.protocol == "TCP"})
        for client_key in sorted({pod for pod, direction in isolated if direction == "egress"}):
            if client_key == server_key:
                continue
            src = cluster.pods[client_key].addresses("ipv4")[0]
            for port in ports:
                verdict = engine.verdict(Connection(src, dst, "TCP", port))
                if verdict.egress.allowed_by and verdict.ingress.allowed_by:
                    return client_key, server_key, port
    raise SystemExit("no allowed pair of policy-isolated local pods in this cluster")


def with_selecting_policies(cluster, model: RuleModel, client: str, server: str, port: int, count: int):
    """``cluster`` plus copies of a policy that allows the pair into ``server``, so that
    ``count`` policies select the destination and each would allow the connection: with the
    first allow ending the walk, the other chains are never entered."""
    src, dst = (cluster.pods[k].addresses("ipv4")[0] for k in (client, server))
    allowed_by = Enforcement({None: model}).verdict(Connection(src, dst, "TCP", port)).ingress.allowed_by
    assert allowed_by is not None
    policy = cluster.policies[allowed_by.policy]  # the policy that allows the pair, not any that selects the server
    copies = {f"{policy.namespace}/copy-{i:02d}": dataclasses.replace(policy, name=f"copy-{i:02d}") for i in range(count - 1)}
    return dataclasses.replace(cluster, policies={**cluster.policies, **copies})


# ---- rulesets that are not a sandbox dataplane ---------------------------------------------------

def conntrack_only() -> Transaction:
    """One table, one forward base chain, one rule: ``ct state established,related accept``."""
    tx = Transaction(BENCH_TABLE, 0)
    tx.add(OurTable())
    tx.add(layout.Chain("forward", (), "forward"))
    tx.add(ChainRule("forward", layout.Rule((layout.ConntrackState(("established", "related")), layout.VerdictStatement("accept")), "")))
    return tx


def without_counters(table: layout.Table) -> layout.Table:
    """``table`` with every ``counter`` statement taken out (nothing else changes)."""
    chains = tuple(dataclasses.replace(c, rules=tuple(dataclasses.replace(r, statements=tuple(
        st for st in r.statements if not isinstance(st, layout.CounterStatement))) for r in c.rules)) for c in table.chains)
    return dataclasses.replace(table, chains=chains)


# ---- the deterministic cost: rules, look-ups and jumps per new connection ----------------------------

def iptables_shaped(table: layout.Table, family: str = "ipv4") -> layout.Table:
    """``table`` as the iptables variant evaluates it (what ``iptables._Printer`` prints, as layout
    rules the table walk can take): no "allowed" returns; one rule per address, protocol and
    ICMP type; a mark-and-return as a MARK rule and a mark-matching RETURN; each verdict-map
    dispatch one rule per element; ``FORWARD`` jumps to ``KUBE-ROUTER-FORWARD``."""
    maps = {m.name: m for m in table.maps}
    chains = []
    for chain in table.chains:
        rules: list[layout.Rule] = []
        for rule in chain.rules:
            if any(isinstance(st, layout.Marked) for st in rule.statements) or rule.family() not in (None, family):
                continue
            variants: list[tuple[layout.Statement, ...]] = [()]
            for st in rule.statements:
                if isinstance(st, layout.AddressIs):
                    options: list[layout.Statement] = [layout.AddressIs(st.family, st.field, (a,)) for a in st.addresses]
                elif isinstance(st, layout.Protocols):
                    options = [layout.Protocols((n,)) for n in st.names]
                elif isinstance(st, layout.IcmpTypes):
                    options = [layout.IcmpTypes(st.family, (t,)) for t in st.types]
                else:
                    options = [st]
                variants = [v + (o,) for v in variants for o in options]
            for v in variants:
                dispatch = next((st for st in v if isinstance(st, layout.Dispatch)), None)
                if dispatch is not None:
                    rules += [layout.Rule((layout.AddressIs(dispatch.family, dispatch.field, (e.address,)), layout.Jump(e.chain)), "")
                              for e in maps[dispatch.map].elements]
                elif isinstance(v[-1], layout.VerdictStatement) and v[-1].kind == "return" and any(isinstance(st, layout.SetMark) for st in v):
                    mark = next(st for st in v if isinstance(st, layout.SetMark))
                    matches = tuple(st for st in v if not isinstance(st, (layout.SetMark, layout.VerdictStatement)))
                    rules += [layout.Rule((*matches, mark), ""), layout.Rule((*matches, layout.Marked(mark.bits), v[-1]), "")]
                else:
                    rules.append(layout.Rule(v, ""))
        chains.append(dataclasses.replace(chain, rules=tuple(rules), hook=None))
    chains.append(layout.Chain("FORWARD", (layout.Rule((layout.Jump("KUBE-ROUTER-FORWARD"),), ""),), "forward"))
    return dataclasses.replace(table, chains=tuple(chains), maps=())


def path_cost(table: layout.Table, source: str, destination: str, port: int, start: str = "KUBE-ROUTER-FORWARD") -> dict[str, dict[str, int]]:
    """Per new connection ``source`` -> ``destination`` TCP ``port``: rules evaluated, look-ups,
    jumps and counters, for ``ingress`` and ``egress`` each walked alone and for the whole walk
    (``both``); the connection must be allowed."""
    walker = TableWalker(table)
    cost = {}
    # a table without verdict maps (the iptables variant's) dispatches in rules: one walk only
    directions = (("ingress", ("daddr",)), ("egress", ("saddr",))) if table.maps else ()
    for name, dispatch in (*directions, ("both", ("daddr", "saddr"))):
        walked = walker.walk(Connection(source, destination, "TCP", port), start, dispatch)
        assert walked.allowed, (name, walked.outcome)
        cost[name] = {"rules": len(walked.steps), "lookups": walked.lookups, "jumps": walked.jumps, "counters": walked.counters}
    return cost


# ---- the cost of a real ruleset: one packet traced by the kernel ------------------------------

TRACE_TABLE = "nftpolicy-bench-trace"  # the table that marks the traced packet (never counted)
_TRACE_EVENT = re.compile(r"^trace id (?P<id>\S+) (?P<family>\S+) (?P<table>\S+) (?P<chain>\S+) (?P<rest>.*)$")
_TRACE_RULE = re.compile(r"^rule .* # handle (?P<handle>\d+) \(verdict (?P<verdict>[^)]*)\)\s*$")
ChainKey = tuple[str, str, str]  # (family, table, chain)


def listed_chains(listing: list[dict[str, Any]]) -> dict[ChainKey, list[dict[str, Any]]]:
    """(family, table, chain) -> that chain's rules in order, from the kernel's JSON listing
    (``nft -j list ruleset``: each ``{"rule": {...}}`` with its ``handle`` and ``expr``)."""
    chains: dict[ChainKey, list[dict[str, Any]]] = {}
    for item in listing:
        if "chain" in item:
            c = item["chain"]
            chains.setdefault((c["family"], c["table"], c["name"]), [])
        elif "rule" in item:
            r = item["rule"]
            chains.setdefault((r["family"], r["table"], r["chain"]), []).append(r)
    return chains


def set_lookups(rule: dict[str, Any]) -> int:
    """The set and map look-ups in a listed rule: iptables' ``-m set`` matches (``xt match set``)
    and nft's ``@set`` references, each counted once per rule evaluated (a look-up behind a match
    that failed first is counted too: an upper bound)."""
    text = json.dumps(rule["expr"])
    return text.count('{"xt": {"type": "match", "name": "set"}}') + text.count('"@')


def traced_costs(lines: Iterable[str], chains: dict[ChainKey, list[dict[str, Any]]], marker: str = TRACE_TABLE) -> list[dict[str, int]]:
    """The cost of each packet in ``lines`` (``nft monitor trace`` output, handles on), in the
    order they came: rules evaluated, set look-ups in those rules (:func:`set_lookups`), jumps
    taken and counters reached (rules that matched with a ``counter``: iptables-nft gives every
    rule one), in every table but ``marker``, the table whose chain marks the packets for the
    trace before any other chain sees them.

    A packet starts with its ``packet:`` event in ``marker`` (the kernel reuses a trace id for a
    later packet of the same flow; events of packets in flight at once differ by id). The kernel
    reports only the rules that matched; in each visit of a chain the rules evaluated are those
    up to the last one that matched when it ended the visit (a verdict: ``accept``, ``drop``,
    ``return``) and every rule of the chain when the packet fell off its end (no event: the next
    one is in a calling chain, or the base chain's ``policy``). ``chains``:
    :func:`listed_chains` of the same ruleset (handles identify the rules)."""
    packets: list[list[tuple[ChainKey, str]]] = []
    current: dict[str, int] = {}  # trace id -> its packet's index in packets
    for line in lines:
        event = _TRACE_EVENT.match(line)
        if event is None:
            continue
        if event["table"] == marker:
            if event["rest"].startswith("packet:"):
                current[event["id"]] = len(packets)
                packets.append([])
        elif event["id"] in current:
            packets[current[event["id"]]].append(((event["family"], event["table"], event["chain"]), event["rest"]))
    return [_packet_cost(events, chains) for events in packets]


def _packet_cost(events: list[tuple[ChainKey, str]], chains: dict[ChainKey, list[dict[str, Any]]]) -> dict[str, int]:
    """:func:`traced_costs` of one packet's events (chain, the event after the chain's name)."""
    cost = {"rules": 0, "lookups": 0, "jumps": 0, "counters": 0}
    stack: list[list[Any]] = []  # [chain key, rules evaluated so far in this visit]

    def leave(fell_off: bool = True) -> None:
        key, pos = stack.pop()
        rules = chains[key] if fell_off else chains[key][:pos]
        cost["rules"] += len(rules)
        cost["lookups"] += sum(set_lookups(r) for r in rules)

    for key, rest in events:
        rule = _TRACE_RULE.match(rest)
        if rest.startswith("policy "):
            while stack and stack[-1][0] != key:
                leave()  # fell off the end
            if stack:
                leave()
            continue
        if rule is None:
            continue
        while stack and stack[-1][0] != key:
            leave()
        if not stack:
            stack.append([key, 0])
        handles = [r["handle"] for r in chains[key]]
        stack[-1][1] = handles.index(int(rule["handle"])) + 1
        cost["counters"] += any("counter" in e for e in chains[key][stack[-1][1] - 1]["expr"])
        verdict = rule["verdict"].split()
        if verdict[0] in ("jump", "goto"):
            cost["jumps"] += 1
            if verdict[0] == "goto":
                leave(fell_off=False)
            stack.append([(key[0], key[1], verdict[1]), 0])
        elif verdict[0] == "return":
            leave(fell_off=False)
        elif verdict[0] in ("accept", "drop"):
            while stack:
                leave(fell_off=False)
    while stack:
        leave()
    return cost


def netns_ruleset(netns_name: str) -> list[dict[str, Any]]:
    """``nft -j list ruleset`` inside ``netns_name`` (iptables-nft's tables included)."""
    listed = subprocess.run(["ip", "netns", "exec", netns_name, "nft", "-j", "list", "ruleset"], capture_output=True, text=True, check=True)
    return json.loads(listed.stdout)["nftables"]


def trace_connection(sandbox: Sandbox, node: str, client: str, server: str, port: int) -> dict[str, Any]:
    """What one connection ``client`` -> ``server``:``port`` (connect, then close with a reset,
    as the load does) costs in every ruleset of ``node``'s namespace, traced by the kernel
    (:func:`traced_costs`): ``first``, its first packet's cost (the SYN: the new connection's
    walk); ``later``, the rules each later packet evaluated, in order. A table of ours marks the
    pair's packets for ``nft monitor trace`` at prerouting, before any other chain, and goes
    again after. Raises RuntimeError when the first packet was not traced."""
    ns = sandbox.node_netns(node)
    src, dst = (sandbox.pods[k].addresses("ipv4")[0] for k in (client, server))
    chains = listed_chains(netns_ruleset(ns))
    marker = (f"add table ip {TRACE_TABLE}\n"
              f"add chain ip {TRACE_TABLE} pair {{ type filter hook prerouting priority -400; }}\n"
              f"add rule ip {TRACE_TABLE} pair ip saddr {src} ip daddr {dst} tcp dport {port} meta nftrace set 1\n"
              f"add rule ip {TRACE_TABLE} pair ip saddr {dst} ip daddr {src} tcp sport {port} meta nftrace set 1\n")
    subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=marker, text=True, check=True)
    try:
        with netns.entered(sandbox.pod_netns[server]):
            listener = socket.create_server(("0.0.0.0", port))
        with listener, TraceMonitor(ns) as monitor:
            with netns.entered(sandbox.pod_netns[client]):
                sock = socket.socket()
            with sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.settimeout(2.0)
                sock.connect((dst, port))
                listener.settimeout(2.0)
                listener.accept()[0].close()
            lines = list(monitor.lines(0.5))
    finally:
        subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "ip", TRACE_TABLE], check=True)
    costs = traced_costs(lines, chains)
    if not costs:
        raise RuntimeError(f"no packet {src} -> {dst}:{port} was traced in {ns}")
    return {"first": costs[0], "later": [c["rules"] for c in costs[1:]]}


# ---- the real kube-router's rules --------------------------------------------------------------

def kube_router_rules(sandbox: Sandbox, cluster, model: RuleModel, workers: int, timeout: float = 900.0) -> dict[str, float]:
    """Have the real kube-router (v2.1.0, built by ``bash .ci/install --test``) write its own
    rules for ``cluster`` into ``sandbox``'s node namespace, as on a node: a control plane holds
    the whole cluster (created through the API by ``tools/k8s/loader`` with ``workers``
    requests at once, as ``kube_router_side_by_side.py`` loads it: every pod with ``status.hostIP`` its node's
    address, the sandbox node's being the one built here), kube-router starts against it and
    runs until its rules are complete (every local pod has its ``KUBE-POD-FW-*`` chain and every
    pod a policy selects jumps to a policy chain), then it and the control plane stop; its
    iptables rules and ipsets stay. Returns the seconds each step took. Raises ControlPlaneError
    when kube-router does not get there within ``timeout`` seconds."""
    from kube_router_side_by_side import kube_router_chains, load_objects, namespace_object, node_object, pod_api_object

    from nftpolicy.agent.testbed.controlplane import ControlPlane, ControlPlaneError
    from nftpolicy.agent.testbed.nodedaemons import KubeRouters

    want = {"pod": sum(1 for p in sandbox.pods.values() if p.node == synthetic.NODE), "isolated": len({c.pod for c in model.pod_chains})}
    took: dict[str, float] = {}
    with ControlPlane() as cp:
        took["load_s"] = sum(load_objects(cp, [*(node_object(n) for n in cluster.nodes.values()),
                                               *(namespace_object(n) for n in cluster.namespaces.values()),
                                               *(synthetic.policy_object(p) for p in cluster.policies.values()),
                                               *(pod_api_object(p, cluster) for p in cluster.pods.values())], workers).values())
        log(f"kube-router: {len(cluster.pods)} pods and {len(cluster.policies)} policies loaded through the API in {took['load_s']:.0f} s")
        routers = KubeRouters(sandbox, cp)
        started = time.monotonic()
        try:
            routers.start()
            while True:
                routers.wait_synced(timeout=timeout)
                chains = kube_router_chains(routers.iptables_save(synthetic.NODE))
                if (chains["pod"], chains["isolated"]) == (want["pod"], want["isolated"]):
                    break
                if time.monotonic() - started > timeout:
                    raise ControlPlaneError(f"kube-router's chains {chains} are not {want} after {timeout:.0f} s")
        finally:
            routers.close()
        took["sync_s"] = time.monotonic() - started
        log(f"kube-router: rules complete {took['sync_s']:.1f} s after its start ({want['pod']} pod chains, {want['isolated']} with a policy)")
    return took


# ---- load ----------------------------------------------------------------------------------------

def _fork(body) -> tuple[int, int]:
    """Run ``body() -> dict`` in a child process; returns (pid, read end of its result pipe)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 0
        try:
            result = body()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            result, code = {"error": repr(exc)}, 1
        os.write(write, json.dumps(result).encode())
        os._exit(code)
    os.close(write)
    return pid, read


def _collect(pid: int, fd: int) -> dict:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b"{}")


def _server(pod_netns: str, port: int, until: float) -> dict:
    netns.enter_thread(os.open(f"{netns.NETNS_DIR}/{pod_netns}", os.O_RDONLY))
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(65535)
    srv.settimeout(0.2)
    accepted = 0
    while time.monotonic() < until:
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        conn.close()
        accepted += 1
    return {"accepted": accepted}


def _client(pod_netns: str, address: str, port: int, start: float, count_from: float, end: float) -> dict:
    netns.enter_thread(os.open(f"{netns.NETNS_DIR}/{pod_netns}", os.O_RDONLY))
    linger = struct.pack("ii", 1, 0)
    counted = failed = 0
    while time.monotonic() < start:
        time.sleep(0.001)
    while True:
        now = time.monotonic()
        if now >= end:
            break
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        sock.settimeout(3.0)
        try:
            sock.connect((address, port))
            ok = True
        except OSError:
            ok = False
        sock.close()
        if now >= count_from:
            counted += ok
            failed += not ok
    return {"connections": counted, "failed": failed}


def measure(sandbox: Sandbox, client: str, server: str, port: int, clients: int, warmup: float, seconds: float) -> dict:
    """New connections per second from ``client`` to ``server``:``port`` in one sandbox."""
    address = sandbox.pods[server].addresses("ipv4")[0]
    start = time.monotonic() + 0.3
    count_from, end = start + warmup, start + warmup + seconds
    srv = _fork(lambda: _server(sandbox.pod_netns[server], port, end + 0.5))
    workers = [_fork(lambda: _client(sandbox.pod_netns[client], address, port, start, count_from, end)) for _ in range(clients)]
    results = [_collect(*w) for w in workers]
    served = _collect(*srv)
    errors = [r["error"] for r in results + [served] if "error" in r]
    if errors:
        raise RuntimeError(f"load generator failed: {errors[0]}")
    total = sum(r["connections"] for r in results)
    return {"rate": total / seconds, "failed": sum(r["failed"] for r in results)}


def paired(runs: dict[str, list[float]], variant: str, base: str) -> dict[str, Any]:
    """``variant``'s rate over ``base``'s, round by round (the two ran back to back in each
    round): their median and every round's, to show how much one round varies."""
    ratios = [v / b for v, b in zip(runs[variant], runs[base])]
    return {"median": statistics.median(ratios), "rounds": ratios}


# ---- main ----------------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    cpu = None
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), None)
    return {"kernel": platform.release(), "cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version()}


def print_costs(out, costs: dict[str, dict[str, Any]]) -> None:
    print("cost of one new connection (the table walk; \"traced\": the loaded ruleset, traced by the kernel): "
          "rules evaluated / set and map look-ups / jumps / counters; and the rules each later packet of it evaluates", file=out)
    print(f"  {'ruleset':<26} {'ingress':>12} {'egress':>12} {'whole walk':>12} {'later packets':>14}", file=out)
    for name, cost in costs.items():
        cells = ["{rules}/{lookups}/{jumps}/{counters}".format(**cost[d]) if d in cost else "-" for d in ("ingress", "egress", "both")]
        later = cost.get("later")
        cells.append("-" if not later else f"{min(later)}" if min(later) == max(later) else f"{min(later)}-{max(later)}")
        print(f"  {name:<26} {cells[0]:>12} {cells[1]:>12} {cells[2]:>12} {cells[3]:>14}", file=out)


def print_table(out, report: dict[str, Any]) -> None:
    r = report
    print_costs(out, r["costs"])
    print(f"packet path: new TCP connections/s, {r['client']} -> {r['server']} TCP/{r['port']} on {r['node']}", file=out)
    print(f"cluster: {r['pods']} pods, {r['policies']} policies; {r['local_pods']} local pods, "
          f"{r['isolated_pods']} isolated, {r['policy_chains']} policy chains on the node", file=out)
    print(f"rulesets: nft {r['nft_rules']} rules + {r['nft_elements']} set/map elements; iptables variant "
          f"{r['iptables_rules']} rules + {r['ipset_elements']} ipset elements", file=out)
    print(f"{r['rounds']} rounds x {r['seconds']} s (+{r['warmup']} s warm-up), {r['clients']} client processes, median:", file=out)
    print(f"load average at the end: {r['load_average']:.2f} (2 cores shared with other work)", file=out)
    print(f"  {'variant':<22} {'conn/s':>9} {'vs none':>8} {'vs conntrack':>13}   runs", file=out)
    ct = r["results"]["conntrack"]["median"]
    for name in r["variants"]:
        v = r["results"][name]
        print(f"  {name:<22} {v['median']:>9.0f} {v['ratio']:>7.1%} {v['median'] / ct:>12.1%}   {' '.join(f'{x:.0f}' for x in v['runs'])}", file=out)
    t = r["target"]

    def spread(p: dict[str, Any]) -> str:
        return f"paired per round: median {p['median']:.1%}, rounds {min(p['rounds']):.1%}..{max(p['rounds']):.1%}"
    print(f"nft keeps {t['nft_vs_conntrack']:.1%} of the conntrack-only rate (target {TARGET_RATIO:.0%}: "
          f"{'met' if t['kept'] else 'MISSED'}; {spread(t['nft_vs_conntrack_paired'])}) and {t['nft_vs_none']:.1%} of the "
          f"no-rules rate; with the hold of unknown pods nft-hold runs at {t['hold_vs_nft']:.1%} of nft "
          f"({spread(t['hold_vs_nft_paired'])}); without counters nft runs at {t['no_counters_vs_nft']:.1%} of nft with them "
          f"({spread(t['no_counters_vs_nft_paired'])}); with 50 policies selecting the destination it keeps {t['fifty_vs_one']:.1%} of the one-policy rate "
          f"(target {POLICIES_TARGET:.0%}: {'met' if t['fifty_kept'] else 'MISSED'}; {spread(t['fifty_vs_one_paired'])}); "
          f"nft / iptables-nft = {t['nft_vs_iptables_nft']:.2f}x, nft / iptables-legacy = {t['nft_vs_iptables_legacy']:.2f}x "
          f"({'beats' if t['beats'] else 'does NOT beat'} the iptables variant)", file=out)
    if "nft_vs_kube_router" in t:
        kr, ours = r["costs"]["kube-router (traced)"]["both"], r["costs"]["nft (traced)"]["both"]
        print(f"beside the real kube-router v2.1.0 ({r['kube_router']['rules']} iptables rules, complete "
              f"{r['kube_router']['sync_s']:.1f} s after its start): nft / kube-router = {t['nft_vs_kube_router']:.2f}x the new-connection rate "
              f"({spread(t['nft_vs_kube_router_paired'])}); a new connection's first packet evaluates {ours['rules']} rules on nft "
              f"against {kr['rules']} on kube-router ({kr['rules'] / ours['rules']:.1f}x), {ours['jumps']} jumps against {kr['jumps']}; "
              f"each later packet {max(r['costs']['nft (traced)']['later'])} against {min(r['costs']['kube-router (traced)']['later'])}-"
              f"{max(r['costs']['kube-router (traced)']['later'])}", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="counted seconds per measurement (default %(default)s)")
    ap.add_argument("--warmup", type=float, default=0.5, help="uncounted seconds before each (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds over the variants (default %(default)s)")
    ap.add_argument("--clients", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="client processes (default: cores - 1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON on stdout (the table goes to stderr)")
    ap.add_argument("--costs-only", action="store_true", help="print the deterministic costs of our rule model only (no sandbox, no load)")
    ap.add_argument("--no-kube-router", action="store_true", help="leave the real kube-router out (no control plane: 2-3 minutes less)")
    ap.add_argument("--workers", type=int, default=16, help="requests at once that load the cluster into kube-router's API server (default %(default)s)")
    args = ap.parse_args(argv)
    variants = tuple(v for v in VARIANTS if not (args.no_kube_router and v == "kube-router"))
    if args.seconds * args.rounds * len(variants) > 600:
        ap.error("keep the run under 10 minutes of load (seconds x rounds x variants <= 600)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = sys.stderr if args.json else sys.stdout

    syn = synthetic.generate(pods=10000, policies=1000, namespaces=100, node_pods=110, seed=args.seed)
    cluster = syn.cluster
    model = build_rule_model(cluster, synthetic.NODE)
    client, server, port = choose_pair(cluster, model)
    local = [p for p in cluster.pods.values() if p.node == synthetic.NODE and p.enforceable]
    table = layout.table(model)
    chains, ipt_rules = iptables_render.filter_table(table, "ipv4")
    src, dst = (cluster.pods[k].addresses("ipv4")[0] for k in (client, server))
    fifty = layout.table(build_rule_model(with_selecting_policies(cluster, model, client, server, port, 50), synthetic.NODE))
    costs = {"nft": path_cost(table, src, dst, port), "nft-no-counters": path_cost(without_counters(table), src, dst, port),
             "nft-50-policies": path_cost(fifty, src, dst, port),
             "iptables variant": path_cost(iptables_shaped(without_counters(table)), src, dst, port, "FORWARD")}
    report: dict[str, Any] = {
        "machine": machine(), "node": synthetic.NODE, "pods": len(cluster.pods), "policies": len(cluster.policies),
        "local_pods": len(local), "isolated_pods": len(model.pod_chains), "policy_chains": len(model.policy_chains),
        "client": client, "server": server, "port": port, "rounds": args.rounds, "seconds": args.seconds,
        "warmup": args.warmup, "clients": args.clients, "variants": list(variants),
        "nft_rules": sum(len(c.rules) for c in table.chains),
        "nft_elements": sum(len(s.elements) for s in table.sets) + sum(len(m.elements) for m in table.maps),
        "iptables_rules": len(ipt_rules),
        "ipset_elements": sum(len(iptables_render.ipset_elements(s)) for s in model.sets if s.family == "ipv4"),
        "costs": costs,
    }
    if args.costs_only:
        print_costs(out, costs)
        return 0
    node_addresses = {n.name: n.addresses for n in cluster.nodes.values()}
    runs: dict[str, list[float]] = {v: [] for v in variants}
    failed: dict[str, int] = {v: 0 for v in variants}
    with contextlib.ExitStack() as stack:
        sandboxes = {}
        for variant in variants:
            dataplane = variant if variant.startswith(("iptables-", "kube-router")) else "nft"
            sandbox = stack.enter_context(Sandbox(local, (synthetic.NODE,), ("ipv4",), node_addresses, timeout=1.0, dataplane=dataplane))
            if variant == "kube-router":
                report["kube_router"] = kube_router_rules(sandbox, cluster, model, args.workers)
                saved = subprocess.run(["ip", "netns", "exec", sandbox.node_netns(synthetic.NODE), "iptables-save"],
                                       capture_output=True, text=True, check=True).stdout
                report["kube_router"]["rules"] = sum(line.startswith("-A ") for line in saved.splitlines())
            elif variant == "nft-50-policies":
                sandbox.apply(with_selecting_policies(cluster, model, client, server, port, 50))
            elif variant in ("nft", "iptables-nft", "iptables-legacy"):
                sandbox.apply(cluster)
            elif variant == "nft-hold":
                placed = sandbox.with_sandbox_pods(cluster)
                ranges = sorted({str(ipaddress.ip_network(f"{ip}/16", strict=False)) for p in placed.pods.values()
                                 if p.node == synthetic.NODE for ip in p.addresses("ipv4")})
                config = dataclasses.replace(sandbox.config, unknown_pods="hold", pod_cidrs=tuple(ranges))
                sandbox.node_dataplane(synthetic.NODE).run(replacing(layout.table(build_rule_model(placed, synthetic.NODE, config))))
            elif variant == "nft-no-counters":
                node_model = build_rule_model(sandbox.with_sandbox_pods(cluster), synthetic.NODE, sandbox.config)
                sandbox.node_dataplane(synthetic.NODE).run(replacing(without_counters(layout.table(node_model))))
            elif variant != "none":
                NftDataplane(BENCH_TABLE, sandbox.node_netns(synthetic.NODE)).run(conntrack_only())
            netns.write_sysctl(sandbox.pod_netns[client], "net.ipv4.ip_local_port_range", "1024 65000")
            # A server stalled by the machine's other work must not overflow its accept queue.
            netns.write_sysctl(sandbox.pod_netns[server], "net.core.somaxconn", "65535")
            sandboxes[variant] = sandbox
            log(f"built sandbox {variant} ({len(local)} pods){'' if variant == 'none' else ', ruleset loaded'}")
            if variant in TRACED:
                traced = trace_connection(sandbox, synthetic.NODE, client, server, port)
                costs[f"{variant} (traced)"] = {"both": traced["first"], "later": traced["later"]}
                log(f"{variant}: one connection traced: its first packet {traced['first']}, the rules of each later one {traced['later']}")
        for i in range(args.rounds):
            order = variants[i % len(variants):] + variants[:i % len(variants)]
            for variant in order:
                result = measure(sandboxes[variant], client, server, port, args.clients, args.warmup, args.seconds)
                runs[variant].append(result["rate"])
                failed[variant] += result["failed"]
                log(f"round {i + 1} {variant}: {result['rate']:.0f} conn/s" + (f", {result['failed']} failed" if result["failed"] else ""))
    total = {v: sum(r) * args.seconds for v, r in runs.items()}
    if any(failed[v] > 0.01 * max(total[v], 1) for v in variants):
        raise SystemExit(f"connections failed during the measurement: {failed} (the pair must be allowed)")
    report["failed"] = failed
    none = statistics.median(runs["none"])
    report["results"] = {v: {"median": statistics.median(r), "ratio": statistics.median(r) / none, "runs": r} for v, r in runs.items()}
    med = {v: report["results"][v]["median"] for v in variants}
    kept, fifty_paired = paired(runs, "nft", "conntrack"), paired(runs, "nft-50-policies", "nft")
    report["load_average"] = os.getloadavg()[0]
    report["target"] = {
        "nft_vs_none": med["nft"] / none, "kept": med["nft"] / med["conntrack"] >= TARGET_RATIO,
        "nft_vs_conntrack": med["nft"] / med["conntrack"], "nft_vs_conntrack_paired": kept,
        "fifty_vs_one": med["nft-50-policies"] / med["nft"], "fifty_vs_one_paired": fifty_paired,
        "hold_vs_nft": med["nft-hold"] / med["nft"], "hold_vs_nft_paired": paired(runs, "nft-hold", "nft"),
        "no_counters_vs_nft": med["nft-no-counters"] / med["nft"], "no_counters_vs_nft_paired": paired(runs, "nft-no-counters", "nft"),
        "fifty_kept": med["nft-50-policies"] / med["nft"] >= POLICIES_TARGET,
        "nft_vs_iptables_nft": med["nft"] / med["iptables-nft"], "nft_vs_iptables_legacy": med["nft"] / med["iptables-legacy"],
        "beats": med["nft"] > max(med["iptables-nft"], med["iptables-legacy"]),
    }
    if "kube-router" in variants:
        report["target"]["nft_vs_kube_router"] = med["nft"] / med["kube-router"]
        report["target"]["nft_vs_kube_router_paired"] = paired(runs, "nft", "kube-router")
    print_table(out, report)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
