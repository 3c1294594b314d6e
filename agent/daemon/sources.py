"""Sources of the cluster model: the Kubernetes API (list + watch) and a manifests directory.

Both feed a :class:`~.store.Store` (the in-memory cluster of model objects).

The API source follows the list/watch protocol of the Kubernetes API concepts page: list, then
watch from the list's ``resourceVersion`` with ``allowWatchBookmarks``; ``410 Gone`` (or an
``ERROR`` event) means relist; a watch that ends or times out reconnects from the last
resourceVersion (a BOOKMARK's too); every request has a client-side timeout, and every
connection TCP keepalive (a watch whose path died silently is reset within seconds). A watch
stream that stays open but brings neither an event nor a bookmark for ``idle_timeout`` seconds
(a stuck proxy or load balancer, which keepalive cannot see) is dead: it is watched again from
the last resourceVersion (see :data:`WATCH_IDLE_TIMEOUT`). 401 and 403 (a restarting API server
refuses requests until its authorizer has loaded; a RoleBinding being replaced), 429 (honouring
``Retry-After``), 5xx and connection errors are retried with exponential backoff and jitter
(tenacity), as client-go's reflectors retry them; a refusal that lasts is reported once per kind.
Other 4xx are reported and the kind is relisted only after the longest backoff.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import queue
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

import orjson
import tenacity
import urllib3
import yaml

from .apiversions import CLUSTER_POLICY_GROUP, CLUSTER_POLICY_PLURAL, CLUSTER_POLICY_VERSIONS, served_version
from . import kubeproto
from .clock import REAL_TIME, Clock
from .kubeclient import Collection, ConfigException, iter_resp_lines, load_configuration
from .kubeclient import client as k8s
from .manifestfiles import manifest_files, read_objects
from .metrics import Metrics
from .store import JSON, KINDS, Reader, Store

log = logging.getLogger("nftpolicy.sources")
T = TypeVar("T")

# Kinds whose resource only exists when its CRD is installed: a 404 on the list means "none".
OPTIONAL = {"ClusterNetworkPolicy": "clusternetworkpolicies.policy.networking.k8s.io"}
MAX_BACKOFF = 30.0  # seconds: the longest pause between lists or watches that end at once, after a 4xx, and for a 429's Retry-After
# Retries of a failing request (5xx, connection errors, timeouts): exponential from 0.2 s, capped at
# RETRY_CAP, plus up to RETRY_JITTER of random delay, so that nodes do not retry in step. The cap keeps
# the agent quick to notice an API server that is back (the first change after a 60 s outage lands
# within 5 s), while a faulty server still gets at most one request per kind and node every 3-4 s.
RETRY_CAP = 3.0
RETRY_JITTER = 1.0
# TCP keepalive on every API connection: a watch whose path to the API server died without a reset
# (the server's host lost power, a load balancer or NAT forgot the flow) stays open and silent until
# its read timeout (--watch-timeout + --api-timeout: 310 s by default); with keepalive the kernel
# resets it after KEEPALIVE_IDLE seconds without a byte plus KEEPALIVE_COUNT unanswered probes
# KEEPALIVE_INTERVAL seconds apart (3 s), and it is retried like any connection error. The cost is
# one probe and its ACK (two bare TCP segments, answered by the API server's kernel, never by the
# API server) per second on each idle connection: 5 connections per node. (client-go asks for
# 30 s idle and Go's 15 s x 9 probes: 165 s.)
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 1, 1, 2
# Watch bookmarks (k8s.io/apiserver v0.36.3, pkg/storage/cacher): kube-apiserver's watch cache
# sends a BOOKMARK (an object of the kind with only metadata.resourceVersion) to every watch that
# asked for them every defaultBookmarkFrequency = time.Minute (cacher.go; a constant, no flag sets
# it), and one 2 s before the watch's deadline when that comes first (cache_watcher.go,
# nextBookmarkTime). Watches wait in buckets of one second, which a timer of 1 to 1.25 s
# (wait.Jitter(time.Second, 0.25)) empties: a bookmark comes 59 to 62.5 s after the one before.
# But it carries the cache's resourceVersion, and process() sends only what is newer than the
# resourceVersion the watch started from: a watch that starts at the cache's current version gets
# no bookmark until the cache moves (a write to that resource, or a progress notification from
# etcd, which any consistent list asks for). Measured on the test bed's kube-apiserver 1.36 with
# nothing written (bench/silent_watch.py): the first bookmark of a quiet kind after 60 or 120 s,
# then one every 59.5 to 61 s, for CustomResources (ClusterNetworkPolicy) too. So a watch silent
# for two periods and a margin is dead: WATCH_IDLE_TIMEOUT, the read timeout of a watch request
# (urllib3's is per recv: the seconds without a byte), --watch-idle-timeout. A false alarm costs one
# watch request from the same resourceVersion (no relist). With kube-apiserver's --watch-cache=false
# a watch is served by etcd and gets no bookmark at all (etcd3/watcher.go): a quiet kind is then
# watched again every idle timeout.
BOOKMARK_PERIOD = 60.0
WATCH_IDLE_TIMEOUT = 2 * BOOKMARK_PERIOD + 10.0
REFUSED = (401, 403)  # retried like 5xx (see _retryable)
REFUSED_GRACE = 10.0  # seconds of refusals of one kind before they are reported as an error (once)
LIST_PAGE = 500  # objects per list request (client-go's pager uses 500 too)
QUICK = 1.0  # seconds: a list or watch cycle shorter than this counts as failing fast


# ---- the Kubernetes API -------------------------------------------------------------------------

class RelistNeeded(Exception):
    """The watch cannot continue from its resourceVersion (410 Gone or an ERROR event with
    the HTTP ``code`` of its Status)."""

    def __init__(self, message: str, code: int = 410) -> None:
        super().__init__(message)
        self.code = code


class SilentWatch(Exception):
    """A watch stream that brought nothing, not even a bookmark, for ``seconds``: retried from the
    last resourceVersion like a connection error (reason ``silent``)."""

    def __init__(self, seconds: float, version: str) -> None:
        super().__init__(f"no event or bookmark for {seconds:.0f}s")
        self.seconds, self.version = seconds, version


def _reason(exc: BaseException) -> str:
    if isinstance(exc, SilentWatch):
        return "silent"
    if isinstance(exc, RelistNeeded):
        return "5xx" if exc.code >= 500 else str(exc.code)
    if isinstance(exc, k8s.ApiException):
        return str(exc.status) if exc.status and exc.status < 500 else "5xx"
    if isinstance(exc, urllib3.exceptions.NewConnectionError):  # a subclass of ConnectTimeoutError
        return "connection"
    if isinstance(exc, (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ConnectTimeoutError, TimeoutError)):
        return "timeout"
    return "connection"


def _next_pause(pause: float, lasted: float) -> float:
    """No pause after a list/watch that lasted a while; else double it (0.2 s to MAX_BACKOFF)."""
    return 0.0 if lasted >= QUICK else min(MAX_BACKOFF, max(0.2, 2 * pause))


def describe(exc: BaseException | None) -> str:
    """One line for a log: ``429 Too Many Requests``, with the API's Status message when it
    sent one (a 403 names the verb and the resource: ``pods is forbidden: User "..." cannot
    watch resource "pods" ...``), or the exception's first line."""
    if isinstance(exc, k8s.ApiException):
        try:
            message = json.loads(exc.body or "").get("message")
        except (ValueError, AttributeError):
            message = None
        return f"{exc.status} {exc.reason}" + (f": {message}" if message else "")
    return str(exc).strip().splitlines()[0] if exc and str(exc).strip() else type(exc).__name__


def _retryable(exc: BaseException) -> bool:
    """True for what may pass by itself: 401 and 403 (an API server that has just started
    refuses every request until its authorizer's caches are loaded; a binding that is being
    replaced), 429, 5xx, no answer (status 0), connection and protocol errors."""
    if isinstance(exc, k8s.ApiException):
        return exc.status in REFUSED or exc.status == 429 or (exc.status or 0) >= 500 or exc.status == 0
    return isinstance(exc, (SilentWatch, urllib3.exceptions.HTTPError, OSError, ValueError))


def keepalive_options() -> list[tuple[int, int, int]]:
    """urllib3 socket options: its defaults (TCP_NODELAY) plus TCP keepalive with
    :data:`KEEPALIVE_IDLE`, :data:`KEEPALIVE_INTERVAL` and :data:`KEEPALIVE_COUNT` (tcp(7))."""
    options: list[tuple[int, int, int]] = list(urllib3.connection.HTTPConnection.default_socket_options)
    return options + [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1), (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE),
                      (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL),
                      (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)]


def _retry_after(state: tenacity.RetryCallState) -> float | None:
    """The seconds a 429's ``Retry-After`` asks for, at most :data:`MAX_BACKOFF` (a server that
    asks for an hour would hold the kind's watch that long), or None (the backoff then) when it
    gives none, or a negative or not finite number (no wait at all would make every node retry
    at once)."""
    exc = state.outcome.exception() if state.outcome else None
    if isinstance(exc, k8s.ApiException) and exc.status == 429 and exc.headers:
        try:
            seconds = float(exc.headers.get("Retry-After"))
        except (TypeError, ValueError):
            return None
        return min(seconds, MAX_BACKOFF) if math.isfinite(seconds) and seconds >= 0 else None
    return None


def read_ahead(source: Iterator[T], name: str) -> Iterator[T]:
    """``source``'s items, each made by a daemon thread (called ``name``) while the caller uses
    the one before: one item ahead, no more. What ``source`` raises is raised here, in place of
    the item it failed to make. When the caller stops early (an exception, ``close()``), the
    thread ends before making another item."""
    made: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
    wanted = threading.Semaphore(1)  # a token per item the caller is ready for
    abandoned = threading.Event()

    def produce() -> None:
        try:
            while True:
                while not wanted.acquire(timeout=0.1):
                    if abandoned.is_set():
                        return
                if abandoned.is_set():
                    return
                item = next(source, made)  # ``made``: a sentinel no source yields
                if item is made:
                    made.put((False, None))
                    return
                made.put((True, item))
        except BaseException as exc:  # handed to the caller, raised there
            made.put((False, exc))

    threading.Thread(target=produce, name=name, daemon=True).start()
    try:
        while True:
            more, value = made.get()
            if not more:
                if value is not None:
                    raise value
                return
            wanted.release()  # the next one is made while the caller uses this one
            yield value
    finally:
        abandoned.set()


class PreferredVersion:
    """The ClusterNetworkPolicy collection at the version the API prefers, called as a
    :class:`~.kubeclient.Collection` is. A list (its first page) asks discovery first
    (:func:`~.apiversions.served_version`: the first of v1beta1 and v1alpha2 it serves; none:
    v1beta1, whose 404 says the CRD is not installed) and reads at that version; its continue
    pages and the watches after it stay there (a resourceVersion belongs to the list it came
    from). A watch asks discovery again first: when the API prefers another version now (its CRD
    was upgraded or downgraded while the agent ran; kube-apiserver also ends the watches of a
    CRD it replaces), it raises :class:`RelistNeeded`, so the kind is listed again at the new
    version: the store takes the list whole and what did not change does not sync, so no object
    and no rule is lost meanwhile. ``version`` is the version discovery gave last (None before
    it gave one)."""

    def __init__(self, api: k8s.ApiClient) -> None:
        self.api = api
        self.version: str | None = None

    def __repr__(self) -> str:
        return f"PreferredVersion({self.version})"

    def __call__(self, _request_timeout: Any = None, **query: Any) -> Any:
        asking = _request_timeout[0] if isinstance(_request_timeout, tuple) else _request_timeout  # discovery: a short answer
        if query.get("watch"):
            preferred = served_version(self.api, asking)
            if preferred is not None and preferred != self.version:
                raise RelistNeeded(f"the API prefers ClusterNetworkPolicy {preferred} now (listed at {self.version})")
        elif not query.get("_continue"):
            served = served_version(self.api, asking)
            if served is not None and served != self.version:
                log.info("ClusterNetworkPolicy: the API serves %s/%s: listing and watching it%s", CLUSTER_POLICY_GROUP, served,
                         f" (was {self.version})" if self.version else "", extra={"kind": "ClusterNetworkPolicy"})
                self.version = served
        path = f"/apis/{CLUSTER_POLICY_GROUP}/{self.version or CLUSTER_POLICY_VERSIONS[0]}/{CLUSTER_POLICY_PLURAL}"
        return Collection(self.api, path)(_request_timeout, **query)


class SourceError(RuntimeError):
    """The API source cannot start: the kubeconfig cannot be read, or there is no in-cluster
    configuration (the message says which, on one line)."""


class KubeSource:
    """List and watch Pods (all namespaces), Namespaces, NetworkPolicies, Nodes (every one: its
    own for its addresses, the others for ClusterNetworkPolicy ``nodes`` peers) and, when their
    CRD is installed, ClusterNetworkPolicies (at the version the API prefers:
    :class:`PreferredVersion`).

    One thread per kind. ``api_timeout`` bounds every request (seconds, client side). A watch
    asks the server to end it after ``watch_timeout`` seconds; its read timeout (seconds without
    a byte) is ``idle_timeout``, or ``watch_timeout`` + ``api_timeout`` when that is shorter, so
    a stream that stays open but stops delivering is given up (:class:`SilentWatch`) and watched
    again from the last resourceVersion. Retry delays, backoff and the seconds since a kind's
    last success are on ``clock``.
    """

    def __init__(self, store: Store, metrics: Metrics, kubeconfig: str | None,
                 api_timeout: float, watch_timeout: int, stop: threading.Event, clock: Clock = REAL_TIME,
                 idle_timeout: float = WATCH_IDLE_TIMEOUT) -> None:
        configuration = k8s.Configuration()
        try:
            load_configuration(kubeconfig, configuration)
        except (ConfigException, yaml.YAMLError, UnicodeDecodeError, OSError, TypeError, ValueError) as exc:
            reason = " ".join(str(exc).split())
            raise SourceError(f"cannot read kubeconfig {kubeconfig}: {reason}" if kubeconfig else
                              f"no in-cluster configuration ({reason}): outside a pod, give --kubeconfig") from None
        configuration.retries = False  # tenacity decides
        configuration.socket_options = keepalive_options()
        api = k8s.ApiClient(configuration)
        if kubeproto.UNAVAILABLE is not None:
            log.warning("API lists and watches in JSON, not protobuf: %s", kubeproto.UNAVAILABLE)

        def collection(kind: str, path: str) -> Collection:  # protobuf where the kind has it (kubeproto.accept)
            return Collection(api, path, kubeproto.accept(kind), kubeproto.status_json)

        self.calls: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
            "Namespace": (collection("Namespace", "/api/v1/namespaces"), {}),
            "Pod": (collection("Pod", "/api/v1/pods"), {}),
            "NetworkPolicy": (collection("NetworkPolicy", "/apis/networking.k8s.io/v1/networkpolicies"), {}),
            "Node": (collection("Node", "/api/v1/nodes"), {}),  # every Node: ClusterNetworkPolicy nodes peers select them by label
            "ClusterNetworkPolicy": (PreferredVersion(api), {}),  # v1beta1 where served, else v1alpha2 (JSON: no protobuf for CRDs)
        }
        self.store, self.metrics, self.stop = store, metrics, stop
        self.clock = clock  # every pause and every "how long since" (tests give their own)
        self.api_timeout, self.watch_timeout = api_timeout, watch_timeout
        self.read_timeout = min(idle_timeout, watch_timeout + api_timeout)  # of a watch: seconds without a byte
        self.versions: dict[str, str] = {}
        self.absent: set[str] = set()  # optional kinds whose resource the API does not have
        self.api = api  # for the Events writer
        self.crd_missing: Callable[[str], None] | None = None  # told the CRD's name when an optional kind is absent
        # Per kind: when a request last succeeded (monotonic; the start until the first), and
        # whether a watch stream is open now (it counts as succeeding while it lasts).
        self._succeeded = {kind: self.clock.now() for kind in self.calls}
        self._streaming: set[str] = set()
        # Per kind refused (401, 403) since its last success: when the first refusal came, and
        # whether the refusal has been reported as an error.
        self._refused: dict[str, float] = {}
        self._reported: set[str] = set()
        for kind in self.calls:
            metrics.watch_seconds_since_success.labels(kind).set_function(functools.partial(self.seconds_failing, kind))
            for verb in ("list", "watch"):
                metrics.api_access_denied.labels(kind, verb).set(0)

    def seconds_failing(self, kind: str) -> float:
        """Seconds since ``kind``'s last successful API response (0 while its watch is open)."""
        return 0.0 if kind in self._streaming else self.clock.now() - self._succeeded[kind]

    def _success(self, kind: str, at: float | None = None) -> None:
        """``kind``'s API answered (at ``at`` on the clock; now by default)."""
        self._succeeded[kind] = self.clock.now() if at is None else at
        refused = self._refused.pop(kind, None)
        if refused is not None:
            self._reported.discard(kind)
            for verb in ("list", "watch"):
                self.metrics.api_access_denied.labels(kind, verb).set(0)
            log.info("API %s requests are allowed again, after %.1fs of refusals", kind, self._succeeded[kind] - refused,
                     extra={"kind": kind})

    def _refusal(self, kind: str, verb: str, exc: BaseException, pause: float) -> None:
        """A 401 or 403 to ``verb`` (list, watch) on ``kind``, retried in ``pause`` seconds.
        The first of a run is a warning (an API server that has just started refuses every
        request until its authenticator's and authorizer's caches are loaded, about a second
        here); once the refusals have lasted
        :data:`REFUSED_GRACE` seconds, one error with the API's message (which names the verb
        and the resource); nothing more until ``kind`` succeeds again. nftpolicy_api_access_denied
        is 1 for the refused verb meanwhile."""
        self.metrics.api_access_denied.labels(kind, verb).set(1)
        now = self.clock.now()
        extra = {"kind": kind, "reason": _reason(exc), "verb": verb}
        if kind not in self._refused:
            self._refused[kind] = now
            log.warning("API %s request refused (%s), retry in %.1fs: an API server that has just started refuses requests until "
                        "its authenticator and authorizer are ready", kind, describe(exc), pause, extra=extra)
        elif now - self._refused[kind] >= REFUSED_GRACE and kind not in self._reported:
            self._reported.add(kind)
            log.error("API %s requests refused for %.0fs: %s; retrying at most %.0fs apart, said once until they are allowed",
                      kind, now - self._refused[kind], describe(exc), RETRY_CAP + RETRY_JITTER, extra=extra)
        else:
            log.debug("API %s %s refused again (%s), retry in %.1fs", kind, verb, describe(exc), pause, extra=extra)

    def start(self) -> list[threading.Thread]:
        """Start one daemon thread per kind; they run until ``stop`` is set."""
        threads = [threading.Thread(target=self._run, args=(kind,), name=f"watch-{kind}", daemon=True) for kind in self.calls]
        for t in threads:
            t.start()
        return threads

    def _retrying(self, kind: str, verb: str) -> tenacity.Retrying:
        """The retry policy of one ``verb`` (list, watch) request on ``kind``: see
        :func:`_retryable`; exponential from 0.2 s to :data:`RETRY_CAP` plus up to
        :data:`RETRY_JITTER` of random delay (``Retry-After`` of a 429 instead, at most :data:`MAX_BACKOFF`); a new one per
        request, so the delay starts again after a success. A stop ends it at once."""
        backoff = tenacity.wait_exponential(multiplier=0.2, max=RETRY_CAP) + tenacity.wait_random(0, RETRY_JITTER)

        def wait(state: tenacity.RetryCallState) -> float:
            return _retry_after(state) or backoff(state)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            reason = _reason(exc) if exc else "unknown"
            self.metrics.api_retries.labels(kind, reason).inc()
            pause = state.next_action.sleep if state.next_action else 0.0
            if isinstance(exc, k8s.ApiException) and exc.status in REFUSED:
                self._refusal(kind, verb, exc, pause)
                return
            if isinstance(exc, SilentWatch):
                log.warning("API %s watch silent for %.0fs (no event or bookmark; kube-apiserver sends a bookmark about every "
                            "%.0fs): watching again from resourceVersion %s in %.1fs", kind, exc.seconds, BOOKMARK_PERIOD,
                            exc.version, pause, extra={"kind": kind, "reason": reason})
                return
            log.warning("API %s request failed (%s), retry %d in %.1fs", kind, describe(exc), state.attempt_number,
                        pause, extra={"kind": kind, "reason": reason})

        def after(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome and state.outcome.failed else None
            if exc is not None:
                self.metrics.api_errors.labels(kind, _reason(exc)).inc()

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: _retryable(e) and not self.stop.is_set()),
            wait=wait, sleep=self._pause, before_sleep=before_sleep, reraise=True, after=after,
        )

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` on the clock; a stop ends the pause at once."""
        self.clock.wait(self.stop, seconds)

    def _run(self, kind: str) -> None:
        pause = 0.0  # grows while lists or watches end as soon as they start, so a faulty
        # server never gets a tight loop of cluster-wide lists from every node
        while not self.stop.is_set():
            started = self.clock.now()
            try:
                self._retrying(kind, "list")(self._list, kind)
                while not self.stop.is_set():
                    started = self.clock.now()
                    self._retrying(kind, "watch")(self._watch, kind)
                    pause = _next_pause(pause, self.clock.now() - started)
                    self._pause(pause)
            except RelistNeeded as exc:
                self.metrics.api_errors.labels(kind, _reason(exc)).inc()
                pause = _next_pause(pause, self.clock.now() - started)
                log.info("relisting %s in %.1fs: %s", kind, pause, exc, extra={"kind": kind})
                self._pause(pause)
            except Exception as exc:  # a non-retryable API error (400, 404, ...): report, relist later
                if self.stop.is_set():
                    return
                if kind in OPTIONAL and isinstance(exc, k8s.ApiException) and exc.status == 404:
                    self._absent(kind)
                    continue
                self.metrics.api_errors.labels(kind, _reason(exc)).inc()
                log.error("API %s request failed, not retryable: %s; relisting in %.0fs", kind, describe(exc), MAX_BACKOFF,
                          extra={"kind": kind, "reason": _reason(exc)})
                self._pause(MAX_BACKOFF)

    def _absent(self, kind: str) -> None:
        """The API has no resource for ``kind`` (its CRD is not installed): none of them, said
        once; the list is tried again every :data:`MAX_BACKOFF` seconds. The answer counts as
        a success (the kind is not stale: the API said there are none)."""
        self._success(kind)
        if kind not in self.absent:
            self.absent.add(kind)
            log.warning("the API has no %s (its CRD is not installed): enforcing without any %s; checking again every %.0fs",
                        OPTIONAL[kind], kind, MAX_BACKOFF, extra={"kind": kind})
            self.store.replace(kind, [])  # none of them (and none left from before the CRD went)
            if self.crd_missing is not None:
                self.crd_missing(OPTIONAL[kind])
        self._pause(MAX_BACKOFF)

    def _list(self, kind: str) -> None:
        """List ``kind`` in pages of :data:`LIST_PAGE` objects, each read as its ``Content-Type``
        says (protobuf or JSON: :mod:`.kubeproto`). The next page is fetched while
        one is converted to model objects (:func:`read_ahead`: the API server answers on
        another core meanwhile), and no further, so the agent never holds a whole cluster of API
        objects (150,000 pods are about a gigabyte of them)."""
        call, kwargs = self.calls[kind]
        pages: dict[str, Any] = {"count": 0, "version": "", "reader": None}  # what the pages said, for the log

        def bodies() -> Iterator[tuple[Any, Reader]]:
            token = None
            while True:
                # No resourceVersion: a consistent list (at least as new as anything seen before
                # a relist). kube-apiserver 1.36 serves it from its watch cache: the first page at
                # etcd's current revision, the continue pages from the cache's snapshot of that
                # revision (ListFromCacheSnapshot); one page of JSON per response, no etcd read
                # but the revision. resourceVersion "0" would be served from the cache too but
                # ignores limit (the whole list in one response); resourceVersionMatch=NotOlderThan
                # saves only the revision read. Pages of 5,000 cost the API server 0.84x the CPU
                # but 1.57x the peak memory (20 agents at 50,000 pods), and the agent about 12 KiB
                # per decoded pod of a page; gzip is not asked for (it costs the API server CPU);
                # a streaming list (sendInitialEvents) cost it 1.2-1.3x these pages. Measured with
                # bench/api_server_cost.py: docs/benchmarks.md.
                try:
                    response = call(limit=LIST_PAGE, _continue=token,
                                    _request_timeout=self.api_timeout, **kwargs)
                except k8s.ApiException as exc:
                    if exc.status == 410 and token:  # the continue token expired: list again now
                        raise RelistNeeded("the list's continue token expired") from None
                    raise
                self._success(kind)
                if kubeproto.is_protobuf(response):
                    items, version, token = kubeproto.list_page(kind, response.data)
                    reader: Reader = kubeproto.MESSAGES
                else:
                    body = orjson.loads(response.data)
                    meta = body.get("metadata") or {}
                    items, reader = body.get("items") or (), JSON
                    version, token = str(meta.get("resourceVersion") or ""), meta.get("continue")
                if pages["reader"] not in (None, reader):  # a server that changed its answers' format within a list
                    raise kubeproto.ProtobufError("the pages of one list came in protobuf and in JSON")
                pages["count"] += 1
                pages["version"], pages["reader"] = version or pages["version"], reader
                yield items, reader
                if not token:
                    return

        items = read_ahead(bodies(), f"list-{kind}")
        first = next(items, ((), JSON))
        count = self.store.replace(kind, itertools.chain(first[0], (item for page, _ in items for item in page)), first[1])
        if kind in self.absent:
            self.absent.discard(kind)
            log.info("the API has %s now: watching %ss", OPTIONAL[kind], kind, extra={"kind": kind})
        self.versions[kind] = pages["version"]
        log.debug("listed %s: %d objects in %d pages at resourceVersion %s", kind, count, pages["count"], self.versions[kind])

    def _watch(self, kind: str) -> None:
        """One watch from the last seen resourceVersion until the server ends it. Every event's
        resourceVersion is kept, a BOOKMARK's too (it has nothing else), so the next watch
        starts there. Raises :class:`SilentWatch` when nothing came for :attr:`read_timeout`
        seconds."""
        call, kwargs = self.calls[kind]
        version = self.versions[kind]
        try:
            response = call(watch=True, resource_version=version, allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout,
                            _request_timeout=(self.api_timeout, self.read_timeout), **kwargs)
        except k8s.ApiException as exc:
            if exc.status == 410:
                raise RelistNeeded(f"resourceVersion {version} is gone") from None
            raise
        heard = self.clock.now()  # the last byte: the answer's headers, then each event
        self._success(kind)
        self._streaming.add(kind)
        try:
            for kind_of_event, obj, reader in self._events(kind, response):
                heard = self.clock.now()
                if self.stop.is_set():
                    break
                if kind_of_event == "ERROR":
                    code: int = obj["code"] if isinstance(obj.get("code"), int) and obj["code"] else 410
                    raise RelistNeeded(f"watch error: {code} {obj.get('message')}", code)
                if kind_of_event in ("ADDED", "MODIFIED", "DELETED"):
                    self.store.apply(kind, kind_of_event, obj, reader)
                if reader is JSON:
                    self.versions[kind] = (obj.get("metadata") or {}).get("resourceVersion") or self.versions[kind]
                else:
                    self.versions[kind] = kubeproto.resource_version(obj) or self.versions[kind]
            heard = self.clock.now()  # the end of the stream
        except urllib3.exceptions.ReadTimeoutError:
            raise SilentWatch(self.clock.now() - heard, self.versions[kind]) from None
        finally:
            self._streaming.discard(kind)
            self._success(kind, heard)  # the stream answered until its last byte
            response.release_conn()


    @staticmethod
    def _events(kind: str, response: Any) -> Iterator[tuple[str, Any, Reader]]:
        """A watch stream's events as ``(type, object, its reader)``: protobuf frames
        (:func:`.kubeproto.watch_events`; an ERROR's Status as its JSON fields) or JSON lines, as
        the answer's ``Content-Type`` says."""
        if kubeproto.is_protobuf(response):
            for kind_of_event, obj in kubeproto.watch_events(response, kind):
                yield kind_of_event, obj, kubeproto.MESSAGES
            return
        for line in iter_resp_lines(response):
            event = orjson.loads(line)
            yield event.get("type"), event.get("object") or {}, JSON


# ---- a manifests directory ----------------------------------------------------------------------

class ManifestsSource:
    """Reads every manifest under ``directory`` and re-reads them all when a file changes
    (polled every ``interval`` seconds of ``clock``: names, sizes and modification times)."""

    def __init__(self, store: Store, directory: str, stop: threading.Event, interval: float = 1.0,
                 clock: Clock = REAL_TIME) -> None:
        self.store, self.directory, self.stop, self.interval, self.clock = store, directory, stop, interval, clock

    def _signature(self) -> list[tuple[str, int, int]]:
        signature = []
        for name in manifest_files([self.directory]):
            stat = Path(name).stat()
            signature.append((name, stat.st_size, stat.st_mtime_ns))
        return signature

    def _read(self) -> None:
        """Read every file; when one cannot be parsed (a typo, a file caught half written) the
        last good state is kept, so a broken policy file never lifts its isolation. At the start
        there is none: nothing counts as listed until every file parses, so the first sync
        waits and the table in the kernel stays as it is (a restart never replaces it with a
        partial cluster)."""
        objects, errors = read_objects([self.directory])
        for error in errors:
            log.error("unreadable manifest: %s", error)
        if errors:
            log.error("%s until every file in %s parses", "keeping the last readable state" if self.store.listed()
                      else "nothing is synced (the kernel keeps its table)", self.directory)
            return
        by_kind: dict[str, list[Any]] = {kind: [] for kind in KINDS}
        for _, obj in objects:
            if isinstance(obj, Mapping) and obj.get("kind") in by_kind:
                by_kind[obj["kind"]].append(obj)
        for kind, items in by_kind.items():
            self.store.replace(kind, items)

    def start(self) -> list[threading.Thread]:
        """Read once now, then poll from a daemon thread until ``stop`` is set."""
        self._read()
        seen = self._signature()

        def poll() -> None:
            nonlocal seen
            while not self.clock.wait(self.stop, self.interval):
                try:
                    current = self._signature()
                    if current != seen:
                        seen = current
                        self._read()
                except Exception as exc:  # the poll must outlive any one bad read
                    log.error("cannot read manifests in %s: %s", self.directory, exc)

        thread = threading.Thread(target=poll, name="manifests", daemon=True)
        thread.start()
        return [thread]

