#!/usr/bin/env python3
"""Benchmark: the packet path. New TCP connections per second between two sandbox pods on one
node, with no rules, with connection tracking only, with the nft ruleset (one policy and 50
selecting the server) and with the iptables variant (iptables-nft and iptables-legacy), side by
side in one run.

Usage (as root)::

    .venv/bin/python bench/packet_path.py                 # table on stdout
    .venv/bin/python bench/packet_path.py --json          # + JSON on stdout (the table goes to stderr)
    .venv/bin/python bench/packet_path.py --seconds 2 --rounds 3

The cluster is ``synthetic.generate(10,000 pods, 1,000 policies, 100 namespaces)`` with 110 pods
on ``node-0`` (see ``synthetic.py``). One sandbox per variant is built with the same 110 local pods
(one network namespace per pod, routed through the node's namespace, as ``nftpolicy sandbox``
builds them):

* ``none``: no ruleset at all (so no connection tracking in the node's namespace either);
* ``conntrack``: one table with one rule, ``ct state established,related accept`` in the forward
  hook: the connection tracking that every stateful policy needs (kube-router's rules too) and
  that every node running kube-proxy has anyway;
* ``nft``: our table (``transaction.full``, through libnftables);
* ``nft-no-counters``: the same table without its ``counter`` statements (each allow rule, each
  reject and each Deny has one), to measure what counting costs;
* ``nft-50-policies``: the same with 49 more policies that select the server and allow the pair
  (the first allow ends the walk through the pod chain);
* ``iptables-nft`` and ``iptables-legacy``: the iptables variant of the same rule model, with its
  ipsets, loaded with that ``iptables-restore``.

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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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

VARIANTS = ("none", "conntrack", "nft", "nft-no-counters", "nft-50-policies", "iptables-nft", "iptables-legacy")
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


def traced_cost(lines: Iterable[str], chains: dict[ChainKey, list[dict[str, Any]]], skip_tables: Iterable[str] = (TRACE_TABLE,)) -> dict[str, int]:
    """The cost of the first packet in ``lines`` (``nft monitor trace`` output, handles on), in
    every table but ``skip_tables``: rules evaluated, set look-ups in those rules
    (:func:`set_lookups`), jumps taken and counters reached (rules that matched with a
    ``counter``: iptables-nft gives every rule one).

    The kernel reports only the rules that matched; in each visit of a chain the rules evaluated
    are those up to the last one that matched when it ended the visit (a verdict: ``accept``,
    ``drop``, ``return``) and every rule of the chain when the packet fell off its end (no event:
    the next one is in a calling chain, or the base chain's ``policy``). ``chains``:
    :func:`listed_chains` of the same ruleset (handles identify the rules)."""
    skip = set(skip_tables)
    cost = {"rules": 0, "lookups": 0, "jumps": 0, "counters": 0}
    stack: list[list[Any]] = []  # [chain key, rules evaluated so far in this visit]

    def leave(fell_off: bool = True) -> None:
        key, pos = stack.pop()
        rules = chains[key] if fell_off else chains[key][:pos]
        cost["rules"] += len(rules)
        cost["lookups"] += sum(set_lookups(r) for r in rules)

    packet = None
    for line in lines:
        event = _TRACE_EVENT.match(line)
        if event is None or event["table"] in skip:
            continue
        if packet is None:
            packet = event["id"]
        if event["id"] != packet:
            continue
        key: ChainKey = (event["family"], event["table"], event["chain"])
        rest = event["rest"]
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


def trace_new_connection(sandbox: Sandbox, node: str, client: str, server: str, port: int) -> dict[str, int]:
    """The cost of one new connection's first packet (the SYN ``client`` -> ``server``:``port``)
    through every ruleset of ``node``'s namespace, traced by the kernel (:func:`traced_cost`): a
    table of ours marks that SYN for ``nft monitor trace`` at prerouting, before any other
    chain, and goes again after."""
    ns = sandbox.node_netns(node)
    src, dst = (sandbox.pods[k].addresses("ipv4")[0] for k in (client, server))
    chains = listed_chains(netns_ruleset(ns))
    marker = (f"add table ip {TRACE_TABLE}\n"
              f"add chain ip {TRACE_TABLE} syn {{ type filter hook prerouting priority -400; }}\n"
              f"add rule ip {TRACE_TABLE} syn ip saddr {src} ip daddr {dst} tcp dport {port} tcp flags & (syn | ack) == syn meta nftrace set 1\n")
    subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=marker, text=True, check=True)
    try:
        with TraceMonitor(ns) as monitor:
            with netns.entered(sandbox.pod_netns[client]), socket.socket() as sock:
                sock.settimeout(2.0)
                with contextlib.suppress(OSError):  # no server listens: the SYN is what counts
                    sock.connect((dst, port))
            lines = list(monitor.lines(0.5))
    finally:
        subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "ip", TRACE_TABLE], check=True)
    if not any(f" {TRACE_TABLE} " in line for line in lines):
        raise RuntimeError(f"the SYN {src} -> {dst}:{port} was not traced in {ns}")
    return traced_cost(lines, chains)


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


def print_costs(out, costs: dict[str, dict[str, dict[str, int]]]) -> None:
    print("cost of one new connection (the table walk): rules evaluated / set and map look-ups / jumps / counters", file=out)
    print(f"  {'ruleset':<22} {'ingress':>16} {'egress':>16} {'whole walk':>16}", file=out)
    for name, cost in costs.items():
        cells = ["{rules}/{lookups}/{jumps}/{counters}".format(**cost[d]) if d in cost else "-" for d in ("ingress", "egress", "both")]
        print(f"  {name:<22} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16}", file=out)


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
          f"no-rules rate; without counters nft runs at {t['no_counters_vs_nft']:.1%} of nft with them "
          f"({spread(t['no_counters_vs_nft_paired'])}); with 50 policies selecting the destination it keeps {t['fifty_vs_one']:.1%} of the one-policy rate "
          f"(target {POLICIES_TARGET:.0%}: {'met' if t['fifty_kept'] else 'MISSED'}; {spread(t['fifty_vs_one_paired'])}); "
          f"nft / iptables-nft = {t['nft_vs_iptables_nft']:.2f}x, nft / iptables-legacy = {t['nft_vs_iptables_legacy']:.2f}x "
          f"({'beats' if t['beats'] else 'does NOT beat'} the iptables variant)", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="counted seconds per measurement (default %(default)s)")
    ap.add_argument("--warmup", type=float, default=0.5, help="uncounted seconds before each (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds over the variants (default %(default)s)")
    ap.add_argument("--clients", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="client processes (default: cores - 1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON on stdout (the table goes to stderr)")
    ap.add_argument("--costs-only", action="store_true", help="print the deterministic costs only (no sandbox, no load)")
    args = ap.parse_args(argv)
    variants = VARIANTS
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
            dataplane = variant if variant.startswith("iptables-") else "nft"
            sandbox = stack.enter_context(Sandbox(local, (synthetic.NODE,), ("ipv4",), node_addresses, timeout=1.0, dataplane=dataplane))
            if variant == "nft-50-policies":
                sandbox.apply(with_selecting_policies(cluster, model, client, server, port, 50))
            elif variant in ("nft", "iptables-nft", "iptables-legacy"):
                sandbox.apply(cluster)
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
        "no_counters_vs_nft": med["nft-no-counters"] / med["nft"], "no_counters_vs_nft_paired": paired(runs, "nft-no-counters", "nft"),
        "fifty_kept": med["nft-50-policies"] / med["nft"] >= POLICIES_TARGET,
        "nft_vs_iptables_nft": med["nft"] / med["iptables-nft"], "nft_vs_iptables_legacy": med["nft"] / med["iptables-legacy"],
        "beats": med["nft"] > max(med["iptables-nft"], med["iptables-legacy"]),
    }
    print_table(out, report)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
