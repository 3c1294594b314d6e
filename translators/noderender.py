"""One node's rule model, kept up to date object by object: a change costs what it touches.

:class:`NodeRenderer` holds the cluster as indexes (pods by namespace and label set, policies by
namespace) and the node's desired rule model (DESIGN.md section 2: ``KUBE-POD-IN-/EG-<hash>`` ->
``KUBE-NWPLCY-<hash>``, semantics section 3). It takes one object at a time (:meth:`set_pod`,
:meth:`set_namespace`, :meth:`set_policy`, :meth:`set_cluster_policy`, :meth:`set_node`) and records what that changed in the model, which
:meth:`take_changes` hands out; :meth:`model` is the whole model (a full render is
:meth:`load` then :meth:`model`: the same code). Peer sets are shared selector sets
(:mod:`~nftpolicy.translators.setstore`); policy and tier chains are built by
:mod:`~nftpolicy.translators.chainbuilders`, tier chains kept by :mod:`~nftpolicy.translators.tierchains`.

What a policy chain says depends only on the policy (its rules name sets by key); which policy
chains exist depends on the node's pods (a chain exists while the policy selects a local pod);
pod chains depend on the local pods and the policies of their namespace. So a non-local pod
change touches only set elements, a namespace label change only the sets of the
namespaceSelectors that start or stop matching it, a Node change only the elements of the node
sets (ClusterNetworkPolicy ``nodes`` peers) whose selector matches it before or after, and a policy change its own chains, sets and
the pod chains of its namespace.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections import Counter
from typing import Any, Iterable, Mapping

from .model import NAMESPACE_NAME_LABEL, Cluster, ClusterNetworkPolicy, Family, Namespace, NetworkPolicy, Node, Pod, family_of
from .rules import (
    FAMILIES,
    AddressSet,
    AnyChain,
    ChainOwner,
    Changes,
    Config,
    PodChain,
    RuleModel,
    TierChain,
    owner_of,
)
from .layout import KNOWN_POD_SETS, POD_CIDR_SETS, counted_origins, peer_chain, tier_chain
from .objectcost import OverLimit
from .setstore import SelectorSets
from .domainnames import DomainSet, domain_sets
from .chainbuilders import build_pod_chains
from .policychains import PolicyChains
from .tierchains import TierChains

class NodeRenderer:
    """The rule model of ``node`` (None: every pod counts as local), updated object by object.

    With ``max_elements`` (``--max-object-elements``), a policy whose sets would hold more
    elements than that (:meth:`~nftpolicy.translators.setstore.SelectorSets.elements`: the
    addresses of the pods and nodes its peers select, its networks, beyond one per pod address)
    is enforced fail-closed
    (:meth:`over_limit` says which and why): counted before its chains are built, and again
    when a set its chains use gains elements (at the next output); it stays closed until it
    changes (or a full render counts it again).

    Inputs are model objects (immutable; a changed object is a new object). Not thread-safe.
    """

    def __init__(self, node: str | None, config: Config = Config(), max_elements: int | None = None) -> None:
        self.node, self.config, self.max_elements = node, config, max_elements
        self.namespaces: dict[str, Namespace] = {}
        self.pods: dict[str, Pod] = {}
        self.sets = SelectorSets(self._is_local, self.namespace_labels)
        self._family_pods: Counter[Family] = Counter()
        self.families: tuple[Family, ...] = ("ipv4",)
        self._local: dict[str, dict[str, Pod]] = {}  # namespace -> local pods that count
        # the model, and the chains changed since take_changes (name -> the chain before, None: absent)
        self._chains_before: dict[str, AnyChain | None] = {}
        self.policies = PolicyChains(self.sets, self._chains_before, max_elements)
        self.tiers = TierChains(self.sets, self._chains_before, self.namespace_labels, max_elements)
        self._pod_chains: dict[str, tuple[PodChain, ...]] = {}  # local pod key -> its pod chains, one per isolated direction (isolated pods only)
        self._stale_pods: set[str] = set()  # local pods whose chain is rebuilt at the next refresh
        self._all_stale = False  # every local pod's chain is rebuilt at the next refresh
        self._local_by_ip: dict[str, set[str]] = {}  # address -> the local pods that have it
        self.pod_cidrs: tuple[str, ...] = config.pod_cidrs  # the node's (Node.spec.podCIDRs unless the config names them)
        self._unknown_reported: dict[str, frozenset[str]] = {}  # unknown-pod set -> its elements as last handed out

    # ---- inputs --------------------------------------------------------------------------

    def load(self, cluster: Cluster) -> "NodeRenderer":
        """Take every object of ``cluster`` (namespaces, then pods, then policies); returns self.

        Into a renderer that has no policy yet, pods are only indexed: no set exists that they
        could change, so each costs a few dictionary updates. Into an empty renderer (a full
        render), the loaded model is where changes start: :meth:`take_changes` reports what
        changes after the load (a full replace carries the whole model anyway).
        """
        empty = not (self.namespaces or self.pods or self.policies.policies or self.tiers.policies or self.sets.known_namespaces)
        for name, ns in cluster.namespaces.items():
            self.set_namespace(name, ns)
        if self.policies.policies or self.tiers.policies:
            for key, pod in cluster.pods.items():
                self.set_pod(key, pod)
        else:
            self._index_pods(cluster.pods)
        for key, policy in cluster.policies.items():
            self.set_policy(key, policy)
        for name, node in cluster.nodes.items():
            self.set_node(name, node)
        for key, cluster_policy in cluster.cluster_policies.items():
            self.set_cluster_policy(key, cluster_policy)
        if empty:
            self._all_stale = True
            self._refresh_pod_chains()
            self.sets.forget_changes()
            self._chains_before.clear()
            self._unknown_reported = {s.name: frozenset(s.elements) for s in self.unknown_pod_sets()}
        return self

    def _index_pods(self, pods: Mapping[str, Pod]) -> None:
        """What :meth:`set_pod` does for new pods, when there are no sets and no policies."""
        self.pods.update(pods)
        counting = [(key, pod) for key, pod in pods.items() if pod.enforceable]
        for namespace in dict.fromkeys(pod.namespace for _, pod in counting):
            if namespace not in self.sets.known_namespaces:
                self.set_namespace(namespace, None)
        self.sets.index(counting)
        self._family_pods.update(_family_counts(pod for _, pod in counting))
        for key, pod in counting:
            if self.node is None or pod.node == self.node:
                self._local.setdefault(pod.namespace, {})[key] = pod
                for ip in pod.ips:
                    self._local_by_ip.setdefault(ip, set()).add(key)
        self._all_stale = True
        self.families = tuple(f for f in FAMILIES if self._family_pods[f] > 0) or ("ipv4",)

    def apply(self, kind: str, key: str, obj: Any) -> None:
        """One changed object of ``kind`` (``Namespace``, ``Pod``, ``NetworkPolicy``,
        ``ClusterNetworkPolicy``, ``Node``; None: deleted)."""
        if kind == "Pod":
            self.set_pod(key, obj)
        elif kind == "Namespace":
            self.set_namespace(key, obj)
        elif kind == "NetworkPolicy":
            self.set_policy(key, obj)
        elif kind == "ClusterNetworkPolicy":
            self.set_cluster_policy(key, obj)
        elif kind == "Node":
            self.set_node(key, obj)

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
        if name in self.sets.known_namespaces and self.namespace_labels(name) == old_labels:
            return
        if self.tiers.policies and self._local.get(name):  # a subject may start or stop selecting its pods
            for pod in self._local[name].values():
                if self.tiers.update_subjects(pod.key, pod):
                    self._stale_pods.add(pod.key)
        self.sets.namespace_changed(name)
        self._bound_growth()

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
        if namespace not in self.sets.known_namespaces:
            self.set_namespace(namespace, None)  # evaluate the namespaceSelectors for it once
        for p, step in ((before, -1), (after, 1)):
            if p is not None:
                for family in FAMILIES:
                    if p.addresses(family):
                        self._family_pods[family] += step
        self.sets.pod_changed(key, before, after)
        self._update_local(key, before, after)
        if self.tiers.policies and any(p is not None and self._is_local(p) for p in (before, after)):
            if self.tiers.update_subjects(key, after if after is not None and self._is_local(after) else None):
                self._stale_pods.add(key)
        families = tuple(f for f in FAMILIES if self._family_pods[f] > 0) or ("ipv4",)
        if families != self.families:
            self.families = families
            for policy_key in list(self.policies.policies):
                self.policies.render(policy_key, families)
            self.tiers.drop(list(self.tiers.chains))
            self._all_stale = True
        self._bound_growth()

    def set_node(self, name: str, node: Node | None) -> None:
        """A Node was added or changed (None: deleted): only the elements of the node sets
        (ClusterNetworkPolicy ``nodes`` peers) that hold or now want its addresses change; this
        node's ``spec.podCIDRs`` are the pod CIDRs of the unknown pods unless the config names them."""
        self.sets.node_changed(name, node)
        self._bound_growth()
        if name == self.node and not self.config.pod_cidrs:
            self.pod_cidrs = node.pod_cidrs if node is not None else ()

    def set_policy(self, key: str, policy: NetworkPolicy | None) -> None:
        """A NetworkPolicy was added or changed (None: deleted): the pod chains of its
        namespace's local pods are rebuilt (only they can jump to its chains)."""
        old = self.policies.policies.get(key)
        namespace = policy.namespace if policy is not None else old.namespace if old is not None else None
        self.policies.set_policy(key, policy, self._local.get(namespace, {}).values() if namespace else (), self.families)
        if namespace is not None:
            self._stale_pods.update(self._local.get(namespace, {}))

    def set_cluster_policy(self, key: str, policy: ClusterNetworkPolicy | None) -> None:
        """A ClusterNetworkPolicy was added or changed (None: deleted). Its tier chains are
        rebuilt when the pod chains are next refreshed."""
        self.tiers.set_policy(key, policy, (p for pods in self._local.values() for p in pods.values()))
        self._all_stale = True

    def policy(self, kind: str, key: str) -> NetworkPolicy | ClusterNetworkPolicy | None:
        """The ``NetworkPolicy`` or ``ClusterNetworkPolicy`` called ``key`` as it was given
        (None: none)."""
        chains = self.policies if kind == "NetworkPolicy" else self.tiers
        over = chains.over.get(key)
        return over[0] if over is not None else chains.policies.get(key)

    def over_limit(self) -> dict[tuple[str, str], OverLimit]:
        """``(kind, key)`` -> why, for each policy enforced fail-closed beyond ``max_elements``
        as counted so far (policies whose sets grew are counted again at the next output:
        :meth:`model`, :meth:`take_changes`)."""
        return {**{("NetworkPolicy", k): why for k, (_, why) in self.policies.over.items()},
                **{("ClusterNetworkPolicy", k): why for k, (_, why) in self.tiers.over.items()}}

    def subject_nodes(self, kind: str, key: str) -> frozenset[str]:
        """The nodes of the pods that count which policy ``key`` of ``kind`` selects (its
        subjects): the nodes whose renderer builds its chains."""
        policy = self.policy(kind, key)
        groups = self.sets.groups
        if isinstance(policy, NetworkPolicy):
            selected = (members for labels, members in groups.get(policy.namespace, {}).items() if policy.pod_selector.matches(labels))
        elif isinstance(policy, ClusterNetworkPolicy):
            selected = (members for ns, by_labels in groups.items() for labels, members in by_labels.items()
                        if policy.selects(self.namespace_labels(ns), labels))
        else:
            return frozenset()
        return frozenset(pod.node for members in selected for pod in members.values() if pod.node)

    # ---- outputs -------------------------------------------------------------------------

    def domain_sets(self) -> tuple[DomainSet, ...]:
        """The domain sets of the model (:func:`~nftpolicy.translators.domainnames.domain_sets`)."""
        if not any(peer.domain_names for p in self.tiers.policies.values() for rule in p.egress for peer in rule.peers):
            return ()
        cluster = Cluster(namespaces=self.namespaces, pods=self.pods, cluster_policies=self.tiers.policies)
        return domain_sets(cluster, self.families)

    def model(self, ordered: bool = True, unions: bool = True) -> RuleModel:
        """The whole desired model, every tuple in a stable order (equal inputs, equal models);
        ``ordered=False`` leaves set elements unsorted (the kernel does not care; sorting 180,000
        elements takes a third of a second); ``unions=False`` leaves out which peer gives what to
        each union set (:attr:`RuleModel.unions`: explain's and trace's, not the kernel's)."""
        self._refresh_pod_chains()
        return RuleModel(
            config=self.config,
            sets=tuple(sorted((*self.sets.address_sets(ordered), *self.unknown_pod_sets()), key=lambda s: s.name)),
            policy_chains=tuple(sorted((c for c, _ in self.policies.chains.values()), key=lambda c: c.name)),
            pod_chains=tuple(sorted((c for chains in self._pod_chains.values() for c in chains), key=lambda c: c.name)),
            tier_chains=tuple(sorted((c for c, _ in self.tiers.chains.values()), key=lambda c: c.name)),
            unions=tuple(sorted(self.sets.unions(), key=lambda u: u.name)) if unions else (),
        )

    def counts(self) -> dict[str, int]:
        """Sizes of the model for metrics: ``sets``, ``elements`` (in every set), ``policy chains``
        and ``pod chains`` (one per local pod and direction it is isolated in)."""
        self._refresh_pod_chains()
        sets, elements = self.sets.counts()
        return {"sets": sets, "elements": elements, "policy chains": len(self.policies.chains), "pod chains": sum(len(chains) for chains in self._pod_chains.values())}

    def known_addresses(self) -> frozenset[str]:
        """The addresses of the local pods that count (as the unknown pods' known sets hold them)."""
        return frozenset(self._local_by_ip)

    def unknown_pod_sets(self) -> tuple[AddressSet, ...]:
        """With ``config.unknown_pods`` not ``off``: the node's pod CIDRs (``interval``, overlaps
        merged) and the addresses of its known local pods (``addr``), one set of each per family
        (:data:`~nftpolicy.translators.layout.POD_CIDR_SETS`, :data:`~nftpolicy.translators.layout.KNOWN_POD_SETS`,
        sorted elements); none when it is ``off``."""
        if self.config.unknown_pods == "off":
            return ()
        networks = [ipaddress.ip_network(c, strict=False) for c in self.pod_cidrs]
        sets = []
        for family in FAMILIES:
            version = 4 if family == "ipv4" else 6
            cidrs = tuple(str(n) for n in ipaddress.collapse_addresses([n for n in networks if n.version == version]))  # type: ignore[type-var]
            known = tuple(sorted((ip for ip in self._local_by_ip if family_of(ip) == family), key=ipaddress.ip_address))
            sets += [AddressSet(POD_CIDR_SETS[family], family, "interval", cidrs, f"the node's pod CIDRs ({family})"),
                     AddressSet(KNOWN_POD_SETS[family], family, "addr", known, f"local pods programmed here ({family})")]
        return tuple(sets)

    def local_pods(self) -> int:
        """How many pods that count (running, with an address, not hostNetwork) run on the node."""
        return sum(len(pods) for pods in self._local.values())

    def chain_owners(self) -> dict[str, ChainOwner]:
        """Chain name -> what it enforces, for every policy, tier and pod chain of the model (and
        a policy or tier chain's peer chains: its owner); a tier chain's owner (and its peer
        chains') with the origins of its counted rules (``counted``)."""
        self._refresh_pod_chains()
        owners = {name: dataclasses.replace(owner_of(chain), counted=counted_origins(tier_chain(self.config, chain)))
                  if isinstance(chain, TierChain) else owner_of(chain) for name, chain in self._chains().items()}
        owners.update((peers.name, owner_of(c)) for c, _ in self.policies.chains.values() for peers in c.peer_chains)
        owners.update((peers.name, dataclasses.replace(owner_of(c), counted=counted_origins(peer_chain(self.config, c, peers))))
                      for c, _ in self.tiers.chains.values() for peers in c.peer_chains)
        return owners

    def take_changes(self) -> Changes:
        """Everything that changed in the model since the last call (or since the start, or
        since a :meth:`load` into an empty renderer)."""
        self._refresh_pod_chains()
        changes = Changes()
        self.sets.take_changes(changes)
        for s in self.unknown_pod_sets():
            elements, reported = frozenset(s.elements), self._unknown_reported.get(s.name, frozenset())
            if elements - reported:
                changes.elements_added[s.name] = sorted(elements - reported)
            if reported - elements:
                changes.elements_removed[s.name] = sorted(reported - elements)
            self._unknown_reported[s.name] = elements
        current = self._chains()
        for name, before in self._chains_before.items():
            after = current.get(name)
            if after != before:
                changes.chains[name] = (before, after)
        self._chains_before.clear()
        return changes

    # ---- chains --------------------------------------------------------------------------

    def _chains(self) -> dict[str, AnyChain]:
        chains: dict[str, AnyChain] = {c.name: c for c, _ in self.policies.chains.values()}
        chains.update((c.name, c) for c, _ in self.tiers.chains.values())
        chains.update((c.name, c) for chains in self._pod_chains.values() for c in chains)
        return chains

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
        for ip in was.ips if was is not None else ():
            self._stale_pods.update(self._local_by_ip.get(ip, ()))  # another pod may take the address over
            holders = self._local_by_ip.get(ip)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self._local_by_ip[ip]
        for ip in now.ips if now is not None else ():
            holders = self._local_by_ip.setdefault(ip, set())
            holders.add(key)
            self._stale_pods.update(holders)  # the pods that had it may lose it to this one
        self._stale_pods.add(key)
        self.policies.local_pod_changed(namespace, was, now, self.families)

    def _refresh_pod_chains(self) -> None:
        """Pod chains of the local pods: which policy chains each direction jumps to. Only the
        chains of the pods marked stale since the last refresh are rebuilt (all of them after a
        load, a change of the address families in use or of a ClusterNetworkPolicy): a local pod
        change costs its own chains, never local pods x policies."""
        self._recheck_grown()
        if not (self._all_stale or self._stale_pods):
            return
        local = {p.key: p for pods in self._local.values() for p in pods.values()} if self._all_stale else None
        stale = set(local) | self._pod_chains.keys() if local is not None else self._stale_pods
        self._all_stale, self._stale_pods = False, set()
        tiers = self.tiers.refresh(self.families)
        tier_policy = {c.name: c.policy for c, _ in self.tiers.chains.values()}
        for key in stale:
            pod = self.pods.get(key)
            old = {c.name: c for c in self._pod_chains.pop(key, ())}
            chains: tuple[PodChain, ...] = ()
            if pod is not None and self._is_local(pod) and pod.enforceable:
                chains = self._built_pod_chains(pod, tiers.get(key, {}), tier_policy)
                if chains:
                    self._pod_chains[key] = chains
            new = {c.name: c for c in chains}
            for name in sorted(old.keys() | new.keys()):
                if old.get(name) != new.get(name):
                    self._chains_before.setdefault(name, old.get(name))
        if self.tiers.chains:  # tier chains that no pod chain jumps to go
            jumped = {n for chains in self._pod_chains.values() for c in chains for n in (*c.admin, *c.baseline)}
            self.tiers.drop([k for k, (c, _) in self.tiers.chains.items() if c.name not in jumped])

    def _bound_growth(self) -> None:
        """Count the policies whose sets grew at once, not at the next output, when the sets
        gained more than ``max_elements`` elements since they were last counted: a burst of
        pods within one sync adds at most that many before a policy beyond the cap is closed."""
        if self.max_elements is not None and self.sets.gained > self.max_elements:
            self._recheck_grown()

    def _recheck_grown(self) -> None:
        """Count again the policies that use a set that gained elements (``max_elements``):
        what changed, times the policies that use it."""
        grown = self.sets.take_grown()
        if self.max_elements is None:
            return
        for kind, key in sorted({owner for set_key in grown for owner in self.sets.owners(set_key)}):
            if kind == "ClusterNetworkPolicy":
                self._all_stale |= self.tiers.recheck(key)
            elif self.policies.recheck(key, self.families):
                self._stale_pods.update(self._local.get(self.policies.policies[key].namespace, {}))

    def _built_pod_chains(self, pod: Pod, pod_tiers: Mapping[str, list[str]], tier_policy: Mapping[str, str]) -> tuple[PodChain, ...]:
        """The chains of local pod ``pod``, one per direction it is isolated in (none: not
        isolated, or none of its addresses dispatches to it). An address shared by local pods dispatches to one pod
        chain: the first of them by (not Running, key)."""
        order = (pod.phase != "Running", pod.key)
        ips = tuple(ip for ip in pod.ips if all(order <= (self.pods[k].phase != "Running", k) for k in self._local_by_ip.get(ip, ())))
        selecting, empty = self.policies.selecting(pod)
        if not (selecting or pod_tiers) or not ips:
            return ()
        return build_pod_chains(pod, ips, selecting, pod_tiers, tier_policy, empty)


def _family_counts(pods: Iterable[Pod]) -> dict[Family, int]:
    """How many of ``pods`` have an address of each family (a dual-stack pod counts in both)."""
    v4 = v6 = 0
    for pod in pods:
        if len(pod.ips) == 1:  # the common case, without a generator per pod
            if ":" in pod.ips[0]:
                v6 += 1
            else:
                v4 += 1
        else:
            v4 += any(":" not in ip for ip in pod.ips)
            v6 += any(":" in ip for ip in pod.ips)
    return {"ipv4": v4, "ipv6": v6}


def build_rule_model(cluster: Cluster, node: str | None, config: Config = Config(), unions: bool = True) -> RuleModel:
    """Render the desired ruleset of ``node`` (None: every pod counts as local) from scratch
    (``unions``: as :meth:`NodeRenderer.model`).

    Returns a :class:`RuleModel` with every tuple in a stable order, so equal clusters give equal
    models whatever the input order.
    """
    return NodeRenderer(node, config).load(cluster).model(unions=unions)
