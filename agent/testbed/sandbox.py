"""The sandbox: a cluster built from network namespaces, enforced by real nftables, probed with real packets.

Topology (every namespace is named ``nftp-<run>-...``, where ``<run>`` is ``$NFTPOLICY_RUN_TAG``
plus random hex, and removed by :meth:`Sandbox.close`):

* one namespace per node: IP forwarding on, an uplink ``eth1`` into a shared bridge (namespace
  ``...-fabric``), and one veth ``vp<N>`` per local pod with the gateway addresses 169.254.1.1
  and fe80::1 (the pods' default routes), plus a host route to every pod (local: the veth;
  remote: the other node's uplink address);
* one namespace per pod: ``eth0`` with the pod's addresses (``status.podIPs`` when the manifests
  give them, else allocated from the Node's pod CIDRs, else from 10.244.<node>.0/24 and
  fd00:10:244:<node>::/64).

Probes between the pods: :mod:`nftpolicy.agent.testbed.probes`. Dataplanes (:meth:`Sandbox.node_dataplane`):
``nft`` applies each node's ruleset through libnftables inside the node's namespace;
``iptables-nft`` and ``iptables-legacy`` load the iptables variant of the same rule model
(:mod:`nftpolicy.translators.iptables`) with that ``iptables-restore`` and ``ipset restore``, also
inside the node's namespace. Replaying conformance cases, also on twin sandboxes:
:mod:`nftpolicy.agent.testbed.replay`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import secrets
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from nftpolicy.translators import transaction
from nftpolicy.translators.errors import OneLineError
from nftpolicy.translators.cases import NODE_TARGET, Matrix
from nftpolicy.translators.manifests import ManifestError, object_ref
from nftpolicy.translators.model import Cluster, Family, Node, Pod, family_of
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import FAMILIES, Config
from nftpolicy.translators.selectors import labels_of
from nftpolicy.translators.workloads import PlacementError, place_pods

from nftpolicy.agent.dataplane import netns
from .controlplane import ApiError, ControlPlane
from nftpolicy.agent.dataplane import Dataplane
from nftpolicy.agent.dataplane.iptables import IptablesDataplane
from nftpolicy.agent.dataplane.nftables import NftDataplane
from .probes import ProbeSpec, Prober
from .started import Started

NETNS_PREFIX = "nftp-"
GATEWAY_V4 = "169.254.1.1"
GATEWAY_V6 = "fe80::1"
DATAPLANES = ("nft", "iptables-nft", "iptables-legacy", "kube-router")
# The kinds publish writes to a control plane, in this order.
PUBLISHED = ("Namespace", "Pod", "NetworkPolicy", "ClusterNetworkPolicy")
NODE_SYSCTLS = {
    "net.ipv4.ip_forward": "1",
    "net.ipv6.conf.all.forwarding": "1",
    "net.ipv4.conf.all.rp_filter": "0",
    "net.ipv4.conf.default.rp_filter": "0",
    # Rejected UDP probes are answered with ICMP errors; unlimited so none is mistaken for a drop.
    "net.ipv4.icmp_ratelimit": "0",
    "net.ipv6.icmp.ratelimit": "0",
}


@dataclass(frozen=True)
class _Node:
    name: str
    netns: str
    index: int
    addresses: dict[Family, str]


class SandboxError(OneLineError, RuntimeError):
    """The sandbox could not be built or a ruleset could not be applied."""


class Sandbox(Started):
    """A throwaway cluster of network namespaces (context manager; always cleans up).

    ``pods``: the pods to build, placed by :func:`~nftpolicy.translators.workloads.place_pods`
    (hostNetwork and finished pods are left out; pods with no ``node`` are spread round-robin
    over ``default_nodes``; pods with no addresses get one per family in ``families``). ``timeout`` (seconds) bounds each probe. ``dataplane`` is one of
    :data:`DATAPLANES`: how :meth:`apply` loads each node's ruleset. ``served_nodes``: nodes
    whose address is a probe target too (``node:<name>``, :data:`~nftpolicy.translators.cases.NODE_TARGET`:
    a server in the node's namespace, as a host-network endpoint), built even when no pod runs there.
    ``pod_cidrs``: node -> its pod CIDRs (``spec.podCIDRs``), where pods without addresses get theirs.
    """

    def __init__(self, pods: Iterable[Pod], default_nodes: Sequence[str] = ("node1",),
                 families: Sequence[Family] = ("ipv4",), node_addresses: Mapping[str, Sequence[str]] | None = None,
                 config: Config = Config(), timeout: float = 1.0, dataplane: str = "nft", served_nodes: Sequence[str] = (),
                 pod_cidrs: Mapping[str, Sequence[str]] | None = None) -> None:
        if dataplane not in DATAPLANES:
            raise SandboxError(f"unknown dataplane {dataplane!r} (one of {', '.join(DATAPLANES)})")
        self.run = netns.run_tag() + secrets.token_hex(3)
        self.prefix = f"{NETNS_PREFIX}{self.run}-"
        self.config, self.timeout, self.dataplane = config, timeout, dataplane
        try:
            self.pods = place_pods(pods, default_nodes, families, pod_cidrs)
        except PlacementError as exc:
            raise SandboxError(str(exc)) from None
        names = sorted({p.node for p in self.pods.values() if p.node} | set(served_nodes))
        self.nodes: dict[str, _Node] = {}
        for i, name in enumerate(names):
            given = {ipaddress.ip_address(a).version: a for a in reversed((node_addresses or {}).get(name, ()))}  # the first of each family
            self.nodes[name] = _Node(name, f"{self.prefix}n{i}", i, {
                "ipv4": given.get(4, f"172.31.{i // 250}.{i % 250 + 2}"),
                "ipv6": given.get(6, f"fd00:172:31::{i + 2:x}"),
            })
        self.pod_netns = {key: f"{self.prefix}p{i}" for i, key in enumerate(self.pods)}
        self.fabric = f"{self.prefix}fabric"
        hosts = {f"{NODE_TARGET}{name}": (self.nodes[name].netns, tuple(self.nodes[name].addresses.values())) for name in served_nodes}
        self.prober = Prober(self.pods, self.pod_netns, timeout, hosts)

    # ---- lifecycle -----------------------------------------------------------------------

    def namespaces(self) -> list[str]:
        """Every namespace this sandbox owns."""
        return [self.fabric] + [n.netns for n in self.nodes.values()] + list(self.pod_netns.values())

    def close(self) -> None:
        """Stop the servers and delete every namespace of this run (idempotent; the namespaces
        are deleted even when a second Ctrl-C interrupts the rest)."""
        try:
            self.prober.close()
        finally:
            netns.delete(netns.existing(self.prefix))

    def start(self) -> None:
        """Make the namespaces, links and addresses of every node and pod, and start the probes' servers."""
        netns.create(self.namespaces())
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
                    commands += [f"route add {other.addresses[f]} dev eth1" for f in FAMILIES]
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
                    family = family_of(ip)
                    if pod.node == node.name:
                        commands.append(f"route add {ip} dev {veth[key]} src {node.addresses[family]}")
                    else:
                        commands.append(f"route add {ip} via {self.nodes[pod.node].addresses[family]} dev eth1")  # type: ignore[index]
            netns.ip_batch(commands, node.netns)

    # ---- rules ---------------------------------------------------------------------------

    def with_sandbox_pods(self, cluster: Cluster) -> Cluster:
        """``cluster`` with every sandbox pod's node and addresses as built here, and every
        sandbox node with the addresses built here as its InternalIPs (its labels those of the
        manifests' Node, else ``kubernetes.io/hostname``, as :meth:`publish` writes it).

        Pods and Nodes of ``cluster`` that the sandbox did not build keep what the manifests say.
        """
        pods = dict(cluster.pods)
        for key, built in self.pods.items():
            if key in pods:
                pods[key] = dataclasses.replace(pods[key], node=built.node, ips=built.ips, phase="Running")
        nodes = dict(cluster.nodes)
        for name, node in self.nodes.items():
            addresses = tuple(node.addresses[f] for f in FAMILIES)
            given = nodes.get(name) or Node(name, labels=labels_of({"kubernetes.io/hostname": name}))
            nodes[name] = dataclasses.replace(given, addresses=addresses, peer_addresses=addresses)
        return dataclasses.replace(cluster, pods=pods, nodes=nodes)

    def node_dataplane(self, name: str) -> Dataplane:
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
            dataplane.run(transaction.full(build_rule_model(cluster, name, self.config)))

    def publish(self, control_plane: ControlPlane, objects: Iterable[tuple[str, Any]]) -> list[ManifestError]:
        """Bring the control plane's cluster to ``objects`` (``(origin, manifest)`` pairs), as
        this sandbox built it: a Node per sandbox node (InternalIP = the node namespace's
        address; labels: ``kubernetes.io/hostname`` and those of its Node in ``objects``), each Pod on its sandbox node with its sandbox addresses, status written through
        the status subresource. Namespaces that pods use are created; NetworkPolicies and Pods
        that ``objects`` no longer has are deleted (a later step replaces an earlier one), and
        ClusterNetworkPolicies likewise.

        Returns one error per object the API server refused (its own reason); the rest is applied.
        """
        objects = list(objects)
        errors: list[ManifestError] = []
        wanted: dict[str, list[tuple[str, dict[str, Any]]]] = {kind: [] for kind in PUBLISHED}
        for origin, obj in objects:
            if isinstance(obj, dict) and obj.get("kind") in wanted:
                wanted[obj["kind"]].append((origin, obj))
        labels = {(o.get("metadata") or {}).get("name"): (o.get("metadata") or {}).get("labels") or {}
                  for _, o in objects if isinstance(o, dict) and o.get("kind") == "Node"}
        for node in self.nodes.values():
            addresses = [{"type": "InternalIP", "address": node.addresses[f]} for f in FAMILIES]
            addresses.append({"type": "Hostname", "address": node.name})
            control_plane.apply({"apiVersion": "v1", "kind": "Node",
                                 "metadata": {"name": node.name, "labels": {"kubernetes.io/hostname": node.name, **labels.get(node.name, {})}},
                                 "status": {"addresses": addresses}})
        given = {(o.get("metadata") or {}).get("name") for _, o in wanted["Namespace"]}
        for name in sorted({p.namespace for p in self.pods.values()} - given):
            wanted["Namespace"].append(("sandbox", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}))
        for i, (origin, pod) in enumerate(wanted["Pod"]):
            built = self.pods.get(object_ref("Pod", pod))
            if built is not None:
                host = self.nodes[built.node].addresses  # type: ignore[index]
                host_ips = [host[f] for f in FAMILIES if any(family_of(ip) == f for ip in built.ips)]
                wanted["Pod"][i] = (origin, {**pod, "spec": {**(pod.get("spec") or {}), "nodeName": built.node},
                                             "status": {**(pod.get("status") or {}), "phase": "Running",
                                                        "hostIP": host_ips[0], "hostIPs": [{"ip": ip} for ip in host_ips],
                                                        "podIP": built.ips[0], "podIPs": [{"ip": ip} for ip in built.ips]}})
        for kind in PUBLISHED:
            keep = set()
            for origin, obj in wanted[kind]:
                ref = object_ref(kind, obj)
                try:
                    control_plane.apply(obj)
                    keep.add(ref)
                except ApiError as error:
                    errors.append(ManifestError(kind, ref, f"the API server refused it: {error.status} {error.reason}", origin))
            if kind != "Namespace":
                for item in control_plane.items(kind):
                    if object_ref(kind, item) not in keep:
                        control_plane.delete(kind, item["metadata"]["name"], item["metadata"].get("namespace"))
        return errors

    def node_netns(self, name: str) -> str:
        """The network namespace of node ``name`` (to load rules into it directly)."""
        return self.nodes[name].netns

    def probe(self, specs: Iterable[ProbeSpec], families: Sequence[Family] = ("ipv4", "ipv6"),
              pairs: Iterable[tuple[str, str]] | None = None) -> dict[tuple[ProbeSpec, Family], Matrix]:
        """:meth:`Prober.probe` between this sandbox's pods."""
        return self.prober.probe(specs, families, pairs)

    def connect(self, src: str, address: str, spec: ProbeSpec) -> bool:
        """:meth:`Prober.connect` from sandbox pod ``src``."""
        return self.prober.connect(src, address, spec)
