"""Layout -> libnftables JSON (libnftables-json(5)): the objects of our table and the batches
that commit them.

:mod:`nftpolicy.translators.layout` decides every chain, rule and map; this module only prints
them as JSON objects (:func:`table_objects`), and :func:`full_transaction` wraps them in the
one-transaction replace that the agent and the sandbox run. The same objects print as ``nft -f``
text (:mod:`nftpolicy.translators.nfttext`); the incremental batch is
:mod:`nftpolicy.translators.nftchanges`. Only native nft expressions are used (no ``xt`` compat
matches), so the ruleset loads on nft-only hosts.
"""

from __future__ import annotations

from typing import Any

import orjson

from . import layout
from .layout import Chain, Rule, Statement, Table
from .model import Family
from .rules import AddressSet, RuleModel, comment

IP: dict[Family, str] = {"ipv4": "ip", "ipv6": "ip6"}
ICMP: dict[Family, str] = {"ipv4": "icmp", "ipv6": "icmpv6"}
ADDR_TYPE: dict[Family, str] = {"ipv4": "ipv4_addr", "ipv6": "ipv6_addr"}
LOG_PREFIX_MAX_BYTES = 127  # the kernel's NF_LOG_PREFIXLEN (128) less the NUL
Json = dict[str, Any]
MARK: Json = {"meta": {"key": "mark"}}
L4PROTO: Json = {"meta": {"key": "l4proto"}}
DPORT: Json = {"payload": {"protocol": "th", "field": "dport"}}
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
        return _match(_payload(IP[s.family], s.field), f"@{s.name}")
    if isinstance(s, layout.NamedPortInSet):
        return _match({"concat": [_payload(IP[s.family], "daddr"), L4PROTO, DPORT]}, f"@{s.name}")
    if isinstance(s, layout.Protocols):
        return _match(L4PROTO, _one_or_set(list(s.names)))
    if isinstance(s, layout.DestinationPorts):
        return _match(DPORT, s.first if s.first == s.last else {"range": [s.first, s.last]})
    if isinstance(s, layout.ConntrackState):
        return _match(CT_STATE, s.states[0] if len(s.states) == 1 else list(s.states), "in")
    if isinstance(s, layout.IcmpTypes):
        return _match(_payload(ICMP[s.family], "type"), {"set": list(s.types)})
    if isinstance(s, layout.LocalAddress):
        return _match({"fib": {"result": "type", "flags": [s.field]}}, "local")
    if isinstance(s, layout.Unmarked):
        return _match({"&": [MARK, s.bits]}, 0)
    if isinstance(s, layout.Marked):
        return _match({"&": [MARK, s.bits]}, s.bits)
    if isinstance(s, layout.Limit):
        return {"limit": {"rate": s.rate, "per": s.per, "burst": s.burst}}
    if isinstance(s, layout.Counter):
        return {"counter": None}
    if isinstance(s, layout.SetMark):
        return {"mangle": {"key": MARK, "value": {"|": [MARK, s.bits]}}}
    if isinstance(s, layout.ClearMark):
        return {"mangle": {"key": MARK, "value": {"&": [MARK, 0xFFFFFFFF & ~s.bits]}}}
    if isinstance(s, layout.ClearAndSetMark):
        return {"mangle": {"key": MARK, "value": {"|": [{"&": [MARK, 0xFFFFFFFF & ~s.clear]}, s.set]}}}
    if isinstance(s, layout.Log):
        return {"log": {"prefix": comment(s.prefix, LOG_PREFIX_MAX_BYTES), "group": s.group}}
    if isinstance(s, layout.Reject):
        return {"reject": {"type": "tcp reset"} if s.tcp_reset else None}
    if isinstance(s, layout.Verdict):
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


def chain_json(table: str, priority: int, chain: Chain) -> list[Json]:
    """The ``chain`` object of one layout chain (a base chain: type filter, policy accept),
    followed by its rules."""
    body: Json = {**_table_ref(table), "name": chain.name}
    if chain.hook:
        body.update(type="filter", hook=chain.hook, prio=priority, policy="accept")
    return [{"chain": body}] + [rule_json(table, chain.name, r) for r in chain.rules]


def table_objects(t: Table) -> list[Json]:
    """Every object of a layout table (libnftables-json(5) object form), in dependency order:
    table, sets, chains each followed by its rules (base chains last), verdict maps before the
    base chains that name them."""
    objects: list[Json] = [{"table": {"family": "inet", "name": t.name}}]
    objects += [{"set": set_json(t.name, s)} for s in t.sets]
    base = [c for c in t.chains if c.hook]
    for chain in (c for c in t.chains if not c.hook):
        objects += chain_json(t.name, t.priority, chain)
    for m in t.maps:
        body: Json = {**_table_ref(t.name), "name": m.name, "type": ADDR_TYPE[m.family], "map": "verdict", "comment": m.comment}
        if m.elements:
            body["elem"] = [map_element_json(e) for e in m.elements]
        objects.append({"map": body})
    declared = [chain_json(t.name, t.priority, chain) for chain in base]
    objects += [objs[0] for objs in declared]  # the base chains, then their rules
    objects += [rule for objs in declared for rule in objs[1:]]
    return objects


def ruleset_objects(model: RuleModel) -> list[Json]:
    """:func:`table_objects` of the layout of ``model`` (:func:`layout.table`)."""
    return table_objects(layout.table(model))


def set_json(table: str, s: AddressSet) -> Json:
    """The ``set`` object of a shared set, with its elements (libnftables-json(5) SET)."""
    body: Json = {**_table_ref(table), "name": s.name, "comment": s.comment}
    if s.kind == "named_port":
        body["type"] = [ADDR_TYPE[s.family], "inet_proto", "inet_service"]
    elif s.kind == "interval":
        body["type"], body["flags"] = ADDR_TYPE[s.family], ["interval"]
    else:
        body["type"] = ADDR_TYPE[s.family]
    if s.elements:
        body["elem"] = [element_json(e) for e in s.elements]
    return body


def map_element_json(element: layout.MapElement) -> list[Any]:
    """A verdict map element: the local pod's address -> jump to its pod chain."""
    return [element.address, {"jump": {"target": element.chain}}]


def element_json(element: Any) -> Any:
    """A set element of the rule model as libnftables JSON: an address, a network (``prefix``)
    or an ``address . protocol . port`` triple (``concat``)."""
    if isinstance(element, tuple):
        return {"concat": list(element)}
    return _prefix(element) if "/" in element else element


def _prefix(cidr: str) -> Json:
    addr, _, length = cidr.partition("/")
    return {"prefix": {"addr": addr, "len": int(length)}}


def replace_transaction(table_name: str, objects: list[Json]) -> Json:
    """One libnftables JSON batch that atomically replaces table ``inet <table_name>`` with
    ``objects``: ``add table`` (so a first load works), ``delete table``, then every object.
    Other tables are never named."""
    table = {"table": {"family": "inet", "name": table_name}}
    return {"nftables": [{"add": table}, {"delete": table}] + [{"add": o} for o in objects]}


def full_transaction(model: RuleModel) -> Json:
    """:func:`replace_transaction` of the whole ruleset of ``model``."""
    return replace_transaction(model.config.table, ruleset_objects(model))


def to_json(model: RuleModel) -> str:
    """:func:`full_transaction` as indented JSON text (input for ``nft -j -f``)."""
    return orjson.dumps(full_transaction(model), option=orjson.OPT_INDENT_2).decode()
