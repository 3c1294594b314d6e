"""The domainNames peers of a cluster's ClusterNetworkPolicies, as the agent's DNS learner reads
them: which set takes which names, learned from the answers to which pods.

A domainNames peer (network-policy-api v0.2.0, ``ClusterNetworkPolicyEgressPeer.DomainNames``)
is rendered as one set per address family (``KUBE-DNS-<hash>`` of the names,
:class:`~nftpolicy.translators.setstore.SetKey` kind ``domain``, ``flags timeout``) that the
rule matches by destination address. The translator gives such a set no element; the agent
(:mod:`nftpolicy.agent.daemon.dnslearn`) adds the A/AAAA addresses of the DNS answers that the
policy's subject pods receive for a matching name, each with the record's TTL as its timeout.
Pure: no DNS here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .layout import (AddressInSet, AskedAddress, Chain, ConntrackState, CounterStatement, Hook, PerAddressLimit, Protocols, Rule, SetMark,
                     SourcePort, Table)
from .model import Cluster, Family, domain_name_matches, family_of
from .rules import AddressSet, TimedAddress
from .setstore import SetKey

# The hold's own objects (docs/domain-names.md, "The hold"): the subject pods' addresses by
# family, and a base chain per hook of the hold that marks the packets to them.
HOLD_SETS: dict[Family, str] = {"ipv4": "KUBE-DNS-SUBJECTS4", "ipv6": "KUBE-DNS-SUBJECTS6"}
HOLD_CHAINS: dict[Hook, str] = {"forward": "KUBE-DNS-HOLD-FORWARD", "output": "KUBE-DNS-HOLD-OUTPUT"}


@dataclass(frozen=True)
class DomainSet:
    """One domain set: ``name`` (the nft set), its ``family``, the peer's ``names`` (patterns,
    :func:`~nftpolicy.translators.model.domain_name_matches`), the ``clients`` (addresses of the
    subject pods, of ``family`` or not, whose DNS answers fill it) and ``policies`` (the
    ClusterNetworkPolicies whose rules use it, by name)."""

    name: str
    family: Family
    names: tuple[str, ...]
    clients: frozenset[str]
    policies: tuple[str, ...]

    def matches(self, name: str) -> str | None:
        """The first of :attr:`names` that DNS name ``name`` matches, or None."""
        return next((pattern for pattern in self.names if domain_name_matches(pattern, name)), None)


def domain_sets(cluster: Cluster, families: Iterable[Family]) -> tuple[DomainSet, ...]:
    """The domain sets that ``cluster``'s ClusterNetworkPolicies use in the address
    ``families`` rendered (as :func:`~nftpolicy.translators.chainbuilders.peer_sets` names
    them), by set name. A set shared by several policies (the same names) takes the answers to
    the subject pods of each of them."""
    families = tuple(families)
    found: dict[str, tuple[SetKey, set[str], list[str]]] = {}
    pods = [pod for pod in cluster.pods.values() if pod.enforceable]
    for policy in sorted(cluster.cluster_policies.values(), key=lambda p: p.name):
        peers = [peer for rule in policy.egress for peer in rule.peers if peer.domain_names]
        if not peers:
            continue
        clients = {ip for pod in pods if policy.selects(cluster.namespace_labels(pod.namespace), pod.labels) for ip in pod.ips}
        for peer in peers:
            for family in families:
                key = SetKey("domain", family, names=peer.domain_names)
                _, members, users = found.setdefault(key.name, (key, set(), []))
                members.update(clients)
                if policy.name not in users:
                    users.append(policy.name)
    return tuple(DomainSet(name, key.family, key.names, frozenset(members), tuple(users))
                 for name, (key, members, users) in sorted(found.items()))


def with_learned(table: Table, learned: Mapping[str, tuple[TimedAddress, ...]]) -> Table:
    """``table`` with the ``learned`` elements (by set name) in its domain sets, so that a full
    replace of the table keeps what DNS answers taught (each with the time it has left)."""
    if not learned:
        return table
    return dataclasses.replace(table, sets=tuple(dataclasses.replace(s, elements=learned.get(s.name, ())) if s.kind == "domain" else s
                                                 for s in table.sets))


def hold_subjects(sets: Iterable[DomainSet]) -> dict[Family, frozenset[str]]:
    """The addresses of every domain set's clients (the subject pods of domainNames peers), by
    address family: whose DNS answers the hold queues."""
    found: dict[Family, set[str]] = {"ipv4": set(), "ipv6": set()}
    for domain_set in sets:
        for address in domain_set.clients:
            found[family_of(address)].add(address)
    return {family: frozenset(addresses) for family, addresses in found.items()}


def with_hold_marks(table: Table, subjects: Mapping[Family, frozenset[str]], mark: int, rate: int, burst: int,
                    learn_from: Sequence[str] | None = None) -> Table:
    """``table`` with the hold's objects: a set of the ``subjects``' addresses per family
    (:data:`HOLD_SETS`) and a base chain per hook (:data:`HOLD_CHAINS`: ``forward`` for answers
    the node routes to its pods, ``output`` for those a DNS server on the node's own network
    sends) that sets bit ``mark`` on UDP and TCP packets from port 53 to them on connections
    conntrack saw both ways (an answer; a flood of unsolicited packets from port 53 would
    otherwise use up the pod's meter and leave its real answers unheld), and only sets it (``mark |=
    bit``, other bits untouched; no verdict, the table's other base chains decide), at most
    ``rate`` packets a second to each, after a burst of ``rate + burst`` (nft's limit; a meter per hook and family):
    the pod's packets beyond pass unmarked. The hold's queue rule takes only packets with that bit
    (:func:`~nftpolicy.agent.daemon.dnshold.hold_rules`): an answer to any other pod never leaves
    the kernel, and one pod's flood cannot fill the kernel's queue for the others.

    ``learn_from`` (addresses or CIDRs, ``--dns-learn-from``; None: any): only answers on
    connections whose original destination (the resolver the pod asked, before DNAT:
    :class:`~nftpolicy.translators.layout.AskedAddress`) is one of them are marked, before
    the meter (an untrusted server's answers use up no pod's rate); the others are counted by a
    rule of their own (the only counted rule of these chains: ``nftpolicy_dns_untrusted_packets_total``)
    and pass unmarked, so unread (every answer of a family without a trusted address)."""
    sets = tuple(AddressSet(name, family, "addr", tuple(sorted(subjects.get(family, ()))),
                            "subjects of domainNames peers: the DNS hold queues the answers to them")
                 for family, name in HOLD_SETS.items())
    chains = tuple(Chain(chain, tuple(rule for family, name in HOLD_SETS.items() for rule in _hold_rules(chain, family, name, mark, rate,
                                                                                                           burst, learn_from)), hook)
                   for hook, chain in HOLD_CHAINS.items())
    return dataclasses.replace(table, sets=table.sets + sets, chains=table.chains + chains)


def _hold_rules(chain: str, family: Family, subjects: str, mark: int, rate: int, burst: int, learn_from: Sequence[str] | None) -> list[Rule]:
    """The rules of hold chain ``chain`` for ``family`` (:func:`with_hold_marks`)."""
    answers = (Protocols(("udp", "tcp")), SourcePort(53), AddressInSet(family, "daddr", subjects),
               ConntrackState(("established",)))  # replies only: no one else's packets use the pod's meter
    meter = (PerAddressLimit(family, "daddr", f"{chain}-{family[-1]}", rate, burst), SetMark(mark))
    if learn_from is None:
        return [Rule(answers + meter, f"DNS hold: answers to subjects of domainNames peers ({family})")]
    trusted = tuple(a for a in learn_from if family_of(a.partition("/")[0]) == family)
    untrusted = Rule(answers + ((AskedAddress(family, trusted, negated=True),) if trusted else ()) + (CounterStatement(),),
                     f"DNS hold: answers from a resolver not trusted (--dns-learn-from), not learned ({family})")
    if not trusted:
        return [untrusted]
    return [untrusted,
            Rule(answers + (AskedAddress(family, trusted),) + meter,
                 f"DNS hold: answers to subjects of domainNames peers from trusted resolvers ({family})")]
