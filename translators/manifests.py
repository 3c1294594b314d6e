"""Kubernetes objects (parsed YAML/JSON) -> :class:`Cluster`, with the API server's defaulting and validation.

Accepted input: any mix of Namespace, Pod, NetworkPolicy and Node objects, ``kind: List``
(what ``kubectl get -A -o yaml`` prints) and multi-document YAML; other kinds are ignored.
An invalid object is reported as a :class:`ManifestError` naming kind, namespace/name and field,
and left out; every other object is still used.

Validation and defaulting follow the ``networking.k8s.io/v1`` API reference and the API server's
validation (``pkg/apis/networking/validation``): protocol defaults to TCP, ``policyTypes``
defaults to Ingress plus Egress when egress rules exist, ``endPort`` needs a numeric ``port`` and
``endPort >= port``, port names are IANA service names, CIDRs must parse and every ``except``
must be a strict subset of its ``cidr``. A missing ``spec.podSelector`` is the empty selector and
a ``metadata.generateName`` without a name gets a name, as the API server does.
Manifests are validated as the API server validates a create (``new=True``): CIDRs with host
bits or IPv4-mapped IPv6 addresses are refused (kube-apiserver v1.36 does); objects read from the
API may still hold such values, stored before the API server refused them (it keeps serving them),
and are read as the API server reads them (host bits masked). So is an object of a dump
(``kubectl get -o yaml``): one with ``metadata.resourceVersion``, which only the API server sets
(:func:`is_stored`).
"""

from __future__ import annotations

import difflib
import functools
import ipaddress
import json
import math
import re
import sys
from dataclasses import dataclass
from collections.abc import Iterable, Iterator, Mapping  # collections.abc: isinstance on typing's alias is slow
from typing import Any

import orjson
import yaml

from .clusterpolicy import API_VERSIONS as CLUSTER_POLICY_API_VERSIONS, cluster_policy_from
from .model import (
    NAMESPACE_NAME_LABEL,
    PROTOCOLS,
    Cluster,
    ClusterNetworkPolicy,
    ContainerPort,
    IPBlock,
    Namespace,
    NetworkPolicy,
    Node,
    Peer,
    Pod,
    PolicyPort,
    PolicyRule,
)
from .selectors import LabelSelector, Labels
from .validation import (
    DNS_LABEL,
    InvalidField,
    known_fields,
    label_key,
    labels_field,
    list_field,
    mapping_field,
    network_field,
    object_name,
    selector_from,
)

KINDS = ("Namespace", "Pod", "NetworkPolicy", "Node", "ClusterNetworkPolicy")
# Every kind nftpolicy reads (KINDS here; workloads and Services in translators.workloads) and
# the apiVersions of it that API servers serve (the Kubernetes API reference; CronJob's
# batch/v1beta1 up to v1.24, same shape): another apiVersion is a different object, left out.
API_VERSIONS = {
    "Namespace": ("v1",), "Pod": ("v1",), "Node": ("v1",), "Service": ("v1",),
    "NetworkPolicy": ("networking.k8s.io/v1",), "ClusterNetworkPolicy": CLUSTER_POLICY_API_VERSIONS,
    "Deployment": ("apps/v1",), "ReplicaSet": ("apps/v1",), "StatefulSet": ("apps/v1",), "DaemonSet": ("apps/v1",),
    "Job": ("batch/v1",), "CronJob": ("batch/v1", "batch/v1beta1"),
}
# How close (difflib ratio, case ignored) a kind must be to one of API_VERSIONS' to be taken for
# its typo: "NetworkPolcy" (0.96), "Pods" (0.86) are; other projects' kinds are not
# (AdminNetworkPolicy 0.84, CiliumNetworkPolicy 0.82, ServiceAccount 0.67, Secret 0.62).
_TYPO_CUTOFF = 0.85
# IANA service name (RFC 6335, Kubernetes' IsValidPortName): 1-15 of [a-z0-9-], at least one
# letter, no leading, trailing or doubled hyphen.
# Object names and labels, as the API server validates them (k8s.io/apimachinery validation).
# Fields each part of a NetworkPolicy may have: anything else is refused, as kubectl's strict
# field validation does (an "egress: [{from: ...}]" typo must not become "allow all").
_FIELDS = {
    "spec": {"podSelector", "policyTypes", "ingress", "egress"},
    "ingress": {"from", "ports"}, "egress": {"to", "ports"},
    "peer": {"podSelector", "namespaceSelector", "ipBlock"}, "ipBlock": {"cidr", "except"},
    "port": {"protocol", "port", "endPort"},
}
_IANA_SVC_NAME = re.compile(r"(?=.*[a-z])(?!.*--)[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?")


@dataclass(frozen=True)
class ManifestError:
    """One rejected object: ``"NetworkPolicy x/deny: spec.ingress[0].ports[0].port: ..."``."""

    kind: str
    ref: str
    message: str
    origin: str = ""

    def __str__(self) -> str:
        where = f" ({self.origin})" if self.origin else ""
        return f"{self.kind} {self.ref}: {self.message}{where}"


# PyYAML's C loader (libyaml) when the build has it: about ten times faster on a large dump.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml_documents(text: str) -> list[Any]:
    """Every non-empty document of YAML ``text`` (safe loading). Raises yaml.YAMLError."""
    return [d for d in yaml.load_all(text, Loader=YAML_LOADER) if d is not None]


def _load_yaml(text: str, origin: str) -> tuple[list[tuple[int, Any]], list[ManifestError]]:
    """All documents of ``text``, each with its number (from 1); when one is broken, every other
    document is still returned, numbered as the error numbers the broken one."""
    # ValueError: a scalar PyYAML resolves but cannot make (a date 2026-13-45, an integer
    # beyond Python's 4300 digits), raised by its constructors rather than as a YAMLError.
    try:
        return list(enumerate(load_yaml_documents(text), 1)), []
    except (yaml.YAMLError, RecursionError, ValueError):
        pass
    docs: list[tuple[int, Any]] = []
    errors = []
    starts = [0] + [m.end() for m in re.finditer(r"(?m)^---[ \t]*(?:#.*)?$", text)]
    for i, chunk in enumerate(re.split(r"(?m)^---[ \t]*(?:#.*)?$", text)):
        try:
            docs.extend((i + 1, doc) for doc in load_yaml_documents(chunk))
        except (yaml.YAMLError, RecursionError, ValueError) as exc:
            first_line = text.count("\n", 0, starts[i])  # of the chunk in the file, from 0
            errors.append(ManifestError("document", f"#{i + 1}", f"not valid YAML/JSON{_yaml_error(exc, first_line)}", origin))
    return docs, errors


def _yaml_error(exc: BaseException, first_line: int) -> str:
    """One line for a YAML error in a document whose first line is ``first_line`` (from 0) of
    its file: `` at line L, column C: problem (context at line L, column C)``, the file's own
    1-based lines and columns (PyYAML counts both from 0 within the text it was given)."""
    def at(mark: yaml.Mark) -> str:
        return f"line {first_line + mark.line + 1}, column {mark.column + 1}"

    if isinstance(exc, RecursionError):
        return ": nested too deeply"
    if not isinstance(exc, yaml.YAMLError):  # a constructor's ValueError: no mark; not Python's advice after ';'
        return ": " + " ".join(str(exc).partition(";")[0].split())
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        context = f" ({exc.context} at {at(exc.context_mark)})" if exc.context and exc.context_mark else \
            f" ({exc.context})" if exc.context else ""
        return f" at {at(exc.problem_mark)}: {exc.problem}{context}"
    return ": " + " ".join(str(exc).split())


def parse_documents(text: str | bytes, origin: str = "<input>") -> tuple[list[tuple[str, Any]], list[ManifestError]]:
    """Split YAML or JSON text into ``(origin, object)`` pairs, flattening ``kind: List``,
    ``kind: <Kind>List`` (raw API list output) and top-level arrays.

    ``text`` may be a file's bytes: JSON is then parsed without a decoded copy (a 150,000-pod
    dump is 95 MB); bytes that are not UTF-8 raise UnicodeDecodeError.
    Returns the objects and one error per document that cannot be parsed (the others are kept).
    """
    docs: list[tuple[int, Any]] | None = None  # each with its number, from 1
    errors: list[ManifestError] = []
    if isinstance(text, bytes):
        if text.lstrip()[:1] in (b"{", b"["):
            try:
                docs, errors = [(1, orjson.loads(text))], []
            except (ValueError, RecursionError):
                pass
        if docs is None:
            text = text.decode()
    if docs is None:
        assert isinstance(text, str)
        try:
            # JSON is read as JSON first: YAML refuses the tab indentation that JSON allows.
            docs, errors = ([(1, orjson.loads(text))], []) if text.lstrip()[:1] in ("{", "[") else _load_yaml(text, origin)
        except (ValueError, RecursionError):  # orjson.JSONDecodeError is a ValueError
            docs, errors = _load_yaml(text, origin)
    objects = [pair for number, doc in docs for pair in _flattened(doc, f"#{number}", origin, errors)]
    return objects, errors


def _flattened(doc: Any, where: str, origin: str, errors: list[ManifestError]) -> Iterator[tuple[str, Any]]:
    """The ``(origin, object)`` pairs of document ``doc`` (``where``: ``"#2"``, the file's second
    document), ``kind: List``/``<Kind>List`` and arrays flattened in order (``"#2 item #3"``:
    an item of its list); one error in ``errors`` per part that is not an object."""
    # A stack, next part last (each part is handled once), with where each one is.
    pending = [(doc, where)]
    while pending:
        doc, where = pending.pop()
        if isinstance(doc, Mapping) and isinstance(doc.get("kind"), str) and doc["kind"].endswith("List"):
            items = doc.get("items") or []
            if not isinstance(items, list):
                errors.append(ManifestError(doc["kind"], "-", f"items: must be a list, got {type(items).__name__}", origin))
                continue
            pending.extend((item, f"{where} item #{i}") for i, item in reversed(list(enumerate(items, 1))))
        elif isinstance(doc, list):  # a top-level JSON array or YAML sequence of objects
            pending.extend((item, f"{where} item #{i}") for i, item in reversed(list(enumerate(doc, 1))))
        elif not isinstance(doc, Mapping):
            errors.append(ManifestError("document", where, f"not a mapping (a {type(doc).__name__})", origin))
        else:
            yield origin, doc


class NotStreamable(ValueError):
    """A JSON document that :func:`json_list_objects` cannot read item by item exactly as
    :func:`parse_documents` reads it whole (not valid JSON, constants such as ``NaN``, text after
    the object, an ``items`` array of an object whose kind turns out not to be a List): the
    caller reads the file whole instead (also for a value nested deeper than Python's stack).
    ``str()``: where and why, one line. :attr:`error`:
    when an item is not valid JSON, the error naming it (``document #1: not valid JSON in item
    #7: expecting ',' delimiter at line 1, column 4021``), for the caller to give instead of the
    whole read's error for the document (which names only a line and column)."""

    error: ManifestError | None = None


# The stdlib's C JSON scanner: it parses one value at a given index of a str and says where it
# ends, which is what reading a List's items one at a time needs (orjson parses only whole
# documents). What orjson reads otherwise ends the item-by-item read: NaN and Infinity, numbers
# too large for a double (refused) and integers beyond 64 bits (a float for orjson).
def _refuse_constant(name: str) -> Any:
    raise NotStreamable(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise NotStreamable(f"{text} is too large for a double")
    return value


def _int64(text: str) -> int:
    value = int(text) if len(text) <= 20 else None  # longer is beyond 64 bits (int() refuses 4300 digits)
    if value is None or not -(1 << 63) <= value < 1 << 64:
        raise NotStreamable(f"{text[:20]}{'...' if len(text) > 20 else ''} is an integer beyond 64 bits")
    return value


_SCAN = json.scanner.make_scanner(json.JSONDecoder(  # type: ignore[attr-defined]
    parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_int64))
_WHITESPACE = re.compile(r"[ \t\n\r]*")
# orjson refuses a lone surrogate, which the stdlib reads: any surrogate escape, paired or not
# (rare in Kubernetes objects), sends the document to the whole read.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class _ChunkedText:
    """JSON text arriving in chunks (str), read from position :attr:`pos` of :attr:`text` (the
    part not read yet); text before it is dropped as the next chunk comes. :meth:`value`
    parses one JSON value at :attr:`pos`; a value cut by a chunk's end is parsed again once the
    next chunk is there. Errors say where, as the line and column of the whole text."""

    # A parse error this close to the end of the text may be a value cut short by the chunk's end
    # (a literal, a number or an escape is at most this long), as may an unterminated string.
    CUT = 32

    def __init__(self, chunks: Iterable[str]) -> None:
        self.chunks = iter(chunks)
        self.text = ""
        self.pos = 0
        self.line = 1  # of the text's first character, in the whole text
        self.line_start = 0  # where that line starts, relative to the text (<= 0)

    def more(self) -> bool:
        """Append the next chunk, dropping what was read; False at the end of the input."""
        chunk = next(self.chunks, None)
        if chunk is None:
            return False
        read = self.text[:self.pos]
        newlines = read.count("\n")
        if newlines:
            self.line += newlines
            self.line_start = read.rindex("\n") + 1 - self.pos
        else:
            self.line_start -= self.pos
        self.text, self.pos = self.text[self.pos:] + chunk, 0
        return True

    def peek(self) -> str:
        """The next character that is not whitespace (:attr:`pos` moves to it), "" at the end."""
        while True:
            self.pos = _WHITESPACE.match(self.text, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.more():
                return ""

    def expect(self, chars: str, what: str) -> str:
        """The next character that is not whitespace, one of ``chars``, consumed. Raises NotStreamable."""
        char = self.peek()
        if not char or char not in chars:
            raise NotStreamable(self.where(self.pos, f"expecting {what}"))
        self.pos += 1
        return char

    def value(self) -> Any:
        """The JSON value at :attr:`pos` (after whitespace), consumed. Raises NotStreamable."""
        self.peek()
        while True:
            try:
                value, end = _SCAN(self.text, self.pos)
            except StopIteration as stop:
                at, problem = stop.value, "expecting a value"
            except json.JSONDecodeError as exc:
                at, problem = exc.pos, exc.msg
            except RecursionError:  # the scanner recurses: deeper than Python's stack (the whole read decides)
                raise NotStreamable(self.where(self.pos, "nested too deeply")) from None
            else:
                if end < len(self.text) or not self.more():  # else a number may go on in the next chunk
                    escape = self.text.find("\\u", self.pos, end)  # the fast test first: str.find
                    if escape >= 0 and _SURROGATE_ESCAPE.search(self.text, escape, end):
                        raise NotStreamable(self.where(escape, "a \\u escape of a UTF-16 surrogate"))
                    self.pos = end
                    return value
                continue
            cut = at >= len(self.text) - self.CUT or problem.startswith("Unterminated string")
            if not (cut and self.more()):
                raise NotStreamable(self.where(at, problem[:1].lower() + problem[1:].removesuffix(" at")))

    def where(self, at: int, problem: str) -> str:
        """``problem at line L, column C`` (of the whole text, from 1)."""
        newlines = self.text.count("\n", 0, at)
        start = self.text.rindex("\n", 0, at) + 1 if newlines else self.line_start
        return f"{problem} at line {self.line + newlines}, column {at - start + 1}"


def json_list_objects(chunks: Iterable[str], origin: str, errors: list[ManifestError]) -> Iterator[tuple[str, Any]]:
    """The objects of one JSON document whose text comes in ``chunks``, as :func:`parse_documents`
    gives them (``(origin, object)`` pairs, errors of parts that are not objects appended to
    ``errors``), but with the items of its top-level ``items`` array parsed and given one at a
    time: the memory held is one item and a chunk, not the whole parsed document (a 150,000-pod
    ``kubectl get -o json`` List is 92 MB of text, and about 800 MB parsed whole).

    The document must be one JSON object: its other fields (``kind`` may come after ``items``, as
    kubectl prints them) are checked as the items go by. Raises :class:`NotStreamable` when
    reading the document whole could give another result: the text is not one JSON object, an
    item is not valid JSON, or the object's kind is not a List (its ``items`` were then no list
    of objects); objects given before that must be dropped by the caller.
    """
    text = _ChunkedText(chunks)
    text.expect("{", "an object")
    envelope: dict[str, Any] = {}
    streamed = False
    if text.peek() == "}":
        text.pos += 1
    else:
        while True:
            key = text.value()
            if not isinstance(key, str):
                raise NotStreamable(text.where(text.pos, "expecting a property name"))
            text.expect(":", "':'")
            kind = envelope.get("kind")
            if key == "items" and not streamed and text.peek() == "[" and (kind is None or isinstance(kind, str) and kind.endswith("List")):
                text.pos += 1
                streamed = True
                number = 0
                if text.peek() == "]":
                    text.pos += 1
                else:
                    while True:
                        number += 1
                        try:
                            item = text.value()
                            end = text.expect(",]", "',' or ']' after an item")
                        except NotStreamable as exc:
                            exc.error = ManifestError("document", "#1", f"not valid JSON in item #{number}: {exc}", origin)
                            raise
                        kind = item.get("kind") if type(item) is dict else None
                        if kind is not None and not (type(kind) is str and kind.endswith("List")):
                            yield origin, item  # the common case, without _flattened's generator
                        else:
                            yield from _flattened(item, f"#1 item #{number}", origin, errors)
                        if end == "]":
                            break
            elif key == "items" and streamed:
                raise NotStreamable("items given twice")
            else:
                envelope[key] = text.value()
            if text.expect(",}", "',' or '}'") == "}":
                break
    if text.peek():
        raise NotStreamable(text.where(text.pos, "text after the object"))
    kind = envelope.get("kind")
    if not streamed:
        yield from _flattened(envelope, "#1", origin, errors)
    elif not (isinstance(kind, str) and kind.endswith("List")):
        raise NotStreamable(f"an object of kind {kind!r} with items, not a List")
    elif "items" in envelope:
        raise NotStreamable("items given twice")


def is_stored(obj: Mapping[str, Any]) -> bool:
    """Whether ``obj`` was served by an API server (a dump's object, ``kubectl get -o yaml``): its
    ``metadata.resourceVersion`` is a non-empty string, which the API server sets on every object
    it stores and ignores in a create. Such an object is read as stored (``new=False``), as the
    agent reads it: a CIDR with host bits that an older API server accepted is masked, not refused."""
    meta = obj.get("metadata")
    version = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    return isinstance(version, str) and bool(version)


def build_cluster(objects: Iterable[tuple[str, Any]]) -> tuple[Cluster, list[ManifestError]]:
    """Build a :class:`Cluster` from ``(origin, object)`` pairs; a later object of the same name wins.
    An object to be created is validated as a create, a dump's object as stored (:func:`is_stored`).

    Returns the cluster and the errors of the objects left out.
    """
    namespaces: dict[str, Namespace] = {}
    pods: dict[str, Pod] = {}
    policies: dict[str, NetworkPolicy] = {}
    nodes: dict[str, Node] = {}
    cluster_policies: dict[str, ClusterNetworkPolicy] = {}
    errors: list[ManifestError] = []
    for origin, obj in objects:
        unread = unread_object(obj, origin)
        if unread is not None:
            errors.append(unread)
            continue
        kind = obj.get("kind")
        if kind not in KINDS:  # another project's kind, a workload or a Service: not for the Cluster
            continue
        try:
            if kind == "Namespace":
                ns = namespace_from(obj)
                namespaces[ns.name] = ns
            elif kind == "Pod":
                pod = pod_from(obj)
                pods[pod.key] = pod
            elif kind == "NetworkPolicy":
                policy = policy_from(obj, new=not is_stored(obj))
                policies[policy.key] = policy
            elif kind == "ClusterNetworkPolicy":
                cluster_policy = cluster_policy_from(obj, new=not is_stored(obj))
                cluster_policies[cluster_policy.key] = cluster_policy
            else:
                node = node_from(obj)
                nodes[node.name] = node
        except InvalidField as exc:
            meta = _mapping_or_empty(obj.get("metadata"))
            name = meta.get("name") or meta.get("generateName")
            ref = f"{meta.get('namespace') or 'default'}/{name}" if kind in ("Pod", "NetworkPolicy") else str(name)
            errors.append(ManifestError(kind, ref, str(exc), origin))
    return Cluster(namespaces=namespaces, pods=pods, policies=policies, nodes=nodes, cluster_policies=cluster_policies), errors


def unread_object(obj: Any, origin: str) -> ManifestError | None:
    """Why ``obj`` (one object of ``origin``) is left out before its kind is read, or None: not a
    mapping, no ``kind``, a kind that is a near spelling of one nftpolicy reads (a typo that would
    otherwise drop the object silently: ``unknown kind 'NetworkPolcy', did you mean
    NetworkPolicy?``), or a kind of :data:`API_VERSIONS` with an apiVersion it does not list.
    A kind far from all of them (ConfigMap, Secret, another project's policy) is no error: such
    objects are ignored. No apiVersion at all is no error (hand-written fixtures leave it out)."""
    if not isinstance(obj, Mapping):
        return ManifestError("object", "?", f"not a mapping (a {type(obj).__name__})", origin)
    kind = obj.get("kind")
    if isinstance(kind, str) and kind in API_VERSIONS:  # the common case first: a kind of ours, of its apiVersion
        api_version = obj.get("apiVersion")
        if api_version is None or api_version in API_VERSIONS[kind]:
            return None
        return ManifestError(kind, _ref(kind, obj), f"apiVersion {api_version!r} is not one nftpolicy reads for a {kind} "
                             f"(expected {' or '.join(API_VERSIONS[kind])})", origin)
    if kind is None:
        return ManifestError("object", _ref("object", obj), "kind: required", origin)
    if not isinstance(kind, str):
        return None  # no kind of ours
    if kind in _REPLACED_KINDS and str(obj.get("apiVersion", POLICY_GROUP)).startswith(POLICY_GROUP):
        return ManifestError(kind, _ref(kind, obj), "a kind of network-policy-api before v1alpha2, which nftpolicy does not "
                             f"read: write it as a ClusterNetworkPolicy of {' or '.join(CLUSTER_POLICY_API_VERSIONS)} with tier: "
                             f"{_REPLACED_KINDS[kind]}", origin)
    near = difflib.get_close_matches(kind.lower(), _KINDS_BY_LOWER, n=1, cutoff=_TYPO_CUTOFF)
    if near:
        return ManifestError(kind, _ref(kind, obj), f"unknown kind {kind!r}, did you mean {_KINDS_BY_LOWER[near[0]]}?", origin)
    return None


_KINDS_BY_LOWER = {kind.lower(): kind for kind in API_VERSIONS}
# network-policy-api's kinds before v1alpha2 (v0.1.x), which ClusterNetworkPolicy replaces: the
# tier each one became. Ignoring them would enforce nothing an operator migrating expects.
# (A kind of that name in another API group is another project's: ignored like any other.)
_REPLACED_KINDS = {"AdminNetworkPolicy": "Admin", "BaselineAdminNetworkPolicy": "Baseline"}
POLICY_GROUP = "policy.networking.k8s.io/"
_CLUSTER_SCOPED = ("Namespace", "Node", "ClusterNetworkPolicy")


def _ref(kind: str, obj: Mapping[str, Any]) -> str:
    """``namespace/name`` of a namespaced kind of ours (name: ``metadata.name``, else
    ``generateName``), the name alone otherwise; never raises."""
    meta = _mapping_or_empty(obj.get("metadata"))
    name = str(meta.get("name") or meta.get("generateName"))
    return f"{meta.get('namespace') or 'default'}/{name}" if kind in API_VERSIONS and kind not in _CLUSTER_SCOPED else name


def _mapping_or_empty(value: Any) -> Mapping[str, Any]:
    """``value`` if it is a mapping, else an empty one (for reading an object that may be malformed)."""
    return value if isinstance(value, Mapping) else {}


def object_ref(kind: str, obj: Mapping[str, Any]) -> str:
    """``namespace/name`` for Pods and NetworkPolicies, ``name`` otherwise: what the object is
    called (with only ``generateName``, the name :func:`object_name` generates for it, so that such
    objects never share a key); never raises (an invalid name is kept as it is)."""
    meta = _mapping_or_empty(obj.get("metadata"))
    try:
        name = object_name(obj)
    except InvalidField:
        name = str(meta.get("name"))
    return f"{meta.get('namespace') or 'default'}/{name}" if kind in ("Pod", "NetworkPolicy") else name


def _namespace(obj: Mapping[str, Any]) -> str:
    """``metadata.namespace`` (default ``default``), interned."""
    return namespace_name(obj["metadata"].get("namespace"))


def namespace_name(namespace: Any) -> str:
    """A ``metadata.namespace`` (None or "": ``default``), checked and interned; raises InvalidField."""
    namespace = namespace or "default"
    if type(namespace) is str and namespace in _NAMESPACES:  # one of the few names seen already
        return _NAMESPACES[namespace]
    if not isinstance(namespace, str) or not DNS_LABEL.fullmatch(namespace):
        raise InvalidField("metadata.namespace", f"invalid namespace {namespace!r} (a lower-case RFC 1123 label)")
    if len(_NAMESPACES) >= 1 << 14:
        _NAMESPACES.clear()
    return _NAMESPACES.setdefault(namespace, sys.intern(namespace))


_NAMESPACES: dict[str, str] = {}  # valid namespace names seen (bounded), each its interned self


def _annotations(value: Any, path: str) -> None:
    """Annotation keys are label keys, compared in lower case; values are any strings."""
    for k, v in mapping_field(value, path).items():
        if not isinstance(v, str):
            raise InvalidField(f"{path}.{k}", "annotation values must be strings")
        label_key(k.lower() if isinstance(k, str) else k, f"{path}.{k}", "annotation")


def namespace_from(obj: Mapping[str, Any]) -> Namespace:
    """A Namespace object -> :class:`Namespace`; adds the automatic ``kubernetes.io/metadata.name`` label."""
    name = object_name(obj, DNS_LABEL)
    labels = {**labels_field(obj["metadata"].get("labels"), "metadata.labels"), NAMESPACE_NAME_LABEL: name}
    return Namespace(name=name, labels=Labels.interned(labels))


def node_from(obj: Mapping[str, Any]) -> Node:
    """A Node object -> :class:`Node` (labels, ``status.addresses`` IPs: all, and those of type
    ``InternalIP`` or ``ExternalIP`` as its peer addresses; ``spec.podCIDRs`` or ``spec.podCIDR``)."""
    name = object_name(obj)
    spec = mapping_field(obj.get("spec"), "spec")
    status = mapping_field(obj.get("status"), "status")
    addresses, peer_addresses = [], []
    for i, a in enumerate(list_field(status.get("addresses"), "status.addresses")):
        entry = mapping_field(a, f"status.addresses[{i}]")
        address = entry.get("address")
        if isinstance(address, str) and _is_ip(address):
            canonical = str(ipaddress.ip_address(address))
            addresses.append(canonical)
            if entry.get("type") in NODE_PEER_ADDRESS_TYPES and canonical not in peer_addresses:
                peer_addresses.append(canonical)
    cidrs = list_field(spec.get("podCIDRs"), "spec.podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    for i, c in enumerate(cidrs):
        network_field(c, f"spec.podCIDRs[{i}]")
    labels = labels_field(obj["metadata"].get("labels"), "metadata.labels")
    return Node(name=name, addresses=tuple(addresses), pod_cidrs=tuple(cidrs), labels=Labels.interned(labels),
                peer_addresses=tuple(peer_addresses))


def node_ready(obj: Mapping[str, Any]) -> bool:
    """Whether a Node object's ``Ready`` condition has status ``True`` (the kubelet's heartbeat:
    the NodeCondition API reference); False without one. Never raises: a status it cannot read
    is not ready. Not part of :class:`Node` (no rule depends on it, and a Node's readiness
    changing must not wake a sync): the agent reads it to choose who writes an object's Events."""
    status = obj.get("status")
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    return isinstance(conditions, list) and any(isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
                                                for c in conditions)


NODE_PEER_ADDRESS_TYPES = ("InternalIP", "ExternalIP")  # the Node addresses a nodes peer matches
_IPV4 = re.compile(r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])")


def _canonical_ip(text: str) -> str | None:
    """The address in its canonical text, or None when it is not one. The kernel compares
    addresses, not text: "FD00::A" and "fd00::a" must be one element. (Dotted IPv4 without
    leading zeros is already canonical: the common case skips the parser.)"""
    if _IPV4.fullmatch(text):
        return text
    return str(ipaddress.ip_address(text)) if _is_ip(text) else None


def _is_ip(text: str) -> bool:
    if "%" in text:  # an IPv6 zone (scope) is never a pod or node address
        return False
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def pod_from(obj: Mapping[str, Any]) -> Pod:
    """A Pod object -> :class:`Pod`: labels, ``spec.nodeName``, ``status.podIPs`` (or ``podIP``),
    phase, ``spec.hostNetwork`` and the containers' named ports (:func:`pod_model`)."""
    name = object_name(obj)
    meta = obj["metadata"]
    spec = mapping_field(obj.get("spec"), "spec")
    status = mapping_field(obj.get("status"), "status")
    ips: list[str] = []
    for i, entry in enumerate(list_field(status.get("podIPs"), "status.podIPs")):
        ips.append(str((entry if type(entry) is dict else mapping_field(entry, f"status.podIPs[{i}]")).get("ip")))
    if not ips and status.get("podIP"):
        ips.append(str(status["podIP"]))
    return pod_model(_namespace(obj), name, labels_field(meta.get("labels"), "metadata.labels"), spec.get("nodeName"), ips,
                     status.get("phase"), _boolean(spec.get("hostNetwork"), "spec.hostNetwork"), _container_ports(spec))


def pod_model(namespace: str, name: str, labels: Labels, node: Any, ips: list[str], phase: Any, host_network: bool,
              ports: tuple[ContainerPort, ...]) -> Pod:
    """The :class:`Pod` of fields already read (the JSON reader :func:`pod_from`, the agent's
    protobuf reader): ``namespace`` and ``name`` valid, ``ips`` the text of ``status.podIPs``
    (or ``podIP``; changed in place to their canonical text), ``phase`` None or "" for none (then
    ``Running`` with an address, else ``Pending``), ``node`` None for none. Raises
    InvalidField for an address that is not one."""
    for i, ip in enumerate(ips):
        canonical = _canonical_ip(ip)
        if canonical is None:
            raise InvalidField(f"status.podIPs[{i}]", f"invalid IP address {ip!r}")
        ips[i] = canonical
    return Pod(  # the strings that repeat across pods are interned: one copy each in memory
        namespace=namespace,
        name=name,
        labels=labels,
        node=sys.intern(node) if isinstance(node, str) else node,
        ips=tuple(ips),
        phase=sys.intern(str(phase or ("Running" if ips else "Pending"))),
        host_network=host_network,
        ports=ports,
    )


def _container_ports(spec: Mapping[str, Any]) -> tuple[ContainerPort, ...]:
    """The containers' ports, in order. Pods of one workload have the same ports: the common
    case (lists of dicts with integer port numbers) is looked up by the ports' (name, number,
    protocol) in a cache of port lists that passed the full check, and shares its tuple; any
    other shape gets the full check, which names the first invalid field."""
    containers = spec.get("containers")
    if type(containers) is list:
        key = []
        for container in containers:
            entries = container.get("ports") if type(container) is dict else None
            if type(entries) is not list:
                if entries or type(container) is not dict:
                    break  # not a list of ports (or not a container object): the full check says why
                continue
            for p in entries:
                number = p.get("containerPort") if type(p) is dict else None
                if type(number) is not int:  # also refuses True and 80.0, which equal 1 and 80
                    break
                key.append((p.get("name"), number, p.get("protocol")))
            else:
                continue
            break
        else:
            try:
                return _checked_ports(tuple(key))
            except (TypeError, InvalidField):  # an unhashable name or protocol, or an invalid value
                pass
    return _container_ports_checked(spec)


def container_ports(containers: Iterable[Iterable[tuple[str | None, int, str | None]]]) -> tuple[ContainerPort, ...]:
    """The ports of ``containers``, each given as its ``(name, containerPort, protocol)``
    triples (None: absent), checked as :func:`pod_from` checks them (the same cache); raises
    InvalidField naming the first invalid field (``spec.containers[1].ports[0].protocol``)."""
    listed = [list(ports) for ports in containers]
    try:
        return _checked_ports(tuple(triple for ports in listed for triple in ports))
    except InvalidField:
        pass
    return _container_ports_checked({"containers": [{"ports": [{"name": n, "containerPort": c, "protocol": p} for n, c, p in ports]}
                                                    for ports in listed]})


@functools.lru_cache(maxsize=1 << 12)
def _checked_ports(key: tuple[tuple[Any, int, Any], ...]) -> tuple[ContainerPort, ...]:
    """``(name, number, protocol)`` triples -> ContainerPorts, or InvalidField. A hit equals,
    element by element, a port list that passed the full check, and equal values get the same
    verdict there (the numbers are exact ints: True and 80.0, equal to 1 and 80, never get here)."""
    return _container_ports_checked({"containers": [{"ports": [{"name": n, "containerPort": c, "protocol": p} for n, c, p in key]}]})


def _container_ports_checked(spec: Mapping[str, Any]) -> tuple[ContainerPort, ...]:
    """The full check of ``spec.containers[*].ports``: raises InvalidField naming the first
    invalid field."""
    ports = []
    for ci, container in enumerate(list_field(spec.get("containers"), "spec.containers")):
        container_ports = mapping_field(container, f"spec.containers[{ci}]").get("ports")
        for pi, p in enumerate(list_field(container_ports, f"spec.containers[{ci}].ports") if container_ports else ()):
            p = mapping_field(p, f"spec.containers[{ci}].ports[{pi}]")
            number, protocol, port_name = p.get("containerPort"), p.get("protocol") or "TCP", p.get("name")
            if port_name is not None and not isinstance(port_name, str):
                raise InvalidField(f"spec.containers[{ci}].ports[{pi}].name", f"must be a string, got {port_name!r}")
            if type(number) is not int or not 1 <= number <= 65535:
                raise InvalidField(f"spec.containers[{ci}].ports[{pi}].containerPort", f"must be a number 1-65535, got {number!r}")
            if protocol not in PROTOCOLS:
                _protocol(protocol, f"spec.containers[{ci}].ports[{pi}].protocol")
            ports.append(_container_port(port_name, number, protocol))
    return tuple(ports)


# Pods of one workload name the same ports: one shared (immutable) object per distinct port.
_container_port = functools.lru_cache(maxsize=1 << 14)(ContainerPort)


def _protocol(value: Any, path: str) -> Any:
    if value is None:
        return "TCP"
    if value not in PROTOCOLS:
        raise InvalidField(path, f"unsupported protocol {value!r} (TCP, UDP or SCTP)")
    return value


def _boolean(value: Any, path: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidField(path, f"must be true or false, got {value!r}")
    return value


def _port(value: Any, path: str) -> PolicyPort:
    entry = mapping_field(value, path)
    known_fields(entry, _FIELDS["port"], path)
    protocol = _protocol(entry.get("protocol"), f"{path}.protocol")
    port, end_port = entry.get("port"), entry.get("endPort")
    if isinstance(port, bool) or not (port is None or isinstance(port, (int, str))):
        raise InvalidField(f"{path}.port", f"must be a number or a port name, got {port!r}")
    if isinstance(port, int) and not 1 <= port <= 65535:
        raise InvalidField(f"{path}.port", f"must be between 1 and 65535, got {port}")
    if isinstance(port, str) and not _IANA_SVC_NAME.fullmatch(port):
        raise InvalidField(f"{path}.port", f"invalid port name {port!r} (IANA service name: 1-15 lower-case letters, digits and '-')")
    if end_port is not None:
        if isinstance(end_port, bool) or not isinstance(end_port, int) or not 1 <= end_port <= 65535:
            raise InvalidField(f"{path}.endPort", f"must be between 1 and 65535, got {end_port!r}")
        if not isinstance(port, int):
            raise InvalidField(f"{path}.endPort", "may only be set with a numeric port")
        if end_port < port:
            raise InvalidField(f"{path}.endPort", f"must be greater than or equal to port ({port}), got {end_port}")
    return PolicyPort(protocol=protocol, port=port, end_port=end_port)


def _peer(value: Any, path: str, new: bool) -> Peer:
    entry = mapping_field(value, path)
    known_fields(entry, _FIELDS["peer"], path)
    block = entry.get("ipBlock")
    has_selector = entry.get("podSelector") is not None or entry.get("namespaceSelector") is not None
    if block is not None and has_selector:
        raise InvalidField(path, "may not specify both ipBlock and a selector")
    if block is None and not has_selector:
        raise InvalidField(path, "must specify a peer (podSelector, namespaceSelector or ipBlock)")
    if block is None:
        return Peer(
            pod_selector=selector_from(entry["podSelector"], f"{path}.podSelector") if entry.get("podSelector") is not None else None,
            namespace_selector=selector_from(entry["namespaceSelector"], f"{path}.namespaceSelector")
            if entry.get("namespaceSelector") is not None else None,
        )
    block = mapping_field(block, f"{path}.ipBlock")
    known_fields(block, _FIELDS["ipBlock"], f"{path}.ipBlock")
    cidr = network_field(block.get("cidr"), f"{path}.ipBlock.cidr", new)
    excepts = []
    for i, text in enumerate(list_field(block.get("except"), f"{path}.ipBlock.except")):
        hole = network_field(text, f"{path}.ipBlock.except[{i}]", new)
        if hole.version != cidr.version or not hole.subnet_of(cidr) or hole == cidr:  # type: ignore[arg-type]
            raise InvalidField(f"{path}.ipBlock.except[{i}]", f"{text} must be a strict subset of cidr {cidr}")
        excepts.append(hole)
    return Peer(ip_block=IPBlock(cidr=cidr, excepts=tuple(excepts)))


def _rules(value: Any, path: str, peers_key: str, new: bool) -> tuple[PolicyRule, ...]:
    rules = []
    for i, rule in enumerate(list_field(value, path)):
        rpath = f"{path}[{i}]"
        rule = mapping_field(rule, rpath)
        known_fields(rule, _FIELDS["ingress" if peers_key == "from" else "egress"], rpath)
        peers = tuple(_peer(p, f"{rpath}.{peers_key}[{j}]", new) for j, p in enumerate(list_field(rule.get(peers_key), f"{rpath}.{peers_key}")))
        ports = tuple(_port(p, f"{rpath}.ports[{j}]") for j, p in enumerate(list_field(rule.get("ports"), f"{rpath}.ports")))
        rules.append(PolicyRule(peers=peers, ports=ports))
    return tuple(rules)


def policy_from(obj: Mapping[str, Any], new: bool = False) -> NetworkPolicy:
    """A NetworkPolicy object -> :class:`NetworkPolicy`, defaulted and validated.

    ``new``: validate as the API server validates a create (manifests); else as an object it
    already stores (the agent's API sources), which may hold legacy CIDRs with host bits.
    Raises :class:`InvalidField` naming the first invalid field.
    """
    name = object_name(obj)
    labels_field(obj["metadata"].get("labels"), "metadata.labels")
    _annotations(obj["metadata"].get("annotations"), "metadata.annotations")
    spec = mapping_field(obj.get("spec"), "spec")
    known_fields(spec, _FIELDS["spec"], "spec")
    ingress = _rules(spec.get("ingress"), "spec.ingress", "from", new)
    egress = _rules(spec.get("egress"), "spec.egress", "to", new)
    types = list_field(spec.get("policyTypes"), "spec.policyTypes")
    if len(types) > 2:
        raise InvalidField("spec.policyTypes", f"may not specify more than two policyTypes, got {len(types)}")
    for i, t in enumerate(types):
        if t not in ("Ingress", "Egress"):
            raise InvalidField(f"spec.policyTypes[{i}]", f"unsupported value {t!r} (Ingress or Egress)")
    if not types:
        types = ["Ingress", "Egress"] if egress else ["Ingress"]
    return NetworkPolicy(
        namespace=_namespace(obj),
        name=name,
        pod_selector=selector_from(spec.get("podSelector"), "spec.podSelector"),
        policy_types=frozenset(t.lower() for t in types),
        ingress=ingress,
        egress=egress,
    )


def fail_closed_policy(obj: Mapping[str, Any], reason: str) -> NetworkPolicy | None:
    """For a NetworkPolicy that failed validation: a policy with no rules that isolates the pods
    it selects, for the directions it names (DESIGN.md section 4: an unrenderable policy fails
    closed for its pods and never blocks other policies).

    An unreadable podSelector selects every pod of the namespace; policyTypes default as the API
    server does (Ingress, plus Egress when egress rules are present); ``reason`` (the validation
    error) is kept as :attr:`NetworkPolicy.fail_closed`, for explain to name. None when the object
    has no name at all.
    """
    meta = _mapping_or_empty(obj.get("metadata"))
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    spec = _mapping_or_empty(obj.get("spec"))
    try:
        selector = selector_from(spec.get("podSelector"), "spec.podSelector")
    except InvalidField:
        selector = LabelSelector()
    types = spec.get("policyTypes")
    directions = {t.lower() for t in types if t in ("Ingress", "Egress")} if isinstance(types, list) and types else set()
    if not directions:  # the API server's defaulting
        directions = {"ingress", "egress"} if isinstance(spec.get("egress"), list) and spec["egress"] else {"ingress"}
    return NetworkPolicy(
        namespace=str(meta.get("namespace") or "default"), name=name, pod_selector=selector,
        policy_types=frozenset(directions), fail_closed=reason,
    )
