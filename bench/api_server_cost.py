"""Benchmark: what K agents cost the real kube-apiserver, nftpolicy's API source against client-go's informers.

One control plane (``ControlPlane``: etcd and the test bed's kube-apiserver v1.36 on loopback)
is loaded through the API (``tools/k8s/loader``: client-go, protobuf, ``--workers`` requests at
once) with a ``synthetic.generate`` cluster of ``--pods`` pods (with their status, as a kubelet
writes it), ``--policies`` NetworkPolicies in 100 namespaces, plus one Node per simulated agent.
Then, for each client, ``--agents`` simulated agents, each its own process with its own
connections, watch it:

* ``nftpolicy``: the agent's real API source, ``KubeSource`` (list + watch of Pods,
  Namespaces, NetworkPolicies, ClusterNetworkPolicies and Nodes) feeding a ``Store``, without
  the renderer: consistent lists in pages of 500, then watches, in protobuf where the kind has
  it (``nftpolicy limit=N``: the same with pages of N objects, a candidate page size;
  ``nftpolicy json``: the same asking only for JSON, as the agent did before protobuf);
* ``client-go``: ``tools/k8s/informers`` (``.tools/bin/informers``), one set of client-go
  v0.36 informers per agent (Pods, Namespaces, NetworkPolicies, Nodes), each on its own
  connection: kube-router's way; client-go v0.36 lists with streaming lists (WatchListClient);
* ``client-go RV=0``: the same with ``KUBE_FEATURE_WatchListClient=false``: one unpaged list
  from the watch cache (``resourceVersion=0``) per informer, what kube-router v2.1's client-go
  (v0.29) does.

Measured per client, on the API server process (``/proc/PID``: utime+stime; ``VmHWM`` reset
through ``clear_refs`` before each phase):

(b) **all restarting at once**: the K agents start together (the Python processes have imported
    first and wait for one signal); per agent, start -> every kind listed (p50, p99, max over the
    agents); the API server's CPU seconds until the last one has listed, and its peak RSS;
(a) **idle with a steady stream of changes**: ``--rate`` pod label changes a second (merge
    PATCH) for ``--idle`` seconds; the API server's CPU seconds, minus the same stream with no
    agent watching (measured first), divided by K: the CPU of watching per agent and second.

Ratios are nftpolicy / client-go. Run as root is not needed: ``.venv/bin/python
bench/api_server_cost.py [--pods 50000] [--agents 20]``. Every process started here is stopped
in ``finally`` blocks and gets SIGTERM if this script dies; the control plane's directory is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import synthetic  # noqa: E402
from kube_router_side_by_side import (Api, die_with_parent, load_objects, namespace_object, node_object,  # noqa: E402
                                      pod_api_object, proc_cpu, proc_memory)

from nftpolicy.agent.testbed.controlplane import ControlPlane, find_binary  # noqa: E402

RUNNER = "--agent-runner"  # this script, started as one simulated nftpolicy agent


def agent_runner(kubeconfig: str, list_page: int | None, json_only: bool) -> None:
    """One simulated agent: KubeSource + Store (lists in pages of ``list_page`` objects when
    given, else the agent's own; JSON only with ``json_only``). Prints ``ready`` once imported,
    starts at the first line on stdin, prints ``{"synced_s": seconds}`` once every kind is
    listed, and exits when stdin closes."""
    from nftpolicy.agent.daemon import kubeproto, sources
    from nftpolicy.agent.daemon.metrics import Metrics
    from nftpolicy.agent.daemon.sources import KubeSource
    from nftpolicy.agent.daemon.store import Store

    if list_page is not None:
        sources.LIST_PAGE = list_page
    if json_only:
        kubeproto.UNAVAILABLE = "JSON asked for (bench/api_server_cost.py: nftpolicy json)"

    metrics, stop = Metrics(), threading.Event()
    store = Store(metrics)
    source = KubeSource(store, metrics, kubeconfig, 60.0, 300, stop)
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    source.start()
    while not store.listed():
        time.sleep(0.005)
    print(json.dumps({"synced_s": time.monotonic() - started}), flush=True)
    sys.stdin.read()
    stop.set()


class Agents:
    """K simulated agents of one client, started together by :meth:`start`."""

    def __init__(self, client: str, kubeconfig: str, count: int) -> None:
        self.client, self.kubeconfig, self.count = client, kubeconfig, count
        self.procs: list[subprocess.Popen[str]] = []

    def prepare(self) -> None:
        """Start the processes up to the point where they wait for the signal."""
        if self.client.startswith("nftpolicy"):
            page = self.client.partition(" limit=")[2] or "-"  # a candidate page size: "nftpolicy limit=5000"
            json_only = "json" if self.client.endswith(" json") else "-"
            for _ in range(self.count):
                proc = subprocess.Popen([sys.executable, __file__, RUNNER, self.kubeconfig, page, json_only],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
                self.procs.append(proc)
            for proc in self.procs:
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError("a simulated nftpolicy agent did not start")

    def start(self) -> list[float]:
        """Signal every agent; returns each one's seconds from the signal to every kind listed."""
        if self.client.startswith("nftpolicy"):
            for proc in self.procs:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            synced = []
            for proc in self.procs:
                assert proc.stdout is not None
                synced.append(json.loads(proc.stdout.readline())["synced_s"])
            return synced
        env = {**os.environ, "KUBE_FEATURE_WatchListClient": "false" if self.client.endswith("RV=0") else "true"}
        proc = subprocess.Popen([find_binary("informers"), "-kubeconfig", self.kubeconfig, "-count", str(self.count)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=die_with_parent)
        self.procs.append(proc)
        assert proc.stdout is not None
        synced = []
        for line in proc.stdout:
            record = json.loads(line)
            if record == "ready":
                return synced
            synced.append(record["synced_s"])
        raise RuntimeError(f"the client-go informers exited with {proc.wait()}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


class ApiServer:
    """CPU and peak RSS of the API server's process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def cpu(self) -> float:
        return proc_cpu(self.pid)[0]

    def reset_peak(self) -> None:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # proc(5): resets VmHWM to VmRSS

    def peak_mib(self) -> float:
        return proc_memory(self.pid)[1]


def changes(api: Api, pods: list[tuple[str, str]], rate: float, seconds: float) -> int:
    """``rate`` pod label changes a second for ``seconds`` (merge PATCH); returns how many."""
    rng = random.Random(7)
    done, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        namespace, name = rng.choice(pods)
        api.request("PATCH", ControlPlane.path("Pod", namespace, name), {"metadata": {"labels": {"bench-change": str(done)}}},
                    content_type="application/merge-patch+json")
        done += 1
        time.sleep(max(0.0, started + done / rate - time.monotonic()))
    return done


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def measure(client: str, cp: ControlPlane, server: ApiServer, api: Api, pods: list[tuple[str, str]], args: argparse.Namespace,
            baseline_cpu: float) -> dict[str, Any]:
    agents = Agents(client, cp.kubeconfig, args.agents)
    try:
        agents.prepare()
        time.sleep(1.0)
        server.reset_peak()
        cpu0 = server.cpu()
        synced = agents.start()
        restart = {"cpu_s": server.cpu() - cpu0, "peak_mib": server.peak_mib(), "p50_s": statistics.median(synced),
                   "p99_s": percentile(synced, 0.99), "max_s": max(synced)}
        time.sleep(2.0)
        cpu0 = server.cpu()
        made = changes(api, pods, args.rate, args.idle)
        idle_cpu = server.cpu() - cpu0
        return {"restart": restart, "idle_cpu_s": idle_cpu, "changes": made,
                "idle_per_agent_ms_s": 1000 * max(0.0, idle_cpu - baseline_cpu) / args.agents / args.idle}
    finally:
        agents.stop()


CLIENTS = ["nftpolicy", "nftpolicy json", "client-go", "client-go RV=0"]
ROWS: list[tuple[str, Callable[[dict[str, Any], int], float], str]] = [
    ("(b) restart of all: API server CPU s", lambda f, k: f["restart"]["cpu_s"], "{:.1f}"),
    ("(b) API server CPU s per agent", lambda f, k: f["restart"]["cpu_s"] / k, "{:.2f}"),
    ("(b) API server peak RSS (MiB)", lambda f, k: f["restart"]["peak_mib"], "{:.0f}"),
    ("(b) list latency per agent p50 (s)", lambda f, k: f["restart"]["p50_s"], "{:.2f}"),
    ("(b) list latency per agent p99 (s)", lambda f, k: f["restart"]["p99_s"], "{:.2f}"),
    ("(a) watching: API server CPU ms per agent and second", lambda f, k: f["idle_per_agent_ms_s"], "{:.2f}"),
]


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == RUNNER:
        agent_runner(sys.argv[2], None if sys.argv[3] == "-" else int(sys.argv[3]), sys.argv[4] == "json")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=50000)
    parser.add_argument("--policies", type=int, default=1000)
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--rate", type=float, default=20.0, help="pod label changes a second during (a)")
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of (a)")
    parser.add_argument("--workers", type=int, default=16, help="objects the loader creates at once")
    parser.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated, of: " + ", ".join(CLIENTS) +
                        '; "nftpolicy limit=N" is the agent listing in pages of N objects (a candidate page size), '
                        '"nftpolicy json" the agent asking only for JSON')
    args = parser.parse_args()
    clients = args.clients.split(",")
    cluster = synthetic.generate(args.pods, args.policies, 100, seed=1).cluster
    with ControlPlane() as cp:
        api = Api(cp)
        server = ApiServer(cp._apiserver.pid)  # type: ignore[union-attr]
        seconds = load_objects(cp, [
            *(node_object(n) for n in cluster.nodes.values()),
            *({"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"node-{i}"}}  # one per agent
              for i in range(args.agents) if f"node-{i}" not in cluster.nodes),
            *(namespace_object(n) for n in cluster.namespaces.values()),
            *(synthetic.policy_object(p) for p in cluster.policies.values()),
            *(pod_api_object(p, cluster) for p in cluster.pods.values())], args.workers)
        print(f"loaded {len(cluster.pods)} pods in {seconds['Pod']:.0f} s ({len(cluster.pods) / seconds['Pod']:.0f} pods/s), "
              f"{len(cluster.policies)} policies, {len(cluster.namespaces)} namespaces in {sum(seconds.values()):.0f} s; "
              f"load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
        pods = [(p.namespace, p.name) for p in cluster.pods.values()]
        time.sleep(2.0)
        cpu0 = server.cpu()
        changes(api, pods, args.rate, args.idle)
        baseline = server.cpu() - cpu0
        print(f"no agent: {args.rate:.0f} changes/s for {args.idle:.0f} s cost the API server {baseline:.2f} CPU s", file=sys.stderr)
        results: dict[str, dict[str, Any]] = {}
        for client in clients:
            results[client] = measure(client, cp, server, api, pods, args, baseline)
            print(f"{client}: {json.dumps(results[client])}; load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    k = args.agents
    print(f"{len(cluster.pods):,} pods, {len(cluster.policies):,} policies, {k} agents; (a) {args.rate:.0f} pod changes/s for "
          f"{args.idle:.0f} s (no agent: {baseline:.2f} API server CPU s); load average {os.getloadavg()[0]:.1f}")
    others = [c for c in ("nftpolicy json", "client-go", "client-go RV=0") if c in results and "nftpolicy" in results]
    header = ["figure", *clients, *(f"nftpolicy / {c}" for c in others)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for label, value, fmt in ROWS:
        row = [label, *(fmt.format(value(results[c], k)) for c in clients)]
        for other in others:
            reference = value(results[other], k)
            row += [f"{value(results['nftpolicy'], k) / reference:.2f}x" if reference > 0 else "-"]
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
