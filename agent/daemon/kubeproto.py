"""Lists and watches in the Kubernetes API's protobuf (``application/vnd.kubernetes.protobuf``),
decoded by the ``protobuf`` package's C decoder (upb) into the messages of ``k8s_pb2`` (built
from the API's own ``generated.proto`` files, only the fields the model reads:
:mod:`.kubefields`), and read into model objects (:data:`MESSAGES`).

The wire format, from k8s.io/apimachinery v0.36.3 (``pkg/runtime/serializer/protobuf``,
``pkg/util/framer``): a body is the 4 bytes ``k8s\\x00`` and a ``runtime.Unknown`` whose ``raw``
is the object (a ``PodList``, a ``Status``), ``contentEncoding`` empty. A watch answers
``application/vnd.kubernetes.protobuf;stream=watch``: frames of a 4-byte big-endian length and a
``meta.v1.WatchEvent`` (no prefix), whose ``object.raw`` is a body as above.

Only Pods, Namespaces, Nodes and NetworkPolicies have protobuf (a CustomResource such as
ClusterNetworkPolicy has none). The agent asks for protobuf with JSON as the second choice
(:data:`ACCEPT`) and reads each answer as its ``Content-Type`` says, so a server or proxy that
answers JSON is read as before. Without the generated module (a build that could not make it)
or without upb, every request asks for JSON: :data:`UNAVAILABLE` says why (the agent logs it once).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import orjson

from nftpolicy.translators.manifests import (container_ports, namespace_from, namespace_name, node_from, object_ref, pod_from,
                                             pod_model, policy_from)
from nftpolicy.translators.model import Pod
from nftpolicy.translators.validation import checked_name, labels_field

PROTOBUF = "application/vnd.kubernetes.protobuf"
ACCEPT = f"{PROTOBUF}, application/json"  # protobuf first; a server without it answers JSON
MAGIC = b"k8s\x00"
MAX_FRAME = 64 << 20  # bytes: a watch frame longer than this is refused (etcd stores objects up to 1.5 MiB by default)
KINDS = ("Pod", "Namespace", "Node", "NetworkPolicy")  # the kinds that have protobuf

try:
    from google.protobuf import message as _message
    from google.protobuf import unknown_fields as _unknown_fields
    from google.protobuf.internal import api_implementation as _implementation

    from . import k8s_pb2
except ImportError as exc:  # the build could not generate k8s_pb2 (setup.py), or no protobuf package
    UNAVAILABLE: str | None = f"cannot import the generated messages ({exc})"
else:
    UNAVAILABLE = None if _implementation.Type() == "upb" else \
        f"the protobuf package runs its {_implementation.Type()} implementation, not its C one (upb)"


class ProtobufError(ValueError):
    """A body or watch frame that is not what the protobuf serializer writes (retried as any
    unreadable answer: a ValueError)."""


def accept(kind: str) -> str:
    """The ``Accept`` header of requests for ``kind``: protobuf first when it has protobuf and
    the decoder is there, else JSON."""
    return ACCEPT if kind in KINDS and UNAVAILABLE is None else "application/json"


def is_protobuf(response: Any) -> bool:
    """True when urllib3 ``response`` is in protobuf (its ``Content-Type``)."""
    return str(response.headers.get("Content-Type") or "").startswith(PROTOBUF)


def unwrap(body: bytes) -> tuple[str, bytes]:
    """The ``(kind, raw object)`` of a protobuf body; raises ProtobufError."""
    if body[:4] != MAGIC:
        raise ProtobufError(f"a protobuf body must start with {MAGIC!r}, got {body[:4]!r}")
    try:
        envelope = k8s_pb2.Unknown.FromString(body[4:])
    except _message.DecodeError as exc:
        raise ProtobufError(f"not a runtime.Unknown: {exc}") from None
    if envelope.contentEncoding:
        raise ProtobufError(f"content encoding {envelope.contentEncoding!r} (none expected)")
    return envelope.typeMeta.kind, envelope.raw


def _parse(cls: Any, raw: bytes) -> Any:
    try:
        return cls.FromString(raw)
    except _message.DecodeError as exc:
        raise ProtobufError(f"not a {cls.__name__}: {exc}") from None


def list_page(kind: str, body: bytes) -> tuple[Any, str, str]:
    """A list page of ``kind``: ``(items, resourceVersion, continue)``, the items messages for
    :data:`MESSAGES`; raises ProtobufError."""
    got, raw = unwrap(body)
    if got != f"{kind}List":
        raise ProtobufError(f"a list of {kind} expected, got {got!r}")
    page = _parse(getattr(k8s_pb2, f"{kind}List"), raw)
    return page.items, page.metadata.resourceVersion, getattr(page.metadata, "continue")


def status(raw: bytes) -> dict[str, Any]:
    """A ``meta.v1.Status`` as its JSON fields (``message``, ``reason``, ``code``)."""
    message = _parse(k8s_pb2.Status, raw)
    return {"kind": "Status", "apiVersion": "v1", "message": message.message, "reason": message.reason, "code": message.code}


def status_json(body: bytes) -> str | None:
    """The JSON text of the ``Status`` a protobuf error body holds (for ``ApiException.body``,
    which the logs read), or None when it holds none."""
    try:
        kind, raw = unwrap(body)
        return orjson.dumps(status(raw)).decode() if kind == "Status" else None
    except ProtobufError:
        return None


def watch_events(response: Any, kind: str) -> Iterator[tuple[str, Any]]:
    """The events of a protobuf watch ``response`` (urllib3, unread) as ``(type, object)``: a
    message of ``kind`` for ADDED, MODIFIED, DELETED and BOOKMARK, the Status's JSON fields
    (:func:`status`) for ERROR. Ends with the stream; raises ProtobufError for a frame that is cut
    short, longer than :data:`MAX_FRAME`, or not a watch event of ``kind``."""
    cls = getattr(k8s_pb2, kind)
    while True:
        header = response.read(4)
        if not header:
            return
        size = int.from_bytes(header, "big") if len(header) == 4 else -1
        if not 0 <= size <= MAX_FRAME:
            raise ProtobufError(f"watch frame of {size} bytes" if size >= 0 else "watch stream cut inside a frame's length")
        frame = response.read(size)
        if len(frame) != size:
            raise ProtobufError(f"watch stream cut inside a frame ({len(frame)} of {size} bytes)")
        event = _parse(k8s_pb2.WatchEvent, frame)
        got, raw = unwrap(event.object.raw)
        if event.type == "ERROR":
            if got != "Status":
                raise ProtobufError(f"a watch ERROR event holds a Status, got {got!r}")
            yield event.type, status(raw)
        elif got and got != kind:
            raise ProtobufError(f"a watch event of {kind} expected, got {got!r}")
        else:
            yield event.type, _parse(cls, raw)


def resource_version(obj: Any) -> str:
    """``metadata.resourceVersion`` of a message of :data:`KINDS` (a BOOKMARK has nothing else)."""
    return str(obj.metadata.resourceVersion)


# ---- messages -> the JSON path's objects and model objects ---------------------------------------

_STRICT = {"NetworkPolicySpec"}  # messages generated whole (kubefields.ALL): unknown fields under them are newer fields


def as_mapping(obj: Any, strict: bool = False) -> dict[str, Any]:
    """Message ``obj`` as the JSON object of its present fields (``IntOrString`` as a number or
    a string, maps as objects, bytes not expected), as the JSON path would read it. Under a
    message generated whole (:data:`_STRICT`) a field this agent's messages do not know (one
    newer than the pinned API) becomes a key ``field <number>``, which the JSON path's strict
    reading refuses as it refuses any unknown field."""
    strict = strict or obj.DESCRIPTOR.name in _STRICT
    out: dict[str, Any] = {}
    for field, value in obj.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = dict(value)
        elif field.message_type is not None:
            out[field.name] = [_value(v, strict) for v in value] if field.is_repeated else _value(value, strict)
        else:
            out[field.name] = list(value) if field.is_repeated else value
    if strict:
        unknown = _unknown_fields.UnknownFieldSet(obj)
        for i in range(len(unknown)):
            out[f"field {unknown[i].field_number}"] = "(newer than this agent's API version)"
    return out


def _value(message: Any, strict: bool) -> Any:
    if message.DESCRIPTOR.name == "IntOrString":  # util/intstr: type 0 is intVal, 1 strVal
        return message.strVal if message.type == 1 else message.intVal
    return as_mapping(message, strict)


def pod_of(message: Any) -> Pod:
    """A Pod message -> :class:`Pod`, as :func:`~nftpolicy.translators.manifests.pod_from`
    reads the same Pod's JSON (:func:`~nftpolicy.translators.manifests.pod_model` builds both;
    an empty string is an absent field, as the API's JSON leaves it out); raises InvalidField."""
    meta, spec, status_ = message.metadata, message.spec, message.status
    if not meta.name:  # only a generateName, or none: the JSON path's reading
        return pod_from(as_mapping(message))
    ips = [entry.ip for entry in status_.podIPs]
    if not ips and status_.podIP:
        ips.append(status_.podIP)
    ports = container_ports([(p.name or None, p.containerPort, p.protocol or None) for p in c.ports] for c in spec.containers)
    return pod_model(namespace_name(meta.namespace), checked_name(meta.name), labels_field(meta.labels, "metadata.labels"),
                     spec.nodeName or None, ips, status_.phase, spec.hostNetwork, ports)


class Messages:
    """What the store needs to read protobuf messages of :data:`KINDS` (see
    :class:`~.store.Reader`): Pods straight to model objects (:func:`pod_of`), the other kinds
    (a few thousand objects at most) through the JSON path's readers of :func:`as_mapping`."""

    CONVERT: dict[str, Callable[[Mapping[str, Any]], Any]] = {"Namespace": namespace_from, "Node": node_from,
                                                               "NetworkPolicy": policy_from}

    def __repr__(self) -> str:
        return "Messages()"

    def ref(self, kind: str, obj: Any) -> str:
        """``namespace/name`` of a Pod or NetworkPolicy, else ``name`` (as ``object_ref``)."""
        meta = obj.metadata
        if not meta.name:
            return object_ref(kind, as_mapping(obj))
        return f"{meta.namespace or 'default'}/{meta.name}" if kind in ("Pod", "NetworkPolicy") else str(meta.name)

    def convert(self, kind: str, obj: Any) -> Any:
        """The model object of message ``obj``; raises InvalidField."""
        return pod_of(obj) if kind == "Pod" else self.CONVERT[kind](as_mapping(obj))

    def mapping(self, kind: str, obj: Any) -> Mapping[str, Any]:
        """``obj`` as the JSON path's object (for a fail-closed stand-in and its Event)."""
        return as_mapping(obj)


MESSAGES = Messages()
