#!/usr/bin/env python3
"""What a namespace label change costs, from the change to the kernel, this tree beside others.

Usage (as root)::

    .venv/bin/python bench/namespace_change.py                          # 10k and 150k pods
    .venv/bin/python bench/namespace_change.py --baseline /work/main    # and main's, side by side

For each size (``synthetic.py`` clusters, as ``scale.py`` builds them) and each tree (its own
``.venv/bin/python``, so its own ``nftpolicy`` package), a subprocess loads the renderer and
commits its full table into a network namespace it creates, then times ``--changes`` namespace
label changes (an application namespace moves to another team, so namespaceSelectors on
``team`` start or stop matching it, as in ``scale.py``), each as the agent's incremental sync
does it: the renderer's update, its change list, the transaction and its commit through the
tree's own dataplane (libnftables). It prints, side by side, p50 and p99 of the wall time from
the change to the end of the commit, of the part before the commit (render) and of the commit,
the CPU per change (mean and p99), the ratio to the first tree, and the load average (the
machine may be shared: CPU time is steadier than wall time on a busy machine). The waiting an
agent adds before a sync (its minimum sync interval, a sync under way) is not in it:
``churn.py`` measures that, in a real agent.

Safety: every nft command runs in the ``nftp-<tag>-*`` network namespace each subprocess
creates and deletes in a ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"10k": (10000, 1000, 100), "50k": (50000, 5000, 500), "150k": (150000, 10000, 1500)}  # pods, policies, namespaces


def worker(size: str, changes: int, seed: int) -> dict[str, float]:
    """In the tree whose Python runs this: the renderer's cost of ``changes`` namespace label changes."""
    sys.path.insert(0, str(ROOT / "bench"))
    import synthetic
    from scale import namespace_changes, percentile

    from nftpolicy.agent.daemon.memory import gc_paused
    from nftpolicy.agent.dataplane import netns
    from nftpolicy.agent.dataplane.nftables import NftDataplane
    from nftpolicy.translators import layout, transaction
    from nftpolicy.translators.delta import delta_transaction
    from nftpolicy.translators.model import Namespace
    from nftpolicy.translators.noderender import NodeRenderer
    from nftpolicy.translators.rules import Config

    pods, policies, namespaces = SIZES[size]
    cluster = synthetic.generate(pods=pods, policies=policies, namespaces=namespaces, seed=seed).cluster
    with gc_paused():
        renderer = NodeRenderer(synthetic.NODE).load(cluster)
        model = renderer.model(ordered=False)
    renderer.take_changes()
    ns = f"nftp-b{secrets.token_hex(2)}-nschange"
    netns.create([ns])
    try:
        dataplane = NftDataplane(Config().table, ns)
        dataplane.run(transaction.replacing(layout.table(model)))
        del model
        walls, renders, commits, cpus = [], [], [], []
        for name, labels in namespace_changes(cluster, changes, random.Random(seed)):
            started, cpu = time.monotonic(), time.process_time()
            renderer.set_namespace(name, Namespace(name, labels))
            tx = delta_transaction(Config(), renderer.take_changes())
            rendered = time.monotonic()
            if tx:
                dataplane.run(tx)
            committed = time.monotonic()
            walls.append((committed - started) * 1000)
            renders.append((rendered - started) * 1000)
            commits.append((committed - rendered) * 1000)
            cpus.append((time.process_time() - cpu) * 1000)
    finally:
        netns.delete([ns])
    return {"p50_ms": percentile(walls, 0.5), "p99_ms": percentile(walls, 0.99), "render_p50_ms": percentile(renders, 0.5),
            "render_p99_ms": percentile(renders, 0.99), "commit_p50_ms": percentile(commits, 0.5),
            "commit_p99_ms": percentile(commits, 0.99), "cpu_ms": sum(cpus) / len(cpus), "cpu_p99_ms": percentile(cpus, 0.99)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10k,150k", help="comma-separated subset of: " + ",".join(SIZES))
    parser.add_argument("--changes", type=int, default=200, help="namespace label changes timed per size (default %(default)s)")
    parser.add_argument("--baseline", type=Path, action="append", default=[], help="another tree, measured first (repeatable)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks delete the namespaces
    if args.worker:
        print(json.dumps(worker(args.worker, args.changes, args.seed)))
        return 0
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if unknown := [s for s in sizes if s not in SIZES]:
        parser.error(f"unknown size {unknown[0]!r} (one of {', '.join(SIZES)})")
    trees = [*args.baseline, ROOT]
    results: dict[str, dict[str, dict[str, float]]] = {}
    for size in sizes:
        for tree in trees:
            out = subprocess.run([str(tree / ".venv" / "bin" / "python"), __file__, "--worker", size, "--changes", str(args.changes),
                                  "--seed", str(args.seed)], check=True, capture_output=True, text=True).stdout
            results.setdefault(size, {})[tree.name] = json.loads(out.splitlines()[-1])
    print(f"namespace label change to the kernel: renderer + transaction + libnftables commit "
          f"({args.changes} changes; {os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())})")
    names = [t.name for t in trees]
    print("".ljust(42) + "".join(f"{n:>14}" for n in names) + ("   ratio last/first" if len(names) > 1 else ""))
    for size in sizes:
        for label, key in (("change to kernel p50 (ms)", "p50_ms"), ("change to kernel p99 (ms; target 15)", "p99_ms"),
                           ("  render p50 (ms)", "render_p50_ms"), ("  render p99 (ms)", "render_p99_ms"),
                           ("  commit p50 (ms)", "commit_p50_ms"), ("  commit p99 (ms)", "commit_p99_ms"),
                           ("CPU per change, mean (ms)", "cpu_ms"), ("CPU per change, p99 (ms)", "cpu_p99_ms")):
            row = [results[size][n][key] for n in names]
            print(f"{size} {label}".ljust(42) + "".join(f"{v:>14.2f}" for v in row) + (f"{row[-1] / row[0]:>19.2f}x" if len(row) > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
