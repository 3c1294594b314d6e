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
from typing import Iterable, Mapping

from .layout import Table
from .model import Cluster, Family, domain_name_matches
from .rules import TimedAddress
from .setstore import SetKey


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
