"""The kernel's rule counters as Prometheus metrics, read by one thread every few seconds.

Every refusal of a pod chain (its rejects, or its drop with ``--deny-action drop``), every allow
rule of a policy chain and every drop of a ClusterNetworkPolicy ``Deny`` rule in a tier chain
carries a counter
(:class:`nftpolicy.translators.layout.CounterStatement`). :class:`RuleCounters` is a prometheus_client
custom collector whose thread (``counters``, :meth:`RuleCounters.start`) lists our table through
the dataplane every ``--counters-interval`` seconds (a terse list: rules and their counters, no
set element) and sums the counters into

* ``nftpolicy_denied_packets_total{namespace, pod, direction}``: packets refused (rejected or
  dropped, as ``--deny-action`` says) because no policy allowed them, for that direction of that local pod;
* ``nftpolicy_allowed_packets_total{namespace, policy, direction}``: packets a rule of that
  policy allowed (only a connection's first packet walks the chains: later ones are accepted
  as established before the dispatch);
* ``nftpolicy_cluster_denied_packets_total{tier, policy, direction, rule}``: packets a
  ClusterNetworkPolicy ``Deny`` rule refused (``rule``: its index in the policy's ingress or
  egress list, from 0). A metric of its own, not a tier label on the denied metric: that one
  counts per local pod what no policy allowed, this one per policy rule (a tier chain is shared
  by every pod its subject selects, so it knows no pod);
* ``nftpolicy_unknown_pod_over_budget_packets_total{direction}``: packets of unknown pods
  (``egress``: from one; ``ingress``: to one) that the kernel dropped instead of queueing them
  for the hold because their source address had used its budget (``--unknown-pod-rate``,
  ``--unknown-pod-burst``): the counted drops of
  :data:`~nftpolicy.translators.layout.TO_HOLD_CHAIN`, in the order of
  :data:`~nftpolicy.translators.layout.OVER_BUDGET_DROPS`;
* ``nftpolicy_dns_untrusted_packets_total``: packets from port 53 to subject pods of domainNames
  peers, replies to a question the pod sent to an address that ``--dns-learn-from`` does not
  trust: not held, not learned (the one counted rule of each hold chain,
  :func:`~nftpolicy.translators.domainnames.with_hold_marks`; absent without the setting).

A scrape serves the families of the last read (at most that interval, plus one read, old): it
lists nothing, takes no lock a sync holds, and costs the same however many scrapers there are
(every listing of the whole table at each scrape, in each scraper's HTTP thread, had run
libnftables concurrently, which aborts the process, and had grown the process by one listing per
concurrent scrape). The memory a read took is given back to the system after it (glibc
``malloc_trim``). Before the first read, and while our table is missing (before the first sync,
or flushed by another tool), the families have no samples. Counters start again at 0 when the
agent rewrites a chain (every full resync, and a pod chain whose policies change); ``rate()``
and ``increase()`` take such resets in their stride.

Labels come from the chain owners of the model the agent committed
(:meth:`~nftpolicy.translators.noderender.NodeRenderer.chain_owners`: a pod chain's pod, a policy
chain's policy and direction, a tier chain's tier, policy, direction and the origin of each of
its counted rules in chain order, which the kernel lists in the same order; never from a rule
comment or an NFLOG prefix, which only describe and which nft cuts at 128 bytes), the refusal's
direction from its pod chain's name (``KUBE-POD-IN-``: ingress, ``KUBE-POD-EG-``: egress). A chain the committed
model does not know (our table changed by hand), or a tier chain whose counted rules are not the
model's, is counted under its own name with direction (and rule) ``unknown``.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from nftpolicy.translators.chainbuilders import POD_CHAIN_PREFIX, TIER_CHAIN_PREFIX
from nftpolicy.translators.domainnames import HOLD_CHAINS
from nftpolicy.translators.layout import COMMON_CHAIN, DEFAULT_CHAIN, OVER_BUDGET_DROPS, TO_HOLD_CHAIN
from nftpolicy.translators.rules import ChainOwner

from nftpolicy.agent.dataplane.nftables import release_memory
from .clock import REAL_TIME, Clock

DENIED = ("nftpolicy_denied_packets", "Packets refused (rejected or dropped) because no policy allowed them, by local pod and direction.",
          ["namespace", "pod", "direction"])
ALLOWED = ("nftpolicy_allowed_packets", "Packets (a connection's first) that a rule of the policy allowed, by policy and direction.",
           ["namespace", "policy", "direction"])
CLUSTER_DENIED = ("nftpolicy_cluster_denied_packets", "Packets that a ClusterNetworkPolicy Deny rule refused, by tier, policy, direction "
                  "and rule index.", ["tier", "policy", "direction", "rule"])
DNS_UNTRUSTED = ("nftpolicy_dns_untrusted_packets", "Packets from port 53 to subject pods of domainNames peers whose question "
                 "went to a resolver --dns-learn-from does not trust: not held, not learned.")
OVER_BUDGET = ("nftpolicy_unknown_pod_over_budget_packets", "Packets of unknown pods that the kernel dropped instead of holding them "
               "because their source address had sent its budget towards the hold (--unknown-pod-rate), by direction.", ["direction"])
FAMILIES = (DENIED, ALLOWED, CLUSTER_DENIED, OVER_BUDGET)


class CountedRules(Protocol):
    """What the collector needs of a dataplane (:class:`~nftpolicy.agent.dataplane.nftables.NftDataplane`)."""

    def counted_rules(self) -> list[dict[str, Any]]:
        """Rule bodies (libnftables JSON) that hold a counter, with its current values."""
        ...


def _packets(rule: dict[str, Any]) -> int:
    return sum(int(e["counter"].get("packets", 0)) for e in rule["expr"] if isinstance(e.get("counter"), dict))


def _split(key: str) -> tuple[str, str]:
    namespace, _, name = key.partition("/")
    return (namespace, name) if name else ("", key)


@dataclass
class Tally:
    """Packet sums of counted rules, by the labels of each metric (module docstring):
    ``denied`` ``(namespace, pod, direction)``, ``allowed`` ``(namespace, policy, direction)``,
    ``cluster_denied`` ``(tier, policy, direction, rule)``, ``over_budget`` ``(direction,)``; ``dns_untrusted``: one sum (None: no
    such rule)."""

    denied: Counter[tuple[str, ...]] = field(default_factory=Counter)
    allowed: Counter[tuple[str, ...]] = field(default_factory=Counter)
    cluster_denied: Counter[tuple[str, ...]] = field(default_factory=Counter)
    over_budget: Counter[tuple[str, ...]] = field(default_factory=Counter)
    dns_untrusted: int | None = None  # None: no counted rule of a hold chain in the kernel


def tally(rules: list[dict[str, Any]], owners: Mapping[str, ChainOwner]) -> Tally:
    """The packet sums of counted rules (in the kernel's order); ``owners``: chain name -> what
    it enforces."""
    sums = Tally()
    tier_rules: dict[str, list[dict[str, Any]]] = {}
    over_budget = iter(OVER_BUDGET_DROPS)
    for rule in rules:
        chain = rule.get("chain", "")
        owner = owners.get(chain)
        direction = next((d for d, prefix in POD_CHAIN_PREFIX.items() if chain.startswith(prefix)), None)
        if direction is not None:  # a pod chain: its direction is in its name
            if any("reject" in e or "drop" in e for e in rule["expr"]):
                sums.denied[(*_split(owner.pod if owner is not None and owner.pod else chain), direction)] += _packets(rule)
        elif chain == TO_HOLD_CHAIN:
            sums.over_budget[(next(over_budget, "unknown"),)] += _packets(rule)
        elif chain in HOLD_CHAINS.values():
            sums.dns_untrusted = (sums.dns_untrusted or 0) + _packets(rule)
        elif chain.startswith(tuple(TIER_CHAIN_PREFIX.values())):
            tier_rules.setdefault(chain, []).append(rule)
        elif chain.startswith("KUBE-NWPLCY-") and chain not in (COMMON_CHAIN, DEFAULT_CHAIN):
            if owner is not None and owner.policy is not None and owner.direction is not None:
                sums.allowed[(*_split(owner.policy), owner.direction)] += _packets(rule)
            else:
                sums.allowed[("", chain, "unknown")] += _packets(rule)
    for chain, counted in tier_rules.items():
        owner = owners.get(chain)
        origins = owner.counted if owner is not None else ()
        for i, rule in enumerate(counted):
            if len(origins) == len(counted):
                o = origins[i]
                sums.cluster_denied[(o.tier or "", o.policy, o.direction, str(o.index))] += _packets(rule)
            else:
                tier = next(t for t, prefix in TIER_CHAIN_PREFIX.items() if chain.startswith(prefix))
                sums.cluster_denied[(tier, chain, "unknown", "unknown")] += _packets(rule)
    return sums


class RuleCounters(Collector):
    """A prometheus_client collector of our table's rule counters (module docstring): the
    families of the last :meth:`read` of ``dataplane``, named by ``owners()`` (chain name -> what
    it enforces, of the committed model); the thread of :meth:`start` reads every ``interval``
    seconds. Register it with ``registry.register(RuleCounters(dataplane, owners, interval))``."""

    def __init__(self, dataplane: CountedRules, owners: Callable[[], Mapping[str, ChainOwner]], interval: float,
                 clock: Clock = REAL_TIME) -> None:
        self.dataplane, self.owners, self.interval, self.clock = dataplane, owners, interval, clock
        self._families = self._built(Tally())  # replaced whole by each read: a scrape sees one read or the next

    def describe(self) -> Iterator[Metric]:
        """The metric families without samples (so registering lists nothing)."""
        return iter(self._built(Tally()))

    def collect(self) -> Iterator[Metric]:
        """The families of the last read (no samples before the first, or while the table is absent)."""
        return iter(self._families)

    def read(self) -> None:
        """List the table now and keep its sums for the scrapes that follow."""
        sums = tally(self.dataplane.counted_rules(), self.owners())
        # The listing is freed now (libnftables' cache and output, the parsed rules: tens of MiB at
        # 150k pods): give it back, or each read leaves the process larger (10k pods: 60 reads
        # 73 -> 125 MiB without, 73 -> 75 MiB with; docs/benchmarks.md)
        release_memory()
        self._families = self._built(sums)

    def start(self, stop: threading.Event) -> threading.Thread:
        """Read now and then every :attr:`interval` seconds, until ``stop`` is set, in a daemon
        thread called ``counters`` (returned)."""
        def run() -> None:
            while True:
                self.read()
                if self.clock.wait(stop, self.interval):
                    return

        thread = threading.Thread(target=run, name="counters", daemon=True)
        thread.start()
        return thread

    @staticmethod
    def _built(sums: Tally) -> list[Metric]:
        families: list[Metric] = []
        for (name, help_text, labels), values in zip(FAMILIES, (sums.denied, sums.allowed, sums.cluster_denied, sums.over_budget)):
            family = CounterMetricFamily(name, help_text, labels=labels)
            for key, packets in sorted(values.items()):
                family.add_metric(list(key), packets)
            families.append(family)
        untrusted = CounterMetricFamily(*DNS_UNTRUSTED)
        if sums.dns_untrusted is not None:
            untrusted.add_metric([], sums.dns_untrusted)
        families.append(untrusted)
        return families
