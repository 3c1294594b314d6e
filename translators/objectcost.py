"""What one policy object may cost the node's ruleset, counted from the object alone before
anything is built: the per-object caps (issue 30, "Caps that fail closed, never an OOM").

The API server bounds neither a NetworkPolicy rule's peers nor its ports, nor an ipBlock's
excepts. :mod:`~nftpolicy.translators.chainbuilders` makes a rule's pod-selector peers one
union set per family and its ipBlocks one union interval set per family, and a rule of P peer
sets and Q ports cost P + Q rules (its peer chain), but some shapes still multiply: an egress
named port is one set and one rule per peer scope, family and named port; a rule of one peer set and Q ports, or
of P peer sets and one port, is P x Q matches of one side of 1 (linear); an ipBlock's excepts
split its CIDR into up to one network per except and prefix bit. :func:`policy_cost` counts
those, as an upper bound of what the chain builders emit for both address families, in O(size
of the object); :func:`over_limit` names the first cap an object is beyond. The agent enforces
such an object fail-closed for its subjects, as it does an invalid one
(:mod:`nftpolicy.agent.daemon.store`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import PROTOCOLS, ClusterNetworkPolicy, Direction, IPBlock, NetworkPolicy
from .validation import InvalidField

FAMILY_COUNT = 2  # an upper bound: a pod peer is one set per address family in use


@dataclass(frozen=True)
class ObjectLimits:
    """The caps of one policy object: ``rules`` (the rules of its chains, peer chains included,
    counted by :func:`policy_cost`), ``elements`` (the networks of its ipBlocks after their
    excepts, counted by :func:`policy_cost`; and the elements of all its sets, the addresses of
    the pods and nodes its peers select included, counted by the node renderer on the cluster:
    :func:`set_elements_over`). Defaults sized from ``bench/hostile_shapes.py``: 1000 peers x
    1000 ports is 3 rules in nft and one union set per family (1,003 counted: the iptables
    variant's rule per port), 5,000 ipBlocks with two excepts each one rule and one set of
    45,000 networks (85,000 counted)."""

    rules: int = 10_000
    elements: int = 100_000


@dataclass(frozen=True)
class ObjectCost:
    """What :func:`policy_cost` counted: ``rules`` and ``elements`` (see :class:`ObjectLimits`)."""

    rules: int
    elements: int


class OverLimit(InvalidField):
    """A policy object beyond a cap of :class:`ObjectLimits`: ``limit`` names it (``rules`` or
    ``elements``), ``value`` is the object's count (``what``: what was counted, in words).
    Raised where an invalid object is, so it fails closed the same way."""

    def __init__(self, limit: str, value: int, cap: int, what: str | None = None) -> None:
        flag = {"rules": "--max-object-rules", "elements": "--max-object-elements"}[limit]
        super().__init__("spec", f"{value} {what or limit} exceed the cap of {cap} per object ({flag}): enforced fail-closed")
        self.limit, self.value = limit, value


SET_ELEMENTS = "set elements beyond one per pod address (the addresses of the pods and nodes its peers select, its networks)"


def set_elements_over(value: int, cap: int) -> OverLimit:
    """The :class:`OverLimit` of an object whose sets hold ``value`` elements on the cluster as
    the node renderer knows it (:meth:`~nftpolicy.translators.setstore.SelectorSets.elements`:
    counted until beyond ``cap``, so at least that many): what the log and the Event say."""
    return OverLimit("elements", value, cap, f"or more {SET_ELEMENTS}")


def set_elements_reason(cap: int) -> str:
    """Why a policy beyond ``cap`` in :func:`set_elements_over` is enforced fail-closed, as its
    model keeps it (its ``fail_closed``): without the count, which depends on when it was
    taken, so that a model is the same however the cluster came to be."""
    return f"spec: more {SET_ELEMENTS} than the cap of {cap} per object (--max-object-elements): enforced fail-closed"


def block_networks(block: IPBlock) -> int:
    """At most how many networks ``block`` minus its excepts is: each except splits the CIDR
    into at most one network per prefix bit between them."""
    return 1 + sum(max(0, hole.prefixlen - block.cidr.prefixlen) for hole in block.excepts)


def _rule_cost(direction: Direction, pod_peers: int, other_peers: int, numbered: int, named: int, blocks: int = 0) -> int:
    """The rules one policy rule costs: ``pod_peers`` (one set per family for all of them: one
    peer's own, or the union of several), ``other_peers`` (a set per family each) and
    ``blocks`` ipBlocks (one set per family for all of them) peer alternatives (all 0: any
    peer), ``numbered`` port matches and ``named`` named-port matches (each protocol a match)."""
    options = (min(pod_peers, 1) + other_peers) * FAMILY_COUNT + min(blocks, FAMILY_COUNT) or 1
    if not numbered and not named:
        return options
    peers = pod_peers + other_peers + blocks
    if direction == "egress":  # a named port's set per peer scope and family; numbered ports as ingress's
        scopes = (peers or 1) * FAMILY_COUNT
        return scopes * named + (options + numbered + 1 if (options > 1 or peers > 1) and numbered > 1 else options * numbered)
    ports = numbered + named * FAMILY_COUNT
    return options + ports + 1 if (options > 1 or peers > 1) and ports > 1 else options * ports


def policy_cost(policy: NetworkPolicy | ClusterNetworkPolicy) -> ObjectCost:
    """What ``policy`` may cost (an upper bound, in the object's size)."""
    rules = elements = 0
    for direction in ("ingress", "egress"):
        if isinstance(policy, NetworkPolicy):
            for rule in policy.rules(direction):
                blocks = [p.ip_block for p in rule.peers if p.ip_block is not None]
                elements += sum(map(block_networks, blocks))
                named = sum(1 for p in rule.ports if isinstance(p.port, str))
                rules += _rule_cost(direction, len(rule.peers) - len(blocks), 0, len(rule.ports) - named, named, len(blocks))
        else:
            for crule in policy.rules(direction):
                networks = sum(len(p.networks) for p in crule.peers)
                elements += networks
                named = sum(1 for p in crule.ports if p.name is not None) * len(PROTOCOLS)
                pods = sum(1 for p in crule.peers if p.namespaces is not None or p.pods is not None)
                others = sum(1 for p in crule.peers if p.domain_names or p.nodes is not None)
                rules += _rule_cost(direction, pods, others, sum(1 for p in crule.ports if p.name is None), named, networks)
    return ObjectCost(rules, elements)


def over_limit(cost: ObjectCost, limits: ObjectLimits) -> OverLimit | None:
    """The first cap of ``limits`` that ``cost`` is beyond (rules, then elements), or None."""
    if cost.rules > limits.rules:
        return OverLimit("rules", cost.rules, limits.rules)
    if cost.elements > limits.elements:
        return OverLimit("elements", cost.elements, limits.elements)
    return None
