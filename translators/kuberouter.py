"""kube-router dumps: read ``iptables-save`` and ``ipset save`` output taken from a kube-router node,
keep its network policy controller's rules and sets, and list everything else.

Pure: text in, :class:`Dump` out. ``nftpolicy compare`` loads :meth:`Dump.restore` and
:meth:`Dump.ipset` into a sandbox node (:mod:`nftpolicy.agent.testbed.compare`).

What counts as kube-router's (its network policy controller, ``pkg/controllers/netpol``):

* the ``filter`` table only (the controller writes nothing else);
* its chains: ``KUBE-ROUTER-INPUT``, ``KUBE-ROUTER-FORWARD``, ``KUBE-ROUTER-OUTPUT``,
  ``KUBE-POD-FW-<16 base32>``, ``KUBE-NWPLCY-<16 base32>``, ``KUBE-NWPLCY-DEFAULT`` (all that
  v2.1.0 writes), and ``KUBE-NWPLCY-COMMON``, ``KUBE-NWPLCY-TAIL`` (later releases);
* in ``INPUT``, ``FORWARD`` and ``OUTPUT``, only the rules that jump to its ``KUBE-ROUTER-*``
  chain;
* in its chains, rules whose target is one of its chains or a standard target (ACCEPT, DROP,
  RETURN, REJECT, MARK, NFLOG, LOG, or none) and whose ``--match-set`` names are its sets:
  ``KUBE-SRC-<16>`` / ``KUBE-DST-<16>`` (``inet6:`` in front for IPv6).

The real format, as kube-router v2.1.0 leaves it (``tests/fixtures/kube-router-v2.1.0``, saved
from the real binary by ``tools/kube_router_dumps.py``): the pod and policy chain names hash the
sync version (``KUBE-POD-FW-`` + base32(sha256(namespace + pod + version))[:16], policy chains
the same over namespace + policy + version + ``IPv4``/``IPv6``), so they change on every sync,
while set names hash no version; comments are quoted, with ``\\'`` for an apostrophe (read by
:func:`shlex.split` and given back to ``iptables-restore`` as saved); a pod chain exists for every
local pod and begins with the conntrack rules (no ``KUBE-NWPLCY-COMMON``, so no ICMP rule: see
:attr:`Dump.accepts_icmp_echo`); ``KUBE-ROUTER-*`` end with ``-m mark --mark 0x20000/0x20000 -j
ACCEPT`` (no ``KUBE-NWPLCY-TAIL``). ``ipset save`` lines carry the options of the ipset that saved
them (``timeout 0``, ``bucketsize 12``, ``initval 0x...``: kept, ``ipset restore`` takes them) and
``nomatch`` on ipBlock excepts; kube-router's ``TMP-`` swap sets are gone by the time a sync ends.
Its IPv6 sets are named ``inet6:KUBE-...``, but v2.1.0's ip6tables rules name them without the
prefix, so its IPv6 restore fails as soon as a policy has a rule and its ip6tables dump holds
only the top-level chains (cloudnativelabs/kube-router#1653); the ``inet6:`` sets are then listed
as unreferenced.

Everything else (other tables, other chains, other rules in the built-in chains, other tools'
rules inserted into kube-router's chains, sets no kept rule references, a built-in chain policy
other than ACCEPT) is left out and listed in :attr:`Dump.left_out`.

Format references: iptables-save(8) / iptables-restore(8) (``*table``, ``:chain policy
[packets:bytes]``, ``[packets:bytes] -A chain ...`` with ``-c``, ``COMMIT``) and ipset(8)
``save`` / ``restore`` (``create NAME TYPE options``, ``add NAME ELEMENT options``).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from .errors import OneLineError

BUILTIN_CHAINS = ("INPUT", "FORWARD", "OUTPUT")
HASH = r"[A-Z2-7]{16}"
CHAIN = re.compile(rf"^(KUBE-ROUTER-(INPUT|FORWARD|OUTPUT)|KUBE-POD-FW-{HASH}|KUBE-NWPLCY-({HASH}|COMMON|DEFAULT|TAIL))$")
SET = re.compile(rf"^(inet6:)?KUBE-(SRC|DST)-{HASH}$")
STANDARD_TARGETS = frozenset({"ACCEPT", "DROP", "RETURN", "REJECT", "MARK", "NFLOG", "LOG"})
COUNTERS = re.compile(r"^\[\d+:\d+\]\s+")


class DumpError(OneLineError, ValueError):
    """The text is not iptables-save / ipset save output, or a kept rule needs a set that the
    ipset save lacks; the message names the line."""


@dataclass(frozen=True)
class SavedRule:
    """One ``-A`` line: table, chain, the line as saved (counters removed), its words, line number."""

    table: str
    chain: str
    text: str
    words: tuple[str, ...]
    line: int

    @property
    def target(self) -> str | None:
        """The ``-j`` / ``-g`` target, or None."""
        for flag in ("-j", "--jump", "-g", "--goto"):
            if flag in self.words:
                i = self.words.index(flag)
                return self.words[i + 1] if i + 1 < len(self.words) else None
        return None

    @property
    def sets(self) -> tuple[str, ...]:
        """Every set named by ``--match-set`` (or the old ``--set``)."""
        return tuple(self.words[i + 1] for i, w in enumerate(self.words[:-1]) if w in ("--match-set", "--set"))


@dataclass
class SavedTable:
    """One ``*table`` block: chain -> policy (``-`` for user chains), in order, and its rules."""

    name: str
    chains: dict[str, str] = field(default_factory=dict)
    rules: list[SavedRule] = field(default_factory=list)


def parse_iptables_save(text: str, source: str = "iptables-save") -> dict[str, SavedTable]:
    """``iptables-save`` (or ``ip6tables-save``) text -> tables by name. Raises DumpError."""
    tables: dict[str, SavedTable] = {}
    current: SavedTable | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}"
        if line.startswith("*"):
            current = tables.setdefault(line[1:].strip(), SavedTable(line[1:].strip()))
        elif line == "COMMIT":
            current = None
        elif current is None:
            swapped = " (ipset save output: is the ipset dump given as the iptables one?)" if line.startswith(("create ", "add ")) else ""
            raise DumpError(f"{where}: {line[:60]!r} outside a *table ... COMMIT block{swapped}")
        elif line.startswith(":"):
            parts = line[1:].split()
            if len(parts) < 2:
                raise DumpError(f"{where}: bad chain line {line!r}")
            current.chains[parts[0]] = parts[1]
        else:
            line = COUNTERS.sub("", line)
            try:
                words = tuple(shlex.split(line))
            except ValueError as exc:
                raise DumpError(f"{where}: {exc}: {line[:80]!r}") from None
            if len(words) < 2 or words[0] not in ("-A", "--append"):
                raise DumpError(f"{where}: expected '-A <chain> ...', got {line[:80]!r}")
            current.rules.append(SavedRule(current.name, words[1], line, words, number))
    return tables


@dataclass(frozen=True)
class SavedSet:
    """One set of an ``ipset save``: its ``create`` line and ``add`` lines, as saved."""

    name: str
    create: str
    adds: tuple[str, ...]


def parse_ipset_save(text: str, source: str = "ipset save") -> dict[str, SavedSet]:
    """``ipset save`` text -> sets by name, in order. Raises DumpError."""
    creates: dict[str, str] = {}
    adds: dict[str, list[str]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        words = line.split()
        if words[0] == "create" and len(words) >= 3:
            creates[words[1]] = line
            adds.setdefault(words[1], [])
        elif words[0] == "add" and len(words) >= 3:
            if words[1] not in creates:
                raise DumpError(f"{source}:{number}: 'add' to set {words[1]} before its 'create'")
            adds[words[1]].append(line)
        else:
            swapped = " (iptables-save output: is the iptables dump given as the ipset one?)" if line.startswith(("*", ":", "-A ")) else ""
            raise DumpError(f"{source}:{number}: expected 'create' or 'add', got {line[:60]!r}{swapped}")
    return {name: SavedSet(name, create, tuple(adds[name])) for name, create in creates.items()}


@dataclass
class Dump:
    """kube-router's network policy part of a node's dump.

    ``kept``: family (``ipv4``/``ipv6``) -> (kept chains in order, kept filter rules in order);
    ``sets``: the kept sets; ``left_out``: one human-readable line per thing not loaded;
    ``loader``: ``nft`` or ``legacy`` as the dump's header says (None when it does not).
    """

    kept: dict[str, tuple[list[str], list[SavedRule]]]
    sets: dict[str, SavedSet]
    left_out: list[str]
    loader: str | None

    def restore(self, family: str) -> str:
        """``iptables-restore`` input (``ip6tables-restore`` for ipv6): the filter table with only
        kube-router's chains and rules, built-in chains ACCEPT."""
        chains, rules = self.kept[family]
        lines = ["*filter"] + [f":{c} ACCEPT [0:0]" for c in BUILTIN_CHAINS] + [f":{c} - [0:0]" for c in chains]
        return "\n".join(lines + [r.text for r in rules] + ["COMMIT", ""])

    def ipset(self) -> str:
        """``ipset restore`` input for the kept sets, lines as saved."""
        lines = []
        for s in self.sets.values():
            lines += [s.create, *s.adds]
        return "\n".join(lines + [""]) if lines else ""

    @property
    def accepts_icmp_echo(self) -> bool:
        """True when a kept rule ACCEPTs ICMP (ICMPv6) echo requests outside any policy, as the
        ``KUBE-NWPLCY-COMMON`` chain of kube-router releases after v2.1.0 does (``-p icmp -m icmp
        --icmp-type 8 -j ACCEPT``; ``--icmpv6-type 128`` for IPv6). kube-router v2.1.0 writes no
        such rule: echo then goes through the policies like any other packet."""
        echo = {("--icmp-type", "8"), ("--icmp-type", "echo-request"), ("--icmp-type", "8/0"),
                ("--icmpv6-type", "128"), ("--icmpv6-type", "echo-request"), ("--icmpv6-type", "128/0")}
        return any(rule.target == "ACCEPT" and not rule.sets and any(pair in echo for pair in zip(rule.words, rule.words[1:]))
                   for _, rules in self.kept.values() for rule in rules)

    @property
    def pod_addresses(self) -> frozenset[str]:
        """The addresses of the pods the dump has a ``KUBE-POD-FW-`` chain for: the ``-d`` or
        ``-s`` of the ``KUBE-ROUTER-*`` rules that jump to one (kube-router writes them for the
        node's own pods only, so they say which node the dump was taken on)."""
        found: set[str] = set()
        for _, rules in self.kept.values():
            for rule in rules:
                if rule.chain.startswith("KUBE-ROUTER-") and (rule.target or "").startswith("KUBE-POD-FW-"):
                    found.update(rule.words[i + 1].split("/")[0] for i, w in enumerate(rule.words[:-1])
                                 if w in ("-d", "--destination", "-s", "--source"))
        return frozenset(found)

    @property
    def rule_count(self) -> int:
        """Rules kept, over every family."""
        return sum(len(rules) for _, rules in self.kept.values())


def _loader_of(text: str) -> str | None:
    for line in text.splitlines()[:5]:
        if line.startswith("# Generated by"):
            return "nft" if "nf_tables" in line else "legacy"
    return None


def _keep(rule: SavedRule) -> str | None:
    """None when the rule is kube-router's; else why it is left out."""
    target = rule.target
    if rule.chain in BUILTIN_CHAINS:
        if target == f"KUBE-ROUTER-{rule.chain}" and "-g" not in rule.words and "--goto" not in rule.words:
            return None
        return "not a jump to kube-router's chain"
    if target is not None and target not in STANDARD_TARGETS and not CHAIN.match(target):
        return f"jumps to {target}, not a kube-router chain"
    foreign = [s for s in rule.sets if not SET.match(s)]
    if foreign:
        return f"matches set {foreign[0]}, not a kube-router set"
    return None


def select(iptables_save: dict[str, str], ipset_save: str, ipset_source: str = "ipset save",
           sources: dict[str, str] | None = None) -> Dump:
    """Keep kube-router's network policy rules and sets; list the rest.

    ``iptables_save`` maps ``ipv4`` (iptables-save text) and/or ``ipv6`` (ip6tables-save text);
    ``sources`` the same families to what errors call that text (a file name; default
    ``iptables-save``, ``ip6tables-save``), ``ipset_source`` likewise.
    Raises DumpError when the text cannot be read or a kept rule names a set that ``ipset_save``
    does not have.
    """
    saved_sets = parse_ipset_save(ipset_save, ipset_source)
    kept: dict[str, tuple[list[str], list[SavedRule]]] = {}
    left_out: list[str] = []
    loader = None
    referenced: list[str] = []
    for family, text in iptables_save.items():
        source = "iptables-save" if family == "ipv4" else "ip6tables-save"
        where = (sources or {}).get(family) or source  # errors name the file
        loader = loader or _loader_of(text)
        tables = parse_iptables_save(text, where)
        for name, table in tables.items():
            if name != "filter":
                chains = sorted({r.chain for r in table.rules} | set(table.chains))
                left_out.append(f"{source} table {name}: {len(table.rules)} rules in {len(chains)} chains"
                                f" (only the filter table is kube-router's network policy)")
        table = tables.get("filter", SavedTable("filter"))
        for chain in BUILTIN_CHAINS:
            policy = table.chains.get(chain, "ACCEPT")
            if policy != "ACCEPT":
                left_out.append(f"{source} filter {chain} policy {policy}: loaded as ACCEPT")
        chains = [c for c in table.chains if CHAIN.match(c)]
        for chain in table.chains:
            if chain not in BUILTIN_CHAINS and not CHAIN.match(chain):
                count = sum(1 for r in table.rules if r.chain == chain)
                left_out.append(f"{source} filter chain {chain} ({count} rules): not a kube-router chain")
        rules = []
        for rule in table.rules:
            if rule.chain not in BUILTIN_CHAINS and not CHAIN.match(rule.chain):
                continue  # counted with its chain above
            if rule.chain not in BUILTIN_CHAINS and rule.chain not in table.chains:
                raise DumpError(f"{where}:{rule.line}: rule in undeclared chain {rule.chain}")
            why = _keep(rule)
            if why is None:
                rules.append(rule)
                referenced += [s for s in rule.sets if s not in referenced]
            else:
                left_out.append(f"{source}:{rule.line}: {rule.text}  ({why})")
        kept[family] = (chains, rules)
    missing = [s for s in referenced if s not in saved_sets]
    if missing:
        raise DumpError(f"kube-router's rules reference set {missing[0]}, which the {ipset_source} does not have")
    for name in saved_sets:
        if name not in referenced:
            left_out.append(f"{ipset_source}: set {name}: no kube-router rule of the dump references it")
    return Dump(kept, {name: saved_sets[name] for name in saved_sets if name in referenced}, left_out, loader)
