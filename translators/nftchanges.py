"""The incremental batch: what the node renderer changed -> one libnftables transaction.

The cost is the size of the change, not of the table (DESIGN.md section 4): new sets and chains,
element adds and deletes, flushed and refilled chains, verdict-map moves, then removals, in an
order the kernel takes in one transaction.
"""

from __future__ import annotations

from typing import Any

from . import layout
from .layout import POD_MAPS
from .model import Family, family_of
from .nft import Json, map_element_json, set_json, chain_json, element_json
from .rules import AnyChain, Changes, Config, PodChain, PolicyChain, TierChain


def chain_objects(config: Config, chain: AnyChain) -> list[Json]:
    """The ``chain`` object of one policy, tier or pod chain followed by its rules (the same
    objects :func:`ruleset_objects` has for it)."""
    if isinstance(chain, PolicyChain):
        decided = layout.policy_chain(config, chain)
    elif isinstance(chain, TierChain):
        decided = layout.tier_chain(config, chain)
    else:
        decided = layout.pod_chain(config, chain)
    return chain_json(config.table, config.priority, decided)


def changes_transaction(config: Config, changes: Changes) -> Json:
    """One libnftables JSON batch that applies ``changes`` (what the model gained and lost since
    the kernel last took it) to our table: the cost is the size of the change, not of the table.

    Order, so that each command only references what exists by then: add new sets and new
    (empty) chains; delete stale elements, then add new ones; flush and refill every changed
    chain and fill new ones; move the verdict-map dispatch of changed pod chains; flush, then
    delete removed chains (pod chains, then the policy and tier chains they jumped to); delete
    removed sets.
    """
    table = {"family": "inet", "table": config.table}
    cmds: list[Json] = [{"add": {"table": {"family": "inet", "name": config.table}}}]
    cmds.extend({"add": {"set": set_json(config.table, s)}} for s in changes.sets_added)
    cmds.extend({"add": {"chain": {**table, "name": name}}} for name, (before, _) in changes.chains.items() if before is None)
    for name, elements in changes.elements_removed.items():
        cmds.append({"delete": {"element": {**table, "name": name, "elem": [element_json(e) for e in elements]}}})
    for name, elements in changes.elements_added.items():
        cmds.append({"add": {"element": {**table, "name": name, "elem": [element_json(e) for e in elements]}}})
    for name, (before, after) in changes.chains.items():
        if after is not None:
            if before is not None:
                cmds.append({"flush": {"chain": {**table, "name": name}}})
            cmds.extend({"add": obj} for obj in chain_objects(config, after)[1:])
    stale: dict[Family, list[Any]] = {"ipv4": [], "ipv6": []}
    fresh: dict[Family, list[Any]] = {"ipv4": [], "ipv6": []}
    for name, (before, after) in changes.chains.items():
        old = {ip: name for ip in before.ips} if isinstance(before, PodChain) else {}
        new = {ip: after for ip in after.ips} if isinstance(after, PodChain) else {}
        stale_ips = [ip for ip in old if ip not in new]
        for ip in stale_ips:
            stale[family_of(ip)].append(ip)
        for ip in new.keys() - old.keys():
            fresh[family_of(ip)].append(map_element_json(layout.MapElement(ip, name, new[ip].pod)))
    for family, ips in stale.items():  # deletions first: an address may move to another pod chain
        if ips:
            cmds.append({"delete": {"element": {**table, "name": POD_MAPS[family], "elem": sorted(ips)}}})
    for family, elements in fresh.items():
        if elements:
            cmds.append({"add": {"element": {**table, "name": POD_MAPS[family], "elem": sorted(elements, key=lambda e: e[0])}}})
    removed = sorted(changes.chains.items(), key=lambda kv: not isinstance(kv[1][0], PodChain))  # pod chains first: they jump to the others
    for name, (before, after) in removed:
        if after is None:
            cmds.append({"flush": {"chain": {**table, "name": name}}})
            cmds.append({"delete": {"chain": {**table, "name": name}}})
    cmds.extend({"delete": {"set": {**table, "name": name}}} for name in changes.sets_removed)
    return {"nftables": cmds}
