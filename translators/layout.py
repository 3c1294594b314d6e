"""The table, decided once: rule model -> typed table objects that both backends only print.

Every chain, rule, verdict map, constant and comment of our table is decided here (DESIGN.md
section 2, kube-router's ``KUBE-ROUTER-*`` -> ``KUBE-POD-FW-<hash>`` -> ``KUBE-NWPLCY-<hash>``
topology, with a pod chain per direction: ``KUBE-POD-IN-<hash>``, ``KUBE-POD-EG-<hash>``) as frozen values: :class:`Table` holds :class:`Chain` objects of :class:`Rule` objects,
each a tuple of statements (matches, then actions) and a comment, plus the shared sets of the
rule model and the dispatch :class:`VerdictMap` objects. :mod:`nftpolicy.translators.nft` prints
them as libnftables JSON and nft text, :mod:`nftpolicy.translators.iptables` as
``iptables-restore`` lines; neither decides anything of its own but syntax.

A reader gets from a printed rule to the function here that decided it through its comment: each
comment is written in exactly one place below.

Marks are only ever changed under a mask (:class:`SetMark`, :class:`ClearMark`: kube-router's
"mask mark reset" fix), so other systems' mark bits survive our chains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence, Union

from .model import Direction, Family, family_of
from .rules import AddressSet, Config, DenyAction, MatchRule, PeerChain, PodChain, PolicyChain, RuleModel, RuleOrigin, TierChain

Field = Literal["saddr", "daddr"]
Hook = Literal["input", "forward", "output"]

BASE_CHAINS: dict[str, Hook] = {"KUBE-ROUTER-INPUT": "input", "KUBE-ROUTER-FORWARD": "forward", "KUBE-ROUTER-OUTPUT": "output"}
INPUT_CHAIN = "KUBE-ROUTER-INPUT"
COMMON_CHAIN = "KUBE-NWPLCY-COMMON"
DEFAULT_CHAIN = "KUBE-NWPLCY-DEFAULT"
# The verdict maps of each direction: a local isolated pod's address -> its chain of that
# direction (KUBE-POD-IN-<hash>, KUBE-POD-EG-<hash>: chainbuilders.POD_CHAIN_PREFIX).
POD_MAPS: dict[Direction, dict[Family, str]] = {"ingress": {"ipv4": "KUBE-POD-IN-MAP4", "ipv6": "KUBE-POD-IN-MAP6"},
                                                "egress": {"ipv4": "KUBE-POD-EG-MAP4", "ipv6": "KUBE-POD-EG-MAP6"}}
# The address each direction's chains are dispatched on: the destination's for ingress, the source's for egress.
DIRECTION_FIELD: dict[Direction, Field] = {"ingress": "daddr", "egress": "saddr"}
FIELD_DIRECTION: dict[Field, Direction] = {"daddr": "ingress", "saddr": "egress"}
# Which addresses each base chain dispatches on: INPUT sees traffic from local pods to the node;
# FORWARD and OUTPUT traffic to a local pod (its ingress) and from one (its egress).
DISPATCH: dict[str, tuple[Field, ...]] = {"KUBE-ROUTER-INPUT": ("saddr",), "KUBE-ROUTER-FORWARD": ("daddr", "saddr"),
                                          "KUBE-ROUTER-OUTPUT": ("daddr", "saddr")}
# Essential ICMP (RFC 4890 for ICMPv6), in nft's names: errors that TCP/UDP need and neighbour
# discovery. Echo is not here: whether ping is allowed is the policies' decision.
ESSENTIAL_ICMP: dict[Family, tuple[str, ...]] = {
    "ipv4": ("destination-unreachable", "time-exceeded", "parameter-problem"),
    "ipv6": ("destination-unreachable", "packet-too-big", "time-exceeded", "parameter-problem",
             "nd-router-solicit", "nd-router-advert", "nd-neighbor-solicit", "nd-neighbor-advert"),
}
NODE_PORT_PROTOCOLS = ("tcp", "udp", "sctp")
# The unknown pods (docs/design.md "A new pod from its first packet"): the node's pod CIDRs and
# the addresses of the local pods the table knows, one set per family each.
POD_CIDR_SETS: dict[Family, str] = {"ipv4": "NFTPOLICY-POD-CIDRS4", "ipv6": "NFTPOLICY-POD-CIDRS6"}
KNOWN_POD_SETS: dict[Family, str] = {"ipv4": "NFTPOLICY-KNOWN-PODS4", "ipv6": "NFTPOLICY-KNOWN-PODS6"}
# Where a held packet that the agent released walks our chains again: base chains after
# iptables-nft's ``security`` table (its base chains' priority is 150: iptables-nft 1.8), where
# the hold queues it; our base chains (Config.priority) must come before that table.
RELEASED_CHAINS: dict[str, Hook] = {"NFTPOLICY-RELEASED-INPUT": "input", "NFTPOLICY-RELEASED-FORWARD": "forward",
                                    "NFTPOLICY-RELEASED-OUTPUT": "output"}
HOLD_QUEUE_PRIORITY = 150
RELEASED_PRIORITY = HOLD_QUEUE_PRIORITY + 10
# The budget of each source address for the hold (docs/design.md "One source cannot fill the
# hold"): a base chain sends a packet it marked unknown here, which accepts it towards the hold
# queue within its source's budget (a meter per family) and drops it beyond, behind a counter
# per direction, in this order (the metric's labels: agent/daemon/rulecounters.py).
TO_HOLD_CHAIN = "NFTPOLICY-TO-HOLD"
HOLD_METERS: dict[Family, str] = {"ipv4": "NFTPOLICY-HOLD-SOURCES4", "ipv6": "NFTPOLICY-HOLD-SOURCES6"}
HOLD_METER_TIMEOUT = 10  # seconds a source stays in a hold meter after its last packet (its budget refills sooner)
OVER_BUDGET_DROPS: tuple[Direction, ...] = ("egress", "ingress")
LOG_RATE = (10, "minute", 10)  # NFLOG of refused packets (a pod chain's, a Deny rule's): rate, per, burst (as kube-router)


# ---- statements: matches ------------------------------------------------------------------------

@dataclass(frozen=True)
class AddressIs:
    """The packet's source (``saddr``) or destination (``daddr``) address of ``family`` is one of
    ``addresses`` (addresses or CIDRs)."""

    family: Family
    field: Field
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class AddressInSet:
    """The packet's ``field`` address of ``family`` is in set ``name`` (``negated``: is not)."""

    family: Family
    field: Field
    name: str
    negated: bool = False


@dataclass(frozen=True)
class NamedPortInSet:
    """``destination address . protocol . destination port`` is in set ``name`` (a named port
    resolved per pod)."""

    family: Family
    name: str


@dataclass(frozen=True)
class Protocols:
    """The layer-4 protocol is one of ``names`` (lower case: ``tcp``, ``udp``, ``sctp``)."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class DestinationPorts:
    """The destination port is in the inclusive range ``first..last`` (after a :class:`Protocols`)."""

    first: int
    last: int


@dataclass(frozen=True)
class DestinationPortSet:
    """The destination port is in one of ``ranges`` (inclusive ``(first, last)``, disjoint and
    sorted; after a :class:`Protocols`): nft's anonymous set, the iptables variant's rule per
    range."""

    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class SourcePort:
    """The source port is ``port`` (after a :class:`Protocols`)."""

    port: int


@dataclass(frozen=True)
class ConntrackState:
    """The connection's conntrack state is one of ``states`` (``invalid``, ``established``, ...)."""

    states: tuple[str, ...]


@dataclass(frozen=True)
class AskedAddress:
    """The connection's original destination of ``family`` (conntrack's ``original`` direction:
    where its first packet was sent, before any DNAT; for a DNS answer, the resolver address the
    pod asked, such as a Service's cluster IP) is one of ``addresses`` (addresses or CIDRs;
    ``negated``: is none of them)."""

    family: Family
    addresses: tuple[str, ...]
    negated: bool = False


@dataclass(frozen=True)
class IcmpTypes:
    """An ICMP (``ipv4``) or ICMPv6 (``ipv6``) packet of one of ``types`` (nft's names)."""

    family: Family
    types: tuple[str, ...]


@dataclass(frozen=True)
class LocalAddress:
    """The packet's source (``saddr``) or destination (``daddr``) is an address of this node
    (nft's ``fib ... type local``, iptables' ``addrtype LOCAL``; ``negated``: is not)."""

    field: Field
    negated: bool = False


@dataclass(frozen=True)
class Unmarked:
    """None of ``bits`` is set in the packet mark."""

    bits: int


@dataclass(frozen=True)
class Marked:
    """Every one of ``bits`` is set in the packet mark."""

    bits: int


@dataclass(frozen=True)
class Limit:
    """At most ``rate`` packets per ``per`` (``minute``), bursts of ``burst``."""

    rate: int
    per: str
    burst: int


# ---- statements: actions ------------------------------------------------------------------------

@dataclass(frozen=True)
class PerAddressLimit:
    """At most ``rate`` packets a second, after a burst of ``burst``, for each ``field`` address
    of ``family``, counted in a meter (nft(8) METER: a dynamic set of the table) named ``meter``;
    a packet over its address's rate does not match, nor does one whose address finds the meter
    full (65,535 addresses). ``timeout``: seconds an address stays in the meter after its last
    packet (None: until the table is replaced)."""

    family: Family
    field: Field
    meter: str
    rate: int
    burst: int
    timeout: int | None = None


@dataclass(frozen=True)
class SetMark:
    """``mark |= bits``: other bits untouched."""

    bits: int


@dataclass(frozen=True)
class ClearMark:
    """``mark &= ~bits``: other bits untouched."""

    bits: int


@dataclass(frozen=True)
class ClearAndSetMark:
    """``mark = (mark & ~clear) | set`` in one statement: other bits untouched."""

    clear: int
    set: int


@dataclass(frozen=True)
class Log:
    """NFLOG to ``group`` with ``prefix`` (each backend cuts it to its own limit)."""

    prefix: str
    group: int


@dataclass(frozen=True)
class CounterStatement:
    """Count the packets and bytes that reach this statement (nft ``counter``, read back by the
    agent's metrics; iptables counts every rule, so its printer prints nothing for it)."""


@dataclass(frozen=True)
class Reject:
    """Reject: a TCP reset when ``tcp_reset`` (after ``Protocols(("tcp",))``), else ICMP port
    unreachable of the packet's family."""

    tcp_reset: bool = False


@dataclass(frozen=True)
class VerdictStatement:
    """``accept``, ``drop`` or ``return``."""

    kind: Literal["accept", "drop", "return"]


@dataclass(frozen=True)
class Jump:
    """Jump to chain ``target`` (and come back unless it decides)."""

    target: str


@dataclass(frozen=True)
class Dispatch:
    """Look the packet's ``field`` address of ``family`` up in verdict map ``map`` and jump to the
    chain it gives (nft: ``vmap``; iptables: one rule per map element)."""

    family: Family
    field: Field
    map: str


@dataclass(frozen=True)
class SetTrace:
    """``meta nftrace set 1``: the kernel reports the packet's walk through every chain to
    ``nft monitor trace`` listeners (only in the chains :func:`trace_chains` adds for a trace)."""


Statement = Union[AddressIs, AddressInSet, NamedPortInSet, Protocols, DestinationPorts, DestinationPortSet, SourcePort, ConntrackState,
                  AskedAddress, IcmpTypes, LocalAddress, Unmarked, Marked, Limit, PerAddressLimit, CounterStatement, SetMark, ClearMark, ClearAndSetMark, Log,
                  Reject, VerdictStatement,
                  Jump, Dispatch, SetTrace]


# ---- table objects ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """Statements in order (matches, then actions) and the comment that says why (a description
    only: printers cut it). ``origin``: the policy rule it enforces, for a rule of a policy or
    tier chain (None: any other rule)."""

    statements: tuple[Statement, ...]
    comment: str
    origin: RuleOrigin | None = None

    def family(self) -> Family | None:
        """The family this rule is limited to by its address or ICMP matches (None: both)."""
        for s in self.statements:
            if isinstance(s, (AddressIs, AddressInSet, NamedPortInSet, IcmpTypes, Dispatch)):
                return s.family
        return None


@dataclass(frozen=True)
class Chain:
    """A chain and its rules; ``hook`` makes it a base chain (type filter, policy accept) at the
    table's priority, or at ``priority`` where it says one."""

    name: str
    rules: tuple[Rule, ...]
    hook: Hook | None = None
    priority: int | None = None


@dataclass(frozen=True)
class MapElement:
    """A dispatch element: local pod ``pod``'s ``address`` -> its pod chain ``chain`` (of the map's direction)."""

    address: str
    chain: str
    pod: str


@dataclass(frozen=True)
class VerdictMap:
    """``KUBE-POD-IN-MAP4``/``6`` (``direction`` ingress) and ``KUBE-POD-EG-MAP4``/``6``
    (egress): the addresses of ``family`` of the local pods isolated for ``direction`` -> their
    pod chain of that direction."""

    name: str
    direction: Direction
    family: Family
    elements: tuple[MapElement, ...]
    comment: str


@dataclass(frozen=True)
class Table:
    """Our whole table for one node, objects in dependency order: sets, then chains (common,
    default, policy chains, ClusterNetworkPolicy tier chains, pod chains, base chains); the maps
    name pod chains. ``cluster_policies``: the ClusterNetworkPolicies that have tier chains here
    (by name, sorted; the iptables variant declines them)."""

    name: str
    priority: int
    sets: tuple[AddressSet, ...]
    chains: tuple[Chain, ...]
    maps: tuple[VerdictMap, ...]
    cluster_policies: tuple[str, ...] = ()


# ---- the decisions ------------------------------------------------------------------------------

def common_chain() -> Chain:
    """``KUBE-NWPLCY-COMMON``, jumped first by every pod chain: a packet conntrack finds invalid
    is dropped (as kube-router), essential ICMP is always allowed (DESIGN.md section 2).
    Established and related connections never get here: every base chain accepts them before it
    dispatches to a pod chain."""
    return Chain(COMMON_CHAIN, (
        Rule((ConntrackState(("invalid",)), VerdictStatement("drop")), "drop invalid conntrack state"),
        Rule((IcmpTypes("ipv4", ESSENTIAL_ICMP["ipv4"]), VerdictStatement("accept")), "allow essential ICMP errors"),
        Rule((IcmpTypes("ipv6", ESSENTIAL_ICMP["ipv6"]), VerdictStatement("accept")), "allow essential ICMPv6 errors and neighbour discovery"),
    ))


def default_chain(config: Config) -> Chain:
    """``KUBE-NWPLCY-DEFAULT``: a direction that no policy isolates is allowed (the API
    reference: a pod is isolated for a direction only by a policy of that type selecting it)."""
    return Chain(DEFAULT_CHAIN, (Rule((SetMark(config.policy_mark),), "allow a direction that no policy isolates"),))


def peer_and_port(direction: Direction, rule: MatchRule) -> list[Statement]:
    """The matches of one (peer, port) tuple of a NetworkPolicy or ClusterNetworkPolicy rule, in
    order: the peer set (the source for ingress, the destination for egress), the named-port set,
    the protocol and the destination port range; empty for a rule that matches everything."""
    matches: list[Statement] = []
    if rule.peer_set:
        assert rule.family
        matches.append(AddressInSet(rule.family, "saddr" if direction == "ingress" else "daddr", rule.peer_set))
    if rule.named_port_set:
        assert rule.family
        matches.append(NamedPortInSet(rule.family, rule.named_port_set))
    if rule.port:
        matches.append(Protocols((rule.port.protocol.lower(),)))
        if rule.port.first is not None:
            matches.append(DestinationPorts(rule.port.first, rule.port.first if rule.port.last is None else rule.port.last))
    return matches


def allow_rule(config: Config, chain: PolicyChain, allow: MatchRule) -> Rule:
    """One allowed (peers, port) tuple of a policy: match the peer (the source for ingress, the
    destination for egress), the named port and the port (:func:`peer_and_port`), then set the
    policy mark and return (rules of a policy are OR'ed, peers and ports within a rule AND'ed: the
    API reference). A counter before the mark counts the packets this rule allowed (the agent's
    allowed metric)."""
    return Rule((*peer_and_port(chain.direction, allow), CounterStatement(), SetMark(config.policy_mark), VerdictStatement("return")), allow.comment,
                allow.origin)


def log_prefix(direction: str, pod: str) -> str:
    """The NFLOG prefix of a packet rejected for ``direction`` (``ingress``/``egress``) of pod
    ``pod`` (``namespace/name``): ``nftpolicy reject ingress shop/api-0: ``. The direction comes
    before the pod, so a printer's cut (nft: 127 bytes, iptables: 63) only ever shortens the name."""
    return f"nftpolicy reject {direction} {pod}: "


def deny_log_prefix(origin: RuleOrigin) -> str:
    """The NFLOG prefix of a packet a ClusterNetworkPolicy ``Deny`` rule refused:
    ``nftpolicy deny Admin ingress rule 0 db-guard: `` (tier, direction, the rule's index in the
    policy's list of that direction, policy name). The name comes last, so a printer's cut (nft:
    127 bytes) only ever shortens it; the metrics name the rule from the rule model, never from
    this text."""
    return f"nftpolicy deny {origin.tier} {origin.direction} rule {origin.index} {origin.policy}: "


def refusal(action: DenyAction, matches: Sequence[Statement], text: str, origin: RuleOrigin | None = None) -> list[Rule]:
    """The counted rules that refuse what ``matches`` match: ``drop`` is one counted ``drop``
    (the sender hears nothing and times out); ``reject`` answers as kube-router does, a TCP
    reset for TCP, then ICMP (ICMPv6) port unreachable for anything else, each answer behind
    its own counter (nft's ``reject with tcp reset`` and ``reject``; iptables' REJECT
    ``--reject-with``). Every rule carries ``text`` and ``origin``."""
    if action == "drop":
        return [Rule((*matches, CounterStatement(), VerdictStatement("drop")), text, origin)]
    return [Rule((*matches, Protocols(("tcp",)), CounterStatement(), Reject(tcp_reset=True)), text, origin),
            Rule((*matches, CounterStatement(), Reject()), text, origin)]


def refused_by(rule: Rule) -> Literal["reject", "drop"] | None:
    """How ``rule`` refuses the packets it matches: ``reject`` (it answers them), ``drop`` (it
    discards them), or None (it refuses nothing)."""
    for s in rule.statements:
        if isinstance(s, Reject):
            return "reject"
        if s == VerdictStatement("drop"):
            return "drop"
    return None


def tier_rule(config: Config, chain: TierChain, rule: MatchRule) -> list[Rule]:
    """One (peer, port) match of a ClusterNetworkPolicy rule (the peer is the source for
    ingress, the destination for egress) and its action: ``Accept`` sets the policy mark and
    returns (the pod chain's later jumps, NetworkPolicies included, test the mark: "no further
    ClusterNetworkPolicy or NetworkPolicy rules will be processed"); ``Deny`` drops ("Deny:
    Drops the selected traffic", network-policy-api v0.3.0; its conformance suite passes a
    denied connection only when it times out); ``Pass`` sets the pass mark and returns (the pod
    chain skips the rest of the tier). The matches are :func:`peer_and_port`'s. Source:
    network-policy-api v0.3.0, ClusterNetworkPolicyRuleAction.

    A ``Deny`` is logged and counted as a pod chain's refusal is: first NFLOG with
    :func:`deny_log_prefix` (at most :data:`LOG_RATE`), then the drop behind a counter (the
    agent's ``nftpolicy_cluster_denied_packets`` metric, by the rule's origin)."""
    matches, text, origin = peer_and_port(chain.direction, rule), rule.comment, rule.origin
    if origin.action == "Accept":
        return [Rule((*matches, SetMark(config.policy_mark), VerdictStatement("return")), text, origin)]
    if origin.action == "Pass":
        return [Rule((*matches, SetMark(config.pass_mark), VerdictStatement("return")), text, origin)]
    log = Rule((*matches, Limit(*LOG_RATE), Log(deny_log_prefix(origin), config.nflog_group)), text, origin)
    return [log, *refusal("drop", matches, text, origin)]


def counted_origins(laid: Chain) -> tuple[RuleOrigin, ...]:
    """The origins of the rules of ``laid`` (a tier chain's or its peer chain's layout) that hold
    a :class:`CounterStatement`, in chain order (its ``Deny`` drops): the k-th counter the kernel
    lists in that chain is the k-th."""
    return tuple(r.origin for r in laid.rules if r.origin is not None and CounterStatement() in r.statements)


def match_rules(config: Config, chain: PolicyChain | TierChain, rule: MatchRule) -> list[Rule]:
    """The layout rules of one match of a policy chain (:func:`allow_rule`) or tier chain
    (:func:`tier_rule`)."""
    return [allow_rule(config, chain, rule)] if isinstance(chain, PolicyChain) else tier_rule(config, chain, rule)


def chain_rules(config: Config, chain: PolicyChain | TierChain) -> list[tuple[Rule, tuple[MatchRule, ...]]]:
    """The layout rules of a policy or tier chain, each with the model rules it was made from
    (none: a peer chain's return). A match whose peers are a peer chain's
    (:attr:`~nftpolicy.translators.rules.MatchRule.peer_chain`) is its port match and a jump
    there, the numbered ports of one protocol in a row one rule with a port set
    (:func:`port_jump`); after the last jump of a rule, a packet its peer chain allowed (the
    policy mark) or passed (the pass mark) returns, as the rule's own return would (the first
    match decides; a ``Deny`` drops in the peer chain)."""
    laid: list[tuple[Rule, tuple[MatchRule, ...]]] = []
    rules, i = chain.rules, 0
    while i < len(rules):
        rule = rules[i]
        if rule.peer_chain is None:
            laid += [(r, (rule,)) for r in match_rules(config, chain, rule)]
            i += 1
            continue
        group = [rule]
        while i + len(group) < len(rules) and _same_port_set(rule, rules[i + len(group)]):
            group.append(rules[i + len(group)])
        i += len(group)
        laid.append((port_jump(chain.direction, group), tuple(group)))
        mark = {"Accept": config.policy_mark, "Pass": config.pass_mark}.get(rule.origin.action)
        if (i == len(rules) or rules[i].peer_chain != rule.peer_chain) and mark is not None:
            laid.append((Rule((Marked(mark), VerdictStatement("return")), f"{rule.comment} decided"), ()))
    return laid


def _same_port_set(first: MatchRule, other: MatchRule) -> bool:
    """``other`` joins ``first``'s port set: numbered ports of one protocol jumping to one peer chain."""
    return (first.peer_chain == other.peer_chain and first.named_port_set is None and other.named_port_set is None
            and first.port is not None and other.port is not None and first.port.first is not None and other.port.first is not None
            and first.port.protocol == other.port.protocol)


def port_jump(direction: Direction, group: Sequence[MatchRule]) -> Rule:
    """The jump of a rule's port matches to its peer chain: one match as :func:`peer_and_port`
    gives it, or numbered ports of one protocol as one port set (their ranges merged: nft refuses
    overlapping intervals in a set)."""
    first = group[0]
    assert first.peer_chain is not None
    if len(group) == 1:
        return Rule((*peer_and_port(direction, first), Jump(first.peer_chain)), first.comment, first.origin)
    merged: list[tuple[int, int]] = []
    for low, high in sorted((r.port.first, r.port.last if r.port.last is not None else r.port.first) for r in group
                            if r.port is not None and r.port.first is not None):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    assert first.port is not None
    return Rule((Protocols((first.port.protocol.lower(),)), DestinationPortSet(tuple(merged)), Jump(first.peer_chain)), first.comment,
                first.origin)


def policy_chain(config: Config, chain: PolicyChain) -> Chain:
    """``KUBE-NWPLCY-<hash>`` of one policy and direction (:func:`chain_rules`); no rules: it
    allows nothing."""
    return Chain(chain.name, tuple(r for r, _ in chain_rules(config, chain)))


def tier_chain(config: Config, chain: TierChain) -> Chain:
    """``KUBE-ANP-<hash>`` / ``KUBE-BANP-<hash>`` of one ClusterNetworkPolicy and direction:
    its matches in the order the policy writes its rules (:func:`chain_rules`)."""
    return Chain(chain.name, tuple(r for r, _ in chain_rules(config, chain)))


def peer_chain(config: Config, chain: PolicyChain | TierChain, peers: PeerChain) -> Chain:
    """The peer chain of one rule of a policy or tier chain: :func:`match_rules` of each peer set."""
    return Chain(peers.name, tuple(r for rule in peers.rules for r in match_rules(config, chain, rule)))


def laid_chains(config: Config, chain: PolicyChain | TierChain) -> list[Chain]:
    """The layout chains of one policy or tier chain of the model: its peer chains, then itself
    (which jumps to them)."""
    own = policy_chain(config, chain) if isinstance(chain, PolicyChain) else tier_chain(config, chain)
    return [*(peer_chain(config, chain, peers) for peers in chain.peer_chains), own]


def pod_chain(config: Config, pod: PodChain) -> Chain:
    """``KUBE-POD-IN-<hash>`` or ``KUBE-POD-EG-<hash>``: one direction of one isolated local pod
    (DESIGN.md section 2), entered from that direction's verdict map only (ingress: the pod's
    address is the destination, egress: the source), so no rule here tests the address. In
    order: common chain; start unmarked; the tiers of the direction, each jump only while no
    earlier one has set the policy mark: the Admin tier chains (and while no Pass rule has set
    the pass mark), then the NetworkPolicy chains, or where no NetworkPolicy isolates the pod
    the Baseline tier chains (the same way) and ``KUBE-NWPLCY-DEFAULT``; the pass mark is
    cleared after each tier. Once the jumps have set the policy mark the packet is allowed for
    this direction: clear the mark, set the passed mark and return (the first allow ends the
    walk, and no reject below could match a marked packet); the base chain then dispatches the
    other direction, so a packet between two addresses of one pod (hairpin through a Service)
    is decided by both. Then, where NetworkPolicies isolate the direction, NFLOG and the counted
    refusal of what nothing allowed (:func:`refusal`, as ``config.deny_action`` says: reject by
    default, as kube-router); clear the policy mark and set the passed mark.

    The node itself may always reach its pods (kubelet probes; the NetworkPolicy concepts page:
    "traffic to and from the node where a Pod is running is always allowed"): in the ingress
    chain that accept comes after the policies, just before the rejects, so a packet a policy
    allowed has returned without the address lookup. The verdict is the one an accept before the
    policies gives: a NetworkPolicy only allows, and the ingress peers of a ClusterNetworkPolicy
    are namespaces and pods (a hostNetwork pod is never a peer), so no rule before it refuses the
    node's traffic. It takes unmarked packets only: a packet a policy allowed, where a printer
    leaves the "allowed" return out (iptables), goes on to the tail, which clears the policy mark.

    A policy chain without rules (a deny-all policy's) is not jumped to: it could only return
    the packet unmarked. A chain without any jump has no "allowed" return either: nothing in it
    could set the mark.

    A direction that no NetworkPolicy isolates jumps ``KUBE-NWPLCY-DEFAULT``, which always sets
    the mark (a ClusterNetworkPolicy Deny before it drops in its tier chain), so it needs no
    refusal: the API has no implicit deny of its own ("If a given connection wasn't allowed or
    denied by any of the tiers, the default kubernetes policy is applied, which says that all
    pods can communicate with each other", network-policy-api v0.3.0, ``spec.tier``)."""
    unmarked = Unmarked(config.policy_mark)
    in_tier = Unmarked(config.policy_mark | config.pass_mark)
    policies = dict(pod.tier_policies)
    passed = ClearAndSetMark(config.policy_mark, config.passed_mark)
    direction = pod.direction
    rules = [Rule((Jump(COMMON_CHAIN),), f"{pod.pod} common"),
             Rule((ClearMark(config.policy_mark | config.pass_mark if pod.admin or pod.baseline else config.policy_mark),),
                  f"{pod.pod} start unmarked")]

    def tier(name: str, chains: tuple[str, ...]) -> list[Rule]:
        jumps = [Rule((in_tier, Jump(target)), f"{pod.pod} {direction} {name} tier: {policies[target]}") for target in chains]
        return jumps + [Rule((ClearMark(config.pass_mark),), f"{pod.pod} {direction} end of {name} tier")] if jumps else []

    before = len(rules)
    rules += tier("admin", pod.admin)
    if pod.policies is None:
        rules += tier("baseline", pod.baseline)
    rules += [Rule((unmarked, Jump(target)), f"{pod.pod} {direction}")
              for target in (pod.policies if pod.policies is not None else (DEFAULT_CHAIN,)) if target not in pod.empty]
    if len(rules) > before:
        rules.append(Rule((Marked(config.policy_mark), passed, VerdictStatement("return")), f"{pod.pod} {direction} allowed"))
    if direction == "ingress":
        rules.append(Rule((unmarked, LocalAddress("saddr"), VerdictStatement("accept")), f"{pod.pod} from the local node"))
    if pod.policies is not None:
        done = {"reject": "rejected", "drop": "dropped"}[config.deny_action]
        rules.append(Rule((unmarked, Limit(*LOG_RATE), Log(log_prefix(direction, pod.pod), config.nflog_group)),
                          f"{pod.pod} log {done} {direction}"))
        rules += refusal(config.deny_action, (unmarked,), f"{pod.pod} {config.deny_action} {direction}")
    rules.append(Rule((passed,), f"{pod.pod} passed"))
    return Chain(pod.name, tuple(rules))


def dispatch_maps(pods: tuple[PodChain, ...]) -> tuple[VerdictMap, ...]:
    """``KUBE-POD-IN-MAP4``/``6`` and ``KUBE-POD-EG-MAP4``/``6``: every address of every local
    pod isolated for the map's direction -> its pod chain of that direction (one lookup per
    packet and direction, O(1) in the number of pods)."""
    return tuple(VerdictMap(name, direction, family, tuple(map_elements([p for p in pods if p.direction == direction], family)),
                            f"local pods isolated for {direction} ({family}) -> their {direction} chain")
                 for direction, names in POD_MAPS.items() for family, name in names.items())


def map_elements(pods: tuple[PodChain, ...] | list[PodChain], family: Family) -> list[MapElement]:
    """The dispatch elements of ``pods`` (chains of one direction) for one family, in pod order."""
    return [MapElement(ip, p.name, p.pod) for p in pods for ip in p.ips if family_of(ip) == family]


def input_exemptions(config: Config) -> list[Rule]:
    """What ``KUBE-ROUTER-INPUT`` returns before any dispatch: traffic to service cluster IPs,
    to node ports on local addresses (tcp, udp, sctp) and to external ranges (DESIGN.md 2)."""
    rules = [Rule((AddressIs(family_of(cidr), "daddr", (cidr,)), VerdictStatement("return")), "allow traffic to service cluster IPs")
             for cidr in config.service_cidrs]
    if config.node_port_range:
        low, high = config.node_port_range
        rules.append(Rule((LocalAddress("daddr"), Protocols(NODE_PORT_PROTOCOLS), DestinationPorts(low, high), VerdictStatement("return")),
                          "allow node ports on local addresses"))
    rules += [Rule((AddressIs(family_of(cidr), "daddr", (cidr,)), VerdictStatement("return")), "allow traffic to external and load-balancer IPs")
              for cidr in config.external_cidrs]
    return rules


def dispatch_rules(name: str) -> list[Rule]:
    """The dispatch of base chain ``name`` to the local pods' chains on the address of each
    direction: the destination's ingress chain, then the source's egress chain."""
    rules = []
    for field in DISPATCH[name]:
        what = "to" if field == "daddr" else "from"
        rules += [Rule((Dispatch(family, field, pod_map),), f"traffic {what} local isolated pods ({family})")
                  for family, pod_map in POD_MAPS[FIELD_DIRECTION[field]].items()]
    return rules


def unknown_pod(family: Family, field: Field) -> tuple[Statement, ...]:
    """The matches of a packet whose ``field`` address is an unknown pod's: in the node's pod
    CIDRs, no local pod the table knows, and no address of the node (a CNI's bridge or gateway
    address in the pod CIDR: the node's own traffic to its pods, kubelet probes among it)."""
    return (AddressInSet(family, field, POD_CIDR_SETS[family]), AddressInSet(family, field, KNOWN_POD_SETS[family], negated=True),
            LocalAddress(field, negated=True))


def unknown_pod_field(rule: Rule) -> Field | None:
    """The address (``saddr``, ``daddr``) that ``rule``, one of :func:`unknown_pod_rules`'s
    marking or dropping rules, finds an unknown pod's; None for any other rule."""
    return next((s.field for s in rule.statements
                 if isinstance(s, AddressInSet) and s.negated and s.name == KNOWN_POD_SETS[s.family]), None)


def unknown_pod_rules(config: Config, name: str) -> list[Rule]:
    """What base chain ``name`` does, before it dispatches, with a packet from or to an unknown
    pod (:func:`unknown_pod`) on an address it dispatches on, as ``config.unknown_pods`` says,
    behind a counter each: ``drop`` drops it; ``hold`` sets the unknown mark of each direction
    whose address is unknown (the destination's: ingress, the source's: egress) and then
    accepts a packet with either mark, so no pod chain of ours decides it here: the agent's
    hold queue in iptables-nft's ``security`` table takes it, waits until the addresses its marks
    name are programmed, and its release walks :func:`released_chains`; ``off``: no rule."""
    if config.unknown_pods == "off":
        return []
    marks = config.unknown_marks()
    if config.unknown_pods == "drop":
        return [Rule((*unknown_pod(family, field), CounterStatement(), VerdictStatement("drop")),
                     f"drop {FIELD_DIRECTION[field]} of an unknown pod ({family}): not programmed yet")
                for field in DISPATCH[name] for family in POD_CIDR_SETS]
    rules = [Rule((*unknown_pod(family, field), CounterStatement(), SetMark(marks[FIELD_DIRECTION[field]])),
                  f"hold {FIELD_DIRECTION[field]} of an unknown pod ({family}): not programmed yet")
             for field in DISPATCH[name] for family in POD_CIDR_SETS]
    return rules + [Rule((Marked(marks[FIELD_DIRECTION[field]]), Jump(TO_HOLD_CHAIN)),
                         f"to the hold, within its source's budget: an unknown pod's {FIELD_DIRECTION[field]}")
                    for field in DISPATCH[name]]


def to_hold_chain(config: Config) -> list[Chain]:
    """With ``config.unknown_pods`` ``hold``: :data:`TO_HOLD_CHAIN`, where the base chains send
    a packet they marked unknown (:func:`unknown_pod_rules`). It accepts the packet (towards
    the hold queue) while its source address is within ``config.unknown_pod_rate`` packets a
    second after a burst of ``config.unknown_pod_burst`` (one meter per family, shared by every
    hook: :data:`HOLD_METERS`), and drops it beyond, behind a counter per direction
    (:data:`OVER_BUDGET_DROPS`; a packet with both marks counts as egress): one source cannot
    fill the kernel's queue of the hold (1,024 packets) and so delay or drop the first packets
    of every other new pod on the node. The node's own packets (kubelet's probes of every new
    pod, whose targets a tenant's pod spec may point at unused addresses) are accepted outside
    any budget: keyed by one source, the node, they would share one (the agent's
    ``--unknown-pod-max-held`` still bounds what waits for one address)."""
    if config.unknown_pods != "hold":
        return []
    marks = config.unknown_marks()
    node = Rule((LocalAddress("saddr"), VerdictStatement("accept")), "to the hold: the node's own packets (kubelet's probes), no budget")
    budget = [Rule((PerAddressLimit(family, "saddr", meter, config.unknown_pod_rate, config.unknown_pod_burst, HOLD_METER_TIMEOUT),
                    VerdictStatement("accept")), f"to the hold: within its source's budget ({family})")
              for family, meter in HOLD_METERS.items()]
    over = [Rule((Marked(marks["egress"]), CounterStatement(), VerdictStatement("drop")),
                 "drop an unknown pod's egress over its source's budget for the hold"),
            Rule((CounterStatement(), VerdictStatement("drop")), "drop an unknown pod's ingress over its source's budget for the hold")]
    return [Chain(TO_HOLD_CHAIN, (node, *budget, *over))]


def base_chains(config: Config) -> list[Chain]:
    """``KUBE-ROUTER-INPUT/FORWARD/OUTPUT``: INPUT's exemptions, then established and related
    connections accepted (conntrack decides known connections, as kube-router; here, before any
    pod chain, so no pod chain tests them), then what an unknown pod's packet gets
    (:func:`unknown_pod_rules`), then :func:`dispatch_rules`."""
    chains = []
    for name, hook in BASE_CHAINS.items():
        rules = input_exemptions(config) if name == INPUT_CHAIN else []
        rules.append(Rule((ConntrackState(("established", "related")), VerdictStatement("accept")), "allow established and related connections"))
        rules += unknown_pod_rules(config, name)
        rules += dispatch_rules(name)
        chains.append(Chain(name, tuple(rules), hook))
    return chains


def released_chains(config: Config) -> list[Chain]:
    """With ``config.unknown_pods`` ``hold``: ``NFTPOLICY-RELEASED-INPUT/FORWARD/OUTPUT``, base
    chains at :data:`RELEASED_PRIORITY` (after the hold queue), where a packet the agent
    released (it cleared the unknown marks and set the released mark) walks the pod chains as
    they are now: clear the released mark, then the dispatch of the base chain of the same
    hook. A packet that still has an unknown mark was not held (the hold chain is missing): it
    is dropped, behind a counter, so a missing hold never lets an unknown pod's packet through.
    Any other packet returns at once."""
    if config.unknown_pods != "hold":
        return []
    base = {hook: name for name, hook in BASE_CHAINS.items()}
    return [Chain(name, (*(Rule((Marked(mark), CounterStatement(), VerdictStatement("drop")),
                                f"drop an unknown pod's {direction} that no hold queue took")
                           for direction, mark in config.unknown_marks().items()),
                         Rule((Unmarked(config.released_mark), VerdictStatement("return")), "not released by the hold"),
                         Rule((ClearMark(config.released_mark),), "released by the hold: the pod is programmed"),
                         *dispatch_rules(base[hook])), hook, RELEASED_PRIORITY)
            for name, hook in RELEASED_CHAINS.items()]


TRACE_PREFIX = "NFTPOLICY-TRACE-"  # then the trace's token, "-" and the hook: NFTPOLICY-TRACE-3f9a0c12-INPUT
TRACE_HOOKS: tuple[Hook, ...] = ("input", "forward", "output")


def trace_token(chain: str) -> str | None:
    """The token of the trace that added ``chain`` (a name of :func:`trace_chains`), or None
    for any other chain."""
    if not chain.startswith(TRACE_PREFIX):
        return None
    token, _, hook = chain.removeprefix(TRACE_PREFIX).rpartition("-")
    return token if token and hook.lower() in TRACE_HOOKS else None


def trace_chains(token: str, source: str, destination: str, protocol: str, port: int | None) -> list[Chain]:
    """The chains ``nftpolicy trace`` adds to our table for one connection and deletes after it:
    one per hook of our base chains, hooked just before them (our priority - 1), named after the
    trace's ``token`` (letters and digits: two traces at once have their own chains), whose one
    rule sets ``nftrace`` on the packets ``source`` -> ``destination`` of ``protocol``
    (``ICMP``: echo requests) and destination ``port``."""
    family = family_of(destination)
    matches: list[Statement] = [AddressIs(family, "saddr", (source,)), AddressIs(family, "daddr", (destination,))]
    if protocol == "ICMP":
        matches.append(IcmpTypes(family, ("echo-request",)))
    else:
        matches.append(Protocols((protocol.lower(),)))
        if port is not None:
            matches.append(DestinationPorts(port, port))
    what = f"{protocol}/{port}" if protocol != "ICMP" else "ICMP echo"
    return [Chain(f"{TRACE_PREFIX}{token}-{hook.upper()}", (Rule((*matches, SetTrace()), f"trace {source} -> {destination} {what}"),), hook)
            for hook in TRACE_HOOKS]


def table(model: RuleModel) -> Table:
    """The whole table of ``model``, in dependency order."""
    c = model.config
    chains = [common_chain(), default_chain(c)]
    chains += [laid for chain in model.policy_chains for laid in laid_chains(c, chain)]
    chains += [laid for chain in model.tier_chains for laid in laid_chains(c, chain)]
    chains += [pod_chain(c, pod) for pod in model.pod_chains]
    chains += to_hold_chain(c)
    chains += base_chains(c)
    chains += released_chains(c)
    return Table(c.table, c.priority, model.sets, tuple(chains), dispatch_maps(model.pod_chains),
                 tuple(sorted({chain.policy for chain in model.tier_chains})))
