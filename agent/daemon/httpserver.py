"""The agent's HTTP server, with bounds: what ``/healthz``, ``/readyz``, ``/metrics`` and
``/debug/model`` are served by (:func:`start_http`).

Every client costs bounded time, memory and threads, whatever it does:

* one event loop thread (asyncio) holds every connection; an idle one costs a file descriptor
  and a few kilobytes, never a thread (http.server's ThreadingHTTPServer gave each connection a
  thread of its own for as long as it stayed open: 120 idle connections, 122 threads);
* the answers are made by :data:`WORKERS` threads at most (a metrics exposition, a token check
  through the API server), so that scrapes at once cost no more threads or memory than that;
* at most :data:`MAX_CONNECTIONS` connections are open; a new one beyond them closes the one
  idle the longest (a connection in its TLS handshake or waiting for its request), or is closed
  at once when every one is being answered. Idle connections cannot lock Prometheus out;
* the TLS handshake and a request's head must come within :data:`HEAD_TIMEOUT` seconds, the
  next request on a kept-alive connection within :data:`IDLE_TIMEOUT`, and an answer must be
  taken by the client within :data:`WRITE_TIMEOUT` (a client that does not read);
* a request is a head of :data:`MAX_HEAD` bytes at most (431 beyond) and no body (400): the
  agent serves ``GET`` and ``HEAD`` only (405 otherwise);
* an answer whose route (or guard) raises is a 500 and one log line per path at most every
  :data:`FAILURE_LOG_SECONDS`, with the count since; the worker and the loop serve on.

Supervision: the loop's thread is called ``name``; if it ends with an exception the agent's
``/healthz`` fails naming it (:meth:`~nftpolicy.agent.daemon.health.Health.supervise`). Its
workers, ``<name>-answer_<n>``, never end by a task's exception (the executor hands it to the
task: the 500 above). A loop or every worker stuck leaves the probes on that address
unanswered, which the kubelet's liveness probe counts as failures.

asyncio rather than a selector loop of our own: its streams and its TLS (``start_tls``, a
handshake that cannot block the loop) are the standard library's, tested code; the TLS
handshake runs after our connection count, so half-open handshakes are bounded as well.

An address is ``HOST:PORT`` (TCP) or ``unix:PATH`` (a Unix socket of mode 0600, which only
processes of its user that see the path can reach: the agent's container).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import os
import socket
import ssl
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping

MAX_CONNECTIONS = 64
WORKERS = 4
HEAD_TIMEOUT = 5.0  # seconds: the TLS handshake, then the head of the first request
IDLE_TIMEOUT = 30.0  # seconds a kept-alive connection waits for its next request
WRITE_TIMEOUT = 10.0  # seconds a client has to take an answer
MAX_HEAD = 8192  # bytes of a request line and its headers
UNIX_PREFIX = "unix:"

FAILURE_LOG_SECONDS = 60.0  # at most one log line about a path's failed answers this often
TEXT = "text/plain; charset=utf-8"

log = logging.getLogger("nftpolicy.http")


@dataclass(frozen=True)
class Request:
    """A request's method (``GET``, ``HEAD``), path (without the query), headers (names in
    lower case; a repeated header: its last value) and whether the connection stays open after
    its answer (HTTP/1.1 without ``Connection: close``)."""

    method: str
    path: str
    headers: Mapping[str, str]
    keep_alive: bool = True


# An answer: (HTTP status, body, content type).
Answer = tuple[int, bytes, str]
# A GET handler of one path: () -> its answer.
Route = Callable[[], Answer]
# Decides whether a request may have its route's answer: None (it may), or the refusal to send.
Guard = Callable[[Request], "Answer | None"]


class HttpServer:
    """A running server (:func:`start_http`): ``server_address`` is what the socket is bound to
    (``(host, port)``; the path for a Unix socket)."""

    def __init__(self, sock: socket.socket, routes: Mapping[str, Route], name: str, tls: Callable[[], ssl.SSLContext] | None,
                 guard: Guard | None, guarded: frozenset[str], head_timeout: float, idle_timeout: float) -> None:
        self.server_address: Any = sock.getsockname()
        self._sock, self._routes, self._tls, self._guard, self._guarded = sock, routes, tls, guard, guarded
        self._head_timeout, self._idle_timeout = head_timeout, idle_timeout
        self._unix_path = self.server_address if sock.family == socket.AF_UNIX else None
        self._loop = asyncio.new_event_loop()
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix=f"{name}-answer")
        self._idle_since: dict[asyncio.StreamWriter, float] = {}  # open connections: since when idle (inf: answering)
        self._failures: dict[str, tuple[float, int]] = {}  # path -> (its failure last logged at, failures since)
        self._failures_lock = threading.Lock()
        self._closed = False
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        start = asyncio.start_unix_server if self._unix_path else asyncio.start_server
        try:
            server = self._loop.run_until_complete(start(self._serve, sock=self._sock, limit=MAX_HEAD))
        finally:
            ready.set()  # a server that could not start: its thread ends, and connections are refused
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for writer in list(self._idle_since):
                writer.transport.abort()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    def shutdown(self) -> None:
        """Stop serving: close the socket and every connection (a Unix socket's path is
        removed). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._sock.close()
        if self._unix_path:
            with contextlib.suppress(OSError):
                os.unlink(self._unix_path)

    server_close = shutdown

    def connections(self) -> int:
        """Connections open now."""
        return len(self._idle_since)

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        """Count a new connection in; at :data:`MAX_CONNECTIONS` close the one idle the longest
        first, or refuse the new one (False) when none is idle."""
        if len(self._idle_since) >= MAX_CONNECTIONS:
            oldest = min(self._idle_since, key=self._idle_since.__getitem__)
            if self._idle_since[oldest] == float("inf"):
                return False
            oldest.transport.abort()
            del self._idle_since[oldest]
        self._idle_since[writer] = time.monotonic()
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit(writer):
            writer.transport.abort()
            return
        try:
            if self._tls is not None:
                await writer.start_tls(self._tls(), ssl_handshake_timeout=self._head_timeout)
            timeout = self._head_timeout
            while writer in self._idle_since:
                self._idle_since[writer] = time.monotonic()
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
                except asyncio.LimitOverrunError:
                    await self._send(writer, "GET", (431, b"request head too large\n", TEXT), keep=False)
                    return
                self._idle_since[writer] = float("inf")
                request = parse_head(head)
                if not isinstance(request, Request):
                    await self._send(writer, "GET", request, keep=False)
                    return
                answer = await self._loop.run_in_executor(self._pool, self._answer, request)
                await self._send(writer, request.method, answer, request.keep_alive)
                if not request.keep_alive:
                    return
                timeout = self._idle_timeout
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, OSError, RuntimeError):
            pass  # the client went, stalled or spoke no TLS: nothing to answer
        finally:
            self._idle_since.pop(writer, None)
            writer.transport.abort()

    def _answer(self, request: Request) -> Answer:
        """The answer to ``request`` (in a worker thread): 404 for a path without a route, the
        guard's refusal for a guarded path, else the route's."""
        route = self._routes.get(request.path)
        if route is None:
            return 404, b"not found\n", TEXT
        if request.method not in ("GET", "HEAD"):
            return 405, b"only GET and HEAD\n", TEXT
        try:
            if self._guard is not None and request.path in self._guarded:
                refusal = self._guard(request)
                if refusal is not None:
                    return refusal
            return route()
        except Exception as exc:  # noqa: BLE001 - a route's failure costs its answer, never the server
            self._failed(request.path, exc)
            return 500, b"internal error (the agent's log says why)\n", TEXT

    def _failed(self, path: str, exc: Exception) -> None:
        """Count a failed answer of ``path``; log one line at most every :data:`FAILURE_LOG_SECONDS`
        for it (each scrape of a broken path would otherwise log a traceback), with how many
        failed since the last line."""
        with self._failures_lock:
            logged_at, since = self._failures.get(path, (-FAILURE_LOG_SECONDS, 0))
            now = time.monotonic()
            if now - logged_at < FAILURE_LOG_SECONDS:
                self._failures[path] = (logged_at, since + 1)
                return
            self._failures[path] = (now, 0)
        log.error("answering %s failed%s: %s: %s", path, f" (and {since} times since the last line)" if since else "",
                  type(exc).__name__, " ".join(str(exc).split())[:300])

    async def _send(self, writer: asyncio.StreamWriter, method: str, answer: Answer, keep: bool) -> None:
        code, body, content_type = answer
        lines = [f"HTTP/1.1 {code} {http.HTTPStatus(code).phrase}", f"Content-Type: {content_type}",
                 f"Content-Length: {len(body)}", f"Connection: {'keep-alive' if keep else 'close'}"]
        if code == 401:
            lines.append('WWW-Authenticate: Bearer realm="nftpolicy"')
        if code == 405:
            lines.append("Allow: GET, HEAD")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body if method != "HEAD" else b""))
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)


def parse_head(head: bytes) -> Request | Answer:
    """The request in ``head`` (its request line and headers, up to the blank line), or the
    answer that refuses it: a request line or header that does not parse, or a body announced
    (it would never be read)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1") or not parts[1].startswith("/"):
        return 400, b"bad request line\n", TEXT
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            return 400, b"bad header\n", TEXT
        headers[name.lower()] = value.strip()
    if "transfer-encoding" in headers or headers.get("content-length", "0") != "0":
        return 400, b"a request body is not accepted\n", TEXT
    keep = parts[2] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    return Request(parts[0], parts[1].partition("?")[0], headers, keep)


def _listen_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _listen_unix(path: str) -> socket.socket:
    """A Unix socket at ``path``, mode 0600, its directory made (0700) when missing. A socket
    left there by a process that ended is replaced; one that a process still serves is not
    (OSError), nor is anything that is not a socket."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # stale: nobody serves it
            else:
                raise OSError(f"{path} is served by another process")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    return sock


def start_http(address: str, routes: Mapping[str, Route], default_host: str, name: str, *,
               tls: Callable[[], ssl.SSLContext] | None = None, guard: Guard | None = None, guarded: frozenset[str] = frozenset(),
               head_timeout: float = HEAD_TIMEOUT, idle_timeout: float = IDLE_TIMEOUT) -> HttpServer:
    """Serve ``GET`` (and ``HEAD``) of each path of ``routes`` on ``address``: ``host:port``
    (``[::]:port`` for IPv6; an empty host is ``default_host``; port 0 picks a free port:
    ``server.server_address`` tells which) or ``unix:PATH``, from a daemon thread called
    ``name``; any other path is 404. ``tls``: the TLS context of each new connection (None:
    plain HTTP). ``guard`` decides for the paths in ``guarded`` before their route answers.
    Logs only the answers that failed. Raises OSError when the address cannot be bound."""
    if address.startswith(UNIX_PREFIX):
        sock = _listen_unix(address[len(UNIX_PREFIX):])
    else:
        host, _, port = address.rpartition(":")
        sock = _listen_tcp(host.strip("[]") or default_host, int(port))
    return HttpServer(sock, routes, name, tls, guard, guarded, head_timeout, idle_timeout)
