"""The ClusterNetworkPolicy tier chains of one node, kept up to date: a tier chain per (policy,
direction) exists while the policy's subject selects a local pod and a pod chain jumps to it
(built by :func:`~nftpolicy.translators.chainbuilders.build_tier_chain`)."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from .chainbuilders import build_tier_chain
from .clusterpolicy import closed_cluster_policy
from .model import DIRECTIONS, ClusterNetworkPolicy, Direction, Family, Pod
from .objectcost import OverLimit, set_elements_over, set_elements_reason
from .rules import AnyChain, TierChain
from .setstore import SelectorSets, SetKey


class TierChains:
    """The node's ClusterNetworkPolicies, which local pods each subject selects, and the tier
    chains built for them. Chains made or taken away are noted in ``journal`` (chain name -> the
    chain before, None: absent); their sets are acquired from and released to ``sets`` (owner
    ``("ClusterNetworkPolicy", name)``). With ``max_elements``, a policy whose sets would hold
    more elements than that when its chains are built, or come to as they grow
    (:meth:`recheck`), is enforced as its
    :func:`~nftpolicy.translators.clusterpolicy.closed_cluster_policy` until it changes:
    ``over`` holds the object given and why."""

    def __init__(self, sets: SelectorSets, journal: dict[str, AnyChain | None],
                 namespace_labels: Callable[[str], Mapping[str, str]], max_elements: int | None = None) -> None:
        self.sets, self.journal, self.namespace_labels, self.max_elements = sets, journal, namespace_labels, max_elements
        self.over: dict[str, tuple[ClusterNetworkPolicy, OverLimit]] = {}
        self.policies: dict[str, ClusterNetworkPolicy] = {}
        self.chains: dict[tuple[str, str], tuple[TierChain, list[SetKey]]] = {}
        self._subjects: dict[str, set[str]] = {}  # ClusterNetworkPolicy -> local pods its subject selects

    def set_policy(self, key: str, policy: ClusterNetworkPolicy | None, local_pods: Iterable[Pod]) -> None:
        """A ClusterNetworkPolicy was added or changed (None: deleted); its chains go (the next
        :meth:`refresh` builds what is still wanted)."""
        self.over.pop(key, None)
        if policy is None:
            self.policies.pop(key, None)
            self._subjects.pop(key, None)
        else:
            self.policies[key] = policy
            self._subjects[key] = {p.key for p in local_pods if policy.selects(self.namespace_labels(p.namespace), p.labels)}
        self.drop([k for k in self.chains if k[0] == key])

    def update_subjects(self, key: str, pod: Pod | None) -> bool:
        """Local pod ``key`` changed (None: gone or not local): which subjects select it; True
        when that changed for one."""
        labels = self.namespace_labels(pod.namespace) if pod is not None else {}
        changed = False
        for name, policy in self.policies.items():
            selected = self._subjects[name]
            now = pod is not None and policy.selects(labels, pod.labels)
            if now != (key in selected):
                (selected.add if now else selected.discard)(key)
                changed = True
        return changed

    def drop(self, keys: list[tuple[str, str]]) -> None:
        """Remove these tier chains (and release their sets)."""
        for key in keys:
            chain, set_keys = self.chains.pop(key)
            for set_key in set_keys:
                self.sets.release(set_key, ("ClusterNetworkPolicy", key[0]))
            self.journal.setdefault(chain.name, chain)

    def refresh(self, families: tuple[Family, ...]) -> dict[str, dict[str, list[str]]]:
        """Build the tier chains of the ClusterNetworkPolicies that select a local pod (and drop
        the others); returns, for each local pod they select, the pod chain fields
        (``admin_ingress``, ...) with the chain names in evaluation order (``(priority, name)``)."""
        tiers: dict[str, dict[str, list[str]]] = {}
        wanted: set[tuple[str, str]] = set()
        for policy in sorted(self.policies.values(), key=lambda p: (p.priority, p.name)):
            selected = self._subjects[policy.name]
            if selected and any((policy.name, d) not in self.chains for d in DIRECTIONS if policy.rules(d)):
                policy = self._build(policy, families)
            for direction in DIRECTIONS:
                if not selected or not policy.rules(direction):
                    continue
                key = (policy.name, direction)
                wanted.add(key)
                name = self.chains[key][0].name
                field = f"{policy.tier.lower()}_{direction}"
                for pod_key in selected:
                    tiers.setdefault(pod_key, {}).setdefault(field, []).append(name)
        self.drop([key for key in self.chains if key not in wanted])
        return tiers

    def recheck(self, name: str) -> bool:
        """A set that policy ``name``'s chains use gained elements: beyond ``max_elements`` now,
        it is closed (its chains go; the next :meth:`refresh` builds its closed policy's). True
        when it was."""
        if self.max_elements is None or name in self.over:
            return False
        total = self.sets.elements(self._set_keys(name), self.max_elements)
        if total <= self.max_elements:
            return False
        self._close(self.policies[name], total, self.max_elements)
        self.drop([k for k in self.chains if k[0] == name])
        return True

    def _set_keys(self, name: str) -> Iterable[SetKey]:
        """The set keys the chains of policy ``name`` use now (one per use)."""
        return (k for d in DIRECTIONS if (name, d) in self.chains for k in self.chains[(name, d)][1])

    def _build(self, policy: ClusterNetworkPolicy, families: tuple[Family, ...]) -> ClusterNetworkPolicy:
        """Build the chains of ``policy``'s directions that have rules and no chain yet (every
        direction's, as they come and go together); when its sets would hold more than
        ``max_elements``, its closed policy's instead. Returns the policy built."""
        built: dict[Direction, tuple[TierChain, list[SetKey]]] = {}
        for direction in DIRECTIONS:
            if policy.rules(direction) and (policy.name, direction) not in self.chains:
                keys: list[SetKey] = []
                built[direction] = (build_tier_chain(policy, direction, families, keys), keys)
        if self.max_elements is not None and policy.name not in self.over:
            total = self.sets.elements((*self._set_keys(policy.name), *(k for _, keys in built.values() for k in keys)), self.max_elements)
            if total > self.max_elements:
                self.drop([k for k in self.chains if k[0] == policy.name])
                return self._build(self._close(policy, total, self.max_elements), families)
        for direction, (chain, keys) in built.items():
            for set_key in keys:
                self.sets.acquire(set_key, ("ClusterNetworkPolicy", policy.name))
            self.chains[(policy.name, direction)] = (chain, keys)
            self.journal.setdefault(chain.name, None)
        return policy

    def _close(self, policy: ClusterNetworkPolicy, total: int, cap: int) -> ClusterNetworkPolicy:
        """``policy``, whose sets hold ``total`` elements, beyond ``cap``: enforced closed from
        now on."""
        beyond = set_elements_over(total, cap)
        self.over[policy.name] = (policy, beyond)
        closed = self.policies[policy.name] = closed_cluster_policy(policy, set_elements_reason(cap))
        return closed
