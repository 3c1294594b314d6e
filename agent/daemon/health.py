"""Liveness and readiness, and the HTTP server of ``/healthz``, ``/readyz`` and ``/metrics``."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .metrics import Metrics


class Health:
    """Liveness and readiness.

    Alive: the reconcile loop ticked within ``window`` seconds. Ready: every source has listed
    and the first sync committed.
    """

    def __init__(self, window: float) -> None:
        self.window = window
        self.ready = False
        self._tick = time.monotonic()
        self.unlisted: Callable[[], list[str]] = list  # the kinds not listed yet (the store's)
        self.sync_failure: str | None = None  # why the last sync failed (None: it did not)

    def beat(self) -> None:
        """Called by the reconcile loop on every iteration."""
        self._tick = time.monotonic()

    def alive(self) -> bool:
        """True when the loop ticked recently."""
        return time.monotonic() - self._tick < self.window

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
        ok = health.alive()
        return (200 if ok else 503), (b"ok\n" if ok else b"reconcile loop stalled\n"), TEXT

    def readyz() -> tuple[int, bytes, str]:
        reasons = health.not_ready()
        return (503 if reasons else 200), ("".join(f"not ready: {r}\n" for r in reasons).encode() or b"ok\n"), TEXT

    return start_http(address, {"/metrics": lambda: (200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST),
                                "/healthz": healthz, "/readyz": readyz}, "0.0.0.0", "http")
