"""Benchmark: the real kube-router and ``nftpolicy agent`` side by side, one real API server.

For each size in ``--sizes`` (pods/policies; default 1,000/100 in 50 namespaces and 10,000/1,000
in 100 namespaces, 110 pods on ``node-0``; ``synthetic.generate``), this script starts etcd and
kube-apiserver on loopback (``ControlPlane``) and, for node ``node-0``, two network namespaces
that stand in for the node: kube-router v2.1.0 (``.tools/bin/kube-router --run-firewall=true
--run-router=false --run-service-proxy=false``, under ``ip netns exec``, API reached through a
relay process, as ``agent/testbed/nodedaemons.py`` does it) writes its iptables (iptables-nft) and ipsets
in one, ``nftpolicy agent --netns`` commits its table in the other. Each namespace has the Node's
InternalIP on an interface (a veth pair inside it); kube-router takes a pod as local when
``status.hostIP`` is that address, so every pod object carries its node's address as ``hostIP``.
Only the node namespaces exist: no pod namespaces or veths (the rules do not need them).

Measured, per daemon:

1. **Load.** The Node objects exist, both daemons run and have done their first sync. Then the
   cluster is created through the API by ``tools/k8s/loader`` (client-go, protobuf, ``--workers``
   requests at once): namespaces, policies, pods (create, then ``status`` with phase, podIP and
   hostIP, as a kubelet reports it).
   One local pod that a policy isolates is held back and created last, alone, so the last object
   changes both daemons' rules. *Last object -> rules complete* is from the return of its status
   write to:

   * nftpolicy: the last committed sync (the agent's metric
     ``nftpolicy_last_successful_sync_timestamp_seconds``) once the agent's table equals the
     render of what the API holds (rendered into a scratch namespace and both listed by the
     kernel, as ``NftpolicyAgents.expected/actual`` do), the metric unchanged around the listing;
   * kube-router: the end (klog time of "sync iptables took") of the first sync that started
     after its last "Received ..." event line (``--v=2``; its informer cache is written before
     the handler logs, so that sync saw every object), once it has been quiet for ``QUIET``
     seconds and its filter table (``iptables-save``) has one ``KUBE-POD-FW-*`` chain per local
     pod (kube-router v2.1 gives every local pod one, selected or not) and, among them, one that
     jumps to a policy chain for every local pod a policy selects (the number from our rule
     model of the same API state).

   Also: the number of syncs each daemon ran during the load.

2. **Full sync.** Both daemons are stopped (their rules stay, as on a restarted node); then each
   alone is started against the loaded API, and start -> rules complete is timed the same way
   (nftpolicy: first committed sync; kube-router: end of its first sync), with the daemon's own
   figure ("sync full in X ms"; "sync iptables took X").

   Then nftpolicy's restart apart, each part alone against the same API: a new interpreter
   importing what ``nftpolicy agent`` imports, and its API source listing every kind into a Store
   (lists, decoding, conversion); with the sync's own figure (render and commit) they show where
   the restart's time goes.

3. **CPU and memory.** CPU seconds are utime+stime of the daemon's process from
   ``/proc/PID/stat`` from its start until it has settled (load: the whole run from the empty
   cluster; full sync: from the restart; for the full sync also until rules complete, from
   samples every ``POLL`` s: kube-router runs a second, queued full sync after its first).
   kube-router runs ``iptables-save``/``iptables-restore`` and ``ipset`` as children: their CPU
   (``cutime+cstime``, counted when reaped) is added and also shown apart. ``ip netns exec``
   execs kube-router, so the PID is kube-router's (checked through ``/proc/PID/exe``). RSS is
   ``VmRSS`` of the daemon process once settled, with the peak ``VmHWM``. Not counted for
   either: the API server and etcd, and the relay process that carries kube-router's API
   connections into its namespace.

Settings: both daemons at their defaults except the periodic full resync, 1 h for both
(kube-router ``--iptables-sync-period``, nftpolicy ``--resync-interval``) so that no timer-driven
sync lands in a measurement; nftpolicy keeps ``--min-sync-interval`` 0.2 s, kube-router coalesces
by itself (one queued full sync). During the load both run at once on the same machine as the API
server and the loader; the full syncs run one daemon at a time.

Run as root: ``.venv/bin/python bench/kube_router_side_by_side.py [--sizes 1000/100,10000/1000]``;
``--python OTHER/.venv/bin/python`` runs another tree's agent (e.g. main's, to compare a branch
with the same bench code, one run after the other). The load average is printed at the start and
the end (other work on the machine slows both daemons).
Safety: ``NFTPOLICY_RUN_TAG`` is set to ``b<4 hex>`` for this process; every iptables, ipset and
nft command runs inside the ``nftp-<tag>...`` namespaces created here; processes, namespaces and
files created here are removed in ``finally`` blocks (also on Ctrl-C and SIGTERM); processes
started here get SIGTERM if this script dies.
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import orjson
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import synthetic  # noqa: E402

from nftpolicy.agent.dataplane import netns  # noqa: E402
from nftpolicy.agent.testbed.controlplane import SANDBOX_IMAGE, ApiError, ControlPlane, find_binary, free_port  # noqa: E402
from nftpolicy.agent.testbed.nodedaemons import (AGENT_COMMAND, KUBE_ROUTER_SYNC_END, KUBE_ROUTER_SYNC_START,  # noqa: E402
                                         NftpolicyAgents, cluster_from_api, config_flags)
from nftpolicy.translators.model import Cluster, Pod  # noqa: E402
from nftpolicy.translators.noderender import build_rule_model  # noqa: E402
from nftpolicy.translators.rules import Config  # noqa: E402

NODE = synthetic.NODE
CONFIG = Config()
QUIET = 3.0  # seconds without a kube-router log line before its rules count as settled
POLL = 0.25
RESYNC = "3600"
CLK_TCK = os.sysconf("SC_CLK_TCK")
KLOG = re.compile(r"^([IWEF])(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6})\s+\d+\s+\S+\] (.*)$")
RECEIVED = "Received "  # kube-router --v=2: "Received update to pod: ns/name", "... network policy ...", namespace


class BenchError(RuntimeError):
    """A process died, a wait ran out or a result is wrong; the message says which and why."""


def die_with_parent() -> None:
    """preexec_fn: SIGTERM to the child when this process dies (prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


# ---- the API: keep-alive HTTPS per loader thread ------------------------------------------------

class Api:
    """Requests to the control plane as its admin, one keep-alive connection per thread."""

    def __init__(self, cp: ControlPlane) -> None:
        self.port, self.token = cp.port, cp.admin_token
        self.context = ssl.create_default_context(cafile=cp.ca_file)
        self.local = threading.local()

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json", "Content-Type": content_type}
        for attempt in range(3):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = self.local.conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context, timeout=120)
            try:
                conn.request(method, path, body=data, headers=headers)
                reply = conn.getresponse()
                text = reply.read().decode()
            except (OSError, http.client.HTTPException):
                conn.close()
                self.local.conn = None
                if attempt == 2:
                    raise
                continue
            if reply.status >= 400:
                try:
                    message = json.loads(text).get("message") or text
                except ValueError:
                    message = text
                raise ApiError(f"{method} {path}", reply.status, message.strip())
            return json.loads(text) if text else None
        raise AssertionError("unreachable")


def create(api: Api, obj: dict[str, Any]) -> None:
    """Create ``obj`` (an existing one is taken as it is, Namespace labels merged in); then its
    ``status`` through the status subresource (Pods and Nodes)."""
    kind, meta = obj["kind"], obj["metadata"]
    name, namespace = meta["name"], meta.get("namespace")
    body = {k: v for k, v in obj.items() if k != "status"}
    try:
        stored = api.request("POST", ControlPlane.path(kind, namespace), body)
    except ApiError as error:
        if error.status != 409:  # kube-system exists; or a retried POST that had gone through
            raise
        stored = api.request("GET", ControlPlane.path(kind, namespace, name))
        if kind == "Namespace" and meta.get("labels"):
            stored = api.request("PATCH", ControlPlane.path(kind, None, name), {"metadata": {"labels": meta["labels"]}},
                                 content_type="application/merge-patch+json")
    if kind in ("Pod", "Node") and obj.get("status"):
        stored["status"] = {**(stored.get("status") or {}), **obj["status"]}
        api.request("PUT", ControlPlane.path(kind, namespace, name, "status"), stored)


def load_objects(cp: ControlPlane, objects: list[dict[str, Any]], workers: int) -> dict[str, float]:
    """Create ``objects`` (Nodes, Namespaces, NetworkPolicies, Pods; their status written as
    ``create`` does) with ``tools/k8s/loader`` (client-go, protobuf, ``workers`` at once, no
    client-side rate limit), kind by kind in that order; returns the seconds per kind.

    Raises BenchError with the loader's message when it fails."""
    lines = b"".join(orjson.dumps(obj) + b"\n" for obj in objects)
    done = subprocess.run([find_binary("loader"), "-kubeconfig", cp.kubeconfig, "-workers", str(workers)], input=lines,
                          capture_output=True, preexec_fn=die_with_parent)
    if done.returncode != 0:
        raise BenchError(f"loading {len(objects)} objects failed: {done.stderr.decode().strip()}")
    return {kind: timing["seconds"] for kind, timing in json.loads(done.stdout).items()}


def node_object(node: Any) -> dict[str, Any]:
    addresses = [{"type": "InternalIP", "address": a} for a in node.addresses] + [{"type": "Hostname", "address": node.name}]
    spec = {"podCIDR": node.pod_cidrs[0], "podCIDRs": list(node.pod_cidrs)} if node.pod_cidrs else {}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node.name, "labels": {"kubernetes.io/hostname": node.name}},
            "spec": spec, "status": {"addresses": addresses}}


def namespace_object(ns: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns.name, "labels": dict(ns.labels)}}


def pod_api_object(pod: Pod, cluster: Cluster) -> dict[str, Any]:
    """``synthetic.pod_object`` plus what the API and kube-router need: an image, and
    ``status.hostIP`` = the address of the pod's node."""
    obj = synthetic.pod_object(pod)
    obj["spec"]["containers"] = [{"image": SANDBOX_IMAGE, **c} for c in obj["spec"]["containers"]]
    node = cluster.nodes.get(pod.node or "")
    if node is not None and node.addresses:
        obj["status"].update(hostIP=node.addresses[0], hostIPs=[{"ip": a} for a in node.addresses])
    return obj


def kube_router_chains(saved: str) -> dict[str, int]:
    """In kube-router's ``iptables-save`` (filter table): ``pod`` KUBE-POD-FW-* chains,
    ``isolated`` those that jump to a policy chain (not only KUBE-NWPLCY-DEFAULT), ``policy``
    KUBE-NWPLCY-* chains."""
    pod, isolated, policy = set(), set(), set()
    for line in saved.splitlines():
        if line.startswith(":KUBE-POD-FW-"):
            pod.add(line[1:].split()[0])
        elif line.startswith(":KUBE-NWPLCY-") and not line.startswith(":KUBE-NWPLCY-DEFAULT "):
            policy.add(line[1:].split()[0])
        elif line.startswith("-A KUBE-POD-FW-"):
            target = line.rpartition(" -j ")[2].split()[0]
            if target.startswith("KUBE-NWPLCY-") and target != "KUBE-NWPLCY-DEFAULT":
                isolated.add(line.split()[1])
    return {"pod": len(pod), "isolated": len(isolated & pod), "policy": len(policy)}


# ---- processes ----------------------------------------------------------------------------------

def proc_cpu(pid: int) -> tuple[float, float]:
    """(utime+stime, cutime+cstime) of ``pid`` in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    ticks = [int(v) for v in fields[11:15]]
    return (ticks[0] + ticks[1]) / CLK_TCK, (ticks[2] + ticks[3]) / CLK_TCK


def proc_memory(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


class Daemon:
    """One daemon process with its log file; :meth:`stop` is idempotent."""

    name = "daemon"

    def __init__(self, logdir: Path) -> None:
        self.logdir, self.runs = logdir, 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = logdir / "none.log"
        self.started = 0.0

    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        self.runs += 1
        self.log_path = self.logdir / f"{self.name}-{self.runs}.log"
        argv = self.argv()
        self.samples: list[tuple[float, float]] = []
        with self.log_path.open("wb") as log:
            self.started = time.time()
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=die_with_parent,
                                         env={**os.environ, "NODE_NAME": NODE})

    def state(self) -> str:
        """What the last completion check saw (for a timeout's message)."""
        return ""

    def tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise BenchError(f"{self.name} exited with code {code}; its log ends:\n{self.tail()}")

    def sample(self) -> None:
        """Record (now, CPU seconds so far) for :meth:`cpu_at`."""
        if self.proc is not None and self.proc.poll() is None:
            own, children = proc_cpu(self.proc.pid)
            self.samples.append((time.time(), own + children))

    def cpu_at(self, when: float) -> float | None:
        """CPU seconds at the first sample taken at or after ``when`` (samples every ``POLL`` s)."""
        return next((cpu for at, cpu in self.samples if at >= when), None)

    def usage(self) -> dict[str, float]:
        """CPU seconds (own + reaped children) and memory of the process now."""
        assert self.proc is not None
        own, children = proc_cpu(self.proc.pid)
        rss, hwm = proc_memory(self.proc.pid)
        return {"cpu": own + children, "cpu_children": children, "rss": rss, "hwm": hwm}

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class KubeRouter(Daemon):
    """kube-router in node namespace ``ns``, reading its klog lines incrementally."""

    name = "kube-router"

    def __init__(self, logdir: Path, ns: str, cp: ControlPlane) -> None:
        super().__init__(logdir)
        self.ns, self.cp = ns, cp
        self.binary = find_binary("kube-router")

    def argv(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns, self.binary,
                f"--kubeconfig={self.cp.kubeconfig}",
                "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
                f"--service-cluster-ip-range={','.join(CONFIG.service_cidrs)}",
                "--service-node-port-range=%d-%d" % CONFIG.node_port_range,  # type: ignore[str-format]
                f"--iptables-sync-period={RESYNC}s", "--health-port=0", "--metrics-port=0", "--v=2"]

    def start(self) -> None:
        super().start()
        self.offset, self.partial = 0, b""
        self.last_received: float | None = None
        self.last_line = time.time()
        self.syncs: list[list[float | None]] = []  # [start, end, took_ms]
        self.mismatch = ""
        assert self.proc is not None
        want = os.path.realpath(self.binary)
        deadline = time.monotonic() + 10
        while True:  # ip netns exec execs the binary: the PID we hold becomes kube-router
            self.check_alive()
            try:
                if os.readlink(f"/proc/{self.proc.pid}/exe") == want:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"PID {self.proc.pid} did not become {want} within 10 s")
            time.sleep(0.01)

    def read(self) -> None:
        """Parse the log lines written since the last call."""
        with self.log_path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        for raw in lines:
            match = KLOG.match(raw.decode(errors="replace"))
            if not match:
                continue
            _, month, day, hh, mm, ss, us, message = match.groups()
            at = datetime(datetime.now().year, int(month), int(day), int(hh), int(mm), int(ss), int(us)).timestamp()
            self.last_line = max(self.last_line, at)
            if message.startswith(RECEIVED):
                self.last_received = at
            elif message.startswith(KUBE_ROUTER_SYNC_START):
                self.syncs.append([at, None, None])
            elif message.startswith(KUBE_ROUTER_SYNC_END) and self.syncs and self.syncs[-1][1] is None:
                self.syncs[-1][1] = at
                self.syncs[-1][2] = go_duration_ms(message.removeprefix(KUBE_ROUTER_SYNC_END).strip())

    def chains(self) -> dict[str, int]:
        """:func:`kube_router_chains` of the namespace's filter table."""
        return kube_router_chains(subprocess.run(["ip", "netns", "exec", self.ns, "iptables-save", "-t", "filter"],
                                                 capture_output=True, text=True, check=True).stdout)

    def settled(self) -> bool:
        self.read()
        return bool(self.syncs) and self.syncs[-1][1] is not None and time.time() - self.last_line >= QUIET

    def complete(self, want: dict[str, int], after_events: bool) -> dict[str, Any] | None:
        """The completing sync once settled with the chains of ``want`` (``pod``: every local
        pod, kube-router v2.1 gives each one a chain; ``isolated``: the local pods a policy
        selects, whose chain jumps to a policy chain), else None. ``after_events``: the first sync
        started after the last event line (load); else the first sync (restart)."""
        self.check_alive()
        if not self.settled():
            return None
        if after_events:
            done = next((s for s in self.syncs if self.last_received is not None and s[0] > self.last_received), None)  # type: ignore[operator]
        else:
            done = self.syncs[0]
        if done is None or done[1] is None:
            return None
        chains = self.chains()
        if chains["pod"] != want["pod"] or chains["isolated"] != want["isolated"]:
            self.last_line = time.time()  # look again after another quiet period
            self.mismatch = (f"KUBE-POD-FW chains: {chains['pod']} (want {want['pod']}), of which with a policy: "
                             f"{chains['isolated']} (want {want['isolated']})")
            return None
        return {"complete": done[1], "own_ms": done[2], "syncs": len(self.syncs), "chains": chains}

    def state(self) -> str:
        running = bool(self.syncs) and self.syncs[-1][1] is None
        return (f"{len(self.syncs)} syncs{' (one running)' if running else ''}, last log line "
                f"{time.time() - self.last_line:.1f} s ago" + (f", {self.mismatch}" if self.mismatch else ""))


class Agent(Daemon):
    """``nftpolicy agent`` committing into namespace ``ns``."""

    name = "nftpolicy"

    def __init__(self, logdir: Path, ns: str, cp: ControlPlane, lister: NftpolicyAgents, python: str) -> None:
        super().__init__(logdir)
        self.ns, self.cp, self.lister, self.python = ns, cp, lister, python
        self.port = 0

    def argv(self) -> list[str]:
        self.port = free_port()
        return [self.python, *AGENT_COMMAND[1:], "agent", "--kubeconfig", self.cp.kubeconfig, "--node", NODE, "--netns", self.ns,
                "--http-address", f"127.0.0.1:{self.port}", "--log-format", "json", "--resync-interval", RESYNC,
                *config_flags(CONFIG)]

    def start(self) -> None:
        super().start()
        self.checked: float | None = None
        self.first_success: float | None = None
        self.mismatch = False

    def last_success(self) -> float:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as reply:
                text = reply.read().decode()
        except OSError:
            return 0.0
        match = re.search(r"^nftpolicy_last_successful_sync_timestamp_seconds (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def syncs(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and str(record.get("msg", "")).startswith("sync ") and "duration_ms" in record:
                out.append(record)
        return out

    def complete(self, expected: str, first: bool) -> dict[str, Any] | None:
        """Once the table equals ``expected``: the time of the committed sync that made it so
        (``first``: the first committed sync of this process), else None."""
        self.check_alive()
        ts = self.last_success()
        if ts <= 0 or ts == self.checked:
            return None
        if self.first_success is None:
            self.first_success = ts
        table = self.lister.actual(NODE)
        if self.last_success() != ts:
            return None  # a commit happened while listing: look again
        self.checked = ts
        if table != expected:
            self.mismatch = True
            return None
        syncs = self.syncs()
        done = self.first_success if first else ts
        return {"complete": done, "own_ms": syncs[0]["duration_ms"] if first and syncs else (syncs[-1]["duration_ms"] if syncs else None),
                "syncs": len(syncs)}

    def state(self) -> str:
        return (f"last committed sync {time.time() - self.checked:.1f} s ago" if self.checked else "no committed sync") + \
            (", its table differs from the render of the API's state" if self.mismatch else "")


def wait_all(waits: dict[Daemon, Callable[[], dict[str, Any] | None]], timeout: float, what: str) -> dict[Daemon, dict[str, Any]]:
    """Poll every ``waits`` callable until each has returned a result (at most ``timeout`` s)."""
    results: dict[Daemon, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(waits):
        for daemon, check in waits.items():
            if daemon not in results:
                daemon.sample()
                result = check()
                if result is not None:
                    results[daemon] = result
        if len(results) < len(waits):
            if time.monotonic() > deadline:
                pending = "; ".join(f"{d.name}: {d.state()}" for d in waits if d not in results)
                raise BenchError(f"rules not complete within {timeout:.0f} s after {what}: {pending}")
            time.sleep(POLL)
    return results


def local_pods(cluster: Cluster) -> set[str]:
    """Addresses of the pods kube-router takes as local (``getLocalPods``: hostIP is the node's,
    a podIP, neither finished nor hostNetwork; keyed by podIP)."""
    return {p.ips[0] for p in cluster.pods.values()
            if p.node == NODE and p.ips and p.phase not in ("Succeeded", "Failed") and not p.host_network}


def go_duration_ms(text: str) -> float | None:
    """A Go time.Duration string ("1.5s", "850.2ms", "1m2.5s", "900µs") in milliseconds."""
    units = {"h": 3600e3, "m": 60e3, "s": 1e3, "ms": 1.0, "us": 1e-3, "µs": 1e-3, "ns": 1e-6}
    parts = re.findall(r"([\d.]+)(h|ms|m|s|us|µs|ns)", text)
    return sum(float(v) * units[u] for v, u in parts) if parts else None


# ---- one size -----------------------------------------------------------------------------------

def run_size(pods: int, policies: int, args: argparse.Namespace, prefix: str, created_ns: list[str]) -> dict[str, Any]:
    namespaces = min(100, max(4, pods // 20))
    t = time.monotonic()
    cluster = synthetic.generate(pods, policies, namespaces, node_pods=110, seed=args.seed).cluster
    print(f"[{pods}/{policies}] cluster generated in {time.monotonic() - t:.1f} s: {len(cluster.pods)} pods, "
          f"{len(cluster.policies)} policies, {len(cluster.namespaces)} namespaces, {len(cluster.nodes)} nodes", file=sys.stderr)
    model = build_rule_model(cluster, NODE, CONFIG)
    last_key = model.pod_chains[0].pod  # a local pod a policy isolates: created last, alone
    node_ip = cluster.nodes[NODE].addresses[0]

    names = {"kr": f"{prefix}kr", "nft": f"{prefix}nft", "scratch": f"{prefix}scratch"}
    created_ns.extend(names.values())
    netns.create(list(names.values()))
    for key in ("kr", "nft"):
        # The node's address on an uplink-like interface (a veth pair with both ends inside).
        netns.ip_batch(["link set lo up", "link add eth1 type veth peer name eth1peer", f"addr add {node_ip}/32 dev eth1",
                        "link set eth1peer up", "link set eth1 up"], names[key])

    logdir = Path(tempfile.mkdtemp(prefix=f"nftpolicy-bench-{netns.run_tag()}-"))
    try:
        with ControlPlane() as cp:
            return measure(cp, cluster, last_key, names, prefix, logdir, args, f"[{pods}/{policies}]")
    finally:
        for name in names.values():
            if name in created_ns:
                netns.delete([name])
                created_ns.remove(name)
        if args.keep_logs:
            print(f"logs kept in {logdir}", file=sys.stderr)
        else:
            shutil.rmtree(logdir, ignore_errors=True)


def measure(cp: ControlPlane, cluster: Cluster, last_key: str, names: dict[str, str], prefix: str, logdir: Path,
            args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """Load, then restart each daemon (the module docstring); the daemons and the API relay are
    stopped before returning or raising."""
    api = Api(cp)
    relay: subprocess.Popen[bytes] | None = None
    daemons: list[Daemon] = []
    try:
        # The API relay into kube-router's namespace, in its own process (not this one's GIL).
        relay = subprocess.Popen([sys.executable, "-c", "import time\nfrom nftpolicy.agent.testbed.nodedaemons import ApiRelay\n"
                                  f"ApiRelay({names['kr']!r}, {cp.port})\nprint('ready', flush=True)\ntime.sleep(1e9)"],
                                 stdout=subprocess.PIPE, preexec_fn=die_with_parent)
        if relay.stdout is None or relay.stdout.readline().strip() != b"ready":
            raise BenchError("the API relay into kube-router's namespace did not start")
        stub = types.SimpleNamespace(prefix=prefix, run=prefix, config=CONFIG,
                                     nodes={NODE: types.SimpleNamespace(name=NODE, netns=names["nft"])})
        lister = NftpolicyAgents(stub, cp)  # type: ignore[arg-type]  # its expected()/actual() only
        kr = KubeRouter(logdir, names["kr"], cp)
        agent = Agent(logdir, names["nft"], cp, lister, args.python)
        daemons += [kr, agent]

        nodes = [node_object(n) for n in cluster.nodes.values()]
        load = {"nodes_s": load_objects(cp, nodes, args.workers)["Node"]}
        for daemon in daemons:
            daemon.start()
        # Both idle on the empty cluster first (kube-router: one sync; nftpolicy: one commit).
        empty_expected = lister.expected(NODE, cluster_from_api(cp))
        wait_all({kr: lambda: kr.complete({"pod": 0, "isolated": 0}, after_events=False),
                  agent: lambda: agent.complete(empty_expected, first=True)}, 120, "start on the empty cluster")
        kr_syncs_before, agent_syncs_before = len(kr.syncs), len(agent.syncs())

        pod_objects = [pod_api_object(p, cluster) for k, p in sorted(cluster.pods.items()) if k != last_key]
        t0 = time.monotonic()
        seconds = load_objects(cp, [*(namespace_object(n) for n in cluster.namespaces.values()),
                                    *(synthetic.policy_object(p) for p in cluster.policies.values()), *pod_objects], args.workers)
        load.update(namespaces_s=seconds["Namespace"], policies_s=seconds.get("NetworkPolicy", 0.0), pods_s=seconds["Pod"])
        create(api, pod_api_object(cluster.pods[last_key], cluster))
        last_created = time.time()
        load["total_s"] = time.monotonic() - t0
        load["objects"] = len(cluster.namespaces) + len(cluster.policies) + len(cluster.pods)
        print(f"{tag} loaded {load['objects']} objects in {load['total_s']:.1f} s (namespaces "
              f"{load['namespaces_s']:.1f} s, policies {load['policies_s']:.1f} s, pods {load['pods_s']:.1f} s; "
              f"{len(nodes)} nodes before, {load['nodes_s']:.1f} s)", file=sys.stderr)

        loaded = cluster_from_api(cp)
        want = build_rule_model(loaded, NODE, CONFIG)
        expected = lister.expected(NODE, loaded)
        want_chains = {"pod": len(local_pods(loaded)), "isolated": len({c.pod for c in want.pod_chains})}  # ours: a chain per isolated direction
        figures: dict[str, Any] = {"load": load, "want": want_chains, "want_policy_chains": len(want.policy_chains),
                                   "kube-router": {}, "nftpolicy": {}}

        done = wait_all({kr: lambda: kr.complete(want_chains, after_events=True),
                         agent: lambda: agent.complete(expected, first=False)}, args.timeout, "the last object")
        for daemon in daemons:
            result, usage = done[daemon], daemon.usage()
            f = figures[daemon.name]
            f["load_latency_s"] = result["complete"] - last_created
            f["load_syncs"] = result["syncs"] - (kr_syncs_before if daemon is kr else agent_syncs_before)
            f["load_last_sync_ms"] = result["own_ms"]
            f["load_cpu_s"], f["load_cpu_children_s"] = usage["cpu"], usage["cpu_children"]
            f["load_rss_mib"], f["load_hwm_mib"] = usage["rss"], usage["hwm"]
            if daemon is kr:
                figures["kr_chains"] = result["chains"]
        print(f"{tag} load settled: kube-router {figures['kube-router']['load_latency_s']:.2f} s, "
              f"nftpolicy {figures['nftpolicy']['load_latency_s']:.2f} s after the last object", file=sys.stderr)
        for daemon in daemons:
            daemon.stop()

        # Full sync: each daemon alone, restarted against the loaded API (its rules still there).
        checks: dict[Daemon, Callable[[], dict[str, Any] | None]] = {
            kr: lambda: kr.complete(want_chains, after_events=False),
            agent: lambda: agent.complete(expected, first=True)}
        for daemon in daemons:
            daemon.start()
            result = wait_all({daemon: checks[daemon]}, args.timeout, f"{daemon.name} restarted")[daemon]
            usage = daemon.usage()
            f = figures[daemon.name]
            f["full_s"] = result["complete"] - daemon.started
            f["full_own_ms"] = result["own_ms"]
            f["full_cpu_complete_s"] = daemon.cpu_at(result["complete"])
            f["full_cpu_s"], f["full_cpu_children_s"] = usage["cpu"], usage["cpu_children"]
            f["full_rss_mib"], f["full_hwm_mib"] = usage["rss"], usage["hwm"]
            daemon.stop()
            print(f"{tag} {daemon.name} full sync: {f['full_s']:.2f} s", file=sys.stderr)
        figures["nftpolicy"].update(startup_breakdown(cp, args.python))
        return figures
    except BaseException:
        for daemon in daemons:
            if daemon.proc is not None and daemon.log_path.exists():
                print(f"--- {daemon.name} log ({daemon.log_path}) ends:\n{daemon.tail()}", file=sys.stderr)
        raise
    finally:
        for daemon in daemons:
            daemon.stop()
        if relay is not None:
            relay.terminate()
            relay.wait(timeout=10)


def startup_breakdown(cp: ControlPlane, python: str) -> dict[str, float]:
    """Where nftpolicy's restart -> rules complete goes, each part measured alone with interpreter
    ``python``: a new interpreter importing what ``nftpolicy agent`` imports (``imports_s``: start
    to exit), and its API source listing every kind into a Store in a process of its own
    (``client_s``: making the API source, its client included, after the imports; ``list_s``: the
    lists with their decoding and conversion); the sync's own figure is the render and the commit."""
    started = time.monotonic()
    subprocess.run([python, "-c", "import nftpolicy.agent.cli.main, nftpolicy.agent.cli.commands.agent, "
                    "nftpolicy.agent.daemon.main"], check=True)
    imports = time.monotonic() - started
    lister = ("import os, threading, time\n"
              "from nftpolicy.agent.daemon.metrics import Metrics\n"
              "from nftpolicy.agent.daemon.sources import KubeSource\n"
              "from nftpolicy.agent.daemon.store import Store\n"
              "metrics = Metrics(); store = Store(metrics)\n"
              "t = time.monotonic()\n"
              f"source = KubeSource(store, metrics, {cp.kubeconfig!r}, 60.0, 300, threading.Event())\n"
              "made = time.monotonic() - t\n"
              "t = time.monotonic(); source.start()\n"
              "while not store.listed(): time.sleep(0.002)\n"
              "print(made, time.monotonic() - t, flush=True)\n"
              "os._exit(0)\n")  # not the interpreter's exit under the watch threads
    made, listed = map(float, subprocess.run([python, "-c", lister], check=True, capture_output=True, text=True).stdout.split())
    return {"imports_s": imports, "client_s": made, "list_s": listed}


# ---- output -------------------------------------------------------------------------------------

ROWS: list[tuple[str, str, str]] = [
    ("last object created -> rules complete (s)", "load_latency_s", "{:.2f}"),
    ("syncs during the load", "load_syncs", "{:d}"),
    ("own duration of the completing sync (ms)", "load_last_sync_ms", "{:.0f}"),
    ("CPU s, start + load until settled", "load_cpu_s", "{:.1f}"),
    ("  of which child processes (iptables/ipset)", "load_cpu_children_s", "{:.1f}"),
    ("RSS after the load, VmRSS / VmHWM (MiB)", "load_rss_mib", "{:.0f}"),
    ("full sync: restart -> rules complete (s)", "full_s", "{:.2f}"),
    ("full sync: the daemon's own figure (ms)", "full_own_ms", "{:.0f}"),
    ("  restart, alone: Python start + imports (s)", "imports_s", "{:.2f}"),
    ("  restart, alone: API source and its client made (s)", "client_s", "{:.2f}"),
    ("  restart, alone: lists, decoded into the store (s)", "list_s", "{:.2f}"),
    ("CPU s, restart -> rules complete", "full_cpu_complete_s", "{:.1f}"),
    ("CPU s, restart until settled", "full_cpu_s", "{:.1f}"),
    ("  of which child processes (iptables/ipset)", "full_cpu_children_s", "{:.1f}"),
    ("RSS after the full sync, VmRSS / VmHWM (MiB)", "full_rss_mib", "{:.0f}"),
]


def cell(figures: dict[str, Any], key: str, fmt: str) -> str:
    value = figures.get(key)
    if value is None:
        return "-"
    text = fmt.format(value)
    if key.endswith("_rss_mib"):
        text += " / " + fmt.format(figures[key.replace("_rss_", "_hwm_")])
    return text


def ratio(nft: Any, kr: Any) -> str:
    if not isinstance(nft, (int, float)) or not isinstance(kr, (int, float)) or kr <= 0:
        return "-"
    value = nft / kr
    return f"{value:.2f}x" if value >= 0.1 else f"{value:.3f}x"


def print_table(results: dict[str, dict[str, Any]]) -> None:
    header = ["figure"]
    for size in results:
        header += [f"{size} kube-router", f"{size} nftpolicy", f"{size} nftpolicy/kube-router"]
    rows = [header, ["---"] * len(header)]
    for label, key, fmt in ROWS:
        row = [label]
        for figures in results.values():
            kr, nft = figures["kube-router"], figures["nftpolicy"]
            row += [cell(kr, key, fmt), cell(nft, key, fmt), "" if "children" in key or "alone" in label else ratio(nft.get(key), kr.get(key))]
        rows.append(row)
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    for size, figures in results.items():
        load = figures["load"]
        print(f"{size}: {load['objects']} objects loaded in {load['total_s']:.1f} s by {figures['workers']} loader workers "
              f"(namespaces {load['namespaces_s']:.1f} s, policies {load['policies_s']:.1f} s, pods {load['pods_s']:.1f} s); "
              f"KUBE-POD-FW chains: kube-router {figures['kr_chains']['pod']} (one per local pod), of which "
              f"{figures['kr_chains']['isolated']} jump to a policy; nftpolicy {figures['want']['isolated']} (isolated local pods only); "
              f"policy chains: kube-router {figures['kr_chains']['policy']} KUBE-NWPLCY-*, nftpolicy {figures['want_policy_chains']} "
              f"(one per policy and direction with a local target)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000/100,10000/1000", help="pods/policies, comma-separated (default %(default)s)")
    parser.add_argument("--workers", type=int, default=16, help="objects the loader creates at once (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for a daemon's rules (default %(default)s)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep-logs", action="store_true", help="keep the daemons' logs (path printed)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter that runs nftpolicy (another tree's .venv/bin/python measures that tree's agent; default this one)")
    args = parser.parse_args()
    sizes = []
    for text in args.sizes.split(","):
        pods, _, policies = text.partition("/")
        sizes.append((int(pods), int(policies)))
    if os.geteuid() != 0:
        print("run as root (network namespaces, iptables, nft)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ[netns.RUN_TAG_ENV] = f"b{secrets.token_hex(2)}"
    created: list[str] = []
    results: dict[str, dict[str, Any]] = {}
    started, load_before = time.monotonic(), os.getloadavg()[0]
    try:
        for pods, policies in sizes:
            t = time.monotonic()
            prefix = f"nftp-{netns.run_tag()}{secrets.token_hex(3)}-"
            figures = run_size(pods, policies, args, prefix, created)
            figures["workers"], figures["wall_s"] = args.workers, time.monotonic() - t
            results[f"{pods:,}/{policies:,}"] = figures
            print(f"[{pods}/{policies}] done in {figures['wall_s']:.0f} s", file=sys.stderr)
    finally:
        netns.delete(created)  # only what run_size did not remove itself
    print_table(results)
    print(f"total {time.monotonic() - started:.0f} s; nftpolicy run by {args.python}; load average (1 min) "
          f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
