"""A small interpreter of the layout's statements (what nft does with them: jumps and returns,
marks under masks, set lookups, rejects) for a new connection's first packet, without a kernel.
It records the rules it walks, so tests can say what a packet costs as well as its verdict."""

from __future__ import annotations

import ipaddress
from typing import Any

from nftpolicy.translators import layout
from nftpolicy.translators.layout import (
    AddressInSet, AddressIs, ClearAndSetMark, ClearMark, ConntrackState, Counter, DestinationPorts, Dispatch, IcmpTypes, Jump, Limit,
    LocalAddress, Log, Marked, NamedPortInSet, Protocols, Reject, SetMark, Unmarked, Verdict,
)
from nftpolicy.translators.model import family_of


def _in(s: layout.AddressSet, element: Any) -> bool:
    if s.kind == "addr":
        return element in s.elements
    if s.kind == "interval":
        ip = ipaddress.ip_address(element)
        return any(ip.version == ipaddress.ip_network(n).version and ip in ipaddress.ip_network(n) for n in s.elements)
    return element in s.elements


class Packet:
    """A new connection's first packet through our table: ``allowed`` unless a rule rejects it."""

    def __init__(self, table: layout.Table, saddr: str, daddr: str, protocol: str, port: int) -> None:
        self.chains = {c.name: c for c in table.chains}
        self.sets = {s.name: s for s in table.sets}
        self.maps = {m.name: {e.address: e.chain for e in m.elements} for m in table.maps}
        self.saddr, self.daddr, self.protocol, self.port = saddr, daddr, protocol.lower(), port
        self.mark = 0
        self.walked: list[tuple[str, str]] = []  # (chain, comment) of every rule evaluated, in order

    def matches(self, s: Any) -> bool:
        if isinstance(s, AddressIs):
            address = self.saddr if s.field == "saddr" else self.daddr
            return family_of(address) == s.family and any(ipaddress.ip_address(address) in ipaddress.ip_network(a) for a in s.addresses)
        if isinstance(s, AddressInSet):
            address = self.saddr if s.field == "saddr" else self.daddr
            return family_of(address) == s.family and _in(self.sets[s.name], address)
        if isinstance(s, NamedPortInSet):
            return family_of(self.daddr) == s.family and _in(self.sets[s.name], (self.daddr, self.protocol, self.port))
        if isinstance(s, Protocols):
            return self.protocol in s.names
        if isinstance(s, DestinationPorts):
            return s.first <= self.port <= s.last
        if isinstance(s, Unmarked):
            return self.mark & s.bits == 0
        if isinstance(s, Marked):
            return self.mark & s.bits == s.bits
        if isinstance(s, (ConntrackState, IcmpTypes, LocalAddress)):
            return False  # a new TCP/UDP connection between pods
        if isinstance(s, (Limit, Counter)):
            return True
        raise AssertionError(f"not a match: {s!r}")

    def run(self, name: str) -> str | None:
        """Walk chain ``name``: ``"accept"``, ``"reject"``, ``"drop"``, or None (went through or returned)."""
        for rule in self.chains[name].rules:
            self.walked.append((name, rule.comment))
            for s in rule.statements:
                if isinstance(s, (SetMark, ClearMark, ClearAndSetMark, Log, Reject, Verdict, Jump, Dispatch)):
                    verdict = self.act(s)
                    if verdict == "return":
                        return None
                    if verdict is not None:
                        return verdict
                elif not self.matches(s):
                    break
        return None

    def act(self, s: Any) -> str | None:
        if isinstance(s, SetMark):
            self.mark |= s.bits
        elif isinstance(s, ClearMark):
            self.mark &= ~s.bits
        elif isinstance(s, ClearAndSetMark):
            self.mark = self.mark & ~s.clear | s.set
        elif isinstance(s, Reject):
            return "reject"
        elif isinstance(s, Verdict):
            return s.kind
        elif isinstance(s, Jump):
            return self.run(s.target)
        elif isinstance(s, Dispatch):
            address = self.saddr if s.field == "saddr" else self.daddr
            target = self.maps[layout.POD_MAPS[s.family]].get(address) if family_of(address) == s.family else None
            return self.run(target) if target else None
        return None

    def allowed(self) -> bool:
        return self.run("KUBE-ROUTER-FORWARD") not in ("reject", "drop")
