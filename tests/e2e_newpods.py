"""New pods under policy on the real node (issue 31): ``python -m tests.e2e_newpods``.

On a :class:`~nftpolicy.agent.testbed.realnode.RealCluster` (two real kubelets and containerd,
ptp CNI with host-local addresses from each Node's ``spec.podCIDRs``, ``10.244.<node>.0/24``),
the chart installed by Helm as
shipped (``agent.unknownPods: hold``), a server (agnhost netexec, HTTP on 80) on node 2:

1. **deny-all egress, three runs**: a NetworkPolicy that denies all egress in a fresh namespace,
   settled; then 20 pods created at once on node 1, each container connecting to the server
   from its first instruction (bash ``/dev/tcp``, 400 tries 5 ms apart): not one connection.
2. **egress allowed**: the same with a policy that allows the server: every pod's first
   connection succeeds; its extra latency (the first connection's time minus the second's) is
   printed as p50/p99.
3. **ingress**: new server pods on node 1 under a deny-all ingress policy, probed from node 2
   from the moment each one's address is in the API: not one connection; then under a policy
   that allows node 2: the time from the address in the API to the first connection (p50/p99).

Prints one line per step and the figures, writes ``newpods-report.json`` in ``--report-dir``.
Exit 0 only when every check held; 2 when a tool is missing; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.testbed import images
from nftpolicy.agent.testbed.realnode import RealCluster, RealNodeError, node_ip

from .e2e_node import AGNHOST_IMAGE, REPO, TOOLS, Step, build_images, install_chart

PODS = 20
TRIES, GAP = 400, 0.005  # the deny runs' connection attempts per pod, and the pause between two
PORT = 80
PROBE_SECONDS = 8.0  # how long each new server is probed from its address on
PROBE_GAP = 0.02
CONNECT = "exec 3<>/dev/tcp/{ip}/80"  # bash's own connect: no process between the pod and its first SYN


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def deny_script(ip: str) -> str:
    """Every try a new connection (1 s at most), :data:`GAP` apart; prints ``connections=N``."""
    connect = CONNECT.format(ip=ip)
    return (f"ok=0; for i in $(seq {TRIES}); do if timeout 1 bash -c '{connect}' 2>/dev/null; then ok=$((ok+1)); fi; "
            f"sleep {GAP}; done; echo connections=$ok")


def allow_script(ip: str) -> str:
    """The first connection, then a second; prints ``first=ok|fail first_us=.. second_us=..``."""
    connect = CONNECT.format(ip=ip)
    return (f"t0=$(date +%s%N); if timeout 5 bash -c '{connect}' 2>/dev/null; then r=ok; else r=fail; fi; t1=$(date +%s%N); "
            f"timeout 5 bash -c '{connect}' 2>/dev/null; t2=$(date +%s%N); "
            f"echo first=$r first_us=$(( (t1-t0)/1000 )) second_us=$(( (t2-t1)/1000 ))")


def client_pods(namespace: str, node: str, script: str) -> list[dict[str, Any]]:
    return [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"client-{i}", "namespace": namespace, "labels": {"app": "client"}},
             "spec": {"nodeName": node, "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                      "containers": [{"name": "c", "image": AGNHOST_IMAGE, "imagePullPolicy": "Never",
                                      "command": ["/bin/bash", "-c", script]}]}}
            for i in range(PODS)]


def server_pod(namespace: str, name: str, node: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": {"app": "server"}},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": AGNHOST_IMAGE, "imagePullPolicy": "Never",
                                     "args": ["netexec", f"--http-port={PORT}"], "ports": [{"containerPort": PORT}]}]}}


def policy(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def apply(cluster: RealCluster, objects: list[dict[str, Any]]) -> None:
    cluster.run([cluster.binaries["kubectl"], "apply", "-f", "-"], input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))


def settled(cluster: RealCluster, namespace: str, policies: list[dict[str, Any]]) -> None:
    """A fresh ``namespace`` with ``policies``, given time to reach every agent (nothing selects
    a pod yet, so nothing in the table shows them: a generous wait)."""
    cluster.kubectl("create", "namespace", namespace)
    apply(cluster, policies)
    time.sleep(3)


def finished_logs(cluster: RealCluster, namespace: str, timeout: float = 240) -> dict[str, str]:
    """Each client pod's log once all have ended (restartPolicy Never)."""
    deadline = time.monotonic() + timeout
    while True:
        pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json"))["items"]
        phases = {p["metadata"]["name"]: p["status"].get("phase") for p in pods}
        if all(phase in ("Succeeded", "Failed") for phase in phases.values()) and len(phases) == PODS:
            break
        if time.monotonic() > deadline:
            raise RealNodeError(f"client pods of {namespace} not finished after {timeout:.0f} s: {phases}")
        time.sleep(1)
    return {name: cluster.kubectl("logs", "-n", namespace, name).strip() for name in phases}


def deny_run(cluster: RealCluster, run: int, server_ip: str) -> int:
    """Check 1, one run: the connections the 20 pods made (must be 0)."""
    namespace = f"newpods-deny-{run}"
    settled(cluster, namespace, [policy(namespace, "deny-egress", {"podSelector": {}, "policyTypes": ["Egress"]})])
    apply(cluster, client_pods(namespace, cluster.node_names[0], deny_script(server_ip)))
    logs = finished_logs(cluster, namespace)
    counts = {name: int(log.rsplit("connections=", 1)[1]) for name, log in logs.items()}
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
    return sum(counts.values())


def allow_run(cluster: RealCluster, server_ip: str) -> dict[str, Any]:
    """Check 2: every first connection, and the extra latency of each (ms)."""
    namespace = "newpods-allow"
    settled(cluster, namespace, [policy(namespace, "to-server", {"podSelector": {}, "policyTypes": ["Egress"],
                                                                "egress": [{"to": [{"ipBlock": {"cidr": f"{server_ip}/32"}}]}]})])
    apply(cluster, client_pods(namespace, cluster.node_names[0], allow_script(server_ip)))
    logs = finished_logs(cluster, namespace)
    fields = {name: dict(part.split("=", 1) for part in log.split()) for name, log in logs.items()}
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
    failed = sorted(name for name, f in fields.items() if f.get("first") != "ok")
    extra = [(int(f["first_us"]) - int(f["second_us"])) / 1000 for f in fields.values() if f.get("first") == "ok"]
    return {"first_failed": failed, "extra_ms": extra,
            "first_ms": [int(f["first_us"]) / 1000 for f in fields.values() if f.get("first") == "ok"]}


class Prober(threading.Thread):
    """From node 2's network namespace: connect to ``ip``:80 every :data:`PROBE_GAP` for
    :data:`PROBE_SECONDS`; :attr:`connected` holds the seconds (from the start) of each success."""

    def __init__(self, ns: str, ip: str, started: float) -> None:
        super().__init__(daemon=True)
        self.ns, self.ip, self.started = ns, ip, started
        self.connected: list[float] = []

    def run(self) -> None:
        while time.monotonic() - self.started < PROBE_SECONDS:
            with netns.entered(self.ns):
                sock = socket.socket()
            sock.settimeout(0.3)
            try:
                sock.connect((self.ip, PORT))
                self.connected.append(time.monotonic() - self.started)
            except OSError:
                pass
            finally:
                sock.close()
            time.sleep(PROBE_GAP)


def ingress_run(cluster: RealCluster, allow: bool, servers: int = 10) -> list[list[float]]:
    """Check 3: new servers on node 1, each probed from node 2 from its address in the API on;
    the successes of each (seconds from the address)."""
    namespace = f"newpods-ingress-{'allow' if allow else 'deny'}"
    spec: dict[str, Any] = {"podSelector": {}, "policyTypes": ["Ingress"]}
    if allow:
        spec["ingress"] = [{"from": [{"ipBlock": {"cidr": f"{node_ip(2)}/32"}}]}]
    settled(cluster, namespace, [policy(namespace, "ingress", spec)])
    apply(cluster, [server_pod(namespace, f"server-{i}", cluster.node_names[0]) for i in range(servers)])
    probers: dict[str, Prober] = {}
    deadline = time.monotonic() + 120
    while len(probers) < servers and time.monotonic() < deadline:  # each address as soon as the API has it
        pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json"))["items"]
        for p in pods:
            ip = p["status"].get("podIP")
            if ip and p["metadata"]["name"] not in probers:
                probers[p["metadata"]["name"]] = prober = Prober(cluster.netns[1], ip, time.monotonic())
                prober.start()
        time.sleep(0.05)
    for prober in probers.values():
        prober.join()
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
    if len(probers) < servers:
        raise RealNodeError(f"only {len(probers)} of {servers} servers got an address")
    return [p.connected for p in probers.values()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e_newpods", description=__doc__.splitlines()[0])
    parser.add_argument("--report-dir", type=Path, default=REPO / "build" / "e2e")
    parser.add_argument("--runs", type=int, default=3, help="runs of the deny-all egress check")
    args = parser.parse_args(argv)
    missing = [tool for tool in ("helm", "pause", "agnhost") if not (TOOLS / "bin" / tool).exists()]
    if missing:
        print(f"e2e_newpods: missing tool {missing[0]} in .tools/bin: run `bash .ci/install --test`", file=sys.stderr)
        return 2
    run = f"{int(time.time())}"
    report: dict[str, Any] = {}
    ok = True
    with images.storage_lock():
        with Step("build images (pause, agnhost, nftpolicy)"):
            tars = build_images(run)
        cluster = RealCluster(nodes=2, images=tars)
        try:
            with Step("start the real cluster (2 nodes)"):
                cluster.start()
        except BaseException:
            cluster.close()
            raise
    try:
        with Step("helm install charts/nftpolicy"):
            report["install"] = install_chart(cluster, run)
        with Step("server on node 2"):
            cluster.kubectl("create", "namespace", "newpods-server")
            apply(cluster, [server_pod("newpods-server", "server", cluster.node_names[1])])
            cluster.kubectl("wait", "--for=condition=Ready", "pod/server", "-n", "newpods-server", "--timeout=120s", timeout=150)
            server_ip = cluster.kubectl("get", "pod", "server", "-n", "newpods-server", "-o", "jsonpath={.status.podIP}").strip()
        for i in range(1, args.runs + 1):
            try:
                with Step(f"deny-all egress, {PODS} new pods at once, run {i}"):
                    connections = deny_run(cluster, i, server_ip)
                    report.setdefault("deny_connections", []).append(connections)
                    print(f"  connections: {connections} ({PODS} pods x {TRIES} tries)", flush=True)
                    if connections:
                        raise RealNodeError(f"{connections} connections under deny-all egress")
            except RealNodeError:
                ok = False
        try:
            with Step(f"egress allowed, {PODS} new pods at once: every first connection"):
                allowed = report["egress_allow"] = allow_run(cluster, server_ip)
                extra = allowed["extra_ms"]
                if extra:
                    print(f"  first connection {statistics.median(allowed['first_ms']):.1f} ms p50, extra latency p50 "
                          f"{percentile(extra, 0.5):.1f} ms, p99 {percentile(extra, 0.99):.1f} ms", flush=True)
                if allowed["first_failed"]:
                    raise RealNodeError(f"first connection failed in {allowed['first_failed']}")
        except RealNodeError:
            ok = False
        try:
            with Step("deny-all ingress: new servers probed from their address on"):
                successes = report["ingress_deny"] = ingress_run(cluster, allow=False)
                total = sum(len(s) for s in successes)
                print(f"  connections: {total} ({len(successes)} servers, {PROBE_SECONDS:.0f} s each)", flush=True)
                if total:
                    raise RealNodeError(f"{total} connections to new servers under deny-all ingress")
        except RealNodeError:
            ok = False
        try:
            with Step("ingress allowed: new servers probed from their address on"):
                successes = report["ingress_allow"] = ingress_run(cluster, allow=True)
                firsts = [s[0] * 1000 for s in successes if s]
                if firsts:
                    print(f"  from the address in the API to the first connection: p50 {percentile(firsts, 0.5):.0f} ms, "
                          f"p99 {percentile(firsts, 0.99):.0f} ms", flush=True)
                if len(firsts) < len(successes):
                    raise RealNodeError(f"{len(successes) - len(firsts)} allowed servers never answered")
        except RealNodeError:
            ok = False
        with Step("nothing dropped after the hold, nothing left unheld"):
            logs = cluster.kubectl("logs", "-n", "nftpolicy", "-l", "app.kubernetes.io/name=nftpolicy", "--tail=-1", "--prefix")
            drops = [line for line in logs.splitlines() if "held packet" in line]
            unheld = cluster.run(["nft", "list", "chain", "inet", "nftpolicy", "NFTPOLICY-RELEASED-FORWARD"], check=False).stdout
            report["drop_lines"], report["released_chain"] = drops, unheld
            print(f"  agent log lines of dropped held packets: {len(drops)}", flush=True)
            for line in drops[:5]:
                print(f"    {line}", flush=True)
    finally:
        args.report_dir.mkdir(parents=True, exist_ok=True)
        (args.report_dir / "newpods-report.json").write_text(json.dumps(report, indent=2))
        cluster.close()
    print(f"e2e_newpods: {'ok' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
