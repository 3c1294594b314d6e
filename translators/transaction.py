"""One typed transaction of our table's objects, recorded, never interpreted (knftables'
``Transaction``, for our objects).

A :class:`Transaction` is bound to our table (``inet <table>``, base chains at ``priority``) and
records operations in order: :meth:`~Transaction.add`, :meth:`~Transaction.flush` and
:meth:`~Transaction.delete` of one object (our table itself, a set, a verdict map, a chain, a
rule, set or map elements), or :meth:`~Transaction.replace` of the whole table. The full sync
and the delta (:mod:`nftpolicy.translators.delta`) both produce one; each dataplane prints it in
its own syntax and commits it as one kernel transaction: libnftables JSON
(:func:`nftpolicy.translators.nft.transaction_json`), ``nft -f`` text
(:func:`nftpolicy.translators.nfttext.transaction_text`), ``ipset restore`` and
``iptables-restore`` input (:func:`nftpolicy.translators.iptables.restore_inputs`: a replace
only); the in-memory fake applies the objects themselves. Recording checks nothing: the kernel
(or the fake) refuses what does not fit, and then the whole transaction.

The objects are the layout's (:mod:`nftpolicy.translators.layout`) and the rule model's
:class:`~nftpolicy.translators.rules.AddressSet`, plus the four below that only name or place a
thing. The verbs and object kinds are nft's (nft(8), libnftables-json(5) COMMAND OBJECTS).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Union

from . import layout
from .rules import AddressSet, RuleModel

Verb = Literal["add", "flush", "delete"]


@dataclass(frozen=True)
class OurTable:
    """Our table itself (its name is the transaction's): ``add`` creates it where it is absent
    and keeps it otherwise, ``delete`` removes it with everything in it."""


class ChainRule(NamedTuple):
    """``rule`` appended to chain ``chain`` (only ``add``: a chain loses its rules by a flush)."""

    chain: str
    rule: layout.Rule


@dataclass(frozen=True)
class Elements:
    """Elements of set or map ``name``: for a set, the rule model's elements (an address, a
    network, an ``(address, protocol, port)`` triple); for a verdict map,
    :class:`~nftpolicy.translators.layout.MapElement` objects to add or the bare addresses (their
    keys) to delete."""

    name: str
    elements: tuple[Any, ...]


@dataclass(frozen=True)
class SetName:
    """A set known by its name only (to delete it)."""

    name: str


Object = Union[OurTable, AddressSet, layout.VerdictMap, SetName, layout.Chain, ChainRule, Elements]
"""``add``: our table, a set or map with its elements, a chain (its declaration: name and hook;
its rules are :class:`ChainRule` objects), a rule, elements. ``flush``: a chain (by name).
``delete``: our table, a set (:class:`SetName`), a chain (by name, once empty and unused), elements."""

KIND: dict[type, str] = {OurTable: "table", AddressSet: "set", layout.VerdictMap: "map", SetName: "set",
                         layout.Chain: "chain", ChainRule: "rule", Elements: "element"}
"""Each object type's nft object kind (the words of nft(8) and libnftables-json(5))."""


class Operation(NamedTuple):
    """``verb`` of ``object``."""

    verb: Verb
    object: Object


@dataclass(frozen=True)
class Replace:
    """The whole table replaced by ``table`` in one step: add our table (so a first load works),
    delete it, then add it again with every set, chain, rule and map of ``table``; nothing outside
    our table is named. The old table stays in force until the new one is committed."""

    table: layout.Table


@dataclass
class Transaction:
    """Operations on ``inet <table>`` (base chains at ``priority``), in the order they were
    recorded; the kernel takes them as one transaction."""

    table: str
    priority: int
    operations: list[Operation | Replace] = field(default_factory=list)

    def add(self, obj: Object) -> None:
        """Record the creation of ``obj`` (see :data:`Object`)."""
        self.operations.append(Operation("add", obj))

    def flush(self, chain: layout.Chain) -> None:
        """Record the removal of every rule of ``chain`` (by name)."""
        self.operations.append(Operation("flush", chain))

    def delete(self, obj: Object) -> None:
        """Record the removal of ``obj`` (see :data:`Object`)."""
        self.operations.append(Operation("delete", obj))

    def replace(self, table: layout.Table) -> None:
        """Record the replacement of our whole table by ``table`` (:class:`Replace`)."""
        assert table.name == self.table, f"table {table.name} in a transaction of table {self.table}"
        self.operations.append(Replace(table))

    def __bool__(self) -> bool:
        return bool(self.operations)

    def summary(self) -> Counter[str]:
        """How many nft commands of each ``"<verb> <kind>"`` (``"add rule"``, ...) the
        transaction holds, a :class:`Replace` counted as the commands it stands for (as the
        libnftables JSON batch has them)."""
        counts: Counter[str] = Counter()
        for op in self.operations:
            if isinstance(op, Replace):
                t = op.table
                counts.update({"add table": 2, "delete table": 1, "add set": len(t.sets), "add chain": len(t.chains),
                               "add rule": sum(len(c.rules) for c in t.chains), "add map": len(t.maps)})
            else:
                counts[f"{op.verb} {KIND[type(op.object)]}"] += 1
        return +counts

    def commands(self) -> int:
        """The number of nft commands (:meth:`summary`'s total)."""
        return sum(self.summary().values())


def replacing(table: layout.Table) -> Transaction:
    """The transaction that replaces our table by ``table`` (the full sync)."""
    transaction = Transaction(table.name, table.priority)
    transaction.replace(table)
    return transaction


def full(model: RuleModel) -> Transaction:
    """:func:`replacing` by the layout of ``model`` (:func:`layout.table`)."""
    return replacing(layout.table(model))


def removing(table: str) -> Transaction:
    """The transaction that deletes our table ``table`` and everything in it."""
    transaction = Transaction(table, 0)
    transaction.delete(OurTable())
    return transaction
