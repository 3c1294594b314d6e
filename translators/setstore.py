"""The shared selector sets of one node's rule model: their keys, reference counts, elements and
change journal.

Peer sets are shared **selector sets** (the pattern of Calico's selector IP sets): a set is named
after what it selects, not after the policy rule that uses it, so every rule that selects the
same thing uses one set. Its key (:class:`SetKey`) is a :class:`Scope` of pods (one namespace, or
the namespaces a namespaceSelector matches; a podSelector; optionally only this node's pods, or
only addresses inside an ipBlock), an ipBlock with its excepts, or a label selector over Nodes
(a ClusterNetworkPolicy ``nodes`` peer: the selected Nodes' InternalIP and ExternalIP
addresses), plus the family and, for named ports, the port name and protocol. A rule of several
pod-selector peers has one **union set** per family instead of a set per peer (its key holds
every scope: kube-router's ipset per rule), and a rule of several ipBlocks of a family one union
interval set (each block minus its own excepts, the union merged): the key is registered under
each of its scopes, and it counts, for each address, how many of its scopes give it, so a pod
change still costs O(change). A set appears with its first user and goes with its last
(reference counts: :meth:`SelectorSets.acquire`, :meth:`SelectorSets.release`). Each set keeps
how many pods give each element, so a pod change adds or deletes only the elements that change,
in only the sets whose scope holds the pod; a namespace label change moves only the pods of the
namespaceSelector scopes that start or stop matching it; a Node change (added, gone,
relabelled, readdressed) moves only that Node's addresses, in only the node sets whose selector
matched it before or matches it now.
"""

from __future__ import annotations

import functools
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping

import orjson

from .model import Family, IPBlock, Node, Pod, Protocol, span_networks
from .objectcost import block_networks
from .rules import AddressSet, Changes, UnionPeer, UnionSet, comment, hashed_name
from .selectors import LabelSelector, Labels, Requirement, selector_text

SetKind = Literal["addr", "interval", "named_port", "domain", "nodes"]
Owner = tuple[str, str]  # what uses a set: a policy as (kind, key)


@dataclass(frozen=True)
class Scope:
    """Which pods a set draws from: those of ``namespace`` (or of every namespace that
    ``namespace_selector`` matches) whose labels match ``pod_selector`` (None: every pod), and
    with ``local`` only those on the rendered node, with ``block`` only their addresses inside
    that ipBlock (an egress named port towards an ipBlock peer). Selectors are canonical
    (:func:`~nftpolicy.translators.selectors.canonical_selector`), so equal scopes are equal values."""

    namespace: str | None = None
    namespace_selector: LabelSelector | None = None
    pod_selector: LabelSelector | None = None
    local: bool = False
    block: IPBlock | None = None

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.namespace, self.namespace_selector, self.pod_selector, self.local, self.block))

    def __hash__(self) -> int:  # computed once: scopes key the dictionaries every change looks up
        return self._hash

    @functools.cached_property
    def identity(self) -> bytes:
        """The scope as canonical JSON, what the names of the sets that draw from it hash
        (computed once: a union set's name and order hash a thousand of them)."""
        return orjson.dumps(_fields(self))

    def text(self) -> str:
        """What the scope selects, in words: ``pods in x: app=b``,
        ``pods in namespaces team=blue: all``, ``pods in namespaces all inside 10.0.0.0/8``."""
        where = f"in {self.namespace}" if self.namespace is not None else f"in namespaces {selector_text(self.namespace_selector)}"
        if self.block is not None:
            return f"pods {where} inside {block_text(self.block)}"
        return f"{'local pods' if self.local else 'pods'} {where}: {selector_text(self.pod_selector)}"


@dataclass(frozen=True)
class SetKey:
    """The identity of a shared set: pod addresses of a scope (``addr``), or of the union of
    ``scopes`` (a rule's several pod-selector peers, canonical order: :func:`union_key`), the
    networks of an ipBlock (``interval``), or of the union of ``blocks`` (a rule's several
    ipBlocks of one family, each minus its own excepts), ``address . protocol . port`` of a
    scope's pods that have the named container port (``named_port``), the addresses DNS answers gave for a domainNames
    peer's ``names`` (``domain``: the agent adds them with a timeout; the translator gives none),
    or the peer addresses of the Nodes that the canonical label selector ``nodes`` matches
    (``nodes``: :data:`~nftpolicy.translators.selectors.ALL` for every Node; printed as an
    address set)."""

    kind: SetKind
    family: Family
    scope: Scope | None = None
    block: IPBlock | None = None
    port: str | None = None
    protocol: Protocol | None = None
    names: tuple[str, ...] = ()
    nodes: LabelSelector | None = None
    scopes: tuple[Scope, ...] = ()
    blocks: tuple[IPBlock, ...] = ()

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.kind, self.family, self.scope, self.block, self.port, self.protocol, self.names, self.nodes, self.scopes,
                     self.blocks))

    def __hash__(self) -> int:  # computed once: set keys key the dictionaries every element count looks up
        return self._hash

    @functools.cached_property
    def name(self) -> str:
        """``KUBE-PODS-``, ``KUBE-NET-``, ``KUBE-PORT-``, ``KUBE-DNS-`` or ``KUBE-NODES-`` + the
        hash of the key's fields (with canonical selectors: equal keys, equal names; different
        keys, different names). The names fit ipset's 31 characters with the iptables variant's
        ``TMP-`` prefix."""
        prefix = {"addr": "KUBE-PODS-", "interval": "KUBE-NET-", "named_port": "KUBE-PORT-", "domain": "KUBE-DNS-",
                  "nodes": "KUBE-NODES-"}[self.kind]
        return hashed_name(prefix, orjson.dumps(_identity(self)).decode())

    @functools.cached_property
    def parts(self) -> tuple["SetKey", ...]:
        """A union set's peers, each as the key of its own set (what it selects and gives the
        union); empty for any other set."""
        return (tuple(SetKey("addr", self.family, scope) for scope in self.scopes)
                + tuple(SetKey("interval", self.family, block=block) for block in self.blocks))

    @functools.cached_property
    def description(self) -> str:
        """What the set holds, in words (its comment, and the identity its name hashes)."""
        if self.parts:
            return f"{len(self.parts)} peers: " + "; ".join(part.description for part in self.parts)
        if self.kind == "interval":
            assert self.block is not None
            return f"ipBlock {block_text(self.block)}"
        if self.kind == "domain":
            return "DNS answers for " + ", ".join(self.names)
        if self.kind == "nodes":
            return f"nodes {selector_text(self.nodes)}"
        assert self.scope is not None
        if self.kind == "named_port":
            return f"port {self.port}/{self.protocol} of {self.scope.text()}"
        return self.scope.text()


def _identity(value: Any) -> Any:
    """A set key as plain JSON data, fields by name (what its name hashes); a key's empty
    ``names``, ``scopes`` and ``blocks`` and unset ``nodes`` are left out, so the sets that have
    none keep the names they had before those fields existed."""
    if isinstance(value, Scope):
        return orjson.Fragment(value.identity)
    if isinstance(value, (SetKey, IPBlock, LabelSelector, Requirement)):
        return _fields(value)
    if isinstance(value, (tuple, list)):
        return [_identity(v) for v in value]
    if isinstance(value, frozenset):
        return sorted(value)
    return value if value is None or isinstance(value, (str, int, bool)) else str(value)


def _fields(value: SetKey | Scope | IPBlock | LabelSelector | Requirement) -> dict[str, Any]:
    """:func:`_identity` of a dataclass: its fields by name."""
    return {f: _identity(getattr(value, f)) for f in value.__dataclass_fields__
            if not (f in ("names", "scopes", "blocks") and not getattr(value, f)) and not (f == "nodes" and getattr(value, f) is None)}


def union_key(family: Family, members: Iterable[Scope | IPBlock]) -> SetKey:
    """The key of the union set of a rule's several pod-selector peers (``members`` all
    :class:`Scope` values: an ``addr`` set) or several ipBlocks of ``family`` (all
    :class:`IPBlock` values: an ``interval`` set), in a canonical order (duplicates once), so
    the same peers in any order name one set. The caller gives at least two distinct members
    (one peer keeps its own shared set)."""
    ordered = sorted(set(members), key=lambda m: orjson.dumps(_identity(m)))
    scopes = tuple(m for m in ordered if isinstance(m, Scope))
    blocks = tuple(m for m in ordered if isinstance(m, IPBlock))
    assert len(ordered) > 1 and not (scopes and blocks)
    return SetKey("addr", family, scopes=scopes) if scopes else SetKey("interval", family, blocks=blocks)


def block_text(block: IPBlock) -> str:
    """``10.0.0.0/8 except 10.1.0.0/16``."""
    return str(block.cidr) + (" except " + ", ".join(map(str, block.excepts)) if block.excepts else "")


def _scopes(key: SetKey) -> tuple[Scope, ...]:
    """The scopes set ``key`` draws from: its own, a union's, or none."""
    return key.scopes or ((key.scope,) if key.scope is not None else ())


def _blocks(key: SetKey) -> tuple[IPBlock, ...]:
    """The ipBlocks interval set ``key`` holds: its own, a union's, or none."""
    return key.blocks or ((key.block,) if key.block is not None else ())


def _node_elements(key: SetKey, node: Node) -> tuple[str, ...]:
    """The addresses ``node`` gives node set ``key`` (given that its selector matches it): its
    peer addresses of the key's family."""
    v6 = key.family == "ipv6"
    return tuple(ip for ip in node.peer_addresses if (":" in ip) == v6)


def _elements(key: SetKey, pod: Pod) -> tuple[Any, ...]:
    """The elements ``pod`` gives set ``key`` (given that it is in the key's scope, or in one of
    a union's scopes: a union's scopes have no ``block``)."""
    v6 = key.family == "ipv6"
    ips = tuple(ip for ip in pod.ips if (":" in ip) == v6)
    if key.scope is not None and key.scope.block is not None:
        ips = tuple(ip for ip in ips if key.scope.block.contains(ip))
    if key.kind == "addr":
        return ips
    assert key.port is not None and key.protocol is not None
    number = pod.resolve_port(key.port, key.protocol)
    return () if number is None else tuple((ip, key.protocol.lower(), number) for ip in ips)


def _block_elements(key: SetKey) -> tuple[str, ...]:
    """The networks of interval set ``key``: its ipBlock minus its excepts (a union: each of its
    blocks minus its own excepts, so one block's except never removes another's addresses),
    collapsed."""
    blocks = _blocks(key)
    spans = sorted(span for block in blocks for span in block.spans())
    return tuple(map(str, span_networks(spans, blocks[0].cidr.version)))


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


def _sorted_elements(key: SetKey, elements: Iterable[Any]) -> list[Any]:
    """Elements of set ``key`` in :func:`_element_order` (pod or node addresses of one family:
    by their bytes, which sort the same, without a Python call per element)."""
    return sorted(elements, key=_ADDRESS_BYTES[key.family] if key.kind in ("addr", "nodes") else _element_order)


@dataclass
class _Set:
    """A live set: its users (each owner's uses: :meth:`SelectorSets.acquire`; none left: it
    goes) and how many pods give each element (an interval set: its networks, computed once when it
    is made; a cache shared by every set thrashed beyond its size, so that 5,000 ipBlocks cost
    each of them again at every count)."""

    counts: Counter[Any] = field(default_factory=Counter)
    networks: tuple[str, ...] = ()
    owners: Counter[Owner] = field(default_factory=Counter)


class SelectorSets:
    """The live sets of one node and the indexes they draw from: pods that count
    (enforceable) by namespace and :class:`~nftpolicy.translators.selectors.Labels` (a group is
    a workload's pods, tested against a selector once), and the cluster's Nodes by name (for
    the node sets). ``is_local`` tells the node's own pods;
    ``namespace_labels`` a namespace's labels. Changes to sets and elements are journalled until
    :meth:`take_changes`. Not thread-safe."""

    def __init__(self, is_local: Callable[[Pod], bool], namespace_labels: Callable[[str], Mapping[str, str]]) -> None:
        self.is_local, self.namespace_labels = is_local, namespace_labels
        self.groups: dict[str, dict[Labels, dict[str, Pod]]] = {}  # namespace -> labels -> {key: pod}
        # (namespace, labels) -> [IPv4, IPv6] addresses of that group's pods, counted when first
        # asked (:meth:`size`) and forgotten when the group changes
        self._group_addresses: dict[tuple[str, Labels], list[int]] = {}
        self._all_addresses: list[int] | None = None  # [IPv4, IPv6] of every pod that counts (None: not counted yet)
        self._node_addresses: list[int] | None = None  # [IPv4, IPv6] peer addresses of every Node (None: not counted yet)
        self.known_namespaces: set[str] = set()
        self._sets: dict[SetKey, _Set] = {}
        self._scope_sets: dict[Scope, set[SetKey]] = {}
        self._scopes_in: dict[str, set[Scope]] = {}  # namespace -> watched scopes that hold its pods
        # each namespaceSelector of a watched scope, tested once per namespace however many scopes share it:
        # the scopes that use it, and the namespaces it matches
        self._selector_scopes: dict[LabelSelector, set[Scope]] = {}
        self._selector_matches: dict[LabelSelector, set[str]] = {}
        self._block_scopes: set[Scope] = set()
        self.nodes: dict[str, Node] = {}
        self._node_sets: dict[LabelSelector, set[SetKey]] = {}  # node selector -> its live node sets
        # changes since take_changes: sets made, sets gone (with what they held then), elements
        self._born: set[SetKey] = set()
        self._dead: dict[SetKey, set[Any]] = {}
        self._added: dict[SetKey, set[Any]] = {}
        self._removed: dict[SetKey, set[Any]] = {}
        self._grown: set[SetKey] = set()  # live sets that gained an element since take_grown
        self.gained = 0  # elements those sets gained since take_grown

    # ---- pods and namespaces -------------------------------------------------------------

    def namespace_changed(self, name: str) -> None:
        """Namespace ``name`` is new or its labels changed: the namespaceSelector scopes that
        start or stop matching it take in or give up its pods. Each distinct namespaceSelector
        is tested once; only the scopes whose match changed touch their sets."""
        self.known_namespaces.add(name)
        labels = self.namespace_labels(name)
        for selector, scopes in self._selector_scopes.items():
            matched = self._selector_matches[selector]
            now = selector.matches(labels)
            if now == (name in matched):
                continue
            inside = self._scopes_in.setdefault(name, set())
            if now:
                matched.add(name)
                inside.update(scopes)
            else:
                matched.discard(name)
                inside.difference_update(scopes)
            for scope in scopes:
                for key in self._scope_sets[scope]:
                    self._count(key, self._scope_elements(key, scope, self._scope_groups(scope, (name,))), 1 if now else -1)

    def pod_changed(self, key: str, before: Pod | None, after: Pod | None) -> None:
        """Pod ``key`` that counts changed from ``before`` to ``after`` (None: absent or not
        counting): the index and the elements of every set whose scope holds it."""
        namespace = (after or before).namespace  # type: ignore[union-attr]
        groups = self.groups.setdefault(namespace, {})
        if before is not None:
            members = groups[before.labels]
            del members[key]
            if not members:
                del groups[before.labels]
            self._group_addresses.pop((namespace, before.labels), None)
        if after is not None:
            groups.setdefault(after.labels, {})[key] = after
            self._group_addresses.pop((namespace, after.labels), None)
        if self._all_addresses is not None:
            for pod, step in ((before, -1), (after, 1)):
                for ip in pod.ips if pod is not None else ():
                    self._all_addresses[":" in ip] += step
        for scope in list(self._scopes_in.get(namespace, ())) + list(self._block_scopes):
            was = before is not None and self._in_scope(scope, before)
            now = after is not None and self._in_scope(scope, after)
            if not was and not now:
                continue
            for set_key in self._scope_sets.get(scope, ()):
                old = _elements(set_key, before) if was else ()  # type: ignore[arg-type]
                new = _elements(set_key, after) if now else ()  # type: ignore[arg-type]
                if old != new:
                    self._count(set_key, old, -1)
                    self._count(set_key, new, 1)

    def node_changed(self, name: str, node: Node | None) -> None:
        """Node ``name`` was added or changed (None: deleted): its addresses leave the node sets
        whose selector matched it and join those whose selector matches it now (an address it
        keeps in a set it stays in is no change)."""
        before = self.nodes.pop(name, None)
        self._node_addresses = None
        if node is not None:
            self.nodes[name] = node
        for selector, keys in self._node_sets.items():
            was = before is not None and selector.matches(before.labels)
            now = node is not None and selector.matches(node.labels)
            if not was and not now:
                continue
            for key in keys:
                old = _node_elements(key, before) if was else ()  # type: ignore[arg-type]
                new = _node_elements(key, node) if now else ()  # type: ignore[arg-type]
                if old != new:
                    self._count(key, old, -1)
                    self._count(key, new, 1)

    def index(self, pods: Iterable[tuple[str, Pod]]) -> None:
        """Add new pods that count (``(key, pod)``, of known namespaces) while no set exists:
        :meth:`pod_changed` without the sets, which would have no element to count."""
        assert not self._sets
        groups: dict[Labels, dict[str, Pod]] = {}
        namespace = None
        self._group_addresses.clear()
        self._all_addresses = None
        for key, pod in pods:
            if pod.namespace != namespace:
                namespace = pod.namespace
                groups = self.groups.setdefault(namespace, {})
            group = groups.get(pod.labels)
            if group is None:
                group = groups[pod.labels] = {}
            group[key] = pod

    # ---- sets ----------------------------------------------------------------------------

    def acquire(self, key: SetKey, owner: Owner) -> None:
        """One more user of set ``key`` (the first makes it, with the elements of its scope);
        ``owner``, the policy whose chain uses it, is counted among its :meth:`owners`."""
        live = self._sets.get(key)
        if live is None:
            live = self._sets[key] = _Set(networks=_block_elements(key) if key.kind == "interval" else ())
            for scope in _scopes(key):
                self._watch(scope, key)
            if key.nodes is not None:
                self._watch_nodes(key.nodes, key)
            if key in self._dead:  # gone and back within one change window: report the difference
                held, now = self._dead.pop(key), set(live.counts)
                if now - held:
                    self._added[key] = now - held
                if held - now:
                    self._removed[key] = held - now
            else:
                self._born.add(key)
        live.owners[owner] += 1

    def release(self, key: SetKey, owner: Owner) -> None:
        """One user fewer of set ``key`` (the last takes it away); ``owner`` as it was acquired."""
        live = self._sets[key]
        live.owners[owner] -= 1
        if not live.owners[owner]:
            del live.owners[owner]
        if live.owners:
            return
        del self._sets[key]
        self._grown.discard(key)
        for scope in _scopes(key):
            users = self._scope_sets[scope]
            users.discard(key)
            if not users:
                self._unwatch(scope)
        if key.nodes is not None:
            users = self._node_sets[key.nodes]
            users.discard(key)
            if not users:
                del self._node_sets[key.nodes]
        added, removed = self._added.pop(key, set()), self._removed.pop(key, set())
        if key in self._born:
            self._born.discard(key)
        else:  # what the kernel holds: the elements now, less those added since, plus those removed
            self._dead[key] = (set(live.counts) - added) | removed

    def address_sets(self, ordered: bool = True) -> list[AddressSet]:
        """Every live set with its elements (``ordered=False``: elements unsorted)."""
        return [self._address_set(key, ordered) for key in self._sets]

    def unions(self) -> list[UnionSet]:
        """The peers of every live union set, each with the elements it gives (computed here,
        from the indexes: the counts hold only the union)."""
        return [UnionSet(key.name, tuple(UnionPeer(comment(part.description), self._given(part)) for part in key.parts))
                for key in self._sets if key.parts]

    def _given(self, part: SetKey) -> tuple[str, ...]:
        """What one peer of a union set (``part``: the key its own set would have) gives it."""
        if part.scope is None:
            return _block_elements(part)
        return tuple(_sorted_elements(part, set(self._scope_elements(part, part.scope, self._scope_groups(part.scope)))))

    def counts(self) -> tuple[int, int]:
        """How many sets live and how many elements they hold."""
        return len(self._sets), sum(len(live.networks) if k.kind == "interval" else len(live.counts)
                                    for k, live in self._sets.items())

    def owners(self, key: SetKey) -> Iterable[Owner]:
        """The owners that use live set ``key`` (as :meth:`acquire` named them)."""
        return self._sets[key].owners.keys()

    def take_grown(self) -> set[SetKey]:
        """The live sets that gained an element since the last call (:attr:`gained` starts
        again from 0)."""
        grown, self._grown, self.gained = self._grown, set(), 0
        return grown

    def size(self, key: SetKey, exact: bool = True) -> int:
        """How many elements set ``key`` holds: a live set's own count; another's counted from
        the indexes without making it: a scope's pods by label group (the addresses of each
        group counted once until it changes: O(label groups), nothing made per pod; with
        ``local``, ``block`` or a named port each pod of the groups is tested, unless not
        ``exact``: then the group's addresses, an upper bound), a node set's Nodes, an interval
        set's networks. A pod's addresses are counted per pod: an upper bound of the distinct
        elements, equal unless two pods that count share an address; a key of several scopes
        (the union of their pods) counts each label group its scopes match once
        (:meth:`_union_size`: what it holds once made, however the scopes overlap)."""
        live = self._sets.get(key)
        if live is not None:
            return len(live.networks) if key.kind == "interval" else len(live.counts)
        if key.kind == "interval":
            return len(_block_elements(key))
        if key.kind == "nodes":
            assert key.nodes is not None
            return sum(len(_node_elements(key, n)) for n in self.nodes.values() if key.nodes.matches(n.labels))
        scopes = _scopes(key)
        return sum(self._scope_size(key, scope, exact) for scope in scopes) if len(scopes) < 2 else self._union_size(key)

    def _union_size(self, key: SetKey) -> int:
        """The addresses of ``key``'s family that union address set ``key`` would hold: each
        label group (a namespace's pods of one label set) that any of its scopes matches,
        counted once (a union's scopes are peer scopes: neither ``local`` nor ``block``).
        O(scopes x label groups), nothing made per pod."""
        v6 = key.family == "ipv6"
        matched: set[tuple[str, Labels]] = set()
        for scope in key.scopes:
            selector = scope.pod_selector
            matched.update((namespace, labels) for namespace in self._namespaces(scope)
                           for labels in self.groups.get(namespace, {}) if selector is None or selector.matches(labels))
        return sum(self._addresses(namespace, labels, self.groups[namespace][labels])[v6] for namespace, labels in matched)

    def _bound(self, key: SetKey) -> int:
        """An upper bound of :meth:`size` in O(1) for a set of pods or Nodes (every pod's, or
        every Node's, addresses of its family), in the ipBlock's size for an interval set."""
        if key in self._sets or key.kind == "domain":
            return self.size(key)
        if key.kind == "interval":
            return sum(map(block_networks, _blocks(key)))
        if key.kind == "nodes":
            if self._node_addresses is None:
                self._node_addresses = [0, 0]
                for node in self.nodes.values():
                    for ip in node.peer_addresses:
                        self._node_addresses[":" in ip] += 1
            return self._node_addresses[key.family == "ipv6"]
        return self._every_address(key.family)

    def _every_address(self, family: Family) -> int:
        """How many addresses of ``family`` the pods that count have (counted once, then kept)."""
        if self._all_addresses is None:
            self._all_addresses = [0, 0]
            for members in (m for by_labels in self.groups.values() for m in by_labels.values()):
                for pod in members.values():
                    for ip in pod.ips:
                        self._all_addresses[":" in ip] += 1
        return self._all_addresses[family == "ipv6"]

    def elements(self, keys: Iterable[SetKey], cap: int) -> int:
        """How many elements the distinct sets of ``keys`` hold together (:meth:`size`) beyond
        one for each address of every pod that counts (both families): what an object's peers
        multiply, the shape the cap exists for (issue 30: distinct selectors each of every pod),
        never what one set of every pod holds, which the pods' owners (other tenants) could
        grow until a policy that names them failed closed. An upper bound when it is within
        ``cap`` (first :meth:`_bound`, in O(sets); then :meth:`size` not ``exact``), else
        counted exactly in order until the sum exceeds ``cap`` (what it is then: at least
        that many)."""
        distinct = list(dict.fromkeys(keys))
        allowance = self._every_address("ipv4") + self._every_address("ipv6")
        limit = cap + allowance
        total = sum(map(self._bound, distinct))
        if total <= limit:
            return max(0, total - allowance)
        for exact in (False, True):
            total = 0
            for key in distinct:
                total += self.size(key, exact)
                if total > limit:
                    break
            if total <= limit:
                break
        return max(0, total - allowance)

    def take_changes(self, changes: Changes) -> None:
        """Write the set and element changes since the last call into ``changes``."""
        changes.sets_added = [self._address_set(key) for key in sorted(self._born, key=lambda k: k.name)]
        changes.sets_removed = sorted(key.name for key in self._dead)
        for key, elements in self._added.items():
            if elements and key not in self._born:  # a new set comes with all its elements
                changes.elements_added[key.name] = _sorted_elements(key, elements)
        for key, elements in self._removed.items():
            if elements and key not in self._born:
                changes.elements_removed[key.name] = _sorted_elements(key, elements)
        self.forget_changes()

    def forget_changes(self) -> None:
        """Start the journal again from now."""
        self._born, self._dead, self._added, self._removed = set(), {}, {}, {}

    def _address_set(self, key: SetKey, ordered: bool = True) -> AddressSet:
        if key.kind == "interval":
            elements: tuple[Any, ...] = self._sets[key].networks
        elif key.kind == "domain":  # learned by the agent, never rendered
            elements = ()
        elif ordered:
            elements = tuple(_sorted_elements(key, self._sets[key].counts))
        else:
            elements = tuple(self._sets[key].counts)
        kind = "addr" if key.kind == "nodes" else key.kind  # node addresses: an address set like the pods'
        return AddressSet(key.name, key.family, kind, elements, comment(key.description))

    def _watch(self, scope: Scope, key: SetKey) -> None:
        users = self._scope_sets.setdefault(scope, set())
        if not users:
            if scope.block is not None:
                self._block_scopes.add(scope)
            elif scope.namespace is not None:
                self._scopes_in.setdefault(scope.namespace, set()).add(scope)
            else:
                selector = scope.namespace_selector
                assert selector is not None
                matched = self._selector_matches.get(selector)
                if matched is None:
                    matched = self._selector_matches[selector] = {n for n in self.known_namespaces if selector.matches(self.namespace_labels(n))}
                self._selector_scopes.setdefault(selector, set()).add(scope)
                for name in matched:
                    self._scopes_in.setdefault(name, set()).add(scope)
        users.add(key)
        self._sets[key].counts.update(self._scope_elements(key, scope, self._scope_groups(scope)))

    def _watch_nodes(self, selector: LabelSelector, key: SetKey) -> None:
        """Node set ``key`` (new) takes the addresses of the Nodes ``selector`` matches."""
        self._node_sets.setdefault(selector, set()).add(key)
        counts = self._sets[key].counts
        for node in self.nodes.values():
            if selector.matches(node.labels):
                counts.update(_node_elements(key, node))

    def _unwatch(self, scope: Scope) -> None:
        del self._scope_sets[scope]
        if scope.block is not None:
            self._block_scopes.discard(scope)
        elif scope.namespace is not None:
            self._scopes_in[scope.namespace].discard(scope)
        else:
            selector = scope.namespace_selector
            assert selector is not None
            for name in self._selector_matches[selector]:
                self._scopes_in[name].discard(scope)
            users = self._selector_scopes[selector]
            users.discard(scope)
            if not users:
                del self._selector_scopes[selector], self._selector_matches[selector]

    def _scope_elements(self, key: SetKey, scope: Scope, groups: list[dict[str, Pod]]) -> list[Any]:
        """The elements the pods of ``groups`` (in the namespaces and podSelector of ``scope``,
        the key's or one of a union's) give set ``key``, one per pod that gives it (``local``
        applied here)."""
        if key.kind == "addr" and scope.block is None and not scope.local:  # the common case, without a call per pod
            v6 = key.family == "ipv6"
            return [ip for members in groups for pod in members.values() for ip in pod.ips if (":" in ip) == v6]
        return [element for members in groups for pod in members.values() if not scope.local or self.is_local(pod)
                for element in _elements(key, pod)]

    def _scope_size(self, key: SetKey, scope: Scope, exact: bool) -> int:
        """The elements the pods of ``scope`` would give set ``key`` (see :meth:`size`)."""
        namespaces, selector = self._namespaces(scope), scope.pod_selector
        if exact and (key.kind != "addr" or scope.block is not None or scope.local):
            return sum(len(_elements(key, pod)) for members in self._scope_groups(scope, namespaces) for pod in members.values()
                       if not scope.local or self.is_local(pod))
        v6 = key.family == "ipv6"
        return sum(self._addresses(namespace, labels, members)[v6] for namespace in namespaces
                   for labels, members in self.groups.get(namespace, {}).items() if selector is None or selector.matches(labels))

    def _addresses(self, namespace: str, labels: Labels, members: dict[str, Pod]) -> list[int]:
        """The ``[IPv4, IPv6]`` addresses of group ``members`` (of ``namespace``, ``labels``)."""
        counts = self._group_addresses.get((namespace, labels))
        if counts is None:
            counts = self._group_addresses[(namespace, labels)] = [0, 0]
            for pod in members.values():
                for ip in pod.ips:
                    counts[":" in ip] += 1
        return counts

    def _namespaces(self, scope: Scope) -> Iterable[str]:
        """The namespaces ``scope`` covers (a namespaceSelector not watched: tested on each)."""
        if scope.block is not None:
            return list(self.groups)
        if scope.namespace is not None:
            return (scope.namespace,)
        selector = scope.namespace_selector
        assert selector is not None
        matched = self._selector_matches.get(selector)
        return matched if matched is not None else [n for n in self.known_namespaces if selector.matches(self.namespace_labels(n))]

    def _in_scope(self, scope: Scope, pod: Pod) -> bool:
        """True when ``pod`` (of a namespace the scope covers) is in ``scope``."""
        if scope.local and not self.is_local(pod):
            return False
        return scope.pod_selector is None or scope.pod_selector.matches(pod.labels)

    def _scope_groups(self, scope: Scope, namespaces: Iterable[str] | None = None) -> list[dict[str, Pod]]:
        """The pod groups of the namespaces ``scope`` covers (or of ``namespaces``, which it
        covers) whose labels its podSelector matches (``local`` is not applied)."""
        if namespaces is None:
            namespaces = self._namespaces(scope)
        selector, groups = scope.pod_selector, self.groups
        return [members for namespace in namespaces if namespace in groups for labels, members in groups[namespace].items()
                if selector is None or selector.matches(labels)]

    def _count(self, key: SetKey, elements: Iterable[Any], step: int) -> None:
        """Count ``elements`` in (step 1) or out (-1) of set ``key``; an element that appears or
        disappears is recorded as a change (an addition and a removal cancel out)."""
        counts = self._sets[key].counts
        if step > 0:
            self._grown.add(key)
        for element in elements:
            count = counts[element] + step
            if count:
                counts[element] = count
            else:
                del counts[element]
            if count == (1 if step > 0 else 0):
                self.gained += step > 0
                gained, lost = (self._added, self._removed) if step > 0 else (self._removed, self._added)
                if element in lost.get(key, ()):
                    lost[key].discard(element)
                else:
                    gained.setdefault(key, set()).add(element)
