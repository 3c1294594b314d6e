"""End-to-end harness: an API server (the in-repo fake for fault injection, or the real
kube-apiserver of a :class:`ControlPlane` through :class:`RealApi`), sandbox pods on one node, and
``nftpolicy agent`` running as a real process that commits inside the sandbox node's network
namespace."""

from __future__ import annotations

import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.testbed.controlplane import ControlPlane, free_port
from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.agent.testbed.sandbox import Sandbox
from nftpolicy.translators.model import Pod

from .conftest import eventually, http_get
from .fakeapi import FakeApiServer, namespace, node, pod

NFTPOLICY = str(Path(sys.executable).parent / "nftpolicy")


class RealApi:
    """The fake API server's interface (``put``, ``delete``, ``kubeconfig``) over a real
    :class:`ControlPlane`, which its fixture starts and stops."""

    def __init__(self, control_plane: ControlPlane) -> None:
        self.control_plane = control_plane

    def put(self, obj: dict) -> dict:
        return self.control_plane.apply(obj)

    def delete(self, kind: str, name: str, namespace: str = "") -> None:
        self.control_plane.delete(kind, name, namespace or None)

    def kubeconfig(self, path: str) -> str:
        return self.control_plane.kubeconfig

    def stop(self) -> None:
        """Nothing: the control plane outlives this environment."""


class AgentEnv:
    """``slots`` maps sandbox pod keys (``ns/name``) to their IPs; all live on ``node1``.

    The API objects are independent of the slots: a test puts Pods whose IPs point at slots.
    ``agent_netns``: a network namespace the test made, where the agent process runs (so its
    API connections and HTTP endpoint live there; it still commits in the sandbox node's).
    ``serve_node``: node1's own address serves probes too (a host-network endpoint).
    """

    def __init__(self, tmp_path: Path, slots: dict[str, str], extra_args: tuple[str, ...] = (),
                 api: FakeApiServer | RealApi | None = None, agent_netns: str | None = None, serve_node: bool = False) -> None:
        if api is None:
            api = FakeApiServer(bookmark_interval=0.5)
            api.start()
        self.api, self.slots = api, slots
        self.kubeconfig = self.api.kubeconfig(str(tmp_path / "kubeconfig.json"))
        self.api.put(node("node1"))
        for ns in sorted({key.split("/")[0] for key in slots}):
            self.api.put(namespace(ns))
        pods = [Pod(namespace=k.split("/")[0], name=k.split("/")[1], labels={}, node="node1", ips=(ip,)) for k, ip in slots.items()]
        self.sandbox = Sandbox(pods, timeout=0.5, served_nodes=("node1",) if serve_node else ()).__enter__()
        self.netns = self.sandbox.nodes["node1"].netns
        self.port = free_port()
        self.log_path = tmp_path / "agent.log"
        self.extra_args = extra_args
        self.agent_netns = agent_netns
        self.proc: subprocess.Popen | None = None

    def put_slot_pods(self) -> "AgentEnv":
        """A Running pod in the API for every slot, at the slot's address, labelled
        ``app=<name>``; returns self."""
        for key, ip in self.slots.items():
            ns, name = key.split("/")
            self.api.put(pod(ns, name, ip, app=name))
        return self

    def start_agent(self, wait_ready: bool = True) -> None:
        inside = ["ip", "netns", "exec", self.agent_netns] if self.agent_netns else []  # ip execs: the pid is the agent's
        args = [*inside, NFTPOLICY, "agent", "--kubeconfig", self.kubeconfig, "--node", "node1", "--netns", self.netns,
                "--http-address", f"127.0.0.1:{self.port}", "--min-sync-interval", "0.05", "--api-timeout", "2",
                "--watch-timeout", "20", "--log-format", "json", *self.extra_args]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self.log_path.open("a"))
        if wait_ready:
            eventually(lambda: self.http("/readyz")[0], 200, timeout=15)

    def stop_agent(self) -> int:
        assert self.proc
        self.proc.terminate()
        code = self.proc.wait(timeout=15)
        self.proc = None
        return code

    def close(self) -> None:
        if self.proc:
            self.proc.kill()
            self.proc.wait()
        self.sandbox.close()
        self.api.stop()

    def http(self, path: str) -> tuple[int, str]:
        with netns.entered(self.agent_netns) if self.agent_netns else nullcontext():
            return http_get(f"http://127.0.0.1:{self.port}{path}")

    def metric(self, name: str, **labels: str) -> float:
        """A sample of /metrics (0 when absent)."""
        _, text = self.http("/metrics")
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
        for line in text.splitlines():
            sample, _, value = line.rpartition(" ")
            if sample == wanted or (not labels and sample == name):
                return float(value)
        return 0.0

    def log(self) -> str:
        return self.log_path.read_text()

    def connects(self, src: str, dst_ip: str, port: int = 80, protocol: str = "TCP") -> bool:
        """One real connection from sandbox pod ``src`` to ``dst_ip``."""
        return self.sandbox.connect(src, dst_ip, ProbeSpec(port, protocol))  # type: ignore[arg-type]
