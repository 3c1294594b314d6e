"""ClusterNetworkPolicy -> its tier chains (``KUBE-ANP-<hash>`` for the Admin tier,
``KUBE-BANP-<hash>`` for the Baseline tier), one per policy and direction, with shared peer sets.

What a tier chain says depends only on the policy (and the address families in use): its rules
name shared sets by key (:class:`~nftpolicy.translators.noderender.SetKey`), as NetworkPolicy
chains do. Peers (network-policy-api v0.2.0, ClusterNetworkPolicyIngressPeer / EgressPeer):
``namespaces`` is every pod of the namespaces a selector matches, ``pods`` the pods a pod selector
matches in those namespaces (both sets of pod addresses), ``networks`` one interval set per CIDR.
A destination named port (``destinationNamedPort``) is resolved on the destination pods: for
ingress the local pods the subject selects, for egress the peer pods (the set of
``address . protocol . port`` is then the peer match as well), with each protocol the container
port may have.
"""

from __future__ import annotations

from .clusterpolicy import ClusterNetworkPolicy, ClusterPeer, ClusterPort, ClusterRule
from .model import PROTOCOLS, Direction, Family, IPBlock, LabelSelector, family_of
from .noderender import ALL_NAMESPACES, Scope, SetKey, canonical_selector
from .rules import PortMatch, TierChain, TierRule, comment, hashed_name

CHAIN_PREFIX = {"Admin": "KUBE-ANP-", "Baseline": "KUBE-BANP-"}


def tier_chain_name(policy: ClusterNetworkPolicy, direction: Direction) -> str:
    """``KUBE-ANP-`` or ``KUBE-BANP-`` + the hash of the policy's name and the direction."""
    return hashed_name(CHAIN_PREFIX[policy.tier], policy.name, direction)


def _scope(namespaces: LabelSelector | None, pods: tuple[LabelSelector, LabelSelector] | None, local: bool = False) -> Scope:
    if pods is None:
        return Scope(namespace_selector=canonical_selector(namespaces) or ALL_NAMESPACES, local=local)
    return Scope(namespace_selector=canonical_selector(pods[0]) or ALL_NAMESPACES, pod_selector=canonical_selector(pods[1]), local=local)


def build_tier_chain(policy: ClusterNetworkPolicy, direction: Direction, families: tuple[Family, ...],
                     keys: list[SetKey]) -> TierChain:
    """The tier chain of ``policy``'s ``direction`` (which has rules); the set keys it uses are
    appended to ``keys`` (one per use)."""
    rules: list[TierRule] = []
    for i, rule in enumerate(policy.rules(direction)):
        text = comment(f"{policy.name} {policy.tier} {direction} rule {i}" + (f" {rule.name}" if rule.name else "") + f" ({rule.action})")
        rules.extend(_matches(policy, direction, rule, families, keys, text))
    return TierChain(tier_chain_name(policy, direction), policy.name, policy.tier, direction, tuple(rules),
                     comment(f"{policy.name} {policy.tier} {direction}"))


def _peer_sets(peer: ClusterPeer, families: tuple[Family, ...], keys: list[SetKey]) -> list[tuple[Family, str]]:
    """(family, set) alternatives of one peer."""
    if peer.networks:
        found = []
        for network in peer.networks:
            key = SetKey("interval", family_of(str(network)), block=IPBlock(cidr=network))
            keys.append(key)
            found.append((key.family, key.name))
        return found
    scope = _scope(peer.namespaces, peer.pods)
    found = []
    for family in families:
        key = SetKey("addr", family, scope)
        keys.append(key)
        found.append((family, key.name))
    return found


def _matches(policy: ClusterNetworkPolicy, direction: Direction, rule: ClusterRule, families: tuple[Family, ...],
             keys: list[SetKey], text: str) -> list[TierRule]:
    named = [p for p in rule.ports if p.name is not None]
    numbered = [p for p in rule.ports if p.name is None]
    egress_named_only = direction == "egress" and named and not numbered
    peers = [] if egress_named_only else [s for peer in rule.peers for s in _peer_sets(peer, families, keys)]
    if not rule.ports:
        return [TierRule(rule.action, family, peer_set, None, None, text) for family, peer_set in peers]
    found = [TierRule(rule.action, family, peer_set, _port_match(port), None, text) for port in numbered for family, peer_set in peers]
    for port in named:
        assert port.name is not None
        for protocol in PROTOCOLS:
            if direction == "ingress":
                targets = _scope(policy.subject_namespaces, policy.subject_pods, local=True)
                for family, peer_set in peers:
                    key = SetKey("named_port", family, targets, port=port.name, protocol=protocol)
                    keys.append(key)
                    found.append(TierRule(rule.action, family, peer_set, None, key.name, text))
            else:
                for peer in rule.peers:  # namespaces and pods peers only (CEL: no named port towards networks)
                    for family in families:
                        key = SetKey("named_port", family, _scope(peer.namespaces, peer.pods), port=port.name, protocol=protocol)
                        keys.append(key)
                        found.append(TierRule(rule.action, family, None, None, key.name, text))
    return found


def _port_match(port: ClusterPort) -> PortMatch:
    assert port.protocol is not None
    return PortMatch(port.protocol, port.first, port.last)
