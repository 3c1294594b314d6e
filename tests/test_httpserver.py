"""The agent's HTTP server (agent/daemon/httpserver.py) under the clients an attacker or a busy
operator brings: idle connections, slow heads, huge heads, bodies, other methods, more
connections than the cap, a Unix socket's mode and a stale one; over TLS as well. Real sockets
on loopback; the timeouts are made short instead of waited out at their defaults."""

from __future__ import annotations

import http.client
import logging
import os
import socket
import ssl
import stat
import threading
import time

import pytest

from nftpolicy.agent.cli.agenthttp import agent_get
from nftpolicy.agent.daemon import httpserver
from nftpolicy.agent.daemon.health import HEALTH_BODY_BYTES, Health, serve_http
from nftpolicy.agent.daemon.httpserver import MAX_CONNECTIONS, MAX_HEAD, WORKERS, start_http
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.serving import ServingCertificate

from .conftest import eventually

TEXT = "text/plain; charset=utf-8"


@pytest.fixture
def server():
    """A server of /ok and /metrics-like /big on loopback, with 0.3 s head and idle timeouts."""
    started = start_http("127.0.0.1:0", {"/ok": lambda: (200, b"ok\n", TEXT), "/big": lambda: (200, b"x" * 100_000, TEXT)},
                         "127.0.0.1", "test-http", head_timeout=0.3, idle_timeout=0.3)
    yield started
    started.shutdown()


def connect(srv) -> socket.socket:
    return socket.create_connection(srv.server_address[:2], timeout=5)


def closed(sock: socket.socket) -> bool:
    """True when the server closed ``sock`` (EOF or reset)."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def get(srv, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    return agent_get(f"http://127.0.0.1:{srv.server_address[1]}", path, timeout)


def test_200_idle_connections_cost_no_thread_and_do_not_hold_up_metrics():
    """The issue's case: http.server gave every idle connection a thread for ever (120 idle
    connections: 122 threads). Here: /metrics answers within 2 s next to 200 idle connections,
    the threads are the loop's and the answer workers' only, the connections at most the cap."""
    metrics, health = Metrics(), Health(window=30)
    srv = serve_http("127.0.0.1:0", metrics, health)
    idle = []
    try:
        before = threading.active_count()
        idle = [connect(srv) for _ in range(200)]
        eventually(srv.connections, MAX_CONNECTIONS)
        started = time.monotonic()
        status, body = get(srv, "/metrics", timeout=2)
        assert status == 200 and b"nftpolicy_sync_failures_total" in body
        assert time.monotonic() - started < 2
        assert threading.active_count() - before <= WORKERS
        assert srv.connections() <= MAX_CONNECTIONS
    finally:
        for sock in idle:
            sock.close()
        srv.shutdown()


def test_an_idle_connection_and_a_slow_head_are_closed_after_the_head_timeout(server):
    silent, slow = connect(server), connect(server)
    slow.sendall(b"GET /ok HTTP/1.1\r\n")
    time.sleep(0.15)
    slow.sendall(b"Host: x\r\n")  # a byte now and then does not extend the head's time
    started = time.monotonic()
    assert closed(silent) and closed(slow)
    assert time.monotonic() - started < 2


def test_keep_alive_serves_several_requests_then_closes_when_idle(server):
    sock = connect(server)
    for _ in range(3):
        sock.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).endswith(b"\r\n\r\nok\n")
    assert closed(sock)  # after the idle timeout


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET /ok HTTP/1.1\r\nX: " + b"a" * MAX_HEAD + b"\r\n\r\n", b"431"),
    (b"POST /ok HTTP/1.1\r\nContent-Length: 4\r\n\r\nbody", b"400"),
    (b"GET /ok HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"400"),
    (b"DELETE /ok HTTP/1.1\r\n\r\n", b"405"),
    (b"GET /nothing HTTP/1.1\r\n\r\n", b"404"),
    (b"GET ok\r\n\r\n", b"400"),
    (b"GET /ok HTTP/1.1\r\nno colon\r\n\r\n", b"400"),
])
def test_what_is_not_a_plain_get_is_refused_and_closed(server, request_bytes, status):
    sock = connect(server)
    sock.sendall(request_bytes)
    answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 " + status), answer
    if status != b"404" and status != b"405":
        assert closed(sock)


def test_head_gets_the_headers_only_and_a_query_is_ignored(server):
    sock = connect(server)
    sock.sendall(b"HEAD /big?x=1 HTTP/1.1\r\n\r\n")
    answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Length: 100000\r\n" in answer and answer.endswith(b"\r\n\r\n")


def test_http_1_0_and_connection_close_close_after_the_answer(server):
    for request_bytes in (b"GET /ok HTTP/1.0\r\n\r\n", b"GET /ok HTTP/1.1\r\nConnection: close\r\n\r\n"):
        sock = connect(server)
        sock.sendall(request_bytes)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        assert data.endswith(b"ok\n") and b"Connection: close" in data


def test_beyond_the_cap_a_new_connection_closes_the_longest_idle_or_is_refused():
    """Idle connections make room for a new one; when every connection is being answered, a new
    one is closed at once."""
    release = threading.Event()
    srv = start_http("127.0.0.1:0", {"/wait": lambda: (release.wait(10), (200, b"ok\n", TEXT))[1]}, "127.0.0.1", "test-http")
    socks = []
    try:
        first = connect(srv)
        socks = [first] + [connect(srv) for _ in range(MAX_CONNECTIONS - 1)]
        eventually(srv.connections, MAX_CONNECTIONS)
        newest = connect(srv)
        socks.append(newest)
        assert closed(first)  # the one idle the longest made room
        eventually(srv.connections, MAX_CONNECTIONS)
        for sock in socks[1:]:
            sock.sendall(b"GET /wait HTTP/1.1\r\n\r\n")  # every connection now waits for its answer
        time.sleep(0.3)
        refused = connect(srv)
        assert closed(refused)
        release.set()
        assert newest.recv(65536).endswith(b"ok\n")
    finally:
        release.set()
        for sock in socks:
            sock.close()
        srv.shutdown()


def test_a_unix_socket_is_mode_0600_replaces_a_stale_one_and_never_a_live_one_or_a_file(tmp_path):
    path = str(tmp_path / "run" / "debug.sock")
    srv = start_http(f"unix:{path}", {"/ok": lambda: (200, b"ok\n", TEXT)}, "", "test-http")
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700
        with pytest.raises(OSError, match="served by another process"):
            start_http(f"unix:{path}", {}, "", "test-http")
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(path)
            sock.sendall(b"GET /ok HTTP/1.1\r\n\r\n")
            assert sock.recv(65536).endswith(b"ok\n")
    finally:
        srv.shutdown()
    assert not os.path.exists(path)  # removed on shutdown
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # a socket file nobody listens on: what a killed agent leaves
    stale.close()
    start_http(f"unix:{path}", {}, "", "test-http").shutdown()
    (tmp_path / "file").write_text("mine")
    with pytest.raises(OSError, match="is not a socket"):
        start_http(f"unix:{tmp_path / 'file'}", {}, "", "test-http")
    assert (tmp_path / "file").read_text() == "mine"


def test_tls_with_a_self_signed_certificate_and_a_plain_client_is_closed_fast():
    certificate = ServingCertificate(None, None, ["node1", "127.0.0.1"])
    srv = start_http("127.0.0.1:0", {"/ok": lambda: (200, b"ok\n", TEXT)}, "127.0.0.1", "test-https", tls=certificate)
    try:
        client = ssl.create_default_context()
        client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
        connection = http.client.HTTPSConnection(*srv.server_address[:2], timeout=5, context=client)
        connection.request("GET", "/ok")
        reply = connection.getresponse()
        assert (reply.status, reply.read()) == (200, b"ok\n")
        der = connection.sock.getpeercert(binary_form=True)
        connection.close()
        from cryptography import x509

        names = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == ["node1"]
        plain = connect(srv)
        plain.sendall(b"GET /ok HTTP/1.1\r\n\r\n")
        assert closed(plain)
    finally:
        srv.shutdown()


def test_a_certificate_from_files_is_read_again_when_it_changes(tmp_path, monkeypatch):
    from nftpolicy.agent.daemon import serving

    from .fakeclock import FakeClock

    def write(name: str) -> None:
        cert, key, _ = serving.self_signed([name])
        (tmp_path / "tls.crt").write_bytes(cert)
        (tmp_path / "tls.key").write_bytes(key)

    write("first")
    clock = FakeClock()
    certificate = ServingCertificate(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), [], clock=clock)
    context = certificate()
    write("second")
    assert certificate() is context  # not looked at again before CHECK_INTERVAL
    clock.advance(serving.CHECK_INTERVAL)
    renewed = certificate()
    assert renewed is not context
    (tmp_path / "tls.key").write_text("not a key")
    clock.advance(serving.CHECK_INTERVAL)
    assert certificate() is renewed  # a change that cannot be used keeps the one in use
    with pytest.raises(serving.CertificateError, match="cannot use the certificate"):
        ServingCertificate(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), [])


def test_readyz_and_healthz_stay_short_whatever_the_failure():
    """A refused batch's text (megabytes naming pods and policies) never reaches /readyz."""
    metrics, health = Metrics(), Health(window=30)
    health.unlisted = lambda: ["Pod"] * 10_000  # whatever a reason grows to, the body is cut
    health.sync_failure = "Error: syntax error, unexpected '{' " + '{"add": {"rule": {"comment": "shop/db pod"}}} ' * 100_000
    srv = serve_http("127.0.0.1:0", metrics, health)
    try:
        status, body = get(srv, "/readyz")
        assert status == 503 and len(body) <= HEALTH_BODY_BYTES < 2048
        assert b"shop/db" not in body and body.startswith(b"not ready: not listed yet: Pod, Pod")
        health.unlisted = list
        status, body = get(srv, "/readyz")
        assert (status, body) == (503, b"not ready: no sync committed yet; the last one failed (the log says why)\n")
    finally:
        srv.shutdown()


def test_a_route_that_raises_is_a_500_and_one_log_line_a_minute_and_the_server_serves_on(caplog):
    """A broken route (or guard) costs its answer only: each scrape of it would otherwise drop
    its connection unanswered and log a traceback. The workers live on, and so does the rest."""
    caplog.set_level(logging.ERROR, "nftpolicy.http")

    def broken() -> tuple[int, bytes, str]:
        raise KeyError("a key\nfrom two lines")

    srv = start_http("127.0.0.1:0", {"/broken": broken, "/ok": lambda: (200, b"ok\n", TEXT)}, "127.0.0.1", "test-http-broken")
    try:
        for _ in range(3 * WORKERS):
            assert get(srv, "/broken") == (500, b"internal error (the agent's log says why)\n")
        assert get(srv, "/ok") == (200, b"ok\n")
        logged_at, since = srv._failures["/broken"]
        srv._failures["/broken"] = (logged_at - httpserver.FAILURE_LOG_SECONDS, since)  # a minute on
        assert get(srv, "/broken")[0] == 500
        assert [r.getMessage() for r in caplog.records] == [
            "answering /broken failed: KeyError: 'a key\\nfrom two lines'",
            f"answering /broken failed (and {3 * WORKERS - 1} times since the last line): KeyError: 'a key\\nfrom two lines'"]
        assert all(r.exc_info is None for r in caplog.records)
    finally:
        srv.shutdown()


def test_shutdown_closes_every_connection_and_the_threads_end():
    srv = start_http("127.0.0.1:0", {}, "127.0.0.1", "test-http-ends")
    sock = connect(srv)
    eventually(srv.connections, 1)
    srv.shutdown()
    assert closed(sock)
    assert not [t for t in threading.enumerate() if t.name.startswith("test-http-ends")]
    assert httpserver.HttpServer.shutdown(srv) is None  # idempotent
