"""The sandbox: a cluster built from network namespaces, enforced by real nftables, probed with real packets.

Topology (every namespace is named ``nftp-<run>-...``, where ``<run>`` is ``$NFTPOLICY_RUN_TAG``
plus random hex, and removed by :meth:`Sandbox.close`):

* one namespace per node: IP forwarding on, an uplink ``eth1`` into a shared bridge (namespace
  ``...-fabric``), and one veth ``vp<N>`` per local pod with the gateway addresses 169.254.1.1
  and fe80::1 (the pods' default routes), plus a host route to every pod (local: the veth;
  remote: the other node's uplink address);
* one namespace per pod: ``eth0`` with the pod's addresses (``status.podIPs`` when the manifests
  give them, else allocated from 10.244.<node>.0/24 and fd00:10:244:<node>::/64).

Pods serve every probed port (TCP accept, UDP echo, SCTP where the kernel has it); a probe is a
new connection from a fresh source port, so conntrack never carries an old verdict into a new
probe. ICMP probes (``ProbeSpec(0, "ICMP")``) are echo requests from a ping socket.

Dataplanes: ``nft`` applies each node's ruleset through libnftables inside the node's namespace;
``iptables-nft`` and ``iptables-legacy`` load the iptables variant of the same rule model
(:mod:`nftpolicy.translators.iptables`) with that ``iptables-restore`` and ``ipset restore``, also
inside the node's namespace. :func:`replay_twins` runs the same steps on twin sandboxes (same
pods, same addresses), one per dataplane, and reports every cell where they disagree.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import itertools
import secrets
import socket
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

from nftpolicy.translators.cases import Case, Matrix, case_manifests, differences
from nftpolicy.translators.manifests import ManifestError, build_cluster
from nftpolicy.translators.model import Cluster, Family, Pod, Protocol
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import Config

from . import netns
from .controlplane import ApiError, ControlPlane
from .dataplane import Dataplane
from .iptables import IptablesDataplane
from .nftables import NftDataplane
from .nodedaemons import NodeDaemons, daemons_for

NETNS_PREFIX = "nftp-"
GATEWAY_V4 = "169.254.1.1"
GATEWAY_V6 = "fe80::1"
SOURCE_PORTS = range(32768, 61000)
SOCKET_PROTO = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP, "SCTP": getattr(socket, "IPPROTO_SCTP", 132)}
DATAPLANES = ("nft", "iptables-nft", "iptables-legacy", "kube-router")
ICMP_ECHO = {socket.AF_INET: (8, 0), socket.AF_INET6: (128, 129)}  # (request, reply) types
NODE_SYSCTLS = {
    "net.ipv4.ip_forward": "1",
    "net.ipv6.conf.all.forwarding": "1",
    "net.ipv4.conf.all.rp_filter": "0",
    "net.ipv4.conf.default.rp_filter": "0",
    # Rejected UDP probes are answered with ICMP errors; unlimited so none is mistaken for a drop.
    "net.ipv4.icmp_ratelimit": "0",
    "net.ipv6.icmp.ratelimit": "0",
}


def sctp_supported() -> bool:
    """True when this kernel can open SCTP sockets (many CI kernels cannot)."""
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM, SOCKET_PROTO["SCTP"]).close()
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class ProbeSpec:
    """A destination port and protocol to probe between every pod pair; ``ProbeSpec(0, "ICMP")``
    is an ICMP (ICMPv6) echo request."""

    port: int
    protocol: Protocol | str


@dataclass(frozen=True)
class _Node:
    name: str
    netns: str
    index: int
    addresses: dict[Family, str]


class SandboxError(RuntimeError):
    """The sandbox could not be built or a ruleset could not be applied."""


class Sandbox:
    """A throwaway cluster of network namespaces (context manager; always cleans up).

    ``pods``: the pods to build (hostNetwork and finished pods are left out); pods with no
    ``node`` are spread round-robin over ``default_nodes``; pods with no addresses get one per
    family in ``families``. ``timeout`` (seconds) bounds each probe. ``dataplane`` is one of
    :data:`DATAPLANES`: how :meth:`apply` loads each node's ruleset.
    """

    def __init__(self, pods: Iterable[Pod], default_nodes: Sequence[str] = ("node1",),
                 families: Sequence[Family] = ("ipv4",), node_addresses: dict[str, Sequence[str]] | None = None,
                 config: Config = Config(), timeout: float = 1.0, dataplane: str = "nft") -> None:
        if dataplane not in DATAPLANES:
            raise SandboxError(f"unknown dataplane {dataplane!r} (one of {', '.join(DATAPLANES)})")
        self.run = netns.run_tag() + secrets.token_hex(3)
        self.prefix = f"{NETNS_PREFIX}{self.run}-"
        self.config, self.timeout, self.dataplane = config, timeout, dataplane
        self.pods: dict[str, Pod] = {}
        spread = itertools.cycle(default_nodes)
        for pod in sorted((p for p in pods if not p.host_network and p.phase not in ("Succeeded", "Failed")), key=lambda p: p.key):
            self.pods[pod.key] = dataclasses.replace(pod, node=pod.node or next(spread), phase="Running")
        names = sorted({p.node for p in self.pods.values() if p.node})
        self.nodes: dict[str, _Node] = {}
        for i, name in enumerate(names):
            given = {ipaddress.ip_address(a).version: a for a in (node_addresses or {}).get(name, ())}
            self.nodes[name] = _Node(name, f"{self.prefix}n{i}", i, {
                "ipv4": given.get(4, f"172.31.{i // 250}.{i % 250 + 2}"),
                "ipv6": given.get(6, f"fd00:172:31::{i + 2:x}"),
            })
        counters = {name: itertools.count(10) for name in self.nodes}
        for key, pod in self.pods.items():
            if not pod.ips:
                n, node = next(counters[pod.node]), self.nodes[pod.node]  # type: ignore[index]
                ips = []
                if "ipv4" in families:
                    ips.append(f"10.{244 + node.index // 256}.{node.index % 256}.{n}" if n < 255 else _too_many(pod))
                if "ipv6" in families:
                    ips.append(f"fd00:10:244:{node.index:x}::{n:x}")
                self.pods[key] = dataclasses.replace(pod, ips=tuple(ips))
        self.pod_netns = {key: f"{self.prefix}p{i}" for i, key in enumerate(self.pods)}
        self.fabric = f"{self.prefix}fabric"
        self.loop = asyncio.new_event_loop()
        self._served: set[ProbeSpec] = set()
        self._servers: list = []
        self._source_ports = itertools.cycle(SOURCE_PORTS)

    # ---- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> "Sandbox":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def namespaces(self) -> list[str]:
        """Every namespace this sandbox owns."""
        return [self.fabric] + [n.netns for n in self.nodes.values()] + list(self.pod_netns.values())

    def close(self) -> None:
        """Stop the servers and delete every namespace of this run (idempotent; the namespaces
        are deleted even when a second Ctrl-C interrupts the rest)."""
        try:
            for server in self._servers:
                server.close()
            self._servers.clear()
            if not self.loop.is_closed():
                pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
                for task in pending:  # probes cut short by Ctrl-C or SIGTERM
                    task.cancel()
                if pending and not self.loop.is_running():
                    with contextlib.suppress(BaseException):
                        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self.loop.close()
        finally:
            netns.delete(netns.existing(self.prefix))

    def _build(self) -> None:
        netns.ip_batch([f"netns add {name}" for name in self.namespaces()])
        for name in self.namespaces():
            # No duplicate address detection: a tentative link-local address cannot source the
            # neighbour solicitations that forwarded IPv6 needs, so the first probes would fail.
            for key in ("net.ipv6.conf.all.accept_dad", "net.ipv6.conf.default.accept_dad"):
                netns.write_sysctl(name, key, "0")
        fabric = ["link add br0 type bridge mcast_snooping 0", "link set br0 up"]
        for node in self.nodes.values():
            fabric += [f"link add n{node.index} type veth peer name eth1 netns {node.netns}",
                       f"link set n{node.index} master br0", f"link set n{node.index} up"]
        netns.ip_batch(fabric, self.fabric)
        veth = {key: f"vp{i}" for i, key in enumerate(self.pods)}
        for node in self.nodes.values():
            commands = ["link set lo up", "link set eth1 up",
                        f"addr add {node.addresses['ipv4']}/32 dev eth1", f"addr add {node.addresses['ipv6']}/128 dev eth1 nodad"]
            for other in self.nodes.values():
                if other is not node:
                    commands += [f"route add {other.addresses[f]} dev eth1" for f in ("ipv4", "ipv6")]
            for key, pod in self.pods.items():
                if pod.node == node.name:
                    commands += [f"link add {veth[key]} type veth peer name eth0 netns {self.pod_netns[key]}",
                                 f"link set {veth[key]} up", f"addr add {GATEWAY_V4}/32 dev {veth[key]}",
                                 f"addr add {GATEWAY_V6}/64 dev {veth[key]} nodad"]
            netns.ip_batch(commands, node.netns)
            for key, value in NODE_SYSCTLS.items():
                netns.write_sysctl(node.netns, key, value)
        for key, pod in self.pods.items():
            commands = ["link set lo up", "link set eth0 up", f"route add {GATEWAY_V4} dev eth0 scope link",
                        f"route add default via {GATEWAY_V4} dev eth0", f"route add default via {GATEWAY_V6} dev eth0"]
            commands += [f"addr add {ip}/32 dev eth0" if ":" not in ip else f"addr add {ip}/128 dev eth0 nodad" for ip in pod.ips]
            netns.ip_batch(commands, self.pod_netns[key])
        for node in self.nodes.values():
            commands = []
            for key, pod in self.pods.items():
                for ip in pod.ips:
                    family = "ipv6" if ":" in ip else "ipv4"
                    if pod.node == node.name:
                        commands.append(f"route add {ip} dev {veth[key]} src {node.addresses[family]}")
                    else:
                        commands.append(f"route add {ip} via {self.nodes[pod.node].addresses[family]} dev eth1")  # type: ignore[index]
            netns.ip_batch(commands, node.netns)

    # ---- rules ---------------------------------------------------------------------------

    def with_sandbox_pods(self, cluster: Cluster) -> Cluster:
        """``cluster`` with every sandbox pod's node and addresses as built here.

        Pods of ``cluster`` that the sandbox did not build keep what the manifests say.
        """
        pods = dict(cluster.pods)
        for key, built in self.pods.items():
            if key in pods:
                pods[key] = dataclasses.replace(pods[key], node=built.node, ips=built.ips, phase="Running")
        return dataclasses.replace(cluster, pods=pods)

    def node_dataplane(self, name: str) -> Dataplane[Any]:
        """The dataplane of node ``name``'s namespace that :meth:`apply` loads: libnftables, or
        the iptables variant with ``iptables-nft-restore`` / ``iptables-legacy-restore``."""
        if self.dataplane == "nft":
            return NftDataplane(self.config.table, self.nodes[name].netns)
        if self.dataplane == "kube-router":
            raise SandboxError("kube-router takes its rules from the API server: run it with a control plane")
        return IptablesDataplane(self.nodes[name].netns, "legacy" if self.dataplane == "iptables-legacy" else "nft")

    def apply(self, cluster: Cluster, nodes: Iterable[str] | None = None) -> None:
        """Render each node's ruleset from ``cluster`` and load it inside that node's namespace
        with this sandbox's dataplane (``nodes``: only these; default every node).

        Raises DataplaneError (nft: the node keeps its previous ruleset).
        """
        chosen = self.nodes.keys() if nodes is None else set(nodes)
        dataplanes = {name: self.node_dataplane(name) for name in self.nodes if name in chosen}
        cluster = self.with_sandbox_pods(cluster)
        for name, dataplane in dataplanes.items():
            dataplane.replace(build_rule_model(cluster, name, self.config))

    def publish(self, control_plane: ControlPlane, objects: Iterable[tuple[str, Any]]) -> list[ManifestError]:
        """Bring the control plane's cluster to ``objects`` (``(origin, manifest)`` pairs), as
        this sandbox built it: a Node per sandbox node (InternalIP = the node namespace's
        address), each Pod on its sandbox node with its sandbox addresses, status written through
        the status subresource. Namespaces that pods use are created; NetworkPolicies and Pods
        that ``objects`` no longer has are deleted (a later step replaces an earlier one).

        Returns one error per object the API server refused (its own reason); the rest is applied.
        """
        errors: list[ManifestError] = []
        wanted: dict[str, list[tuple[str, dict[str, Any]]]] = {kind: [] for kind in ("Namespace", "Pod", "NetworkPolicy")}
        for origin, obj in objects:
            if isinstance(obj, dict) and obj.get("kind") in wanted:
                wanted[obj["kind"]].append((origin, obj))
        for node in self.nodes.values():
            addresses = [{"type": "InternalIP", "address": node.addresses[f]} for f in ("ipv4", "ipv6")]
            addresses.append({"type": "Hostname", "address": node.name})
            control_plane.apply({"apiVersion": "v1", "kind": "Node",
                                 "metadata": {"name": node.name, "labels": {"kubernetes.io/hostname": node.name}},
                                 "status": {"addresses": addresses}})
        given = {(o.get("metadata") or {}).get("name") for _, o in wanted["Namespace"]}
        for name in sorted({p.namespace for p in self.pods.values()} - given):
            wanted["Namespace"].append(("sandbox", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}))
        for i, (origin, pod) in enumerate(wanted["Pod"]):
            meta = pod.get("metadata") or {}
            built = self.pods.get(f"{meta.get('namespace') or 'default'}/{meta.get('name')}")
            if built is not None:
                host = self.nodes[built.node].addresses  # type: ignore[index]
                host_ips = [host[f] for f in ("ipv4", "ipv6") if any(ipaddress.ip_address(ip).version == (4 if f == "ipv4" else 6) for ip in built.ips)]
                wanted["Pod"][i] = (origin, {**pod, "spec": {**(pod.get("spec") or {}), "nodeName": built.node},
                                             "status": {**(pod.get("status") or {}), "phase": "Running",
                                                        "hostIP": host_ips[0], "hostIPs": [{"ip": ip} for ip in host_ips],
                                                        "podIP": built.ips[0], "podIPs": [{"ip": ip} for ip in built.ips]}})
        for kind in ("Namespace", "Pod", "NetworkPolicy"):
            keep = set()
            for origin, obj in wanted[kind]:
                meta = obj.get("metadata") or {}
                ref = f"{meta.get('namespace') or 'default'}/{meta.get('name')}" if kind != "Namespace" else str(meta.get("name"))
                try:
                    control_plane.apply(obj)
                    keep.add(ref)
                except ApiError as error:
                    errors.append(ManifestError(kind, ref, f"the API server refused it: {error.status} {error.reason}", origin))
            if kind != "Namespace":
                for item in control_plane.items(kind):
                    meta = item["metadata"]
                    if f"{meta['namespace']}/{meta['name']}" not in keep:
                        control_plane.delete(kind, meta["name"], meta["namespace"])
        return errors

    def node_netns(self, name: str) -> str:
        """The network namespace of node ``name`` (to load rules into it directly)."""
        return self.nodes[name].netns

    # ---- probes --------------------------------------------------------------------------

    def probe(self, specs: Iterable[ProbeSpec], families: Sequence[Family] = ("ipv4", "ipv6"),
              pairs: Iterable[tuple[str, str]] | None = None) -> dict[tuple[ProbeSpec, Family], Matrix]:
        """Connect from every pod to every pod on each spec, once per address family
        (``pairs``: only these ``(from, to)`` pod keys).

        Returns ``{(spec, family): {(from, to): connected}}`` for the families the pods have.
        SCTP specs are left out when the kernel has no SCTP.
        """
        specs = [s for s in specs if s.protocol != "SCTP" or sctp_supported()]
        wanted = set(pairs) if pairs is not None else None
        return self.loop.run_until_complete(self._probe_all(specs, families, wanted))

    def connect(self, src: str, address: str, spec: ProbeSpec) -> bool:
        """One new connection from sandbox pod ``src`` to ``address`` (every pod serves ``spec``
        from then on); True when it connected (TCP, SCTP) or got its echo back (UDP)."""
        return self.loop.run_until_complete(self._connect_once(src, address, spec))

    async def _connect_once(self, src: str, address: str, spec: ProbeSpec) -> bool:
        if spec not in self._served:
            await self._serve(spec)
            self._served.add(spec)
        return await self._connect(asyncio.Semaphore(1), src, address, spec)

    async def _probe_all(self, specs: list[ProbeSpec], families: Sequence[Family],
                         wanted: set[tuple[str, str]] | None = None) -> dict[tuple[ProbeSpec, Family], Matrix]:
        for spec in specs:
            if spec not in self._served:
                await self._serve(spec)
                self._served.add(spec)
        limit = asyncio.Semaphore(200)
        jobs = []
        for spec in specs:
            for family in families:
                for src, dst in itertools.product(self.pods.values(), repeat=2):
                    if wanted is not None and (src.key, dst.key) not in wanted:
                        continue
                    targets = dst.addresses(family)
                    if src.addresses(family) and targets:
                        jobs.append(((spec, family), (src.key, dst.key), self._connect(limit, src.key, targets[0], spec)))
        results = await asyncio.gather(*(job for _, _, job in jobs))
        matrices: dict[tuple[ProbeSpec, Family], Matrix] = {}
        for (key, cell, _), ok in zip(jobs, results):
            matrices.setdefault(key, {})[cell] = ok
        return matrices

    def _socket(self, pod: str, family: int, kind: int, protocol: Protocol) -> socket.socket:
        with netns.entered(self.pod_netns[pod]):
            sock = socket.socket(family, kind, SOCKET_PROTO[protocol])
        sock.setblocking(False)
        return sock

    async def _serve(self, spec: ProbeSpec) -> None:
        if spec.protocol == "ICMP":
            # Ping sockets (no raw sockets needed) for root's group, in every pod.
            for name in self.pod_netns.values():
                netns.write_sysctl(name, "net.ipv4.ping_group_range", "0 2147483647")
            return
        kind = socket.SOCK_DGRAM if spec.protocol == "UDP" else socket.SOCK_STREAM
        for key in self.pods:
            sock = self._socket(key, socket.AF_INET6, kind, spec.protocol)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::", spec.port))
            if kind == socket.SOCK_DGRAM:
                transport, _ = await self.loop.create_datagram_endpoint(_Echo, sock=sock)
                self._servers.append(transport)
            else:
                sock.listen(128)
                self._servers.append(await self.loop.create_server(_Hangup, sock=sock))

    def _source_port(self) -> int:
        served = {s.port for s in self._served}
        return next(p for p in self._source_ports if p not in served)

    async def _ping(self, src: str, address: str) -> bool:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        request, reply_type = ICMP_ECHO[family]
        with netns.entered(self.pod_netns[src]):
            sock = socket.socket(family, socket.SOCK_DGRAM, socket.IPPROTO_ICMP if family == socket.AF_INET else socket.IPPROTO_ICMPV6)
        sock.setblocking(False)
        try:
            sock.connect((address, 0))
            # The checksum and identifier are filled in by the kernel's ping socket.
            await self.loop.sock_sendall(sock, bytes([request, 0, 0, 0, 0, 0, 0, 1]) + b"nftpolicy-probe")
            reply = await asyncio.wait_for(self.loop.sock_recv(sock, 128), self.timeout)
            return len(reply) >= 8 and reply[0] == reply_type
        except (OSError, asyncio.TimeoutError):
            return False
        finally:
            sock.close()

    async def _connect(self, limit: asyncio.Semaphore, src: str, address: str, spec: ProbeSpec) -> bool:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        if spec.protocol == "ICMP":
            async with limit:
                return await self._ping(src, address)
        async with limit:
            sock = self._socket(src, family, socket.SOCK_DGRAM if spec.protocol == "UDP" else socket.SOCK_STREAM, spec.protocol)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", self._source_port()))
                if spec.protocol == "UDP":
                    sock.connect((address, spec.port))
                    await self.loop.sock_sendall(sock, b"nftpolicy-probe")
                    reply = await asyncio.wait_for(self.loop.sock_recv(sock, 64), self.timeout)
                    return reply == b"nftpolicy-probe"
                await asyncio.wait_for(self.loop.sock_connect(sock, (address, spec.port)), self.timeout)
                return True
            except (OSError, asyncio.TimeoutError):
                return False
            finally:
                if spec.protocol != "UDP":
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                sock.close()


def _too_many(pod: Pod) -> str:
    raise SandboxError(f"too many pods on node {pod.node} for the sandbox's /24 (pod {pod.key})")


class _Echo(asyncio.DatagramProtocol):
    """UDP server: send every datagram back."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:  # type: ignore[override]
        self.transport.sendto(data, addr)


class _Hangup(asyncio.Protocol):
    """TCP/SCTP server: accept, then close (the accepted connection is the answer)."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        transport.close()


@dataclass
class StepResult:
    """One replayed case (or step): the measured matrices and every cell that differs.

    ``cluster`` is the step's cluster with the sandbox's pod addresses; ``differences`` rows are ``(spec, family, from, to, expected, actual)``; ``not_probed`` lists
    the (spec, family) pairs the kernel could not probe (SCTP without kernel support).
    """

    case: Case
    cluster: Cluster
    results: dict[tuple[ProbeSpec, Family], Matrix]
    differences: list[tuple[ProbeSpec, Family, str, str, bool, bool | None]]
    not_probed: list[tuple[ProbeSpec, Family]]
    errors: list[ManifestError]


def replay(cases: Sequence[Case], nodes: Sequence[str] = ("node1",), families: Sequence[Family] = ("ipv4",),
           config: Config = Config(), timeout: float = 1.0, dataplane: str = "nft",
           control_plane: ControlPlane | None = None, kube_router: str | None = None) -> Iterator[tuple[Sandbox, StepResult]]:
    """Replay conformance cases in one sandbox, in order, as a live sequence of steps.

    The pods of the first case are built once; each case's namespaces, labels and policies are
    applied over the previous ones (one transaction per node; with ``control_plane``, as API
    writes that the node daemons pick up), then its probes are run and compared with the
    expected matrices (diagonal ignored). Yields after every step, while the sandbox still exists.
    """
    with contextlib.closing(replay_twins(cases, nodes, families, config, timeout, (dataplane,), control_plane, kube_router)) as twins:
        for sandboxes, steps, _ in twins:
            yield sandboxes[0], steps[0]


# (spec, family, from, to, verdict of the first dataplane, verdict of the other)
Disagreement = tuple[ProbeSpec, Family, str, str, bool | None, bool | None]


def disagreements(first: dict[tuple[ProbeSpec, Family], Matrix], other: dict[tuple[ProbeSpec, Family], Matrix]) -> list[Disagreement]:
    """Every cell (diagonal included) where two probe results differ, or that only one has."""
    found = []
    for key in sorted(set(first) | set(other), key=lambda k: (k[0].port, k[0].protocol, k[1])):
        a, b = first.get(key, {}), other.get(key, {})
        for cell in sorted(set(a) | set(b)):
            if a.get(cell) != b.get(cell):
                found.append((key[0], key[1], cell[0], cell[1], a.get(cell), b.get(cell)))
    return found


def replay_twins(cases: Sequence[Case], nodes: Sequence[str] = ("node1",), families: Sequence[Family] = ("ipv4",),
                 config: Config = Config(), timeout: float = 1.0, dataplanes: Sequence[str] = ("nft", "iptables-nft"),
                 control_plane: ControlPlane | None = None, kube_router: str | None = None,
                 ) -> Iterator[tuple[list[Sandbox], list[StepResult], list[list[Disagreement]]]]:
    """:func:`replay` on twin sandboxes, one per dataplane (same pods, same addresses).

    With ``control_plane``, every step is written to that API server once, and each twin's
    node daemons (:func:`~.nodedaemons.daemons_for`: nftpolicy agents for ``nft``, the real
    kube-router, from ``kube_router`` or the default binary) enforce it; probes start when every
    daemon has synced. Yields after every step: the sandboxes, one :class:`StepResult` per
    dataplane, and for each dataplane after the first the cells where it disagrees with the first.
    """
    pods_only = dataclasses.replace(cases[0], policies=())
    skeleton, _ = build_cluster(("case", o) for o in case_manifests(pods_only, {}))
    with contextlib.ExitStack() as stack:
        sandboxes = [stack.enter_context(Sandbox(skeleton.pods.values(), nodes, families, None, config, timeout, d))
                     for d in dataplanes]
        for other in sandboxes[1:]:
            if {k: p.ips for k, p in other.pods.items()} != {k: p.ips for k, p in sandboxes[0].pods.items()}:
                raise SandboxError("twin sandboxes got different pod addresses")
        daemons: list[NodeDaemons] = []
        for case in cases:
            ips = {key: list(pod.ips) for key, pod in sandboxes[0].pods.items()}
            objects = [(f"case {case.name}", o) for o in case_manifests(case, ips)]
            if control_plane is None:
                steps = [_step(sandbox, case, families, objects) for sandbox in sandboxes]
            else:
                errors = sandboxes[0].publish(control_plane, objects)
                daemons = daemons or start_daemons(stack, sandboxes, control_plane, kube_router)
                for daemon in daemons:
                    daemon.wait_synced()
                steps = [_step(sandbox, case, families, objects, errors) for sandbox in sandboxes]
            yield sandboxes, steps, [disagreements(steps[0].results, s.results) for s in steps[1:]]


def start_daemons(stack: contextlib.ExitStack, sandboxes: Sequence[Sandbox], control_plane: ControlPlane,
                  kube_router: str | None = None) -> list[NodeDaemons]:
    """Start each sandbox's node daemons against ``control_plane`` (nftpolicy agents for an
    ``nft`` sandbox, kube-router for a ``kube-router`` one); ``stack`` stops them before the
    sandboxes go."""
    daemons: list[NodeDaemons] = []
    for sandbox in sandboxes:
        daemon = daemons_for(sandbox.dataplane, sandbox, control_plane, kube_router)
        stack.callback(daemon.close)
        daemon.start()
        daemons.append(daemon)
    return daemons


def _step(sandbox: Sandbox, case: Case, families: Sequence[Family], objects: list[tuple[str, Any]],
          api_errors: list[ManifestError] | None = None) -> StepResult:
    """Apply one case over the sandbox's current state (unless node daemons enforce what the API
    server took: ``api_errors`` then lists what it refused), probe it and compare with the case."""
    cluster, errors = build_cluster(objects)
    cluster = sandbox.with_sandbox_pods(cluster)
    if api_errors is None:
        sandbox.apply(cluster)
    else:
        errors = api_errors
    results = sandbox.probe([ProbeSpec(p.port, p.protocol) for p in case.probes], families)
    diffs, not_probed = [], []
    for probe in case.probes:
        spec = ProbeSpec(probe.port, probe.protocol)
        for family in families:
            actual = results.get((spec, family))
            if actual is None:
                not_probed.append((spec, family))
            else:
                diffs.extend((spec, family, *d) for d in differences(probe.expected, actual))
    return StepResult(case, cluster, results, diffs, not_probed, errors)
