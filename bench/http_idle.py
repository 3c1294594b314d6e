#!/usr/bin/env python3
"""Benchmark: what idle and slow clients cost the agent's HTTP port (issue 29, "Why" 3 and
"Done when": 200 idle connections, /metrics still answers within 2 s).

Usage (as root for the real agent: it commits the example's table in a network namespace of
its own, which is deleted afterwards)::

    .venv/bin/python bench/http_idle.py                  # 200 idle connections
    .venv/bin/python bench/http_idle.py --idle 1000 --no-agent

Side by side in one run, each holding ``--idle`` connections open that send nothing, and as
many again that send a request head one byte a second (slowloris):

* ``thread per connection``: http.server's ThreadingHTTPServer, as the agent served before
  (a thread per connection, no timeout), with the same routes;
* ``bounded``: agent/daemon/httpserver.py (one loop thread, a few answer threads, the
  connection cap, the head timeout);
* ``agent``: the real ``nftpolicy agent --manifests examples/shop`` process (its threads from
  /proc).

Printed: the threads the server's process has while the clients hang on, the connections the
server still holds after ``HEAD_TIMEOUT`` + 1 s, and the time of ``GET /metrics`` (median and
worst of 20) while they hang on; target: worst < 2 s. The load average is printed beside the
figures (the machine is shared).
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nftpolicy.agent.daemon.health import Health, health_routes, serve_http  # noqa: E402
from nftpolicy.agent.daemon.httpserver import HEAD_TIMEOUT  # noqa: E402
from nftpolicy.agent.daemon.metrics import Metrics  # noqa: E402
from nftpolicy.agent.dataplane import netns  # noqa: E402
from nftpolicy.agent.testbed.controlplane import free_port  # noqa: E402

TARGET_SECONDS = 2.0
NFTPOLICY = str(Path(sys.executable).parent / "nftpolicy")


def thread_per_connection(metrics: Metrics, health: Health) -> tuple[int, http.server.ThreadingHTTPServer]:
    """The design the agent had: ThreadingHTTPServer, a daemon thread per connection, no timeout."""
    routes = health_routes(metrics, health)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802
            code, body, content_type = routes[self.path]() if self.path in routes else (404, b"", "text/plain")
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1], server


def metrics_seconds(port: int, tries: int = 20) -> tuple[float, float]:
    """Median and worst seconds of GET /metrics (a new connection each; 10 s at most each)."""
    times = []
    for _ in range(tries):
        started = time.monotonic()
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            connection.request("GET", "/metrics")
            reply = connection.getresponse()
            reply.read()
            connection.close()
            times.append(time.monotonic() - started if reply.status == 200 else float("inf"))
        except OSError:
            times.append(float("inf"))
    times.sort()
    return times[len(times) // 2], times[-1]


def hang_on(port: int, idle: int) -> tuple[list[socket.socket], threading.Event]:
    """``idle`` connections that send nothing and ``idle`` that send a head a byte a second."""
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(idle)]
    slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(idle)]
    stop = threading.Event()

    def trickle() -> None:
        head = b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 1000
        for byte in head:
            for sock in slow:
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    pass
            if stop.wait(1):
                return

    threading.Thread(target=trickle, daemon=True).start()
    return silent + slow, stop


def held(port: int, socks: list[socket.socket]) -> int:
    """How many of ``socks`` the server has not closed."""
    count = 0
    for sock in socks:
        sock.setblocking(False)
        try:
            count += sock.recv(1) != b""
        except BlockingIOError:
            count += 1
        except OSError:
            pass
    return count


def process_threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def measure(name: str, port: int, idle: int, threads: "callable") -> None:
    socks, stop = hang_on(port, idle)
    try:
        time.sleep(1)
        during = threads()
        median, worst = metrics_seconds(port)
        time.sleep(HEAD_TIMEOUT + 1)
        still = held(port, socks)
        print(f"{name:22} threads {during:5}   connections held after {HEAD_TIMEOUT + 1:.0f} s: {still:5} of {len(socks)}   "
              f"/metrics median {median * 1000:7.1f} ms, worst {worst * 1000:8.1f} ms  "
              f"{'ok' if worst < TARGET_SECONDS else 'OVER'} (target < {TARGET_SECONDS:g} s)")
    finally:
        stop.set()
        for sock in socks:
            sock.close()


def run_agent(idle: int) -> None:
    name = f"nftp-{netns.run_tag()}bench{secrets.token_hex(3)}"
    netns.create([name])
    port = free_port()
    agent = subprocess.Popen([NFTPOLICY, "agent", "--manifests", str(ROOT / "examples" / "shop"), "--node", "node1", "--netns", name,
                              "--http-address", f"127.0.0.1:{port}", "--debug-address", ""],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while metrics_seconds(port, 1)[1] == float("inf"):
            if time.monotonic() > deadline or agent.poll() is not None:
                raise SystemExit("the agent did not serve /metrics within 30 s")
            time.sleep(0.2)
        idle_threads = process_threads(agent.pid)
        measure(f"agent (idle: {idle_threads} thr)", port, idle, lambda: process_threads(agent.pid))
    finally:
        agent.terminate()
        agent.wait(timeout=20)
        netns.delete([name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=200, help="idle connections, and as many slow ones (default %(default)s)")
    parser.add_argument("--no-agent", action="store_true", help="leave out the real agent process (no root needed)")
    args = parser.parse_args()
    print(f"load average: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}; {os.cpu_count()} CPUs; "
          f"{args.idle} idle + {args.idle} slow connections")
    metrics, health = Metrics(), Health(window=60)
    old_port, old = thread_per_connection(metrics, health)
    measure("thread per connection", old_port, args.idle, threading.active_count)
    old.shutdown()
    time.sleep(1)  # its handler threads end once their connections are closed
    new = serve_http("127.0.0.1:0", metrics, health)
    measure("bounded", new.server_address[1], args.idle, threading.active_count)
    new.shutdown()
    if not args.no_agent:
        run_agent(args.idle)
    print(f"load average after: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")


if __name__ == "__main__":
    main()
