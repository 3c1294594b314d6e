"""The cluster model: the few fields of Kubernetes objects that NetworkPolicy enforcement needs.

Every type is a frozen dataclass built by :mod:`nftpolicy.translators.manifests` (from YAML or
JSON) or by the agent's API sources; validation and API-server defaulting happen there, so a
model object is always valid (ClusterNetworkPolicy by :mod:`nftpolicy.translators.clusterpolicy`).
Source of the semantics: the Kubernetes API reference for ``networking.k8s.io/v1``
NetworkPolicy (label selectors: :mod:`nftpolicy.translators.selectors`) and, for
ClusterNetworkPolicy, sigs.k8s.io/network-policy-api v0.3.0 (``apis/v1beta1``, the schema of
``v1alpha2`` too).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping

from .selectors import LabelSelector, Labels, labels_of

Protocol = Literal["TCP", "UDP", "SCTP"]
Direction = Literal["ingress", "egress"]
DIRECTIONS: tuple[Direction, ...] = ("ingress", "egress")
Family = Literal["ipv4", "ipv6"]
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

Tier = Literal["Admin", "Baseline"]  # of a ClusterNetworkPolicy
Action = Literal["Accept", "Deny", "Pass"]  # of a ClusterNetworkPolicy rule
TIERS: tuple[Tier, ...] = ("Admin", "Baseline")
ACTIONS: tuple[Action, ...] = ("Accept", "Deny", "Pass")
PROTOCOLS: tuple[Protocol, ...] = ("TCP", "UDP", "SCTP")
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def family_of(address: str) -> Family:
    """Return ``"ipv4"`` or ``"ipv6"`` for a valid address or network string (validated when the
    manifests were read; only IPv6 text contains ':')."""
    return "ipv6" if ":" in address else "ipv4"


@dataclass(frozen=True, slots=True)
class Namespace:
    """A Namespace: name and labels (``kubernetes.io/metadata.name`` always present)."""

    name: str
    labels: Labels

    def __post_init__(self) -> None:
        if type(self.labels) is not Labels:  # given a plain mapping: its interned label set
            object.__setattr__(self, "labels", labels_of(self.labels))


@dataclass(frozen=True, slots=True)
class ContainerPort:
    """A container port: optional IANA name, number 1-65535, protocol."""

    name: str | None
    port: int
    protocol: Protocol


@dataclass(frozen=True, slots=True)
class Pod:
    """A Pod as far as policy is concerned.

    ``ips`` holds every address in ``status.podIPs`` (both families on a dual-stack cluster).
    ``phase`` is ``status.phase``; ``host_network`` is ``spec.hostNetwork``.
    """

    namespace: str
    name: str
    labels: Labels
    node: str | None
    ips: tuple[str, ...]
    phase: str = "Running"
    host_network: bool = False
    ports: tuple[ContainerPort, ...] = ()

    def __post_init__(self) -> None:
        if type(self.labels) is not Labels:  # given a plain mapping: its interned label set
            object.__setattr__(self, "labels", labels_of(self.labels))

    @property
    def key(self) -> str:
        """``namespace/name``."""
        return f"{self.namespace}/{self.name}"

    @property
    def enforceable(self) -> bool:
        """True when the pod counts as a policy target or peer.

        DESIGN.md section 3: only running pods with an IP count, hostNetwork pods never, and a
        finished pod (Succeeded/Failed) releases its IP at once.
        """
        return bool(self.ips) and not self.host_network and self.phase not in ("Succeeded", "Failed")

    def addresses(self, family: Family) -> tuple[str, ...]:
        """The pod's addresses of one family."""
        return tuple(ip for ip in self.ips if family_of(ip) == family)

    def resolve_port(self, name: str, protocol: Protocol) -> int | None:
        """The number of the container port called ``name`` with ``protocol``, or None.

        NetworkPolicyPort API reference: a named port matches a container port of that name,
        and the protocol must match too.
        """
        for p in self.ports:
            if p.name == name and p.protocol == protocol:
                return p.port
        return None


@dataclass(frozen=True, slots=True)
class PolicyPort:
    """One ``ports`` entry: protocol, and a number, a range ``port..end_port`` or a name.

    ``port`` None means every port of the protocol; a string is a named container port.
    """

    protocol: Protocol = "TCP"
    port: int | str | None = None
    end_port: int | None = None


@dataclass(frozen=True, slots=True)
class IPBlock:
    """An ``ipBlock`` peer: a CIDR minus its own ``except`` list (all one family)."""

    cidr: IPNetwork
    excepts: tuple[IPNetwork, ...] = ()

    def spans(self) -> list[tuple[int, int]]:
        """The CIDR with every except removed, as inclusive ranges of addresses (integers),
        disjoint and in address order."""
        at, end = int(self.cidr.network_address), int(self.cidr.broadcast_address)
        spans = []
        for hole in sorted(self.excepts):  # one family
            low, high = int(hole.network_address), int(hole.broadcast_address)
            if low > at:
                spans.append((at, min(low - 1, end)))
            at = max(at, high + 1)
            if at > end:
                return spans
        return spans + [(at, end)]

    def networks(self) -> list[IPNetwork]:
        """The CIDR with every except removed, as the fewest disjoint networks in address order."""
        return span_networks(self.spans(), self.cidr.version)

    def contains(self, address: str) -> bool:
        """True when ``address`` is in the CIDR and in none of its excepts."""
        ip = ipaddress.ip_address(address)
        return ip in self.cidr and not any(ip in hole for hole in self.excepts)


def span_networks(spans: Iterable[tuple[int, int]], version: int) -> list[IPNetwork]:
    """The fewest networks of IP ``version`` (4 or 6) that hold exactly the addresses of
    ``spans`` (inclusive ranges of addresses as integers, in order of their start; overlapping
    and adjacent ones merge), in address order: each merged range cut into the largest aligned
    blocks, as ``ipaddress.collapse_addresses`` would give them, in integers."""
    bits = 32 if version == 4 else 128
    network = ipaddress.IPv4Network if version == 4 else ipaddress.IPv6Network
    merged: list[tuple[int, int]] = []
    for low, high in spans:
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    found: list[IPNetwork] = []
    for low, high in merged:
        while low <= high:
            size = low & -low or 1 << bits  # the largest block aligned at low
            while low + size - 1 > high:
                size >>= 1
            found.append(network((low, bits + 1 - size.bit_length())))
            low += size
    return found


@dataclass(frozen=True, slots=True)
class Peer:
    """A ``from``/``to`` peer: pod and/or namespace selectors (AND'ed), or an ipBlock.

    ``pod_selector`` None with a namespace selector means every pod of those namespaces;
    ``namespace_selector`` None means the policy's own namespace (API reference,
    NetworkPolicyPeer).
    """

    pod_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    ip_block: IPBlock | None = None


@dataclass(frozen=True, slots=True)
class PolicyRule:
    """One ingress or egress rule. Empty ``peers`` means every peer, empty ``ports`` every port."""

    peers: tuple[Peer, ...] = ()
    ports: tuple[PolicyPort, ...] = ()


@dataclass(frozen=True, slots=True)
class NetworkPolicy:
    """A NetworkPolicy with defaulted ``policy_types``.

    ``policy_types`` follows the API server's defaulting: Ingress always, plus Egress when the
    spec has egress rules, unless the object lists them. ``fail_closed``: why this is the
    rule-less stand-in of an invalid object (DESIGN.md section 4), None for a valid policy.
    """

    namespace: str
    name: str
    pod_selector: LabelSelector
    policy_types: frozenset[Direction]
    ingress: tuple[PolicyRule, ...] = ()
    egress: tuple[PolicyRule, ...] = ()
    fail_closed: str | None = None  # a fail-closed stand-in's reason: the object's validation error

    @property
    def key(self) -> str:
        """``namespace/name``."""
        return f"{self.namespace}/{self.name}"

    def rules(self, direction: Direction) -> tuple[PolicyRule, ...]:
        """The rules of one direction."""
        return self.ingress if direction == "ingress" else self.egress


@dataclass(frozen=True, slots=True)
class ClusterPeer:
    """One ``from``/``to`` peer: exactly one of ``namespaces`` (every pod of the namespaces it
    matches), ``pods`` (``(namespace selector, pod selector)``: pods matching both),
    ``networks`` (egress only: CIDRs, host bits masked), ``nodes`` (egress only: the
    :attr:`Node.peer_addresses` of the Nodes whose labels the selector matches; empty: every Node)
    or ``domain_names`` (egress only: names and ``*.`` wildcards, lower case without a trailing
    dot; :func:`domain_name_matches`)."""

    namespaces: LabelSelector | None = None
    pods: tuple[LabelSelector, LabelSelector] | None = None
    networks: tuple[IPNetwork, ...] = ()
    domain_names: tuple[str, ...] = ()
    nodes: LabelSelector | None = None


@dataclass(frozen=True, slots=True)
class ClusterPort:
    """One ``protocols`` entry: ``protocol`` with the destination ports ``first..last``
    (inclusive; a single number has ``first == last``), or a destination named port ``name``
    (``protocol`` None: the container port's own protocol)."""

    protocol: Protocol | None
    first: int = 0
    last: int = 0
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ClusterRule:
    """An ingress or egress rule: ``action`` on traffic from/to any of ``peers`` on any of
    ``ports`` (empty ``ports``: every port and protocol). ``name`` is the optional rule name."""

    action: Action
    peers: tuple[ClusterPeer, ...]
    ports: tuple[ClusterPort, ...] = ()
    name: str = ""


@dataclass(frozen=True, slots=True)
class ClusterNetworkPolicy:
    """A ClusterNetworkPolicy: ``tier``, ``priority`` (lower first), the subject (exactly one of
    ``subject_namespaces`` and ``subject_pods``, as in :class:`ClusterPeer`) and its rules in
    their written order (the first matching rule of a policy decides: the API reference)."""

    name: str
    tier: Tier
    priority: int
    subject_namespaces: LabelSelector | None = None
    subject_pods: tuple[LabelSelector, LabelSelector] | None = None
    ingress: tuple[ClusterRule, ...] = ()
    egress: tuple[ClusterRule, ...] = ()
    fail_closed: str | None = None  # as NetworkPolicy.fail_closed: why its rules were failed closed

    @property
    def key(self) -> str:
        """The object's name (cluster-scoped)."""
        return self.name

    def rules(self, direction: Direction) -> tuple[ClusterRule, ...]:
        """The rules of one direction, in precedence order."""
        return self.ingress if direction == "ingress" else self.egress

    def selects(self, namespace_labels: Mapping[str, str], pod_labels: Mapping[str, str]) -> bool:
        """True when the subject selects a pod with ``pod_labels`` in a namespace with
        ``namespace_labels`` (callers pass only enforceable pods: host-networked pods are never
        selected, says the API reference)."""
        return _selects(self.subject_namespaces, self.subject_pods, namespace_labels, pod_labels)


def _selects(namespaces: LabelSelector | None, pods: tuple[LabelSelector, LabelSelector] | None,
             namespace_labels: Mapping[str, str], pod_labels: Mapping[str, str]) -> bool:
    if namespaces is not None:
        return namespaces.matches(namespace_labels)
    assert pods is not None
    return pods[0].matches(namespace_labels) and pods[1].matches(pod_labels)


def peer_selects(peer: ClusterPeer, namespace_labels: Mapping[str, str], pod_labels: Mapping[str, str]) -> bool:
    """True when a namespaces or pods ``peer`` selects a pod with these labels (a networks,
    nodes or domainNames peer selects addresses, not pods: False)."""
    if peer.networks or peer.domain_names or peer.nodes is not None:
        return False
    return _selects(peer.namespaces, peer.pods, namespace_labels, pod_labels)


def network_contains(peer: ClusterPeer, address: str) -> bool:
    """True when ``address`` is in one of a networks peer's CIDRs."""
    ip = ipaddress.ip_address(address)
    return any(ip.version == n.version and ip in n for n in peer.networks)


def domain_name_matches(pattern: str, name: str) -> bool:
    """True when DNS name ``name`` (any case, trailing dot or not) matches a domainNames entry
    ``pattern`` (as :class:`ClusterPeer` holds it). network-policy-api v0.2.0, ``DomainName``: an
    exact name matches only itself; ``*.`` matches one or more entire labels, so
    ``*.kubernetes.io`` matches ``www.kubernetes.io`` and ``latest.blog.kubernetes.io`` but not
    ``kubernetes.io``."""
    name = name.lower().rstrip(".")
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and len(name) > len(pattern) - 1
    return name == pattern


def node_peer_selects(peer: ClusterPeer, node: "Node") -> bool:
    """True when a nodes ``peer`` selects ``node`` (by its labels); False for any other peer."""
    return peer.nodes is not None and peer.nodes.matches(node.labels)


@dataclass(frozen=True, slots=True)
class Node:
    """A Node: name, its addresses (every IP of ``status.addresses``), pod CIDRs, labels and
    ``peer_addresses``: the IPs of its ``InternalIP`` and ``ExternalIP`` addresses (both
    families), which a ClusterNetworkPolicy ``nodes`` peer that selects it matches."""

    name: str
    addresses: tuple[str, ...] = ()
    pod_cidrs: tuple[str, ...] = ()
    labels: Labels = field(default_factory=Labels)
    peer_addresses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if type(self.labels) is not Labels:  # given a plain mapping: its interned label set
            object.__setattr__(self, "labels", labels_of(self.labels))


@dataclass(frozen=True, slots=True)
class Cluster:
    """Everything the translator reads, keyed by ``namespace/name`` (nodes and namespaces by name)."""

    namespaces: Mapping[str, Namespace] = field(default_factory=dict)
    pods: Mapping[str, Pod] = field(default_factory=dict)
    policies: Mapping[str, NetworkPolicy] = field(default_factory=dict)
    nodes: Mapping[str, Node] = field(default_factory=dict)
    cluster_policies: Mapping[str, ClusterNetworkPolicy] = field(default_factory=dict)  # by name

    def namespace_labels(self, name: str) -> Mapping[str, str]:
        """Labels of a namespace; one absent from the model has only its automatic name label."""
        ns = self.namespaces.get(name)
        return ns.labels if ns else {NAMESPACE_NAME_LABEL: name}
