#!/usr/bin/env python3
"""Benchmark: what a local pod create, delete or label change costs the renderer (issue 19, item 3).

Usage::

    .venv/bin/python bench/local_pods.py                   # 150k pods / 10k policies, 110 and 220 local pods
    .venv/bin/python bench/local_pods.py --pods 10000 --policies 1000 --namespaces 100

For each cluster (``synthetic.py``: realistic selector mix; ``--local`` running pods on the
rendered node) it times, in process, one local pod change as the agent handles it: the renderer
update, its changes, the delta transaction and its libnftables JSON (no kernel: the commit of a
pod's chain and its set elements is the same few commands whatever the cluster). Side by side in
one run:

* ``now``: only that pod's chain is rebuilt (the sets it is in move their elements);
* ``every chain``: the same change, then every local pod chain rebuilt and compared, as the
  renderer did before (cost grows with local pods x policies): the figure it replaces.

Changes: label changes (the ``app`` label takes another app of the namespace, so the pod moves
between policies and selector sets), deletes of a running local pod and its re-creation. p50 and
A change that makes the pod the first local target of a policy makes that policy's chain and
its peer sets, whose elements (thousands, for a namespaceSelector peer) the kernel must load as
well: such changes are also shown apart (``no set born``: the others).
p50 and p99 in milliseconds, of the wall time and of the thread's CPU time (on a shared machine the wall
time's tail is the scheduler's); target p99 <= 5 ms at 150k pods. The load average is printed beside the
figures (the machine is shared).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import synthetic  # noqa: E402

from nftpolicy.agent.daemon.memory import gc_paused  # noqa: E402
from nftpolicy.translators import nft  # noqa: E402
from nftpolicy.translators.delta import delta_transaction  # noqa: E402
from nftpolicy.translators.model import Cluster, Pod  # noqa: E402
from nftpolicy.translators.noderender import NodeRenderer  # noqa: E402
from nftpolicy.translators.rules import Config  # noqa: E402

TARGET_P99_MS = 5.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def local_changes(cluster: Cluster, count: int, rng: random.Random) -> list[tuple[str, str, Pod | None]]:
    """``count`` (what, pod key, new pod or None) changes of local pods, in thirds: label changes
    (``app`` takes another app of the namespace), deletes, re-creations of what was deleted."""
    local = [p for p in cluster.pods.values() if p.enforceable and p.node == synthetic.NODE and "app" in p.labels]
    apps: dict[str, set[str]] = {}
    for p in cluster.pods.values():
        if p.enforceable and "app" in p.labels:
            apps.setdefault(p.namespace, set()).add(p.labels["app"])
    changes: list[tuple[str, str, Pod | None]] = []
    while len(changes) < count:
        pod = rng.choice(local)
        choices = sorted(apps[pod.namespace] - {pod.labels["app"]})
        if choices:
            changes.append(("label", pod.key, dataclasses.replace(pod, labels={**pod.labels, "app": rng.choice(choices)})))
        changes.append(("delete", pod.key, None))
        changes.append(("create", pod.key, pod))
    return changes[:count]


def timed_changes(renderer: NodeRenderer, changes: list[tuple[str, str, Pod | None]],
                  every_chain: bool) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) milliseconds of each change by kind (``label``, ``delete``, ``create``, and
    ``... no set born`` for those that made no new set); ``every_chain``: every local pod chain
    rebuilt too. The CPU time is this thread's own (time.thread_time): on a shared machine the
    wall time's tail is mostly the scheduler's."""
    costs: dict[str, list[tuple[float, float]]] = {}
    for what, key, pod in changes:
        started, cpu = time.perf_counter(), time.thread_time()
        renderer.set_pod(key, pod)
        if every_chain:
            renderer._all_stale = True  # noqa: SLF001 (the renderer before: every local chain rebuilt and compared)
        changes = renderer.take_changes()
        nft.transaction_json(delta_transaction(Config(), changes))  # as the agent prints it
        cost = ((time.perf_counter() - started) * 1000, (time.thread_time() - cpu) * 1000)
        costs.setdefault(what, []).append(cost)
        if not changes.sets_added:
            costs.setdefault(f"{what}, no set born", []).append(cost)
    return costs


def measure(cluster: Cluster, changes: int, seed: int) -> dict[str, dict[str, list[tuple[float, float]]]]:
    with gc_paused():
        renderer = NodeRenderer(synthetic.NODE).load(cluster)
        renderer.model(ordered=False)
    renderer.take_changes()
    gc.collect()  # as the agent does after a full sync: the long-lived model stays out of later collections
    gc.freeze()
    wanted = local_changes(cluster, changes, random.Random(seed))
    run: Callable[[bool], dict[str, list[tuple[float, float]]]] = lambda every: timed_changes(renderer, wanted, every)  # noqa: E731
    results = {"now": run(False), "every chain": run(True)}
    results["now, again"] = run(False)  # paired: the first round against the second, for the noise
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=150000)
    parser.add_argument("--policies", type=int, default=10000)
    parser.add_argument("--namespaces", type=int, default=1500)
    parser.add_argument("--local", default="110,220", help="local pod counts, comma-separated")
    parser.add_argument("--changes", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"{args.pods:,} pods, {args.policies:,} policies, {args.namespaces:,} namespaces; "
          f"load average {os.getloadavg()[0]:.2f} (2 cores, shared)")
    print(f"{'local pods':>10} {'renderer':<12} {'change':<20} {'p50 ms':>8} {'p99 ms':>8} {'CPU p50':>8} {'CPU p99':>8}"
          f"  target p99 <= {TARGET_P99_MS} ms (CPU)")
    for local in (int(n) for n in args.local.split(",")):
        cluster = synthetic.generate(pods=args.pods, policies=args.policies, namespaces=args.namespaces,
                                     node_pods=local, seed=args.seed).cluster
        for renderer, costs in measure(cluster, args.changes, args.seed).items():
            for what in ("label", "delete", "create", "label, no set born", "create, no set born"):
                wall, cpu = [w for w, _ in costs[what]], [c for _, c in costs[what]]
                cpu_p99 = percentile(cpu, 0.99)
                met = "" if renderer == "every chain" else ("  met" if cpu_p99 <= TARGET_P99_MS else "  MISSED")
                print(f"{local:>10} {renderer:<12} {what:<20} {statistics.median(wall):>8.2f} {percentile(wall, 0.99):>8.2f} "
                      f"{statistics.median(cpu):>8.2f} {cpu_p99:>8.2f}{met}")
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
