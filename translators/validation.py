"""Validation of Kubernetes object fields, shared by the readers of manifests
(:mod:`~nftpolicy.translators.manifests` for the core kinds, :mod:`~nftpolicy.translators.clusterpolicy`
for ClusterNetworkPolicy): each helper returns the validated value or raises :class:`InvalidField`
with the field's JSON path. The rules are the API server's (k8s.io/apimachinery validation).
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import itertools
import json
import re
import sys
from collections.abc import Mapping  # collections.abc: isinstance on typing's alias is slow
from typing import Any

from .selectors import LabelSelector, Labels, Requirement

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_NAME = re.compile(r"(?=.{1,63}$)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
LABEL_VALUE = re.compile(r"(?=.{0,63}$)([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
SELECTOR_FIELDS = {"matchLabels", "matchExpressions"}
REQUIREMENT_FIELDS = {"key", "operator", "values"}
# The characters the API server appends to ``metadata.generateName`` (5 of them).
GENERATED_SUFFIX = "bcdfghjklmnpqrstvwxz2456789"


class InvalidField(ValueError):
    """A field that fails validation: ``path`` is the JSON path (``spec.ingress[0].ports[1].port``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path, self.message = path, message


def mapping_field(value: Any, path: str) -> Mapping[str, Any]:
    """An object field (absent: empty); raises InvalidField when it is not a mapping."""
    if type(value) is dict:  # what every parser gives: skip the slower abstract check
        return value
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidField(path, f"must be an object, got {type(value).__name__}")
    return value


def list_field(value: Any, path: str) -> list[Any]:
    """A list field (absent: empty); raises InvalidField when it is not a list."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidField(path, f"must be a list, got {type(value).__name__}")
    return value


def known_fields(value: Mapping[str, Any], allowed: set[str], path: str) -> None:
    """Refuse a field of ``value`` not in ``allowed``, as kubectl's strict field validation does
    (an ``egress: [{from: ...}]`` typo must not become "allow all")."""
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise InvalidField(f"{path}.{unknown[0]}", f"unknown field (expected one of {', '.join(sorted(allowed))})")


def generated_suffix(content: Any, length: int) -> str:
    """``length`` characters of the API server's name alphabet (``bcdfghjklmnpqrstvwxz2456789``,
    what it appends to a ``generateName``), taken from a digest of ``content`` (JSON-able): the
    same content gives the same characters, so reading the same file twice gives the same names."""
    digest = hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).digest()
    return "".join(GENERATED_SUFFIX[b % len(GENERATED_SUFFIX)] for b in digest[:length])


def object_name(obj: Mapping[str, Any], pattern: re.Pattern[str] = DNS_SUBDOMAIN) -> str:
    """``metadata.name`` (``pattern``: an RFC 1123 subdomain unless given), or for an object with
    only ``metadata.generateName`` the prefix with 5 characters from its content; raises
    InvalidField."""
    meta = mapping_field(obj.get("metadata"), "metadata")
    name, prefix = meta.get("name"), meta.get("generateName")
    if not name and isinstance(prefix, str) and prefix:
        # The API server appends 5 random characters (to at most 58 of the prefix); ours come
        # from the object's content, so that reading the same file twice gives the same name.
        if not pattern.fullmatch(prefix[:-1] + "a" if prefix.endswith("-") else prefix):
            raise InvalidField("metadata.generateName", f"invalid name prefix {prefix!r} (a lower-case RFC 1123 name)")
        name = prefix[:58] + generated_suffix(obj, 5)
    return checked_name(name, pattern)


def checked_name(name: Any, pattern: re.Pattern[str] = DNS_SUBDOMAIN) -> str:
    """``name`` when it is a ``metadata.name`` matching ``pattern`` (an RFC 1123 subdomain unless
    given); raises InvalidField."""
    if not isinstance(name, str) or not name:
        raise InvalidField("metadata.name", "required")
    if not pattern.fullmatch(name):
        raise InvalidField("metadata.name", f"invalid name {name!r} (a lower-case RFC 1123 name)")
    return name


def label_key(key: Any, path: str, what: str = "label") -> str:
    """A label (or annotation: ``what``) key, ``[prefix/]name``; raises InvalidField."""
    if not isinstance(key, str):
        raise InvalidField(path, f"{what} keys must be strings, got {key!r}")
    prefix, slash, name = key.rpartition("/")
    if (slash and not DNS_SUBDOMAIN.fullmatch(prefix)) or not LABEL_NAME.fullmatch(name):
        raise InvalidField(path, f"invalid {what} key {key!r}")
    return key


@functools.lru_cache(maxsize=1 << 16)
def _label_error(key: Any, value: Any) -> str | None:
    """Why ``key: value`` is not a valid label, or None (cached: pods repeat their labels)."""
    if not isinstance(key, str) or not isinstance(value, str):
        return "label keys and values must be strings"
    try:
        label_key(key, "")
    except InvalidField as exc:
        return exc.message
    return None if LABEL_VALUE.fullmatch(value) else f"invalid label value {value!r}"


# Label sets seen before, as ``(key1, value1, key2, value2, ...)`` in the object's order (keys and
# values the interned strings of the Labels) -> their interned Labels: one flat tuple an entry,
# about a third of a two-tuple lru_cache key's memory (15.6 MiB of keys at 150k pods, 59k sets).
_LABEL_SETS: dict[tuple[str, ...], Labels] = {}
MAX_LABEL_SETS = 1 << 16  # distinct label sets (and orders) remembered before the cache starts again


def labels_field(value: Any, path: str) -> Labels:
    """Validated labels as the interned :class:`~nftpolicy.translators.selectors.Labels` of
    their set (the replicas of a workload share one object). A set seen before in the same order
    is valid: only validated strings are remembered, and nothing but a string equals one."""
    labels = mapping_field(value, path)
    flat = tuple(itertools.chain.from_iterable(labels.items()))
    try:
        found = _LABEL_SETS.get(flat)
    except TypeError:  # an unhashable key or value (a list, a mapping): not a string either
        bad = next(k for k, v in labels.items() if not isinstance(k, str) or not isinstance(v, str))
        raise InvalidField(f"{path}.{bad}", "label keys and values must be strings") from None
    if found is None:
        for k, v in labels.items():
            error = _label_error(k, v) if isinstance(k, str) and isinstance(v, str) else "label keys and values must be strings"
            if error:
                raise InvalidField(f"{path}.{k}", error)
        found = Labels.interned(labels)
        if len(_LABEL_SETS) >= MAX_LABEL_SETS:
            _LABEL_SETS.clear()
        _LABEL_SETS[tuple(sys.intern(s) for s in flat)] = found  # the Labels' own strings: no second copy
    return found


def network_field(value: Any, path: str, new: bool = False) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A CIDR; ``new``: also refuse what kube-apiserver (v1.36) refuses in a new object."""
    if not isinstance(value, str):
        raise InvalidField(path, f"invalid CIDR {value!r}")
    try:
        return _cidr(value, new)
    except ValueError as exc:
        raise InvalidField(path, str(exc)) from None


@functools.lru_cache(maxsize=1 << 12)
def _cidr(value: str, new: bool) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """:func:`network_field` of a string, cached (policies repeat their CIDRs; networks are
    immutable); raises ValueError with the reason."""
    if not re.fullmatch(r"[0-9a-fA-F.:]+/[0-9]{1,3}", value):
        raise ValueError(f"invalid CIDR {value!r}")
    try:
        network = ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise ValueError(f"invalid CIDR {value!r}") from None
    if new and ipaddress.ip_interface(value).ip != network.network_address:
        raise ValueError(f"invalid CIDR {value!r}: must not have bits set beyond the prefix length (use {network})")
    if new and isinstance(network, ipaddress.IPv6Network) and network.network_address.ipv4_mapped is not None:
        raise ValueError(f"invalid CIDR {value!r}: must not have an IPv4-mapped IPv6 address")
    return network


def selector_from(value: Any, path: str) -> LabelSelector:
    """A ``meta/v1`` LabelSelector object -> :class:`LabelSelector` (validates operators and values)."""
    sel = mapping_field(value, path)
    known_fields(sel, SELECTOR_FIELDS, path)
    requirements = []
    for i, expr in enumerate(list_field(sel.get("matchExpressions"), f"{path}.matchExpressions")):
        epath = f"{path}.matchExpressions[{i}]"
        expr = mapping_field(expr, epath)
        known_fields(expr, REQUIREMENT_FIELDS, epath)
        op, key, values = expr.get("operator"), expr.get("key"), list_field(expr.get("values"), f"{epath}.values")
        if not isinstance(key, str) or not key:
            raise InvalidField(f"{epath}.key", "required")
        label_key(key, f"{epath}.key")
        for j, v in enumerate(values):
            if not isinstance(v, str) or not LABEL_VALUE.fullmatch(v):
                raise InvalidField(f"{epath}.values[{j}]", f"invalid label value {v!r}")
        if op in ("In", "NotIn") and not values:
            raise InvalidField(f"{epath}.values", f"must be non-empty when operator is {op}")
        if op in ("Exists", "DoesNotExist") and values:
            raise InvalidField(f"{epath}.values", f"must be empty when operator is {op}")
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise InvalidField(f"{epath}.operator", f"unknown operator {op!r} (In, NotIn, Exists, DoesNotExist)")
        requirements.append(Requirement(key=key, operator=op, values=frozenset(str(v) for v in values)))
    labels = labels_field(sel.get("matchLabels"), f"{path}.matchLabels")
    return LabelSelector(match_labels=tuple(sorted(labels.items())), match_expressions=tuple(requirements))


