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
    """Selector lookups over a cluster, cached per selector (pure).

    Pods are grouped by (namespace, labels) so a selector is evaluated once per distinct label
    set, not once per pod. Given the ``previous`` index (of an earlier snapshot of the same
    cluster), results for namespaces whose pods are the same objects as before are carried over,
    so a sync after one pod change re-evaluates selectors only in that pod's namespace.
    """

    def __init__(self, cluster: Cluster, previous: "ClusterIndex | None" = None) -> None:
        self.cluster = cluster
        changed = _changed_namespaces(previous.cluster.pods, cluster.pods) if previous else None
        self._groups: dict[str, dict[frozenset, tuple[Mapping[str, str], list[Pod]]]] = (
            {} if previous is None else {n: g for n, g in previous._groups.items() if n not in changed})  # type: ignore[operator]
        for key in sorted(cluster.pods):
            pod = cluster.pods[key]
            if pod.enforceable and (changed is None or pod.namespace in changed):
                groups = self._groups.setdefault(pod.namespace, {})
                groups.setdefault(frozenset(pod.labels.items()), (pod.labels, []))[1].append(pod)
        self.namespaces = sorted(set(cluster.namespaces) | set(self._groups))
        same_namespaces = (previous is not None and previous.namespaces == self.namespaces
                           and previous.cluster.namespaces.keys() == cluster.namespaces.keys()
                           and all(previous.cluster.namespaces[n] is v for n, v in cluster.namespaces.items()))
        self._pods: dict[tuple[str, LabelSelector | None], tuple[Pod, ...]] = (
            {} if previous is None else {k: v for k, v in previous._pods.items() if k[0] not in changed})  # type: ignore[operator]
        self._namespaces: dict[LabelSelector, tuple[str, ...]] = dict(previous._namespaces) if same_namespaces else {}  # type: ignore[union-attr]
        self._peers: dict[tuple[str, Peer], tuple[tuple[Pod, ...], tuple[str, ...]]] = {}
        if previous is not None and same_namespaces:
            self._peers = {k: v for k, v in previous._peers.items() if not changed.intersection(v[1])}  # type: ignore[union-attr]
        self._all = previous._all if previous is not None and not changed and same_namespaces else None
        # Earlier results, handed back when a recomputed lookup finds the very same pods.
        self._earlier_peers = previous._peers if previous is not None else {}
        self._earlier_all = previous._all if previous is not None else None

    def pods(self, namespace: str, selector: LabelSelector | None) -> tuple[Pod, ...]:
        """Enforceable pods of ``namespace`` matching ``selector`` (None: all of them)."""
        key = (namespace, selector)
        if key not in self._pods:
            self._pods[key] = tuple(
                pod
                for labels, group in self._groups.get(namespace, {}).values()
                if selector is None or selector.matches(labels)
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
        if self._all is None:
            self._all = _same_or(self._earlier_all, tuple(p for n in self.namespaces for p in self.pods(n, None)))
        return self._all

    def peer_pods(self, policy: NetworkPolicy, peer: Peer) -> tuple[Pod, ...]:
        """Pods a selector peer names (NetworkPolicyPeer: selectors in one peer are AND'ed;
        no namespaceSelector means the policy's namespace). An ipBlock peer names no pods here."""
        if peer.ip_block is not None:
            return ()
        key = (policy.namespace, peer)
        if key not in self._peers:
            namespaces = (policy.namespace,) if peer.namespace_selector is None else self.namespaces_matching(peer.namespace_selector)
            pods = tuple(p for n in namespaces for p in self.pods(n, peer.pod_selector))
            earlier = self._earlier_peers.get(key)
            self._peers[key] = (_same_or(earlier[0] if earlier else None, pods), namespaces)
        return self._peers[key][0]


def _same_or(earlier: tuple[Pod, ...] | None, pods: tuple[Pod, ...]) -> tuple[Pod, ...]:
    """``earlier`` when it holds the very same pod objects as ``pods``, else ``pods``."""
    if earlier is not None and len(earlier) == len(pods) and all(a is b for a, b in zip(earlier, pods)):
        return earlier
    return pods


def _changed_namespaces(old: Mapping[str, Pod], new: Mapping[str, Pod]) -> set[str]:
    """Namespaces with a pod added, removed or replaced by another object."""
    changed = set()
    for key, pod in new.items():
        before = old.get(key)
        if before is not pod:
            changed.add(pod.namespace)
            if before is not None:
                changed.add(before.namespace)
    changed.update(old[key].namespace for key in old.keys() - new.keys())
    return changed


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
    return tuple(sorted(elements, key=_named_port_order))


def _named_port_order(element: tuple[str, str, int]) -> tuple:
    """Sort key of an ``(address, protocol, port)`` element."""
    return _address_order(element[0]), element[1], element[2]


@functools.lru_cache(maxsize=1 << 17)
def _address_order(ip: str) -> tuple[int, int]:
    """Sort key of an address: family, then numeric value."""
    address = ipaddress.ip_address(ip)
    return address.version, int(address)


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
        self.lookups: list[tuple[Peer | None, tuple[Pod, ...]]] = []  # what the result depends on

    def _peer_pods(self, peer: Peer | None) -> tuple[Pod, ...]:
        """Pods of a selector peer (None: every pod), recorded as an input of this render."""
        pods = self.index.all_pods() if peer is None else self.index.peer_pods(self.policy, peer)
        self.lookups.append((peer, pods))
        return pods

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
            pods = [pod for peer in selector_peers for pod in self._peer_pods(peer)]
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
                            named[fam] = self._set(fam, "named_port", elements, i, f"port {port.port}", str(j), port.port)
                        allows.append(AllowRule(fam, peer_set, None, named[fam], text))
            else:
                # Named ports of an egress rule resolve on the peer pods; the set holds only
                # peer addresses, so it carries the peer match as well.
                allows.extend(self._egress_named(i, j, rule, port, text))
        return allows

    def _egress_named(self, i: int, j: int, rule: PolicyRule, port: PolicyPort, text: str) -> list[AllowRule]:
        if not rule.peers:
            pods, blocks = self._peer_pods(None), []
        else:
            pods = tuple(pod for peer in rule.peers for pod in self._peer_pods(peer))
            blocks = [p.ip_block for p in rule.peers if p.ip_block is not None]
        allows = []
        for family in self.families:
            elements = set(_named_port_elements(pods, port, family))
            if blocks:
                elements |= set(_named_port_elements(self._peer_pods(None), port, family, lambda ip: any(b.contains(ip) for b in blocks)))
            ordered = tuple(sorted(elements, key=_named_port_order))
            allows.append(AllowRule(family, None, None, self._set(family, "named_port", ordered, i, f"port {port.port}", str(j), port.port), text))
        return allows


@dataclass
class _Rendered:
    """One (policy, direction) as rendered, with every input it was rendered from."""

    policy: NetworkPolicy
    targets: tuple[Pod, ...]
    families: tuple[Family, ...]
    lookups: list[tuple[Peer | None, tuple[Pod, ...]]]
    chain: PolicyChain
    sets: list[AddressSet]

    def still_valid(self, index: ClusterIndex, policy: NetworkPolicy, targets: tuple[Pod, ...], families: tuple[Family, ...]) -> bool:
        """True when every input is the same object as when this was rendered."""
        return (self.policy is policy and self.families == families and len(self.targets) == len(targets)
                and all(a is b for a, b in zip(self.targets, targets))
                and all((index.all_pods() if peer is None else index.peer_pods(policy, peer)) is pods for peer, pods in self.lookups))


class RenderCache:
    """What one render of a node lends the next one (the agent keeps one across syncs).

    Holds the last :class:`ClusterIndex` and every policy chain with its sets; a policy whose
    inputs (the policy, its local targets, its peers' pods) are the same objects as last time is
    not rendered again. The model objects must be immutable (they are frozen dataclasses) and
    a changed object must be a new object, as the agent's store guarantees.
    """

    def __init__(self) -> None:
        self.index: ClusterIndex | None = None
        self.rendered: dict[tuple[str, str], _Rendered] = {}


def build_rule_model(cluster: Cluster, node: str | None, config: Config = Config(), cache: RenderCache | None = None) -> RuleModel:
    """Render the desired ruleset of ``node`` (None: every pod counts as local).

    Returns a :class:`RuleModel` with every tuple in a stable order, so equal clusters give equal
    models whatever the input order. With a ``cache``, the work of the previous render is reused
    where its inputs are unchanged; the result is the same as without it.
    """
    index = ClusterIndex(cluster, cache.index if cache else None)
    families = tuple(f for f in FAMILIES if any(p.addresses(f) for p in index.all_pods())) or ("ipv4",)
    rendered: dict[tuple[str, str], _Rendered] = {}
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
            done = cache.rendered.get((key, direction)) if cache else None
            if done is None or not done.still_valid(index, policy, local_targets, families):
                renderer = _PolicyRenderer(index, policy, direction, local_targets, families)  # type: ignore[arg-type]
                done = _Rendered(policy, local_targets, families, renderer.lookups, renderer.chain(), renderer.sets)
            rendered[(key, direction)] = done
            chain = done.chain
            policy_chains.append(chain)
            sets.extend(done.sets)
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
    if cache is not None:
        cache.index, cache.rendered = index, rendered
    return RuleModel(
        config=config,
        sets=tuple(sorted(sets, key=lambda s: s.name)),
        policy_chains=tuple(sorted(policy_chains, key=lambda c: c.name)),
        pod_chains=tuple(sorted(pod_chains, key=lambda c: c.name)),
    )
