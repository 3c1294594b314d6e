#!/usr/bin/env python3
"""An agent's restart against the real kube-apiserver, this tree beside others: restart -> its
first committed full sync, and its RSS then.

Usage (as root)::

    .venv/bin/python bench/restart.py --baseline /work/main             # 10,000 pods
    .venv/bin/python bench/restart.py --pods 150000 --baseline /work/main

One control plane (the test bed's etcd and kube-apiserver 1.36) is loaded by
``tools/k8s/loader`` with a ``synthetic.generate`` cluster (pods with their status, as a kubelet
writes it; policies; namespaces; nodes). Then, ``--rounds`` times, each tree's ``nftpolicy
agent`` (its own ``.venv``) starts against it, lists every kind (protobuf where the tree and the
kind have it) and commits its full table into a network namespace made here; the time is from
the process's start to the log line of its first committed sync, with the agent's CPU seconds and
RSS (VmRSS, VmHWM) at that moment and the sync's own ``duration_ms``; then it is stopped. Rounds
alternate between the trees (the table is already there from the round before, as on a restarted
node). ``kube_router_side_by_side.py`` times the same restart beside kube-router's, with
"rules complete" checked by listing the table; this one needs no kube-router and its figures
are per round. The load average is printed with them.

Safety: every nft command runs in the ``nftp-<tag>-restart`` namespace made here and deleted in a
``finally``; each agent is stopped by its pid.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import synthetic  # noqa: E402
from kube_router_side_by_side import (load_objects, namespace_object, node_object, pod_api_object, proc_cpu,  # noqa: E402
                                      proc_memory)

from nftpolicy.agent.dataplane import netns  # noqa: E402
from nftpolicy.agent.testbed.controlplane import ControlPlane, free_port  # noqa: E402


def restart(tree: Path, kubeconfig: str, ns: str) -> dict[str, float]:
    """One start of ``tree``'s agent until its first committed sync."""
    started = time.monotonic()
    proc = subprocess.Popen([str(tree / ".venv" / "bin" / "nftpolicy"), "agent", "--kubeconfig", kubeconfig, "--node", synthetic.NODE,
                             "--netns", ns, "--http-address", f"127.0.0.1:{free_port()}", "--log-format", "json",
                             "--resync-interval", "3600"], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and str(record.get("msg", "")).startswith("sync ") and "duration_ms" in record:
                seconds = time.monotonic() - started
                rss, hwm = proc_memory(proc.pid)
                return {"seconds": seconds, "cpu_s": sum(proc_cpu(proc.pid)), "rss_mib": rss, "hwm_mib": hwm,
                        "sync_ms": float(record["duration_ms"])}
        raise RuntimeError(f"the agent of {tree} exited with {proc.wait()} before its first sync")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


ROWS = [("restart -> first committed sync (s)", "seconds", "{:.2f}"), ("agent CPU until then (s)", "cpu_s", "{:.2f}"),
        ("the sync's own duration (ms)", "sync_ms", "{:.0f}"), ("agent RSS then (MiB)", "rss_mib", "{:.0f}"),
        ("agent peak RSS until then (MiB)", "hwm_mib", "{:.0f}")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=10000)
    parser.add_argument("--policies", type=int, help="default: a tenth of the pods")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=16, help="objects the loader creates at once")
    parser.add_argument("--baseline", type=Path, action="append", default=[], help="another tree, started first (repeatable)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ[netns.RUN_TAG_ENV] = f"b{secrets.token_hex(2)}"
    trees = [*args.baseline, ROOT]
    cluster = synthetic.generate(args.pods, args.policies or args.pods // 10, max(100, args.pods // 100), seed=args.seed).cluster
    ns = f"nftp-{netns.run_tag()}-restart"
    results: dict[str, list[dict[str, float]]] = {str(t): [] for t in trees}
    netns.create([ns])
    try:
        with ControlPlane() as cp:
            seconds = load_objects(cp, [*(node_object(n) for n in cluster.nodes.values()),
                                        *(namespace_object(n) for n in cluster.namespaces.values()),
                                        *(synthetic.policy_object(p) for p in cluster.policies.values()),
                                        *(pod_api_object(p, cluster) for p in cluster.pods.values())], args.workers)
            print(f"loaded {len(cluster.pods)} pods in {seconds['Pod']:.0f} s; load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
            for _ in range(args.rounds):
                for tree in trees:
                    results[str(tree)].append(restart(tree, cp.kubeconfig, ns))
    finally:
        netns.delete([ns])
    print(f"restart at {len(cluster.pods):,} pods / {len(cluster.policies):,} policies, real kube-apiserver, {args.rounds} rounds "
          f"alternating; median (min-max) ({os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())})")
    width = 40
    print("".ljust(width) + "".join(f"{Path(t).name:>26}" for t in results))
    for label, key, fmt in ROWS:
        cells = []
        for runs in results.values():
            values = [r[key] for r in runs]
            cells.append(f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})")
        print(label.ljust(width) + "".join(f"{c:>26}" for c in cells))
    if len(results) > 1:
        first, last = (statistics.median(r["seconds"] for r in runs) for runs in (list(results.values())[0], list(results.values())[-1]))
        print("restart, ratio last/first".ljust(width) + f"{last / first:>26.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
