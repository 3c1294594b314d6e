"""Liveness and readiness, and the HTTP server of ``/healthz``, ``/readyz`` and ``/metrics``."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

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
        reasons.append("no sync committed yet" + (f"; the last one failed: {self.sync_failure}" if self.sync_failure else ""))
        return reasons


class _Server6(ThreadingHTTPServer):
    """The HTTP server on an IPv6 address (``[::]:port``)."""

    address_family = socket.AF_INET6


TEXT = "text/plain; charset=utf-8"
# A GET handler: () -> (HTTP status, body, content type).
Route = Callable[[], tuple[int, bytes, str]]


def start_http(address: str, routes: Mapping[str, Route], default_host: str, name: str) -> ThreadingHTTPServer:
    """Serve ``GET`` of each path of ``routes`` on ``host:port`` (``[::]:port`` for IPv6; an
    empty host is ``default_host``; port 0 picks a free port: ``server.server_address`` tells
    which) from a daemon thread called ``name``; any other path is 404. Logs nothing. Raises
    OSError when the address cannot be bound."""
    host, _, port = address.rpartition(":")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            route = routes.get(self.path)
            code, body, content_type = route() if route is not None else (404, b"not found\n", TEXT)
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    host = host.strip("[]") or default_host
    server_class: type[ThreadingHTTPServer] = _Server6 if ":" in host else ThreadingHTTPServer
    server = server_class((host, int(port)), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


def serve_http(address: str, metrics: Metrics, health: Health) -> ThreadingHTTPServer:
    """Serve ``/healthz``, ``/readyz`` and ``/metrics`` on ``host:port`` (:func:`start_http`;
    an empty host is every IPv4 address)."""
    def healthz() -> tuple[int, bytes, str]:
        reasons = health.not_alive()
        return (503 if reasons else 200), ("".join(f"{r}\n" for r in reasons).encode() or b"ok\n"), TEXT

    def readyz() -> tuple[int, bytes, str]:
        reasons = health.not_ready()
        return (503 if reasons else 200), ("".join(f"not ready: {r}\n" for r in reasons).encode() or b"ok\n"), TEXT

    return start_http(address, {"/metrics": lambda: (200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST),
                                "/healthz": healthz, "/readyz": readyz}, "0.0.0.0", "http")
