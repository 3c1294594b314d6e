"""The rule model: kube-router's network-policy topology as plain data (its types and names).

The rule model names every chain and set and says what each rule allows, without nft or iptables
syntax; :mod:`nftpolicy.translators.noderender` builds it from the cluster (and keeps it up to
date object by object), :mod:`nftpolicy.translators.nft` turns it into an nftables ruleset. The layout is
DESIGN.md section 2 (kube-router's ``KUBE-ROUTER-*`` -> ``KUBE-POD-FW-<hash>`` ->
``KUBE-NWPLCY-<hash>``, with a pod chain per direction: ``KUBE-POD-IN-<hash>``,
``KUBE-POD-EG-<hash>``), the semantics section 3 (the NetworkPolicy API reference):

* a pod is isolated for a direction when a policy of that type selects it; its chain of that
  direction then jumps to the policy chains of that direction, else (a ClusterNetworkPolicy
  tier only) to ``KUBE-NWPLCY-DEFAULT``;
* a policy chain has one :class:`MatchRule` per allowed (peers, port) tuple;
* peers are shared sets, named after what they select: pod addresses (``addr``), an ipBlock
  minus its own excepts (``interval``), or ``address . protocol . port`` triples where a named
  port resolves per pod (``named_port``).

Only policies that select a pod on the node are rendered, so the ruleset grows with local pods,
their policies and those policies' peers, never with pods x policies.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import ipaddress
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Literal

from .model import Action, Direction, Family, Protocol, Tier

# What the kernel does with a packet no NetworkPolicy allowed where one isolates the pod
# (``--deny-action``): ``reject`` answers it (a TCP reset, else ICMP port unreachable: the client
# fails at once, as with kube-router), ``drop`` discards it (the client times out).
DenyAction = Literal["reject", "drop"]
DENY_ACTIONS: tuple[DenyAction, ...] = ("reject", "drop")
# What the kernel does with a packet from or to an unknown pod: an address in the node's pod
# CIDRs that is no local pod the table knows yet (``--unknown-pods``, docs/design.md "A new pod
# from its first packet"): ``hold`` marks it for the agent's hold queue, which releases it once
# the pod is programmed (or drops it after the hold), ``drop`` drops it at once, ``off`` lets it
# through as a pod no policy selects (the window every peer has).
UnknownPods = Literal["hold", "drop", "off"]
UNKNOWN_PODS: tuple[UnknownPods, ...] = ("hold", "drop", "off")
FAMILIES: tuple[Family, ...] = ("ipv4", "ipv6")
COMMENT_MAX_BYTES = 128  # see comment()
LOG_PREFIX_MAX_BYTES = 127  # see log_prefix_text()


@dataclass(frozen=True)
class Config:
    """Rendering settings (DESIGN.md sections 2 and 5), defaults as kube-router.

    ``priority`` is the base chains' hook priority (0 is nft's ``filter``); marks are bit masks;
    ``pass_mark`` is set by a ClusterNetworkPolicy ``Pass`` rule and lives only inside a pod
    chain (cleared before its tier ends); ``node_port_range`` is inclusive; CIDR strings may
    mix families. ``deny_action`` is what a pod chain does with what no NetworkPolicy allowed
    (:data:`DenyAction`; a ClusterNetworkPolicy ``Deny`` always drops: see
    :func:`~nftpolicy.translators.layout.tier_rule`). ``unknown_pods``: what a packet from or
    to an unknown pod gets (:data:`UnknownPods`); ``pod_cidrs``: the node's pod CIDRs where the
    CNI's IPAM does not use ``Node.spec.podCIDRs`` (empty: those); ``unknown_ingress_mark`` and
    ``unknown_egress_mark`` are set on a packet to hold whose destination (source) is an
    unknown pod, ``released_mark`` by the agent on a packet it releases. ``unknown_pod_rate`` and
    ``unknown_pod_burst``: the packets a second (after a burst of ``unknown_pod_burst`` at once, nft's limit)
    that one source address may send towards the hold (:func:`~nftpolicy.translators.layout.to_hold_chain`).
    """

    table: str = "nftpolicy"
    priority: int = 0
    policy_mark: int = 0x10000
    passed_mark: int = 0x20000
    pass_mark: int = 0x40000
    service_cidrs: tuple[str, ...] = ("10.96.0.0/12",)
    node_port_range: tuple[int, int] | None = (30000, 32767)
    external_cidrs: tuple[str, ...] = ()
    nflog_group: int = 100
    deny_action: DenyAction = "reject"
    unknown_pods: UnknownPods = "off"
    pod_cidrs: tuple[str, ...] = ()
    unknown_ingress_mark: int = 0x1000000
    unknown_egress_mark: int = 0x2000000
    released_mark: int = 0x4000000
    unknown_pod_rate: int = 20
    unknown_pod_burst: int = 40

    def unknown_marks(self) -> dict[Direction, int]:
        """The unknown mark of each direction: ``ingress`` (the destination is an unknown pod),
        ``egress`` (the source is)."""
        return {"ingress": self.unknown_ingress_mark, "egress": self.unknown_egress_mark}


@dataclass(frozen=True)
class AddressSet:
    """A named set of one family.

    ``kind`` ``addr``: address strings; ``interval``: network strings, disjoint and sorted;
    ``named_port``: ``(address, protocol, port)`` triples, protocol lower case; ``domain``:
    :class:`TimedAddress` elements, which only the agent has (DNS answers): a render's are empty.
    """

    name: str
    family: Family
    kind: Literal["addr", "interval", "named_port", "domain"]
    elements: tuple[Any, ...]
    comment: str


@dataclass(frozen=True)
class UnionPeer:
    """One peer of a union set (:class:`UnionSet`): ``text``, what it selects (the comment its
    own set would have: ``pods in x: app=web``, ``ipBlock 10.0.0.0/8 except 10.1.0.0/16``), and
    the ``elements`` it gives the union (addresses, or the networks of its ipBlock minus its own
    excepts), sorted."""

    text: str
    elements: tuple[str, ...]


@dataclass(frozen=True)
class UnionSet:
    """Which peer gives what to the union set ``name`` (of a rule with several pod-selector
    peers, or several ipBlocks of one family), for explain and trace to name the peer(s) a
    connection matched; the kernel's set holds only the union."""

    name: str
    peers: tuple[UnionPeer, ...]

    def matching(self, address: str) -> tuple[str, ...]:
        """The texts of the peers that give ``address`` (canonical text) to the union."""
        ip = ipaddress.ip_address(address)
        return tuple(peer.text for peer in self.peers
                     if any(ip in ipaddress.ip_network(e) if "/" in e else ip == ipaddress.ip_address(e) for e in peer.elements))


@dataclass(frozen=True)
class TimedAddress:
    """An element of a ``domain`` set: ``address`` for ``timeout`` more seconds (then the
    kernel removes it)."""

    address: str
    timeout: int


@dataclass(frozen=True)
class PortMatch:
    """A protocol, optionally with the inclusive port range ``first..last``."""

    protocol: Protocol
    first: int | None = None
    last: int | None = None


@dataclass(frozen=True)
class RuleOrigin:
    """The policy rule a :class:`MatchRule` comes from, as data (comments only describe; nft cuts
    them at 128 bytes): ``policy`` (a NetworkPolicy's ``namespace/name`` or a
    ClusterNetworkPolicy's name), ``direction``, ``index`` (the rule's place in the policy's
    ingress or egress list, from 0), ``tier`` (None for a NetworkPolicy), ``action`` (a
    NetworkPolicy rule only allows: ``Accept``) and ``name`` (a ClusterNetworkPolicy rule's
    optional name)."""

    policy: str
    direction: Direction
    index: int
    tier: Tier | None = None
    action: Action = "Accept"
    name: str = ""


@dataclass(frozen=True)
class MatchRule:
    """One (peer, port) match of a NetworkPolicy or ClusterNetworkPolicy rule and the rule it
    comes from (``origin``, which holds the action: a NetworkPolicy rule sets the policy mark and
    returns).

    ``peer_set`` names the set the peer address (source for ingress, destination for egress)
    must be in; None means any peer, unless ``peer_chain`` names the :class:`PeerChain` (of the
    same policy chain) that this rule jumps to once its port matches: the rule's peers are
    matched there, one rule per peer set, so a rule of P peer sets and Q ports costs P + Q rules,
    never P x Q. ``named_port_set`` names a ``named_port`` set that the
    packet's ``destination address . protocol . port`` must be in (for an egress named port it
    holds the peers' addresses, so it is the peer match as well). ``family`` is None when the
    rule has no address match and applies to both families.
    """

    family: Family | None
    peer_set: str | None
    port: PortMatch | None
    named_port_set: str | None
    origin: RuleOrigin
    comment: str
    peer_chain: str | None = None


@dataclass(frozen=True)
class PeerChain:
    """The chain of one rule of a policy that has several peer sets and several ports: the port
    matches of the rule jump here, and each of ``rules`` (a peer set of one family, no port)
    does the rule's action (a NetworkPolicy rule: set the policy mark and return).
    ``KUBE-NWPLCY-<hash>`` of a NetworkPolicy's rule (the hash of the policy's namespace, name,
    direction and rule index), ``KUBE-ANP-<hash>`` or ``KUBE-BANP-<hash>`` of a
    ClusterNetworkPolicy's (its name, direction and rule index)."""

    name: str
    rules: tuple[MatchRule, ...]


@dataclass(frozen=True)
class PolicyChain:
    """``KUBE-NWPLCY-<hash>`` for one policy and one direction; no rules means deny all.
    ``peer_chains``: the chains its rules' port matches jump to (:attr:`MatchRule.peer_chain`).
    ``fail_closed``: why the policy is enforced fail-closed (:attr:`NetworkPolicy.fail_closed`)."""

    name: str
    policy: str
    direction: Direction
    rules: tuple[MatchRule, ...]
    comment: str
    peer_chains: tuple[PeerChain, ...] = ()
    fail_closed: str | None = None


@dataclass(frozen=True)
class TierChain:
    """``KUBE-ANP-<hash>`` (Admin tier) or ``KUBE-BANP-<hash>`` (Baseline tier) for one
    ClusterNetworkPolicy and one direction: its rules in precedence order; ``peer_chains`` as a
    :class:`PolicyChain`'s. ``fail_closed``: why its rules were failed closed
    (:attr:`ClusterNetworkPolicy.fail_closed`)."""

    name: str
    policy: str
    tier: Tier
    direction: Direction
    rules: tuple[MatchRule, ...]
    comment: str
    peer_chains: tuple[PeerChain, ...] = ()
    fail_closed: str | None = None


@dataclass(frozen=True)
class PodChain:
    """One direction's chain of one local pod: ``KUBE-POD-IN-<hash>`` (ingress, entered by the
    pod's addresses as destination) or ``KUBE-POD-EG-<hash>`` (egress, by them as source); both
    of a pod share the hash. A pod has a chain only for a direction it is isolated in (a policy
    of that direction or a ClusterNetworkPolicy tier chain of it selects it).

    ``policies`` lists the policy chains of the NetworkPolicies that isolate the pod for
    ``direction``; None means no NetworkPolicy does (jump ``KUBE-NWPLCY-DEFAULT``, after the
    Baseline tier). ``empty``: those of them that have no rule (a deny-all policy's: it allows
    nothing), which the pod chain does not jump to. ``admin`` and ``baseline`` list the tier
    chains of the ClusterNetworkPolicies that select the pod for ``direction``, in evaluation
    order (``(priority, name)``).
    """

    name: str
    pod: str
    direction: Direction
    ips: tuple[str, ...]
    policies: tuple[str, ...] | None
    comment: str
    admin: tuple[str, ...] = ()
    baseline: tuple[str, ...] = ()
    tier_policies: tuple[tuple[str, str], ...] = ()  # (tier chain, ClusterNetworkPolicy name), for comments
    empty: tuple[str, ...] = ()


@dataclass(frozen=True)
class RuleModel:
    """The whole desired ruleset for one node, every tuple sorted for stable output.
    ``unions``: the peers of each union set of ``sets`` (empty where the model was made
    without them: the agent's commit needs none)."""

    config: Config
    sets: tuple[AddressSet, ...]
    policy_chains: tuple[PolicyChain, ...]
    pod_chains: tuple[PodChain, ...]
    tier_chains: tuple[TierChain, ...] = ()
    unions: tuple[UnionSet, ...] = ()


AnyChain = PolicyChain | PodChain | TierChain


@dataclass(frozen=True)
class ChainOwner:
    """What a chain of the model enforces: ``policy`` (a NetworkPolicy's ``namespace/name``, or
    with ``tier`` a ClusterNetworkPolicy's name) in ``direction``, or for a pod chain the local
    pod ``pod`` (``namespace/name``). ``counted``: for a tier chain, the origin of each of its
    layout rules that holds a counter, in chain order
    (:func:`~nftpolicy.translators.layout.counted_origins`; empty where not filled in)."""

    policy: str | None = None
    direction: Direction | None = None
    tier: Tier | None = None
    pod: str | None = None
    counted: tuple[RuleOrigin, ...] = ()


def owner_of(chain: AnyChain) -> ChainOwner:
    """The :class:`ChainOwner` of a policy, tier or pod chain."""
    if isinstance(chain, PodChain):
        return ChainOwner(direction=chain.direction, pod=chain.pod)
    return ChainOwner(chain.policy, chain.direction, chain.tier if isinstance(chain, TierChain) else None)


def chain_owners(model: RuleModel) -> dict[str, ChainOwner]:
    """Chain name -> :class:`ChainOwner` for every policy, tier and pod chain of ``model``, and
    every peer chain of a policy or tier chain (its policy's owner)."""
    chains: list[AnyChain] = [*model.policy_chains, *model.tier_chains, *model.pod_chains]
    owners = {c.name: owner_of(c) for c in chains}
    ruled: list[PolicyChain | TierChain] = [*model.policy_chains, *model.tier_chains]
    owners.update((peers.name, owner_of(c)) for c in ruled for peers in c.peer_chains)
    return owners


@dataclass
class Changes:
    """What changed in a node's rule model between two points (the node renderer's
    ``take_changes``).

    ``sets_added``/``sets_removed``: whole sets (added ones with their elements);
    ``elements_added``/``elements_removed``: set name -> elements, for sets that exist before and
    after; ``chains``: chain name -> (before, after), each a PolicyChain, a PodChain, a TierChain or None
    (absent), only where they differ.
    """

    sets_added: list[AddressSet] = field(default_factory=list)
    sets_removed: list[str] = field(default_factory=list)
    elements_added: dict[str, list[Any]] = field(default_factory=dict)
    elements_removed: dict[str, list[Any]] = field(default_factory=dict)
    chains: dict[str, tuple[AnyChain | None, AnyChain | None]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.sets_added or self.sets_removed or self.elements_added or self.elements_removed or self.chains)


def hashed_name(prefix: str, *identity: str) -> str:
    """``prefix`` + the first 16 characters of base32(sha256(identity)) (DESIGN.md section 2).

    The identity parts are joined with NUL so that ``("ab", "c")`` and ``("a", "bc")`` differ.
    """
    digest = hashlib.sha256("\0".join(identity).encode()).digest()
    return prefix + base64.b32encode(digest).decode()[:16]


# The Unicode categories whose characters never reach a printed comment or log prefix as they
# are: control (Cc: C0, DEL, C1), format (Cf: bidirectional overrides, zero widths, the BOM),
# surrogates (Cs: no UTF-8 for them), line and paragraph separators (Zl, Zp).
ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _safe_character(character: str, also: str) -> str:
    """One character as :func:`safe_text` writes it."""
    if character == '"':
        return "'"
    if character in also or unicodedata.category(character) in ESCAPED_CATEGORIES:
        code = ord(character)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
    return character


def safe_text(text: str, limit: int, also: str = "") -> str:
    """``text`` as every printer of ours may put it between double quotes (an nft or
    iptables-restore word, a libnftables JSON string, an ``ipset restore`` comment line), at most
    ``limit`` bytes of UTF-8, cut after the last whole character (never inside one, nor inside an
    escape).

    A double quote becomes ``'``; a character of :data:`ESCAPED_CATEGORIES` or of ``also``
    becomes its escape, ``\\x00``, ``\\u202e`` or ``\\U000e0001`` (Python's spelling). Each refusal
    this prevents, found against the real tools (``tests/test_safe_text.py`` checks every one):
    libnftables 1.0.6 refuses a NUL in its JSON input (its JSON parser fails, and the batch is
    then read as nft syntax: ``syntax error, unexpected '{'``) and ends nft syntax at one;
    ``nft`` syntax has no escape for ``"``; ``iptables-restore`` 1.8.9 refuses a newline and a
    ``"`` in a quoted word and cuts the line at a NUL (the rule loses its target, silently);
    ``ipset restore`` 7.17 refuses a newline in a comment line (the rest of the line is a
    command). The other control and format characters load, but end a line for Python's and
    other readers of ``nft list ruleset`` and the trace monitor, or show text that is not there
    (a bidirectional override). A backslash stays as it is: the text is a description only (data
    travels as typed fields), and so the function is idempotent:
    ``safe_text(safe_text(t, n, a), n, a) == safe_text(t, n, a)``."""
    if text.isprintable() and not any(map(text.__contains__, also)):  # nothing to escape: at C speed
        text = text.replace('"', "'")
        return text[:limit] if text.isascii() else text.encode()[:limit].decode(errors="ignore")
    pieces, size = [], 0
    for character in text:
        piece = _safe_character(character, also)
        size += len(piece.encode())
        if size > limit:
            break
        pieces.append(piece)
    return "".join(pieces)


def comment(text: str, limit: int = COMMENT_MAX_BYTES) -> str:
    """``text`` as an nft comment (a rule's, a set's, a map's): :func:`safe_text` within
    ``limit`` bytes. The limit is libnftables': nft syntax refuses a comment longer than 128
    bytes (``NFTNL_UDATA_COMMENT_MAXLEN``: "comment too long, 128 characters maximum allowed");
    its JSON parser checks nothing, and libnftables 1.0.6 ends the process (``netlink_linearize.c:
    Memory allocation failure``) on a rule comment of 254 bytes or more."""
    return safe_text(text, limit)


def log_prefix_text(text: str) -> str:
    """``text`` as an nft ``log prefix``: :func:`safe_text` within :data:`LOG_PREFIX_MAX_BYTES`
    (the kernel's ``NF_LOG_PREFIXLEN``, 128 with the NUL: a longer prefix is refused with
    "Numerical result out of range"), with ``$`` escaped too (nft syntax reads ``$name`` in a
    log prefix as a variable: "unknown identifier")."""
    return safe_text(text, LOG_PREFIX_MAX_BYTES, also="$")


@functools.lru_cache(maxsize=1 << 17)
def address_order(ip: str) -> tuple[int, int]:
    """Sort key of an address: family, then numeric value."""
    address = ipaddress.ip_address(ip)
    return address.version, int(address)
