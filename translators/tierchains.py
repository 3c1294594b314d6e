"""The ClusterNetworkPolicy tier chains of one node, kept up to date: a tier chain per (policy,
direction) exists while the policy's subject selects a local pod and a pod chain jumps to it
(built by :func:`~nftpolicy.translators.chainbuilders.build_tier_chain`)."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from .chainbuilders import build_tier_chain
from .model import DIRECTIONS, ClusterNetworkPolicy, Family, Pod
from .rules import AnyChain, TierChain
from .setstore import SelectorSets, SetKey


class TierChains:
    """The node's ClusterNetworkPolicies, which local pods each subject selects, and the tier
    chains built for them. Chains made or taken away are noted in ``journal`` (chain name -> the
    chain before, None: absent); their sets are acquired from and released to ``sets``."""

    def __init__(self, sets: SelectorSets, journal: dict[str, AnyChain | None],
                 namespace_labels: Callable[[str], Mapping[str, str]]) -> None:
        self.sets, self.journal, self.namespace_labels = sets, journal, namespace_labels
        self.policies: dict[str, ClusterNetworkPolicy] = {}
        self.chains: dict[tuple[str, str], tuple[TierChain, list[SetKey]]] = {}
        self._subjects: dict[str, set[str]] = {}  # ClusterNetworkPolicy -> local pods its subject selects

    def set_policy(self, key: str, policy: ClusterNetworkPolicy | None, local_pods: Iterable[Pod]) -> None:
        """A ClusterNetworkPolicy was added or changed (None: deleted); its chains go (the next
        :meth:`refresh` builds what is still wanted)."""
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
                self.sets.release(set_key)
            self.journal.setdefault(chain.name, chain)

    def refresh(self, families: tuple[Family, ...]) -> dict[str, dict[str, list[str]]]:
        """Build the tier chains of the ClusterNetworkPolicies that select a local pod (and drop
        the others); returns, for each local pod they select, the pod chain fields
        (``admin_ingress``, ...) with the chain names in evaluation order (``(priority, name)``)."""
        tiers: dict[str, dict[str, list[str]]] = {}
        wanted: set[tuple[str, str]] = set()
        for policy in sorted(self.policies.values(), key=lambda p: (p.priority, p.name)):
            selected = self._subjects[policy.name]
            for direction in DIRECTIONS:
                if not selected or not policy.rules(direction):
                    continue
                key = (policy.name, direction)
                wanted.add(key)
                if key not in self.chains:
                    set_keys: list[SetKey] = []
                    chain = build_tier_chain(policy, direction, families, set_keys)
                    for set_key in set_keys:
                        self.sets.acquire(set_key)
                    self.chains[key] = (chain, set_keys)
                    self.journal.setdefault(chain.name, None)
                name = self.chains[key][0].name
                field = f"{policy.tier.lower()}_{direction}"
                for pod_key in selected:
                    tiers.setdefault(pod_key, {}).setdefault(field, []).append(name)
        self.drop([key for key in self.chains if key not in wanted])
        return tiers
