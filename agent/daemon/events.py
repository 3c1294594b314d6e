"""Kubernetes Events on what the agent cannot enforce, so that ``kubectl describe`` shows them.

When a NetworkPolicy or ClusterNetworkPolicy fails validation, or the kernel refuses its rules
(:mod:`nftpolicy.agent.daemon.quarantine`), the agent fails closed on it
(:mod:`nftpolicy.agent.daemon.sources`) and records one ``Warning`` Event on that object; when the ClusterNetworkPolicy CRD is not installed, one
``Normal`` Event on this node (nothing fails closed: there are none to enforce).

The Events are core ``v1`` Events (``/api/v1/namespaces/{ns}/events``): the API that ``kubectl
describe`` reads, and the one whose fields say what an operator needs here (``source.host``: the
node that failed closed; ``count``, ``firstTimestamp``, ``lastTimestamp``: how often). They
follow the rules of client-go's ``record.EventRecorder`` (k8s.io/client-go/tools/record, whose
``EventCorrelator`` counts identical Events in one object by patching ``count`` and
``lastTimestamp``, and drops what its rate limiter refuses), in our own words:

* one Event per object, reason and message: the same object seen again at the same
  ``metadata.generation`` (a relist, a label change) records nothing; at a new generation, still
  failing the same way, the Event's ``count`` is bumped with a PATCH (a new Event if the old one
  has expired: the API server keeps Events for an hour by default);
* a token bucket (:class:`TokenBucket`) bounds the writes of one agent: :data:`BURST` at once, then
  one per :data:`REFILL_SECONDS`; what it refuses is dropped;
* :meth:`EventRecorder.record` never blocks: it puts the Event on a queue of
  :data:`QUEUE_SIZE` (dropped when full) that one background thread writes; a write that fails
  is logged and counted (``nftpolicy_events_total{result="failed"}``), never fatal, and tried
  again the next time the agent sees the object fail;
* what it remembers (the generation queued and the Event written per object, reason and message)
  is bounded: the :data:`REMEMBERED` most recent of each. An object forgotten and seen failing
  again gets a new Event, as after the API server expired the old one.

Every agent sees an invalid object alike, so one agent writes its ``InvalidPolicy`` (and ``PolicyOverLimit``) Events, not
one per node (5,000 nodes made 5,000 Events of one policy): the agent of the node that ranks
first for the object among the Ready Nodes (:func:`event_writer`: rendezvous hashing of the
object's uid over the node names, so every agent picks the same one without asking anyone, and a
node joining or leaving moves only the objects it ranks first for). An agent that knows no Ready
Node writes its own (nothing to choose from). A refusal of the kernel is the node's own
(``RefusedByKernel``: kernels can differ) and the CRD's absence is said on each Node: those stay
per node. The writer chosen is the one of the generation seen: if its agent is down while its
Node is still Ready, that generation gets no Event (its next does, once the Node is not Ready).
A policy whose sets would hold more elements than ``--max-object-elements`` is seen so only by
the nodes that build its chains (those of the pods it selects: the node renderer counts them),
so its ``PolicyOverLimit`` Event's writer is picked among those of them that are Ready.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Mapping, Protocol
from urllib.parse import quote

from nftpolicy.translators.rules import safe_text
from nftpolicy.translators.objectcost import OverLimit
from nftpolicy.translators.validation import InvalidField

from .clock import REAL_TIME, Clock
from .kubeclient import client as k8s
from .kubeclient import request
from .metrics import Metrics
from .sources import describe

log = logging.getLogger("nftpolicy.events")

COMPONENT = "nftpolicy"  # source.component and reportingComponent of every Event
BURST = 25  # Events one agent may write at once (client-go's per-object burst is 25 too)
REFILL_SECONDS = 10.0  # then one more every this many seconds
QUEUE_SIZE = 256  # Events waiting for the writer; more are dropped
REMEMBERED = 4096  # (object, reason, message) keys kept for deduplication and counting; oldest go first
MAX_MESSAGE = 1024  # bytes of a message (events.k8s.io's limit; core v1 Events keep longer ones)
# Every result of an Event, the values of nftpolicy_events_total's label ("other_writer": another
# node's agent writes it, see event_writer).
RESULTS = ("created", "patched", "failed", "rate_limited", "queue_full", "other_writer")


# Reasons (the Event's ``reason``), one per way the agent falls short of an object.
INVALID = "InvalidPolicy"  # a field fails validation
OVER_LIMIT = "PolicyOverLimit"  # beyond a per-object cap (nftpolicy.translators.objectcost)
REFUSED = "RefusedByKernel"  # the kernel refused its rules (nftpolicy.agent.daemon.quarantine)
CRD_MISSING = "ClusterNetworkPolicyCRDMissing"  # on the Node: the API has no ClusterNetworkPolicies

# The apiVersion of an object that comes without one (items of a built-in kind's list); a custom
# resource's items carry theirs (a ClusterNetworkPolicy's: the version the agent watches).
API_VERSIONS = {"NetworkPolicy": "networking.k8s.io/v1", "ClusterNetworkPolicy": "policy.networking.k8s.io/v1beta1"}
OVER_LIMIT_EFFECT = {  # what refusals.stand_in enforces
    "NetworkPolicy": "the pods it selects are isolated, with nothing allowed, in the directions it names",
    "ClusterNetworkPolicy": "each of its Accept rules is left out, each other rule denies everything",
}
FAIL_CLOSED_EFFECT = {
    "NetworkPolicy": "enforced fail-closed: the pods it selects are isolated, with nothing allowed, in the directions it names",
    "ClusterNetworkPolicy": "enforced fail-closed: each rule that cannot be read matches nothing (Accept) or denies everything "
                            "(Deny, Pass)",
}


@dataclass(frozen=True)
class Subject:
    """The object an Event is about: ``namespace`` is "" for a cluster-scoped object;
    ``generation`` is the object's ``metadata.generation`` (its ``resourceVersion`` when it has
    none): one Event per generation."""

    kind: str
    api_version: str
    namespace: str
    name: str
    uid: str
    generation: str

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> "Subject":
        """The subject of an API object (``kind``, ``apiVersion``, ``metadata``)."""
        meta = obj.get("metadata") or {}
        generation = meta.get("generation")
        return cls(kind=str(obj.get("kind") or ""), api_version=str(obj.get("apiVersion") or ""),
                   namespace=str(meta.get("namespace") or ""), name=str(meta.get("name") or ""), uid=str(meta.get("uid") or ""),
                   generation=str(generation if generation is not None else meta.get("resourceVersion") or ""))

    @classmethod
    def node(cls, name: str) -> "Subject":
        """A Node, referred to as the kubelet refers to it (uid = its name), which ``kubectl
        describe node`` also looks up."""
        return cls(kind="Node", api_version="v1", namespace="", name=name, uid=name, generation="")

    def reference(self) -> dict[str, str]:
        """The Event's ``involvedObject``."""
        ref = {"kind": self.kind, "apiVersion": self.api_version, "name": self.name, "uid": self.uid}
        return {**ref, "namespace": self.namespace} if self.namespace else ref

    @property
    def event_namespace(self) -> str:
        """Where its Events live: its own namespace, or ``default`` for a cluster-scoped object
        (as client-go records them)."""
        return self.namespace or "default"


class TokenBucket:
    """``capacity`` tokens, refilled at one per ``refill_seconds`` of ``clock``."""

    def __init__(self, capacity: int, refill_seconds: float, clock: Clock) -> None:
        self.capacity, self.refill_seconds, self.clock = capacity, refill_seconds, clock
        self.tokens = float(capacity)
        self.updated = clock.now()

    def take(self) -> bool:
        """Take one token: True when there was one."""
        now = self.clock.now()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) / self.refill_seconds)
        self.updated = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class EventWriter(Protocol):
    """Writes core v1 Events. Both raise on failure (any exception); :meth:`patch` raises
    :class:`EventGone` when the Event does not exist any more."""

    def create(self, namespace: str, body: dict[str, Any]) -> None:
        """POST a new Event."""

    def patch(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        """Merge-patch an existing Event."""


class EventGone(Exception):
    """The Event to patch does not exist (it expired): create a new one."""


@dataclass(frozen=True)
class _Pending:
    subject: Subject
    event_type: str
    reason: str
    message: str
    writers: AbstractSet[str] = frozenset()  # the nodes that may write it (empty: any Ready Node)


@dataclass
class _Written:
    name: str
    count: int


def _remember(memory: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    """Set ``memory[key]`` as its newest entry, forgetting the oldest beyond :data:`REMEMBERED`."""
    memory[key] = value
    memory.move_to_end(key)
    if len(memory) > REMEMBERED:
        memory.popitem(last=False)


def event_writer(subject: Subject, nodes: AbstractSet[str]) -> str | None:
    """The node among ``nodes`` (names of Ready Nodes) whose agent writes ``subject``'s Events:
    the one with the highest BLAKE2b hash of ``node NUL uid`` (rendezvous hashing: each agent
    computes the same answer from the same Nodes; uid, else namespace/name, names the object).
    None when ``nodes`` is empty."""
    identity = subject.uid or f"{subject.kind}/{subject.namespace}/{subject.name}"
    return max(nodes, key=lambda node: (hashlib.blake2b(f"{node}\0{identity}".encode(), digest_size=8).digest(), node),
               default=None)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    """Records Events for this ``node`` through ``writer`` (see the module): :meth:`record`
    from any thread, :meth:`start` the writer thread. ``clock`` drives the rate limit
    (:mod:`~nftpolicy.agent.daemon.clock`); tests give their own. ``ready_nodes``: the names of
    the Ready Nodes now (the store's; None until the Nodes are listed: an invalid object's Event
    waits for them, or every agent of a rollout would write its own), from which
    :func:`event_writer` picks who writes an invalid object's Events."""

    def __init__(self, writer: EventWriter, node: str, metrics: Metrics, clock: Clock = REAL_TIME,
                 burst: int = BURST, refill_seconds: float = REFILL_SECONDS, queue_size: int = QUEUE_SIZE,
                 ready_nodes: Callable[[], AbstractSet[str] | None] = frozenset) -> None:
        self.writer, self.node, self.metrics, self.ready_nodes = writer, node, metrics, ready_nodes
        self.bucket = TokenBucket(burst, refill_seconds, clock)
        self.queue: queue.Queue[_Pending] = queue.Queue(queue_size)
        self._lock = threading.Lock()
        # (subject without generation, reason, message) -> the generation last queued
        self._queued: OrderedDict[tuple[str, str, str, str, str, str], str] = OrderedDict()
        self._written: OrderedDict[tuple[str, str, str, str, str, str], _Written] = OrderedDict()  # the writer thread's own
        for result in RESULTS:
            metrics.events.labels(result)

    @staticmethod
    def _key(subject: Subject, reason: str, message: str) -> tuple[str, str, str, str, str, str]:
        return subject.kind, subject.namespace, subject.name, subject.uid, reason, message

    def record(self, subject: Subject, reason: str, message: str, event_type: str = "Warning",
               writers: AbstractSet[str] = frozenset()) -> None:
        """Queue an Event about ``subject`` unless one with this reason and message was queued
        for its generation already. Never blocks: a full queue drops it (counted). ``writers``:
        the nodes among which :func:`event_writer` picks who writes an invalid object's Event
        (those of them that are Ready; none: every Ready Node)."""
        message = safe_text(message, MAX_MESSAGE)  # no control character of an object's text reaches kubectl describe
        key = self._key(subject, reason, message)
        with self._lock:
            if self._queued.get(key) == subject.generation:
                return
            _remember(self._queued, key, subject.generation)
        try:
            self.queue.put_nowait(_Pending(subject, event_type, reason, message, writers))
        except queue.Full:
            self._unqueue(key, subject.generation)
            self.metrics.events.labels("queue_full").inc()
            log.debug("Event queue full: dropped %s %s on %s %s", event_type, reason, subject.kind, subject.name)

    def failed_closed(self, kind: str, obj: Mapping[str, Any], exc: InvalidField, enforced: bool,
                      writers: AbstractSet[str] = frozenset()) -> None:
        """Record that the agent fails closed on ``obj`` (a ``kind`` of :data:`API_VERSIONS`, as
        the API serves it: a built-in kind's list items lack ``kind`` and ``apiVersion``) because of ``exc``;
        ``enforced``: its fail-closed stand-in is enforced (else nothing of it is: a
        ClusterNetworkPolicy whose tier, priority or subject cannot be read); ``writers``: the
        nodes that see it so (none: every node: see :meth:`record`)."""
        effect = FAIL_CLOSED_EFFECT[kind] if enforced else "not enforced: its tier, priority or subject cannot be read"
        if isinstance(exc, OverLimit):  # its rules were read: every Accept left out, every other rule denying everything
            effect = OVER_LIMIT_EFFECT[kind]
        self.record(Subject.of({**obj, "kind": kind, "apiVersion": obj.get("apiVersion") or API_VERSIONS[kind]}),
                    OVER_LIMIT if isinstance(exc, OverLimit) else INVALID, f"{exc}; {effect}", writers=writers)

    def kernel_refused(self, kind: str, obj: Mapping[str, Any], reason: str) -> None:
        """Record that the kernel refused the rules of ``obj`` (a ``kind`` of
        :data:`API_VERSIONS`; its ``metadata`` is enough) for ``reason`` and that the agent
        enforces it fail-closed, as an invalid one (:data:`FAIL_CLOSED_EFFECT`)."""
        self.record(Subject.of({**obj, "kind": kind, "apiVersion": API_VERSIONS[kind]}), REFUSED,
                    f"the kernel refused its rules: {reason}; {FAIL_CLOSED_EFFECT[kind]}")

    def crd_missing(self, crd: str) -> None:
        """Record on this node that the API has no ``crd``: ``Normal``, since nothing fails
        closed (no ClusterNetworkPolicy can exist) and most clusters do not install it."""
        self.record(Subject.node(self.node), CRD_MISSING, f"the API has no {crd} (its CRD is not installed): "
                    "nftpolicy enforces no ClusterNetworkPolicy on this node until it is", event_type="Normal")

    def _unqueue(self, key: tuple[str, str, str, str, str, str], generation: str) -> None:
        """The Event of ``key`` at ``generation`` was not written: the next sighting tries again."""
        with self._lock:
            if self._queued.get(key) == generation:
                del self._queued[key]

    def start(self, stop: threading.Event) -> threading.Thread:
        """Start the writer thread (a daemon thread: it ends with ``stop`` or the process)."""
        def run() -> None:
            while not stop.is_set():
                try:
                    pending = self.queue.get(timeout=0.5)
                except queue.Empty:
                    continue
                while not self.write(pending) and not stop.wait(0.5):
                    pass  # the Nodes are not listed yet

        thread = threading.Thread(target=run, name="events", daemon=True)
        thread.start()
        return thread

    def write(self, pending: _Pending) -> bool:
        """Write one queued Event (the writer thread's step): create it, or bump the count of the
        one written before; a failure is logged and counted, and forgotten so the next sighting
        tries again. False: not yet (an invalid object's, before the Nodes are listed)."""
        subject, key = pending.subject, self._key(pending.subject, pending.reason, pending.message)
        if pending.reason in (INVALID, OVER_LIMIT):  # what every agent sees alike
            nodes = self.ready_nodes()
            if nodes is None:
                return False
            writer = event_writer(subject, (nodes & pending.writers) or nodes)
            if writer is not None and writer != self.node:  # remembered as queued: asked again at its next generation
                self.metrics.events.labels("other_writer").inc()
                log.debug("Event %s on %s %s: written by node %s's agent", pending.reason, subject.kind, subject.name, writer)
                return True
        if not self.bucket.take():
            self._unqueue(key, subject.generation)
            self.metrics.events.labels("rate_limited").inc()
            log.debug("Event rate limit: dropped %s on %s %s", pending.reason, subject.kind, subject.name)
            return True
        namespace, now = subject.event_namespace, _now()
        written = self._written.get(key)
        try:
            if written is not None:
                try:
                    self.writer.patch(namespace, written.name, {"count": written.count + 1, "lastTimestamp": now})
                    written.count += 1
                    self._written.move_to_end(key)
                    self.metrics.events.labels("patched").inc()
                    return True
                except EventGone:
                    del self._written[key]
            stamp = f"{time.time_ns():x}"  # as client-go names them; the name stays a DNS subdomain (<= 253)
            name = f"{subject.name[:252 - len(stamp)].rstrip('-.')}.{stamp}"
            self.writer.create(namespace, {
                "apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": namespace},
                "involvedObject": subject.reference(), "reason": pending.reason, "message": pending.message,
                "type": pending.event_type, "source": {"component": COMPONENT, "host": self.node},
                "reportingComponent": COMPONENT, "reportingInstance": self.node,
                "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            })
            _remember(self._written, key, _Written(name, 1))
            self.metrics.events.labels("created").inc()
            return True
        except Exception as exc:  # an Event is a courtesy: enforcement never waits for it
            self._unqueue(key, subject.generation)
            self.metrics.events.labels("failed").inc()
            log.warning("cannot write Event %s on %s %s: %s", pending.reason, subject.kind,
                        f"{subject.namespace}/{subject.name}" if subject.namespace else subject.name, describe(exc),
                        extra={"kind": subject.kind, "reason": pending.reason})
            return True


class KubeEventWriter:
    """:class:`EventWriter` through the official client (an ``ApiClient`` the API source made):
    core v1 ``create`` and merge ``patch`` (:func:`~.kubeclient.request`, the requests of
    ``CoreV1Api.create_namespaced_event`` and ``patch_namespaced_event``), each bounded by
    ``timeout`` seconds; each answer is read whole (its connection goes back to the pool)."""

    def __init__(self, api: Any, timeout: float) -> None:
        self.api, self.timeout = api, timeout

    def create(self, namespace: str, body: dict[str, Any]) -> None:
        """POST ``body`` to ``namespace``'s Events."""
        request(self.api, "POST", f"/api/v1/namespaces/{quote(namespace, safe='')}/events", self.timeout, body=body).read()

    def patch(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        """Merge-patch Event ``name``; :class:`EventGone` on 404."""
        try:
            request(self.api, "PATCH", f"/api/v1/namespaces/{quote(namespace, safe='')}/events/{quote(name, safe='')}", self.timeout,
                    body=body, content_type="application/merge-patch+json").read()
        except k8s.ApiException as exc:
            if exc.status == 404:
                raise EventGone(name) from None
            raise
