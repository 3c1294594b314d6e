"""Liveness (agent/daemon/health.py): ``/healthz`` fails when the reconcile loop stalls or when a
thread of the agent dies (an exception nobody caught: the DNS hold's reader, the Event writer,
the HTTP server, the rule counters' reader, a watch), naming it, with one log line that says
why; the chart's liveness probe then restarts the agent. The real agent too: its rule counters'
reader dies when the network namespace it reads is deleted under it."""

from __future__ import annotations

import logging
import socket
import subprocess
import threading

import pytest

from nftpolicy.agent.daemon.dnshold import DnsHold
from nftpolicy.agent.daemon.health import HEALTH_BODY_BYTES, Health, serve_http
from nftpolicy.agent.daemon.httpserver import HttpServer
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.testbed.controlplane import free_port

from .conftest import REPO, eventually, http_get
from .test_interrupts import NFTPOLICY


@pytest.fixture
def supervised(monkeypatch):
    """A Health whose supervision is on (the process's threading.excepthook is restored after)."""
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    health = Health(window=30)
    health.supervise()
    return health


def _run(name: str, target) -> None:
    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()


def _fail() -> None:
    raise OSError(5, "Input/output error")


def test_a_thread_that_dies_fails_liveness_by_name_with_one_log_line(supervised, caplog):
    caplog.set_level(logging.ERROR, "nftpolicy.health")
    _run("events", lambda: None)  # a thread that ends by itself is no death
    assert supervised.alive() and supervised.not_alive() == []
    _run("dns-hold", _fail)
    assert not supervised.alive() and supervised.not_alive() == ["thread dns-hold died"]
    [record] = caplog.records
    assert record.getMessage().startswith("thread dns-hold died: OSError: [Errno 5] Input/output error at test_health.py:")
    assert record.getMessage().endswith("; /healthz fails until the agent is restarted")
    _run("counters", _fail)
    assert supervised.not_alive() == ["thread dns-hold died", "thread counters died"]  # for good, each named


def test_healthz_names_what_failed_in_a_short_body(supervised):
    server = serve_http("127.0.0.1:0", Metrics(), supervised)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/healthz"
        assert http_get(url) == (200, "ok\n")
        _run("http-handler", lambda: {}["a key from an object's text"])
        status, body = http_get(url)
        assert (status, body) == (503, "thread http-handler died\n")  # the exception's text stays in the log
        supervised.window = 0  # and the loop has not ticked within it
        assert http_get(url) == (503, "reconcile loop stalled\nthread http-handler died\n")
    finally:
        server.shutdown()
        server.server_close()


def test_many_dead_threads_still_fit_the_health_body(supervised):
    for i in range(40):
        _run(f"watch-kind{i}", _fail)
    _run("watch-kind0", _fail)  # a name that dies again is one reason
    server = serve_http("127.0.0.1:0", Metrics(), supervised)
    try:
        status, body = http_get(f"http://127.0.0.1:{server.server_address[1]}/healthz")
        assert status == 503 and len(body.encode()) <= HEALTH_BODY_BYTES
        assert body.startswith("thread watch-kind0 died\nthread watch-kind1 died\n") and body.endswith("...\n")
        assert len(supervised.not_alive()) == 40
    finally:
        server.shutdown()


def test_an_http_loop_that_dies_fails_the_other_servers_healthz_by_name(supervised, caplog):
    """The agent's two servers (``http`` on the node's port, ``debug-http`` on its Unix socket)
    each serve /healthz: the loop of one ends (here: asyncio cannot serve its socket, one of
    datagrams), the other's /healthz names it."""
    caplog.set_level(logging.ERROR, "nftpolicy.health")
    server = serve_http("127.0.0.1:0", Metrics(), supervised)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as datagrams:
            HttpServer(datagrams, {}, "debug-http", None, None, frozenset(), 1.0, 1.0)  # returns as its thread ends
        eventually(lambda: http_get(f"http://127.0.0.1:{server.server_address[1]}/healthz"), (503, "thread debug-http died\n"))
        [record] = caplog.records
        assert record.getMessage().startswith("thread debug-http died: ValueError: A Stream Socket was expected")
    finally:
        server.shutdown()


@pytest.mark.kernel
def test_a_dns_hold_whose_queue_fails_fails_liveness(make_netns, supervised, caplog):
    """The DNS hold's reader in a namespace the test made: its netlink socket fails under it
    (closed); the thread dies, /healthz names it (answers would wait in the queue, unread)."""
    caplog.set_level(logging.ERROR, "nftpolicy.health")
    hold = DnsHold(lambda segment: None, bypass=True, netns_name=make_netns())
    hold.start()
    try:
        assert supervised.not_alive() == []
        assert hold._queue is not None
        hold._queue.sock.close()
        eventually(supervised.not_alive, ["thread dns-hold died"])
        [record] = caplog.records
        assert record.getMessage().startswith("thread dns-hold died: OSError: [Errno 9] Bad file descriptor at dnshold.py:")
    finally:
        hold.close()


@pytest.mark.kernel
def test_the_agent_whose_counters_reader_dies_fails_liveness(make_netns, tmp_path):
    """The agent on the example commits and reads in a namespace the test made; the test deletes
    it: the next read of the rule counters cannot enter it, its thread dies, /healthz says so
    (the HTTP thread and the loop live on) and the log has one line with the reason."""
    name = make_netns()
    port, log = free_port(), tmp_path / "agent.log"
    proc = subprocess.Popen([NFTPOLICY, "agent", "--manifests", str(REPO / "examples" / "shop"), "--node", "node1", "--netns", name,
                             "--http-address", f"127.0.0.1:{port}", "--debug-address", "", "--counters-interval", "1"],
                            stderr=log.open("w"))
    try:
        eventually(lambda: http_get(f"http://127.0.0.1:{port}/readyz")[0], 200, timeout=30)
        assert http_get(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")
        subprocess.run(["ip", "netns", "del", name], check=True)
        eventually(lambda: http_get(f"http://127.0.0.1:{port}/healthz"), (503, "thread counters died\n"))
        died = [line for line in log.read_text().splitlines() if "thread counters died" in line]
        assert len(died) == 1 and "FileNotFoundError" in died[0] and name in died[0], died
        assert proc.poll() is None  # the kubelet's probe restarts it, not the agent itself
    finally:
        proc.kill()  # the test's own process
        proc.wait()
