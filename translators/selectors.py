"""Label sets and label selectors: :class:`Labels`, :class:`LabelSelector` and how one matches
the other.

Source of the semantics: the Kubernetes API reference for ``meta/v1`` LabelSelector ("An empty
label selector matches all objects"; ``matchLabels`` and every ``matchExpressions`` requirement
are AND'ed).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, NoReturn

MAX_INTERNED = 1 << 16  # distinct label sets :meth:`Labels.interned` remembers before it starts again


class Labels(dict[str, str]):
    """An object's labels: an immutable, hashable mapping compared by content, keys in sorted
    order. Built with :meth:`interned`, equal label sets are one object (the replicas of a
    workload carry the same labels): the node renderer groups pods by their ``Labels`` and tests
    each group against a selector once.

    A dict underneath (lookups at dict speed); every mutating method raises TypeError.
    """

    __slots__ = ("_hash",)
    _interned: dict[Labels, Labels] = {}

    def __init__(self, items: Mapping[str, str] | Iterable[tuple[str, str]] = ()) -> None:
        pairs = sorted(items.items() if isinstance(items, Mapping) else items)
        dict.__init__(self, pairs)
        self._hash = hash(tuple(pairs))

    @classmethod
    def interned(cls, items: Mapping[str, str] | Iterable[tuple[str, str]]) -> Labels:
        """The one :class:`Labels` of this label set (keys and values interned strings)."""
        labels = cls((sys.intern(k), sys.intern(v)) for k, v in (items.items() if isinstance(items, Mapping) else items))
        found = cls._interned.get(labels)
        if found is None:
            if len(cls._interned) >= MAX_INTERNED:
                cls._interned.clear()
            found = cls._interned[labels] = labels
        return found

    def __hash__(self) -> int:  # type: ignore[override]  # dict is unhashable; Labels are immutable
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        return Labels, (tuple(self.items()),)

    def _immutable(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("Labels are immutable")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _immutable


def labels_of(labels: Mapping[str, str]) -> Labels:
    """``labels`` as :class:`Labels` (itself when it is one already, else the interned one)."""
    return labels if isinstance(labels, Labels) else Labels.interned(labels)


@dataclass(frozen=True, slots=True)
class Requirement:
    """One ``matchExpressions`` entry: ``key``, operator ``In|NotIn|Exists|DoesNotExist``, values.

    Semantics from the LabelSelector API reference: ``In`` needs the key with one of the values,
    ``NotIn`` matches a missing key or a value not listed, ``Exists``/``DoesNotExist`` test the key.
    """

    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """True when ``labels`` satisfy this requirement."""
        if self.operator == "In":
            return labels.get(self.key) in self.values
        if self.operator == "NotIn":
            return labels.get(self.key) not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """A ``meta/v1`` LabelSelector: ``matchLabels`` AND every ``matchExpressions`` requirement.

    The empty selector (``{}``) matches every object (API reference: "An empty label selector
    matches all objects").
    """

    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """True when ``labels`` satisfy every term of the selector."""
        for k, v in self.match_labels:  # loops, not all(): this runs for every pod group and selector
            if labels.get(k) != v:
                return False
        for r in self.match_expressions:
            if not r.matches(labels):
                return False
        return True


ALL = LabelSelector()  # the empty selector: every object


def canonical_selector(selector: LabelSelector | None) -> LabelSelector | None:
    """``selector`` with its terms in one order (None for the empty selector, which matches
    everything just as None does), so that selectors that read the same are equal."""
    if selector is None or (not selector.match_labels and not selector.match_expressions):
        return None
    return LabelSelector(tuple(sorted(selector.match_labels)),
                         tuple(sorted(set(selector.match_expressions), key=lambda r: (r.key, r.operator, sorted(r.values)))))


def selector_text(selector: LabelSelector | None) -> str:
    """A label selector in kubectl's words, terms sorted: ``app=b,tier in (api,web),!legacy``;
    ``(any)`` for None or the empty selector (both match everything; no label key has
    parentheses, so it never reads like an ``Exists`` term)."""
    if selector is None:
        return "(any)"
    terms = [f"{k}={v}" for k, v in sorted(selector.match_labels)]
    for r in sorted(selector.match_expressions, key=lambda r: (r.key, r.operator, sorted(r.values))):
        values = ",".join(sorted(r.values))
        terms.append({"In": f"{r.key} in ({values})", "NotIn": f"{r.key} notin ({values})",
                      "Exists": r.key, "DoesNotExist": f"!{r.key}"}[r.operator])
    return ",".join(terms) or "(any)"
