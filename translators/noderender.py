"""One node's rule model, kept up to date object by object: a change costs what it touches.

:class:`NodeRenderer` holds the cluster as indexes (pods by namespace and label set, policies by
namespace) and the node's desired rule model (DESIGN.md section 2: ``KUBE-POD-FW-<hash>`` ->
``KUBE-NWPLCY-<hash>``, semantics section 3). It takes one object at a time (:meth:`set_pod`,
:meth:`set_namespace`, :meth:`set_policy`) and records what that changed in the model, which
:meth:`take_changes` hands out; :meth:`model` is the whole model (a full render is
:meth:`load` then :meth:`model`: the same code).

Peer sets are shared **selector sets** (the pattern of Calico's selector IP sets): a set is named
after what it selects, not after the policy rule that uses it, so every rule that selects the
same thing uses one set. Its key (:class:`SetKey`) is a :class:`Scope` of pods (one namespace, or
the namespaces a namespaceSelector matches; a podSelector; optionally only this node's pods, or
only addresses inside an ipBlock), or an ipBlock with its excepts, plus the family and, for named
ports, the port name and protocol. A set appears with its first user and goes with its last
(reference counts). Each set keeps how many pods give each element, so a pod change adds or
deletes only the elements that change, in only the sets whose scope holds the pod.

What a policy chain says depends only on the policy (its rules name sets by key); which policy
chains exist depends on the node's pods (a chain exists while the policy selects a local pod);
pod chains depend on the local pods and the policies of their namespace. So a non-local pod
change touches only set elements, a namespace label change only the sets of the
namespaceSelectors that start or stop matching it, and a policy change its own chains, sets and
the pod chains of its namespace.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, Mapping

import orjson

from .model import (
    NAMESPACE_NAME_LABEL,
    Cluster,
    Direction,
    Family,
    IPBlock,
    LabelSelector,
    Namespace,
    NetworkPolicy,
    Peer,
    Pod,
    PolicyPort,
    PolicyRule,
    Protocol,
    Requirement,
    family_of,
)
from .rules import (
    FAMILIES,
    AddressSet,
    AllowRule,
    Config,
    PodChain,
    PolicyChain,
    PortMatch,
    RuleModel,
    TierChain,
    address_order,
    comment,
    hashed_name,
    selector_text,
)

if TYPE_CHECKING:
    from .clusterpolicy import ClusterNetworkPolicy

SetKind = Literal["addr", "interval", "named_port"]
DIRECTIONS: tuple[Direction, ...] = ("ingress", "egress")
ALL_NAMESPACES = LabelSelector()  # namespaceSelector {}: every namespace


@dataclass(frozen=True)
class Scope:
    """Which pods a set draws from: those of ``namespace`` (or of every namespace that
    ``namespace_selector`` matches) whose labels match ``pod_selector`` (None: every pod), and
    with ``local`` only those on the rendered node, with ``block`` only their addresses inside
    that ipBlock (an egress named port towards an ipBlock peer). Selectors are canonical
    (:func:`canonical_selector`), so equal scopes are equal values."""

    namespace: str | None = None
    namespace_selector: LabelSelector | None = None
    pod_selector: LabelSelector | None = None
    local: bool = False
    block: IPBlock | None = None

    def text(self) -> str:
        """What the scope selects, in words: ``pods in x: app=b``,
        ``pods in namespaces team=blue: all``, ``pods in namespaces all inside 10.0.0.0/8``."""
        where = f"in {self.namespace}" if self.namespace is not None else f"in namespaces {selector_text(self.namespace_selector)}"
        if self.block is not None:
            return f"pods {where} inside {block_text(self.block)}"
        return f"{'local pods' if self.local else 'pods'} {where}: {selector_text(self.pod_selector)}"


@dataclass(frozen=True)
class SetKey:
    """The identity of a shared set: pod addresses of a scope (``addr``), the networks of an
    ipBlock (``interval``), or ``address . protocol . port`` of a scope's pods that have the
    named container port (``named_port``)."""

    kind: SetKind
    family: Family
    scope: Scope | None = None
    block: IPBlock | None = None
    port: str | None = None
    protocol: Protocol | None = None

    @functools.cached_property
    def name(self) -> str:
        """``KUBE-PODS-``, ``KUBE-NET-`` or ``KUBE-PORT-`` + the hash of the key's fields (with
        canonical selectors: equal keys, equal names; different keys, different names). The
        names fit ipset's 31 characters with the iptables variant's ``TMP-`` prefix."""
        prefix = {"addr": "KUBE-PODS-", "interval": "KUBE-NET-", "named_port": "KUBE-PORT-"}[self.kind]
        return hashed_name(prefix, orjson.dumps(_identity(self)).decode())

    @functools.cached_property
    def description(self) -> str:
        """What the set holds, in words (its comment, and the identity its name hashes)."""
        if self.kind == "interval":
            assert self.block is not None
            return f"ipBlock {block_text(self.block)}"
        assert self.scope is not None
        if self.kind == "named_port":
            return f"port {self.port}/{self.protocol} of {self.scope.text()}"
        return self.scope.text()


def _identity(value: Any) -> Any:
    """A set key as plain JSON data, fields by name (what its name hashes)."""
    if isinstance(value, (SetKey, Scope, IPBlock, LabelSelector, Requirement)):
        return {f: _identity(getattr(value, f)) for f in value.__dataclass_fields__}
    if isinstance(value, (tuple, list)):
        return [_identity(v) for v in value]
    if isinstance(value, frozenset):
        return sorted(value)
    return value if value is None or isinstance(value, (str, int, bool)) else str(value)


def canonical_selector(selector: LabelSelector | None) -> LabelSelector | None:
    """``selector`` with its terms in one order (None for the empty selector, which matches
    everything just as None does), so that selectors that read the same are equal."""
    if selector is None or (not selector.match_labels and not selector.match_expressions):
        return None
    return LabelSelector(tuple(sorted(selector.match_labels)),
                         tuple(sorted(set(selector.match_expressions), key=lambda r: (r.key, r.operator, sorted(r.values)))))


def block_text(block: IPBlock) -> str:
    """``10.0.0.0/8 except 10.1.0.0/16``."""
    return str(block.cidr) + (" except " + ", ".join(map(str, block.excepts)) if block.excepts else "")


def _elements(key: SetKey, pod: Pod) -> tuple[Any, ...]:
    """The elements ``pod`` gives set ``key`` (given that it is in the key's scope)."""
    v6 = key.family == "ipv6"
    ips = tuple(ip for ip in pod.ips if (":" in ip) == v6)
    if key.scope is not None and key.scope.block is not None:
        ips = tuple(ip for ip in ips if key.scope.block.contains(ip))
    if key.kind == "addr":
        return ips
    assert key.port is not None and key.protocol is not None
    number = pod.resolve_port(key.port, key.protocol)
    return () if number is None else tuple((ip, key.protocol.lower(), number) for ip in ips)


@functools.lru_cache(maxsize=4096)
def _block_elements(key: SetKey) -> tuple[str, ...]:
    assert key.block is not None
    return tuple(str(n) for n in ipaddress.collapse_addresses(key.block.networks()))  # type: ignore[type-var]  # one family


@dataclass
class _Set:
    """A live set: its users and how many pods give each element."""

    users: int = 0
    counts: Counter[Any] = field(default_factory=Counter)


AnyChain = PolicyChain | PodChain | TierChain


@dataclass
class Changes:
    """What changed in the model since the last :meth:`NodeRenderer.take_changes`.

    ``sets_added``/``sets_removed``: whole sets (added ones with their elements);
    ``elements_added``/``elements_removed``: set name -> elements, for sets that exist before and
    after; ``chains``: chain name -> (before, after), each a PolicyChain, a PodChain, a TierChain or None
    (absent), only where they differ.
    """

    sets_added: list[AddressSet] = field(default_factory=list)
    sets_removed: list[str] = field(default_factory=list)
    elements_added: dict[str, list[Any]] = field(default_factory=dict)
    elements_removed: dict[str, list[Any]] = field(default_factory=dict)
    chains: dict[str, tuple[AnyChain | None, AnyChain | None]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.sets_added or self.sets_removed or self.elements_added or self.elements_removed or self.chains)


class NodeRenderer:
    """The rule model of ``node`` (None: every pod counts as local), updated object by object.

    Inputs are model objects (immutable; a changed object is a new object). Not thread-safe.
    """

    def __init__(self, node: str | None, config: Config = Config()) -> None:
        self.node, self.config = node, config
        self.namespaces: dict[str, Namespace] = {}
        self.pods: dict[str, Pod] = {}
        self.policies: dict[str, NetworkPolicy] = {}
        # pods that count (enforceable): namespace -> id of a labels object -> (labels, {key: pod}).
        # Pods of one workload share one labels object (translators.manifests shares equal label
        # sets), so a group is a workload's pods, tested against a selector once; a group holds
        # its labels object, so the id cannot be reused while the group exists.
        self._groups: dict[str, dict[int, tuple[Mapping[str, str], dict[str, Pod]]]] = {}
        self._known_namespaces: set[str] = set()
        self._family_pods: Counter[Family] = Counter()
        self.families: tuple[Family, ...] = ("ipv4",)
        self._local: dict[str, dict[str, Pod]] = {}  # namespace -> local pods that count
        self._policies_in: dict[str, set[str]] = {}
        self._local_targets: Counter[str] = Counter()  # policy key -> local pods it selects
        # shared sets, and the scopes that route pod and namespace changes to them
        self._sets: dict[SetKey, _Set] = {}
        self._scope_sets: dict[Scope, set[SetKey]] = {}
        self._scopes_in: dict[str, set[Scope]] = {}  # namespace -> watched scopes that hold its pods
        self._selector_scopes: dict[Scope, set[str]] = {}  # namespaceSelector scope -> namespaces it matches
        self._block_scopes: set[Scope] = set()
        # the model
        self._policy_chains: dict[tuple[str, str], tuple[PolicyChain, list[SetKey]]] = {}
        self._pod_chains: dict[str, PodChain] = {}
        self._pod_chains_stale = False
        # changes since take_changes: sets made, sets gone (with what they held then), elements
        self._born: set[SetKey] = set()
        self._dead: dict[SetKey, set[Any]] = {}
        self._added: dict[SetKey, set[Any]] = {}
        self._removed: dict[SetKey, set[Any]] = {}
        self._chains_before: dict[str, AnyChain | None] = {}
        # ClusterNetworkPolicies (translators/tierchains.py): a tier chain per (policy,
        # direction) exists while the policy selects a local pod; pod chains decide it
        self.cluster_policies: dict[str, ClusterNetworkPolicy] = {}
        self._tier_chains: dict[tuple[str, str], tuple[TierChain, list[SetKey]]] = {}
        self._subjects: dict[str, set[str]] = {}  # ClusterNetworkPolicy -> local pods its subject selects

    # ---- inputs --------------------------------------------------------------------------

    def load(self, cluster: Cluster) -> "NodeRenderer":
        """Take every object of ``cluster`` (namespaces, then pods, then policies); returns self.

        Into a renderer that has no policy yet, pods are only indexed: no set exists that they
        could change, so each costs a few dictionary updates. Into an empty renderer (a full
        render), the loaded model is where changes start: :meth:`take_changes` reports what
        changes after the load (a full replace carries the whole model anyway).
        """
        empty = not (self.namespaces or self.pods or self.policies or self.cluster_policies or self._known_namespaces)
        for name, ns in cluster.namespaces.items():
            self.set_namespace(name, ns)
        if self.policies or self.cluster_policies:
            for key, pod in cluster.pods.items():
                self.set_pod(key, pod)
        else:
            self._index_pods(cluster.pods)
        for key, policy in cluster.policies.items():
            self.set_policy(key, policy)
        for key, cluster_policy in cluster.cluster_policies.items():
            self.set_cluster_policy(key, cluster_policy)
        if empty:
            self._refresh_pod_chains()
            self._born, self._dead, self._added, self._removed, self._chains_before = set(), {}, {}, {}, {}
        return self

    def _index_pods(self, pods: Mapping[str, Pod]) -> None:
        """What :meth:`set_pod` does for new pods, when there are no sets and no policies."""
        self.pods.update(pods)
        v4 = v6 = 0
        groups: dict[int, tuple[Mapping[str, str], dict[str, Pod]]] = {}
        namespace = None
        for key, pod in pods.items():
            if not pod.enforceable:
                continue
            if pod.namespace != namespace:
                namespace = pod.namespace
                if namespace not in self._known_namespaces:
                    self.set_namespace(namespace, None)
                groups = self._groups.setdefault(namespace, {})
            group = groups.get(id(pod.labels))
            if group is None:
                group = groups[id(pod.labels)] = (pod.labels, {})
            group[1][key] = pod
            if len(pod.ips) == 1:
                if ":" in pod.ips[0]:
                    v6 += 1
                else:
                    v4 += 1
            else:
                v4 += any(":" not in ip for ip in pod.ips)
                v6 += any(":" in ip for ip in pod.ips)
            if self.node is None or pod.node == self.node:
                self._local.setdefault(namespace, {})[key] = pod
        self._family_pods.update({"ipv4": v4, "ipv6": v6})
        self._pod_chains_stale = True
        self.families = tuple(f for f in FAMILIES if self._family_pods[f] > 0) or ("ipv4",)

    def apply(self, kind: str, key: str, obj: Any) -> None:
        """One changed object of ``kind`` (``Namespace``, ``Pod``, ``NetworkPolicy``,
        ``ClusterNetworkPolicy``; None: deleted). Other kinds (``Node``) do not shape the rules
        and are ignored."""
        if kind == "Pod":
            self.set_pod(key, obj)
        elif kind == "Namespace":
            self.set_namespace(key, obj)
        elif kind == "NetworkPolicy":
            self.set_policy(key, obj)
        elif kind == "ClusterNetworkPolicy":
            self.set_cluster_policy(key, obj)

    def namespace_labels(self, name: str) -> Mapping[str, str]:
        """A namespace's labels; one without a Namespace object has only its name label."""
        ns = self.namespaces.get(name)
        return ns.labels if ns is not None else {NAMESPACE_NAME_LABEL: name}

    def set_namespace(self, name: str, namespace: Namespace | None) -> None:
        """A Namespace was added or changed (None: deleted)."""
        old_labels = self.namespace_labels(name)
        if namespace is None:
            self.namespaces.pop(name, None)
        else:
            self.namespaces[name] = namespace
        if name in self._known_namespaces and self.namespace_labels(name) == old_labels:
            return
        self._known_namespaces.add(name)
        labels = self.namespace_labels(name)
        if self.cluster_policies and self._local.get(name):  # a subject may start or stop selecting its pods
            for pod in self._local[name].values():
                self._update_subjects(pod.key, pod)
        for scope, matched in self._selector_scopes.items():
            assert scope.namespace_selector is not None
            now = scope.namespace_selector.matches(labels)
            if now == (name in matched):
                continue
            if now:
                matched.add(name)
                self._scopes_in.setdefault(name, set()).add(scope)
            else:
                matched.discard(name)
                self._scopes_in[name].discard(scope)
            for pod in self._pods_of(name, scope.pod_selector):
                self._move(scope, pod, joins=now)

    def set_pod(self, key: str, pod: Pod | None) -> None:
        """A Pod was added or changed (None: deleted)."""
        old = self.pods.get(key)
        if pod is None:
            self.pods.pop(key, None)
        else:
            self.pods[key] = pod
        before = old if old is not None and old.enforceable else None
        after = pod if pod is not None and pod.enforceable else None
        if before is None and after is None:
            return
        namespace = (after or before).namespace  # type: ignore[union-attr]
        if namespace not in self._known_namespaces:
            self.set_namespace(namespace, None)  # evaluate the namespaceSelectors for it once
        for p, step in ((before, -1), (after, 1)):
            if p is None:
                continue
            groups = self._groups.setdefault(namespace, {})
            if step > 0:
                groups.setdefault(id(p.labels), (p.labels, {}))[1][key] = p
            else:
                members = groups[id(p.labels)][1]
                del members[key]
                if not members:
                    del groups[id(p.labels)]
            for family in FAMILIES:
                if p.addresses(family):
                    self._family_pods[family] += step
        for scope in list(self._scopes_in.get(namespace, ())) + list(self._block_scopes):
            self._update_member(scope, before, after)
        self._update_local(key, before, after)
        if self.cluster_policies and any(p is not None and self._is_local(p) for p in (before, after)):
            self._update_subjects(key, after if after is not None and self._is_local(after) else None)
        families = tuple(f for f in FAMILIES if self._family_pods[f] > 0) or ("ipv4",)
        if families != self.families:
            self.families = families
            for policy_key in list(self.policies):
                self._render_policy(policy_key)
            self._drop_tier_chains(list(self._tier_chains))

    def set_policy(self, key: str, policy: NetworkPolicy | None) -> None:
        """A NetworkPolicy was added or changed (None: deleted)."""
        old = self.policies.pop(key, None)
        if old is not None:
            self._policies_in[old.namespace].discard(key)
        if policy is not None:
            self.policies[key] = policy
            self._policies_in.setdefault(policy.namespace, set()).add(key)
            self._local_targets[key] = sum(1 for p in self._local.get(policy.namespace, {}).values()
                                           if policy.pod_selector.matches(p.labels))
        else:
            self._local_targets.pop(key, None)
        self._render_policy(key)
        self._pod_chains_stale = True

    def set_cluster_policy(self, key: str, policy: ClusterNetworkPolicy | None) -> None:
        """A ClusterNetworkPolicy was added or changed (None: deleted). Its tier chains are
        rebuilt when the pod chains are next refreshed."""
        if policy is None:
            self.cluster_policies.pop(key, None)
            self._subjects.pop(key, None)
        else:
            self.cluster_policies[key] = policy
            self._subjects[key] = {p.key for pods in self._local.values() for p in pods.values()
                                   if policy.selects(self.namespace_labels(p.namespace), p.labels)}
        self._drop_tier_chains([k for k in self._tier_chains if k[0] == key])

    # ---- outputs -------------------------------------------------------------------------

    def model(self, ordered: bool = True) -> RuleModel:
        """The whole desired model, every tuple in a stable order (equal inputs, equal models);
        ``ordered=False`` leaves set elements unsorted (the kernel does not care; sorting 180,000
        elements takes a third of a second)."""
        self._refresh_pod_chains()
        sets = [self._address_set(key, ordered) for key in self._sets]
        return RuleModel(
            config=self.config,
            sets=tuple(sorted(sets, key=lambda s: s.name)),
            policy_chains=tuple(sorted((c for c, _ in self._policy_chains.values()), key=lambda c: c.name)),
            pod_chains=tuple(sorted(self._pod_chains.values(), key=lambda c: c.name)),
            tier_chains=tuple(sorted((c for c, _ in self._tier_chains.values()), key=lambda c: c.name)),
        )

    def counts(self) -> dict[str, int]:
        """Sizes of the model for metrics: ``sets``, ``elements`` (in every set), ``policy chains``
        and ``pod chains``."""
        self._refresh_pod_chains()
        elements = sum(len(_block_elements(k)) if k.kind == "interval" else len(live.counts) for k, live in self._sets.items())
        return {"sets": len(self._sets), "elements": elements, "policy chains": len(self._policy_chains),
                "pod chains": len(self._pod_chains)}

    def local_pods(self) -> int:
        """How many pods that count (running, with an address, not hostNetwork) run on the node."""
        return sum(len(pods) for pods in self._local.values())

    def take_changes(self) -> Changes:
        """Everything that changed in the model since the last call (or since the start, or
        since a :meth:`load` into an empty renderer)."""
        self._refresh_pod_chains()
        changes = Changes(sets_added=[self._address_set(key) for key in sorted(self._born, key=lambda k: k.name)],
                          sets_removed=sorted(key.name for key in self._dead))
        for key, elements in self._added.items():
            if elements and key not in self._born:  # a new set comes with all its elements
                changes.elements_added[key.name] = sorted(elements, key=_element_order)
        for key, elements in self._removed.items():
            if elements and key not in self._born:
                changes.elements_removed[key.name] = sorted(elements, key=_element_order)
        current = self._chains_now()
        for name, before in self._chains_before.items():
            after = current.get(name)
            if after != before:
                changes.chains[name] = (before, after)
        self._born, self._dead, self._added, self._removed, self._chains_before = set(), {}, {}, {}, {}
        return changes

    # ---- sets ----------------------------------------------------------------------------

    def _address_set(self, key: SetKey, ordered: bool = True) -> AddressSet:
        if key.kind == "interval":
            elements: tuple[Any, ...] = _block_elements(key)
        elif ordered and key.kind == "addr":  # addresses of one family: their bytes sort as _element_order does
            elements = tuple(sorted(self._sets[key].counts, key=_ADDRESS_BYTES[key.family]))
        elif ordered:
            elements = tuple(sorted(self._sets[key].counts, key=_element_order))
        else:
            elements = tuple(self._sets[key].counts)
        return AddressSet(key.name, key.family, key.kind, elements, comment(key.description))

    def _acquire(self, key: SetKey) -> None:
        live = self._sets.get(key)
        if live is None:
            live = self._sets[key] = _Set()
            if key.scope is not None:
                self._watch(key.scope, key)
            if key in self._dead:  # gone and back within one change window: report the difference
                held, now = self._dead.pop(key), set(live.counts)
                if now - held:
                    self._added[key] = now - held
                if held - now:
                    self._removed[key] = held - now
            else:
                self._born.add(key)
        live.users += 1

    def _release(self, key: SetKey) -> None:
        live = self._sets[key]
        live.users -= 1
        if live.users:
            return
        del self._sets[key]
        if key.scope is not None:
            users = self._scope_sets[key.scope]
            users.discard(key)
            if not users:
                self._unwatch(key.scope)
        added, removed = self._added.pop(key, set()), self._removed.pop(key, set())
        if key in self._born:
            self._born.discard(key)
        else:  # what the kernel holds: the elements now, less those added since, plus those removed
            self._dead[key] = (set(live.counts) - added) | removed

    def _watch(self, scope: Scope, key: SetKey) -> None:
        users = self._scope_sets.setdefault(scope, set())
        if not users:
            if scope.block is not None:
                self._block_scopes.add(scope)
            elif scope.namespace is not None:
                self._scopes_in.setdefault(scope.namespace, set()).add(scope)
            else:
                assert scope.namespace_selector is not None
                matched = {n for n in self._known_namespaces if scope.namespace_selector.matches(self.namespace_labels(n))}
                self._selector_scopes[scope] = matched
                for name in matched:
                    self._scopes_in.setdefault(name, set()).add(scope)
        users.add(key)
        counts = self._sets[key].counts
        if key.kind == "addr" and scope.block is None and not scope.local:  # the common case, without a call per pod
            v6 = key.family == "ipv6"
            counts.update([ip for members in self._scope_groups(scope) for pod in members.values() for ip in pod.ips
                           if (":" in ip) == v6])
        else:
            for pod in self._scope_pods(scope):
                counts.update(_elements(key, pod))

    def _unwatch(self, scope: Scope) -> None:
        del self._scope_sets[scope]
        if scope.block is not None:
            self._block_scopes.discard(scope)
        elif scope.namespace is not None:
            self._scopes_in[scope.namespace].discard(scope)
        else:
            for name in self._selector_scopes.pop(scope):
                self._scopes_in[name].discard(scope)

    def _in_scope(self, scope: Scope, pod: Pod) -> bool:
        """True when ``pod`` (of a namespace the scope covers) is in ``scope``."""
        if scope.local and not self._is_local(pod):
            return False
        return scope.pod_selector is None or scope.pod_selector.matches(pod.labels)

    def _pods_of(self, namespace: str, selector: LabelSelector | None) -> Iterator[Pod]:
        for labels, group in self._groups.get(namespace, {}).values():
            if selector is None or selector.matches(labels):
                yield from group.values()

    def _scope_groups(self, scope: Scope) -> list[dict[str, Pod]]:
        """The pod groups of the namespaces ``scope`` covers whose labels its podSelector
        matches (``local`` is not applied)."""
        if scope.block is not None:
            namespaces: Iterable[str] = list(self._groups)
        elif scope.namespace is not None:
            namespaces = (scope.namespace,)
        else:
            namespaces = self._selector_scopes[scope]
        selector, groups = scope.pod_selector, self._groups
        return [members for namespace in namespaces if namespace in groups for labels, members in groups[namespace].values()
                if selector is None or selector.matches(labels)]

    def _scope_pods(self, scope: Scope) -> Iterator[Pod]:
        for members in self._scope_groups(scope):
            for pod in members.values():
                if not scope.local or self._is_local(pod):
                    yield pod

    def _update_member(self, scope: Scope, old: Pod | None, new: Pod | None) -> None:
        """Move the elements of one pod change through every set of ``scope``."""
        was = old is not None and self._in_scope(scope, old)
        now = new is not None and self._in_scope(scope, new)
        if not was and not now:
            return
        for key in self._scope_sets.get(scope, ()):
            before = _elements(key, old) if was else ()  # type: ignore[arg-type]
            after = _elements(key, new) if now else ()  # type: ignore[arg-type]
            if before != after:
                self._count(key, before, -1)
                self._count(key, after, 1)

    def _move(self, scope: Scope, pod: Pod, joins: bool) -> None:
        """A whole pod enters (or leaves) ``scope`` because its namespace's labels changed."""
        if self._in_scope(scope, pod):
            for key in self._scope_sets.get(scope, ()):
                self._count(key, _elements(key, pod), 1 if joins else -1)

    def _count(self, key: SetKey, elements: Iterable[Any], step: int) -> None:
        """Count ``elements`` in (step 1) or out (-1) of set ``key``; an element that appears or
        disappears is recorded as a change (an addition and a removal cancel out)."""
        counts = self._sets[key].counts
        for element in elements:
            count = counts[element] + step
            if count:
                counts[element] = count
            else:
                del counts[element]
            if count == (1 if step > 0 else 0):
                gained, lost = (self._added, self._removed) if step > 0 else (self._removed, self._added)
                if element in lost.get(key, ()):
                    lost[key].discard(element)
                else:
                    gained.setdefault(key, set()).add(element)

    # ---- chains --------------------------------------------------------------------------

    def _is_local(self, pod: Pod) -> bool:
        return self.node is None or pod.node == self.node

    def _update_local(self, key: str, old: Pod | None, new: Pod | None) -> None:
        """Track the local pods; a policy chain comes and goes with the policy's first and last
        local target."""
        was = old if old is not None and self._is_local(old) else None
        now = new if new is not None and self._is_local(new) else None
        if was is None and now is None:
            return
        namespace = (now or was).namespace  # type: ignore[union-attr]
        local = self._local.setdefault(namespace, {})
        if now is not None:
            local[key] = now
        else:
            local.pop(key, None)
        self._pod_chains_stale = True
        for policy_key in list(self._policies_in.get(namespace, ())):
            selector = self.policies[policy_key].pod_selector
            step = int(now is not None and selector.matches(now.labels)) - int(was is not None and selector.matches(was.labels))
            if step:
                before = self._local_targets[policy_key]
                self._local_targets[policy_key] = before + step
                if (before == 0) != (before + step == 0):
                    self._render_policy(policy_key)

    def _render_policy(self, key: str) -> None:
        """(Re)build the chains of policy ``key``: they exist while it selects a local pod."""
        policy = self.policies.get(key)
        for direction in DIRECTIONS:
            old = self._policy_chains.pop((key, direction), None)
            chain = None
            if policy is not None and direction in policy.policy_types and self._local_targets[key] > 0:
                keys: list[SetKey] = []
                chain = _PolicyChainBuilder(policy, direction, self.families).build(keys)
                for set_key in keys:  # acquired before the old ones are released: shared sets stay
                    self._acquire(set_key)
                self._policy_chains[(key, direction)] = (chain, keys)
            if old is not None:
                for set_key in old[1]:
                    self._release(set_key)
            name = old[0].name if old is not None else chain.name if chain is not None else None
            if name is not None and name not in self._chains_before:
                self._chains_before[name] = old[0] if old is not None else None

    def _chains_now(self) -> dict[str, AnyChain]:
        now: dict[str, AnyChain] = {c.name: c for c, _ in self._policy_chains.values()}
        now.update((c.name, c) for c, _ in self._tier_chains.values())
        now.update(self._pod_chains)
        return now

    def _refresh_pod_chains(self) -> None:
        """Pod chains of the local pods: which policy chains each direction jumps to."""
        if not self._pod_chains_stale:
            return
        self._pod_chains_stale = False
        chains: dict[str, PodChain] = {}
        dispatched: set[str] = set()  # an address reaches one pod chain (Running pods first)
        local = [p for pods in self._local.values() for p in pods.values()]
        tiers = self._refresh_tier_chains()
        tier_policy = {c.name: c.policy for c, _ in self._tier_chains.values()}
        for pod in sorted(local, key=lambda p: (p.phase != "Running", p.key)):
            ips = tuple(ip for ip in pod.ips if ip not in dispatched)
            dispatched.update(pod.ips)
            selecting: dict[str, list[str]] = {}
            for policy_key in self._policies_in.get(pod.namespace, ()):
                if self.policies[policy_key].pod_selector.matches(pod.labels):
                    for direction in DIRECTIONS:
                        entry = self._policy_chains.get((policy_key, direction))
                        if entry is not None:
                            selecting.setdefault(direction, []).append(entry[0].name)
            pod_tiers = tiers.get(pod.key, {})
            if not (selecting or pod_tiers) or not ips:
                continue  # not isolated in either direction: nothing to enforce
            name = hashed_name("KUBE-POD-FW-", pod.namespace, pod.name)
            ingress, egress = selecting.get("ingress"), selecting.get("egress")
            chains[name] = PodChain(name=name, pod=pod.key, ips=tuple(sorted(set(ips), key=address_order)),
                                    ingress=tuple(sorted(ingress)) if ingress is not None else None,
                                    egress=tuple(sorted(egress)) if egress is not None else None,
                                    comment=comment(f"{pod.key} pod"),
                                    admin_ingress=tuple(pod_tiers.get("admin_ingress", ())),
                                    admin_egress=tuple(pod_tiers.get("admin_egress", ())),
                                    # the Baseline tier only where no NetworkPolicy isolates the pod
                                    baseline_ingress=tuple(pod_tiers.get("baseline_ingress", ())) if ingress is None else (),
                                    baseline_egress=tuple(pod_tiers.get("baseline_egress", ())) if egress is None else (),
                                    tier_policies=tuple(sorted({(n, tier_policy[n]) for v in pod_tiers.values() for n in v})))
        if self._tier_chains:  # tier chains that no pod chain jumps to go
            jumped = {n for c in chains.values() for n in (*c.admin_ingress, *c.admin_egress, *c.baseline_ingress, *c.baseline_egress)}
            self._drop_tier_chains([k for k, (c, _) in self._tier_chains.items() if c.name not in jumped], refresh=False)
        for name in self._pod_chains.keys() | chains.keys():
            if self._pod_chains.get(name) != chains.get(name) and name not in self._chains_before:
                self._chains_before[name] = self._pod_chains.get(name)
        self._pod_chains = chains

    # ---- ClusterNetworkPolicy tier chains -------------------------------------------------

    def _drop_tier_chains(self, keys: list[tuple[str, str]], refresh: bool = True) -> None:
        """Remove these tier chains; ``refresh``: the next pod chain refresh builds what is
        still wanted."""
        for key in keys:
            chain, set_keys = self._tier_chains.pop(key)
            for set_key in set_keys:
                self._release(set_key)
            self._chains_before.setdefault(chain.name, chain)
        self._pod_chains_stale = self._pod_chains_stale or refresh

    def _update_subjects(self, key: str, pod: Pod | None) -> None:
        """Local pod ``key`` changed (None: gone or not local): which subjects select it."""
        labels = self.namespace_labels(pod.namespace) if pod is not None else {}
        for name, policy in self.cluster_policies.items():
            selected = self._subjects[name]
            now = pod is not None and policy.selects(labels, pod.labels)
            if now and key not in selected:
                selected.add(key)
                self._pod_chains_stale = True
            elif not now and key in selected:
                selected.discard(key)
                self._pod_chains_stale = True

    def _refresh_tier_chains(self) -> dict[str, dict[str, list[str]]]:
        """Build the tier chains of the ClusterNetworkPolicies that select a local pod (and drop
        the others); returns, for each local pod they select, the pod chain fields
        (``admin_ingress``, ...) with the chain names in evaluation order (``(priority, name)``)."""
        from .tierchains import build_tier_chain  # it builds on this module's set keys

        tiers: dict[str, dict[str, list[str]]] = {}
        wanted: set[tuple[str, str]] = set()
        for policy in sorted(self.cluster_policies.values(), key=lambda p: (p.priority, p.name)):
            selected = self._subjects[policy.name]
            for direction in DIRECTIONS:
                if not selected or not policy.rules(direction):
                    continue
                key = (policy.name, direction)
                wanted.add(key)
                if key not in self._tier_chains:
                    set_keys: list[SetKey] = []
                    chain = build_tier_chain(policy, direction, self.families, set_keys)
                    for set_key in set_keys:
                        self._acquire(set_key)
                    self._tier_chains[key] = (chain, set_keys)
                    self._chains_before.setdefault(chain.name, None)
                name = self._tier_chains[key][0].name
                field = f"{policy.tier.lower()}_{direction}"
                for pod_key in selected:
                    tiers.setdefault(pod_key, {}).setdefault(field, []).append(name)
        self._drop_tier_chains([key for key in self._tier_chains if key not in wanted], refresh=False)
        return tiers


class _PolicyChainBuilder:
    """The chain of one (policy, direction): one :class:`AllowRule` per allowed (peer, port);
    peers become shared set keys (NetworkPolicyPeer: selectors in one peer are AND'ed, no
    namespaceSelector means the policy's namespace, peers of a rule are OR'ed)."""

    def __init__(self, policy: NetworkPolicy, direction: Direction, families: tuple[Family, ...]) -> None:
        self.policy, self.direction, self.families = policy, direction, families
        self.keys: list[SetKey] = []

    def _use(self, key: SetKey) -> str:
        self.keys.append(key)
        return key.name

    def _scope(self, peer: Peer) -> Scope:
        pods = canonical_selector(peer.pod_selector)
        if peer.namespace_selector is None:
            return Scope(namespace=self.policy.namespace, pod_selector=pods)
        return Scope(namespace_selector=canonical_selector(peer.namespace_selector) or ALL_NAMESPACES, pod_selector=pods)

    def build(self, keys: list[SetKey]) -> PolicyChain:
        """The chain; the set keys it uses are appended to ``keys`` (one per use)."""
        self.keys = keys
        rules: list[AllowRule] = []
        for i, rule in enumerate(self.policy.rules(self.direction)):
            rules.extend(self._rule(i, rule))
        name = hashed_name("KUBE-NWPLCY-", self.policy.namespace, self.policy.name, self.direction)
        return PolicyChain(name, self.policy.key, self.direction, tuple(rules), comment(f"{self.policy.key} {self.direction}"))

    def _peer_options(self, rule: PolicyRule) -> list[tuple[Family | None, str | None]]:
        """(family, peer set) alternatives of one rule: any peer, or one set per peer and family."""
        if not rule.peers:
            return [(None, None)]
        options: list[tuple[Family | None, str | None]] = []
        for peer in rule.peers:
            if peer.ip_block is None:
                scope = self._scope(peer)
                options.extend((f, self._use(SetKey("addr", f, scope))) for f in self.families)
            else:
                family = family_of(str(peer.ip_block.cidr))
                options.append((family, self._use(SetKey("interval", family, block=peer.ip_block))))
        return options

    def _rule(self, i: int, rule: PolicyRule) -> list[AllowRule]:
        text = comment(f"{self.policy.key} {self.direction} rule {i}")
        egress_named_only = self.direction == "egress" and rule.ports and all(isinstance(p.port, str) for p in rule.ports)
        # The peer sets, unless only egress named ports use this rule's peers (their own sets
        # hold the peers' addresses with the port): a set exists only while a rule uses it.
        peer_options = [] if egress_named_only else self._peer_options(rule)
        if not rule.ports:
            return [AllowRule(family, peer_set, None, None, text) for family, peer_set in peer_options]
        allows: list[AllowRule] = []
        for port in rule.ports:
            if not isinstance(port.port, str):
                allows.extend(AllowRule(family, peer_set, _port_match(port), None, text) for family, peer_set in peer_options)
            elif self.direction == "ingress":
                # Named ports of an ingress rule resolve on the selected (destination) pods.
                targets = Scope(namespace=self.policy.namespace, pod_selector=canonical_selector(self.policy.pod_selector), local=True)
                for family, peer_set in peer_options:
                    for fam in (self.families if family is None else (family,)):
                        named = self._use(SetKey("named_port", fam, targets, port=port.port, protocol=port.protocol))
                        allows.append(AllowRule(fam, peer_set, None, named, text))
            else:
                # Named ports of an egress rule resolve on the peer pods: the set holds the peers'
                # addresses with their port, so it is the peer match as well.
                for scope, families in self._egress_named_scopes(rule):
                    for fam in families:
                        named = self._use(SetKey("named_port", fam, scope, port=port.port, protocol=port.protocol))
                        allows.append(AllowRule(fam, None, None, named, text))
        return allows

    def _egress_named_scopes(self, rule: PolicyRule) -> list[tuple[Scope, tuple[Family, ...]]]:
        if not rule.peers:
            return [(Scope(namespace_selector=ALL_NAMESPACES), self.families)]
        scopes = []
        for peer in rule.peers:
            if peer.ip_block is None:
                scopes.append((self._scope(peer), self.families))
            else:
                family = family_of(str(peer.ip_block.cidr))
                scopes.append((Scope(namespace_selector=ALL_NAMESPACES, block=peer.ip_block), (family,)))
        return scopes


def _port_match(port: PolicyPort) -> PortMatch:
    if port.port is None:
        return PortMatch(port.protocol)
    assert isinstance(port.port, int)
    return PortMatch(port.protocol, port.port, port.end_port or port.port)


def _packed(ip: str) -> bytes:
    """An address as its bytes: IPv4 (4 bytes) sorts before IPv6 (16), each in numeric order
    when compared after the length."""
    return socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip)


_ADDRESS_BYTES = {"ipv4": functools.partial(socket.inet_pton, socket.AF_INET), "ipv6": functools.partial(socket.inet_pton, socket.AF_INET6)}


def _element_order(element: Any) -> tuple[Any, ...]:
    """Sort key of a set element: an address, a network, or an ``(address, protocol, port)``."""
    if isinstance(element, tuple):
        packed = _packed(element[0])
        return len(packed), packed, element[1], element[2]
    address, _, length = element.partition("/")
    packed = _packed(address)
    return len(packed), packed, int(length or 0)


def build_rule_model(cluster: Cluster, node: str | None, config: Config = Config()) -> RuleModel:
    """Render the desired ruleset of ``node`` (None: every pod counts as local) from scratch.

    Returns a :class:`RuleModel` with every tuple in a stable order, so equal clusters give equal
    models whatever the input order.
    """
    return NodeRenderer(node, config).load(cluster).model()
