"""Typed transaction -> nft(8) input syntax: ``nft -f`` text of the same commands.

Each object is printed from its libnftables JSON (:mod:`nftpolicy.translators.nft`, the one
writer of it), so the text and the JSON batch load to the same kernel state
(``tests/test_render_load.py``).
"""

from __future__ import annotations

from typing import Any

from . import transaction
from .nft import Json, object_json, table_objects
from .rules import RuleModel
from .transaction import Operation, Replace, Transaction


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
    if key == "elem":  # an element with its timeout
        return f"{_value(body['val'])} timeout {body['timeout']}s"
    if key == "payload":
        return f"{body['protocol']} {body['field']}"
    if key in ("meta", "ct"):
        return f"{key} {body['dir'] + ' ' if 'dir' in body else ''}{body['key']}"
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
    if key == "meter":
        return f"meter {body['name']} size {body['size']} {{ {_value(body['key'])} {_statement(body['stmt'])} }}"
    if key == "log":
        return f'log prefix "{body["prefix"]}" group {body["group"]}'
    if key == "counter":
        return "counter"
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
    ``10.0.0.1 . tcp . 80`` or ``10.0.0.1 : jump KUBE-POD-IN-...``."""
    if isinstance(element, list):
        return f"{_value(element[0])} : {_value(element[1])}"
    return _value(element)


def _set_fields(kind: str, body: Json) -> tuple[list[str], list[str]]:
    """The declarations of a set or map body (type, flags, comment) and its elements' texts."""
    types = body["type"] if isinstance(body["type"], list) else [body["type"]]
    fields = [f"type {' . '.join(types)}" + (" : verdict" if kind == "map" else "")]
    if body.get("flags"):
        fields.append(f"flags {','.join(body['flags'])}")
    fields.append(f"comment {_quoted(body['comment'])}")
    return fields, [element_text(e) for e in body.get("elem", ())]


def _set_text(kind: str, body: Json) -> list[str]:
    fields, items = _set_fields(kind, body)
    lines = [f"\t{kind} {body['name']} {{"] + [f"\t\t{f}" for f in fields]
    if items:
        lines.append("\t\telements = { " + ",\n\t\t\t     ".join(items) + " }")
    return lines + ["\t}"]


def _replace_text(table: str, replace: Replace) -> list[str]:
    """``table`` (creates it on a first load), ``delete table``, then the table's full definition
    as one ``table inet <name> { ... }`` block."""
    lines = [f"table inet {table}", f"delete table inet {table}", f"table inet {table} {{"]
    chains: dict[str, list[str]] = {}
    for obj in table_objects(replace.table):
        (kind, body), = obj.items()
        if kind in ("set", "map"):
            lines.extend(_set_text(kind, body))
        elif kind == "chain":
            chains[body["name"]] = [f"\t\t{_base_chain_text(body)}"] if "hook" in body else []
        elif kind == "rule":
            chains[body["chain"]].append("\t\t" + rule_text(body))
    for chain, body_lines in chains.items():
        lines.extend([f"\tchain {chain} {{", *body_lines, "\t}"])
    return lines + ["}"]


def _base_chain_text(body: Json) -> str:
    return f"type {body['type']} hook {body['hook']} priority {body['prio']}; policy {body['policy']};"


def _command_text(tx: Transaction, op: Operation) -> str:
    """One operation as an nft(8) command line (``add rule inet <table> <chain> ...``, ...)."""
    (kind, body), = object_json(tx, op).items()
    where = f"{op.verb} {kind} inet {tx.table}"
    if kind == "table":
        return where
    if kind == "rule":
        return f"{where} {body['chain']} {rule_text(body)}"
    if kind == "element":
        return f"{where} {body['name']} {{ {', '.join(element_text(e) for e in body['elem'])} }}"
    if kind == "chain" and "hook" in body:
        return f"{where} {body['name']} {{ {_base_chain_text(body)} }}"
    if kind in ("set", "map") and op.verb == "add":
        fields, items = _set_fields(kind, body)
        if items:
            fields.append("elements = { " + ", ".join(items) + " }")
        return f"{where} {body['name']} {{ {'; '.join(fields)}; }}"
    return f"{where} {body['name']}"


def transaction_text(tx: Transaction) -> str:
    """``tx`` as ``nft -f`` input, one transaction: a :class:`Replace` as :func:`_replace_text`,
    every other operation as one nft(8) command line. Touches no other table."""
    lines: list[str] = []
    for op in tx.operations:
        if isinstance(op, Replace):
            lines += _replace_text(tx.table, op)
        else:
            lines.append(_command_text(tx, op))
    return "\n".join(lines + [""])


def to_text(model: RuleModel) -> str:
    """The ruleset as ``nft -f`` input that atomically replaces our table and touches no other
    (:func:`transaction_text` of :func:`transaction.full`)."""
    return transaction_text(transaction.full(model))
