"""Typed transaction -> libnftables JSON (libnftables-json(5)): the one place that writes it.

:mod:`nftpolicy.translators.layout` decides every chain, rule and map and
:mod:`nftpolicy.translators.transaction` records what to do with them (the full replace and the
delta alike); this module only prints a transaction as one JSON batch
(:func:`transaction_json`), which the agent and the sandbox commit through libnftables. The
same objects print as ``nft -f`` text (:mod:`nftpolicy.translators.nfttext`). Only native nft
expressions are used (no ``xt`` compat matches), so the ruleset loads on nft-only hosts.
"""

from __future__ import annotations

from typing import Any, Sequence

import orjson

from . import layout, transaction
from .layout import Chain, Rule, Statement, Table
from .model import Family
from .rules import AddressSet, RuleModel, TimedAddress, comment, log_prefix_text
from .transaction import ChainRule, Elements, OurTable, Operation, Replace, SetName, Transaction

IP: dict[Family, str] = {"ipv4": "ip", "ipv6": "ip6"}
ICMP: dict[Family, str] = {"ipv4": "icmp", "ipv6": "icmpv6"}
ADDR_TYPE: dict[Family, str] = {"ipv4": "ipv4_addr", "ipv6": "ipv6_addr"}
Json = dict[str, Any]
MARK: Json = {"meta": {"key": "mark"}}
L4PROTO: Json = {"meta": {"key": "l4proto"}}
DPORT: Json = {"payload": {"protocol": "th", "field": "dport"}}
SPORT: Json = {"payload": {"protocol": "th", "field": "sport"}}
CT_STATE: Json = {"ct": {"key": "state"}}


def _payload(protocol: str, field: str) -> Json:
    return {"payload": {"protocol": protocol, "field": field}}


def _match(left: Any, right: Any, op: str = "==") -> Json:
    return {"match": {"op": op, "left": left, "right": right}}


def _one_or_set(values: list[Any]) -> Any:
    return values[0] if len(values) == 1 else {"set": values}


def statement_json(s: Statement) -> Json:
    """One statement of :mod:`~nftpolicy.translators.layout` as a libnftables JSON statement
    (libnftables-json(5): MATCH, MANGLE, VERDICT, REJECT, LOG, LIMIT, COUNTER, VMAP)."""
    if isinstance(s, layout.AddressIs):
        return _match(_payload(IP[s.family], s.field), _one_or_set([element_json(a) for a in s.addresses]))
    if isinstance(s, layout.AddressInSet):
        return _match(_payload(IP[s.family], s.field), f"@{s.name}", "!=" if s.negated else "==")
    if isinstance(s, layout.NamedPortInSet):
        return _match({"concat": [_payload(IP[s.family], "daddr"), L4PROTO, DPORT]}, f"@{s.name}")
    if isinstance(s, layout.Protocols):
        return _match(L4PROTO, _one_or_set(list(s.names)))
    if isinstance(s, layout.DestinationPorts):
        return _match(DPORT, s.first if s.first == s.last else {"range": [s.first, s.last]})
    if isinstance(s, layout.DestinationPortSet):
        return _match(DPORT, {"set": [first if first == last else {"range": [first, last]} for first, last in s.ranges]})
    if isinstance(s, layout.SourcePort):
        return _match(SPORT, s.port)
    if isinstance(s, layout.ConntrackState):
        return _match(CT_STATE, s.states[0] if len(s.states) == 1 else list(s.states), "in")
    if isinstance(s, layout.AskedAddress):
        return _match({"ct": {"key": f"{IP[s.family]} daddr", "dir": "original"}}, _one_or_set([element_json(a) for a in s.addresses]),
                      "!=" if s.negated else "==")
    if isinstance(s, layout.IcmpTypes):
        return _match(_payload(ICMP[s.family], "type"), {"set": list(s.types)})
    if isinstance(s, layout.LocalAddress):
        return _match({"fib": {"result": "type", "flags": [s.field]}}, "local", "!=" if s.negated else "==")
    if isinstance(s, layout.Unmarked):
        return _match({"&": [MARK, s.bits]}, 0)
    if isinstance(s, layout.Marked):
        return _match({"&": [MARK, s.bits]}, s.bits)
    if isinstance(s, layout.Limit):
        return {"limit": {"rate": s.rate, "per": s.per, "burst": s.burst}}
    if isinstance(s, layout.PerAddressLimit):
        limit = {"limit": {"rate": s.rate, "per": "second", "burst": s.burst}}
        key = _payload(IP[s.family], s.field)
        timed = key if s.timeout is None else {"elem": {"val": key, "timeout": s.timeout}}
        return {"meter": {"name": s.meter, "key": timed, "stmt": limit, "size": 65535}}
    if isinstance(s, layout.CounterStatement):
        return {"counter": None}
    if isinstance(s, layout.SetMark):
        return {"mangle": {"key": MARK, "value": {"|": [MARK, s.bits]}}}
    if isinstance(s, layout.ClearMark):
        return {"mangle": {"key": MARK, "value": {"&": [MARK, 0xFFFFFFFF & ~s.bits]}}}
    if isinstance(s, layout.ClearAndSetMark):
        return {"mangle": {"key": MARK, "value": {"|": [{"&": [MARK, 0xFFFFFFFF & ~s.clear]}, s.set]}}}
    if isinstance(s, layout.Log):
        return {"log": {"prefix": log_prefix_text(s.prefix), "group": s.group}}
    if isinstance(s, layout.Reject):
        return {"reject": {"type": "tcp reset"} if s.tcp_reset else None}
    if isinstance(s, layout.VerdictStatement):
        return {s.kind: None}
    if isinstance(s, layout.Jump):
        return {"jump": {"target": s.target}}
    if isinstance(s, layout.Dispatch):
        return {"vmap": {"key": _payload(IP[s.family], s.field), "data": f"@{s.map}"}}
    if isinstance(s, layout.SetTrace):
        return {"mangle": {"key": {"meta": {"key": "nftrace"}}, "value": 1}}
    raise TypeError(f"no nft statement for {s!r}")


def _table_ref(table: str) -> Json:
    return {"family": "inet", "table": table}


def rule_json(table: str, chain: str, rule: Rule) -> Json:
    """The ``rule`` object of one layout rule (libnftables-json(5) RULE), comment included."""
    body: Json = {**_table_ref(table), "chain": chain, "expr": [statement_json(s) for s in rule.statements]}
    if rule.comment:
        body["comment"] = comment(rule.comment)
    return {"rule": body}


def chain_json(table: str, priority: int, chain: Chain) -> Json:
    """The ``chain`` object of one layout chain, without its rules (libnftables-json(5) CHAIN;
    a base chain: type filter, hook, ``priority``, policy accept)."""
    body: Json = {**_table_ref(table), "name": chain.name}
    if chain.hook:
        body.update(type="filter", hook=chain.hook, prio=priority if chain.priority is None else chain.priority, policy="accept")
    return {"chain": body}


def _chain_with_rules(table: str, priority: int, chain: Chain) -> list[Json]:
    return [chain_json(table, priority, chain)] + [rule_json(table, chain.name, r) for r in chain.rules]


def map_json(table: str, m: layout.VerdictMap) -> Json:
    """The ``map`` object of a dispatch verdict map, with its elements (libnftables-json(5) MAP)."""
    body: Json = {**_table_ref(table), "name": m.name, "type": ADDR_TYPE[m.family], "map": "verdict", "comment": comment(m.comment)}
    if m.elements:
        body["elem"] = [map_element_json(e) for e in m.elements]
    return {"map": body}


def table_objects(t: Table) -> list[Json]:
    """Every object of a layout table (libnftables-json(5) object form), in dependency order:
    table, sets, chains each followed by its rules (base chains last), verdict maps before the
    base chains that name them."""
    objects: list[Json] = [{"table": {"family": "inet", "name": t.name}}]
    objects += [{"set": set_json(t.name, s)} for s in t.sets]
    base = [c for c in t.chains if c.hook]
    for chain in (c for c in t.chains if not c.hook):
        objects += _chain_with_rules(t.name, t.priority, chain)
    objects += [map_json(t.name, m) for m in t.maps]
    declared = [_chain_with_rules(t.name, t.priority, chain) for chain in base]
    objects += [objs[0] for objs in declared]  # the base chains, then their rules
    objects += [rule for objs in declared for rule in objs[1:]]
    return objects


def set_json(table: str, s: AddressSet) -> Json:
    """The ``set`` object of a shared set, with its elements (libnftables-json(5) SET)."""
    body: Json = {**_table_ref(table), "name": s.name, "comment": comment(s.comment)}
    if s.kind == "named_port":
        body["type"] = [ADDR_TYPE[s.family], "inet_proto", "inet_service"]
    elif s.kind == "interval":
        body["type"], body["flags"] = ADDR_TYPE[s.family], ["interval"]
    elif s.kind == "domain":  # elements expire with their DNS record (DOMAIN_NAMES in docs/design.md)
        body["type"], body["flags"] = ADDR_TYPE[s.family], ["timeout"]
    else:
        body["type"] = ADDR_TYPE[s.family]
    if s.elements:
        body["elem"] = [element_json(e) for e in s.elements]
    return body


def map_element_json(element: layout.MapElement) -> list[Any]:
    """A verdict map element: the local pod's address -> jump to its pod chain."""
    return [element.address, {"jump": {"target": element.chain}}]


def element_json(element: Any) -> Any:
    """A set element of the rule model as libnftables JSON: an address, a network (``prefix``),
    an ``address . protocol . port`` triple (``concat``) or a :class:`TimedAddress` (``elem``
    with its ``timeout``); a verdict map's :class:`~nftpolicy.translators.layout.MapElement` as
    :func:`map_element_json`."""
    if isinstance(element, str):
        return _prefix(element) if "/" in element else element
    if isinstance(element, tuple):
        return {"concat": list(element)}
    if isinstance(element, TimedAddress):
        return {"elem": {"val": element.address, "timeout": element.timeout}}
    return map_element_json(element)


def _prefix(cidr: str) -> Json:
    addr, _, length = cidr.partition("/")
    return {"prefix": {"addr": addr, "len": int(length)}}


def object_json(tx: Transaction, op: Operation) -> Json:
    """The object of one operation as libnftables-json(5) COMMAND OBJECTS take it: the whole
    object for ``add``, its name (and table) for ``flush`` and ``delete``; elements by their keys."""
    obj, table = op.object, tx.table
    if isinstance(obj, ChainRule):  # the most frequent first
        return rule_json(table, obj.chain, obj.rule)
    if isinstance(obj, Elements):
        return {"element": {**_table_ref(table), "name": obj.name, "elem": [element_json(e) for e in obj.elements]}}
    if isinstance(obj, Chain):
        return chain_json(table, tx.priority, obj) if op.verb == "add" else {"chain": {**_table_ref(table), "name": obj.name}}
    if isinstance(obj, OurTable):
        return {"table": {"family": "inet", "name": table}}
    if isinstance(obj, AddressSet):
        return {"set": set_json(table, obj)}
    if isinstance(obj, SetName):
        return {"set": {**_table_ref(table), "name": obj.name}}
    return map_json(table, obj)


def transaction_json(tx: Transaction) -> Json:
    """``tx`` as one libnftables JSON batch (libnftables-json(5): ``{"nftables": [commands]}``,
    each ``{"add"|"flush"|"delete": object}``). A :class:`Replace` is ``add table`` (so a first
    load works), ``delete table``, then ``add`` of every object of the new table
    (:func:`table_objects`); other tables are never named."""
    commands: list[Json] = []
    for op in tx.operations:
        if isinstance(op, Replace):
            table = {"table": {"family": "inet", "name": tx.table}}
            commands += [{"add": table}, {"delete": table}]
            commands += [{"add": o} for o in table_objects(op.table)]
        else:
            commands.append({op.verb: object_json(tx, op)})
    return {"nftables": commands}


def timed_elements_json(table: str, elements: Sequence[tuple[str, TimedAddress]]) -> Json:
    """The libnftables batch that puts each ``(set, element)`` in its domain set with the
    element's timeout, whether or not the set holds the address already: ``add`` (so that it
    exists), ``delete``, ``add`` with the timeout, in one transaction (an older kernel keeps an
    existing element's timeout on ``add``)."""
    commands: list[Json] = []
    for set_name, element in elements:
        ref = {**_table_ref(table), "name": set_name}
        commands += [{"add": {"element": {**ref, "elem": [element.address]}}},
                     {"delete": {"element": {**ref, "elem": [element.address]}}},
                     {"add": {"element": {**ref, "elem": [element_json(element)]}}}]
    return {"nftables": commands}


def list_json(table: str, chain: str | None = None) -> Json:
    """The libnftables JSON query that lists ``inet <table>`` (or only its chain ``chain``)."""
    if chain is None:
        return {"nftables": [{"list": {"table": {"family": "inet", "name": table}}}]}
    return {"nftables": [{"list": {"chain": {**_table_ref(table), "name": chain}}}]}


def list_sets_json(table: str) -> Json:
    """The libnftables JSON query that lists the sets of ``inet <table>`` (with their elements
    unless the listing is terse). libnftables 1.0.6 answers with the sets of every inet table:
    each set names its ``table``."""
    return {"nftables": [{"list": {"sets": _table_ref(table)}}]}


def list_set_json(table: str, name: str) -> Json:
    """The libnftables JSON query that lists set ``name`` of ``inet <table>``."""
    return {"nftables": [{"list": {"set": {**_table_ref(table), "name": name}}}]}


def to_json(model: RuleModel) -> str:
    """The full replace of ``model``'s table (:func:`transaction.full`) as indented libnftables
    JSON text (input for ``nft -j -f``)."""
    return orjson.dumps(transaction_json(transaction.full(model)), option=orjson.OPT_INDENT_2).decode()
