"""A table's policies one by one: what the reconcile loop needs to single out the objects of a
transaction the kernel refused (:mod:`nftpolicy.agent.daemon.quarantine`) and to fail closed on
them, so that one object the kernel cannot take never keeps the others from being enforced
(DESIGN.md section 4).

Every rule of a policy or tier chain names its policy (:class:`~nftpolicy.translators.rules.RuleOrigin`,
data, never its comment), and everything the table holds of a policy (its rules and the sets
they name, with their comments and elements) can be checked apart from the rest
(:func:`only`). The stand-in of a refused policy (:func:`stand_in`) fails closed as for a policy
that fails validation: a NetworkPolicy isolates the pods it selects with nothing allowed; a
ClusterNetworkPolicy's Accept rules match nothing and its Deny and Pass rules deny everything.
"""

from __future__ import annotations

import dataclasses
from typing import Collection

from . import layout
from .clusterpolicy import closed_cluster_policy
from .model import ClusterNetworkPolicy, NetworkPolicy
from .rules import RuleOrigin

PolicyRef = tuple[str, str]  # (kind, key): ("NetworkPolicy", "namespace/name") or ("ClusterNetworkPolicy", "name")


def policy_ref(origin: RuleOrigin) -> PolicyRef:
    """The policy a rule comes from, as the store names it."""
    return ("ClusterNetworkPolicy" if origin.tier is not None else "NetworkPolicy", origin.policy)


def policies_in(table: layout.Table) -> list[PolicyRef]:
    """Each policy with a rule in ``table``, once, in the order of its first rule."""
    found = (policy_ref(rule.origin) for chain in table.chains for rule in chain.rules if rule.origin is not None)
    return list(dict.fromkeys(found))


def only(table: layout.Table, policies: Collection[PolicyRef]) -> layout.Table:
    """What ``table`` holds of ``policies``: the chains of their rules and the sets those rules
    look up (declarations, comments and elements), with no base chain and no map (nothing of it
    sees a packet). The kernel takes or refuses it as it would take or refuse those objects in
    the whole table; it costs what they cost, not the table."""
    wanted = set(policies)
    chains = tuple(c for c in table.chains if any(r.origin is not None and policy_ref(r.origin) in wanted for r in c.rules))
    named = {s.name for c in chains for r in c.rules for s in r.statements if isinstance(s, (layout.AddressInSet, layout.NamedPortInSet))}
    return dataclasses.replace(table, sets=tuple(s for s in table.sets if s.name in named), chains=chains, maps=())


def stand_in(policy: NetworkPolicy | ClusterNetworkPolicy, reason: str) -> NetworkPolicy | ClusterNetworkPolicy:
    """What the table enforces in place of ``policy`` once the kernel refused it: a NetworkPolicy
    without rules (it isolates the pods it selects, in its policyTypes, allowing nothing: as
    :func:`~nftpolicy.translators.manifests.fail_closed_policy`), a ClusterNetworkPolicy as
    :func:`~nftpolicy.translators.clusterpolicy.closed_cluster_policy`. Its rules print no text of
    the policy's but its name (an object name: the API server's validation, and ours).
    ``reason``: the kernel's refusal, kept as ``fail_closed`` for explain to name."""
    why = f"the kernel refused its rules: {reason}"
    if isinstance(policy, NetworkPolicy):
        return dataclasses.replace(policy, ingress=(), egress=(), fail_closed=why)
    return closed_cluster_policy(policy, why)
