"""The agent's lifecycle with traffic on the real cluster (part of ``.ci/e2e``).

Three pods: ``client`` on node 1, ``allowed`` and ``denied`` servers (agnhost porter on port 80)
on the last node, so that traffic crosses the nodes (and two DaemonSet pods when there are two).
NetworkPolicies: ``denied`` takes no ingress at all; ``allowed`` takes ingress from ``client``
only. A :class:`PairProber` connects from inside the client pod's own network namespace (the
packets leave by the pod's veth, as the pod's would) to each server every 100 ms, all along:

1. the agent's pods deleted (the DaemonSet starts new ones);
2. ``helm upgrade`` with a changed value (a rolling update);
3. containerd restarted on every node;
4. kubelet restarted on every node;
5. kube-apiserver restarted;
6. ``helm uninstall``: the table stays in the kernel (the documented decision: the last ruleset
   keeps enforcing until ``nftpolicy cleanup`` runs on the node), checked; then ``nftpolicy
   cleanup`` in each node, after which the denied pair connects (so the probes can tell).

Not one connection of the denied pair may succeed before the cleanup, and the allowed pair may
fail for at most :data:`ALLOWED_WINDOW` seconds in a row.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.testbed.realnode import RealCluster, RealNodeError, container_pid

NAMESPACE = "lifecycle"
PERIOD = 0.1  # seconds between two probes of one pair
CONNECT_TIMEOUT = 0.5
ALLOWED_WINDOW = 1.0  # seconds: the longest the allowed pair may fail in a row (docs/contributing.md, "Lifecycle with traffic")
SETTLE = 3.0  # seconds of probing after each step has settled


def _pod(name: str, node: str, labels: dict[str, str], server: bool, image: str) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "agnhost", "image": image, "imagePullPolicy": "IfNotPresent"}
    if server:
        container |= {"args": ["porter"], "env": [{"name": "SERVE_PORT_80", "value": "ok"}],
                      "ports": [{"containerPort": 80}]}
    else:
        container |= {"args": ["pause"]}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
            "spec": {"nodeName": node, "containers": [container], "terminationGracePeriodSeconds": 1}}


def _policies() -> list[dict[str, Any]]:
    meta = {"namespace": NAMESPACE}
    return [
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "deny-all", **meta},
         "spec": {"podSelector": {"matchLabels": {"app": "denied"}}, "policyTypes": ["Ingress"]}},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "from-client", **meta},
         "spec": {"podSelector": {"matchLabels": {"app": "allowed"}}, "policyTypes": ["Ingress"],
                  "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}]}]}},
    ]


def pod_pid(cluster: RealCluster, name: str) -> int:
    """The pid of pod ``name``'s container."""
    status = json.loads(cluster.kubectl("get", "pod", name, "-n", NAMESPACE, "-o", "json"))["status"]
    return container_pid(status["containerStatuses"][0]["containerID"].split("://", 1)[1])


class PairProber(threading.Thread):
    """Connects to ``address:port`` from inside the network namespace of process ``pid`` every
    :data:`PERIOD` seconds; ``results`` is a list of (monotonic seconds, connected)."""

    def __init__(self, name: str, pid: int, address: str, port: int) -> None:
        super().__init__(name=name, daemon=True)
        self.pid, self.address, self.port = pid, address, port
        self.results: list[tuple[float, bool]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with open(f"/proc/{self.pid}/ns/net") as target:
            netns.enter_thread(target.fileno())
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    with socket.create_connection((self.address, self.port), timeout=CONNECT_TIMEOUT):
                        connected = True
                except OSError:
                    connected = False
                self.results.append((started, connected))
                self.stop.wait(max(0.0, PERIOD - (time.monotonic() - started)))

    def since(self, t0: float) -> list[tuple[float, bool]]:
        return [r for r in self.results if r[0] >= t0]


def longest_failure(results: list[tuple[float, bool]]) -> float:
    """Seconds of the longest run of failed probes (from its first failure to the next success)."""
    longest, first_failure = 0.0, None
    for when, connected in results:
        if not connected and first_failure is None:
            first_failure = when
        elif connected and first_failure is not None:
            longest, first_failure = max(longest, when - first_failure), None
    if first_failure is not None and results:
        longest = max(longest, results[-1][0] - first_failure + PERIOD)
    return longest


def lifecycle(cluster: RealCluster, helm: Callable[..., str], chart: Path, image: str) -> dict[str, Any]:
    """The steps of the module doc, with the chart installed as release ``nftpolicy`` from
    ``chart`` and ``image`` (agnhost) for the pods; returns per step its seconds, the allowed
    pair's longest failure and the denied pair's connections; raises RealNodeError when a rule is
    broken."""
    last = cluster.node_names[-1]
    cluster.kubectl("create", "namespace", NAMESPACE)
    manifests = [_pod("client", cluster.node_names[0], {"app": "client"}, False, image),
                 _pod("allowed", last, {"app": "allowed"}, True, image),
                 _pod("denied", last, {"app": "denied"}, True, image), *_policies()]
    cluster.run([cluster.binaries["kubectl"], "apply", "-f", "-"], input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                                   "items": manifests}))
    cluster.kubectl("wait", "--for=condition=Ready", "pod", "--all", "-n", NAMESPACE, "--timeout=120s", timeout=150)
    ips = {name: json.loads(cluster.kubectl("get", "pod", name, "-n", NAMESPACE, "-o", "json"))["status"]["podIP"]
           for name in ("allowed", "denied")}
    client = pod_pid(cluster, "client")
    allowed = PairProber("allowed", client, ips["allowed"], 80)
    denied = PairProber("denied", client, ips["denied"], 80)
    allowed.start()
    denied.start()
    steps: list[dict[str, Any]] = []

    def step(name: str, action: Callable[[], None]) -> None:
        t0 = time.monotonic()
        action()
        time.sleep(SETTLE)
        window = longest_failure(allowed.since(t0))
        leaks = sum(ok for _, ok in denied.since(t0))
        steps.append({"step": name, "seconds": round(time.monotonic() - t0, 1), "allowed_longest_failure": round(window, 2),
                      "denied_connections": leaks, "probes": len(denied.since(t0)),
                      "allowed_probes": len(allowed.since(t0))})
        print(f"  {name}: allowed pair's longest failure {window:.2f} s, denied pair connected {leaks} "
              f"of {len(denied.since(t0))} times", flush=True)

    def rollout() -> None:
        cluster.kubectl("rollout", "status", "daemonset/nftpolicy", "-n", "nftpolicy", "--timeout=180s", timeout=200)

    def agent_pods() -> set[str]:
        items = json.loads(cluster.kubectl("get", "pods", "-n", "nftpolicy", "-l", "app.kubernetes.io/name=nftpolicy",
                                           "-o", "json"))["items"]
        return {item["metadata"]["uid"] for item in items}

    def replaced(action: Callable[[], None]) -> Callable[[], None]:
        """``action``, then a check that every agent pod is a new one."""
        def run() -> None:
            before = agent_pods()
            action()
            rollout()
            after = agent_pods()
            if before & after or len(after) != cluster.node_count:
                raise RealNodeError(f"agent pods not replaced: {len(before & after)} kept, {len(after)} now")
        return run

    def delete_agent_pods() -> None:
        cluster.kubectl("delete", "pod", "-n", "nftpolicy", "-l", "app.kubernetes.io/name=nftpolicy", "--wait=true")

    def upgrade() -> None:
        helm(cluster, "upgrade", "nftpolicy", str(chart), "--namespace", "nftpolicy", "--reuse-values",
             "--set", "agent.logLevel=debug")

    def restart_each(component: str) -> Callable[[], None]:
        def action() -> None:
            for name in cluster.node_names:
                old = cluster.pid(f"{component}-{name}")
                if cluster.restart(f"{component}-{name}") == old:
                    raise RealNodeError(f"{component} of {name} was not restarted")
            cluster.wait_ready()
            rollout()
        return action

    def restart_apiserver() -> None:
        cluster.restart("kube-apiserver")
        cluster.wait_ready()
        rollout()

    try:
        step("baseline", lambda: None)
        step("agent pods deleted", replaced(delete_agent_pods))
        step("helm upgrade (rolling update)", replaced(upgrade))
        step("containerd restarted", restart_each("containerd"))
        step("kubelet restarted", restart_each("kubelet"))
        step("kube-apiserver restarted", restart_apiserver)

        def uninstall() -> None:
            helm(cluster, "uninstall", "nftpolicy", "--namespace", "nftpolicy", "--wait", "--timeout=120s")
            for node in range(1, cluster.node_count + 1):
                if cluster.run(["nft", "list", "table", "inet", "nftpolicy"], node=node, check=False).returncode != 0:
                    raise RealNodeError(f"helm uninstall removed the table of node {node}: it should stay")

        step("helm uninstall (the table stays)", uninstall)
        cleaned = time.monotonic()
        nftpolicy = str(Path(sys.executable).with_name("nftpolicy"))
        for name in cluster.netns:
            subprocess.run([nftpolicy, "cleanup", "--netns", name], check=True, capture_output=True, timeout=60)
        time.sleep(SETTLE)
        after_cleanup = sum(ok for _, ok in denied.since(cleaned + 0.5))
    finally:
        allowed.stop.set()
        denied.stop.set()
        allowed.join()
        denied.join()
    # A prober that died (its thread's exception is only printed) leaves a step without probes,
    # which would break no rule: a step needs probes of both pairs.
    failures = [s for s in steps if s["denied_connections"] or s["allowed_longest_failure"] > ALLOWED_WINDOW
                or not s["probes"] or not s["allowed_probes"]]
    if after_cleanup == 0:
        raise RealNodeError("after nftpolicy cleanup the denied pair still could not connect: the probe cannot tell")
    if failures:
        raise RealNodeError("lifecycle broke a rule in: " + ", ".join(s["step"] for s in failures))
    return {"steps": steps, "denied_connected_after_cleanup": after_cleanup}

