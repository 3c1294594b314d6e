"""The cluster model: the few fields of Kubernetes objects that NetworkPolicy enforcement needs.

Every type is a frozen dataclass built by :mod:`nftpolicy.translators.manifests` (from YAML or
JSON) or by the agent's API sources; validation and API-server defaulting happen there, so a
model object is always valid. Source of the semantics: the Kubernetes API reference for
``networking.k8s.io/v1`` NetworkPolicy and ``meta/v1`` LabelSelector.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Mapping

if TYPE_CHECKING:
    from .clusterpolicy import ClusterNetworkPolicy

Protocol = Literal["TCP", "UDP", "SCTP"]
Direction = Literal["ingress", "egress"]
Family = Literal["ipv4", "ipv6"]
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

PROTOCOLS: tuple[Protocol, ...] = ("TCP", "UDP", "SCTP")
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def family_of(address: str) -> Family:
    """Return ``"ipv4"`` or ``"ipv6"`` for a valid address or network string (validated when the
    manifests were read; only IPv6 text contains ':')."""
    return "ipv6" if ":" in address else "ipv4"


@dataclass(frozen=True, slots=True)
class Requirement:
    """One ``matchExpressions`` entry: ``key``, operator ``In|NotIn|Exists|DoesNotExist``, values.

    Semantics from the LabelSelector API reference: ``In`` needs the key with one of the values,
    ``NotIn`` matches a missing key or a value not listed, ``Exists``/``DoesNotExist`` test the key.
    """

    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """True when ``labels`` satisfy this requirement."""
        if self.operator == "In":
            return labels.get(self.key) in self.values
        if self.operator == "NotIn":
            return labels.get(self.key) not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """A ``meta/v1`` LabelSelector: ``matchLabels`` AND every ``matchExpressions`` requirement.

    The empty selector (``{}``) matches every object (API reference: "An empty label selector
    matches all objects").
    """

    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """True when ``labels`` satisfy every term of the selector."""
        for k, v in self.match_labels:  # loops, not all(): this runs for every pod group and selector
            if labels.get(k) != v:
                return False
        for r in self.match_expressions:
            if not r.matches(labels):
                return False
        return True


@dataclass(frozen=True, slots=True)
class Namespace:
    """A Namespace: name and labels (``kubernetes.io/metadata.name`` always present)."""

    name: str
    labels: Mapping[str, str]


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
    labels: Mapping[str, str]
    node: str | None
    ips: tuple[str, ...]
    phase: str = "Running"
    host_network: bool = False
    ports: tuple[ContainerPort, ...] = ()

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

    def networks(self) -> list[IPNetwork]:
        """The CIDR with every except removed, as disjoint networks in address order."""
        remaining = [self.cidr]
        for hole in self.excepts:
            kept: list[IPNetwork] = []
            for net in remaining:
                if not net.overlaps(hole):
                    kept.append(net)
                elif not net.subnet_of(hole):  # type: ignore[arg-type]
                    kept.extend(net.address_exclude(hole))  # type: ignore[arg-type]
            remaining = kept
        return sorted(remaining)

    def contains(self, address: str) -> bool:
        """True when ``address`` is in the CIDR and in none of its excepts."""
        ip = ipaddress.ip_address(address)
        return ip in self.cidr and not any(ip in hole for hole in self.excepts)


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
    spec has egress rules, unless the object lists them.
    """

    namespace: str
    name: str
    pod_selector: LabelSelector
    policy_types: frozenset[Direction]
    ingress: tuple[PolicyRule, ...] = ()
    egress: tuple[PolicyRule, ...] = ()

    @property
    def key(self) -> str:
        """``namespace/name``."""
        return f"{self.namespace}/{self.name}"

    def rules(self, direction: Direction) -> tuple[PolicyRule, ...]:
        """The rules of one direction."""
        return self.ingress if direction == "ingress" else self.egress


@dataclass(frozen=True, slots=True)
class Node:
    """A Node: name, its addresses and pod CIDRs."""

    name: str
    addresses: tuple[str, ...] = ()
    pod_cidrs: tuple[str, ...] = ()


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
