"""Layout table -> the iptables variant: ``iptables-restore`` input for the filter table and
``ipset restore`` input for its sets, in kube-router's chain topology.

The same :class:`~nftpolicy.translators.layout.Table` as :mod:`nftpolicy.translators.nft`
prints, so the same names and the same semantics (DESIGN.md sections 2 and 3); only the syntax
and the dispatch differ. Of a typed transaction (:mod:`nftpolicy.translators.transaction`) only
a whole-table replace prints here (:func:`replaced_table`): the variant has no incremental path. It exists so an operator can compare verdicts with kube-router's iptables network
policy controller before switching a node (``nftpolicy sandbox --dataplane both`` and
``nftpolicy compare``).

Shape of one family's filter table (``to_restore(table, "ipv4")``; ``"ipv6"`` is the same for
``ip6tables-restore``)::

    *filter
    :INPUT ACCEPT [0:0]                      (likewise FORWARD, OUTPUT)
    :KUBE-ROUTER-INPUT - [0:0]               (likewise every chain below)
    -A INPUT -j KUBE-ROUTER-INPUT            (FORWARD, OUTPUT: their KUBE-ROUTER-* chain)
    -A KUBE-ROUTER-INPUT -d <service cidr> -j RETURN
    -A KUBE-ROUTER-INPUT -p tcp -m addrtype --dst-type LOCAL -m multiport --dports 30000:32767 -j RETURN   (udp, sctp)
    -A KUBE-ROUTER-INPUT -s <pod ip> -j KUBE-POD-EG-<hash>                       (one rule per address of a pod isolated for egress)
    -A KUBE-ROUTER-FORWARD -d <pod ip> -j KUBE-POD-IN-<hash>, then -s <pod ip> -j KUBE-POD-EG-<hash> ... (OUTPUT the same)
    -A KUBE-POD-IN-<hash> -j KUBE-NWPLCY-COMMON
    -A KUBE-POD-IN-<hash> -j MARK --set-xmark 0x0/0x10000                        (start unmarked)
    -A KUBE-POD-IN-<hash> -m mark ! --mark 0x10000/0x10000 -j KUBE-NWPLCY-<ingress hash>   (or KUBE-NWPLCY-DEFAULT)
    -A KUBE-POD-IN-<hash> -m mark ! --mark 0x10000/0x10000 -m addrtype --src-type LOCAL -j ACCEPT   (the node itself)
    -A KUBE-POD-IN-<hash> -m mark ! --mark 0x10000/0x10000 -m limit --limit 10/min --limit-burst 10 -j NFLOG --nflog-group 100
    -A KUBE-POD-IN-<hash> -p tcp -m mark ! --mark 0x10000/0x10000 -j REJECT --reject-with tcp-reset
    -A KUBE-POD-IN-<hash> -m mark ! --mark 0x10000/0x10000 -j REJECT --reject-with icmp-port-unreachable
                                             (--deny-action drop: -m mark ! --mark 0x10000/0x10000 -j DROP instead of both)
    -A KUBE-POD-IN-<hash> -j MARK --set-xmark 0x20000/0x30000                    (clear the policy mark, set passed)
    (KUBE-POD-EG-<hash> the same for egress, without the node's ACCEPT)
    -A KUBE-NWPLCY-<hash> [-p tcp] -m set --match-set KUBE-PODS-<hash> src [-m tcp --dport 80[:90]] -j MARK --set-xmark 0x10000/0x10000
    -A KUBE-NWPLCY-<hash> <the same matches> -m mark --mark 0x10000/0x10000 -j RETURN
    COMMIT

Sources: the layout, the two-rule MARK/RETURN pairs, the ``--set-xmark`` marks, NFLOG group 100
and REJECT are kube-router's network policy controller (``pkg/controllers/netpol``); the match and
target options are iptables-extensions(8) (``set``, ``mark``, ``addrtype``, ``multiport``,
``conntrack``, ``icmp``/``icmp6``, ``limit``, ``comment``; ``MARK``, ``NFLOG``, ``REJECT``).
Deliberately unlike kube-router, and like our nft ruleset: a pod has a chain per direction
(``KUBE-POD-IN-``/``KUBE-POD-EG-``, as long as kube-router's ``KUBE-POD-FW-``, so names stay
within 28 characters), entered on ``-d`` for ingress and ``-s`` for egress, so a policy chain is
jumped only for its own direction (also for policies with both types), ICMP echo
is left to the policies, the KUBE-ROUTER-* chains end without kube-router's ``KUBE-NWPLCY-TAIL``
ACCEPT (we only ever refuse; everything else is left to the rest of the table), and there are no
``physdev`` rules (pods are routed, not bridged). The nft ruleset's "allowed" returns (a marked
packet leaves the pod chain at once) are left out: iptables cannot match a mark, change it and
return in one rule, and the rules after them give the same verdict.

The file replaces the whole filter table: it is meant for a namespace (or a node) where nothing
else owns it, as kube-router's controller assumes too.

Sets (``to_ipset(table)``, ipset(8) ``restore`` syntax, both families in one file): pod addresses
``hash:ip``, ipBlocks ``hash:net`` (the CIDR, its excepts as ``nomatch`` entries: see
:func:`lpm_entries`), named ports ``hash:ip,port`` (``10.0.0.1,tcp:8080``, matched ``dst,dst``).
IPv6 sets are ``family inet6``. Each set is filled as a ``TMP-<name>`` copy and swapped in, so a
reload changes every set atomically, as kube-router does. Names fit ipset's 31 characters.
"""

from __future__ import annotations

import bisect
import ipaddress
from dataclasses import dataclass
from typing import Iterable, Sequence

from .errors import OneLineError
from . import layout
from .model import Family
from .rules import AddressSet, safe_text
from .transaction import Replace, Transaction

BUILTIN: dict[layout.Hook, str] = {"input": "INPUT", "forward": "FORWARD", "output": "OUTPUT"}
IPSET_FAMILY: dict[Family, str] = {"ipv4": "inet", "ipv6": "inet6"}
HOST_PREFIX: dict[Family, int] = {"ipv4": 32, "ipv6": 128}
ICMP: dict[Family, tuple[str, str, str]] = {"ipv4": ("icmp", "icmp", "--icmp-type"), "ipv6": ("ipv6-icmp", "icmp6", "--icmpv6-type")}
PORT_UNREACHABLE: dict[Family, str] = {"ipv4": "icmp-port-unreachable", "ipv6": "icmp6-port-unreachable"}
# nft's ICMPv6 names (layout.ESSENTIAL_ICMP) as iptables-extensions(8) spells them (``ip6tables -p icmpv6 -h``).
ICMP_NAMES = {"nd-router-solicit": "router-solicitation", "nd-router-advert": "router-advertisement",
              "nd-neighbor-solicit": "neighbour-solicitation", "nd-neighbor-advert": "neighbour-advertisement"}
IPSET_TYPE = {"addr": "hash:ip", "interval": "hash:net", "named_port": "hash:ip,port"}
# Fixed, so that ``create -exist`` of an existing set always matches (ipset compares maxelem);
# the hash grows as needed, maxelem reserves nothing.
IPSET_OPTIONS = "hashsize 1024 maxelem 1048576"
TMP_PREFIX = "TMP-"
IPSET_NAME_MAX = 31
CHAIN_NAME_MAX = 28  # XT_EXTENSION_MAXNAMELEN - 1
NFLOG_PREFIX_MAX = 63  # see nflog_prefix()
COMMENT_MAX = 255  # see comment_word()
IPSET_LINE_MAX = 1023  # see ipset_comment_line()


@dataclass(frozen=True)
class IptablesRule:
    """One ``-A <chain> <args...>`` line; ``args`` are the arguments after the chain name."""

    chain: str
    args: tuple[str, ...]


def _quote(text: str) -> str:
    """A double-quoted iptables-restore word of :func:`safe_text` output (no ``"``): a backslash
    is doubled (iptables-restore drops a lone one)."""
    return '"' + text.replace("\\", "\\\\") + '"'


def comment_word(text: str) -> str:
    """``text`` as the word after ``-m comment --comment``: :func:`safe_text` within
    :data:`COMMENT_MAX` bytes (the kernel's ``XT_MAX_COMMENT_LEN``, 256 with the NUL; iptables
    1.8.9 cuts a longer one without a word, inside a character too), quoted."""
    return _quote(safe_text(text, COMMENT_MAX))


def nflog_prefix(text: str) -> str:
    """``text`` as the word after ``--nflog-prefix``: :func:`safe_text` within
    :data:`NFLOG_PREFIX_MAX` bytes (``xt_NFLOG``'s prefix, 64 with the NUL; iptables-legacy
    1.8.9 cuts a longer one without a word, inside a character too), quoted."""
    return _quote(safe_text(text, NFLOG_PREFIX_MAX))


def ipset_comment_line(text: str) -> str:
    """``text`` as an ``ipset restore`` comment line (``# ...``): :func:`safe_text` (a newline
    would start a command) within :data:`IPSET_LINE_MAX` bytes with the ``# `` (ipset 7.17 reads
    a line into 1024 bytes with the NUL and the rest of a longer line as a command of its own)."""
    return "# " + safe_text(text, IPSET_LINE_MAX - 2)


def _mark(bits: int) -> str:
    return f"0x{bits:x}/0x{bits:x}"


def _address(text: str) -> str:
    """An address as ``-s``/``-d`` take it: a host gets its full prefix, a CIDR stays."""
    if "/" in text:
        return text
    return f"{text}/{HOST_PREFIX['ipv6' if ':' in text else 'ipv4']}"


class _Printer:
    """Prints one family's share of a layout table (:mod:`nftpolicy.translators.layout`) as
    iptables rules: the same chains, rules and comments as the nft table, in iptables' words."""

    def __init__(self, table: layout.Table, family: Family) -> None:
        self.table, self.family = table, family
        self.maps = {m.name: m for m in table.maps if m.family == family}
        self.chains: list[str] = []
        self.rules: list[IptablesRule] = []

    def build(self) -> "_Printer":
        chains = self.table.chains
        # Pod chains of pods without an address of this family are left out, and nothing jumps to them.
        pod_chains = {e.chain for m in self.table.maps for e in m.elements}
        ours = {e.chain for m in self.maps.values() for e in m.elements}
        kept = [c for c in chains if c.name not in pod_chains or c.name in ours]
        for chain in sorted(kept, key=lambda c: c.hook is None):
            if len(chain.name) > CHAIN_NAME_MAX:
                raise ValueError(f"chain name {chain.name!r} is longer than iptables' {CHAIN_NAME_MAX} characters")
            self.chains.append(chain.name)
        for chain in kept:
            if chain.hook is None:
                continue
            self.rules.append(IptablesRule(BUILTIN[chain.hook], ("-m", "comment", "--comment", comment_word("nftpolicy: kube-router network policy"),
                                                         "-j", chain.name)))
        for chain in kept:
            for rule in chain.rules:
                if rule.family() in (None, self.family):
                    self._rule(chain.name, rule)
        return self

    def _rule(self, chain: str, rule: layout.Rule) -> None:
        """Append the lines of one layout rule: one per address, protocol or ICMP type where iptables
        takes one at a time; a mark-and-return becomes MARK then a mark-matching RETURN; a verdict
        map lookup one line per map element; an "allowed" return (:class:`~layout.Marked`: a
        shortcut iptables cannot take in one rule) none."""
        if any(isinstance(s, layout.Marked) for s in rule.statements):
            return
        for variant in self._expanded(rule.statements):
            if any(isinstance(s, layout.Dispatch) for s in variant):
                (dispatch,) = variant
                assert isinstance(dispatch, layout.Dispatch)
                flag = "-d" if dispatch.field == "daddr" else "-s"
                what = "to" if dispatch.field == "daddr" else "from"
                for e in self.maps[dispatch.map].elements:
                    self.rules.append(IptablesRule(chain, (flag, _address(e.address), "-m", "comment", "--comment",
                                                   comment_word(f"{e.pod} traffic {what} the pod"), "-j", e.chain)))
                continue
            matches, target = self._words(variant, rule.comment)
            if target[-1] == "RETURN" and any(isinstance(s, layout.SetMark) for s in variant):
                (mark,) = (s for s in variant if isinstance(s, layout.SetMark))
                self.rules.append(IptablesRule(chain, (*matches, "-j", "MARK", "--set-xmark", _mark(mark.bits))))
                self.rules.append(IptablesRule(chain, (*matches, "-m", "mark", "--mark", _mark(mark.bits), "-j", "RETURN")))
            else:
                self.rules.append(IptablesRule(chain, (*matches, *target)))

    def _expanded(self, statements: tuple[layout.Statement, ...]) -> list[tuple[layout.Statement, ...]]:
        """``statements`` once per address, protocol and ICMP type (iptables matches one of each)."""
        variants: list[tuple[layout.Statement, ...]] = [()]
        for s in statements:
            if isinstance(s, layout.AddressIs):
                options: list[layout.Statement] = [layout.AddressIs(s.family, s.field, (a,)) for a in s.addresses]
            elif isinstance(s, layout.Protocols):
                options = [layout.Protocols((name,)) for name in s.names]
            elif isinstance(s, layout.IcmpTypes):
                options = [layout.IcmpTypes(s.family, (kind,)) for kind in s.types]
            else:
                options = [s]
            variants = [v + (o,) for v in variants for o in options]
        return variants

    def _words(self, statements: tuple[layout.Statement, ...], comment: str) -> tuple[list[str], list[str]]:
        """(matches, target) of one rule: ``-s``/``-d`` and ``-p`` first, then the comment, then
        the extension matches (iptables-extensions(8)), then ``-j``."""
        basic: list[str] = []
        extensions: list[str] = []
        target: list[str] = []
        protocol = ""
        for s in statements:
            if isinstance(s, layout.AddressIs):
                basic += ["-s" if s.field == "saddr" else "-d", _address(s.addresses[0])]
            elif isinstance(s, layout.Protocols):
                protocol = s.names[0]
                basic += ["-p", protocol]
            elif isinstance(s, layout.IcmpTypes):
                name, module, option = ICMP[s.family]
                basic += ["-p", name]
                extensions += ["-m", module, option, ICMP_NAMES.get(s.types[0], s.types[0])]
            elif isinstance(s, layout.AddressInSet):
                extensions += ["-m", "set", *(["!"] if s.negated else []), "--match-set", s.name, "src" if s.field == "saddr" else "dst"]
            elif isinstance(s, layout.NamedPortInSet):
                extensions += ["-m", "set", "--match-set", s.name, "dst,dst"]
            elif isinstance(s, layout.DestinationPorts):
                extensions += ["-m", protocol, "--dport", str(s.first) if s.first == s.last else f"{s.first}:{s.last}"]
            elif isinstance(s, layout.ConntrackState):
                extensions += ["-m", "conntrack", "--ctstate", ",".join(state.upper() for state in s.states)]
            elif isinstance(s, layout.LocalAddress):
                extensions += ["-m", "addrtype", *(["!"] if s.negated else []), "--src-type" if s.field == "saddr" else "--dst-type", "LOCAL"]
            elif isinstance(s, layout.Unmarked):
                extensions += ["-m", "mark", "!", "--mark", _mark(s.bits)]
            elif isinstance(s, layout.Limit):
                extensions += ["-m", "limit", "--limit", f"{s.rate}/{s.per[:3]}", "--limit-burst", str(s.burst)]
            elif isinstance(s, layout.SetMark):
                target = ["-j", "MARK", "--set-xmark", _mark(s.bits)]
            elif isinstance(s, layout.ClearMark):
                target = ["-j", "MARK", "--set-xmark", f"0x0/0x{s.bits:x}"]
            elif isinstance(s, layout.ClearAndSetMark):
                target = ["-j", "MARK", "--set-xmark", f"0x{s.set:x}/0x{s.clear | s.set:x}"]
            elif isinstance(s, layout.Log):
                target = ["-j", "NFLOG", "--nflog-group", str(s.group), "--nflog-prefix", nflog_prefix(s.prefix)]
            elif isinstance(s, layout.CounterStatement):
                pass  # iptables counts every rule
            elif isinstance(s, layout.Reject):
                target = ["-j", "REJECT", "--reject-with", "tcp-reset" if s.tcp_reset else PORT_UNREACHABLE[self.family]]
            elif isinstance(s, layout.VerdictStatement):
                target = ["-j", s.kind.upper()]
            elif isinstance(s, layout.Jump):
                target = ["-j", s.target]
            else:
                raise TypeError(f"no iptables words for {s!r}")
        words = basic + (["-m", "comment", "--comment", comment_word(comment)] if comment else []) + extensions
        return words, target


class Unsupported(OneLineError, ValueError):
    """What the iptables variant does not do (kube-router has no equivalent)."""


def replaced_table(tx: Transaction) -> layout.Table:
    """The table that ``tx`` replaces ours by; raises :class:`Unsupported` for any other
    transaction (the iptables variant loads whole tables only)."""
    if len(tx.operations) == 1 and isinstance(tx.operations[0], Replace):
        return tx.operations[0].table
    raise Unsupported("the iptables variant loads whole tables only: no incremental transaction")


def _decline_cluster_policies(table: layout.Table) -> None:
    if table.cluster_policies:
        names = table.cluster_policies
        raise Unsupported(f"the iptables variant does not enforce ClusterNetworkPolicy (kube-router has no equivalent); "
                          f"{', '.join(names)} select{'s' if len(names) == 1 else ''} pods of this node: use the nft ruleset")


def filter_table(table: layout.Table, family: Family) -> tuple[list[str], list[IptablesRule]]:
    """The chains we declare (besides INPUT/FORWARD/OUTPUT) and every rule, in order, for one
    family: ``table`` printed as iptables rules. Raises :class:`Unsupported` when a
    ClusterNetworkPolicy selects a pod of the node."""
    _decline_cluster_policies(table)
    printer = _Printer(table, family).build()
    return printer.chains, printer.rules


def rule_line(rule: IptablesRule) -> str:
    """``-A <chain> <args>`` as iptables-restore reads it."""
    return " ".join(("-A", rule.chain) + rule.args)


def to_restore(table: layout.Table, family: Family = "ipv4") -> str:
    """``iptables-restore`` (``ipv4``) or ``ip6tables-restore`` (``ipv6``) input that replaces the
    filter table with our chains. Load the sets (:func:`to_ipset`) first: rules name them."""
    chains, rules = filter_table(table, family)
    tool = "iptables-restore" if family == "ipv4" else "ip6tables-restore"
    lines = [f"# nftpolicy iptables variant ({family}): {tool} input, replaces the filter table", "*filter"]
    lines += [f":{builtin} ACCEPT [0:0]" for builtin in BUILTIN.values()]
    lines += [f":{name} - [0:0]" for name in chains]
    lines += [rule_line(r) for r in rules]
    return "\n".join(lines + ["COMMIT", ""])


# ---- ipset ------------------------------------------------------------------------------------

def lpm_entries(networks: Iterable[str], family: Family) -> list[tuple[str, bool]]:
    """The fewest ``hash:net`` entries whose longest-prefix match is exactly ``networks``.

    ``networks`` are disjoint CIDRs (an ipBlock minus its excepts, as the rule model holds them).
    Returns ``(cidr, nomatch)`` pairs in address order: ipset(8) ``hash:net`` looks up the most
    specific prefix first, and a ``nomatch`` entry makes that lookup fail, so an ipBlock comes out as
    kube-router writes it (``10.0.0.0/8`` plus ``10.1.0.0/16 nomatch`` for its except), while peers
    that overlap never cancel each other (their excepts were applied per peer before). ipset cannot
    store a /0, so the whole space is two /1 entries.

    The method is the two-colour case of ORTC (Draves et al., "Constructing optimal IP routing
    tables", 1999): a dynamic programme over the binary trie of the boundaries, where each node
    costs the fewest entries below it given the colour it inherits.
    """
    bits = HOST_PREFIX[family]
    spans = sorted((int(n.network_address), int(n.broadcast_address))
                   for n in (ipaddress.ip_network(text) for text in networks))
    starts = [s for s, _ in spans]
    ends = [e for _, e in spans]
    before = [0]
    for s, e in spans:
        before.append(before[-1] + e - s + 1)

    def covered(low: int, high: int) -> int:
        """Addresses of [low, high] inside the networks (disjoint and sorted: prefix sums)."""
        i = bisect.bisect_left(ends, low)  # first span ending at or after low
        j = bisect.bisect_right(starts, high)  # spans[i:j] overlap [low, high]
        if i >= j:
            return 0
        total = before[j] - before[i]
        total -= max(0, low - spans[i][0])
        total -= max(0, spans[j - 1][1] - high)
        return total

    memo: dict[tuple[int, int], tuple[str, dict[bool, int]]] = {}

    def cost(value: int, length: int) -> tuple[str, dict[bool, int]]:
        """(kind, {inherited colour: fewest entries}) of the node value/length; kind is 'in', 'out' or 'mixed'."""
        key = (value, length)
        if key in memo:
            return memo[key]
        size = 1 << (bits - length)
        inside = covered(value, value + size - 1)
        if inside == size:
            result = ("in", {True: 0, False: 1})
        elif inside == 0:
            result = ("out", {True: 1, False: 0})
        else:
            half = size >> 1
            left, right = cost(value, length + 1)[1], cost(value + half, length + 1)[1]
            below = {colour: left[colour] + right[colour] for colour in (True, False)}
            result = ("mixed", {colour: min(below[colour], 1 + below[not colour]) for colour in (True, False)})
        memo[key] = result
        return result

    entries: list[tuple[int, int, bool]] = []

    def emit(value: int, length: int, inherited: bool, may_write: bool) -> None:
        kind, costs = cost(value, length)
        if kind != "mixed":
            if (kind == "in") != inherited:
                entries.append((value, length, kind == "out"))
            return
        half = 1 << (bits - length - 1)
        left, right = cost(value, length + 1)[1], cost(value + half, length + 1)[1]
        keep = left[inherited] + right[inherited]
        colour = inherited
        if may_write and 1 + left[not inherited] + right[not inherited] < keep:
            colour = not inherited
            entries.append((value, length, not colour))
        emit(value, length + 1, colour, True)
        emit(value + half, length + 1, colour, True)

    if spans:
        # The root (/0) cannot be an entry: it is "no match", and each /1 may be written.
        kind, _ = cost(0, 0)
        if kind == "in":
            entries = [(0, 1, False), (1 << (bits - 1), 1, False)]
        else:
            emit(0, 0, False, False)
    address = ipaddress.IPv4Address if family == "ipv4" else ipaddress.IPv6Address
    out = []
    for value, length, nomatch in sorted(entries):
        text = str(address(value)) if length == bits else f"{address(value)}/{length}"
        out.append((text, nomatch))
    return out


def ipset_elements(s: AddressSet) -> list[str]:
    """The ``add`` arguments of one set: addresses, ``cidr [nomatch]``, or ``ip,proto:port``."""
    if s.kind == "addr":
        return list(s.elements)
    if s.kind == "named_port":
        return [f"{ip},{proto}:{port}" for ip, proto, port in s.elements]
    return [f"{cidr} nomatch" if nomatch else cidr for cidr, nomatch in lpm_entries(s.elements, s.family)]


def set_names(table: layout.Table, families: Sequence[Family] = ("ipv4", "ipv6")) -> list[str]:
    """Names of the sets :func:`to_ipset` creates (without the temporary copies)."""
    return [s.name for s in table.sets if s.family in families]


def to_ipset(table: layout.Table, families: Sequence[Family] = ("ipv4", "ipv6")) -> str:
    """``ipset restore`` input that creates or atomically refills every set of ``families``.

    Per set: ``create TMP-<name> ... -exist``, ``flush``, ``add`` each element, ``create <name>
    ... -exist``, ``swap TMP-<name> <name>``, ``destroy TMP-<name>``. Rules that reference
    ``<name>`` see the new content at once (ipset(8), ``swap``). Sets the table no longer has are
    not named here: remove them after the rules stop referring to them. Raises
    :class:`Unsupported` as :func:`filter_table` does.
    """
    _decline_cluster_policies(table)
    lines = ["# nftpolicy iptables variant: ipset restore input (each set refilled in a copy and swapped in)"]
    for s in table.sets:
        if s.family not in families:
            continue
        tmp = TMP_PREFIX + s.name
        if len(tmp) > IPSET_NAME_MAX:
            raise ValueError(f"set name {tmp!r} is longer than ipset's {IPSET_NAME_MAX} characters")
        header = f"{IPSET_TYPE[s.kind]} family {IPSET_FAMILY[s.family]} {IPSET_OPTIONS}"
        lines.append(ipset_comment_line(s.comment))
        lines.append(f"create {tmp} {header} -exist")
        lines.append(f"flush {tmp}")
        lines.extend(f"add {tmp} {element}" for element in ipset_elements(s))
        lines.append(f"create {s.name} {header} -exist")
        lines.append(f"swap {tmp} {s.name}")
        lines.append(f"destroy {tmp}")
    return "\n".join(lines + [""])
