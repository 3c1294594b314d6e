"""The chains of the rule model, built: a NetworkPolicy's ``KUBE-NWPLCY-<hash>`` and a
ClusterNetworkPolicy's tier chain (``KUBE-ANP-<hash>`` for the Admin tier, ``KUBE-BANP-<hash>``
for the Baseline tier), one per policy and direction, built the same way; and a local pod's
``KUBE-POD-IN-<hash>`` and ``KUBE-POD-EG-<hash>``, one per direction, which jump to them.

What such a chain says depends only on the policy (and the address families in use): one
:class:`~nftpolicy.translators.rules.MatchRule` per (peer, port) of each policy rule, whose peers
name shared sets by key (:class:`~nftpolicy.translators.setstore.SetKey`). A peer is a
:class:`~nftpolicy.translators.setstore.Scope` of pods (one address set per family) or an
ipBlock (one interval set); peers of a rule are OR'ed. A rule's several pod-selector peers are
one union set per family, its several ipBlocks of a family one union interval set
(:func:`~nftpolicy.translators.setstore.union_key`: kube-router's ipset per rule), so a rule of
1,000 peers adds one set, not 1,000. A rule with several peers (or peer sets) and several ports
is not multiplied out: one match per port jumps to the rule's
:class:`~nftpolicy.translators.rules.PeerChain`, which holds one match per peer set (P + Q
rules for P peer sets and Q ports; the API server bounds neither list).

* NetworkPolicyPeer (the API reference): selectors in one peer are AND'ed, no
  namespaceSelector means the policy's namespace; an ipBlock minus its excepts.
* ClusterNetworkPolicy peers (network-policy-api v0.2.0, ClusterNetworkPolicyIngressPeer /
  EgressPeer): ``namespaces`` is every pod of the namespaces a selector matches, ``pods`` the pods
  a pod selector matches in those namespaces, ``networks`` one ipBlock per CIDR, ``domainNames``
  one set per family of the addresses DNS answers gave for its names (the agent fills it,
  :mod:`nftpolicy.agent.daemon.dnslearn`).

A named port is resolved on the destination pods: for ingress the local pods the policy
selects, for egress the peer pods (the set of ``address . protocol . port`` is then the peer
match as well); a NetworkPolicy port names its protocol, a ClusterNetworkPolicy
``destinationNamedPort`` takes each protocol the container port may have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from .model import (
    PROTOCOLS,
    ClusterNetworkPolicy,
    ClusterPeer,
    ClusterRule,
    Direction,
    Family,
    IPBlock,
    NetworkPolicy,
    Peer,
    Pod,
    PolicyRule,
    Protocol,
    family_of,
)
from .rules import MatchRule, PeerChain, PodChain, PolicyChain, PortMatch, RuleOrigin, TierChain, address_order, comment, hashed_name
from .selectors import ALL, LabelSelector, canonical_selector
from .setstore import Scope, SetKey, union_key

TIER_CHAIN_PREFIX = {"Admin": "KUBE-ANP-", "Baseline": "KUBE-BANP-"}


@dataclass(frozen=True)
class DomainNames:
    """A domainNames peer: its names (:func:`~nftpolicy.translators.model.domain_name_matches`)."""

    names: tuple[str, ...]


# a peer: pods (their addresses), an ipBlock, domain names, or Nodes (a selector over their labels)
PeerTarget = Scope | IPBlock | DomainNames | LabelSelector
# family, peer set, port, named-port set, and whether the rule's peer chain matches its peers
Match = tuple[Family | None, str | None, PortMatch | None, str | None, bool]
PeerOption = tuple[Family | None, str | None]  # (family, peer set): one alternative of a rule's peers


@dataclass(frozen=True)
class NamedPort:
    """A destination named port ``name`` with each protocol it may have."""

    name: str
    protocols: tuple[Protocol, ...]


def build_policy_chain(policy: NetworkPolicy, direction: Direction, families: tuple[Family, ...],
                       keys: list[SetKey]) -> PolicyChain:
    """The chain of ``policy``'s ``direction``; the set keys it uses are appended to ``keys``
    (one per use)."""
    targets = Scope(namespace=policy.namespace, pod_selector=canonical_selector(policy.pod_selector), local=True)
    rules: list[MatchRule] = []
    peer_chains: list[PeerChain] = []
    for i, rule in enumerate(policy.rules(direction)):
        origin = RuleOrigin(policy.key, direction, i)
        text = comment(f"{policy.key} {direction} rule {i}")
        peers = [_policy_peer(policy, peer) for peer in rule.peers] if rule.peers else None
        found, chained = rule_matches(direction, peers, _policy_ports(rule), targets, families, _user(keys), chain_peers=True)
        peer_chain = hashed_name("KUBE-NWPLCY-", policy.namespace, policy.name, direction, str(i)) if chained else None
        rules.extend(MatchRule(*match[:4], origin, text, peer_chain if match[4] else None) for match in found)
        if peer_chain is not None:
            peer_chains.append(PeerChain(peer_chain, tuple(MatchRule(f, peer_set, None, None, origin, text) for f, peer_set in chained)))
    name = hashed_name("KUBE-NWPLCY-", policy.namespace, policy.name, direction)
    return PolicyChain(name, policy.key, direction, tuple(rules), comment(f"{policy.key} {direction}"), tuple(peer_chains),
                       policy.fail_closed)


POD_CHAIN_PREFIX: dict[Direction, str] = {"ingress": "KUBE-POD-IN-", "egress": "KUBE-POD-EG-"}  # as long as kube-router's KUBE-POD-FW-


def build_pod_chains(pod: Pod, ips: tuple[str, ...], policies: Mapping[Direction, list[str]],
                     tiers: Mapping[str, list[str]], tier_policy: Mapping[str, str], empty: Iterable[str] = ()) -> tuple[PodChain, ...]:
    """The chains of local pod ``pod`` for its addresses ``ips`` (those that dispatch to it), one
    per direction it is isolated in (ingress first; none: not isolated): ``KUBE-POD-IN-<hash>``
    and ``KUBE-POD-EG-<hash>``, the hash of the pod's namespace and name. ``policies``, the
    policy chains of each direction whose policy selects it (a direction absent: no
    NetworkPolicy isolates it); ``tiers``, the tier chains by direction and tier
    (``admin_ingress``, ...) in evaluation order; ``tier_policy``: tier chain -> its
    ClusterNetworkPolicy; ``empty``: policy chains that have no rule (of those listed or any
    others)."""
    addresses = tuple(sorted(set(ips), key=address_order))
    chains = []
    for direction in ("ingress", "egress"):
        selecting = policies.get(direction)
        admin = tuple(tiers.get(f"admin_{direction}", ()))
        # the Baseline tier only where no NetworkPolicy isolates the pod
        baseline = tuple(tiers.get(f"baseline_{direction}", ())) if selecting is None else ()
        if selecting is None and not admin and not baseline:
            continue
        chains.append(PodChain(name=hashed_name(POD_CHAIN_PREFIX[direction], pod.namespace, pod.name), pod=pod.key, direction=direction,
                               ips=addresses, policies=tuple(sorted(selecting)) if selecting is not None else None,
                               comment=comment(f"{pod.key} pod {direction}"), admin=admin, baseline=baseline,
                               tier_policies=tuple(sorted({(n, tier_policy[n]) for n in admin + baseline})),
                               empty=tuple(sorted(set(empty) & set(selecting or ())))))
    return tuple(chains)


def tier_chain_name(policy: ClusterNetworkPolicy, direction: Direction) -> str:
    """``KUBE-ANP-`` or ``KUBE-BANP-`` + the hash of the policy's name and the direction."""
    return hashed_name(TIER_CHAIN_PREFIX[policy.tier], policy.name, direction)


def build_tier_chain(policy: ClusterNetworkPolicy, direction: Direction, families: tuple[Family, ...],
                     keys: list[SetKey]) -> TierChain:
    """The tier chain of ``policy``'s ``direction`` (which has rules); the set keys it uses are
    appended to ``keys`` (one per use)."""
    targets = _cluster_scope(policy.subject_namespaces, policy.subject_pods, local=True)
    rules: list[MatchRule] = []
    peer_chains: list[PeerChain] = []
    for i, rule in enumerate(policy.rules(direction)):
        origin = RuleOrigin(policy.name, direction, i, policy.tier, rule.action, rule.name)
        text = comment(f"{policy.name} {policy.tier} {direction} rule {i}" + (f" {rule.name}" if rule.name else "") + f" ({rule.action})")
        peers = [target for peer in rule.peers for target in _cluster_peer(peer)]
        found, chained = rule_matches(direction, peers, _cluster_ports(rule), targets, families, _user(keys), chain_peers=True)
        peer_chain = hashed_name(TIER_CHAIN_PREFIX[policy.tier], policy.name, direction, str(i)) if chained else None
        rules.extend(MatchRule(*match[:4], origin, text, peer_chain if match[4] else None) for match in found)
        if peer_chain is not None:
            peer_chains.append(PeerChain(peer_chain, tuple(MatchRule(f, peer_set, None, None, origin, text) for f, peer_set in chained)))
    return TierChain(tier_chain_name(policy, direction), policy.name, policy.tier, direction, tuple(rules),
                     comment(f"{policy.name} {policy.tier} {direction}"), tuple(peer_chains), policy.fail_closed)


def rule_matches(direction: Direction, peers: Sequence[PeerTarget] | None, ports: Sequence[PortMatch | NamedPort],
                 targets: Scope, families: tuple[Family, ...], use: Callable[[SetKey], str],
                 chain_peers: bool = False) -> tuple[list[Match], list[PeerOption]]:
    """The (family, peer set, port, named-port set, jumps) matches of one policy rule, in order:
    one per peer set for each numbered port (or just one per peer set without ports), one per
    peer set and family for each ingress named port (resolved on ``targets``, the policy's local
    pods), one per peer scope and family for each egress named port (resolved on the peers);
    and the peer alternatives of the rule's peer chain (empty: none). ``peers`` None: any peer.
    ``use`` names a set key the rule uses (and takes note of it).

    With ``chain_peers``, a rule of several peers (or peer sets) and several port matches
    (numbered, or ingress named) is not multiplied out: each port match has no peer set and
    ``jumps`` True (its peers are matched in the rule's peer chain), and the peer sets come back
    as that chain's alternatives. An egress named port's set holds its peers' addresses: it stays one
    match per peer scope (:mod:`~nftpolicy.translators.objectcost` bounds what still multiplies)."""
    egress_named_only = direction == "egress" and bool(ports) and all(isinstance(p, NamedPort) for p in ports)
    # The peer sets, unless only egress named ports use this rule's peers (their own sets
    # hold the peers' addresses with the port): a set exists only while a rule uses it.
    options = [] if egress_named_only else peer_sets(peers, families, use)
    if not ports:
        return [(family, peer_set, None, None, False) for family, peer_set in options], []
    multiplying = sum(1 for p in ports if isinstance(p, PortMatch) or direction == "ingress")
    several = len(options) > 1 or (len(peers or ()) > 1 and bool(options))  # several peers, even in one union set: a peer chain
    chained = options if chain_peers and several and multiplying > 1 else []
    jumps = bool(chained)
    if jumps:
        options = [(None, None)]  # any peer here: the peer chain decides
    found: list[Match] = []
    for port in ports:
        if isinstance(port, PortMatch):
            found.extend((family, peer_set, port, None, jumps) for family, peer_set in options)
            continue
        for protocol in port.protocols:
            if direction == "ingress":
                for family, peer_set in options:
                    for fam in (families if family is None else (family,)):
                        found.append((fam, peer_set, None, use(SetKey("named_port", fam, targets, port=port.name, protocol=protocol)), jumps))
            else:
                for scope, scope_families in _named_port_scopes(peers, families):
                    for fam in scope_families:
                        found.append((fam, None, None, use(SetKey("named_port", fam, scope, port=port.name, protocol=protocol)), False))
    return found, chained


def peer_sets(peers: Sequence[PeerTarget] | None, families: tuple[Family, ...],
              use: Callable[[SetKey], str]) -> list[PeerOption]:
    """(family, peer set) alternatives of a rule's peers: ``(None, None)`` for any peer, else an
    address set per family for the pod scopes (one scope's shared set, or the union set of
    several, where the first of them is), for each domainNames peer and each Node selector, and
    an interval set per family for the ipBlocks of that family (one block's shared set, or the
    union set of several, where the first of them is)."""
    if peers is None:
        return [(None, None)]
    scopes = list(dict.fromkeys(peer for peer in peers if isinstance(peer, Scope)))
    blocks: dict[Family, dict[IPBlock, None]] = {}  # each family's distinct blocks, in order
    for peer in peers:
        if isinstance(peer, IPBlock):
            blocks.setdefault(family_of(str(peer.cidr)), {})[peer] = None
    options: list[PeerOption] = []
    placed: set[Family | None] = set()  # the union of scopes (None) and of each family's blocks, once
    for peer in peers:
        if isinstance(peer, Scope):
            if len(scopes) == 1:
                options.extend((f, use(SetKey("addr", f, peer))) for f in families)
            elif None not in placed:
                placed.add(None)
                options.extend((f, use(union_key(f, scopes))) for f in families)
        elif isinstance(peer, DomainNames):
            options.extend((f, use(SetKey("domain", f, names=peer.names))) for f in families)
        elif isinstance(peer, LabelSelector):
            options.extend((f, use(SetKey("nodes", f, nodes=peer))) for f in families)
        else:
            family = family_of(str(peer.cidr))
            if len(blocks[family]) == 1:
                options.append((family, use(SetKey("interval", family, block=peer))))
            elif family not in placed:
                placed.add(family)
                options.append((family, use(union_key(family, blocks[family]))))
    return options


def _named_port_scopes(peers: Sequence[PeerTarget] | None, families: tuple[Family, ...]) -> list[tuple[Scope, tuple[Family, ...]]]:
    """Where an egress named port resolves: each peer's pods (an ipBlock peer: every pod's
    addresses inside it; any peer: every pod). A domainNames or nodes peer has none: the CRD's
    validation refuses named ports with them."""
    if peers is None:
        return [(Scope(namespace_selector=ALL), families)]
    scopes: list[tuple[Scope, tuple[Family, ...]]] = []
    for peer in peers:
        if isinstance(peer, Scope):
            scopes.append((peer, families))
        elif isinstance(peer, IPBlock):
            scopes.append((Scope(namespace_selector=ALL, block=peer), (family_of(str(peer.cidr)),)))
    return scopes


def _user(keys: list[SetKey]) -> Callable[[SetKey], str]:
    def use(key: SetKey) -> str:
        keys.append(key)
        return key.name
    return use


def _policy_peer(policy: NetworkPolicy, peer: Peer) -> PeerTarget:
    if peer.ip_block is not None:
        return peer.ip_block
    pods = canonical_selector(peer.pod_selector)
    if peer.namespace_selector is None:
        return Scope(namespace=policy.namespace, pod_selector=pods)
    return Scope(namespace_selector=canonical_selector(peer.namespace_selector) or ALL, pod_selector=pods)


def _policy_ports(rule: PolicyRule) -> list[PortMatch | NamedPort]:
    ports: list[PortMatch | NamedPort] = []
    for port in rule.ports:
        if isinstance(port.port, str):
            ports.append(NamedPort(port.port, (port.protocol,)))
        elif port.port is None:
            ports.append(PortMatch(port.protocol))
        else:
            ports.append(PortMatch(port.protocol, port.port, port.end_port or port.port))
    return ports


def _cluster_scope(namespaces: LabelSelector | None, pods: tuple[LabelSelector, LabelSelector] | None, local: bool = False) -> Scope:
    if pods is None:
        return Scope(namespace_selector=canonical_selector(namespaces) or ALL, local=local)
    return Scope(namespace_selector=canonical_selector(pods[0]) or ALL, pod_selector=canonical_selector(pods[1]), local=local)


def _cluster_peer(peer: ClusterPeer) -> list[PeerTarget]:
    if peer.networks:
        return [IPBlock(cidr=network) for network in peer.networks]
    if peer.domain_names:
        return [DomainNames(peer.domain_names)]
    if peer.nodes is not None:
        return [canonical_selector(peer.nodes) or ALL]
    return [_cluster_scope(peer.namespaces, peer.pods)]


def _cluster_ports(rule: ClusterRule) -> list[PortMatch | NamedPort]:
    """Numbered ports first, then named ports (with every protocol), as the tier chain lists them."""
    numbered: list[PortMatch | NamedPort] = []
    named: list[PortMatch | NamedPort] = []
    for port in rule.ports:
        if port.name is not None:
            named.append(NamedPort(port.name, PROTOCOLS))
        else:
            assert port.protocol is not None
            numbered.append(PortMatch(port.protocol, port.first, port.last))
    return numbered + named
