"""The delta: what the node renderer changed -> one typed transaction of only that.

The cost is the size of the change, not of the table (DESIGN.md section 4): new sets and chains,
element adds and deletes, flushed and refilled chains, verdict-map moves, then removals, in an
order the kernel takes in one transaction.
"""

from __future__ import annotations

from . import layout
from .layout import POD_MAPS
from .model import family_of
from .rules import AnyChain, Changes, Config, PeerChain, PodChain, PolicyChain, TierChain
from .transaction import ChainRule, Elements, OurTable, SetName, Transaction

# A chain of the delta: one of the model's, or a peer chain with the policy or tier chain it belongs to.
DeltaChain = AnyChain | tuple[PolicyChain | TierChain, PeerChain]


def decided_chain(config: Config, chain: DeltaChain) -> layout.Chain:
    """The layout chain of one policy, tier, pod or peer chain (the one :func:`layout.table` has)."""
    if isinstance(chain, tuple):
        return layout.peer_chain(config, *chain)
    if isinstance(chain, PolicyChain):
        return layout.policy_chain(config, chain)
    if isinstance(chain, TierChain):
        return layout.tier_chain(config, chain)
    return layout.pod_chain(config, chain)


def _with_peer_chains(chains: dict[str, tuple[AnyChain | None, AnyChain | None]]) -> dict[str, tuple[DeltaChain | None, DeltaChain | None]]:
    """``changes.chains`` with the peer chains of each changed policy or tier chain that differ
    before and after, each before the chain that jumps to it."""
    found: dict[str, tuple[DeltaChain | None, DeltaChain | None]] = {}
    for name, (before, after) in chains.items():
        old = {p.name: (before, p) for p in before.peer_chains} if isinstance(before, (PolicyChain, TierChain)) else {}
        new = {p.name: (after, p) for p in after.peer_chains} if isinstance(after, (PolicyChain, TierChain)) else {}
        for peers in old.keys() | new.keys():
            was, now = old.get(peers), new.get(peers)
            if was is None or now is None or was[1] != now[1]:
                found[peers] = (was, now)
        found[name] = (before, after)
    return found


def _removal_order(chain: DeltaChain | None) -> int:
    """Removed chains go after those that jump to them: pod chains, then policy and tier
    chains, then peer chains."""
    return 0 if isinstance(chain, PodChain) else 2 if isinstance(chain, tuple) else 1


def delta_transaction(config: Config, changes: Changes) -> Transaction:
    """The transaction that applies ``changes`` (what the model gained and lost since the kernel
    last took it) to our table: the cost is the size of the change, not of the table.

    Order, so that each command only references what exists by then: add new sets and new
    (empty) chains; delete stale elements, then add new ones; flush and refill every changed
    chain and fill new ones; move the verdict-map dispatch of changed pod chains; flush, then
    delete removed chains (pod chains, then the policy and tier chains they jumped to, then the
    peer chains of those); delete removed sets. A changed policy chain's peer chains
    change with it (only those that differ).
    """
    tx = Transaction(config.table, config.priority)
    tx.add(OurTable())
    chains = _with_peer_chains(changes.chains)
    for s in changes.sets_added:
        tx.add(s)
    for name, (before, _) in chains.items():
        if before is None:
            tx.add(layout.Chain(name, ()))
    for name, elements in changes.elements_removed.items():
        tx.delete(Elements(name, tuple(elements)))
    for name, elements in changes.elements_added.items():
        tx.add(Elements(name, tuple(elements)))
    for name, (before, after) in chains.items():
        if after is not None:
            if before is not None:
                tx.flush(layout.Chain(name, ()))
            for rule in decided_chain(config, after).rules:
                tx.add(ChainRule(name, rule))
    stale: dict[str, list[str]] = {}  # verdict map -> addresses to delete
    fresh: dict[str, list[layout.MapElement]] = {}  # verdict map -> elements to add
    for name, (before, after) in changes.chains.items():
        old = set(before.ips) if isinstance(before, PodChain) else set()
        new = set(after.ips) if isinstance(after, PodChain) else set()
        for ip in old - new:
            stale.setdefault(POD_MAPS[before.direction][family_of(ip)], []).append(ip)  # type: ignore[union-attr]
        for ip in new - old:
            fresh.setdefault(POD_MAPS[after.direction][family_of(ip)], []).append(layout.MapElement(ip, name, after.pod))  # type: ignore[union-attr]
    for pod_map, ips in sorted(stale.items()):  # deletions first: an address may move to another pod chain
        tx.delete(Elements(pod_map, tuple(sorted(ips))))
    for pod_map, elements in sorted(fresh.items()):
        tx.add(Elements(pod_map, tuple(sorted(elements, key=lambda e: e.address))))
    removed = sorted(chains.items(), key=lambda kv: _removal_order(kv[1][0]))
    for name, (before, after) in removed:
        if after is None:
            tx.flush(layout.Chain(name, ()))
            tx.delete(layout.Chain(name, ()))
    for name in changes.sets_removed:
        tx.delete(SetName(name))
    return tx
