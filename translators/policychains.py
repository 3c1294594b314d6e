"""The NetworkPolicy chains of one node, kept up to date: a policy chain per (policy, direction)
exists while the policy selects a local pod (built by
:func:`~nftpolicy.translators.chainbuilders.build_policy_chain`), so the ruleset grows with the
local pods' policies, never with pods x policies."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from .chainbuilders import build_policy_chain
from .model import DIRECTIONS, Direction, Family, NetworkPolicy, Pod
from .objectcost import OverLimit, set_elements_over, set_elements_reason
from .refusals import closed_policy
from .rules import AnyChain, PolicyChain
from .setstore import SelectorSets, SetKey

Built = dict[Direction, tuple[PolicyChain, list[SetKey]]]


class PolicyChains:
    """The node's NetworkPolicies by namespace, how many local pods each selects, and the
    chains of those that select one. Chains made, changed or taken away are noted in
    ``journal`` (chain name -> the chain before, None: absent); their sets are acquired from and
    released to ``sets`` (owner ``("NetworkPolicy", key)``). With ``max_elements``, a policy
    whose sets would hold more elements than that when its chains are built, or come to as
    they grow (:meth:`recheck`), is enforced as its
    :func:`~nftpolicy.translators.refusals.closed_policy` until it changes: ``over`` holds the
    object given and why."""

    def __init__(self, sets: SelectorSets, journal: dict[str, AnyChain | None], max_elements: int | None = None) -> None:
        self.sets, self.journal, self.max_elements = sets, journal, max_elements
        self.over: dict[str, tuple[NetworkPolicy, OverLimit]] = {}
        self.policies: dict[str, NetworkPolicy] = {}
        self.chains: dict[tuple[str, str], tuple[PolicyChain, list[SetKey]]] = {}
        self._policies_in: dict[str, set[str]] = {}
        self._local_targets: Counter[str] = Counter()  # policy key -> local pods it selects

    def set_policy(self, key: str, policy: NetworkPolicy | None, local_pods: Iterable[Pod], families: tuple[Family, ...]) -> None:
        """A NetworkPolicy was added or changed (None: deleted); ``local_pods``: the local pods
        of its namespace."""
        old = self.policies.pop(key, None)
        self.over.pop(key, None)
        if old is not None:
            self._policies_in[old.namespace].discard(key)
        if policy is not None:
            self.policies[key] = policy
            self._policies_in.setdefault(policy.namespace, set()).add(key)
            self._local_targets[key] = sum(1 for p in local_pods if policy.pod_selector.matches(p.labels))
        else:
            self._local_targets.pop(key, None)
        self.render(key, families)

    def local_pod_changed(self, namespace: str, was: Pod | None, now: Pod | None, families: tuple[Family, ...]) -> None:
        """A local pod of ``namespace`` changed from ``was`` to ``now`` (None: absent): a
        policy's chains come and go with its first and last local target."""
        for policy_key in list(self._policies_in.get(namespace, ())):
            selector = self.policies[policy_key].pod_selector
            step = int(now is not None and selector.matches(now.labels)) - int(was is not None and selector.matches(was.labels))
            if step:
                before = self._local_targets[policy_key]
                self._local_targets[policy_key] = before + step
                if (before == 0) != (before + step == 0):
                    self.render(policy_key, families)

    def render(self, key: str, families: tuple[Family, ...]) -> None:
        """(Re)build the chains of policy ``key``: they exist while it selects a local pod."""
        policy = self.policies.get(key)
        built = self._built(key, policy, families) if policy is not None and self._local_targets[key] > 0 else {}
        owner = ("NetworkPolicy", key)
        for direction in DIRECTIONS:
            old = self.chains.pop((key, direction), None)
            entry = built.get(direction)
            if entry is not None:
                for set_key in entry[1]:  # acquired before the old ones are released: shared sets stay
                    self.sets.acquire(set_key, owner)
                self.chains[(key, direction)] = entry
            if old is not None:
                for set_key in old[1]:
                    self.sets.release(set_key, owner)
            name = old[0].name if old is not None else entry[0].name if entry is not None else None
            if name is not None and name not in self.journal:
                self.journal[name] = old[0] if old is not None else None

    def recheck(self, key: str, families: tuple[Family, ...]) -> bool:
        """A set that policy ``key``'s chains use gained elements: beyond ``max_elements`` now,
        it is closed (its chains rebuilt as its closed policy's). True when it was."""
        if self.max_elements is None or key in self.over:
            return False
        total = self.sets.elements(self._set_keys(key), self.max_elements)
        if total <= self.max_elements:
            return False
        self._close(key, total, self.max_elements)
        self.render(key, families)
        return True

    def _set_keys(self, key: str) -> Iterable[SetKey]:
        """The set keys the chains of policy ``key`` use now (one per use)."""
        return (k for d in DIRECTIONS if (key, d) in self.chains for k in self.chains[(key, d)][1])

    def _built(self, key: str, policy: NetworkPolicy, families: tuple[Family, ...]) -> Built:
        """The chains of ``policy`` (called ``key``), with the set keys each uses; those of its
        closed policy when its sets would hold more than ``max_elements``."""
        built: Built = {}
        for direction in DIRECTIONS:
            if direction in policy.policy_types:
                keys: list[SetKey] = []
                built[direction] = (build_policy_chain(policy, direction, families, keys), keys)
        if self.max_elements is not None and key not in self.over:
            total = self.sets.elements((k for _, keys in built.values() for k in keys), self.max_elements)
            if total > self.max_elements:
                return self._built(key, self._close(key, total, self.max_elements), families)
        return built

    def _close(self, key: str, total: int, cap: int) -> NetworkPolicy:
        """Policy ``key``, whose sets hold ``total`` elements, beyond ``cap``: enforced closed
        from now on."""
        policy = self.policies[key]
        beyond = set_elements_over(total, cap)
        self.over[key] = (policy, beyond)
        closed = closed_policy(policy, set_elements_reason(cap))
        assert isinstance(closed, NetworkPolicy)
        self.policies[key] = closed
        return closed

    def selecting(self, pod: Pod) -> tuple[dict[Direction, list[str]], set[str]]:
        """The policy chains of each direction whose policy selects local pod ``pod``, and which
        of them have no rule."""
        found: dict[Direction, list[str]] = {}
        empty: set[str] = set()
        for policy_key in self._policies_in.get(pod.namespace, ()):
            if self.policies[policy_key].pod_selector.matches(pod.labels):
                for direction in DIRECTIONS:
                    entry = self.chains.get((policy_key, direction))
                    if entry is not None:
                        found.setdefault(direction, []).append(entry[0].name)
                        if not entry[0].rules:
                            empty.add(entry[0].name)
        return found, empty
