"""The kernel's rule counters as Prometheus metrics, read when Prometheus scrapes.

Every reject rule of a pod chain and every allow rule of a policy chain carries a counter
(:class:`nftpolicy.translators.layout.Counter`). :class:`RuleCounters` is a prometheus_client
custom collector: on each scrape it lists our table through the dataplane (a terse list: rules
and their counters, no set element) and sums the counters into

* ``nftpolicy_denied_packets_total{namespace, pod, direction}``: packets rejected because no
  policy allowed them, for that direction of that local pod;
* ``nftpolicy_allowed_packets_total{namespace, policy, direction}``: packets a rule of that
  policy allowed (only a connection's first packet walks the chains: later ones are accepted
  as established before the dispatch).

The collector runs in the HTTP server's thread with its own libnftables context, and the kernel
lists a table without holding up a commit. A missing table (before the first sync, or flushed by
another tool) gives no samples. Counters start again at 0 when the agent rewrites a chain (every
full resync, and a pod chain whose policies change); ``rate()`` and ``increase()`` take such
resets in their stride.

Labels come from the chain owners of the model the agent committed
(:meth:`~nftpolicy.translators.noderender.NodeRenderer.chain_owners`: a pod chain's pod, a policy
chain's policy and direction; never from a rule comment, which only describes and which nft cuts
at 128 bytes), the reject's direction from its address match (``daddr``: ingress, ``saddr``:
egress). A chain the committed model does not know (our table changed by hand) is counted under
its own name with direction ``unknown``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterator, Mapping, Protocol

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from nftpolicy.translators.layout import COMMON_CHAIN, DEFAULT_CHAIN
from nftpolicy.translators.rules import ChainOwner

DENIED = ("nftpolicy_denied_packets", "Packets rejected because no policy allowed them, by local pod and direction.",
          ["namespace", "pod", "direction"])
ALLOWED = ("nftpolicy_allowed_packets", "Packets (a connection's first) that a rule of the policy allowed, by policy and direction.",
           ["namespace", "policy", "direction"])


class CountedRules(Protocol):
    """What the collector needs of a dataplane (:class:`~nftpolicy.agent.dataplane.nftables.NftDataplane`)."""

    def counted_rules(self) -> list[dict[str, Any]]:
        """Rule bodies (libnftables JSON) that hold a counter, with its current values."""
        ...


def _packets(rule: dict[str, Any]) -> int:
    return sum(int(e["counter"].get("packets", 0)) for e in rule["expr"] if isinstance(e.get("counter"), dict))


def _direction(rule: dict[str, Any]) -> str:
    """``ingress`` for a rule that matches the pod as destination, ``egress`` as source."""
    for e in rule["expr"]:
        left = e.get("match", {}).get("left")
        if isinstance(left, dict) and left.get("payload", {}).get("field") in ("daddr", "saddr"):
            return "ingress" if left["payload"]["field"] == "daddr" else "egress"
    return "unknown"


def _split(key: str) -> tuple[str, str]:
    namespace, _, name = key.partition("/")
    return (namespace, name) if name else ("", key)


def tally(rules: list[dict[str, Any]], owners: Mapping[str, ChainOwner]) -> tuple[Counter[tuple[str, str, str]], Counter[tuple[str, str, str]]]:
    """(denied, allowed) packet sums of counted rules: ``(namespace, pod, direction)`` and
    ``(namespace, policy, direction)`` -> packets; ``owners``: chain name -> what it enforces."""
    denied: Counter[tuple[str, str, str]] = Counter()
    allowed: Counter[tuple[str, str, str]] = Counter()
    for rule in rules:
        chain = rule.get("chain", "")
        owner = owners.get(chain)
        if chain.startswith("KUBE-POD-FW-"):
            if any("reject" in e for e in rule["expr"]):
                denied[(*_split(owner.pod if owner is not None and owner.pod else chain), _direction(rule))] += _packets(rule)
        elif chain.startswith("KUBE-NWPLCY-") and chain not in (COMMON_CHAIN, DEFAULT_CHAIN):
            if owner is not None and owner.policy is not None and owner.direction is not None:
                allowed[(*_split(owner.policy), owner.direction)] += _packets(rule)
            else:
                allowed[("", chain, "unknown")] += _packets(rule)
    return denied, allowed


class RuleCounters(Collector):
    """A prometheus_client collector of our table's rule counters (module docstring), read from
    ``dataplane`` at each scrape and named by ``owners()`` (chain name -> what it enforces, of the
    committed model); register it with ``registry.register(RuleCounters(dataplane, owners))``."""

    def __init__(self, dataplane: CountedRules, owners: Callable[[], Mapping[str, ChainOwner]]) -> None:
        self.dataplane, self.owners = dataplane, owners

    def describe(self) -> Iterator[Metric]:
        """The metric families without samples (so registering lists nothing)."""
        yield CounterMetricFamily(*DENIED[:2], labels=DENIED[2])
        yield CounterMetricFamily(*ALLOWED[:2], labels=ALLOWED[2])

    def collect(self) -> Iterator[Metric]:
        """List the table now and yield both families (empty when the table is absent)."""
        denied, allowed = tally(self.dataplane.counted_rules(), self.owners())
        for (name, help_text, labels), values in ((DENIED, denied), (ALLOWED, allowed)):
            family = CounterMetricFamily(name, help_text, labels=labels)
            for key, packets in sorted(values.items()):
                family.add_metric(list(key), packets)
            yield family
