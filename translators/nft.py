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

from .model import Family, family_of
from .noderender import Changes
from .rules import AddressSet, AllowRule, Config, PodChain, PolicyChain, RuleModel, comment

BASE_CHAINS = {"KUBE-ROUTER-INPUT": "input", "KUBE-ROUTER-FORWARD": "forward", "KUBE-ROUTER-OUTPUT": "output"}
COMMON_CHAIN = "KUBE-NWPLCY-COMMON"
DEFAULT_CHAIN = "KUBE-NWPLCY-DEFAULT"
POD_MAPS: dict[Family, str] = {"ipv4": "KUBE-POD-FW-MAP4", "ipv6": "KUBE-POD-FW-MAP6"}
IP: dict[Family, str] = {"ipv4": "ip", "ipv6": "ip6"}
ADDR_TYPE: dict[Family, str] = {"ipv4": "ipv4_addr", "ipv6": "ipv6_addr"}
# Essential ICMP (RFC 4890 for ICMPv6): errors that TCP/UDP need and neighbour discovery.
# Echo is not here: whether ping is allowed is the policies' decision.
ESSENTIAL_ICMP = ["destination-unreachable", "time-exceeded", "parameter-problem"]
ESSENTIAL_ICMPV6 = ["destination-unreachable", "packet-too-big", "time-exceeded", "parameter-problem",
                    "nd-router-solicit", "nd-router-advert", "nd-neighbor-solicit", "nd-neighbor-advert"]

LOG_PREFIX_MAX_BYTES = 127  # the kernel's NF_LOG_PREFIXLEN, NUL included
Json = dict[str, Any]
MARK: Json = {"meta": {"key": "mark"}}
L4PROTO: Json = {"meta": {"key": "l4proto"}}
DPORT: Json = {"payload": {"protocol": "th", "field": "dport"}}


def _payload(protocol: str, field: str) -> Json:
    return {"payload": {"protocol": protocol, "field": field}}


def _match(left: Any, right: Any, op: str = "==") -> Json:
    return {"match": {"op": op, "left": left, "right": right}}


def _set_mark(bits: int) -> Json:
    return {"mangle": {"key": MARK, "value": {"|": [MARK, bits]}}}


def _clear_mark(bits: int) -> Json:
    return {"mangle": {"key": MARK, "value": {"&": [MARK, 0xFFFFFFFF & ~bits]}}}


def _unmarked(bits: int) -> Json:
    return _match({"&": [MARK, bits]}, 0)


def _addresses(ips: list[str]) -> Any:
    return ips[0] if len(ips) == 1 else {"set": ips}


def _jump(target: str) -> Json:
    return {"jump": {"target": target}}


class _Builder:
    """Collects the table's objects in dependency order."""

    def __init__(self, model: RuleModel) -> None:
        self.model = model
        self.config = model.config
        self.table = {"family": "inet", "table": model.config.table}
        self.objects: list[Json] = []

    def chain(self, name: str, hook: str | None = None) -> None:
        body: Json = {**self.table, "name": name}
        if hook:
            body.update(type="filter", hook=hook, prio=self.config.priority, policy="accept")
        self.objects.append({"chain": body})

    def rule(self, chain: str, expr: list[Json], text: str = "") -> None:
        body: Json = {**self.table, "chain": chain, "expr": expr}
        if text:
            body["comment"] = comment(text)
        self.objects.append({"rule": body})

    def address_set(self, s: AddressSet) -> None:
        self.objects.append({"set": _set_body(self.config, s)})

    def build(self) -> list[Json]:
        m, c = self.model, self.config
        self.objects.append({"table": {"family": "inet", "name": c.table}})
        for s in m.sets:
            self.address_set(s)
        self._common()
        self.chain(DEFAULT_CHAIN)
        self.rule(DEFAULT_CHAIN, [_set_mark(c.policy_mark)], "allow a direction that no policy isolates")
        for chain in m.policy_chains:
            self._policy_chain(chain)
        for pod in m.pod_chains:
            self._pod_chain(pod)
        for family, name in POD_MAPS.items():
            elements = [_dispatch(ip, p.name) for p in m.pod_chains for ip in p.ips if family_of(ip) == family]
            body: Json = {**self.table, "name": name, "type": ADDR_TYPE[family], "map": "verdict",
                          "comment": f"local isolated pods ({family}) -> KUBE-POD-FW chain"}
            if elements:
                body["elem"] = elements
            self.objects.append({"map": body})
        self._base_chains()
        return self.objects

    def _common(self) -> None:
        self.chain(COMMON_CHAIN)
        ct_state = {"ct": {"key": "state"}}
        self.rule(COMMON_CHAIN, [_match(ct_state, "invalid", "in"), {"drop": None}], "drop invalid conntrack state")
        self.rule(COMMON_CHAIN, [_match(ct_state, ["established", "related"], "in"), {"accept": None}],
                  "allow established and related connections")
        self.rule(COMMON_CHAIN, [_match(_payload("icmp", "type"), {"set": ESSENTIAL_ICMP}), {"accept": None}],
                  "allow essential ICMP errors")
        self.rule(COMMON_CHAIN, [_match(_payload("icmpv6", "type"), {"set": ESSENTIAL_ICMPV6}), {"accept": None}],
                  "allow essential ICMPv6 errors and neighbour discovery")

    def _policy_chain(self, chain: PolicyChain) -> None:
        self.chain(chain.name)
        for allow in chain.rules:
            self.rule(chain.name, _allow_expr(allow, chain, self.config.policy_mark), allow.comment)

    def _pod_chain(self, pod: PodChain) -> None:
        c, name = self.config, pod.name
        self.chain(name)
        self.rule(name, [_jump(COMMON_CHAIN)], f"{pod.pod} common")
        self.rule(name, [_clear_mark(c.policy_mark)], f"{pod.pod} start unmarked")
        by_family = {f: [ip for ip in pod.ips if family_of(ip) == f] for f in IP}
        by_family = {f: ips for f, ips in by_family.items() if ips}
        for family, ips in by_family.items():
            dst = _match(_payload(IP[family], "daddr"), _addresses(ips))
            local_src = _match({"fib": {"result": "type", "flags": ["saddr"]}}, "local")
            self.rule(name, [dst, local_src, {"accept": None}], f"{pod.pod} from the local node")
        unmarked = _unmarked(c.policy_mark)
        for direction, chains, field in (("ingress", pod.ingress, "daddr"), ("egress", pod.egress, "saddr")):
            for target in chains if chains is not None else (DEFAULT_CHAIN,):
                for family, ips in by_family.items():
                    # Only while no policy has allowed the packet yet: the first allow ends the
                    # walk (same verdict, one mark test instead of a policy chain per policy).
                    self.rule(name, [_match(_payload(IP[family], field), _addresses(ips)), unmarked, _jump(target)],
                              f"{pod.pod} {direction}")
        log = {"log": {"prefix": comment(f"nftpolicy reject {pod.pod}: ", LOG_PREFIX_MAX_BYTES), "group": c.nflog_group}}
        self.rule(name, [unmarked, {"limit": {"rate": 10, "per": "minute", "burst": 10}}, log], f"{pod.pod} log rejected")
        self.rule(name, [unmarked, _match(L4PROTO, "tcp"), {"reject": {"type": "tcp reset"}}], f"{pod.pod} reject")
        self.rule(name, [unmarked, {"reject": None}], f"{pod.pod} reject")
        self.rule(name, [_clear_mark(c.policy_mark)], f"{pod.pod} clear policy mark")
        self.rule(name, [_set_mark(c.passed_mark)], f"{pod.pod} passed")

    def _base_chains(self) -> None:
        c = self.config
        for name, hook in BASE_CHAINS.items():
            self.chain(name, hook)
        for cidr in c.service_cidrs:
            family = family_of(cidr)
            self.rule("KUBE-ROUTER-INPUT", [_match(_payload(IP[family], "daddr"), _prefix(cidr)), {"return": None}],
                      "allow traffic to service cluster IPs")
        if c.node_port_range:
            low, high = c.node_port_range
            self.rule("KUBE-ROUTER-INPUT", [
                _match({"fib": {"result": "type", "flags": ["daddr"]}}, "local"),
                _match(L4PROTO, {"set": ["tcp", "udp", "sctp"]}),
                _match(DPORT, {"range": [low, high]}), {"return": None}], "allow node ports on local addresses")
        for cidr in c.external_cidrs:
            self.rule("KUBE-ROUTER-INPUT", [_match(_payload(IP[family_of(cidr)], "daddr"), _prefix(cidr)), {"return": None}],
                      "allow traffic to external and load-balancer IPs")
        dispatch = {"KUBE-ROUTER-INPUT": ("saddr",), "KUBE-ROUTER-FORWARD": ("daddr", "saddr"), "KUBE-ROUTER-OUTPUT": ("daddr", "saddr")}
        for name, fields in dispatch.items():
            # Same verdict as KUBE-NWPLCY-COMMON gives them, without the map lookups and jumps.
            self.rule(name, [_match({"ct": {"key": "state"}}, ["established", "related"], "in"), {"accept": None}],
                      "allow established and related connections")
            for field in fields:
                for family, pod_map in POD_MAPS.items():
                    what = "to" if field == "daddr" else "from"
                    self.rule(name, [{"vmap": {"key": _payload(IP[family], field), "data": f"@{pod_map}"}}],
                              f"traffic {what} local isolated pods ({family})")


def _set_body(config: Config, s: AddressSet) -> Json:
    """The ``set`` object of a shared set, with its elements (libnftables-json(5) SET)."""
    body: Json = {"family": "inet", "table": config.table, "name": s.name, "comment": s.comment}
    if s.kind == "named_port":
        body["type"] = [ADDR_TYPE[s.family], "inet_proto", "inet_service"]
    elif s.kind == "interval":
        body["type"], body["flags"] = ADDR_TYPE[s.family], ["interval"]
    else:
        body["type"] = ADDR_TYPE[s.family]
    if s.elements:
        body["elem"] = [element_json(e) for e in s.elements]
    return body


def _dispatch(ip: str, pod_chain: str) -> list[Any]:
    """A verdict map element: the local pod's address -> jump to its pod chain."""
    return [ip, _jump(pod_chain)]


def element_json(element: Any) -> Any:
    """A set element of the rule model as libnftables JSON: an address, a network (``prefix``)
    or an ``address . protocol . port`` triple (``concat``)."""
    if isinstance(element, tuple):
        return {"concat": list(element)}
    return _prefix(element) if "/" in element else element


def _prefix(cidr: str) -> Json:
    addr, _, length = cidr.partition("/")
    return {"prefix": {"addr": addr, "len": int(length)}}


def _allow_expr(allow: AllowRule, chain: PolicyChain, mark: int) -> list[Json]:
    """Matches of one allowed (peers, port) tuple, then set the policy mark and return."""
    expr: list[Json] = []
    if allow.peer_set:
        assert allow.family
        field = "saddr" if chain.direction == "ingress" else "daddr"
        expr.append(_match(_payload(IP[allow.family], field), f"@{allow.peer_set}"))
    if allow.named_port_set:
        assert allow.family
        expr.append(_match({"concat": [_payload(IP[allow.family], "daddr"), L4PROTO, DPORT]}, f"@{allow.named_port_set}"))
    if allow.port:
        expr.append(_match(L4PROTO, allow.port.protocol.lower()))
        if allow.port.first is not None:
            first, last = allow.port.first, allow.port.last
            expr.append(_match(DPORT, first if first == last else {"range": [first, last]}))
    return expr + [_set_mark(mark), {"return": None}]


def ruleset_objects(model: RuleModel) -> list[Json]:
    """Every object of our table (libnftables-json(5) object form), in dependency order:
    table, sets, chains each followed by its rules, verdict maps, base chains."""
    return _Builder(model).build()


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


def _set_text(kind: str, body: Json) -> list[str]:
    types = body["type"] if isinstance(body["type"], list) else [body["type"]]
    lines = [f"\t{kind} {body['name']} {{", f"\t\ttype {' . '.join(types)}" + (" : verdict" if kind == "map" else "")]
    if body.get("flags"):
        lines.append(f"\t\tflags {','.join(body['flags'])}")
    lines.append(f"\t\tcomment {_quoted(body['comment'])}")
    if body.get("elem"):
        items = [f"{_value(k)} : {_value(v)}" if kind == "map" else _value(k)
                 for k, v in ((e if kind == "map" else (e, None)) for e in body["elem"])]
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
    builder = _Builder(RuleModel(config, (), (), ()))
    if isinstance(chain, PolicyChain):
        builder._policy_chain(chain)
    else:
        builder._pod_chain(chain)
    return builder.objects


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
    cmds.extend({"add": {"set": _set_body(config, s)}} for s in changes.sets_added)
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
        new = {ip: name for ip in after.ips} if isinstance(after, PodChain) else {}
        stale_ips = [ip for ip in old if ip not in new]
        for ip in stale_ips:
            stale[family_of(ip)].append(ip)
        for ip in new.keys() - old.keys():
            fresh[family_of(ip)].append(_dispatch(ip, name))
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
