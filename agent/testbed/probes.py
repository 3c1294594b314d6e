"""Probes: real connections between sandbox pods, one new connection per cell.

Every pod serves each probed port (TCP accept, UDP echo, SCTP where the kernel has it); a probe
is a new connection from a fresh source port, so conntrack never carries an old verdict into a new
probe. ICMP probes (``ProbeSpec(0, "ICMP")``) are echo requests from a ping socket. Sockets are
made inside each pod's network namespace (:func:`~nftpolicy.agent.dataplane.netns.entered`), then driven
from one asyncio loop in this thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from dataclasses import dataclass
from typing import Any, Coroutine, Iterable, Mapping, Sequence, TypeVar, cast

from nftpolicy.translators.cases import Matrix
from nftpolicy.translators.model import Family, Pod, Protocol

from nftpolicy.agent import interrupts

from nftpolicy.agent.dataplane import netns

T = TypeVar("T")

SOURCE_PORTS = range(32768, 61000)
SOCKET_PROTO = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP, "SCTP": getattr(socket, "IPPROTO_SCTP", 132)}
ICMP_ECHO = {socket.AF_INET: (8, 0), socket.AF_INET6: (128, 129)}  # (request, reply) types
PARALLEL = 200  # connections in flight at once
CLOSE_TIMEOUT = 1.0  # seconds that close() waits for cancelled probes


def sctp_supported() -> bool:
    """True when this kernel can open SCTP sockets (many CI kernels cannot)."""
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM, SOCKET_PROTO["SCTP"]).close()
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class ProbeSpec:
    """A destination port and protocol to probe between every pod pair; ``ProbeSpec(0, "ICMP")``
    is an ICMP (ICMPv6) echo request."""

    port: int
    protocol: Protocol | str



class Prober:
    """Probes between ``pods`` (key -> pod with its addresses), each pod's sockets made in its
    namespace ``pod_netns[key]``, and from the pods to ``hosts`` (a Node's endpoint: key ->
    (its network namespace, its addresses), served like a pod, never a source); ``timeout``
    (seconds) bounds each probe. :meth:`close` stops the servers."""

    def __init__(self, pods: Mapping[str, Pod], pod_netns: Mapping[str, str], timeout: float,
                 hosts: Mapping[str, tuple[str, tuple[str, ...]]] | None = None) -> None:
        self.pods, self.pod_netns, self.timeout = pods, pod_netns, timeout
        self.hosts = dict(hosts or {})
        self.loop = asyncio.new_event_loop()
        self._served: set[ProbeSpec] = set()
        self._servers: list[Any] = []
        self._source_ports = itertools.cycle(SOURCE_PORTS)

    def close(self) -> None:
        """Stop the servers and the loop (idempotent). Probes still running (cut short by an
        interrupt) are cancelled and given at most :data:`CLOSE_TIMEOUT` seconds to end."""
        for server in self._servers:
            server.close()
        self._servers.clear()
        if not self.loop.is_closed():
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending and not self.loop.is_running():
                with contextlib.suppress(BaseException):  # a second Ctrl-C: the caller cleans up anyway
                    self.loop.run_until_complete(asyncio.wait(pending, timeout=CLOSE_TIMEOUT))
            self.loop.close()

    def probe(self, specs: Iterable[ProbeSpec], families: Sequence[Family] = ("ipv4", "ipv6"),
              pairs: Iterable[tuple[str, str]] | None = None) -> dict[tuple[ProbeSpec, Family], Matrix]:
        """Connect from every pod to every pod and host on each spec, once per address family
        (``pairs``: only these ``(from, to)`` keys).

        Returns ``{(spec, family): {(from, to): connected}}`` for the families the pods have.
        SCTP specs are left out when the kernel has no SCTP.
        """
        specs = [s for s in specs if s.protocol != "SCTP" or sctp_supported()]
        wanted = set(pairs) if pairs is not None else None
        return self._run(self._probe_all(specs, families, wanted))

    def connect(self, src: str, address: str, spec: ProbeSpec) -> bool:
        """One new connection from sandbox pod ``src`` to ``address`` (every pod serves ``spec``
        from then on); True when it connected (TCP, SCTP) or got its echo back (UDP)."""
        return self._run(self._connect_once(src, address, spec))

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on the loop. An interrupt cancels the loop's tasks rather than raising
        inside asyncio (:mod:`nftpolicy.agent.interrupts`); it is raised here once the loop has
        returned (and one still pending, before it starts)."""
        try:
            interrupts.raise_pending()
        except interrupts.Interrupted:
            work.close()  # never started: no "coroutine was never awaited"
            raise
        try:
            result = self.loop.run_until_complete(work)
        except asyncio.CancelledError:
            interrupts.raise_pending()
            raise
        interrupts.raise_pending()
        return result

    async def _connect_once(self, src: str, address: str, spec: ProbeSpec) -> bool:
        if spec not in self._served:
            await self._serve(spec)
            self._served.add(spec)
        return await self._connect(asyncio.Semaphore(1), src, address, spec)

    async def _probe_all(self, specs: list[ProbeSpec], families: Sequence[Family],
                         wanted: set[tuple[str, str]] | None = None) -> dict[tuple[ProbeSpec, Family], Matrix]:
        for spec in specs:
            if spec not in self._served:
                await self._serve(spec)
                self._served.add(spec)
        limit = asyncio.Semaphore(PARALLEL)
        jobs = []
        destinations = [(key, pod.ips) for key, pod in self.pods.items()] + [(key, ips) for key, (_, ips) in self.hosts.items()]
        for spec in specs:
            for family in families:
                for src, (dst, ips) in itertools.product(self.pods.values(), destinations):
                    if wanted is not None and (src.key, dst) not in wanted:
                        continue
                    targets = [ip for ip in ips if (":" in ip) == (family == "ipv6")]
                    if src.addresses(family) and targets:
                        jobs.append(((spec, family), (src.key, dst), self._connect(limit, src.key, targets[0], spec)))
        results = await asyncio.gather(*(job for _, _, job in jobs))
        matrices: dict[tuple[ProbeSpec, Family], Matrix] = {}
        for (key, cell, _), ok in zip(jobs, results):
            matrices.setdefault(key, {})[cell] = ok
        return matrices

    def _socket(self, pod: str, family: int, kind: int, protocol: str) -> socket.socket:
        """A socket in the namespace of pod or host ``pod``."""
        with netns.entered(self.pod_netns[pod] if pod in self.pod_netns else self.hosts[pod][0]):
            sock = socket.socket(family, kind, SOCKET_PROTO[protocol])
        sock.setblocking(False)
        return sock

    async def _serve(self, spec: ProbeSpec) -> None:
        if spec.protocol == "ICMP":
            # Ping sockets (no raw sockets needed) for root's group, in every pod.
            for name in self.pod_netns.values():
                netns.write_sysctl(name, "net.ipv4.ping_group_range", "0 2147483647")
            return
        kind = socket.SOCK_DGRAM if spec.protocol == "UDP" else socket.SOCK_STREAM
        for key in [*self.pods, *self.hosts]:
            sock = self._socket(key, socket.AF_INET6, kind, spec.protocol)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::", spec.port))
            if kind == socket.SOCK_DGRAM:
                transport, _ = await self.loop.create_datagram_endpoint(_Echo, sock=sock)
                self._servers.append(transport)
            else:
                sock.listen(128)
                self._servers.append(await self.loop.create_server(_Hangup, sock=sock))

    def _source_port(self) -> int:
        served = {s.port for s in self._served}
        return next(p for p in self._source_ports if p not in served)

    async def _ping(self, src: str, address: str) -> bool:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        request, reply_type = ICMP_ECHO[family]
        with netns.entered(self.pod_netns[src]):
            sock = socket.socket(family, socket.SOCK_DGRAM, socket.IPPROTO_ICMP if family == socket.AF_INET else socket.IPPROTO_ICMPV6)
        sock.setblocking(False)
        try:
            sock.connect((address, 0))
            # The checksum and identifier are filled in by the kernel's ping socket.
            await self.loop.sock_sendall(sock, bytes([request, 0, 0, 0, 0, 0, 0, 1]) + b"nftpolicy-probe")
            reply = await asyncio.wait_for(self.loop.sock_recv(sock, 128), self.timeout)
            return len(reply) >= 8 and reply[0] == reply_type
        except (OSError, asyncio.TimeoutError):
            return False
        finally:
            sock.close()

    async def _connect(self, limit: asyncio.Semaphore, src: str, address: str, spec: ProbeSpec) -> bool:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        if spec.protocol == "ICMP":
            async with limit:
                return await self._ping(src, address)
        async with limit:
            sock = self._socket(src, family, socket.SOCK_DGRAM if spec.protocol == "UDP" else socket.SOCK_STREAM, spec.protocol)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", self._source_port()))
                if spec.protocol == "UDP":
                    sock.connect((address, spec.port))
                    await self.loop.sock_sendall(sock, b"nftpolicy-probe")
                    reply = await asyncio.wait_for(self.loop.sock_recv(sock, 64), self.timeout)
                    return reply == b"nftpolicy-probe"
                await asyncio.wait_for(self.loop.sock_connect(sock, (address, spec.port)), self.timeout)
                return True
            except (OSError, asyncio.TimeoutError):
                return False
            finally:
                if spec.protocol != "UDP":
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                sock.close()


class _Echo(asyncio.DatagramProtocol):
    """UDP server: send every datagram back."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self.transport.sendto(data, addr)


class _Hangup(asyncio.Protocol):
    """TCP/SCTP server: accept, then close (the accepted connection is the answer)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()
