"""The verdict engine: what nftpolicy's rules do with one connection, and why.

Pure: rule models in (:mod:`nftpolicy.translators.rules`, as
:mod:`nftpolicy.translators.noderender` builds them), a :class:`Verdict` out. It does not
re-derive the kernel's order: it walks the table :mod:`nftpolicy.translators.layout` decides for
each node (the table walk, :mod:`nftpolicy.translators.tablewalk`: its chains and rules in the
order the kernel evaluates them, its verdict maps and sets) and reads the walk back as reasons:
the exemption, or the policy or tier rule (its origin: policy, direction, rule index, tier,
action) that decided. What the table does (DESIGN.md section 2):

* a packet leaves its source pod's node through that pod's chain (its **egress**) and enters
  its destination pod's node through that pod's chain (its **ingress**); the rule model of the
  source's node decides the egress, the destination's node's model the ingress, and the
  connection passes when both allow it;
* a pod without a chain of a direction on its node (``KUBE-POD-IN-`` for ingress,
  ``KUBE-POD-EG-`` for egress), or whose chain of it has no policy chains, is not isolated for
  that direction (the API reference: only a policy of that type
  selecting the pod isolates it);
* a connection from an address to itself never leaves the pod (its loopback), so no chain sees
  it: allowed in both directions, as upstream's conformance tests expect of a pod's own address;
* exemptions, in the order the table applies them: traffic to the node itself
  (``KUBE-ROUTER-INPUT``) returns first for service cluster IPs, node ports on node addresses
  and external ranges; an established (or related) connection is accepted by the base chains;
  the common chain accepts essential ICMP errors
  (:data:`~nftpolicy.translators.layout.ESSENTIAL_ICMP`); traffic to a pod from an address of
  its own node is accepted (kubelet probes; the pod chain tests it after the policies, so a
  policy rule that allows it is named instead);
* each direction is walked on its own node, from the base chain that sees it, with only that
  pod's verdict-map look-up (the destination's for ingress, the source's for egress);
* otherwise the pod chain jumps to the policy chains of the direction in order, and the first
  allow rule that matches (family, peer set, port, named-port set) allows; none: reject;
* ClusterNetworkPolicies (:mod:`nftpolicy.translators.tierchains`): before the policy chains,
  the Admin tier chains, and where no policy isolates the direction the Baseline tier chains;
  the first matching rule of a tier decides (Accept allows, Deny denies), a Pass rule ends its
  tier (``tests/tiers.py``, the tests' spec oracle, states the same order from the API reference).

:class:`Enforcement` holds the models (one per node, or one for node None: every pod local), the
pods (key, node, addresses: to name both ends and to pick the node whose model decides) and the
nodes' addresses; :meth:`Enforcement.verdict` answers one :class:`Connection`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, Sequence

from . import layout
from .model import Cluster, Direction, Pod, family_of
from .noderender import build_rule_model
from .rules import (
    AddressSet, Config, MatchRule, PeerChain, PodChain, PolicyChain, PortMatch, RuleModel, RuleOrigin, TierChain, UnionPeer, UnionSet, UnknownPods,
)
from .tablewalk import Connection as Connection, ConnectionProtocol as ConnectionProtocol  # the engine's input, named here too
from .tablewalk import Step, TableWalker, Walk, canonical

Exemption = Literal["own address", "established", "essential ICMP error", "node-local source", "service cluster IP",
                    "node port", "external IP"]
# What the kernel does with a packet the table refuses (layout.refusal): an answer, or nothing.
Refusal = Literal["TCP reset", "ICMP port unreachable", "drop"]


@dataclass(frozen=True)
class Endpoint:
    """A pod as the engine names it: ``namespace/name``, its node, its addresses and its
    container ports as ``(protocol, number)``."""

    key: str
    node: str | None
    ips: tuple[str, ...]
    ports: tuple[tuple[str, int], ...] = ()

    @staticmethod
    def of(pod: Pod) -> "Endpoint":
        """The endpoint of a model pod."""
        return Endpoint(pod.key, pod.node, pod.ips, tuple(sorted({(p.protocol, p.port) for p in pod.ports})))


@dataclass(frozen=True)
class RuleSummary:
    """What one rule of a policy allows, in words: ``peers`` (what its peer sets select) and
    ``ports`` (``TCP/8080``, ``TCP/6000-6999``, a named-port set's description, ``any port``).
    ``rule`` is the rule's index in the policy's ingress or egress list."""

    policy: str
    direction: Direction
    rule: int
    peers: tuple[str, ...]
    ports: tuple[str, ...]


@dataclass(frozen=True)
class DirectionVerdict:
    """One direction of a connection: the egress of its source or the ingress of its destination.

    ``pod`` is the pod whose chain decides (None: the address is no pod, nothing is enforced);
    ``node`` the node whose rule model decided; ``known`` False when that node's model was not
    given (an agent knows only its own node: ``allowed`` is then None). ``isolated``: the pod has
    a pod chain with policy chains for this direction; ``policies`` the policies of those chains
    in walk order. ``exemption`` names what allowed it before any policy; ``allowed_by`` the rule
    that allowed it; when neither, ``rules`` lists what the policies' rules of this family allow.
    """

    direction: Direction
    address: str
    pod: str | None
    node: str | None
    known: bool
    isolated: bool
    allowed: bool | None
    policies: tuple[str, ...] = ()
    exemption: Exemption | None = None
    allowed_by: RuleSummary | None = None
    rules: tuple[RuleSummary, ...] = ()
    cluster_rule: RuleSummary | None = None  # the ClusterNetworkPolicy rule that decided
    cluster_action: str | None = None  # its tier and action: "Admin Deny", "Baseline Accept"
    peer_node: str | None = None  # the Node whose address the other end is (a nodes peer matches it)
    refusal: Refusal | None = None  # what the kernel does with the packet when it is not allowed
    fail_closed: tuple[tuple[str, str], ...] = ()  # (policy, why) of each deciding policy enforced fail-closed
    unknown: UnknownPods | None = None  # an unknown pod's address (in the node's pod CIDRs, no pod): "hold" or "drop"


@dataclass(frozen=True)
class Verdict:
    """The connection's verdict: ``allowed`` True when both directions allow it, False when one
    denies it, None when no direction denies it but one is not known (its node's model absent)."""

    connection: Connection
    allowed: bool | None
    egress: DirectionVerdict
    ingress: DirectionVerdict

    def as_json(self) -> dict[str, Any]:
        """The verdict as plain JSON data (``explain --output json``); the connection's
        ``icmp_type`` only for ICMP (a TCP, UDP or SCTP connection has none)."""
        data = dataclasses.asdict(self)
        if self.connection.protocol != "ICMP":
            del data["connection"]["icmp_type"]
        return data


class _Node:
    """One node's rule model and the table :mod:`~nftpolicy.translators.layout` decides for it,
    indexed: the table walker (``local``: the node's addresses), the model's chains and sets by
    name, the pod of each dispatched address, and the model rule each layout rule of a policy or
    tier chain was made from (for its words: its peer set, named-port set and port)."""

    def __init__(self, model: RuleModel, local: Sequence[str], learned: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self.model = model
        self.learned = learned or {}  # domain set -> learned address -> the DNS name that taught it
        self.walker = TableWalker(layout.table(model), local)
        self.policy_chains = {chain.name: chain for chain in model.policy_chains}
        self.tier_chains = {chain.name: chain for chain in model.tier_chains}
        self.pod_chains = {chain.name: chain for chain in model.pod_chains}
        self.sets = {s.name: s for s in model.sets}
        self.unions = {u.name: u for u in model.unions}
        self.pods = {canonical(e.address): e.pod for m in self.walker.table.maps for e in m.elements}
        chains: list[PolicyChain | TierChain] = [*model.policy_chains, *model.tier_chains]
        self.peer_chains: dict[str, tuple[PolicyChain | TierChain, PeerChain]] = {p.name: (c, p) for c in chains for p in c.peer_chains}
        self._made_from: dict[str, list[tuple[MatchRule, ...]]] = {
            **{c.name: [made for _, made in layout.chain_rules(model.config, c)] for c in chains},
            **{p.name: [(r,) for r in p.rules for _ in layout.match_rules(model.config, c, r)] for c, p in self.peer_chains.values()}}

    def made_from(self, step: Step) -> tuple[PolicyChain | TierChain, tuple[MatchRule, ...]]:
        """The policy or tier chain of the model and the rules of it that the layout rule of
        ``step`` (a rule with an origin of a policy, peer or tier chain) was made from (several:
        the ports of a port set)."""
        chain = self.policy_chains.get(step.chain) or self.tier_chains.get(step.chain) or self.peer_chains[step.chain][0]
        return chain, self._made_from[step.chain][step.position]

    def jumps(self, pod_chain: str) -> tuple[str, ...]:
        """The chains that pod chain ``pod_chain`` jumps to (its tier chains, policy chains or
        ``KUBE-NWPLCY-DEFAULT``; the common chain aside), in order."""
        targets = [s.target for rule in self.walker.chains[pod_chain].rules for s in rule.statements
                   if isinstance(s, layout.Jump) and s.target != layout.COMMON_CHAIN]
        return tuple(dict.fromkeys(targets))

    def unknown_pod(self, address: str) -> bool:
        """True when the node's table takes ``address`` for an unknown pod's: an address of its
        pod CIDRs that none of its known local pods has (the node's own addresses aside)."""
        family = family_of(address)
        return (self.model.config.unknown_pods != "off" and address not in self.walker.local
                and self.walker.contains(layout.POD_CIDR_SETS[family], address) and not self.walker.contains(layout.KNOWN_POD_SETS[family], address))

    def describe(self, name: str) -> str:
        """What set ``name`` selects (its comment)."""
        return self.sets[name].comment

    def peers(self, name: str, address: str | None = None) -> tuple[str, ...]:
        """What the peers behind set ``name`` select: a union set's peers (with ``address``:
        those that give it), any other set's comment."""
        union = self.unions.get(name)
        if union is None:
            return (self.describe(name),)
        return union.matching(address) if address is not None else tuple(peer.text for peer in union.peers)


class Enforcement:
    """What nftpolicy enforces: ``models`` (node name -> that node's rule model; key None: one
    model in which every pod is local), ``pods`` (to name addresses and find the node whose model
    decides; an address of no listed pod is looked up in every model's pod chains) and
    ``node_addresses`` (node name -> its addresses, for the node-local exemption and traffic to
    the node itself)."""

    def __init__(self, models: Mapping[str | None, RuleModel], pods: Iterable[Endpoint] = (),
                 node_addresses: Mapping[str, Sequence[str]] | None = None,
                 learned: Mapping[str | None, Mapping[str, Mapping[str, str]]] | None = None) -> None:
        self.models = dict(models)
        self.learned = {node: {s: dict(a) for s, a in sets.items()} for node, sets in (learned or {}).items()}
        self.pods = tuple(pods)
        self.node_addresses = {name: tuple(canonical(a) for a in addresses) for name, addresses in (node_addresses or {}).items()}
        self._nodes = {name: _Node(model, self.node_addresses.get(name or "", ()), self.learned.get(name))
                       for name, model in self.models.items()}
        self._pod_at: dict[str, Endpoint] = {}
        for pod in self.pods:
            for ip in pod.ips:
                self._pod_at.setdefault(canonical(ip), pod)

    def pod_at(self, address: str) -> Endpoint | None:
        """The listed pod that holds ``address``, if any."""
        return self._pod_at.get(canonical(address))

    def node_at(self, address: str) -> str | None:
        """The name of the node that has ``address``, if any."""
        address = canonical(address)
        return next((name for name, addresses in self.node_addresses.items() if address in addresses), None)

    def name(self, address: str) -> str:
        """The pod key at ``address``, else the address."""
        pod = self.pod_at(address)
        return pod.key if pod is not None else canonical(address)

    def verdict(self, connection: Connection) -> Verdict:
        """The verdict of ``connection`` with its reasons. Raises ValueError for an address that
        does not parse or a connection whose two addresses are of different families."""
        conn = dataclasses.replace(connection, source=canonical(connection.source), destination=canonical(connection.destination))
        if family_of(conn.source) != family_of(conn.destination):
            raise ValueError(f"{conn.source} and {conn.destination} are of different address families")
        egress = self._direction("egress", conn.source, conn.destination, conn)
        ingress = self._direction("ingress", conn.destination, conn.source, conn)
        sides = (egress.allowed, ingress.allowed)
        allowed = False if False in sides else None if None in sides else True
        return Verdict(conn, allowed, egress, ingress)

    def _node_of(self, address: str) -> tuple[str | None, _Node | None, bool]:
        """(node name, its index, known) for the pod at ``address``."""
        pod = self.pod_at(address)
        if pod is not None:
            for name in (pod.node, None):
                if name in self._nodes:
                    return name, self._nodes[name], True
            return pod.node, None, False
        for name, index in self._nodes.items():
            if address in index.pods or index.unknown_pod(address):
                return name, index, True
        return None, None, True

    def _base_chain(self, node: str | None, direction: Direction, conn: Connection) -> str:
        """The base chain that first sees the connection on ``node`` for ``direction``: egress
        to an address of the node itself, a service cluster IP or an external range enters
        ``KUBE-ROUTER-INPUT`` (kube-proxy's IPVS mode binds the latter two to the node);
        ingress from the node itself ``KUBE-ROUTER-OUTPUT``; the rest ``KUBE-ROUTER-FORWARD``."""
        local = self.node_addresses.get(node or "", ())
        if direction == "ingress":
            return "KUBE-ROUTER-OUTPUT" if conn.source in local else "KUBE-ROUTER-FORWARD"
        config, destination = self._nodes[node].model.config, ipaddress.ip_address(conn.destination)
        bound = [c for c in config.service_cidrs + config.external_cidrs if family_of(c) == conn.family]
        if conn.destination in local or any(destination in ipaddress.ip_network(c) for c in bound):
            return layout.INPUT_CHAIN
        return "KUBE-ROUTER-FORWARD"

    def _direction(self, direction: Direction, address: str, peer: str, conn: Connection) -> DirectionVerdict:
        """One direction: the walk of the node's table from the base chain that sees the packet,
        dispatching only on ``address`` (the destination's pod chain for ingress, the source's for
        egress), read back as reasons."""
        node, index, known = self._node_of(address)
        pod = self.pod_at(address)
        key = pod.key if pod is not None else index.pods.get(address) if index is not None else None
        if not known or index is None:
            return DirectionVerdict(direction, address, key, node, known, False, None if not known else True)
        if pod is None and index.unknown_pod(address):
            return DirectionVerdict(direction, address, None, node, True, False, False, unknown=index.model.config.unknown_pods)
        pod_chain = index.walker.dispatch_target(direction, address)
        jumps = index.jumps(pod_chain) if pod_chain is not None else ()
        isolating = index.pod_chains[pod_chain].policies if pod_chain is not None else None
        targets = [index.policy_chains[t] for t in isolating or ()]  # a deny-all policy's chain too, never jumped to
        isolated = pod_chain is not None and layout.DEFAULT_CHAIN not in jumps
        side = DirectionVerdict(direction, address, key, node, True, isolated, True, tuple(c.policy for c in targets),
                                peer_node=self.node_at(peer))
        if address == peer:
            return dataclasses.replace(side, exemption="own address")
        walk = index.walker.walk(conn, self._base_chain(node, direction, conn), ("daddr" if direction == "ingress" else "saddr",))
        ended = walk.ended_by
        if walk.allowed and ended is not None:
            return dataclasses.replace(side, exemption=_exemption(ended.rule, index.model.config))
        if not walk.allowed and walk.ended_by is not None:
            side = dataclasses.replace(side, refusal=_refusal(walk.ended_by.rule))
        decided = _deciding_rule(index, walk, conn.port)
        if decided is not None:
            chain, rule = decided
            summary = _summaries(index, chain, [rule])[0]
            if rule.peer_set in index.unions:  # which of the union's peers the other end is
                summary = dataclasses.replace(summary, peers=index.peers(rule.peer_set, peer))
            taught = index.learned.get(rule.peer_set or "", {}).get(peer)
            if taught is not None:  # a domainNames peer: which name's answer put the address there
                summary = dataclasses.replace(summary, peers=(f"{index.describe(rule.peer_set or '')}: {peer} learned from the "
                                                              f"DNS answer for {taught}",))
            if rule.origin.tier is not None:
                action = rule.origin.action
                return dataclasses.replace(side, allowed=action == "Accept", cluster_rule=summary,
                                           cluster_action=f"{rule.origin.tier} {action}", fail_closed=_why_closed([chain]))
            return dataclasses.replace(side, allowed_by=summary)
        if walk.allowed:
            return side
        summaries = tuple(s for t in targets for s in _summaries(index, t, [r for r in t.rules if r.family in (None, conn.family)]))
        return dataclasses.replace(side, allowed=False, rules=summaries, fail_closed=_why_closed(targets))


def _why_closed(chains: Sequence[PolicyChain | TierChain]) -> tuple[tuple[str, str], ...]:
    """``(policy, why)`` of each of ``chains`` whose policy is enforced fail-closed (DESIGN.md
    section 4: invalid, or refused by the kernel), each policy once."""
    return tuple(dict.fromkeys((c.policy, c.fail_closed) for c in chains if c.fail_closed))


def _deciding_rule(index: _Node, walk: Walk, port: int | None) -> tuple[PolicyChain | TierChain, MatchRule] | None:
    """The policy or tier rule that decided a walk: the last rule with an origin (a policy
    rule) that fired, a ``Pass`` aside (it only ends its tier) and a jump to a peer chain (it
    decides nothing); None when none fired, or ``KUBE-NWPLCY-DEFAULT`` after it. A peer chain's
    rule is given with the port (of the match that jumped to it) that the connection's ``port``
    is in."""
    fired = walk.fired()
    for at in range(len(fired) - 1, -1, -1):
        step = fired[at]
        if step.chain == layout.DEFAULT_CHAIN:
            return None
        if step.rule.origin is None or step.rule.origin.action == "Pass" or any(isinstance(s, layout.Jump) for s in step.rule.statements):
            continue
        chain, (rule,) = index.made_from(step)
        if step.chain in index.peer_chains:
            ports = next(index.made_from(s)[1] for s in reversed(fired[:at]) if layout.Jump(step.chain) in s.rule.statements)
            jumped = next((r for r in ports if r.port is None or r.port.first is None or r.port.last is None
                           or (port is not None and r.port.first <= port <= r.port.last)), ports[0])
            rule = dataclasses.replace(jumped, family=rule.family, peer_set=rule.peer_set, peer_chain=None)
        return chain, rule
    return None


def _refusal(rule: layout.Rule) -> Refusal:
    """What refusing ``rule`` (one :func:`~nftpolicy.translators.layout.refusal` laid out) makes
    the kernel do: answer with a TCP reset or ICMP (ICMPv6) port unreachable, or drop."""
    reject = next((s for s in rule.statements if isinstance(s, layout.Reject)), None)
    if reject is None:
        return "drop"
    return "TCP reset" if reject.tcp_reset else "ICMP port unreachable"


def _exemption(rule: layout.Rule, config: Config) -> Exemption:
    """Which exemption ``rule`` (of a base chain, the common chain or a pod chain: a rule that
    accepts, or a ``return`` of ``KUBE-ROUTER-INPUT``) is, by what it matches."""
    statements = rule.statements
    if any(isinstance(s, layout.ConntrackState) for s in statements):
        return "established"
    if any(isinstance(s, layout.IcmpTypes) for s in statements):
        return "essential ICMP error"
    if any(isinstance(s, layout.LocalAddress) and s.field == "saddr" for s in statements):
        return "node-local source"
    if any(isinstance(s, layout.LocalAddress) and s.field == "daddr" for s in statements):
        return "node port"
    if any(isinstance(s, layout.AddressIs) and set(s.addresses) <= set(config.service_cidrs) for s in statements):
        return "service cluster IP"
    return "external IP"


def port_text(port: PortMatch) -> str:
    """``TCP/8080``, ``TCP/6000-6999`` or ``every UDP port``."""
    if port.first is None:
        return f"every {port.protocol} port"
    return f"{port.protocol}/{port.first}" + (f"-{port.last}" if port.last not in (None, port.first) else "")


def _summaries(index: _Node, chain: PolicyChain | TierChain, rules: Sequence[MatchRule]) -> list[RuleSummary]:
    """The allow rules of ``chain`` grouped by policy rule index, in order, in words."""
    grouped: dict[int, tuple[list[str], list[str]]] = {}
    for rule in rules:
        peers, ports = grouped.setdefault(rule.origin.index, ([], []))
        if rule.named_port_set is not None:
            what = index.describe(rule.named_port_set)
            if chain.direction == "egress":  # the set of the peers' named port: the peer match as well
                peers.append(what)
                ports.append("that named port")
            else:
                ports.append(what)
        elif rule.port is not None:
            ports.append(port_text(rule.port))
        else:
            ports.append("any port")
        if rule.peer_chain is not None:
            peers.extend(text for p in index.peer_chains[rule.peer_chain][1].rules if p.peer_set is not None for text in index.peers(p.peer_set))
        elif rule.peer_set is not None:
            peers.extend(index.peers(rule.peer_set))
        elif rule.named_port_set is None or chain.direction == "ingress":
            peers.append("any source" if chain.direction == "ingress" else "any destination")
    return [RuleSummary(chain.policy, chain.direction, i, tuple(dict.fromkeys(peers)), tuple(dict.fromkeys(ports)))
            for i, (peers, ports) in grouped.items()]


def enforcement_of(cluster: Cluster, nodes: Iterable[str | None] | None = None, config: Config = Config()) -> Enforcement:
    """:class:`Enforcement` of ``cluster``: the rule model of each of ``nodes`` (default: every
    node a pod runs on, and None, a model where every pod is local, for pods without a node), its
    enforceable pods and its nodes' addresses."""
    pods = [p for p in cluster.pods.values() if p.enforceable]
    names: list[str | None] = list(nodes) if nodes is not None else \
        [*sorted({p.node for p in pods if p.node}), *([None] if any(not p.node for p in pods) else [])]
    models = {name: build_rule_model(cluster, name, config) for name in names}
    return Enforcement(models, [Endpoint.of(p) for p in pods], {n.name: n.addresses for n in cluster.nodes.values()})


# ---- words ---------------------------------------------------------------------------------------

def _rule_text(summary: RuleSummary, with_policy: bool, verb: str = "") -> str:
    """``shop/db-ingress rule 0 (from ipBlock 10.244.1.0/24 on TCP/5432)``, or with ``verb``
    ``rule 0 allows from ... on ...``."""
    where = "from" if summary.direction == "ingress" else "to"
    name = f"rule {summary.rule}" if summary.rule is not None else "a rule"
    if with_policy:
        name = f"{summary.policy} {name}"
    what = f"{where} {' or '.join(summary.peers)} on {', '.join(summary.ports)}"
    return f"{name} {verb} {what}" if verb else f"{name} ({what})"


REFUSAL_TEXT: dict[str, str] = {
    "TCP reset": "the kernel rejects it with a TCP reset",
    "ICMP port unreachable": "the kernel rejects it with ICMP port unreachable",
    "drop": "the kernel drops it (no answer: the client times out)",
}

EXEMPTION_TEXT: dict[str, str] = {
    "own address": "allowed: to its own address (it never leaves the pod)",
    "established": "allowed: an established or related connection",
    "essential ICMP error": "allowed: an essential ICMP error (always accepted)",
    "node-local source": "allowed: from an address of its own node (the node may always reach its pods)",
    "service cluster IP": "allowed: to a service cluster IP (exempt in KUBE-ROUTER-INPUT)",
    "node port": "allowed: to a node port of its node (exempt in KUBE-ROUTER-INPUT)",
    "external IP": "allowed: to an external or load-balancer IP (exempt in KUBE-ROUTER-INPUT)",
}


def unknown_pod_text(direction: Direction, address: str, unknown: UnknownPods, node: str | None) -> str:
    """What ``direction`` of an unknown pod's ``address`` gets on ``node`` (None: the node
    asked about) as ``unknown`` says: ``egress of 10.0.1.77: an unknown pod (in node node-1's
    pod CIDRs, no pod programmed there): held until ...`` (explain and trace)."""
    where = f"node {node}'s" if node is not None else "the node's"
    what = ("held until the agent programs its pod, then its rules decide (dropped if that takes longer than the hold)"
            if unknown == "hold" else "dropped until the agent programs its pod")
    return f"{direction} of {address}: an unknown pod (in {where} pod CIDRs, no pod programmed there): {what}"


def direction_text(verdict: Verdict, side: DirectionVerdict) -> str:
    """One line for one direction, e.g. ``ingress of shop/db: allowed by shop/db-ingress rule 0
    (from ipBlock 10.244.1.0/24 except 10.244.1.10/32; TCP/5432)``."""
    conn = verdict.connection
    if side.unknown is not None:
        return unknown_pod_text(side.direction, side.address, side.unknown, side.node)
    if side.pod is None:
        return f"{side.direction} of {side.address}: not a pod, nothing enforced"
    head = f"{side.direction} of {side.pod}"
    if not side.known:
        return f"{head}: enforced on node {side.node}, whose rules are not known here"
    if side.exemption is not None:
        return f"{head}: {EXEMPTION_TEXT[side.exemption]}"
    if side.cluster_rule is not None and side.cluster_action is not None:
        tier, action = side.cluster_action.split()
        verb = "allowed" if action == "Accept" else "denied"
        peer = conn.destination if side.direction == "egress" else conn.source
        node = f", {peer} is an address of node {side.peer_node}" if side.peer_node is not None else ""
        return (f"{head}: {verb} by the {tier} tier: ClusterNetworkPolicy {_rule_text(side.cluster_rule, True)}{node}"
                f"{_closed(side)}{_refused(side)}")
    if not side.isolated:
        return f"{head}: not isolated (no policy selects it for {side.direction}), allowed"
    isolated = f"isolated by {', '.join(side.policies)}"
    if side.allowed_by is not None:
        return f"{head}: {isolated}; allowed by {_rule_text(side.allowed_by, True)}"
    peer = conn.destination if side.direction == "egress" else conn.source
    target = f"{_name(verdict, peer)} on {conn.text()}"
    allowing = "; ".join(_rule_text(s, len(side.policies) > 1, "allows") for s in side.rules) or \
        ("" if side.fail_closed else "its policies have no rules: deny all")
    return f"{head}: {isolated}; no rule allows {target}{f' ({allowing})' if allowing else ''}{_closed(side)}{_refused(side)}"


def _closed(side: DirectionVerdict) -> str:
    """``; shop/bad is enforced fail-closed: spec.ingress[0]...: why`` for each policy enforced
    fail-closed that decided the side, else ``""``."""
    return "".join(f"; {policy} is enforced fail-closed: {why}" for policy, why in side.fail_closed)


def _refused(side: DirectionVerdict) -> str:
    """``; the kernel drops it (...)`` for a refused direction, else ``""``."""
    return f"; {REFUSAL_TEXT[side.refusal]}" if side.refusal is not None else ""


def _name(verdict: Verdict, address: str) -> str:
    for side in (verdict.egress, verdict.ingress):
        if side.address == address and side.pod is not None:
            return side.pod
    return address


def verdict_lines(verdict: Verdict) -> list[str]:
    """The verdict in a few plain lines: ``DENIED  shop/frontend -> shop/db TCP/5432``, then the
    egress and the ingress line (:func:`direction_text`)."""
    word = {True: "ALLOWED", False: "DENIED", None: "UNKNOWN"}[verdict.allowed]
    if "hold" in (verdict.egress.unknown, verdict.ingress.unknown):
        word = "HELD"
    conn = verdict.connection
    head = f"{word}  {_name(verdict, conn.source)} -> {_name(verdict, conn.destination)} {conn.text()}"
    if conn.established:
        head += " (established)"
    return [head, "  " + direction_text(verdict, verdict.egress), "  " + direction_text(verdict, verdict.ingress)]


# ---- JSON (the agent's debug endpoint) -------------------------------------------------------------

def node_json(node: str, model: RuleModel, pods: Iterable[Pod], node_addresses: Mapping[str, Sequence[str]] | None = None,
              learned: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, Any]:
    """What one node enforces (:func:`enforcement_json` of its ``model``, the enforceable ones of
    ``pods`` and ``node_addresses``, node name -> addresses: its own for the node-local and
    node-port exemptions, the others' to name the Node a connection goes to): the agent's debug
    endpoint. ``learned``: domain set -> address -> the DNS name whose answer taught it (the
    agent's; they become the domain sets' elements)."""
    endpoints = [Endpoint.of(p) for p in pods if p.enforceable]
    if learned:
        model = dataclasses.replace(model, sets=tuple(dataclasses.replace(s, elements=tuple(learned.get(s.name, {})))
                                                      if s.kind == "domain" else s for s in model.sets))
    return enforcement_json(Enforcement({node: model}, endpoints, {k: v for k, v in (node_addresses or {}).items() if v},
                                        {node: learned} if learned else None))


def _model_shape() -> str:
    """A fingerprint of the dataclasses :func:`enforcement_json` writes (their field names and
    types): it changes whenever one of them does, so that a reader of another nftpolicy version
    says so instead of misreading the data."""
    classes = (RuleModel, Config, AddressSet, PolicyChain, PeerChain, PodChain, TierChain, MatchRule, PortMatch, RuleOrigin, Endpoint,
               UnionSet, UnionPeer)
    fields = [(c.__name__, [(f.name, str(f.type)) for f in dataclasses.fields(c)]) for c in classes]
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:12]


MODEL_SHAPE = _model_shape()


class ModelShapeMismatch(ValueError):
    """The data was written by an nftpolicy whose model has another shape (another version)."""

    def __init__(self, shape: object) -> None:
        super().__init__(f"its model has shape {shape}, this nftpolicy reads shape {MODEL_SHAPE}")
        self.shape = shape


def enforcement_json(enforcement: Enforcement) -> dict[str, Any]:
    """Everything :class:`Enforcement` holds as plain JSON data (:func:`enforcement_from_json`
    reads it back): ``shape`` (:data:`MODEL_SHAPE`), ``models`` as ``[{"node": ..., "model": ...}]``,
    ``pods``, ``node_addresses``; a model's ``learned`` (domain set -> address -> DNS name) where
    an agent learned addresses."""
    return {"shape": MODEL_SHAPE, "models": [{"node": node, "model": dataclasses.asdict(model),
                                              **({"learned": enforcement.learned[node]} if enforcement.learned.get(node) else {})}
                                             for node, model in enforcement.models.items()],
            "pods": [dataclasses.asdict(p) for p in enforcement.pods],
            "node_addresses": {k: list(v) for k, v in enforcement.node_addresses.items()}}


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _match_rule(data: Mapping[str, Any]) -> MatchRule:
    return MatchRule(**{**data, "port": PortMatch(**data["port"]) if data["port"] else None, "origin": RuleOrigin(**data["origin"])})


def enforcement_from_json(data: Mapping[str, Any]) -> Enforcement:
    """The :class:`Enforcement` that :func:`enforcement_json` wrote. Raises
    :class:`ModelShapeMismatch` for data another version wrote, KeyError, TypeError or ValueError
    for data of another shape."""
    if data.get("shape") != MODEL_SHAPE:
        raise ModelShapeMismatch(data.get("shape", "(none)"))
    models: dict[str | None, RuleModel] = {}
    learned: dict[str | None, Mapping[str, Mapping[str, str]]] = {}
    for entry in data["models"]:
        m = entry["model"]
        if entry.get("learned"):
            learned[entry["node"]] = entry["learned"]
        config = Config(**{k: _tuples(v) for k, v in m["config"].items()})
        sets = tuple(AddressSet(**{**s, "elements": _tuples(s["elements"])}) for s in m["sets"])
        chains = tuple(PolicyChain(**{**c, "rules": tuple(map(_match_rule, c["rules"])),
                                      "peer_chains": tuple(PeerChain(p["name"], tuple(map(_match_rule, p["rules"]))) for p in c["peer_chains"])})
                       for c in m["policy_chains"])
        pods = tuple(PodChain(**{k: _tuples(v) for k, v in p.items()}) for p in m["pod_chains"])
        tiers = tuple(TierChain(**{**c, "rules": tuple(map(_match_rule, c["rules"])),
                                   "peer_chains": tuple(PeerChain(p["name"], tuple(map(_match_rule, p["rules"]))) for p in c["peer_chains"])})
                      for c in m.get("tier_chains") or ())
        unions = tuple(UnionSet(u["name"], tuple(UnionPeer(p["text"], tuple(p["elements"])) for p in u["peers"])) for u in m.get("unions") or ())
        models[entry["node"]] = RuleModel(config, sets, chains, pods, tiers, unions)
    endpoints = [Endpoint(p["key"], p["node"], tuple(p["ips"]), _tuples(p.get("ports") or [])) for p in data["pods"]]
    return Enforcement(models, endpoints, data.get("node_addresses") or {}, learned)
