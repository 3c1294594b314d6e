#!/usr/bin/env python3
"""A new pod's reaction time: from its address in the API to its rules in the kernel (issue 31).

Usage (as root, after ``bash .ci/install --test``: etcd and kube-apiserver)::

    .venv/bin/python bench/new_pod.py                    # 40 single pods, then 3 bursts of 20
    .venv/bin/python bench/new_pod.py --pods 100 --singles 100

A real etcd and kube-apiserver (agent/testbed/controlplane.py) hold namespace ``shop`` with a
deny-all egress NetworkPolicy, Node ``node-1`` with ``spec.podCIDRs`` and ``--pods`` running
pods on it; a real ``nftpolicy agent`` (this tree's, defaults: ``--unknown-pods hold``,
``--min-sync-interval 0.2``) watches it and commits into a network namespace made here. Then
new pods, each created and given its address by a status write (as the kubelet does once the
CNI has set the pod up), one at a time (``--gap`` seconds apart) and in bursts of 20 at once.
Reaction: from the end of that status write (the address is in the API) to the moment the
kernel has the address in ``NFTPOLICY-KNOWN-PODS4``, committed with the pod's chains in one
transaction, seen by ``nft monitor`` in the namespace (each kernel change is reported as it is
committed). This is how long an unknown pod's first packet is held. Printed side by side:
single pods and pods of a burst, p50, p90, p99 and max, with the load average.

Safety: nft runs only in the ``nftp-b<tag>-newpod0`` namespace made here, deleted in a
``finally``; the agent and the monitor are stopped by their pids.
"""

from __future__ import annotations

import argparse
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nftpolicy.agent.dataplane import netns  # noqa: E402
from nftpolicy.agent.testbed.controlplane import ControlPlane, free_port  # noqa: E402

NODE = "node-1"
CIDR = "10.245.0.0/16"


def address(i: int) -> str:
    """The ``i``-th pod address of :data:`CIDR` (never .0)."""
    return f"10.245.{(i + 1) // 250}.{(i + 1) % 250 + 1}"


def pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "shop", "labels": {"app": "bench"}},
            "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "bench"}]}}


def give_address(api: ControlPlane, name: str, ip: str) -> None:
    """The kubelet's status write: Running, with ``ip``."""
    api.request("PATCH", api.path("Pod", "shop", name, "status"), {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}},
                content_type="application/merge-patch+json")


class Monitor(threading.Thread):
    """``nft monitor`` in namespace ``ns``: the time each address is added to the known set."""

    def __init__(self, ns: str) -> None:
        super().__init__(daemon=True)
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, "nft", "monitor", "elements"], stdout=subprocess.PIPE, text=True)
        self.seen: dict[str, float] = {}
        self.arrived: queue.Queue[str] = queue.Queue()

    def run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.monotonic()
            if line.startswith("add element inet nftpolicy NFTPOLICY-KNOWN-PODS4"):
                for ip in line.split("{", 1)[1].split("}", 1)[0].replace(",", " ").split():
                    self.seen.setdefault(ip, now)
                    self.arrived.put(ip)

    def wait(self, ip: str, timeout: float = 30) -> float:
        deadline = time.monotonic() + timeout
        while ip not in self.seen:
            self.arrived.get(timeout=max(0.001, deadline - time.monotonic()))
        return self.seen[ip]


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=100, help="running pods on the node before (default %(default)s)")
    parser.add_argument("--singles", type=int, default=40, help="new pods one at a time (default %(default)s)")
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between two single pods (default %(default)s)")
    parser.add_argument("--bursts", type=int, default=3, help="bursts of 20 new pods at once (default %(default)s)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tag = f"b{secrets.token_hex(2)}"
    os.environ[netns.RUN_TAG_ENV] = tag
    ns = f"nftp-{tag}-newpod0"
    api = ControlPlane()
    agent: subprocess.Popen[bytes] | None = None
    monitor: Monitor | None = None
    netns.create([ns])
    try:
        api.start()
        api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop", "labels": {"kubernetes.io/metadata.name": "shop"}}})
        api.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}, "spec": {"podCIDRs": [CIDR], "podCIDR": CIDR}})
        api.apply({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "deny-egress", "namespace": "shop"},
                   "spec": {"podSelector": {}, "policyTypes": ["Egress"]}})
        for i in range(args.pods):
            api.apply(pod(f"old-{i}"))
            give_address(api, f"old-{i}", address(i))
        monitor = Monitor(ns)
        monitor.start()
        http = f"127.0.0.1:{free_port()}"
        log = open(Path(api.dir) / "agent.log", "wb")
        agent = subprocess.Popen([str(ROOT / ".venv" / "bin" / "nftpolicy"), "agent", "--kubeconfig", api.kubeconfig, "--node", NODE,
                                  "--netns", ns, "--http-address", http, "--debug-address", ""], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://{http}/readyz", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or agent.poll() is not None:
                raise RuntimeError(f"the agent did not get ready: {(Path(api.dir) / 'agent.log').read_text()[-2000:]}")
            time.sleep(0.1)
        monitor.wait(address(args.pods - 1))
        next_ip = args.pods
        singles: list[float] = []
        for i in range(args.singles):
            name, ip = f"single-{i}", address(next_ip)
            next_ip += 1
            api.apply(pod(name))
            time.sleep(0.05)  # the pod exists unscheduled-to-running a moment, as with a kubelet
            give_address(api, name, ip)
            in_api = time.monotonic()
            singles.append((monitor.wait(ip) - in_api) * 1000)
            time.sleep(args.gap)
        burst: list[float] = []
        for b in range(args.bursts):
            names = [(f"burst-{b}-{i}", address(next_ip + i)) for i in range(20)]
            next_ip += 20
            for name, _ in names:
                api.apply(pod(name))
            written = []
            for name, ip in names:
                give_address(api, name, ip)
                written.append((ip, time.monotonic()))
            burst += [(monitor.wait(ip) - at) * 1000 for ip, at in written]
            time.sleep(1)
        rows = {"single pods": percentiles(singles), "20 at once": percentiles(burst)}
        print(f"reaction: a new pod's address in the API -> in the kernel with its chains ({os.cpu_count()} CPUs, load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; {args.pods} pods on the node, deny-all egress)")
        print(f"{'':14}" + "".join(f"{k:>9}" for k in ("n", "p50 ms", "p90 ms", "p99 ms", "max ms")))
        for label, figures in rows.items():
            n = len(singles) if label == "single pods" else len(burst)
            print(f"{label:14}{n:>9}" + "".join(f"{figures[k]:>9.1f}" for k in ("p50", "p90", "p99", "max")))
        return 0
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
        if monitor is not None:
            monitor.proc.terminate()
            monitor.proc.wait(timeout=10)
        api.close()
        netns.delete([ns])


if __name__ == "__main__":
    sys.exit(main())
