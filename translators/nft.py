"""Rule model -> nftables: libnftables JSON objects, and the same objects as ``nft -f`` text.

The JSON objects (libnftables-json(5)) are the single source: :func:`ruleset_objects` builds them,
:func:`full_transaction` wraps them in the one-transaction replace that the agent and the sandbox
run, and :func:`to_text` prints them in nft's input syntax (nft(8)). Only native nft expressions
are used (no ``xt`` compat matches), so the ruleset loads on nft-only hosts.

Layout (DESIGN.md section 2), in one ``inet`` table:

* base chains ``KUBE-ROUTER-INPUT/FORWARD/OUTPUT`` (type filter, policy accept): exemptions
  first in INPUT, then verdict-map dispatch on the local pod's address
  (``ip daddr vmap @KUBE-POD-FW-MAP4`` for traffic to a pod, ``saddr`` for traffic from it);
* ``KUBE-NWPLCY-COMMON`` (conntrack, essential ICMP) and ``KUBE-NWPLCY-DEFAULT``;
* ``KUBE-POD-FW-<hash>`` per isolated local pod, ``KUBE-NWPLCY-<hash>`` per policy direction.

Marks are only ever changed with a mask: ``meta mark set meta mark | <bit>`` and
``meta mark set meta mark & ~<bit>`` (kube-router's "mask mark reset" fix), so other systems'
mark bits survive our chains.
"""

from __future__ import annotations

from typing import Any

import orjson

from . import layout
from .layout import POD_MAPS, Chain, Rule, Statement, Table
from .model import Family, family_of
from .noderender import Changes
from .rules import AddressSet, Config, PodChain, PolicyChain, RuleModel, comment

IP: dict[Family, str] = {"ipv4": "ip", "ipv6": "ip6"}
ICMP: dict[Family, str] = {"ipv4": "icmp", "ipv6": "icmpv6"}
ADDR_TYPE: dict[Family, str] = {"ipv4": "ipv4_addr", "ipv6": "ipv6_addr"}
LOG_PREFIX_MAX_BYTES = 127  # the kernel's NF_LOG_PREFIXLEN, NUL included
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
    (libnftables-json(5): MATCH, MANGLE, VERDICT, REJECT, LOG, LIMIT, VMAP)."""
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
    if isinstance(s, layout.Limit):
        return {"limit": {"rate": s.rate, "per": s.per, "burst": s.burst}}
    if isinstance(s, layout.SetMark):
        return {"mangle": {"key": MARK, "value": {"|": [MARK, s.bits]}}}
    if isinstance(s, layout.ClearMark):
        return {"mangle": {"key": MARK, "value": {"&": [MARK, 0xFFFFFFFF & ~s.bits]}}}
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
    objects += [{"set": _set_body(t.name, s)} for s in t.sets]
    base = [c for c in t.chains if c.hook]
    for chain in (c for c in t.chains if not c.hook):
        objects += chain_json(t.name, t.priority, chain)
    for m in t.maps:
        body: Json = {**_table_ref(t.name), "name": m.name, "type": ADDR_TYPE[m.family], "map": "verdict", "comment": m.comment}
        if m.elements:
            body["elem"] = [_dispatch(e) for e in m.elements]
        objects.append({"map": body})
    declared = [chain_json(t.name, t.priority, chain) for chain in base]
    objects += [objs[0] for objs in declared]  # the base chains, then their rules
    objects += [rule for objs in declared for rule in objs[1:]]
    return objects


def ruleset_objects(model: RuleModel) -> list[Json]:
    """:func:`table_objects` of the layout of ``model`` (:func:`layout.table`)."""
    return table_objects(layout.table(model))


def _set_body(table: str, s: AddressSet) -> Json:
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


def _dispatch(element: layout.MapElement) -> list[Any]:
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


# ---- nft(8) input syntax for the same objects -------------------------------------------------

def _value(v: Any, hex_ints: bool = False) -> str:
    if isinstance(v, bool) or v is None:
        raise ValueError(f"no nft syntax for {v!r}")
    if isinstance(v, int):
        return f"0x{v:08x}" if hex_ints else str(v)
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return ",".join(_value(x) for x in v)
    (key, body), = v.items()
    if key == "payload":
        return f"{body['protocol']} {body['field']}"
    if key in ("meta", "ct"):
        return f"{key} {body['key']}"
    if key == "fib":
        return f"fib {' . '.join(body['flags'])} {body['result']}"
    if key == "concat":
        return " . ".join(_value(x) for x in body)
    if key == "range":
        return f"{_value(body[0])}-{_value(body[1])}"
    if key == "prefix":
        return f"{body['addr']}/{body['len']}"
    if key == "set":
        return "{ " + ", ".join(_value(x) for x in body) + " }"
    if key in ("&", "|"):
        return f"{_value(body[0])} {key} {_value(body[1], hex_ints=True)}"
    if key == "jump":
        return f"jump {body['target']}"
    raise ValueError(f"no nft syntax for {key!r}")


def _statement(s: Json) -> str:
    (key, body), = s.items()
    if key == "match":
        binop = isinstance(body["left"], dict) and "&" in body["left"]
        right = _value(body["right"], hex_ints=binop)
        op = "== " if binop else "" if body["op"] in ("==", "in") else f"{body['op']} "
        return f"{_value(body['left'])} {op}{right}"
    if key == "mangle":
        return f"{_value(body['key'])} set {_value(body['value'])}"
    if key in ("accept", "drop", "return"):
        return key
    if key == "jump":
        return _value(s)
    if key == "vmap":
        return f"{_value(body['key'])} vmap {body['data']}"
    if key == "limit":
        return f"limit rate {body['rate']}/{body['per']} burst {body['burst']} packets"
    if key == "log":
        return f'log prefix "{body["prefix"]}" group {body["group"]}'
    if key == "reject":
        return "reject" if body is None else f"reject with {body['type']}"
    raise ValueError(f"no nft syntax for statement {key!r}")


def _quoted(text: str) -> str:
    return '"' + text.replace('"', "'") + '"'


def rule_text(rule: Json) -> str:
    """One rule object as nft syntax (``ip saddr @KUBE-PODS-... return comment "..."``)."""
    text = " ".join(_statement(s) for s in rule["expr"])
    return f"{text} comment {_quoted(rule['comment'])}" if rule.get("comment") else text


def element_text(element: Any) -> str:
    """One set or map element (libnftables JSON) in nft syntax: ``10.0.0.1``, ``10.0.0.0/8``,
    ``10.0.0.1 . tcp . 80`` or ``10.0.0.1 : jump KUBE-POD-FW-...``."""
    if isinstance(element, list):
        return f"{_value(element[0])} : {_value(element[1])}"
    return _value(element)


def _set_text(kind: str, body: Json) -> list[str]:
    types = body["type"] if isinstance(body["type"], list) else [body["type"]]
    lines = [f"\t{kind} {body['name']} {{", f"\t\ttype {' . '.join(types)}" + (" : verdict" if kind == "map" else "")]
    if body.get("flags"):
        lines.append(f"\t\tflags {','.join(body['flags'])}")
    lines.append(f"\t\tcomment {_quoted(body['comment'])}")
    if body.get("elem"):
        items = [element_text(e) for e in body["elem"]]
        lines.append("\t\telements = { " + ",\n\t\t\t     ".join(items) + " }")
    return lines + ["\t}"]


def to_text(model: RuleModel) -> str:
    """The ruleset as ``nft -f`` input that atomically replaces our table and touches no other.

    The file is one transaction: ``table`` (creates it on a first load), ``delete table``, then
    the table's full definition.
    """
    name = model.config.table
    lines = [f"table inet {name}", f"delete table inet {name}", f"table inet {name} {{"]
    chains: dict[str, list[str]] = {}
    for obj in ruleset_objects(model):
        (kind, body), = obj.items()
        if kind in ("set", "map"):
            lines.extend(_set_text(kind, body))
        elif kind == "chain":
            header = []
            if "hook" in body:
                header = [f"\t\ttype {body['type']} hook {body['hook']} priority {body['prio']}; policy {body['policy']};"]
            chains[body["name"]] = header
        elif kind == "rule":
            chains[body["chain"]].append("\t\t" + rule_text(body))
    for chain, body_lines in chains.items():
        lines.extend([f"\tchain {chain} {{", *body_lines, "\t}"])
    return "\n".join(lines + ["}", ""])


# ---- incremental updates ------------------------------------------------------------------------

def chain_objects(config: Config, chain: PolicyChain | PodChain) -> list[Json]:
    """The ``chain`` object of one policy or pod chain followed by its rules (the same objects
    :func:`ruleset_objects` has for it)."""
    decided = layout.policy_chain(config, chain) if isinstance(chain, PolicyChain) else layout.pod_chain(config, chain)
    return chain_json(config.table, config.priority, decided)


def changes_transaction(config: Config, changes: Changes) -> Json:
    """One libnftables JSON batch that applies ``changes`` (what the model gained and lost since
    the kernel last took it) to our table: the cost is the size of the change, not of the table.

    Order, so that each command only references what exists by then: add new sets and new
    (empty) chains; delete stale elements, then add new ones; flush and refill every changed
    chain and fill new ones; move the verdict-map dispatch of changed pod chains; flush, then
    delete removed chains (pod chains, then policy chains); delete removed sets.
    """
    table = {"family": "inet", "table": config.table}
    cmds: list[Json] = [{"add": {"table": {"family": "inet", "name": config.table}}}]
    cmds.extend({"add": {"set": _set_body(config.table, s)}} for s in changes.sets_added)
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
            fresh[family_of(ip)].append(_dispatch(layout.MapElement(ip, name, new[ip].pod)))
    for family, ips in stale.items():  # deletions first: an address may move to another pod chain
        if ips:
            cmds.append({"delete": {"element": {**table, "name": POD_MAPS[family], "elem": sorted(ips)}}})
    for family, elements in fresh.items():
        if elements:
            cmds.append({"add": {"element": {**table, "name": POD_MAPS[family], "elem": sorted(elements, key=lambda e: e[0])}}})
    removed = sorted(changes.chains.items(), key=lambda kv: isinstance(kv[1][0], PolicyChain))
    for name, (before, after) in removed:
        if after is None:
            cmds.append({"flush": {"chain": {**table, "name": name}}})
            cmds.append({"delete": {"chain": {**table, "name": name}}})
    cmds.extend({"delete": {"set": {**table, "name": name}}} for name in changes.sets_removed)
    return {"nftables": cmds}
