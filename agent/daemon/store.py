"""The in-memory cluster the sources feed and the reconciler reads: model objects per kind.

A :class:`Store` keeps only model objects (the fields the translator needs), built by the same
validation as ``nftpolicy render`` (:mod:`nftpolicy.translators.manifests`); an invalid
NetworkPolicy or ClusterNetworkPolicy stands as its fail-closed model. It knows nothing of where
objects come from (:mod:`.sources`: the Kubernetes API or a manifests directory).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import AbstractSet, Any, Callable, Iterable, Mapping, Protocol

from nftpolicy.translators.clusterpolicy import cluster_policy_from, fail_closed_cluster_policy
from nftpolicy.translators.manifests import (
    fail_closed_policy,
    namespace_from,
    node_from,
    node_ready,
    object_ref,
    pod_from,
    policy_from,
)
from nftpolicy.translators.model import Cluster
from nftpolicy.translators.objectcost import ObjectLimits, OverLimit, over_limit, policy_cost
from nftpolicy.translators.refusals import closed_policy
from nftpolicy.translators.rules import safe_text
from nftpolicy.translators.validation import InvalidField

from .memory import gc_paused
from .metrics import Metrics

# The invalid-object errors keep the logger they always had (operators filter logs by it).
log = logging.getLogger("nftpolicy.sources")

KINDS = ("Namespace", "Pod", "NetworkPolicy", "Node", "ClusterNetworkPolicy")
CONVERT: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "Namespace": namespace_from, "Pod": pod_from, "NetworkPolicy": policy_from, "Node": node_from,
    "ClusterNetworkPolicy": cluster_policy_from,
}
# An invalid object -> its fail-closed stand-in, given the object and why it is invalid.
FAIL_CLOSED: dict[str, Callable[[Mapping[str, Any], str], Any]] = {
    "NetworkPolicy": fail_closed_policy, "ClusterNetworkPolicy": fail_closed_cluster_policy,
}



class Reader(Protocol):
    """How the store reads the API objects a source hands it: JSON objects (:data:`JSON`) or
    protobuf messages (:data:`.kubeproto.MESSAGES`)."""

    def ref(self, kind: str, obj: Any) -> str:
        """What ``obj`` is called: ``namespace/name``, or ``name`` (cluster-scoped kinds)."""

    def convert(self, kind: str, obj: Any) -> Any:
        """The model object of ``obj``; raises InvalidField."""

    def mapping(self, kind: str, obj: Any) -> Mapping[str, Any]:
        """``obj`` as a JSON object (its fail-closed stand-in and its Event read it)."""


class JsonObjects:
    """:class:`Reader` of JSON objects (parsed API answers, manifests)."""

    def __repr__(self) -> str:
        return "JsonObjects()"

    def ref(self, kind: str, obj: Any) -> str:
        return object_ref(kind, obj)

    def convert(self, kind: str, obj: Any) -> Any:
        return CONVERT[kind](obj)

    def mapping(self, kind: str, obj: Any) -> Mapping[str, Any]:
        return obj  # type: ignore[no-any-return]


JSON = JsonObjects()

class FailedClosed(Protocol):
    """Told of each object the agent fails closed on: (kind, the API object, why, whether its
    fail-closed stand-in is enforced, the nodes that see it so: none, every node); the agent
    records an Event (:meth:`nftpolicy.agent.daemon.events.EventRecorder.failed_closed`)."""

    def __call__(self, kind: str, obj: Mapping[str, Any], exc: InvalidField, enforced: bool,
                 writers: AbstractSet[str] = frozenset()) -> None:
        """Record it."""


# Told of each policy the kernel refused: (kind, the API object's identity: ``metadata`` with
# name, namespace, uid, generation and resourceVersion, the kernel's reason); an Event too.
KernelRefused = Callable[[str, Mapping[str, Any], str], None]
IDENTITY_FIELDS = ("name", "namespace", "uid", "generation", "resourceVersion")
LIMITS = ("rules", "elements")  # the caps of ObjectLimits, as the over-limit metric names them
MESSAGE_MAX_BYTES = 1024  # of an invalid object's log line (an invalid name can be long)


class Store:
    """The in-memory cluster: model objects per kind, thread-safe, with change notification.

    ``changed`` is set on every change; ``pending_since`` is the monotonic time of the oldest
    change not yet taken by :meth:`take` (for the event-to-kernel latency).
    """

    def __init__(self, metrics: Metrics, limits: ObjectLimits = ObjectLimits()) -> None:
        self.metrics, self.limits = metrics, limits
        self._lock = threading.Lock()
        self._objects: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
        self._invalid: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}
        self._over: dict[str, dict[str, str]] = {kind: {} for kind in FAIL_CLOSED}  # policies beyond a cap: key -> the cap's name
        self._rendered_over: dict[tuple[str, str], str] = {}  # beyond --max-object-elements as rendered (:meth:`rendered_over`)
        self._listed: set[str] = set()
        # (kind, key) -> the model object now (None: gone), for every object that changed since
        # the last take: what an incremental sync feeds the renderer. Kept from the first take()
        # on: before it every sync is a full one (the first lists would leave a tuple per object)
        self._changes: dict[tuple[str, str], Any] = {}
        self._taken = False
        self._new_address: tuple[str, str] | None = None  # the last Pod change that gave a pod a new address
        self.changed = threading.Event()
        self.pending_since: float | None = None
        self.failed_closed: FailedClosed | None = None
        self.kernel_refused: KernelRefused | None = None
        # The policies' identities (what an Event names): (kind, key) -> metadata; no other kind's
        self._identities: dict[tuple[str, str], dict[str, Any]] = {}
        self._ready_nodes: set[str] = set()  # the Nodes whose Ready condition is True (:meth:`ready_nodes`)
        for kind in KINDS:  # every series from the start; then each kind's when it changes
            metrics.watched_objects.labels(kind).set(0)
            metrics.invalid_objects.labels(kind).set(0)
        for kind in FAIL_CLOSED:
            for limit in LIMITS:
                metrics.over_limit_objects.labels(kind, limit).set(0)

    def _convert(self, kind: str, key: str, obj: Any, invalid: dict[str, str], reader: Reader) -> Any:
        """The model object, or None (a NetworkPolicy or ClusterNetworkPolicy that fails
        validation, or is beyond a cap of :attr:`limits` (:mod:`~nftpolicy.translators.objectcost`):
        its fail-closed stand-in); ``invalid`` (key -> message) records each invalid object."""
        model = None
        if kind in FAIL_CLOSED:
            meta = reader.mapping(kind, obj).get("metadata")  # a protobuf message too (policies are few)
            meta = meta if isinstance(meta, Mapping) else {}
            self._identities[(kind, key)] = {f: meta[f] for f in IDENTITY_FIELDS if f in meta}
            self._over[kind].pop(key, None)
        try:
            model = reader.convert(kind, obj)
            beyond = over_limit(policy_cost(model), self.limits) if kind in FAIL_CLOSED else None
            if beyond is not None:
                self._over[kind][key] = beyond.limit
                raise beyond
            invalid.pop(key, None)
            return model
        except InvalidField as exc:
            message = safe_text(f"{kind} {key}: {exc}", MESSAGE_MAX_BYTES)  # the object's text: no control character reaches a log
            if self._invalid[kind].get(key) != message:
                log.error("invalid object: %s", message, extra={"kind": kind, "object": key})
            invalid[key] = message
            if kind not in FAIL_CLOSED:
                return None
            mapping = reader.mapping(kind, obj)
            reason = safe_text(str(exc), MESSAGE_MAX_BYTES)
            closed = closed_policy(model, reason) if isinstance(exc, OverLimit) and model is not None else FAIL_CLOSED[kind](mapping, reason)
            if self.failed_closed is not None:
                self.failed_closed(kind, mapping, exc, closed is not None)
            return closed

    def _touch(self, kind: str) -> None:
        """A change of ``kind``: its gauges, the oldest pending change's time, the wake-up."""
        if self.pending_since is None:
            self.pending_since = time.monotonic()
        self.metrics.watched_objects.labels(kind).set(len(self._objects[kind]))
        self.metrics.invalid_objects.labels(kind).set(len(self._invalid[kind]))
        if kind in FAIL_CLOSED:
            self._over_gauges(kind)
        self.changed.set()

    def _over_gauges(self, kind: str) -> None:
        """``nftpolicy_over_limit_objects`` of ``kind``: its objects beyond each cap, as read and
        as rendered."""
        rendered = sum(1 for k, _ in self._rendered_over if k == kind)
        for limit in LIMITS:
            over = sum(1 for v in self._over[kind].values() if v == limit) + (rendered if limit == "elements" else 0)
            self.metrics.over_limit_objects.labels(kind, limit).set(over)

    def rendered_over(self, over: Mapping[tuple[str, str], OverLimit], writers: Callable[[str, str], AbstractSet[str]]) -> None:
        """The policies the node renderer enforces fail-closed now because their sets would hold
        more than ``--max-object-elements`` (``(kind, key)`` -> why; counted on the cluster as it
        knows it: :class:`~nftpolicy.translators.noderender.NodeRenderer`): each one new since
        the last call, or changed since, is logged and told to :attr:`failed_closed` with the
        nodes that see it so (``writers(kind, key)``), and one no longer beyond is logged; the
        over-limit gauge counts them."""
        with self._lock:
            new = [(ref, why, self._identities.get(ref)) for ref, why in over.items() if ref not in self._rendered_over]
            within = sorted(self._rendered_over.keys() - over.keys())  # counted again (a full render) with fewer pods
            changed = {kind for kind, _ in over.keys() ^ self._rendered_over.keys()}
            self._rendered_over = {ref: str(why) for ref, why in over.items()}
            for kind in changed:
                self._over_gauges(kind)
        for kind, key in within:
            log.info("%s %s: within --max-object-elements again, enforced as written", kind, key, extra={"kind": kind, "object": key})
        for (kind, key), why, identity in new:
            log.error("invalid object: %s", safe_text(f"{kind} {key}: {why}", MESSAGE_MAX_BYTES), extra={"kind": kind, "object": key})
            if self.failed_closed is not None and identity is not None:
                self.failed_closed(kind, {"metadata": identity}, why, True, writers(kind, key))

    def replace(self, kind: str, objects: Iterable[Any], reader: Reader = JSON) -> int:
        """A full list of ``kind`` (any iterable: pages are converted as they come; API objects
        that ``reader`` reads): replaces every object of that kind and marks it listed. Returns
        how many objects were listed."""
        converted = {}
        count = 0
        invalid: dict[str, str] = {}
        ready: set[str] = set()
        with gc_paused():
            for obj in objects:  # outside the lock: fetching pages takes a while
                count += 1
                key = reader.ref(kind, obj)
                model = self._convert(kind, key, obj, invalid, reader)
                if model is not None:
                    converted[key] = model
                if kind == "Node" and node_ready(reader.mapping(kind, obj)):
                    ready.add(key)
        with self._lock:
            if kind == "Node":
                self._ready_nodes = ready
            self._invalid[kind] = invalid
            if kind in FAIL_CLOSED:
                self._over[kind] = {k: v for k, v in self._over[kind].items() if k in invalid}
            old = self._objects[kind]
            for gone in old.keys() - converted.keys():
                self._identities.pop((kind, gone), None)
            if self._taken or kind in FAIL_CLOSED:
                for key in old.keys() | converted.keys():
                    if old.get(key) != converted.get(key):
                        self._rendered_over.pop((kind, key), None)  # counted again, and told again if still beyond
                        if self._taken:
                            self._changes[(kind, key)] = converted.get(key)
            self._objects[kind] = converted
            self._listed.add(kind)
            self._touch(kind)
        return count

    def apply(self, kind: str, event: str, obj: Any, reader: Reader = JSON) -> None:
        """One watch event (``ADDED``, ``MODIFIED``, ``DELETED``) for ``kind`` (an API object
        that ``reader`` reads). An event whose
        model object equals the one held (a Node's status heartbeat, a Pod's condition or
        container status: fields the translator does not read) changes nothing and wakes no sync."""
        key = reader.ref(kind, obj)
        ready = kind == "Node" and event != "DELETED" and node_ready(reader.mapping(kind, obj))
        with self._lock:
            if ready:
                self._ready_nodes.add(key)
            elif kind == "Node":
                self._ready_nodes.discard(key)
            invalid_before = len(self._invalid[kind])
            model = None if event == "DELETED" else self._convert(kind, key, obj, self._invalid[kind], reader)
            if event == "DELETED":
                self._invalid[kind].pop(key, None)
                self._over.get(kind, {}).pop(key, None)
                self._identities.pop((kind, key), None)
            old = self._objects[kind].get(key)
            if model == old and len(self._invalid[kind]) == invalid_before:
                return
            if model is None:
                self._objects[kind].pop(key, None)
            else:
                self._objects[kind][key] = model
            self._rendered_over.pop((kind, key), None)  # counted again, and told again if still beyond
            if self._taken:
                self._changes[(kind, key)] = model
                if kind == "Pod" and model is not None and set(model.ips) - set(old.ips if old is not None else ()):
                    self._new_address = (kind, key)  # until the next take: its change carries the new address
            self._touch(kind)

    def report_refused(self, kind: str, key: str, reason: str) -> None:
        """Tell :attr:`kernel_refused` (if set) that the kernel refused the rules of policy
        ``key`` of ``kind`` (``NetworkPolicy``, ``ClusterNetworkPolicy``) for ``reason``."""
        with self._lock:
            identity = self._identities.get((kind, key))
        if self.kernel_refused is not None and identity is not None:
            self.kernel_refused(kind, {"metadata": identity}, reason)

    def ready_nodes(self) -> frozenset[str] | None:
        """The names of the Nodes whose ``Ready`` condition is True, as last listed or watched
        (:func:`~nftpolicy.translators.manifests.node_ready`): the agents that can write Events;
        None before the Nodes are listed."""
        with self._lock:
            return frozenset(self._ready_nodes) if "Node" in self._listed else None

    def get(self, kind: str, key: str) -> Any:
        """The model object of ``kind`` called ``key`` (``ns/name`` or ``name``), or None."""
        with self._lock:
            return self._objects[kind].get(key)

    def unlisted(self) -> list[str]:
        """The kinds not listed yet, in :data:`KINDS` order."""
        with self._lock:
            return [kind for kind in KINDS if kind not in self._listed]

    def listed(self, kinds: tuple[str, ...] = KINDS) -> bool:
        """True once every kind in ``kinds`` has been listed."""
        with self._lock:
            return set(kinds) <= self._listed

    def new_address_pending(self) -> bool:
        """True when the only change since the last take is a Pod that got an address it did
        not have (a new pod's, as the kubelet writes it once the CNI set the pod up): the
        reconcile loop's fast path commits it without waiting out the minimum interval."""
        with self._lock:
            return len(self._changes) == 1 and self._new_address in self._changes

    def take_changes(self) -> tuple[list[tuple[str, str, Any]], float | None]:
        """Every object that changed since the last take, as ``(kind, key, model or None)``
        (the latest state of each; none before the first :meth:`take`), and the time of the oldest
        change among them."""
        with self._lock:
            self.changed.clear()
            since, self.pending_since = self.pending_since, None
            changes, self._changes, self._new_address = self._changes, {}, None
            return [(kind, key, model) for (kind, key), model in changes.items()], since

    def take(self) -> tuple[Cluster, float | None]:
        """A consistent snapshot of the cluster and the time of the oldest change it includes
        (it includes every change so far: the change list starts again)."""
        with self._lock:
            self.changed.clear()
            since, self.pending_since = self.pending_since, None
            self._changes, self._taken, self._new_address = {}, True, None
            objects = self._objects
            return Cluster(namespaces=dict(objects["Namespace"]), pods=dict(objects["Pod"]),
                           policies=dict(objects["NetworkPolicy"]), nodes=dict(objects["Node"]),
                           cluster_policies=dict(objects["ClusterNetworkPolicy"])), since
