#!/usr/bin/env python3
"""Every kind of libnftables call the agent makes, from several threads at once, against one
table: does every answer parse, does the process live?

Usage (as root)::

    .venv/bin/python bench/libnftables_threads.py                        # this tree, 60 s
    .venv/bin/python bench/libnftables_threads.py --baseline /work/main  # another tree first, side by side
    .venv/bin/python bench/libnftables_threads.py --seconds 12 --netns NS --json   # one run (tests/test_libnftables_owner.py)

``--threads`` threads per kind of call (default 3), each back to back for ``--seconds``,
through the tree's own :class:`~nftpolicy.agent.dataplane.nftables.NftDataplane` (a tree runs
in a process of its own, its ``.venv/bin/python``: libnftables' state is per process): a full
replace of the table (the example ``examples/shop`` rendered for node1: pod chains with
counters, and a concatenated set, whose type libnftables' JSON output names with ``strtok()``),
its dry run (``check``: the refused-batch search's), an element-only commit (one pod address:
nf_tables netlink where the tree has it, no libnftables), an incremental commit through
libnftables (one network into an interval set added to the table: the kept context), the DNS
hold's timed element commit (the other kept context, into a domain set added to the table), a whole listing, a terse
listing, a read of the rule counters
(:meth:`~nftpolicy.agent.daemon.rulecounters.RuleCounters.read`; in a tree before it
``collect``, which listed the table at each scrape), the has-table look-up, the timed
elements' listing, the feature probe. An answer counts as good when its JSON parsed and says
what the table holds (every listing has the base chains, the counters name the example's
pods, the probe finds nothing missing). Printed per tree: good and bad answers per kind and how
the process ended (libnftables 1.0.6 without one owner: SIGABRT, ``set_dtype_json: Assertion
'__out' failed``, within seconds).

Safety: every nft command runs in the ``nftp-b<tag>-*`` network namespace this script creates
(or the one ``--netns`` names, which its caller made), deleted in a ``finally``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from churn import machine, run_namespaces  # noqa: E402

from nftpolicy.agent.dataplane import netns  # noqa: E402

EXAMPLE = ROOT / "examples" / "shop"
DOMAIN_SET = "KUBE-DNS-BENCH"  # a domain set added to the example's table, for the DNS hold's commits
INTERVAL_SET = "KUBE-CIDR-BENCH"  # an interval set added to it, for libnftables' incremental commits
TABLE = "nftpolicy"


def calls(ns: str) -> dict[str, Callable[[int], bool]]:
    """Kind -> one call of it (given its count so far), True when its answer is what the table holds."""
    from nftpolicy.agent.daemon.manifestfiles import load_cluster
    from nftpolicy.agent.daemon.rulecounters import RuleCounters
    from nftpolicy.agent.dataplane.nftables import NftDataplane
    from nftpolicy.translators import layout, transaction
    from nftpolicy.translators.noderender import NodeRenderer
    from nftpolicy.translators.rules import AddressSet, Config, TimedAddress

    cluster, errors = load_cluster([str(EXAMPLE)])
    assert not errors, errors
    renderer = NodeRenderer("node1", Config(table=TABLE)).load(cluster)
    renderer.take_changes()
    table = layout.table(renderer.model(ordered=False))
    table = dataclasses.replace(table, sets=(*table.sets, AddressSet(DOMAIN_SET, "ipv4", "domain", (), "a domainNames peer's"),
                                             AddressSet(INTERVAL_SET, "ipv4", "interval", (), "ipBlock networks")))
    dataplane = NftDataplane(TABLE, ns)
    dataplane.run(transaction.replacing(table))
    pods = next(s.name for s in table.sets if s.family == "ipv4" and s.kind == "addr")
    domain = DOMAIN_SET
    try:
        counters = RuleCounters(dataplane, renderer.chain_owners, 1.0)
        read = counters.read
    except TypeError:  # a tree before the counters' reader: each collect() lists the table
        counters = RuleCounters(dataplane, renderer.chain_owners)  # type: ignore[call-arg]
        read = lambda: None  # noqa: E731
    base = {"KUBE-ROUTER-INPUT", "KUBE-ROUTER-FORWARD", "KUBE-ROUTER-OUTPUT"}

    def replace(_: int) -> bool:
        dataplane.run(transaction.replacing(table))
        return True

    def check(_: int) -> bool:
        getattr(dataplane, "check", dataplane.run)(transaction.replacing(table))  # a tree before the dry run: a replace
        return True

    def elements(i: int) -> bool:
        tx = transaction.Transaction(TABLE, table.priority)
        tx.add(transaction.Elements(pods, (f"192.0.2.{i % 250 + 1}",)))
        dataplane.run(tx)
        return True

    def delta(i: int) -> bool:
        tx = transaction.Transaction(TABLE, table.priority)
        tx.add(transaction.Elements(INTERVAL_SET, (f"10.{2 * (i % 120)}.0.0/16",)))  # never adjacent: none merges
        dataplane.run(tx)
        return True

    def timed(i: int) -> bool:
        dataplane.add_timed_elements([(domain, TimedAddress(f"198.51.100.{i % 250 + 1}", 60))])
        return True

    def chains(listed: list[dict[str, Any]]) -> set[str]:
        return {o["chain"]["name"] for o in listed if "chain" in o}

    def counted(_: int) -> bool:
        read()
        return any(sample.labels.get("namespace") == "shop" for family in counters.collect() for sample in family.samples)

    return {
        "replace": replace, "check": check, "elements": elements, "delta": delta, "timed": timed,
        "listing": lambda _: base <= chains(dataplane.listing()),
        "terse": lambda _: base <= chains(dataplane.listing(terse=True)),
        "counters": counted,
        "has_table": lambda _: dataplane.has_table(),
        "timed_elements": lambda _: domain in dataplane.timed_elements(),
        "probe": lambda _: dataplane.missing_features() == [],
    }


def hammer(ns: str, seconds: float, per_kind: int) -> dict[str, dict[str, Any]]:
    """Run every kind of :func:`calls` in ``per_kind`` threads of its own for ``seconds``: kind
    -> good, bad and the first bad answer's reason."""
    kinds = calls(ns)
    results = {kind: {"good": 0, "bad": 0, "first_bad": ""} for kind in kinds}
    deadline = time.monotonic() + seconds

    def run(kind: str) -> None:
        figures = results[kind]
        while time.monotonic() < deadline:
            try:
                good = kinds[kind](figures["good"] + figures["bad"])
                reason = "" if good else "an answer without what the table holds"
            except Exception as exc:  # noqa: BLE001 - every failure is a figure here
                good, reason = False, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            figures["good" if good else "bad"] += 1
            figures["first_bad"] = figures["first_bad"] or reason

    threads = [threading.Thread(target=run, args=(kind,), name=f"{kind}-{i}") for kind in kinds for i in range(per_kind)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def one_tree(tree: Path, ns: str, seconds: float, per_kind: int) -> dict[str, Any]:
    """This script in ``tree``'s Python (its own libnftables dataplane), in a process of its own."""
    started = time.monotonic()
    proc = subprocess.run([str(tree / ".venv" / "bin" / "python"), __file__, "--netns", ns, "--seconds", str(seconds),
                           "--threads", str(per_kind), "--json"], capture_output=True, text=True)
    lasted = time.monotonic() - started
    if proc.returncode != 0:
        how = f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        return {"ended": f"{how} after {lasted:.1f} s", "why": last[:200]}
    return {"ended": f"lived {seconds:g} s", "kinds": json.loads(proc.stdout)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of calls (default %(default)s)")
    parser.add_argument("--threads", type=int, default=3, help="threads per kind of call (default %(default)s)")
    parser.add_argument("--baseline", type=Path, action="append", default=[], help="another tree, run first (repeatable)")
    parser.add_argument("--netns", help="run here, in this process, in this namespace (made by the caller)")
    parser.add_argument("--json", action="store_true", help="with --netns: print the figures as JSON")
    args = parser.parse_args()
    if args.netns:
        results = hammer(args.netns, args.seconds, args.threads)
        print(json.dumps(results) if args.json else results)
        return 0
    trees = [*args.baseline, ROOT]
    names = run_namespaces("lib", len(trees))
    runs = {}
    try:
        netns.create(names)
        for tree, ns in zip(trees, names):
            print(f"[{tree}] {args.seconds:g} s ...", file=sys.stderr, flush=True)
            runs[tree.name or str(tree)] = one_tree(tree, ns, args.seconds, args.threads)
    finally:
        netns.delete(names)
    print(f"libnftables calls of every kind, {args.threads} threads each, for {args.seconds:g} s ({machine()})")
    kinds = next((list(r["kinds"]) for r in runs.values() if "kinds" in r), [])
    print("".ljust(24) + "".join(f"{name:>26}" for name in runs))
    print("process".ljust(24) + "".join(f"{r['ended']:>26}" for r in runs.values()))
    for kind in kinds:
        cells = [f"{r['kinds'][kind]['good']:,} good, {r['kinds'][kind]['bad']:,} bad" if "kinds" in r else "-" for r in runs.values()]
        print(f"{kind} answers".ljust(24) + "".join(f"{c:>26}" for c in cells))
    for name, r in runs.items():
        if r.get("why"):
            print(f"{name}: {r['why']}")
        for kind, figures in r.get("kinds", {}).items():
            if figures["first_bad"]:
                print(f"{name}: {kind}: first bad answer: {figures['first_bad']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
