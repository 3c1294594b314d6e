"""A TCP proxy on loopback that can stop forwarding: a stuck load balancer or proxy in front of
an API server. After :meth:`StallProxy.stall`, every connection open then forwards nothing in
either direction and stays open (the proxy stops reading both sockets: their kernel buffers
fill and the peers' TCP windows close, while the proxy's kernel still ACKs and answers
keepalive probes, so TCP keepalive sees a live peer); connections made later are forwarded as
before. TLS passes through untouched (the proxy sees bytes, not requests)."""

from __future__ import annotations

import select
import socket
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Link:
    """One proxied connection: the client's socket and the upstream's; ``answered`` is when
    the upstream last sent a byte (monotonic; its connection time until then)."""

    client: socket.socket
    upstream: socket.socket
    answered: float = field(default_factory=time.monotonic)
    stalled: bool = False
    closed: threading.Event = field(default_factory=threading.Event)

    def close(self) -> None:
        self.closed.set()
        for sock in (self.client, self.upstream):
            sock.close()


class StallProxy:
    """Listens on 127.0.0.1 (``port`` after :meth:`start`) and forwards each connection to
    ``upstream`` (host, port). Use as a context manager; :meth:`close` closes every socket."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.links: list[Link] = []
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.listener.settimeout(0.1)
        self.closed = threading.Event()

    def __enter__(self) -> "StallProxy":
        threading.Thread(target=self._accept, name="stallproxy-accept", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        with self.lock:
            for link in self.links:
                link.close()

    def stall(self) -> list[Link]:
        """Stop forwarding on every connection open now; returns them."""
        with self.lock:
            open_now = [link for link in self.links if not link.closed.is_set()]
            for link in open_now:
                link.stalled = True
        return open_now

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)  # blocking: a pump waits in select, and sendall as long as its reader needs
            link = Link(client, upstream)
            with self.lock:
                self.links.append(link)
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(link, source, sink), name="stallproxy-pump", daemon=True).start()

    @staticmethod
    def _pump(link: Link, source: socket.socket, sink: socket.socket) -> None:
        """Copy ``source`` to ``sink`` until either closes; once ``link`` is stalled, read
        nothing more (and forward nothing already read) until it is closed."""
        try:
            while not link.closed.is_set():
                if link.stalled or not select.select([source], [], [], 0.1)[0]:
                    link.closed.wait(0.1 if link.stalled else 0)
                    continue
                data = source.recv(65536)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                if link.stalled:
                    continue
                if source is link.upstream:
                    link.answered = time.monotonic()
                sink.sendall(data)
        except (OSError, ValueError):  # ValueError: select on a socket closed meanwhile
            link.close()
