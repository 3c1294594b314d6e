"""The NetworkPolicy chains of one node, kept up to date: a policy chain per (policy, direction)
exists while the policy selects a local pod (built by
:func:`~nftpolicy.translators.chainbuilders.build_policy_chain`), so the ruleset grows with the
local pods' policies, never with pods x policies."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from .chainbuilders import build_policy_chain
from .model import DIRECTIONS, Direction, Family, NetworkPolicy, Pod
from .rules import AnyChain, PolicyChain
from .setstore import SelectorSets, SetKey


class PolicyChains:
    """The node's NetworkPolicies by namespace, how many local pods each selects, and the
    chains of those that select one. Chains made, changed or taken away are noted in
    ``journal`` (chain name -> the chain before, None: absent); their sets are acquired from and
    released to ``sets``."""

    def __init__(self, sets: SelectorSets, journal: dict[str, AnyChain | None]) -> None:
        self.sets, self.journal = sets, journal
        self.policies: dict[str, NetworkPolicy] = {}
        self.chains: dict[tuple[str, str], tuple[PolicyChain, list[SetKey]]] = {}
        self._policies_in: dict[str, set[str]] = {}
        self._local_targets: Counter[str] = Counter()  # policy key -> local pods it selects

    def set_policy(self, key: str, policy: NetworkPolicy | None, local_pods: Iterable[Pod], families: tuple[Family, ...]) -> None:
        """A NetworkPolicy was added or changed (None: deleted); ``local_pods``: the local pods
        of its namespace."""
        old = self.policies.pop(key, None)
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
        for direction in DIRECTIONS:
            old = self.chains.pop((key, direction), None)
            chain = None
            if policy is not None and direction in policy.policy_types and self._local_targets[key] > 0:
                keys: list[SetKey] = []
                chain = build_policy_chain(policy, direction, families, keys)
                for set_key in keys:  # acquired before the old ones are released: shared sets stay
                    self.sets.acquire(set_key)
                self.chains[(key, direction)] = (chain, keys)
            if old is not None:
                for set_key in old[1]:
                    self.sets.release(set_key)
            name = old[0].name if old is not None else chain.name if chain is not None else None
            if name is not None and name not in self.journal:
                self.journal[name] = old[0] if old is not None else None

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
