"""Set and map elements committed straight through nf_tables' netlink interface, without
libnftables: what an incremental sync's element-only transactions need, and nothing more.

Why: before every command libnftables 1.0.6 builds a cache of the kernel's ruleset, and for an
``add element`` or ``delete element`` (src/cache.c, ``evaluate_cache_add``: ``NFT_CACHE_TABLE |
CHAIN | SET | OBJECT | SETELEM_MAYBE``) that is a dump of every table, chain, set, stateful
object and flowtable of the network namespace, of every table (the dumps carry no table
filter), plus every element of each interval set. Each of our commits moves the ruleset's
generation, so a kept context fetches it all again at the next one. Measured (bench/
namespace_change.py's changes, 10k pods): about half of a small commit's CPU, 1.2 ms; with another
table of 5,000 chains in the namespace (kube-proxy's iptables-nft tables on a real node),
6.5 ms. Here an element-only commit costs its elements, whatever else the namespace holds.

One batch (``NFNL_MSG_BATCH_BEGIN``, one ``NFT_MSG_DELSETELEM`` / ``NFT_MSG_NEWSETELEM`` per set
and at most :data:`MAX_ELEMENTS_BYTES` of elements, ``NFNL_MSG_BATCH_END``) is one kernel
transaction, as a libnftables batch is: all of it or nothing. Every element message asks for an
acknowledgement; the kernel answers each one once the batch is done, with 0 or the errno that
aborted it. The encoding is the kernel's uapi (linux/netlink.h, linux/netfilter/nfnetlink.h,
linux/netfilter/nf_tables.h): a key is the address (4 or 16 bytes, network order), or for a
concatenation each field in turn padded to 4 bytes (``inet_proto`` 1 byte, ``inet_service`` 2
bytes big-endian); a verdict map element's data is a ``jump`` to its chain; a timed element
(a domain set's, :class:`~nftpolicy.translators.rules.TimedAddress`) carries its timeout
(``NFTA_SET_ELEM_TIMEOUT``, milliseconds, 64 bits big-endian). Only sets whose every element is
one key take this path (:data:`KEYED_KINDS`, and the DNS hold's timed elements); interval sets
(an element is a range: a start and an end element) go through libnftables.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from typing import Any, Callable, Iterable, Sequence

from nftpolicy.translators.layout import MapElement
from nftpolicy.translators.rules import TimedAddress

from . import DataplaneError

NETLINK_NETFILTER = 12
SOL_NETLINK, NETLINK_CAP_ACK = 270, 10  # errors come back without a copy of the refused message
NLM_F_REQUEST, NLM_F_ACK, NLM_F_CREATE = 0x1, 0x4, 0x400
NLMSG_ERROR = 2
NLA_F_NESTED = 0x8000
NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END = 16, 17
NFT_MSG_NEWSETELEM, NFT_MSG_DELSETELEM = 12, 14
NFPROTO_INET = 1
NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET, NFTA_SET_ELEM_LIST_ELEMENTS = 1, 2, 3
NFTA_LIST_ELEM = 1
NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_DATA, NFTA_SET_ELEM_TIMEOUT = 1, 2, 4
NFTA_DATA_VALUE, NFTA_DATA_VERDICT = 1, 2
NFTA_VERDICT_CODE, NFTA_VERDICT_CHAIN = 1, 2
NFT_JUMP = -3
PROTOCOLS = {"tcp": 6, "udp": 17, "sctp": 132}  # inet_proto: IANA protocol numbers
KEYED_KINDS = {"addr", "named_port", "map"}  # our set kinds (AddressSet.kind, and verdict maps) whose elements are keys
# A netlink attribute's length is 16 bits: the elements of one message stay below that.
MAX_ELEMENTS_BYTES = 60000
ACK_TIMEOUT = 30.0  # seconds for the kernel's answers to one batch


class NetlinkError(DataplaneError):
    """The kernel refused a batch of elements (nothing of it was committed); the message names
    the verb, the set and the errno."""


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _nested(kind: int, payload: bytes) -> bytes:
    return _attr(kind | NLA_F_NESTED, payload)


def _address(text: str) -> bytes:
    return socket.inet_pton(socket.AF_INET6 if ":" in text else socket.AF_INET, text)


def key(element: Any) -> bytes:
    """The set key of one element: an address (``str``), an ``(address, protocol, port)``
    triple (``address . inet_proto . inet_service``), or a :class:`MapElement`'s or
    :class:`TimedAddress`'s address."""
    if isinstance(element, str):
        return _address(element)
    if isinstance(element, (MapElement, TimedAddress)):
        return _address(element.address)
    address, protocol, port = element
    return _address(address) + struct.pack("=B3x", PROTOCOLS[protocol]) + struct.pack(">H2x", port)


def element(value: Any) -> bytes:
    """One ``NFTA_LIST_ELEM``: the key, for a :class:`MapElement` its ``jump`` verdict, for a
    :class:`TimedAddress` its timeout."""
    body = _nested(NFTA_SET_ELEM_KEY, _attr(NFTA_DATA_VALUE, key(value)))
    if isinstance(value, TimedAddress):
        body += _attr(NFTA_SET_ELEM_TIMEOUT, struct.pack(">Q", value.timeout * 1000))
    if isinstance(value, MapElement):
        verdict = _attr(NFTA_VERDICT_CODE, struct.pack(">i", NFT_JUMP)) + _attr(NFTA_VERDICT_CHAIN, value.chain.encode() + b"\0")
        body += _nested(NFTA_SET_ELEM_DATA, _nested(NFTA_DATA_VERDICT, verdict))
    return _nested(NFTA_LIST_ELEM, body)


def _message(kind: int, flags: int, seq: int, family: int, body: bytes, res_id: int = 0) -> bytes:
    payload = struct.pack("=BB", family, 0) + struct.pack(">H", res_id) + body  # nfgenmsg, then attributes
    return struct.pack("=IHHII", 16 + len(payload), kind, flags, seq, 0) + payload


def batch(table: str, changes: Sequence[tuple[str, str, Iterable[Any]]], seq: int) -> tuple[bytes, list[tuple[int, str, str]]]:
    """The netlink batch of ``changes`` (``(verb, set, elements)``, verb ``add`` or ``delete``,
    in order) on ``inet <table>``, sequence numbers from ``seq``; and the messages that answer
    (``(seq, verb, set)``)."""
    head = _attr(NFTA_SET_ELEM_LIST_TABLE, table.encode() + b"\0")
    messages = [_message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq, socket.AF_UNSPEC, b"", NFNL_SUBSYS_NFTABLES)]
    acked: list[tuple[int, str, str]] = []

    def flush(verb: str, name: str, parts: list[bytes]) -> None:
        nonlocal seq
        seq += 1
        kind, flags = ((NFT_MSG_NEWSETELEM, NLM_F_CREATE) if verb == "add" else (NFT_MSG_DELSETELEM, 0))
        body = head + _attr(NFTA_SET_ELEM_LIST_SET, name.encode() + b"\0") + _nested(NFTA_SET_ELEM_LIST_ELEMENTS, b"".join(parts))
        messages.append(_message(NFNL_SUBSYS_NFTABLES << 8 | kind, NLM_F_REQUEST | NLM_F_ACK | flags, seq, NFPROTO_INET, body))
        acked.append((seq, verb, name))

    for verb, name, elements in changes:
        parts: list[bytes] = []
        size = 0
        for value in elements:
            encoded = element(value)
            if size + len(encoded) > MAX_ELEMENTS_BYTES:
                flush(verb, name, parts)
                parts, size = [], 0
            parts.append(encoded)
            size += len(encoded)
        if parts:
            flush(verb, name, parts)
    messages.append(_message(NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq + 1, socket.AF_UNSPEC, b"", NFNL_SUBSYS_NFTABLES))
    return b"".join(messages), acked


class ElementSocket:
    """A netfilter netlink socket kept for element batches (made at the first :meth:`commit`
    inside ``entered()``, the namespace, where it stays), one batch at a time (a lock); dropped
    after a refusal or a failure, so the next batch gets a fresh one."""

    def __init__(self, entered: Callable[[], Any]) -> None:
        self._entered, self._lock = entered, threading.Lock()
        self._socket: socket.socket | None = None
        self._seq = 0

    def __repr__(self) -> str:
        return f"ElementSocket({'open' if self._socket is not None else 'not open'})"

    def commit(self, table: str, changes: Sequence[tuple[str, str, Iterable[Any]]]) -> None:
        """Commit ``changes`` (see :func:`batch`) as one kernel transaction; raises NetlinkError
        (nothing committed) naming the first refused message's verb, set and errno, or the
        socket's error (an answer not in :data:`ACK_TIMEOUT` seconds: whether the kernel took
        the batch is then unknown, and the caller's next full sync settles it)."""
        with self._lock:
            try:
                self._commit(table, changes)
            except BaseException as exc:
                if self._socket is not None:
                    self._socket.close()
                    self._socket = None
                if isinstance(exc, OSError):  # the socket failed or the kernel did not answer in ACK_TIMEOUT
                    raise NetlinkError(f"element batch on inet {table}: {exc}") from None
                raise

    def _commit(self, table: str, changes: Sequence[tuple[str, str, Iterable[Any]]]) -> None:
        if self._socket is None:
            with self._entered():
                sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
            sock.bind((0, 0))
            sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
            sock.settimeout(ACK_TIMEOUT)
            self._socket = sock
        data, acked = batch(table, changes, self._seq)
        self._seq = (self._seq + len(acked) + 2) & 0x7FFFFFFF
        if not acked:
            return
        if len(data) > self._socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2:  # the kernel doubles what is set
            self._socket.setsockopt(socket.SOL_SOCKET, 32, len(data) * 2)  # SO_SNDBUFFORCE (CAP_NET_ADMIN): one batch, one send
        self._socket.send(data)
        pending = {seq: (verb, name) for seq, verb, name in acked}
        refused: tuple[int, str, str] | None = None
        while pending:
            reply = self._socket.recv(1 << 16)
            offset = 0
            while offset + 16 <= len(reply):
                length, kind, _, seq, _ = struct.unpack_from("=IHHII", reply, offset)
                if kind == NLMSG_ERROR and seq in pending:
                    (error,) = struct.unpack_from("=i", reply, offset + 16)
                    verb, name = pending.pop(seq)
                    if error and refused is None:
                        refused = (-error, verb, name)
                offset += (length + 3) & ~3 if length else len(reply)
        if refused is not None:
            errno, verb, name = refused
            raise NetlinkError(f"{verb} element in set {name} of inet {table}: {os.strerror(errno)} (nothing committed)")
