"""What the DNS answers to the subject pods of a domainNames peer teach: the addresses of its
names, each until its record expires (docs/domain-names.md).

:class:`DomainLearner` reads one DNS message (the payload of a UDP or TCP segment from port 53
to a pod) with dnspython, follows the CNAME chain from the question to the A and AAAA records
at its end, and for each domain set (:class:`~nftpolicy.translators.domainnames.DomainSet`)
whose clients include the pod and one of whose names the question matches, gives the
addresses of the set's family with a timeout: the chain's smallest TTL, raised to ``ttl_floor``
and cut to ``ttl_cap`` seconds. It keeps what it gave until then (the address, the name that
allowed it, when it expires), which the agent commits
(:func:`~nftpolicy.translators.nft.timed_elements_json`) and
re-commits after a full replace of the table; ``explain`` and ``trace`` read it to say which
name allowed an address.

What an answer costs is bounded before it is read: an answer to a pod that no domain set has
as a client is not read at all; of any other only the question is read first (dnspython's
``question_only``), and the records only when the question's name matches a set of that pod's;
then at most ``max_records`` answer records are read (the header's counts are cut to them, the
authority and additional sections are not read). A TCP segment of many messages costs one
question read for each message that asks for no name of the pod's sets.

Deliberate choices (each counted in ``nftpolicy_dns_answers_total`` by its ``result``):

* a message that is not DNS, a query rather than a response, or that dnspython cannot read
  (truncated mid-record, bad compression pointers): ``malformed``, never an exception;
* an answer with the TC bit (truncated: the resolver asks again over TCP): its records are
  still learned (they are true, only not all of them), the full answer comes by TCP;
* DNS over TCP: a segment holds a two-byte length and then the message; a segment without
  data (the server's SYN-ACK, ACKs, FIN) is no message and counts nothing; only a segment that
  carries whole messages is read (a message split over segments is ``malformed``, as the
  resolver's UDP answer usually came first);
* an answer to a pod that no domain set has as a client (one count for a whole TCP segment,
  which is not read), or for a name no set matches (a name with a label that holds a dot or
  another byte its text escapes matches none): ``ignored`` (nobody asked for it under a
  policy: nothing is learned);
* an answer with more than ``max_records`` answer records: ``capped`` (its first
  ``max_records`` are learned from, the rest are not read);
* an error response (NXDOMAIN, SERVFAIL) or one without A/AAAA records: ``empty``;
* a set that holds ``max_per_set`` live addresses, or a pod that gave ``max_per_pod``:
  the new address is ``dropped`` (the pod's connection to it is refused until older ones
  expire), so one pod cannot grow the agent's memory without bound.
"""

from __future__ import annotations

import heapq
import math
import socket
import struct
from dataclasses import dataclass
from typing import Iterable, Union

import dns.exception
import dns.name
import dns.rdatatype

from nftpolicy.translators.domainnames import DomainSet
from nftpolicy.translators.model import Family

RESULTS = ("learned", "dropped", "ignored", "empty", "malformed", "capped")
DEFAULT_MAX_RECORDS = 100  # answer records read of one message (--dns-max-records)
_TYPES: dict[int, Family] = {dns.rdatatype.A: "ipv4", dns.rdatatype.AAAA: "ipv6"}
_ADDRESS_BYTES: dict[int, int] = {dns.rdatatype.A: 4, dns.rdatatype.AAAA: 16}
QR = 0x80  # the response bit, in the header's third byte (RFC 1035 4.1.1)
ADOPTED = "(before this agent)"  # the name of an address an earlier agent learned
MAX_QUESTIONS = 4096  # questions remembered (then forgotten at once)
MAX_CHAIN = 16  # CNAME links followed from the question (a loop ends there)
# A held address is committed again only when an answer moves its expiry later by more than this
# (seconds): the element then ends at most this long before the answer's TTL, whose own unit is
# the second, and a TCP stream's segments (or a resolver asked again and again) that repeat an
# answer a few milliseconds apart do not commit every element again.
REFRESH_SECONDS = 1.0


@dataclass(frozen=True)
class Learned:
    """An address to put in set ``set_name`` for ``timeout`` seconds, because DNS name
    ``name`` (which pattern ``pattern`` of the set matches) resolved to it for pod ``client``."""

    set_name: str
    address: str
    timeout: int
    name: str
    pattern: str
    client: str


@dataclass
class _Entry:
    expires: float
    name: str
    pattern: str
    client: str


class DomainLearner:
    """The learned addresses of every domain set of one node, bounded (module docstring).

    ``ttl_floor``/``ttl_cap``: seconds; ``max_per_set``/``max_per_pod``: live addresses;
    ``max_records``: answer records read of one message. The caller gives the time (``now``,
    monotonic seconds) and serialises calls (not thread-safe). :attr:`decoded` counts the
    messages whose records were read (the others cost at most their question).
    """

    def __init__(self, ttl_floor: int, ttl_cap: int, max_per_set: int, max_per_pod: int,
                 max_records: int = DEFAULT_MAX_RECORDS) -> None:
        if not 1 <= ttl_floor <= ttl_cap:
            raise ValueError(f"the TTL floor ({ttl_floor}) must be at least 1 and at most the cap ({ttl_cap})")
        if max_records < 1:
            raise ValueError(f"the records read of one answer ({max_records}) must be at least 1")
        self.ttl_floor, self.ttl_cap, self.max_per_set, self.max_per_pod = ttl_floor, ttl_cap, max_per_set, max_per_pod
        self.max_records = max_records
        self.decoded = 0
        self._size = 0  # live entries
        # the questions read lately: (the client's sets, the question's wire name) -> its name,
        # text and matches (a segment of many messages for one name reads it once)
        self._questions: dict[tuple[int, bytes], tuple[dns.name.Name, str, list[tuple[DomainSet, str]]]] = {}
        self._expiry: list[tuple[float, str, str]] = []  # (expires, set name, address), a heap; stale items skipped
        self._sets: dict[str, DomainSet] = {}
        self._by_client: dict[str, list[DomainSet]] = {}
        self._held: dict[str, dict[str, _Entry]] = {}  # set name -> address -> entry
        self._per_pod: dict[str, int] = {}
        self.counts: dict[str, int] = dict.fromkeys(RESULTS, 0)

    def update(self, sets: Iterable[DomainSet]) -> None:
        """The domain sets now rendered: those gone forget what they held; the others keep it."""
        self._sets = {s.name: s for s in sets}
        self._by_client, self._questions = {}, {}
        for s in self._sets.values():
            for client in s.clients:
                self._by_client.setdefault(client, []).append(s)
        for name in [n for n in self._held if n not in self._sets]:
            for entry in self._held.pop(name).values():
                self._forget(entry)

    def has_set(self, name: str) -> bool:
        """Whether domain set ``name`` is one of those rendered (:meth:`update`)."""
        return name in self._sets

    def learn(self, client: str, payload: bytes, now: float, tcp: bool = False) -> list[Learned]:
        """What the DNS message ``payload`` (a UDP payload, or with ``tcp`` a TCP segment's:
        length-prefixed messages) sent to pod address ``client`` teaches at time ``now``: the
        addresses to add (new ones, and known ones whose expiry moves later). Never raises on
        bad input: it is counted (:attr:`counts`)."""
        self.expire(now)
        if tcp and not payload:  # the server's SYN-ACK, ACKs, FIN: no message at all
            return []
        sets = self._by_client.get(client)
        if not sets:  # nobody asked under a policy: not read at all
            self.counts["ignored"] += 1
            return []
        messages = _tcp_messages(payload) if tcp else [payload]
        if messages is None:
            self.counts["malformed"] += 1
            return []
        found: list[Learned] = []
        for wire in messages:
            found.extend(self._message(client, wire, sets, now))
        return found

    def _message(self, client: str, wire: bytes, sets: list[DomainSet], now: float) -> list[Learned]:
        """What one DNS message teaches: its question first, its records only when the question
        matches one of ``sets`` (at most :attr:`max_records` of them)."""
        try:
            if len(wire) < 12 or not wire[2] & QR or int.from_bytes(wire[4:6], "big") != 1:
                raise ValueError("not a response to one question")
            used = _name_length(wire, 12)
            key = (id(sets), wire[12:12 + used])
            if (known := self._questions.get(key)) is None:
                question = dns.name.from_wire(wire, 12)[0]
                asked = question.to_text(omit_final_dot=True).lower()
                # a label with a dot in it is escaped ('x\\.cdn.example': one label under 'example'),
                # which a pattern's text would match as labels ('*.cdn.example'): no API name has one
                matched = [] if "\\" in asked else [(s, p) for s in sets for p in (s.matches(asked),) if p is not None]
                if len(self._questions) >= MAX_QUESTIONS:
                    self._questions.clear()
                known = self._questions[key] = (question, asked, matched)
        except (dns.exception.DNSException, ValueError, IndexError):
            self.counts["malformed"] += 1
            return []
        question, asked, matched = known
        if not matched:
            self.counts["ignored"] += 1
            return []
        count = int.from_bytes(wire[6:8], "big")
        if count > self.max_records:
            self.counts["capped"] += 1
        try:  # the answer section's first max_records (the authority and additional sections unread)
            records = _answer_records(wire, 12 + used + 4, min(count, self.max_records), question)
        except (dns.exception.DNSException, ValueError, IndexError, struct.error):
            self.counts["malformed"] += 1
            return []
        self.decoded += 1
        addresses = _chain_addresses(records, question)
        if not addresses:
            self.counts["empty"] += 1
            return []
        found = []
        for domain_set, pattern in matched:
            held = self._held.setdefault(domain_set.name, {})
            for family, address, ttl in addresses:
                if family != domain_set.family:
                    continue
                timeout = min(max(ttl, self.ttl_floor), self.ttl_cap)
                entry = held.get(address)
                if entry is not None and now + timeout <= entry.expires + REFRESH_SECONDS:
                    continue  # the kernel's element outlives this answer already, or ends within a second of it
                learned = self._hold(held, entry, Learned(domain_set.name, address, timeout, asked, pattern, client), now)
                if learned is not None:
                    found.append(learned)
        return found

    def _hold(self, held: dict[str, _Entry], entry: _Entry | None, learned: Learned, now: float) -> Learned | None:
        """Hold ``learned`` in its set's entries ``held`` (``entry``: its address's there, which
        the answer outlasts): renewed, new, or ``dropped`` over a bound (None)."""
        set_name = learned.set_name
        expires = now + learned.timeout
        if entry is not None:
            entry.expires, entry.name, entry.pattern = expires, learned.name, learned.pattern
            self._expires_at(expires, set_name, learned.address)
            self.counts["learned"] += 1
            return learned
        if len(held) >= self.max_per_set or self._per_pod.get(learned.client, 0) >= self.max_per_pod:
            self.counts["dropped"] += 1
            return None
        held[learned.address] = _Entry(expires, learned.name, learned.pattern, learned.client)
        self._expires_at(expires, set_name, learned.address)
        self._size += 1
        self._per_pod[learned.client] = self._per_pod.get(learned.client, 0) + 1
        self.counts["learned"] += 1
        return learned

    def adopt(self, set_name: str, address: str, seconds_left: int, now: float) -> None:
        """Hold an address that the kernel's set has (an earlier agent learned it) for the
        seconds it has left, so that this agent's full replace keeps it; it counts against no
        pod and names no DNS name (``(before this agent)``)."""
        if seconds_left > 0:
            self._held.setdefault(set_name, {})[address] = _Entry(now + seconds_left, ADOPTED, ADOPTED, "")
            self._expires_at(now + seconds_left, set_name, address)
            self._size += 1
            self._per_pod[""] = self._per_pod.get("", 0) + 1

    def _expires_at(self, expires: float, set_name: str, address: str) -> None:
        """Note when an entry expires; the heap is rebuilt from the live entries when stale
        items (entries whose expiry moved later, sets gone) outnumber them."""
        heapq.heappush(self._expiry, (expires, set_name, address))
        if len(self._expiry) > 2 * self.size() + 1024:
            self._expiry = [(e.expires, name, a) for name, held in self._held.items() for a, e in held.items()]
            heapq.heapify(self._expiry)

    def expire(self, now: float) -> None:
        """Forget what expired by ``now`` (the kernel's elements time out by themselves): the
        entries at the head of the expiry heap, O(log n) each."""
        while self._expiry and self._expiry[0][0] <= now:
            expires, set_name, address = heapq.heappop(self._expiry)
            held = self._held.get(set_name, {})
            entry = held.get(address)
            if entry is not None and entry.expires == expires:
                self._forget(held.pop(address))

    def _forget(self, entry: _Entry) -> None:
        self._size -= 1
        left = self._per_pod[entry.client] - 1
        if left:
            self._per_pod[entry.client] = left
        else:
            del self._per_pod[entry.client]

    def held(self, now: float) -> list[Learned]:
        """Every live address with the timeout left (whole seconds, rounded up: the element a
        full replace adds again must not end before this learner's copy, which skips answers
        that end no later): what a full replace of the table must add again."""
        return [Learned(set_name, address, math.ceil(entry.expires - now), entry.name, entry.pattern, entry.client)
                for set_name, held in self._held.items() for address, entry in held.items() if entry.expires > now]

    def why(self, address: str, now: float) -> list[tuple[str, str, str]]:
        """``(set name, DNS name, pattern)`` of each live learned ``address``: which name
        allowed it (for ``explain`` and ``trace``)."""
        found = []
        for set_name, held in self._held.items():
            entry = held.get(address)
            if entry is not None and entry.expires > now:
                found.append((set_name, entry.name, entry.pattern))
        return found

    def size(self) -> int:
        """How many addresses are held."""
        return self._size


def _name_length(wire: bytes, offset: int) -> int:
    """The length of the uncompressed name at ``offset`` (a question's: RFC 1035 4.1.2; a
    compression pointer there is refused, ValueError; cut short, IndexError)."""
    at = offset
    while wire[at]:
        if wire[at] & 0xC0:
            raise ValueError("a compression pointer in the question")
        at += wire[at] + 1
    return at + 1 - offset


def _tcp_messages(segment: bytes) -> list[bytes] | None:
    """The DNS messages of a TCP segment (RFC 1035 4.2.2: each after its two-byte length), or
    None when the segment does not end at a message's end."""
    messages, offset = [], 0
    while offset < len(segment):
        if offset + 2 > len(segment):
            return None
        length = int.from_bytes(segment[offset:offset + 2], "big")
        offset += 2
        if length == 0 or offset + length > len(segment):
            return None
        messages.append(segment[offset:offset + length])
        offset += length
    return messages or None


Record = tuple[dns.name.Name, int, int, Union[str, dns.name.Name, None]]  # owner, type, TTL, address or CNAME target


def _answer_records(wire: bytes, offset: int, count: int, question: dns.name.Name) -> list[Record]:
    """The first ``count`` records of the answer section of message ``wire``, which starts at
    ``offset`` (RFC 1035 4.1.3: owner, type, class, TTL, data length, data): ``(owner, type, ttl,
    data)``, data an A or AAAA record's address, a CNAME's target, None for other types. Names
    are read by dnspython (an owner name that is a compression pointer once for each pointer; a
    pointer to the question's name, at offset 12, is ``question`` itself, the name
    :func:`_chain_addresses` compares first);
    the rest is read here: dnspython's whole-message decode costs about 25 us a record (a
    250-record answer cut to 100: 2.9 ms of CPU against 0.35 ms here).
    Raises DNSException (a bad name), ValueError (an address of the wrong length), IndexError or
    struct.error (cut short)."""
    found: list[Record] = []
    pointed: dict[int, dns.name.Name] = {0xC000 | 12: question}  # the owner names that compression pointers name, by pointer
    for _ in range(count):
        if wire[offset] & 0xC0 == 0xC0:  # a pointer (nearly every owner: to the question's name)
            pointer = int.from_bytes(wire[offset:offset + 2], "big")
            if pointer not in pointed:
                pointed[pointer] = dns.name.from_wire(wire, offset)[0]
            owner, used = pointed[pointer], 2
        else:
            owner, used = dns.name.from_wire(wire, offset)
        rdtype, _, ttl, length = struct.unpack_from(">HHIH", wire, offset + used)
        start = offset + used + 10
        if start + length > len(wire):
            raise IndexError("a record's data is cut short")
        data: str | dns.name.Name | None = None
        if rdtype in _TYPES:
            if length != _ADDRESS_BYTES[rdtype]:
                raise ValueError("an address of the wrong length")
            data = socket.inet_ntop(socket.AF_INET if rdtype == dns.rdatatype.A else socket.AF_INET6, wire[start:start + length])
        elif rdtype == dns.rdatatype.CNAME:
            data = dns.name.from_wire(wire, start)[0]
        found.append((owner, rdtype, ttl, data))
        offset = start + length
    return found


def _chain_addresses(records: list[Record], question: dns.name.Name) -> list[tuple[Family, str, int]]:
    """``(family, address, ttl)`` of the A/AAAA ``records`` for ``question``, following its
    CNAME chain; the TTL is the smallest along the chain (a CNAME that expires first ends the
    addresses' validity too)."""
    found: list[tuple[Family, str, int]] = []
    owner, chain_ttl = question, None
    for _ in range(MAX_CHAIN):
        step = None
        for name, rdtype, record_ttl, data in records:
            if name is not owner and name != owner:  # the same object: nearly every owner, a pointer to the question
                continue
            family = _TYPES.get(rdtype)
            ttl = record_ttl if chain_ttl is None else min(record_ttl, chain_ttl)
            if family is not None and isinstance(data, str):
                found.append((family, data, ttl))
            elif rdtype == dns.rdatatype.CNAME and isinstance(data, dns.name.Name):
                step = (data, ttl)
        if found or step is None:
            return found
        owner, chain_ttl = step
    return found
