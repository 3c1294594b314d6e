"""The spec oracle of the tiers: the verdict of one connection under every tier: Admin ClusterNetworkPolicies, NetworkPolicies,
Baseline ClusterNetworkPolicies (a pure evaluator, straight from the cluster model).

Source: sigs.k8s.io/network-policy-api v0.2.0, ``ClusterNetworkPolicySpec.Tier`` and
``.Priority``, ``ClusterNetworkPolicyRuleAction``; the ``networking.k8s.io/v1`` NetworkPolicy
API reference for the middle tier. Each end decides its own direction (the source pod its
egress, the destination pod its ingress) and a connection is allowed when both allow it:

1. Admin tier: the Admin policies that select the pod, by ascending ``priority``, each rule in
   its written order. The first rule that matches decides: ``Accept`` allows ("no further
   ClusterNetworkPolicy or NetworkPolicy rules will be processed"), ``Deny`` refuses,
   ``Pass`` skips the rest of the Admin tier.
2. NetworkPolicy tier: when a NetworkPolicy of that direction selects the pod, it "always makes
   a final decision for selected pods": allowed when one of their rules allows.
3. Baseline tier (only for a pod no NetworkPolicy isolates in that direction): as the Admin
   tier; ``Pass`` skips the rest of the Baseline tier.
4. Nothing decided: allowed ("all pods can communicate with each other").

Priority ties: the API leaves them open ("the implementation can apply any of the matching
policies"); nftpolicy orders policies of one tier by ``(priority, name)``, so of two policies
with the same priority the one whose name sorts first decides.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from nftpolicy.translators.cases import NODE_TARGET, Case, CaseError, CaseProbe, Matrix, case_manifests
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.model import (
    Cluster,
    ClusterNetworkPolicy,
    ClusterPeer,
    ClusterPort,
    Direction,
    Family,
    NetworkPolicy,
    Node,
    Peer,
    Pod,
    PolicyPort,
    Protocol,
    Tier,
    family_of,
    network_contains,
    node_peer_selects,
    peer_selects,
)

PodOrAddress = Pod | Node | str  # a pod of the model, a Node (its addresses: never a pod), or an address outside both


@dataclass(frozen=True)
class Decision:
    """What decided one direction: ``allowed``, and ``by`` in words
    (``ClusterNetworkPolicy deny-all ingress rule 0 (Deny)``, ``NetworkPolicy x/p``,
    ``no NetworkPolicy allows it``, ``default``)."""

    allowed: bool
    by: str


def tier_order(cluster: Cluster, tier: Tier) -> list[ClusterNetworkPolicy]:
    """The ClusterNetworkPolicies of ``tier`` in evaluation order: ``(priority, name)``."""
    return sorted((p for p in cluster.cluster_policies.values() if p.tier == tier), key=lambda p: (p.priority, p.name))


def _address(end: PodOrAddress, family: Family) -> str | None:
    if isinstance(end, str):
        return end if family_of(end) == family else None
    if isinstance(end, Node):
        return next((a for a in end.peer_addresses if family_of(a) == family), None)
    addresses = end.addresses(family)
    return addresses[0] if addresses else None


def _pod_peer(end: PodOrAddress) -> Pod | None:
    """The end as a pod that selectors can select (host-networked and finished pods never are)."""
    return end if isinstance(end, Pod) and end.enforceable else None


def _cluster_peer_matches(cluster: Cluster, peer: ClusterPeer, other: PodOrAddress, family: Family) -> bool:
    if peer.nodes is not None:  # the Nodes its selector matches, by their labels, and their addresses (egress only)
        if isinstance(other, Node):
            return node_peer_selects(peer, other)
        address = _address(other, family)  # an address, or a pod's (a host-network pod's is its node's)
        return address is not None and any(address in n.peer_addresses and node_peer_selects(peer, n) for n in cluster.nodes.values())
    if peer.networks:
        address = _address(other, family)
        return address is not None and network_contains(peer, address)
    pod = _pod_peer(other)
    return pod is not None and peer_selects(peer, cluster.namespace_labels(pod.namespace), pod.labels)


def _cluster_port_matches(port: ClusterPort, destination: PodOrAddress, protocol: Protocol, number: int) -> bool:
    if port.name is None:
        return port.protocol == protocol and port.first <= number <= port.last
    pod = _pod_peer(destination)  # a named port is resolved on the destination pod
    return pod is not None and pod.resolve_port(port.name, protocol) == number


def _tier(cluster: Cluster, tier: Tier, direction: Direction, pod: Pod, other: PodOrAddress, destination: PodOrAddress,
          protocol: Protocol, port: int, family: Family) -> Decision | None:
    """The first matching rule of ``tier`` for ``pod``'s ``direction``: a decision, or None when
    no rule matched or a ``Pass`` rule did."""
    namespace_labels = cluster.namespace_labels(pod.namespace)
    for policy in tier_order(cluster, tier):
        if not policy.selects(namespace_labels, pod.labels):
            continue
        for i, rule in enumerate(policy.rules(direction)):
            if not any(_cluster_peer_matches(cluster, peer, other, family) for peer in rule.peers):
                continue
            if rule.ports and not any(_cluster_port_matches(p, destination, protocol, port) for p in rule.ports):
                continue
            if rule.action == "Pass":
                return None
            return Decision(rule.action == "Accept", f"ClusterNetworkPolicy {policy.name} {direction} rule {i} ({rule.action})")
    return None


def _netpol_peer_matches(cluster: Cluster, policy: NetworkPolicy, peer: Peer, other: PodOrAddress, family: Family) -> bool:
    if peer.ip_block is not None:
        address = _address(other, family)
        return address is not None and ipaddress.ip_address(address).version == peer.ip_block.cidr.version \
            and peer.ip_block.contains(address)
    pod = _pod_peer(other)
    if pod is None:
        return False
    if peer.namespace_selector is None:
        in_namespace = pod.namespace == policy.namespace
    else:
        in_namespace = peer.namespace_selector.matches(cluster.namespace_labels(pod.namespace))
    return in_namespace and (peer.pod_selector is None or peer.pod_selector.matches(pod.labels))


def _netpol_port_matches(port: PolicyPort, destination: PodOrAddress, protocol: Protocol, number: int) -> bool:
    if port.protocol != protocol:
        return False
    if port.port is None:
        return True
    if isinstance(port.port, str):
        pod = _pod_peer(destination)
        return pod is not None and pod.resolve_port(port.port, protocol) == number
    return port.port <= number <= (port.end_port or port.port)


def _network_policies(cluster: Cluster, direction: Direction, pod: Pod, other: PodOrAddress, destination: PodOrAddress,
                      protocol: Protocol, port: int, family: Family) -> Decision | None:
    """The NetworkPolicy tier: None when no policy of ``direction`` selects ``pod``."""
    isolating = sorted((p for p in cluster.policies.values()
                        if p.namespace == pod.namespace and direction in p.policy_types and p.pod_selector.matches(pod.labels)),
                       key=lambda p: p.key)
    if not isolating:
        return None
    for policy in isolating:
        for rule in policy.rules(direction):
            if rule.peers and not any(_netpol_peer_matches(cluster, policy, peer, other, family) for peer in rule.peers):
                continue
            if rule.ports and not any(_netpol_port_matches(p, destination, protocol, port) for p in rule.ports):
                continue
            return Decision(True, f"NetworkPolicy {policy.key}")
    return Decision(False, "no NetworkPolicy allows it")


def direction_decision(cluster: Cluster, direction: Direction, pod: Pod, other: PodOrAddress, protocol: Protocol, port: int,
                       family: Family = "ipv4") -> Decision:
    """The decision of ``pod``'s ``direction`` on a connection with ``other`` (the source for
    ingress, the destination for egress) to ``protocol``/``port``, over ``family``; see the
    module for the order. A pod that is not enforceable (host network, no IP, finished) is
    never a subject: allowed."""
    if not pod.enforceable:
        return Decision(True, "default")
    destination = pod if direction == "ingress" else other
    args = (direction, pod, other, destination, protocol, port, family)
    return (_tier(cluster, "Admin", *args) or _network_policies(cluster, *args)
            or _tier(cluster, "Baseline", *args) or Decision(True, "default"))


def connection_allowed(cluster: Cluster, source: PodOrAddress, destination: PodOrAddress, protocol: Protocol, port: int,
                       family: Family = "ipv4") -> bool:
    """True when a new connection from ``source`` to ``destination`` (pods of the model, or
    addresses outside them) on ``protocol``/``port`` over ``family`` is allowed: the source
    pod's egress and the destination pod's ingress must both allow it."""
    egress = direction_decision(cluster, "egress", source, destination, protocol, port, family) if isinstance(source, Pod) else None
    ingress = direction_decision(cluster, "ingress", destination, source, protocol, port, family) if isinstance(destination, Pod) else None
    return all(d.allowed for d in (egress, ingress) if d is not None)


def evaluated_matrix(case: Case, probe: CaseProbe) -> Matrix:
    """Every (from, to) cell of ``probe`` as :func:`connection_allowed` decides it, with
    pod i of the case at 10.0.<i // 250>.<i % 250 + 1> (one /4, as ``largeCIDR`` assumes), and
    from every pod to every Node of the case (column ``node:<name>``; Node i at 172.31.0.<i + 2>).
    Raises CaseError when an object of the case is invalid."""
    ips = {p.key: [f"10.0.{i // 250}.{i % 250 + 1}"] for i, p in enumerate(case.pods)}
    node_ips = {name: [f"172.31.0.{i + 2}"] for i, name in enumerate(case.nodes)}
    cluster, errors = build_cluster(("case", o) for o in case_manifests(case, ips, node_ips))
    if errors:
        raise CaseError(f"{case.name}: {errors[0]}")
    pods = [cluster.pods[p.key] for p in case.pods]
    targets: list[tuple[str, PodOrAddress]] = [(p.key, p) for p in pods]
    targets += [(f"{NODE_TARGET}{name}", cluster.nodes[name]) for name in case.nodes]
    return {(a.key, key): connection_allowed(cluster, a, b, probe.protocol, probe.port) for a in pods for key, b in targets}
