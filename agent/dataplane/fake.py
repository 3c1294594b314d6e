"""An in-memory nftables dataplane for fast tests (knftables' ``Fake``, for our objects).

:class:`FakeTable` applies typed transactions (:mod:`nftpolicy.translators.transaction`) the way
the kernel applies the libnftables batch printed from them, and refuses what the kernel
refuses: a reference to a set or chain that does not exist, deleting an element that is not
there, deleting a set or chain that something still uses. A transaction lands whole or not at
all, as in the kernel. :class:`FakeNftDataplane` is a
:class:`~nftpolicy.agent.dataplane.Dataplane` over one such table, with failure injection and a
printer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from nftpolicy.translators import layout, nft, nfttext
from nftpolicy.translators.rules import AddressSet, TimedAddress
from nftpolicy.translators.transaction import ChainRule, Elements, Operation, OurTable, Replace, SetName, Transaction, removing

from . import DataplaneError

SetDefinition = AddressSet | layout.VerdictMap  # with its elements left out


class FakeNftError(DataplaneError):
    """A command the kernel would refuse; the table keeps its state from before the transaction."""


def _key(element: Any) -> Any:
    """What identifies a set or map element: its address, network or triple (a map element's
    address)."""
    return element.address if isinstance(element, (layout.MapElement, TimedAddress)) else element


def _references(rule: layout.Rule) -> tuple[set[str], set[str]]:
    """(sets and maps the rule looks up, chains it jumps to)."""
    sets: set[str] = set()
    chains: set[str] = set()
    for s in rule.statements:
        if isinstance(s, (layout.AddressInSet, layout.NamedPortInSet)):
            sets.add(s.name)
        elif isinstance(s, layout.Dispatch):
            sets.add(s.map)
        elif isinstance(s, layout.Jump):
            chains.add(s.target)
    return sets, chains


class FakeTable:
    """One ``inet`` table: sets and maps (definition, {element key: element}), chains (hook,
    rules in order)."""

    def __init__(self) -> None:
        self.exists = False
        self.sets: dict[str, tuple[SetDefinition, dict[Any, Any]]] = {}
        self.chains: dict[str, tuple[layout.Hook | None, list[layout.Rule]]] = {}

    def apply(self, tx: Transaction) -> "FakeTable":
        """Apply every operation of ``tx`` or none (raises FakeNftError naming the operation)."""
        before = self._copy()
        try:
            for op in tx.operations:
                if isinstance(op, Replace):
                    self._replace(op.table)
                else:
                    self._operation(op)
        except FakeNftError:
            self.exists, self.sets, self.chains = before
            raise
        return self

    def check(self, tx: Transaction) -> None:
        """Raise FakeNftError where :meth:`apply` would; change nothing either way."""
        before = self._copy()
        try:
            self.apply(tx)
        finally:
            self.exists, self.sets, self.chains = before

    def _copy(self) -> tuple[bool, dict[str, tuple[SetDefinition, dict[Any, Any]]], dict[str, tuple[layout.Hook | None, list[layout.Rule]]]]:
        return (self.exists, {name: (d, dict(e)) for name, (d, e) in self.sets.items()},  # the objects are immutable
                {name: (hook, list(rules)) for name, (hook, rules) in self.chains.items()})

    def state(self) -> tuple[Any, ...]:
        """Everything in the table, comparable (element order does not count; rule order does)."""
        sets = {name: (d, frozenset(e.values())) for name, (d, e) in self.sets.items()}
        chains = {name: (hook, tuple(rules)) for name, (hook, rules) in self.chains.items()}
        return self.exists, sets, chains

    def _replace(self, table: layout.Table) -> None:
        self.exists = True  # add table
        self._delete_table()
        self.exists = True
        for s in table.sets:
            self._add_set(s, s.elements)
        base = [c for c in table.chains if c.hook]
        for chain in (c for c in table.chains if not c.hook):
            self._add_chain(chain)
            for rule in chain.rules:
                self._add_rule(chain.name, rule)
        for m in table.maps:  # after the pod chains they name, before the base chains that look them up
            self._add_set(m, m.elements)
        for chain in base:
            self._add_chain(chain)
            for rule in chain.rules:
                self._add_rule(chain.name, rule)

    def _operation(self, op: Operation) -> None:
        obj = op.object
        if isinstance(obj, OurTable):
            if op.verb == "add":
                self.exists = True
            else:
                self._delete_table()
        elif isinstance(obj, (AddressSet, layout.VerdictMap)):
            self._add_set(obj, obj.elements)
        elif isinstance(obj, SetName):
            self._delete_set(obj.name)
        elif isinstance(obj, layout.Chain):
            {"add": self._add_chain, "flush": self._flush_chain, "delete": self._delete_chain}[op.verb](obj)
        elif isinstance(obj, ChainRule):
            self._add_rule(obj.chain, obj.rule)
        elif op.verb == "add":
            self._add_elements(obj)
        else:
            self._delete_elements(obj)

    def _users(self) -> tuple[set[str], set[str]]:
        sets: set[str] = set()
        chains: set[str] = set()
        for _, rules in self.chains.values():
            for rule in rules:
                s, c = _references(rule)
                sets |= s
                chains |= c
        for _, elements in self.sets.values():
            chains |= {e.chain for e in elements.values() if isinstance(e, layout.MapElement)}
        return sets, chains

    def _delete_table(self) -> None:
        if not self.exists:
            raise FakeNftError("delete table: no such table")
        self.exists, self.sets, self.chains = False, {}, {}

    def _add_set(self, s: SetDefinition, elements: tuple[Any, ...]) -> None:
        definition = dataclasses.replace(s, elements=())
        if s.name in self.sets and self.sets[s.name][0] != definition:
            raise FakeNftError(f"add set {s.name}: exists with another definition")
        self.sets.setdefault(s.name, (definition, {}))
        self._add_elements(Elements(s.name, elements))

    def _delete_set(self, name: str) -> None:
        if name not in self.sets:
            raise FakeNftError(f"delete set {name}: no such set")
        if name in self._users()[0]:
            raise FakeNftError(f"delete set {name}: in use by a rule")
        del self.sets[name]

    def _add_elements(self, obj: Elements) -> None:
        if obj.name not in self.sets:
            raise FakeNftError(f"add element to {obj.name}: no such set")
        for element in obj.elements:
            if isinstance(element, layout.MapElement) and element.chain not in self.chains:
                raise FakeNftError(f"add element to {obj.name}: no chain {element.chain}")
            held = self.sets[obj.name][1].get(_key(element))
            if isinstance(element, layout.MapElement) and held is not None and held != element:
                # the kernel refuses a key mapped to another verdict: "File exists"
                raise FakeNftError(f"add element to {obj.name}: {element.address} is mapped to {held.chain} already")
            self.sets[obj.name][1][_key(element)] = element

    def _delete_elements(self, obj: Elements) -> None:
        if obj.name not in self.sets:
            raise FakeNftError(f"delete element from {obj.name}: no such set")
        elements = self.sets[obj.name][1]
        for element in obj.elements:
            if _key(element) not in elements:
                raise FakeNftError(f"delete element {element!r} from {obj.name}: not there")
            del elements[_key(element)]

    def _add_chain(self, chain: layout.Chain) -> None:
        self.chains.setdefault(chain.name, (chain.hook, []))

    def _flush_chain(self, chain: layout.Chain) -> None:
        if chain.name not in self.chains:
            raise FakeNftError(f"flush chain {chain.name}: no such chain")
        self.chains[chain.name][1].clear()

    def _delete_chain(self, chain: layout.Chain) -> None:
        if chain.name not in self.chains:
            raise FakeNftError(f"delete chain {chain.name}: no such chain")
        if chain.name in self._users()[1]:
            raise FakeNftError(f"delete chain {chain.name}: still jumped to")
        del self.chains[chain.name]

    def _add_rule(self, chain: str, rule: layout.Rule) -> None:
        if chain not in self.chains:
            raise FakeNftError(f"add rule to {chain}: no such chain")
        sets, chains = _references(rule)
        if sets - self.sets.keys() or chains - self.chains.keys():
            raise FakeNftError(f"add rule to {chain}: references {sorted((sets - self.sets.keys()) | (chains - self.chains.keys()))}")
        self.chains[chain][1].append(rule)


class FakeNftDataplane:
    """A :class:`~nftpolicy.agent.dataplane.Dataplane` that keeps our table in memory.

    ``transactions`` records every transaction that landed, ``checked`` every one
    :meth:`check` was asked about; :meth:`refuse_next` makes the next ``count`` fail as the
    kernel would refuse them, :meth:`refuse_rules` every one that adds a rule of a kind (as
    the kernel refuses an object it cannot take); :meth:`lose_table` is another tool flushing
    the ruleset; ``missing`` is what :meth:`missing_features` reports.
    """

    def __init__(self, table: str = "nftpolicy", missing: list[str] | None = None) -> None:
        self.table = table
        self.state = FakeTable()
        self.transactions: list[Transaction] = []
        self.missing = list(missing or [])
        self.checked: list[Transaction] = []
        self._refusals: list[str] = []
        self._refused_rules: list[tuple[Callable[[layout.Rule], bool], str]] = []

    def refuse_next(self, reason: str = "Operation not permitted", count: int = 1) -> None:
        """The next ``count`` transactions fail with ``reason`` and change nothing."""
        self._refusals += [reason] * count

    def refuse_rules(self, where: Callable[[layout.Rule], bool], reason: str = "Could not process rule: Invalid argument") -> None:
        """Refuse, with ``reason``, every transaction (committed or checked) that adds a rule
        for which ``where`` is true (``lambda r: r.origin is not None and r.origin.policy ==
        "x/p"``: the rules of one policy, by their :class:`~nftpolicy.translators.rules.RuleOrigin`)."""
        self._refused_rules.append((where, reason))

    def stop_refusing(self) -> None:
        """Forget every :meth:`refuse_rules`."""
        self._refused_rules.clear()

    def _refuse_rules(self, tx: Transaction) -> None:
        if not self._refused_rules:
            return
        for op in tx.operations:
            rules = ([r for c in op.table.chains for r in c.rules] if isinstance(op, Replace)
                     else [op.object.rule] if isinstance(op.object, ChainRule) else [])
            for rule in rules:
                for where, reason in self._refused_rules:
                    if where(rule):
                        raise FakeNftError(f"{reason} ({rule.comment})")

    def lose_table(self) -> None:
        """Our table disappears, as after ``nft flush ruleset``."""
        self.state = FakeTable()

    def missing_features(self) -> list[str]:
        return list(self.missing)

    def run(self, tx: Transaction) -> None:
        if self._refusals:
            raise FakeNftError(self._refusals.pop(0))
        self._refuse_rules(tx)
        self.state.apply(tx)
        self.transactions.append(tx)

    def check(self, tx: Transaction) -> None:
        self.checked.append(tx)
        self._refuse_rules(tx)
        self.state.check(tx)

    def has_table(self) -> bool:
        return self.state.exists and "KUBE-ROUTER-FORWARD" in self.state.chains

    def remove(self) -> bool:
        if not self.state.exists:
            return False
        self.run(removing(self.table))
        return True

    def text(self) -> str:
        """The table in nft syntax: sets with their elements (sorted), then chains with their
        rules, each in name order (``""`` when there is no table)."""
        if not self.state.exists:
            return ""
        lines = [f"table inet {self.table} {{"]
        for name, (_, elements) in sorted(self.state.sets.items()):
            items = sorted(nfttext.element_text(nft.element_json(e)) for e in elements.values())
            lines.append(f"\tset {name} {{ " + ", ".join(items) + " }" if items else f"\tset {name} {{ }}")
        for name, (_, rules) in sorted(self.state.chains.items()):
            lines.append(f"\tchain {name} {{")
            lines += [f"\t\t{nfttext.rule_text(nft.rule_json(self.table, name, rule)['rule'])}" for rule in rules]
            lines.append("\t}")
        return "\n".join(lines + ["}", ""])
