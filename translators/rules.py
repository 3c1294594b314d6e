"""Cluster model + node name -> rule model: kube-router's network-policy topology as plain data.

The rule model names every chain and set and says what each rule allows, without nft or iptables
syntax; :mod:`nftpolicy.translators.nft` turns it into an nftables ruleset. The layout is
DESIGN.md section 2 (kube-router's ``KUBE-ROUTER-*`` -> ``KUBE-POD-FW-<hash>`` ->
``KUBE-NWPLCY-<hash>``), the semantics section 3 (the NetworkPolicy API reference):

* a pod is isolated for a direction when a policy of that type selects it; its chain then jumps
  to the policy chains of that direction only, else to ``KUBE-NWPLCY-DEFAULT``;
* a policy chain has one :class:`AllowRule` per allowed (peers, port) tuple;
* peers are sets: pod addresses (``addr``), ipBlocks minus their own excepts (``interval``), or
  ``address . protocol . port`` triples where a named port resolves per pod (``named_port``).

Only policies that select a pod on the node are rendered, so the ruleset grows with local pods,
their policies and those policies' peers, never with pods x policies.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import ipaddress
from dataclasses import dataclass
from typing import Literal, Mapping

from .model import Cluster, Direction, Family, LabelSelector, NetworkPolicy, Peer, Pod, PolicyPort, PolicyRule, Protocol, family_of

FAMILIES: tuple[Family, ...] = ("ipv4", "ipv6")
COMMENT_MAX_BYTES = 128


@dataclass(frozen=True)
class Config:
    """Rendering settings (DESIGN.md sections 2 and 5), defaults as kube-router.

    ``priority`` is the base chains' hook priority (0 is nft's ``filter``); marks are bit masks;
    ``node_port_range`` is inclusive; CIDR strings may mix families.
    """

    table: str = "nftpolicy"
    priority: int = 0
    policy_mark: int = 0x10000
    passed_mark: int = 0x20000
    service_cidrs: tuple[str, ...] = ("10.96.0.0/12",)
    node_port_range: tuple[int, int] | None = (30000, 32767)
    external_cidrs: tuple[str, ...] = ()
    nflog_group: int = 100


@dataclass(frozen=True)
class AddressSet:
    """A named set of one family.

    ``kind`` ``addr``: address strings; ``interval``: network strings, disjoint and sorted;
    ``named_port``: ``(address, protocol, port)`` triples, protocol lower case.
    """

    name: str
    family: Family
    kind: Literal["addr", "interval", "named_port"]
    elements: tuple
    comment: str


@dataclass(frozen=True)
class PortMatch:
    """A protocol, optionally with the inclusive port range ``first..last``."""

    protocol: Protocol
    first: int | None = None
    last: int | None = None


@dataclass(frozen=True)
class AllowRule:
    """One allowed (peers, port) tuple: set the policy mark and return.

    ``peer_set`` names the set the peer address (source for ingress, destination for egress)
    must be in; None means any peer. ``named_port_set`` names a ``named_port`` set that the
    packet's ``destination address . protocol . port`` must be in. ``family`` is None when the
    rule has no address match and applies to both families.
    """

    family: Family | None
    peer_set: str | None
    port: PortMatch | None
    named_port_set: str | None
    comment: str


@dataclass(frozen=True)
class PolicyChain:
    """``KUBE-NWPLCY-<hash>`` for one policy and one direction; no rules means deny all."""

    name: str
    policy: str
    direction: Direction
    rules: tuple[AllowRule, ...]
    comment: str


@dataclass(frozen=True)
class PodChain:
    """``KUBE-POD-FW-<hash>`` for one local pod.

    ``ingress``/``egress`` list the policy chains to jump to for that direction; None means no
    policy isolates the pod in that direction (jump ``KUBE-NWPLCY-DEFAULT``).
    """

    name: str
    pod: str
    ips: tuple[str, ...]
    ingress: tuple[str, ...] | None
    egress: tuple[str, ...] | None
    comment: str


@dataclass(frozen=True)
class RuleModel:
    """The whole desired ruleset for one node, every tuple sorted for stable output."""

    config: Config
    sets: tuple[AddressSet, ...]
    policy_chains: tuple[PolicyChain, ...]
    pod_chains: tuple[PodChain, ...]


def hashed_name(prefix: str, *identity: str) -> str:
    """``prefix`` + the first 16 characters of base32(sha256(identity)) (DESIGN.md section 2).

    The identity parts are joined with NUL so that ``("ab", "c")`` and ``("a", "bc")`` differ.
    """
    digest = hashlib.sha256("\0".join(identity).encode()).digest()
    return prefix + base64.b32encode(digest).decode()[:16]


def comment(text: str, limit: int = COMMENT_MAX_BYTES) -> str:
    """``text`` without double quotes, cut to at most ``limit`` bytes of UTF-8 (nft's comment
    limit is 128), never mid-character."""
    return text.replace('"', "'").encode()[:limit].decode(errors="ignore")


class ClusterIndex:
    """Selector lookups over a cluster, cached per selector (pure, built once per render).

    Pods are grouped by (namespace, labels) so a selector is evaluated once per distinct label
    set, not once per pod.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._groups: dict[str, dict[frozenset, list[Pod]]] = {}
        for key in sorted(cluster.pods):
            pod = cluster.pods[key]
            if pod.enforceable:
                self._groups.setdefault(pod.namespace, {}).setdefault(frozenset(pod.labels.items()), []).append(pod)
        self.namespaces = sorted(set(cluster.namespaces) | set(self._groups))
        self._pods: dict[tuple[str, LabelSelector | None], tuple[Pod, ...]] = {}
        self._namespaces: dict[LabelSelector, tuple[str, ...]] = {}

    def pods(self, namespace: str, selector: LabelSelector | None) -> tuple[Pod, ...]:
        """Enforceable pods of ``namespace`` matching ``selector`` (None: all of them)."""
        key = (namespace, selector)
        if key not in self._pods:
            self._pods[key] = tuple(
                pod
                for labels, group in self._groups.get(namespace, {}).items()
                if selector is None or selector.matches(dict(labels))
                for pod in group
            )
        return self._pods[key]

    def namespaces_matching(self, selector: LabelSelector) -> tuple[str, ...]:
        """Names of the namespaces whose labels match ``selector``."""
        if selector not in self._namespaces:
            self._namespaces[selector] = tuple(n for n in self.namespaces if selector.matches(self.cluster.namespace_labels(n)))
        return self._namespaces[selector]

    def all_pods(self) -> tuple[Pod, ...]:
        """Every enforceable pod."""
        return tuple(p for n in self.namespaces for p in self.pods(n, None))

    def peer_pods(self, policy: NetworkPolicy, peer: Peer) -> tuple[Pod, ...]:
        """Pods a selector peer names (NetworkPolicyPeer: selectors in one peer are AND'ed;
        no namespaceSelector means the policy's namespace). An ipBlock peer names no pods here."""
        if peer.ip_block is not None:
            return ()
        namespaces = (policy.namespace,) if peer.namespace_selector is None else self.namespaces_matching(peer.namespace_selector)
        return tuple(p for n in namespaces for p in self.pods(n, peer.pod_selector))


def _port_match(port: PolicyPort) -> PortMatch:
    if port.port is None:
        return PortMatch(port.protocol)
    assert isinstance(port.port, int)
    return PortMatch(port.protocol, port.port, port.end_port or port.port)


def _named_port_elements(pods: tuple[Pod, ...], port: PolicyPort, family: Family, ip_filter=None) -> tuple:
    assert isinstance(port.port, str)
    elements = set()
    for pod in pods:
        number = pod.resolve_port(port.port, port.protocol)
        if number is None:
            continue
        for ip in pod.addresses(family):
            if ip_filter is None or ip_filter(ip):
                elements.add((ip, port.protocol.lower(), number))
    return tuple(sorted(elements, key=lambda e: (_address_order(e[0]), e[1], e[2])))


@functools.lru_cache(maxsize=1 << 16)
def _address_order(ip: str) -> tuple[int, ipaddress.IPv4Address | ipaddress.IPv6Address]:
    address = ipaddress.ip_address(ip)
    return address.version, address


def _sorted_ips(ips) -> tuple[str, ...]:
    """Unique addresses, IPv4 first, each family in numeric order."""
    return tuple(sorted(set(ips), key=_address_order))


class _PolicyRenderer:
    """Builds the chain and sets of one (policy, direction)."""

    def __init__(self, index: ClusterIndex, policy: NetworkPolicy, direction: Direction, targets: tuple[Pod, ...], families: tuple[Family, ...]) -> None:
        self.index, self.policy, self.direction = index, policy, direction
        self.targets, self.families = targets, families
        self.sets: list[AddressSet] = []
        self.peer_prefix = "KUBE-SRC-" if direction == "ingress" else "KUBE-DST-"

    def _set(self, family: Family, kind: str, elements: tuple, rule_index: int, what: str, *extra: str) -> str:
        name = hashed_name(self.peer_prefix if kind != "named_port" else "KUBE-DST-",
                           self.policy.namespace, self.policy.name, self.direction, str(rule_index), family, kind, *extra)
        self.sets.append(AddressSet(name, family, kind, elements, comment(f"{self.policy.key} {self.direction} rule {rule_index} {what}")))  # type: ignore[arg-type]
        return name

    def chain(self) -> PolicyChain:
        rules: list[AllowRule] = []
        for i, rule in enumerate(self.policy.rules(self.direction)):
            rules.extend(self._rule(i, rule))
        name = hashed_name("KUBE-NWPLCY-", self.policy.namespace, self.policy.name, self.direction)
        return PolicyChain(name, self.policy.key, self.direction, tuple(rules), comment(f"{self.policy.key} {self.direction}"))

    def _peer_options(self, i: int, rule: PolicyRule) -> list[tuple[Family | None, str | None]]:
        """(family, peer set) alternatives of one rule: any peer, or its pod sets and ipBlock sets."""
        if not rule.peers:
            return [(None, None)]
        options: list[tuple[Family | None, str | None]] = []
        selector_peers = [p for p in rule.peers if p.ip_block is None]
        if selector_peers:
            pods = [pod for peer in selector_peers for pod in self.index.peer_pods(self.policy, peer)]
            for family in self.families:
                ips = _sorted_ips(ip for pod in pods for ip in pod.addresses(family))
                options.append((family, self._set(family, "addr", ips, i, "pods")))
        blocks = [p.ip_block for p in rule.peers if p.ip_block is not None]
        for family in FAMILIES:
            nets = list(ipaddress.collapse_addresses(net for b in blocks for net in b.networks() if family_of(str(net)) == family))
            if any(family_of(str(b.cidr)) == family for b in blocks):
                options.append((family, self._set(family, "interval", tuple(str(n) for n in nets), i, "ipBlock")))
        return options

    def _rule(self, i: int, rule: PolicyRule) -> list[AllowRule]:
        text = comment(f"{self.policy.key} {self.direction} rule {i}")
        peer_options = self._peer_options(i, rule)
        if not rule.ports:
            return [AllowRule(family, peer_set, None, None, text) for family, peer_set in peer_options]
        allows: list[AllowRule] = []
        for j, port in enumerate(rule.ports):
            if not isinstance(port.port, str):
                allows.extend(AllowRule(family, peer_set, _port_match(port), None, text) for family, peer_set in peer_options)
            elif self.direction == "ingress":
                # Named ports of an ingress rule resolve on the selected (destination) pods.
                named: dict[Family, str] = {}
                for family, peer_set in peer_options:
                    for fam in (self.families if family is None else (family,)):
                        if fam not in named:
                            elements = _named_port_elements(self.targets, port, fam)
                            named[fam] = self._set(fam, "named_port", elements, i, f"port {port.port}", str(j))
                        allows.append(AllowRule(fam, peer_set, None, named[fam], text))
            else:
                # Named ports of an egress rule resolve on the peer pods; the set holds only
                # peer addresses, so it carries the peer match as well.
                allows.extend(self._egress_named(i, j, rule, port, text))
        return allows

    def _egress_named(self, i: int, j: int, rule: PolicyRule, port: PolicyPort, text: str) -> list[AllowRule]:
        if not rule.peers:
            pods, blocks = self.index.all_pods(), []
        else:
            pods = tuple(pod for peer in rule.peers for pod in self.index.peer_pods(self.policy, peer))
            blocks = [p.ip_block for p in rule.peers if p.ip_block is not None]
        allows = []
        for family in self.families:
            elements = set(_named_port_elements(pods, port, family))
            if blocks:
                elements |= set(_named_port_elements(self.index.all_pods(), port, family, lambda ip: any(b.contains(ip) for b in blocks)))
            ordered = tuple(sorted(elements, key=lambda e: (_address_order(e[0]), e[1], e[2])))
            allows.append(AllowRule(family, None, None, self._set(family, "named_port", ordered, i, f"port {port.port}", str(j)), text))
        return allows


def build_rule_model(cluster: Cluster, node: str | None, config: Config = Config()) -> RuleModel:
    """Render the desired ruleset of ``node`` (None: every pod counts as local).

    Returns a :class:`RuleModel` with every tuple in a stable order, so equal clusters give equal
    models whatever the input order.
    """
    index = ClusterIndex(cluster)
    families = tuple(f for f in FAMILIES if any(p.addresses(f) for p in index.all_pods())) or ("ipv4",)
    local = [p for p in index.all_pods() if node is None or p.node == node]
    local_keys = {p.key for p in local}
    selecting: dict[str, dict[Direction, list[str]]] = {p.key: {} for p in local}
    policy_chains: list[PolicyChain] = []
    sets: list[AddressSet] = []
    for key in sorted(cluster.policies):
        policy = cluster.policies[key]
        targets = index.pods(policy.namespace, policy.pod_selector)
        local_targets = tuple(p for p in targets if p.key in local_keys)
        if not local_targets:
            continue
        for direction in ("ingress", "egress"):
            if direction not in policy.policy_types:
                continue
            renderer = _PolicyRenderer(index, policy, direction, local_targets, families)  # type: ignore[arg-type]
            chain = renderer.chain()
            policy_chains.append(chain)
            sets.extend(renderer.sets)
            for pod in local_targets:
                selecting[pod.key].setdefault(direction, []).append(chain.name)  # type: ignore[index]
    pod_chains = []
    dispatched: set[str] = set()  # an address reaches one pod chain (Running pods first)
    for pod in sorted(local, key=lambda p: (p.phase != "Running", p.key)):
        directions: Mapping[str, list[str]] = selecting[pod.key]
        ips = tuple(ip for ip in pod.ips if ip not in dispatched)
        dispatched.update(pod.ips)
        if not directions or not ips:
            continue  # not isolated in either direction: nothing to enforce
        ingress, egress = directions.get("ingress"), directions.get("egress")
        pod_chains.append(PodChain(
            name=hashed_name("KUBE-POD-FW-", pod.namespace, pod.name),
            pod=pod.key,
            ips=_sorted_ips(ips),
            ingress=tuple(ingress) if ingress is not None else None,
            egress=tuple(egress) if egress is not None else None,
            comment=comment(f"{pod.key} pod"),
        ))
    return RuleModel(
        config=config,
        sets=tuple(sorted(sets, key=lambda s: s.name)),
        policy_chains=tuple(sorted(policy_chains, key=lambda c: c.name)),
        pod_chains=tuple(sorted(pod_chains, key=lambda c: c.name)),
    )
