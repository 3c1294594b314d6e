"""The table walk: what our table does with the first packet of a connection, without a kernel.

Pure: a :class:`~nftpolicy.translators.layout.Table` (the chains and rules in the order the kernel
evaluates them, the verdict maps, the sets) and a :class:`Connection` in, a :class:`Walk` out. It
interprets the layout's statements as nft does: matches in order (the first that fails ends the
rule), marks changed under masks, set and verdict-map look-ups, jumps that come back unless the
chain decides, ``return``, ``accept``, ``drop`` and ``reject``. A base chain that ends without a
verdict lets the packet through (its policy is accept).

The walk records every rule it evaluates (:class:`Step`: which chain, which rule, whether all its
matches held) and the rule that ended it, so a caller can say what decided a connection and why
(:mod:`nftpolicy.translators.verdict`, behind ``nftpolicy explain``) and what a packet costs.

What a packet is: the first packet of a connection, conntrack state ``new`` (or ``established``
with :attr:`Connection.established`), never ``invalid``; ``local`` names the walking node's own
addresses (nft's ``fib ... type local``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from . import layout
from .layout import (
    AddressInSet, AddressIs, ClearAndSetMark, ClearMark, ConntrackState, CounterStatement, DestinationPorts, Dispatch, Field, IcmpTypes,
    Jump, Limit, LocalAddress, Log, Marked, NamedPortInSet, PerAddressLimit, Protocols, Reject, SetMark, SetTrace, Statement, Unmarked,
)
from .model import Direction, Family, family_of

Outcome = Literal["accept", "drop", "reject", "through"]
_ACTIONS = (SetMark, ClearMark, ClearAndSetMark, Log, CounterStatement, Reject, layout.VerdictStatement, Jump, Dispatch, SetTrace)


ConnectionProtocol = Literal["TCP", "UDP", "SCTP", "ICMP"]


@dataclass(frozen=True)
class Connection:
    """The first packet of a connection: ``source`` -> ``destination`` addresses (one family),
    ``protocol`` and destination ``port`` (None for ICMP). ICMP is an echo request unless
    ``icmp_type`` names another type (nft's names: ``destination-unreachable``...).
    ``established``: the packet belongs to a connection conntrack already knows."""

    source: str
    destination: str
    protocol: ConnectionProtocol = "TCP"
    port: int | None = None
    icmp_type: str = "echo-request"
    established: bool = False

    @property
    def family(self) -> Family:
        """The connection's address family."""
        return family_of(self.destination)

    @property
    def layout_protocol(self) -> str:
        """The protocol in the layout's words: ``tcp``, ``udp``, ``sctp``, or ``icmp`` for ICMP
        and ICMPv6."""
        return self.protocol.lower()

    def address(self, which: Field) -> str:
        """The source (``saddr``) or destination (``daddr``) address."""
        return self.source if which == "saddr" else self.destination

    def text(self) -> str:
        """``TCP/5432``, ``ICMP/echo-request``."""
        return f"ICMP/{self.icmp_type}" if self.protocol == "ICMP" else f"{self.protocol}/{self.port}"


@dataclass(frozen=True)
class Step:
    """One rule the walk evaluated: the rule at ``position`` of chain ``chain``; ``fired`` when
    every match held and its actions ran."""

    chain: str
    position: int
    rule: layout.Rule
    fired: bool


@dataclass
class Walk:
    """A packet's walk: ``outcome`` (``through``: no rule decided, the base chain's accept let it
    pass), ``steps`` (every rule evaluated, in order), ``ended_by`` (the step whose verdict ended
    the walk: an accept, drop or reject anywhere, or a ``return`` of the base chain itself; None
    when the packet went through every rule). What it cost: ``lookups`` (set and verdict-map
    look-ups evaluated), ``jumps`` (jumps taken, verdict-map dispatches included) and
    ``counters`` (counter statements reached); every rule evaluated is one of ``steps``."""

    outcome: Outcome = "through"
    steps: list[Step] = field(default_factory=list)
    ended_by: Step | None = None
    lookups: int = 0
    jumps: int = 0
    counters: int = 0

    @property
    def allowed(self) -> bool:
        """True unless a rule dropped or rejected the packet."""
        return self.outcome not in ("drop", "reject")

    def fired(self) -> list[Step]:
        """The steps whose rules fired, in order."""
        return [s for s in self.steps if s.fired]


def canonical(address: str) -> str:
    """An address in canonical text (``fd00::1``, not ``fd00:0::01``). Raises ValueError."""
    return str(ipaddress.ip_address(address))


class TableWalker:
    """Walks packets through one node's ``table``; ``local`` are that node's addresses. The
    table's chains, sets and maps are indexed once."""

    def __init__(self, table: layout.Table, local: Iterable[str] = ()) -> None:
        self.table = table
        self.chains = {c.name: c for c in table.chains}
        self.sets = {s.name: s for s in table.sets}
        self.maps = {m.name: {canonical(e.address): e.chain for e in m.elements} for m in table.maps}
        self.local = frozenset(canonical(a) for a in local)
        self._members: dict[str, Any] = {}

    def contains(self, name: str, element: Any) -> bool:
        """True when ``element`` (an address, or ``(address, protocol, port)``) is in set ``name``."""
        members = self._members.get(name)
        if members is None:
            s = self.sets[name]
            if s.kind == "interval":
                members = [ipaddress.ip_network(e) for e in s.elements]
            elif s.kind in ("addr", "domain"):  # a domain set: the addresses an agent learned (as text)
                members = frozenset(canonical(e) for e in s.elements)
            else:
                members = frozenset((canonical(e[0]), e[1], e[2]) for e in s.elements)
            self._members[name] = members
        if isinstance(members, list):
            address = ipaddress.ip_address(element)
            return any(address.version == net.version and address in net for net in members)
        return element in members

    def dispatch_target(self, direction: Direction, address: str) -> str | None:
        """The pod chain of ``direction`` that the verdict map of that direction and the address's
        family gives ``address``, if any (None: the pod is not isolated for ``direction``)."""
        return self.maps[layout.POD_MAPS[direction][family_of(address)]].get(canonical(address))

    def walk(self, packet: Connection, chain: str = "KUBE-ROUTER-FORWARD", dispatch: tuple[Field, ...] = ("daddr", "saddr")) -> Walk:
        """Walk ``packet`` from base chain ``chain``. ``dispatch`` limits the verdict-map look-ups
        to those on the given addresses (``daddr``: the destination pod's chain, its ingress;
        ``saddr``: the source pod's, its egress), so one direction can be walked alone."""
        packet = dataclasses.replace(packet, source=canonical(packet.source), destination=canonical(packet.destination))
        return _Walking(self, packet, dispatch).start(chain)


class _Walking:
    """One packet's walk in progress: its mark and the steps so far."""

    def __init__(self, walker: TableWalker, packet: Connection, dispatch: tuple[Field, ...]) -> None:
        self.walker, self.packet, self.dispatch = walker, packet, dispatch
        self.mark = 0
        self.result = Walk()

    def start(self, chain: str) -> Walk:
        verdict = self.run(chain)
        if verdict == "return" and self.result.ended_by is None:
            self.result.ended_by = self.result.steps[-1]
        self.result.outcome = verdict if verdict in ("accept", "drop", "reject") else "through"  # type: ignore[assignment]
        return self.result

    def run(self, name: str) -> str | None:
        """Walk chain ``name``: ``accept``, ``drop``, ``reject``, ``return``, or None (went through)."""
        for position, rule in enumerate(self.walker.chains[name].rules):
            steps = self.result.steps
            steps.append(Step(name, position, rule, False))
            here = len(steps) - 1
            for s in rule.statements:
                if isinstance(s, _ACTIONS):
                    if not steps[here].fired:
                        steps[here] = dataclasses.replace(steps[here], fired=True)
                    verdict = self.act(s)
                    if verdict in ("accept", "drop", "reject") and self.result.ended_by is None:
                        self.result.ended_by = steps[here]
                    if verdict is not None:
                        return verdict
                elif not self.matches(s):
                    break
        return None

    def matches(self, s: Statement) -> bool:
        p, w = self.packet, self.walker
        if isinstance(s, AddressIs):
            address = ipaddress.ip_address(p.address(s.field))
            return p.family == s.family and any(address in ipaddress.ip_network(a) for a in s.addresses)
        if isinstance(s, AddressInSet):
            self.result.lookups += p.family == s.family
            return p.family == s.family and w.contains(s.name, p.address(s.field)) != s.negated
        if isinstance(s, NamedPortInSet):
            self.result.lookups += p.family == s.family
            return p.family == s.family and w.contains(s.name, (p.destination, p.layout_protocol, p.port))
        if isinstance(s, Protocols):
            return p.layout_protocol in s.names
        if isinstance(s, DestinationPorts):
            return p.port is not None and s.first <= p.port <= s.last
        if isinstance(s, layout.DestinationPortSet):
            return p.port is not None and any(first <= p.port <= last for first, last in s.ranges)
        if isinstance(s, ConntrackState):
            return ("established" if p.established else "new") in s.states
        if isinstance(s, layout.AskedAddress):  # the walk knows no NAT: a reply's original destination is its source
            asked = ipaddress.ip_address(p.address("saddr" if p.established else "daddr"))
            return p.family == s.family and any(asked in ipaddress.ip_network(a) for a in s.addresses) != s.negated
        if isinstance(s, IcmpTypes):
            return p.protocol == "ICMP" and p.family == s.family and p.icmp_type in s.types
        if isinstance(s, LocalAddress):
            return (p.address(s.field) in w.local) != s.negated
        if isinstance(s, Unmarked):
            return self.mark & s.bits == 0
        if isinstance(s, Marked):
            return self.mark & s.bits == s.bits
        if isinstance(s, (Limit, PerAddressLimit)):
            return True  # the first packet is within any rate
        raise AssertionError(f"not a match: {s!r}")

    def act(self, s: Statement) -> str | None:
        """Run one action: a verdict (``return`` included) or None to go on with the rule."""
        if isinstance(s, SetMark):
            self.mark |= s.bits
        elif isinstance(s, ClearMark):
            self.mark &= ~s.bits
        elif isinstance(s, ClearAndSetMark):
            self.mark = self.mark & ~s.clear | s.set
        elif isinstance(s, Reject):
            return "reject"
        elif isinstance(s, layout.VerdictStatement):
            return s.kind
        elif isinstance(s, Jump):
            self.result.jumps += 1
            verdict = self.run(s.target)
            return verdict if verdict != "return" else None
        elif isinstance(s, Dispatch):
            if s.field not in self.dispatch or s.family != self.packet.family:
                return None  # the other family's map: nft tests the family before it looks up
            self.result.lookups += 1
            target = self.walker.maps[s.map].get(self.packet.address(s.field))
            if target is None:
                return None
            self.result.jumps += 1
            verdict = self.run(target)
            return verdict if verdict != "return" else None
        elif isinstance(s, CounterStatement):
            self.result.counters += 1
        return None  # Log, CounterStatement, SetTrace: nothing that changes the verdict
