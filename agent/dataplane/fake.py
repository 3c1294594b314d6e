"""An in-memory nftables dataplane for fast tests (knftables' ``Fake``, for our commands).

:class:`FakeTable` applies libnftables JSON batches (libnftables-json(5)) the way the kernel
does for the commands nftpolicy sends, and refuses what the kernel refuses: a reference to a set
or chain that does not exist, deleting an element that is not there, deleting a set or chain that
something still uses. A batch lands whole or not at all, as one transaction does.
:class:`FakeNftDataplane` is a :class:`~nftpolicy.agent.dataplane.Dataplane` over one such table,
with failure injection and a printer.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from nftpolicy.translators import nft, nfttext
from nftpolicy.translators.rules import RuleModel

from . import DataplaneError


class FakeNftError(DataplaneError):
    """A command the kernel would refuse; the table keeps its state from before the batch."""


def _key(element: Any) -> Any:
    if isinstance(element, list):  # a map element: [key, verdict]
        return _key(element[0])
    if isinstance(element, dict):
        if "prefix" in element:
            return f"{element['prefix']['addr']}/{element['prefix']['len']}"
        if "concat" in element:
            return tuple(element["concat"])
    return element if not isinstance(element, dict) else json.dumps(element, sort_keys=True)


def _references(expr: Any) -> tuple[set[str], set[str]]:
    """(sets named with ``@``, chains jumped to) anywhere in an expression."""
    sets: set[str] = set()
    chains: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, str) and node.startswith("@"):
            sets.add(node[1:])
        elif isinstance(node, dict):
            for verb in ("jump", "goto"):
                if verb in node and isinstance(node[verb], dict):
                    chains.add(node[verb]["target"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(expr)
    return sets, chains


class FakeTable:
    """One ``inet`` table: sets and maps (definition, {element key: element}), chains (definition,
    rules in order)."""

    def __init__(self) -> None:
        self.exists = False
        self.sets: dict[str, tuple[dict[str, Any], dict[Any, Any]]] = {}
        self.chains: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}

    def apply(self, batch: dict[str, Any]) -> "FakeTable":
        """Apply every command of ``batch`` or none (raises FakeNftError naming the command)."""
        before = copy.deepcopy((self.exists, self.sets, self.chains))
        try:
            for command in batch["nftables"]:
                ((verb, body),) = command.items()
                ((kind, obj),) = body.items()
                getattr(self, f"_{verb}_{kind}")(obj)
        except FakeNftError:
            self.exists, self.sets, self.chains = before
            raise
        return self

    def state(self) -> tuple[Any, ...]:
        """Everything in the table, comparable (element order does not count; rule order does)."""
        sets = {name: (json.dumps(d, sort_keys=True), sorted(map(repr, e.items()))) for name, (d, e) in self.sets.items()}
        chains = {name: (json.dumps(d, sort_keys=True), [json.dumps(r, sort_keys=True) for r in rules])
                  for name, (d, rules) in self.chains.items()}
        return self.exists, sets, chains

    def _users(self) -> tuple[set[str], set[str]]:
        sets: set[str] = set()
        chains: set[str] = set()
        for _, rules in self.chains.values():
            for rule in rules:
                s, c = _references(rule["expr"])
                sets |= s
                chains |= c
        for _, elements in self.sets.values():
            _, c = _references(list(elements.values()))
            chains |= c
        return sets, chains

    def _add_table(self, obj: dict[str, Any]) -> None:
        self.exists = True

    def _delete_table(self, obj: dict[str, Any]) -> None:
        if not self.exists:
            raise FakeNftError(f"delete table {obj['name']}: no such table")
        self.exists, self.sets, self.chains = False, {}, {}

    def _add_set(self, obj: dict[str, Any]) -> None:
        definition = {k: v for k, v in obj.items() if k != "elem"}
        if obj["name"] in self.sets and self.sets[obj["name"]][0] != definition:
            raise FakeNftError(f"add set {obj['name']}: exists with another definition")
        elements = self.sets.setdefault(obj["name"], (definition, {}))[1]
        elements.update({_key(e): e for e in obj.get("elem", ())})

    _add_map = _add_set

    def _delete_set(self, obj: dict[str, Any]) -> None:
        if obj["name"] not in self.sets:
            raise FakeNftError(f"delete set {obj['name']}: no such set")
        if obj["name"] in self._users()[0]:
            raise FakeNftError(f"delete set {obj['name']}: in use by a rule")
        del self.sets[obj["name"]]

    def _add_element(self, obj: dict[str, Any]) -> None:
        if obj["name"] not in self.sets:
            raise FakeNftError(f"add element to {obj['name']}: no such set")
        for element in obj["elem"]:
            _, chains = _references(element)
            if chains - self.chains.keys():
                raise FakeNftError(f"add element to {obj['name']}: no chain {sorted(chains - self.chains.keys())}")
            self.sets[obj["name"]][1][_key(element)] = element

    def _delete_element(self, obj: dict[str, Any]) -> None:
        if obj["name"] not in self.sets:
            raise FakeNftError(f"delete element from {obj['name']}: no such set")
        elements = self.sets[obj["name"]][1]
        for element in obj["elem"]:
            if _key(element) not in elements:
                raise FakeNftError(f"delete element {element!r} from {obj['name']}: not there")
            del elements[_key(element)]

    def _add_chain(self, obj: dict[str, Any]) -> None:
        self.chains.setdefault(obj["name"], (obj, []))

    def _flush_chain(self, obj: dict[str, Any]) -> None:
        if obj["name"] not in self.chains:
            raise FakeNftError(f"flush chain {obj['name']}: no such chain")
        self.chains[obj["name"]][1].clear()

    def _delete_chain(self, obj: dict[str, Any]) -> None:
        if obj["name"] not in self.chains:
            raise FakeNftError(f"delete chain {obj['name']}: no such chain")
        if obj["name"] in self._users()[1]:
            raise FakeNftError(f"delete chain {obj['name']}: still jumped to")
        del self.chains[obj["name"]]

    def _add_rule(self, obj: dict[str, Any]) -> None:
        if obj["chain"] not in self.chains:
            raise FakeNftError(f"add rule to {obj['chain']}: no such chain")
        sets, chains = _references(obj["expr"])
        if sets - self.sets.keys() or chains - self.chains.keys():
            raise FakeNftError(f"add rule to {obj['chain']}: references {sorted((sets - self.sets.keys()) | (chains - self.chains.keys()))}")
        self.chains[obj["chain"]][1].append(obj)


class FakeNftDataplane:
    """A :class:`~nftpolicy.agent.dataplane.Dataplane` that keeps our table in memory.

    ``batches`` records every batch that landed; :meth:`refuse_next` makes the next ``count``
    batches fail as the kernel would refuse them; :meth:`lose_table` is another tool flushing the
    ruleset; ``missing`` is what :meth:`missing_features` reports.
    """

    def __init__(self, table: str = "nftpolicy", missing: list[str] | None = None) -> None:
        self.table = table
        self.state = FakeTable()
        self.batches: list[dict[str, Any]] = []
        self.missing = list(missing or [])
        self._refusals: list[str] = []

    def refuse_next(self, reason: str = "Operation not permitted", count: int = 1) -> None:
        """The next ``count`` batches fail with ``reason`` and change nothing."""
        self._refusals += [reason] * count

    def lose_table(self) -> None:
        """Our table disappears, as after ``nft flush ruleset``."""
        self.state = FakeTable()

    def missing_features(self) -> list[str]:
        return list(self.missing)

    def run(self, batch: dict[str, Any]) -> None:
        if self._refusals:
            raise FakeNftError(self._refusals.pop(0))
        self.state.apply(batch)
        self.batches.append(batch)

    def replace(self, model: RuleModel) -> None:
        self.run(nft.full_transaction(model))

    def has_table(self) -> bool:
        return self.state.exists and "KUBE-ROUTER-FORWARD" in self.state.chains

    def remove(self) -> bool:
        if not self.state.exists:
            return False
        self.run({"nftables": [{"delete": {"table": {"family": "inet", "name": self.table}}}]})
        return True

    def text(self) -> str:
        """The table in nft syntax: sets with their elements (sorted), then chains with their
        rules, each in name order (``""`` when there is no table)."""
        if not self.state.exists:
            return ""
        lines = [f"table inet {self.table} {{"]
        for name, (_, elements) in sorted(self.state.sets.items()):
            items = sorted(nfttext.element_text(e) for e in elements.values())
            lines.append(f"\tset {name} {{ " + ", ".join(items) + " }" if items else f"\tset {name} {{ }}")
        for name, (_, rules) in sorted(self.state.chains.items()):
            lines.append(f"\tchain {name} {{")
            lines += [f"\t\t{nfttext.rule_text(rule)}" for rule in rules]
            lines.append("\t}")
        return "\n".join(lines + ["}", ""])
