"""The hold of unknown pods' packets: a packet from or to an address of the node's pod CIDRs
that no local pod programmed in our table has waits in an nfqueue until the pod is programmed,
then walks its rules; after ``hold_seconds`` it is dropped (docs/design.md "A new pod from its
first packet", docs/operations.md).

How a packet gets here: our base chains mark it (:func:`nftpolicy.translators.layout.unknown_pod_rules`:
the unknown mark of each direction whose address is unknown) and accept it undecided; a chain
of our own, ``NFTPOLICY-POD-HOLD`` in iptables-nft's ``security`` table (priority 150, after
ours), jumped to first from ``INPUT``, ``FORWARD`` and ``OUTPUT``, queues every packet with
either mark to queue ``queue``: xt ``NFQUEUE`` through nft's compat layer, the path the DNS
hold takes for the same reason (:mod:`.dnshold`: nft's own ``queue`` needs CONFIG_NFT_QUEUE).
Without ``--queue-bypass``: while no agent reads the queue (down, restarting) the kernel drops
what it would queue. A packet released here gets the verdict ``repeat`` with its unknown marks
cleared and the released mark set: the ``security`` chain is walked again (nothing is queued
twice, no rule of it is skipped), and our released chains
(:func:`nftpolicy.translators.layout.released_chains`, priority 160) dispatch it to the pod
chains as they are now. A packet that reaches them still marked unknown was not queued (the
hold chain is missing): they drop it.

Which address a held packet waits for is read from its marks (ingress: the destination,
egress: the source), never guessed from its addresses: the node's own address in a pod CIDR
(a bridge's gateway) is no pod, and our rules never mark it.

What one address or source can take of the kernel's queue (1,024 packets, each held up to
``hold_seconds``) is bounded twice: our table lets each source address send at most its budget
towards the queue (:func:`nftpolicy.translators.layout.to_hold_chain`: a meter, the rest dropped
and counted in the kernel), and here a packet that finds ``max_held`` packets of its direction
already waiting for one of the addresses it waits for is dropped at once (counted:
``over_limit``), so the packets for one unknown address, from however many sources, cannot fill
the queue either. Per direction: packets sent to a new pod's address (which a scanner may
guess) never use up the room of the pod's own first packets.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from nftpolicy.agent.dataplane import netns
from nftpolicy.translators.model import Direction
from nftpolicy.translators.rules import Config

from .dnshold import NF_DROP, NF_REPEAT, TOOLS, NfQueue, QueuedPacket, remove_chain, run_xt
from .metrics import Metrics

log = logging.getLogger("nftpolicy.podhold")

HOLD_CHAIN = "NFTPOLICY-POD-HOLD"
HOLD_TABLE = "security"  # iptables-nft's, after our table (see the module docstring)
HOOKS = ("INPUT", "FORWARD", "OUTPUT")
COPY_RANGE = 40  # bytes copied of each queued packet: an IPv6 header, an IPv4 one with its addresses
DROP_LOG_SECONDS = 10.0  # at most one log line about dropped held packets this often
DEFAULT_MAX_HELD = 32  # packets waiting for one unknown address at most (--unknown-pod-max-held)


def hold_rules(queue: int, marks: tuple[int, ...]) -> list[list[str]]:
    """The ``iptables``/``ip6tables`` argument lists that make the hold chain (one rule per mark:
    a packet with it goes to ``queue``, no bypass) and jump to it first from each of
    :data:`HOOKS`."""
    target = ["-j", "NFQUEUE", "--queue-num", str(queue)]
    return [["-N", HOLD_CHAIN],
            *(["-A", HOLD_CHAIN, "-m", "mark", "--mark", f"{mark:#x}/{mark:#x}", *target] for mark in marks),
            *(["-I", hook, "1", "-j", HOLD_CHAIN] for hook in HOOKS)]


def remove_pod_hold_chain(netns_name: str | None) -> bool:
    """Remove the hold chain and its jumps from iptables-nft in ``netns_name`` (None: this
    process's) where it is; True when it was somewhere."""
    return remove_chain(netns_name, HOLD_CHAIN, [[hook] for hook in HOOKS], (HOLD_TABLE,))


def addresses(packet: bytes) -> tuple[str, str] | None:
    """(source, destination) of an IPv4 or IPv6 packet, or None when it is neither or cut short."""
    try:
        if packet[0] >> 4 == 4:
            return str(ipaddress.IPv4Address(packet[12:16])), str(ipaddress.IPv4Address(packet[16:20]))
        if packet[0] >> 4 == 6:
            return str(ipaddress.IPv6Address(packet[8:24])), str(ipaddress.IPv6Address(packet[24:40]))
    except (IndexError, ipaddress.AddressValueError):
        return None
    return None


@dataclass(frozen=True)
class Held:
    """A queued packet waiting for ``waits`` (direction -> the unknown pod's address) to be
    programmed, since ``since`` (the hold's clock, seconds)."""

    queued: QueuedPacket
    waits: dict[Direction, str]
    since: float


class PodHold:
    """Holds the packets of unknown pods in network namespace ``netns_name`` (None: the agent's
    own) on nfqueue ``queue``, releasing each once :meth:`programmed` says the addresses it
    waits for are in the kernel, dropping it after ``hold_seconds``. ``config``: the marks.
    ``clock``: monotonic seconds (tests give their own). :meth:`start` binds the queue, starts
    the reader and installs the hold chain; :meth:`close` stops. ``max_held``: packets that may
    wait for one address at once (module docstring)."""

    def __init__(self, config: Config, queue: int, hold_seconds: float, metrics: Metrics, *, netns_name: str | None,
                 clock: Callable[[], float] = time.monotonic, max_held: int = DEFAULT_MAX_HELD) -> None:
        self.marks, self.released_mark = config.unknown_marks(), config.released_mark
        self.queue_num, self.hold_seconds, self.metrics, self.netns, self.clock = queue, hold_seconds, metrics, netns_name, clock
        self.max_held = max_held
        self.known: frozenset[str] = frozenset()  # the addresses of the pods the kernel has programmed
        self.waiting: list[Held] = []
        self.waiting_for: Counter[tuple[Direction, str]] = Counter()  # (direction, address) -> packets of self.waiting waiting for it
        self.lock = threading.Lock()  # the known addresses, the waiting packets and the verdicts
        self._queue: NfQueue | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._logged_at = float("-inf")  # when a drop was last logged (clock)
        self._dropped_since = 0  # drops not logged since

    def start(self) -> None:
        """Bind the queue (before the chain: no packet waits for a reader), start the reader,
        then make the chain anew (an earlier agent's is removed first). Raises OSError when the
        queue cannot be bound and IptablesError when the chain cannot be made (what was made of
        it is removed again): then our released chains drop what the base chains mark."""
        with netns.entered(self.netns) if self.netns is not None else contextlib.nullcontext():
            self._queue = NfQueue(self.queue_num, copy_range=COPY_RANGE)
        self._thread = threading.Thread(target=self._run, name="pod-hold", daemon=True)
        self._thread.start()
        remove_pod_hold_chain(self.netns)
        try:
            for argv in hold_rules(self.queue_num, tuple(self.marks.values())):
                for tool in TOOLS:
                    run_xt(self.netns, [tool, "-w", "-t", HOLD_TABLE, *argv])
        except Exception:
            remove_pod_hold_chain(self.netns)
            raise

    def programmed(self, known: frozenset[str]) -> None:
        """The addresses of the local pods of the model the kernel now holds (after each
        committed sync): release every waiting packet whose addresses are all among them."""
        with self.lock:
            self.known = known
            still = []
            for held in self.waiting:
                if all(address in known for address in held.waits.values()):
                    self._release(held)
                    self._forget(held)
                else:
                    still.append(held)
            self.waiting = still

    def _run(self) -> None:
        assert self._queue is not None
        while not self._stopping.is_set():
            for queued in self._queue.packets():
                self.take(queued)
            self.expire()

    def take(self, queued: QueuedPacket) -> None:
        """A packet the kernel queued: released at once when what it waits for is programmed
        already (its pod's commit came between the kernel's look-up and this), dropped at once
        when an address it waits for has :attr:`max_held` packets of that direction waiting
        (``over_limit``), else held."""
        pair = addresses(queued.packet)
        waits: dict[Direction, str] = {}
        if pair is not None:
            waits = {direction: pair[0] if direction == "egress" else pair[1] for direction, mark in self.marks.items() if queued.mark & mark}
        held = Held(queued, waits, self.clock())
        with self.lock:
            for direction in waits:
                self.metrics.unknown_pod_packets.labels(direction, "held").inc()
            if waits and all(address in self.known for address in waits.values()):
                self._release(held)
            elif not waits:  # no mark of ours, or not IP: nothing to wait for
                self._verdict(held, NF_DROP)
            elif any(self.waiting_for[wait] >= self.max_held for wait in waits.items()):
                self._verdict(held, NF_DROP)
                for direction in waits:
                    self.metrics.unknown_pod_packets.labels(direction, "over_limit").inc()
            else:
                self.waiting.append(held)
                self.waiting_for.update(waits.items())

    def expire(self) -> None:
        """Drop the packets held for ``hold_seconds`` or longer: counted, and logged naming the
        address at most every :data:`DROP_LOG_SECONDS` (with how many were dropped since)."""
        now = self.clock()
        with self.lock:
            due = [h for h in self.waiting if now - h.since >= self.hold_seconds]
            if not due:
                return
            self.waiting = [h for h in self.waiting if now - h.since < self.hold_seconds]
            for held in due:
                self._verdict(held, NF_DROP)
                self._forget(held)
                for direction in held.waits:
                    self.metrics.unknown_pod_packets.labels(direction, "dropped").inc()
            self._dropped_since += len(due)
            if now - self._logged_at >= DROP_LOG_SECONDS:
                last = due[-1]
                what = ", ".join(f"{direction} of {address}" for direction, address in last.waits.items())
                log.warning("dropped %d held %s of unknown pods after %.1f s: %s is no pod programmed on this node",
                            self._dropped_since, "packet" if self._dropped_since == 1 else "packets", self.hold_seconds, what,
                            extra={"address": ", ".join(last.waits.values())})
                self._logged_at, self._dropped_since = now, 0

    def _release(self, held: Held) -> None:
        """Walk ``held`` through the rules again (repeat), its unknown marks cleared and the
        released mark set (under :attr:`lock`)."""
        mark = held.queued.mark & ~sum(self.marks.values()) | self.released_mark
        for direction in held.waits:  # counted before the verdict: a scrape after the packet's answer sees it
            self.metrics.unknown_pod_packets.labels(direction, "released").inc()
        self.metrics.unknown_pod_hold_seconds.observe(self.clock() - held.since)
        self._verdict(held, NF_REPEAT, mark)

    def _forget(self, held: Held) -> None:
        """``held`` waits no more (under :attr:`lock`)."""
        for wait in held.waits.items():
            self.waiting_for[wait] -= 1
            if not self.waiting_for[wait]:
                del self.waiting_for[wait]

    def _verdict(self, held: Held, verdict: int, mark: int | None = None) -> None:
        if self._queue is not None:
            self._queue.verdict(held.queued.id, verdict, mark)

    def close(self, remove_chain: bool = True) -> None:
        """Stop reading and close the queue (what waits is dropped by the kernel); with
        ``remove_chain`` remove the hold chain first (without: it stays, and the kernel drops
        what it would queue while no agent reads it, which is what a restart leaves)."""
        if remove_chain:
            remove_pod_hold_chain(self.netns)
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        if self._queue is not None:
            self._queue.close()
