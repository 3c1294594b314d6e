"""Who may read ``/metrics`` (with ``--metrics-secure``): the caller's bearer token, checked by the
API server, as the kubelet and controller-runtime's ``WithAuthenticationAndAuthorization``
filter check theirs ("delegated" authentication and authorization).

For each request: a ``TokenReview`` (``authentication.k8s.io/v1``) says whose token it is, then a
``SubjectAccessReview`` (``authorization.k8s.io/v1``) whether that user may ``get`` the request's
path as a non-resource URL (``nonResourceURLs: ["/metrics"], verbs: ["get"]`` in a ClusterRole
bound to Prometheus' ServiceAccount). No token or a bad one: 401; a user without the permission:
403; the API server cannot be asked: 503 (never a guess either way).

The agent's ServiceAccount needs ``create`` on ``tokenreviews`` and ``subjectaccessreviews``
(what the ``system:auth-delegator`` ClusterRole grants; the chart adds it when the option is on).

Answers are kept briefly (:class:`ReviewCache`: at most :data:`CACHE_ENTRIES` of each, a "yes"
for :data:`ALLOW_TTL` seconds, a "no" for :data:`DENY_TTL`, an error never), so a scrape every
few seconds costs the API server about one review per minute per token and node; a permission
taken away or a token revoked stops working within :data:`ALLOW_TTL`. Reviews not answered from
the cache are limited to :data:`REVIEWS_PER_SECOND` (bursts of :data:`REVIEW_BURST`; 429 beyond):
a client sending random tokens cannot make the agent flood the API server, whose priority and
fairness would then slow the agent's own watches, which share its flow.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, Hashable, TypeVar

import orjson
import urllib3

from .clock import REAL_TIME, Clock
from .httpserver import TEXT, Answer, Request
from .kubeclient import client as k8s
from .kubeclient import request
from .metrics import Metrics

log = logging.getLogger("nftpolicy.agent")

ALLOW_TTL = 60.0  # seconds a token's owner, and that owner's permission, stay known
DENY_TTL = 10.0  # seconds a refused token, or a refused permission, stays refused
CACHE_ENTRIES = 1024  # answers kept of each kind (tokens, permissions), the least recently used dropped
REVIEWS_PER_SECOND = 10.0
REVIEW_BURST = 20
TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
ERROR_LOG_INTERVAL = 60.0  # seconds between two log lines about reviews the API server did not answer

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ReviewError(Exception):
    """The API server did not answer a review (unreachable, an error status, an odd body)."""


@dataclass(frozen=True)
class User:
    """Whom a token belongs to, as the TokenReview's ``status.user`` says."""

    name: str
    uid: str
    groups: tuple[str, ...]
    extra: tuple[tuple[str, tuple[str, ...]], ...]


NOBODY = User("", "", (), ())  # a token the API server does not know, as kept in the cache


class ReviewCache(Generic[K, V]):
    """At most ``size`` answers, each until its own expiry on ``clock``; the least recently used
    goes first. Thread-safe."""

    def __init__(self, size: int, clock: Clock) -> None:
        self.size, self.clock = size, clock
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The answer kept for ``key``, or None (none, or expired)."""
        with self._lock:
            found = self._entries.get(key)
            if found is None or found[0] <= self.clock.now():
                self._entries.pop(key, None)
                return None
            self._entries.move_to_end(key)
            return found[1]

    def put(self, key: K, value: V, ttl: float) -> None:
        """Keep ``value`` for ``key`` for ``ttl`` seconds."""
        with self._lock:
            self._entries[key] = (self.clock.now() + ttl, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class TokenBucket:
    """``rate`` events a second on ``clock``, bursts of ``burst``. Thread-safe."""

    def __init__(self, rate: float, burst: int, clock: Clock) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._tokens, self._at = float(burst), clock.now()
        self._lock = threading.Lock()

    def take(self) -> bool:
        """True (and one event counted) when an event may happen now."""
        with self._lock:
            now = self.clock.now()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True


class DelegatedAuth:
    """The guard of the secure paths (:data:`~.httpserver.Guard`): called with a request, it
    returns None when the request's bearer token belongs to a user allowed to ``get`` its path,
    else the answer that refuses it (401, 403, 429, 503). Reviews go through ``api`` (the
    agent's own ``ApiClient``: its ServiceAccount), each bounded by ``timeout`` seconds."""

    def __init__(self, api: k8s.ApiClient, timeout: float, metrics: Metrics, clock: Clock = REAL_TIME) -> None:
        self.api, self.timeout, self.metrics, self.clock = api, timeout, metrics, clock
        self.users: ReviewCache[str, User] = ReviewCache(CACHE_ENTRIES, clock)  # by the token's sha256
        self.permissions: ReviewCache[tuple[User, str, str], bool] = ReviewCache(CACHE_ENTRIES, clock)
        self.reviews = TokenBucket(REVIEWS_PER_SECOND, REVIEW_BURST, clock)
        self._logged_at = -ERROR_LOG_INTERVAL

    def __call__(self, req: Request) -> Answer | None:
        result, answer = self._decide(req)
        self.metrics.http_auth.labels(result).inc()
        return answer

    def _decide(self, req: Request) -> tuple[str, Answer | None]:
        scheme, _, token = req.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or " " in token:
            return "unauthenticated", (401, b"unauthorized: a bearer token is needed\n", TEXT)
        verb = "get"  # GET and HEAD, as the API server names them
        try:
            user = self._user(token)
            if user is None:
                return "unauthenticated", (401, b"unauthorized: the API server does not know this token\n", TEXT)
            if not self._allowed(user, req.path, verb):
                return "forbidden", (403, f"forbidden: {user.name[:100]} may not {verb} {req.path}\n".encode(), TEXT)
        except _RateLimited:
            return "rate_limited", (429, b"too many tokens to check: try again\n", TEXT)
        except ReviewError as exc:
            if self.clock.now() - self._logged_at >= ERROR_LOG_INTERVAL:
                self._logged_at = self.clock.now()
                log.warning("cannot check a token for %s with the API server: %s", req.path, exc)
            return "error", (503, b"cannot check the token with the API server now\n", TEXT)
        return "allowed", None

    def _user(self, token: str) -> User | None:
        """The owner of ``token``; None when the API server does not know it."""
        key = hashlib.sha256(token.encode()).hexdigest()
        known = self.users.get(key)
        if known is not None:
            return None if known is NOBODY else known
        status = self._review(TOKEN_REVIEWS, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}})
        user = NOBODY
        if status.get("authenticated") is True:
            info = status.get("user") or {}
            user = User(str(info.get("username") or ""), str(info.get("uid") or ""), tuple(info.get("groups") or ()),
                        tuple(sorted((str(k), tuple(v or ())) for k, v in (info.get("extra") or {}).items())))
        self.users.put(key, user, DENY_TTL if user is NOBODY else ALLOW_TTL)
        return None if user is NOBODY else user

    def _allowed(self, user: User, path: str, verb: str) -> bool:
        key = (user, path, verb)
        known = self.permissions.get(key)
        if known is not None:
            return known
        spec: dict[str, Any] = {"user": user.name, "groups": list(user.groups), "nonResourceAttributes": {"path": path, "verb": verb}}
        if user.uid:
            spec["uid"] = user.uid
        if user.extra:
            spec["extra"] = {name: list(values) for name, values in user.extra}
        status = self._review(ACCESS_REVIEWS, {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec})
        allowed = status.get("allowed") is True and status.get("denied") is not True
        self.permissions.put(key, allowed, ALLOW_TTL if allowed else DENY_TTL)
        return allowed

    def _review(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST one review; its ``status``. Raises _RateLimited, ReviewError."""
        if not self.reviews.take():
            raise _RateLimited()
        try:
            answer = orjson.loads(request(self.api, "POST", path, self.timeout, body=body).data)
        except k8s.ApiException as exc:
            raise ReviewError(f"{path}: {exc.status} {exc.reason}") from None
        except (urllib3.exceptions.HTTPError, OSError, orjson.JSONDecodeError) as exc:
            raise ReviewError(f"{path}: {' '.join(str(exc).split())[:200]}") from None
        status = answer.get("status") if isinstance(answer, dict) else None
        if not isinstance(status, dict):
            raise ReviewError(f"{path}: an answer without a status")
        return status


class _RateLimited(Exception):
    """More reviews than :data:`REVIEWS_PER_SECOND` would be asked for."""
