"""The agent's debug endpoint: ``GET /debug/model``, what the agent enforces right now, as JSON.

It names every pod, label-selected set and policy of the cluster, so it is served on its own
address (``--debug-address``, loopback by default), never on the metrics port that the chart
exposes on every node address. Read-only; ``nftpolicy explain --agent http://ADDR`` reads it
(:func:`nftpolicy.translators.verdict.enforcement_from_json`).
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import orjson

from nftpolicy.translators.verdict import renderer_json

from .reconcile import Reconciler

DEBUG_PATH = "/debug/model"


def serve_debug(address: str, snapshot: Callable[[], dict[str, Any] | None]) -> ThreadingHTTPServer:
    """Serve ``GET /debug/model`` on ``host:port`` (``[::1]:port`` for IPv6; port 0: a free one)
    from a daemon thread: ``snapshot()`` as JSON (:func:`~nftpolicy.translators.verdict.renderer_json`
    of the committed model), or 503 while it returns None (no sync committed yet). Raises OSError
    when the address cannot be bound."""
    host, _, port = address.rpartition(":")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path != DEBUG_PATH:
                self._reply(404, b"not found\n", "text/plain; charset=utf-8")
                return
            data = snapshot()
            if data is None:
                self._reply(503, b"no sync committed yet\n", "text/plain; charset=utf-8")
            else:
                self._reply(200, orjson.dumps(data), "application/json")

        def _reply(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    host = host.strip("[]") or "127.0.0.1"
    server_class: type[ThreadingHTTPServer] = type("Server6", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6}) if ":" in host else ThreadingHTTPServer
    server = server_class((host, int(port)), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="debug-http", daemon=True).start()
    return server


def start_debug(address: str, reconciler: Reconciler) -> ThreadingHTTPServer:
    """:func:`serve_debug` of ``reconciler``'s committed model (read under its lock, between
    syncs; building it takes about as long as a full render's model step)."""
    def snapshot() -> dict[str, Any] | None:
        with reconciler.lock:
            renderer = reconciler.renderer
            return None if renderer is None else renderer_json(renderer)
    return serve_debug(address, snapshot)
