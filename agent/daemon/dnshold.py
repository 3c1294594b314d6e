"""The hold of DNS answers to pods: each answer waits in an nfqueue until what it teaches is in
the kernel, so the first connection after an answer is never refused (docs/domain-names.md).

Where the answers are queued: a chain of our own, ``NFTPOLICY-DNS-HOLD``, in the ``security``
table of ``iptables-nft`` and ``ip6tables-nft`` (xt ``NFQUEUE`` through nft's compat layer,
jumped to from ``FORWARD``), which queues every UDP and TCP segment from port 53 to queue
``queue`` (jumped to from ``OUTPUT`` too, for a DNS server on the node's own network). nft's
own ``queue`` statement would do the same in our table, but needs
``nft_queue`` (CONFIG_NFT_QUEUE), which some kernels lack while the xt target
(CONFIG_NETFILTER_XT_TARGET_NFQUEUE) is there: the xt path works on both. Why ``security``:
the queue's verdict (accept) ends the base chain the packet was queued from, so queued from
``filter`` (where kube-proxy, CNIs and operators keep their rules) an answer skipped every
rule after the jump; ``security`` (priority 150, after ``filter`` and our own table) is the
table hardly anyone uses (SELinux ``SECMARK``), and an answer reaches it only when the others
let it through.

When the agent is not reading the queue (down, restarting): with ``bypass`` (the default) the
kernel lets answers through unheld, so DNS keeps working and what they would teach is not
learned (a connection to a new address is refused until the agent is back and the pod asks
again); without it (``fail_closed``) the kernel drops them and the pods' DNS fails until the
agent is back. The hold chain stays in the kernel while the agent is away (its shutdown leaves
it); it goes when the last domainNames peer goes.

One pod cannot delay another's answers: the reader takes what the queue holds into one line per
pod (the answer's destination), and releases in rounds, the oldest answer of each waiting pod
in turn, the pods with fewest answers waiting first (a pod that asks now and then goes before a
flood's backlog), so a pod's answer waits for at most one answer of each other pod; a pod with
``budget`` answers waiting already has its next let through at once, unheld and unread (counted:
what it would teach is not learned, as when the kernel's queue is full), so one pod's flood
neither fills the kernel's queue of 1024 for the others nor grows the agent's memory.

The queue is read with nfnetlink_queue directly (``NETLINK_NETFILTER``, linux/netfilter/
nfnetlink_queue.h): config (bind, copy the whole packet), packet messages, verdicts. No binding
on PyPI serves it without a C build against libnetfilter_queue (NetfilterQueue), which the
image does not carry; the protocol part used here is four message shapes.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from nftpolicy.agent.dataplane import iptables as xt
from nftpolicy.agent.dataplane import netns

log = logging.getLogger("nftpolicy.dnshold")

HOLD_CHAIN = "NFTPOLICY-DNS-HOLD"
HOLD_TABLE = "security"  # iptables-nft's table of the hold chain (module docstring)
EARLIER_TABLES = ("filter",)  # where an agent before this one may have left it
TOOLS = ("iptables-nft", "ip6tables-nft")
NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 4, 5
NFQA_CFG_F_FAIL_OPEN = 1
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND = 1, 2
NFQNL_COPY_PACKET = 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR, NFQA_MARK, NFQA_PAYLOAD = 1, 2, 3, 10
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NF_DROP, NF_ACCEPT, NF_REPEAT = 0, 1, 4  # linux/netfilter.h verdicts
COPY_RANGE = 65535
POLL = 0.2  # seconds a read waits before the reader looks whether it should stop
DEFAULT_BUDGET = 32  # answers one pod may have waiting in the agent (--dns-pod-budget)
HOLD_NICE = -10  # the hold's thread's niceness, where the agent may raise it (CAP_SYS_NICE)
# The GIL's switch interval (seconds) while a hold runs: the reader takes the GIL back after each
# system call (read, commit, verdict), each time waiting up to the interval for a thread that
# computes (a full resync's render, a watch decoding a large list). Python's 5 ms made a held
# answer wait 30 ms at p99 beside such a thread (bench/dns_learn.py --busy).
SWITCH_INTERVAL = 0.0005
READS_PER_ROUND = 16  # socket reads at most before a round of releases (each up to 256 KiB)
FAILURE_LOG_SECONDS = 60.0  # at most one log line about failed commits this often


@dataclass(frozen=True)
class QueuedPacket:
    """A packet the kernel queued: its ``id`` (for the verdict), ``packet`` (the IP packet, as
    much as the queue copies) and ``mark`` (the packet mark when it was queued)."""

    id: int
    packet: bytes
    mark: int


@dataclass(frozen=True)
class DnsSegment:
    """The DNS part of a queued packet: to ``client`` (the pod's address), ``payload`` (the
    UDP payload or the TCP segment's data), ``tcp``."""

    client: str
    payload: bytes
    tcp: bool


def dns_segment(packet: bytes) -> DnsSegment | None:
    """The DNS segment of an IPv4 or IPv6 packet (no IPv6 extension headers), or None when it is
    not UDP/TCP or is cut short."""
    try:
        if packet[0] >> 4 == 4:
            header, protocol, client = (packet[0] & 0x0F) * 4, packet[9], str(ipaddress.IPv4Address(packet[16:20]))
        elif packet[0] >> 4 == 6:
            header, protocol, client = 40, packet[6], str(ipaddress.IPv6Address(packet[24:40]))
        else:
            return None
        if protocol == socket.IPPROTO_UDP:
            return DnsSegment(client, packet[header + 8:], False)
        if protocol == socket.IPPROTO_TCP:
            return DnsSegment(client, packet[header + (packet[header + 12] >> 4) * 4:], True)
    except (IndexError, ipaddress.AddressValueError):
        return None
    return None


def hold_rules(queue: int, bypass: bool, mark: int | None = None) -> list[list[str]]:
    """The ``iptables``/``ip6tables`` argument lists that make the hold chain and jump to it from
    ``FORWARD`` (answers the node routes to its pods) and ``OUTPUT`` (answers a DNS server on the
    node's own network sends them: a node-local cache, a host-network CoreDNS; never through
    ``lo``, so the node's own lookups are not held); the ``FORWARD`` jump comes last.

    Only a reply of a flow that the pod began is queued (conntrack: ``ESTABLISHED`` in the
    ``REPLY`` direction): a DNS message that anybody sends from port 53 to a pod unasked is
    no answer to the pod's question and teaches nothing (it passes unheld and unread).

    With ``mark`` (a bit), only packets that carry it are queued: our table sets it on packets
    to the subject pods of domainNames peers
    (:func:`~nftpolicy.translators.domainnames.with_hold_marks`), so an answer to any other pod
    never leaves the kernel."""
    target = ["-j", "NFQUEUE", "--queue-num", str(queue)] + (["--queue-bypass"] if bypass else [])
    replies = ["-m", "conntrack", "--ctstate", "ESTABLISHED", "--ctdir", "REPLY"]
    if mark is not None:
        replies += ["-m", "mark", "--mark", f"{mark:#x}/{mark:#x}"]
    return [["-N", HOLD_CHAIN],
            ["-A", HOLD_CHAIN, "-p", "udp", "--sport", "53", *replies, *target],
            ["-A", HOLD_CHAIN, "-p", "tcp", "--sport", "53", *replies, *target],
            ["-I", "OUTPUT", "1", "!", "-o", "lo", "-j", HOLD_CHAIN],
            ["-I", "FORWARD", "1", "-j", HOLD_CHAIN]]


def run_xt(netns_name: str | None, command: list[str]) -> str:
    """Run an iptables ``command`` in ``netns_name`` (None: this process's namespace); its
    stdout. Raises IptablesError (the tool failed) or OSError (the tool is absent)."""
    if netns_name is not None:
        return xt.run(netns_name, command)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise xt.IptablesError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result.stdout


def remove_hold_chain(netns_name: str | None) -> bool:
    """Remove the hold chain and its jumps from each family's :data:`HOLD_TABLE` (and
    :data:`EARLIER_TABLES`) of iptables-nft in ``netns_name`` (None: this process's) where it
    is; True when it was somewhere (:func:`remove_chain`)."""
    return remove_chain(netns_name, HOLD_CHAIN, [["FORWARD"], ["OUTPUT", "!", "-o", "lo"]], (HOLD_TABLE, *EARLIER_TABLES))


def remove_chain(netns_name: str | None, chain: str, jumps: Sequence[Sequence[str]], tables: Sequence[str]) -> bool:
    """Remove iptables-nft chain ``chain`` of ``tables`` (each family's) in ``netns_name`` (None:
    this process's) where it is, with its ``jumps`` (each a built-in chain and the matches
    before ``-j chain``); True when it was somewhere. Where it is not, nothing is run that would
    make the table (``iptables-nft -D FORWARD`` makes ``table ip filter`` with its base chains);
    without the tools there is no chain to remove (False)."""
    found = False
    for tool in TOOLS:
        for table in tables:
            try:
                if f":{chain} " not in run_xt(netns_name, [f"{tool}-save", "-t", table]):
                    continue
            except (xt.IptablesError, OSError):
                continue
            found = True
            for argv in (*(["-D", *jump, "-j", chain] for jump in jumps), ["-F", chain], ["-X", chain]):
                with contextlib.suppress(xt.IptablesError):  # a jump someone removed already
                    run_xt(netns_name, [tool, "-w", "-t", table, *argv])
    return found


def _nlmsg(kind: int, flags: int, family: int, res_id: int, attrs: Sequence[tuple[int, bytes]], seq: int = 0) -> bytes:
    body = struct.pack("=BB", family, 0) + struct.pack(">H", res_id)
    for attr_type, data in attrs:
        attr = struct.pack("=HH", 4 + len(data), attr_type) + data
        body += attr + b"\0" * (-len(attr) % 4)
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body


def _attrs(data: bytes) -> dict[int, bytes]:
    found, offset = {}, 0
    while offset + 4 <= len(data):
        length, attr_type = struct.unpack_from("=HH", data, offset)
        if length < 4:
            break
        found[attr_type & 0x7FFF] = data[offset + 4:offset + length]
        offset += (length + 3) & ~3
    return found


class NfQueue:
    """One nfnetlink queue, bound in the network namespace this thread is in when it is made
    (a socket keeps its namespace). :meth:`packets` gives :class:`QueuedPacket` objects; every
    packet needs its :meth:`verdict` (:meth:`accept`). ``fail_open``: a packet that finds the
    queue full (1024 waiting) or the socket's buffer full passes unheld instead of being
    dropped. ``copy_range``: bytes of each packet copied to us (from its IP header on).
    :attr:`overruns` counts the reads that found packets lost that way (ENOBUFS)."""

    def __init__(self, queue: int, fail_open: bool = False, copy_range: int = COPY_RANGE) -> None:
        self.queue = queue
        self.overruns = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        self.sock.bind((0, 0))
        self.sock.settimeout(POLL)
        self._request([(NFQA_CFG_CMD, struct.pack("=BB", NFQNL_CFG_CMD_BIND, 0) + struct.pack(">H", socket.AF_UNSPEC))])
        self._request([(NFQA_CFG_PARAMS, struct.pack(">IB", copy_range, NFQNL_COPY_PACKET))])
        if fail_open:
            self._request([(NFQA_CFG_MASK, struct.pack(">I", NFQA_CFG_F_FAIL_OPEN)),
                           (NFQA_CFG_FLAGS, struct.pack(">I", NFQA_CFG_F_FAIL_OPEN))])
        self.sock.setblocking(False)  # reads wait in select (packets), or not at all

    def _request(self, attrs: Sequence[tuple[int, bytes]]) -> None:
        self.sock.send(_nlmsg(NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, socket.AF_UNSPEC, self.queue, attrs))
        reply = self.sock.recv(65536)
        kind = struct.unpack_from("=H", reply, 4)[0]
        if kind == NLMSG_ERROR:
            code = struct.unpack_from("=i", reply, 16)[0]
            if code:
                raise OSError(-code, f"nfqueue {self.queue}: {errno.errorcode.get(-code, code)}")

    def packets(self, wait: bool = True) -> list[QueuedPacket]:
        """The packets of one read (``wait``: up to :data:`POLL` seconds for one, else none;
        ``[]`` if none)."""
        if wait and not select.select([self.sock], [], [], POLL)[0]:
            return []
        try:
            data = self.sock.recv(1 << 18)
        except BlockingIOError:
            return []
        except OSError as exc:  # the socket's buffer overflowed: those packets passed or dropped (fail_open)
            if exc.errno != errno.ENOBUFS:
                raise
            self.overruns += 1
            return []
        found: list[QueuedPacket] = []
        offset = 0
        while offset + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, offset)
            if length < 16:
                break
            if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                attrs = _attrs(data[offset + 20:offset + length])
                if NFQA_PACKET_HDR in attrs:
                    mark = struct.unpack(">I", attrs[NFQA_MARK])[0] if len(attrs.get(NFQA_MARK, b"")) == 4 else 0
                    found.append(QueuedPacket(struct.unpack_from(">I", attrs[NFQA_PACKET_HDR])[0], attrs.get(NFQA_PAYLOAD, b""), mark))
            offset += (length + 3) & ~3
        return found

    def accept(self, packet_id: int) -> None:
        """Let packet ``packet_id`` go on."""
        self.verdict(packet_id, NF_ACCEPT)

    def verdict(self, packet_id: int, verdict: int, mark: int | None = None) -> None:
        """Give packet ``packet_id`` ``verdict`` (:data:`NF_ACCEPT`: go on after the rule that
        queued it; :data:`NF_REPEAT`: walk that base chain again; :data:`NF_DROP`), with the
        packet mark set to ``mark`` first where given (nfnetlink_queue.h: NFQA_MARK)."""
        attrs = [(NFQA_VERDICT_HDR, struct.pack(">II", verdict, packet_id))]
        if mark is not None:
            attrs.append((NFQA_MARK, struct.pack(">I", mark)))
        self.sock.send(_nlmsg(NFQNL_MSG_VERDICT, NLM_F_REQUEST, socket.AF_UNSPEC, self.queue, attrs))

    def close(self) -> None:
        """Close (the kernel unbinds the queue; packets still queued then pass or drop as the
        rule's bypass says)."""
        self.sock.close()


class DnsHold:
    """Holds DNS answers in network namespace ``netns_name`` (one this process created, through
    :func:`nftpolicy.agent.dataplane.iptables.run`; None: the agent's own, the node's) until
    ``commit`` returns for what each teaches: ``commit(segment)`` learns and writes the set
    elements (an exception there is logged and the answer let through). ``mark``: as
    :func:`hold_rules` (None: every answer to a pod is queued). ``budget``: answers one
    pod may have waiting (module docstring); ``released(segment, seconds)``: after each held
    answer's release, how long it was held from its read. :meth:`start` installs the hold chain
    and starts the reader thread; :meth:`close` stops it and removes the chain."""

    def __init__(self, commit: Callable[[DnsSegment], None], queue: int = 5300, bypass: bool = True,
                 *, netns_name: str | None, mark: int | None = None, budget: int = DEFAULT_BUDGET,
                 released: Callable[[DnsSegment, float], None] | None = None) -> None:
        self.commit, self.queue_num, self.bypass, self.netns, self.mark = commit, queue, bypass, netns_name, mark
        self.budget, self.released = budget, released
        self.held = 0  # answers released after their commit
        self.failed = 0  # answers whose commit raised (let through all the same)
        self.over_budget = 0  # answers let through unread: their pod had budget answers waiting
        self.unmarked = 0  # answers let through unread: queued without the mark (no trusted answer to a subject)
        self._logged_at = -FAILURE_LOG_SECONDS  # when a failed commit was last logged (time.monotonic)
        self._failed_since = 0  # self.failed when that line was logged
        self._queue: NfQueue | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def _iptables(self, argv: list[str]) -> None:
        for tool in TOOLS:
            run_xt(self.netns, [tool, "-w", "-t", HOLD_TABLE, *argv])

    def start(self) -> None:
        """Bind the queue (before the rule, so no answer waits for a reader), then the chain
        (made anew: an earlier agent's is removed first); the process's GIL switch interval is
        cut to :data:`SWITCH_INTERVAL` at most (for good: the hold may start again). Raises
        OSError when the queue cannot be bound (another process holds it: nothing is changed)
        and IptablesError when the chain cannot be made (what was made of it is removed again)."""
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        with netns.entered(self.netns) if self.netns is not None else contextlib.nullcontext():
            self._queue = NfQueue(self.queue_num, fail_open=self.bypass)
        self._thread = threading.Thread(target=self._reader, name="dns-hold", daemon=True)
        self._thread.start()
        remove_hold_chain(self.netns)
        try:
            for argv in hold_rules(self.queue_num, self.bypass, self.mark):
                self._iptables(argv)
        except Exception:
            remove_hold_chain(self.netns)
            raise

    def _reader(self) -> None:
        """The reader thread: :meth:`_run` at :data:`HOLD_NICE` where the agent may raise its
        priority (every held answer waits for this thread: ahead of the pods' processes for a
        core), else at the agent's."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HOLD_NICE)
        except PermissionError:  # without CAP_SYS_NICE
            log.info("the DNS hold's thread runs at the agent's priority (nice %d needs CAP_SYS_NICE)", HOLD_NICE)
        self._run()

    def _run(self) -> None:
        assert self._queue is not None
        waiting: dict[str, deque[tuple[int, DnsSegment, float]]] = {}  # pod address -> its answers, oldest first
        while not self._stopping.is_set():
            for reads in range(READS_PER_ROUND):
                packets = self._queue.packets(wait=not waiting and reads == 0)
                if not packets:
                    break
                self._take(packets, waiting)
            for client in sorted(waiting, key=lambda c: len(waiting[c])):  # one round: the oldest answer of each pod, fewest waiting first
                line = waiting[client]
                packet_id, segment, read_at = line.popleft()
                if not line:
                    del waiting[client]
                self._release(packet_id, segment, read_at)
        for line in waiting.values():  # stopping: what waits goes on unlearned
            for packet_id, _, _ in line:
                self._queue.accept(packet_id)

    def _take(self, packets: list[QueuedPacket], waiting: dict[str, deque[tuple[int, DnsSegment, float]]]) -> None:
        """Put each packet of one read in its pod's line; one that is no DNS segment, or whose
        pod has :attr:`budget` waiting, is let through at once, and with a :attr:`mark` so is
        one without it (the agent's own check of the kernel's: our table marks only the
        answers to subjects from trusted resolvers; a chain of another agent that queues
        unmarked answers teaches nothing)."""
        assert self._queue is not None
        now = time.monotonic()
        for queued in packets:
            if self.mark is not None and not queued.mark & self.mark:
                self._queue.accept(queued.id)
                self.unmarked += 1
                continue
            segment = dns_segment(queued.packet)
            if segment is None:
                self._queue.accept(queued.id)
                continue
            line = waiting.setdefault(segment.client, deque())
            if len(line) >= self.budget:
                self._queue.accept(queued.id)
                self.over_budget += 1
                continue
            line.append((queued.id, segment, now))

    def _release(self, packet_id: int, segment: DnsSegment, read_at: float) -> None:
        """Commit what ``segment`` teaches, then let it go on (also when the commit failed)."""
        assert self._queue is not None
        try:
            self.commit(segment)
        except Exception as exc:  # noqa: BLE001 - an answer is never kept from its pod by our failure
            self._failed(exc)
        finally:
            self._queue.accept(packet_id)
            self.held += 1
        if self.released is not None:
            self.released(segment, time.monotonic() - read_at)

    def _failed(self, exc: Exception) -> None:
        """Count a failed commit; log one line for it at most every :data:`FAILURE_LOG_SECONDS`
        (a failing dataplane would otherwise log one traceback per DNS answer), with how many
        failed since the last line."""
        self.failed += 1
        now = time.monotonic()
        if now - self._logged_at >= FAILURE_LOG_SECONDS:
            self._logged_at, since, self._failed_since = now, self.failed - self._failed_since, self.failed
            log.error("could not commit what %d DNS %s taught, let through unlearned: %s: %s", since,
                      "answer" if since == 1 else "answers", type(exc).__name__, " ".join(str(exc).split()))

    def close(self, remove_chain: bool = True) -> None:
        """Stop reading and close the queue; with ``remove_chain`` remove the hold chain first
        (without: it stays, and the kernel passes or drops answers as its bypass says, which is
        what an agent that stops for a restart leaves)."""
        if remove_chain:
            remove_hold_chain(self.netns)
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        if self._queue is not None:
            self._queue.close()


