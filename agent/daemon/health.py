"""Liveness and readiness, and what ``/healthz``, ``/readyz`` and ``/metrics`` answer (served by :mod:`.httpserver`)."""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
import traceback
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .httpserver import TEXT, Guard, HttpServer, Route, start_http
from .metrics import Metrics

log = logging.getLogger("nftpolicy.health")


class Health:
    """Liveness and readiness.

    Alive: the reconcile loop ticked within ``window`` seconds, and no thread of the agent died
    (once :meth:`supervise` is on: the DNS hold's reader, the Event writer, the HTTP servers, the
    rule counters' reader, the API watches, ...). Ready: every source has listed and the first
    sync committed.
    """

    def __init__(self, window: float) -> None:
        self.window = window
        self.ready = False
        self._tick = time.monotonic()
        self.unlisted: Callable[[], list[str]] = list  # the kinds not listed yet (the store's)
        self.sync_failure: str | None = None  # why the last sync failed (None: it did not)
        self.dead: list[str] = []  # the names of the threads that died, in order

    def beat(self) -> None:
        """Called by the reconcile loop on every iteration."""
        self._tick = time.monotonic()

    def supervise(self) -> None:
        """From now on, a thread of this process that ends with an exception nobody caught (every
        thread of the agent but the main one, the reconcile loop, runs until the agent stops, or
        catches its own errors) is logged in one line and fails liveness for good: what it did is
        no longer done, so the kubelet's liveness probe restarts the agent. Sets
        ``threading.excepthook`` (Python's default prints a traceback and carries on)."""
        threading.excepthook = self.thread_died

    def thread_died(self, args: threading.ExceptHookArgs) -> None:
        """``threading.excepthook``: count ``args.thread`` dead and log one line (its name, the
        exception and where it was raised)."""
        name = args.thread.name if args.thread is not None else "unnamed"
        frames = traceback.extract_tb(args.exc_traceback) if args.exc_traceback is not None else []
        where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
        log.error("thread %s died: %s: %s%s; /healthz fails until the agent is restarted", name, args.exc_type.__name__,
                  " ".join(str(args.exc_value).split())[:500], where)
        if name not in self.dead:  # one reason per thread name, however often threads of that name die
            self.dead.append(name)

    def not_alive(self) -> list[str]:
        """Why the agent is not alive, one short reason each (empty when it is): the loop has not
        ticked within the window, a thread died (by name; the log line has the exception)."""
        stalled = ["reconcile loop stalled"] if time.monotonic() - self._tick >= self.window else []
        return stalled + [f"thread {name} died" for name in self.dead]

    def alive(self) -> bool:
        """True when the loop ticked recently and no thread died."""
        return not self.not_alive()

    def not_ready(self) -> list[str]:
        """Why the agent is not ready, one reason a line (empty when it is): the kinds not
        listed yet, no sync committed yet, and how the last sync failed."""
        if self.ready:
            return []
        reasons = []
        if unlisted := self.unlisted():
            reasons.append(f"not listed yet: {', '.join(unlisted)}")
        # the failure itself (the kernel's words about a batch that names pods and policies) is in the log
        reasons.append("no sync committed yet" + ("; the last one failed (the log says why)" if self.sync_failure else ""))
        return reasons


# A health body says "ok" or a short reason, never an object's text (a refused batch names pods
# and policies, and the port is every pod's to read): at most this many bytes.
HEALTH_BODY_BYTES = 200


def short(text: str) -> bytes:
    """``text`` as UTF-8, cut to :data:`HEALTH_BODY_BYTES` (never inside a character; a cut
    body ends with ``...`` and a newline)."""
    body = text.encode()
    if len(body) <= HEALTH_BODY_BYTES:
        return body
    return body[:HEALTH_BODY_BYTES - 4].decode(errors="ignore").encode() + b"...\n"


def health_routes(metrics: Metrics, health: Health) -> dict[str, Route]:
    """``/healthz`` (200 ``ok``, 503 and a line per reason: the reconcile loop stalled, a thread
    died, :meth:`Health.not_alive`), ``/readyz`` (200 ``ok``,
    503 and a line per reason) and ``/metrics`` (the Prometheus text of ``metrics``)."""
    def healthz() -> tuple[int, bytes, str]:
        reasons = health.not_alive()
        return (503 if reasons else 200), (short("".join(f"{r}\n" for r in reasons)) or b"ok\n"), TEXT

    def readyz() -> tuple[int, bytes, str]:
        reasons = health.not_ready()
        return (503 if reasons else 200), (short("".join(f"not ready: {r}\n" for r in reasons)) or b"ok\n"), TEXT

    return {"/metrics": lambda: (200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST), "/healthz": healthz, "/readyz": readyz}


def serve_http(address: str, metrics: Metrics, health: Health, *, tls: Callable[[], ssl.SSLContext] | None = None,
               guard: Guard | None = None) -> HttpServer:
    """Serve :func:`health_routes` on ``host:port`` (:func:`~.httpserver.start_http`; an empty
    host is every IPv4 address), over TLS with ``tls``; ``guard`` decides who gets
    ``/metrics`` (the probes' paths stay open: they say ``ok`` or a short reason only)."""
    return start_http(address, health_routes(metrics, health), "0.0.0.0", "http", tls=tls, guard=guard, guarded=frozenset({"/metrics"}))
