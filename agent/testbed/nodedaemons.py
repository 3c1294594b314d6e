"""Real node daemons in sandbox nodes, against a :class:`~.controlplane.ControlPlane`.

* :class:`NftpolicyAgents`: one ``nftpolicy agent`` process per sandbox node, committing inside
  that node's network namespace (``--netns``), watching the control plane with the admin
  kubeconfig.
* :class:`KubeRouters`: one real kube-router per sandbox node (``--run-firewall=true
  --run-router=false --run-service-proxy=false``, ``NODE_NAME``), running inside the node's
  namespace, where it writes iptables and ipsets as it does on a node. The API server listens on
  the host's loopback, which a namespace cannot reach, so an :class:`ApiRelay` listens on the
  same port of the namespace's own loopback and relays each connection (TLS passes through
  untouched: the serving certificate is for 127.0.0.1 in both places).

Both wait until their node's rules reflect what the API holds (:meth:`wait_synced`), so a probe
never runs against a ruleset that is still on its way.
"""

from __future__ import annotations

import difflib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nftpolicy.translators import transaction
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import Config

from nftpolicy.agent.dataplane import netns
from .controlplane import ControlPlane, ControlPlaneError, find_binary, free_port, spawn, stop
from nftpolicy.agent.dataplane.nftables import NftDataplane

if TYPE_CHECKING:
    from .sandbox import Sandbox

AGENT_COMMAND = [sys.executable, "-c", "from nftpolicy.agent.cli import run; run()"]
KUBE_ROUTER_SYNC_START = "Starting sync of iptables"
KUBE_ROUTER_SYNC_END = "sync iptables took"
QUIET = 1.0  # seconds without a new kube-router sync before its rules count as settled


def node_port_flag(config: Config) -> str:
    """``LOW-HIGH`` of the node-port range, as both daemons take it; raises ValueError without
    one (every node daemon exempts a node-port range)."""
    if config.node_port_range is None:
        raise ValueError("node daemons need a node-port range")
    return "%d-%d" % config.node_port_range


def config_flags(config: Config) -> list[str]:
    """``nftpolicy agent`` flags that give the agent ``config`` (the inverse of cli.config_from)."""
    flags = ["--table", config.table, "--priority", str(config.priority), "--policy-mark", hex(config.policy_mark),
             "--passed-mark", hex(config.passed_mark), "--pass-mark", hex(config.pass_mark), "--node-port-range", node_port_flag(config),
             "--deny-action", config.deny_action, "--unknown-pods", config.unknown_pods]
    for cidr in config.service_cidrs:
        flags += ["--service-cidr", cidr]
    for cidr in config.external_cidrs:
        flags += ["--external-cidr", cidr]
    for cidr in config.pod_cidrs:
        flags += ["--pod-cidr", cidr]
    return flags


def cluster_from_api(control_plane: ControlPlane) -> Any:
    """The cluster as the API holds it now, converted as the agent converts it (a
    :class:`~nftpolicy.translators.model.Cluster`)."""
    from nftpolicy.agent.daemon.metrics import Metrics  # with the Kubernetes client: only when a control plane runs
    from nftpolicy.agent.daemon.store import KINDS, Store

    store = Store(Metrics())
    for kind in KINDS:
        store.replace(kind, control_plane.items(kind))
    return store.take()[0]


class NodeDaemons:
    """Processes, one per sandbox node, with their logs in the control plane's directory."""

    name = "daemon"

    def __init__(self, sandbox: "Sandbox", control_plane: ControlPlane) -> None:
        self.sandbox, self.control_plane = sandbox, control_plane
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        """Start the daemon of every node."""
        raise NotImplementedError

    def wait_synced(self, timeout: float = 60.0) -> None:
        """Wait until every node's rules reflect what the API server holds now."""
        raise NotImplementedError

    def log_path(self, node: str) -> Path:
        """Where the daemon of ``node`` writes its log."""
        return self.control_plane.dir / f"{self.name}-{self.sandbox.run}-{node}.log"

    def log(self, node: str) -> str:
        """The log of the daemon of ``node`` so far."""
        path = self.log_path(node)
        return path.read_text(errors="replace") if path.exists() else ""

    def _spawn(self, node: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with self.log_path(node).open("ab") as log:
            self.procs[node] = spawn(argv, log, {**os.environ, **(env or {})})

    def _check_alive(self) -> None:
        for node, proc in self.procs.items():
            if proc.poll() is not None:
                tail = "\n".join(self.log(node).splitlines()[-10:])
                raise ControlPlaneError(f"{self.name} on {node} exited with code {proc.returncode}:\n{tail}")

    def close(self) -> None:
        """SIGTERM every process (SIGKILL after 10 s); idempotent."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            stop(proc)
        self.procs.clear()


class NftpolicyAgents(NodeDaemons):
    """``nftpolicy agent`` on every sandbox node, with the sandbox's :class:`Config`."""

    name = "nftpolicy"

    def __init__(self, sandbox: "Sandbox", control_plane: ControlPlane) -> None:
        super().__init__(sandbox, control_plane)
        self.http: dict[str, int] = {}
        self.scratch = f"{sandbox.prefix}scratch"

    def start(self) -> None:
        """Start one agent per node (each with its own HTTP port on 127.0.0.1)."""
        netns.create([self.scratch])
        for node in self.sandbox.nodes.values():
            self.http[node.name] = free_port()
            self._spawn(node.name, [*AGENT_COMMAND, "agent", "--kubeconfig", self.control_plane.kubeconfig,
                                    "--node", node.name, "--netns", node.netns,
                                    "--http-address", f"127.0.0.1:{self.http[node.name]}", "--min-sync-interval", "0.05",
                                    "--log-format", "json", *config_flags(self.sandbox.config)])

    def _listing(self, netns_name: str) -> str:
        """Our table as the kernel lists it in ``netns_name``, in an order that does not
        depend on history (a chain made by an incremental sync is listed after older ones):
        chains and sets sorted by name, set elements sorted, rules in chain order, no handles.
        Empty when the table is not there."""
        objects: dict[str, list[str]] = {}
        for item in NftDataplane(self.sandbox.config.table, netns_name).listing():
            (kind, body), = item.items()
            body = {k: v for k, v in body.items() if k != "handle"}
            if kind == "set" and "elem" in body:
                body["elem"] = sorted(body["elem"], key=lambda e: json.dumps(e, sort_keys=True))
            objects.setdefault(kind, []).append(json.dumps(body, sort_keys=True))
        # Rules keep their order within a chain (a stable sort by chain name); the rest is sorted.
        rules = sorted(objects.pop("rule", []), key=lambda r: json.loads(r)["chain"])
        return "\n".join(["\n".join(sorted(items)) for _, items in sorted(objects.items())] + rules)

    def expected(self, node: str, cluster: Any) -> str:
        """What node ``node`` must hold for ``cluster``: rendered, loaded into a scratch
        namespace of this sandbox and listed by the kernel, so both sides print the same way."""
        NftDataplane(self.sandbox.config.table, self.scratch).run(transaction.full(build_rule_model(cluster, node, self.sandbox.config)))
        return self._listing(self.scratch)

    def actual(self, node: str) -> str:
        """Our table in node ``node``, listed as :meth:`expected` lists it."""
        return self._listing(self.sandbox.nodes[node].netns)

    def wait_synced(self, timeout: float = 60.0) -> None:
        """Wait until every node's table equals the render of what the API holds now.

        Raises ControlPlaneError naming the node (and an agent that exited, with its log).
        """
        cluster = cluster_from_api(self.control_plane)
        pending = {name: self.expected(name, cluster) for name in self.sandbox.nodes}
        deadline = time.monotonic() + timeout
        while pending:
            self._check_alive()
            pending = {name: want for name, want in pending.items() if self.actual(name) != want}
            if pending and time.monotonic() > deadline:
                first = min(pending)
                diff = difflib.unified_diff(pending[first].splitlines(), self.actual(first).splitlines(), "expected", "kernel", n=0, lineterm="")
                raise ControlPlaneError(f"nftpolicy agent on {', '.join(sorted(pending))} did not reach the API's state "
                                        f"within {timeout:.0f}s; {first}:\n" + "\n".join(list(diff)[2:12]))
            if pending:
                time.sleep(0.05)

    def close(self) -> None:
        """Stop the agents (their rules stay until the sandbox goes) and the scratch namespace."""
        super().close()
        netns.delete([self.scratch])


class ApiRelay:
    """Relays TCP connections from 127.0.0.1:``port`` inside network namespace ``netns_name``
    to 127.0.0.1:``port`` on this process's own loopback (daemon threads; :meth:`close` stops
    accepting)."""

    def __init__(self, netns_name: str, port: int) -> None:
        with netns.entered(netns_name):
            self.listener = socket.create_server(("127.0.0.1", port))
        self.port = port
        threading.Thread(target=self._accept, name=f"relay-{netns_name}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inside, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                outside = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                outside.settimeout(None)
            except OSError:
                inside.close()
                continue
            for a, b in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop accepting (connections under way end with their peers)."""
        self.listener.close()


class KubeRouters(NodeDaemons):
    """The real kube-router on every sandbox node (the migration oracle; never shipped).

    ``binary``: the kube-router to run (:func:`find_binary` order: given, ``.tools/bin``,
    ``$PATH``), so an operator can point it at the exact build they run.
    """

    name = "kube-router"

    def __init__(self, sandbox: "Sandbox", control_plane: ControlPlane, binary: str | None = None) -> None:
        super().__init__(sandbox, control_plane)
        self.binary = find_binary("kube-router", binary)
        self.relays: list[ApiRelay] = []
        self.offsets: dict[str, int] = {}

    def start(self) -> None:
        """Relay the API into every node and start kube-router there."""
        for node in self.sandbox.nodes.values():
            self.relays.append(ApiRelay(node.netns, self.control_plane.port))
            self.offsets[node.name] = 0
            self._spawn(node.name, ["ip", "netns", "exec", node.netns, self.binary,
                                    f"--kubeconfig={self.control_plane.kubeconfig}",
                                    "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
                                    f"--service-cluster-ip-range={','.join(self.sandbox.config.service_cidrs)}",
                                    f"--service-node-port-range={node_port_flag(self.sandbox.config)}",
                                    "--health-port=0", "--metrics-port=0", "--v=1"],
                        env={"NODE_NAME": node.name})

    def iptables_save(self, node: str, binary: str = "iptables-save") -> str:
        """``iptables-save`` (or ``ip6tables-save``) of the node's namespace."""
        return subprocess.run(["ip", "netns", "exec", self.sandbox.nodes[node].netns, binary],
                              capture_output=True, text=True, check=True).stdout

    def ipset_save(self, node: str) -> str:
        """``ipset save`` of the node's namespace."""
        return subprocess.run(["ip", "netns", "exec", self.sandbox.nodes[node].netns, "ipset", "save"],
                              capture_output=True, text=True, check=True).stdout

    def wait_synced(self, timeout: float = 60.0, start_within: float = 3.0) -> None:
        """Wait until every kube-router has finished a sync that started after the last call
        (and none followed for :data:`QUIET` seconds), and its chains are in place. A node where
        no sync starts within ``start_within`` seconds had nothing to change.

        Raises ControlPlaneError naming the node when it never gets there (or kube-router exited).
        """
        begun = time.monotonic()
        deadline = begun + timeout
        pending = set(self.sandbox.nodes)
        while pending:
            self._check_alive()
            for node in sorted(pending):
                text = self.log(node)
                new = text[self.offsets[node]:]
                last_start = new.rfind(KUBE_ROUTER_SYNC_START)
                finished = last_start >= 0 and new.find(KUBE_ROUTER_SYNC_END, last_start) >= 0
                settled = finished and time.time() - self.log_path(node).stat().st_mtime >= QUIET
                idle = last_start < 0 and time.monotonic() - begun >= start_within and self.offsets[node] > 0
                if (settled or idle) and "KUBE-ROUTER-FORWARD" in self.iptables_save(node):
                    self.offsets[node] = len(text)
                    pending.discard(node)
            if pending and time.monotonic() > deadline:
                raise ControlPlaneError(f"kube-router on {', '.join(sorted(pending))} did not finish a sync within {timeout:.0f}s")
            time.sleep(0.1)

    def close(self) -> None:
        """Stop kube-router and the relays."""
        super().close()
        for relay in self.relays:
            relay.close()
        self.relays.clear()


def daemons_for(dataplane: str, sandbox: "Sandbox", control_plane: ControlPlane,
                kube_router: str | None = None) -> NodeDaemons:
    """The node daemons that enforce ``dataplane`` (``nft``: nftpolicy agents; ``kube-router``)."""
    if dataplane == "kube-router":
        return KubeRouters(sandbox, control_plane, kube_router)
    if dataplane == "nft":
        return NftpolicyAgents(sandbox, control_plane)
    raise ControlPlaneError(f"dataplane {dataplane} has no node daemon (with a control plane: nft or kube-router)")

