"""Drops that name the pod, allows that name the policy, ClusterNetworkPolicy denies that name
the tier, policy and rule: the real agent's rule counters as Prometheus metrics, after real
packets between sandbox pods in a namespace this test made (read every second here,
``--counters-interval 1``: a probe's count shows within a read). Scrapes are served from the
last read: they list nothing, and each read gives its memory back."""

from __future__ import annotations

import threading

import pytest

from nftpolicy.agent.daemon import rulecounters
from nftpolicy.agent.daemon.rulecounters import RuleCounters, tally
from nftpolicy.agent.dataplane.nftables import NftDataplane
from nftpolicy.translators.rules import ChainOwner, RuleOrigin

from .agentenv import AgentEnv
from .conftest import eventually, nft
from .fakeapi import FakeApiServer
from .fakeclock import FakeClock
from .test_agent_e2e import SLOTS, A, B, policy

pytestmark = pytest.mark.kernel

DENIED_PROBES, ALLOWED_PROBES = 3, 2
READ_EVERY_SECOND = ("--counters-interval", "1")


@pytest.fixture
def env(tmp_path):
    env = AgentEnv(tmp_path, SLOTS, READ_EVERY_SECOND).put_slot_pods()
    try:
        yield env
    finally:
        env.close()


def test_denied_and_allowed_metrics_count_each_probe(env):
    # x/b takes ingress from x/c only; x/a is refused. Only a connection's first packet walks
    # the chains (later ones are established), so each probe is one counted packet.
    env.api.put(policy("b-from-c", {"podSelector": {"matchLabels": {"app": "b"}}, "ingress": [
        {"from": [{"podSelector": {"matchLabels": {"app": "c"}}}], "ports": [{"port": 80}]}]}))
    env.start_agent()
    eventually(lambda: env.connects("x/a", B), False)  # the last probe was the first refused one
    denied = {"namespace": "x", "pod": "b", "direction": "ingress"}
    allowed = {"namespace": "x", "policy": "b-from-c", "direction": "ingress"}
    eventually(lambda: env.metric("nftpolicy_denied_packets_total", **denied), 1)
    for _ in range(DENIED_PROBES):
        assert not env.connects("x/a", B)
    for _ in range(ALLOWED_PROBES):
        assert env.connects("x/c", B)
    eventually(lambda: env.metric("nftpolicy_denied_packets_total", **denied), 1 + DENIED_PROBES)
    eventually(lambda: env.metric("nftpolicy_allowed_packets_total", **allowed), ALLOWED_PROBES)
    # x/b is not isolated for egress: no reject of that direction, so no sample for it
    _, text = env.http("/metrics")
    assert 'direction="egress",namespace="x",pod="b"' not in text
    assert "# TYPE nftpolicy_denied_packets_total counter" in text


def test_first_probe_after_the_sync_counts_from_zero(env):
    """The very first denied probe gives exactly 1 (nothing else walked the chain)."""
    env.api.put(policy("deny-b", {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"]}))
    env.start_agent()
    eventually(lambda: env.metric("nftpolicy_table_objects", type="pod chains"), 1.0)
    sample = 'nftpolicy_denied_packets_total{direction="ingress",namespace="x",pod="b"} 0.0'
    eventually(lambda: sample in env.http("/metrics")[1])  # read since the sync: its chain counted nothing
    assert not env.connects("x/a", B)
    eventually(lambda: env.metric("nftpolicy_denied_packets_total", namespace="x", pod="b", direction="ingress"), 1)


def _namespace(name: str) -> dict:
    return {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": name}}}


def test_a_deny_rule_of_the_admin_tier_counts_under_its_tier_policy_and_rule(tmp_path):
    """x/a's Admin policy (a 253-character name) denies x on port 81 (rule 0) and all of y
    (rule 1): each refused probe from y/d adds one to rule 1 only, and the kernel holds the
    NFLOG prefix cut to 127 bytes after tier, direction and rule index."""
    name = ("d" * 62 + ".") * 4 + "y"
    assert len(name) == 253
    api = FakeApiServer(bookmark_interval=0.5, cluster_network_policies=True)
    api.start()
    env = AgentEnv(tmp_path, SLOTS, READ_EVERY_SECOND, api=api).put_slot_pods()
    try:
        env.api.put({"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": name},
                     "spec": {"tier": "Admin", "priority": 1, "subject": {"pods": {"namespaceSelector": {},
                                                                                   "podSelector": {"matchLabels": {"app": "a"}}}},
                              "ingress": [{"action": "Deny", "from": [_namespace("x")], "protocols": [{"tcp": {"destinationPort": {"number": 81}}}]},
                                          {"action": "Deny", "name": "no-y", "from": [_namespace("y")]}]}})
        env.start_agent()
        eventually(lambda: env.connects("y/d", A), False)  # the last probe was the first refused one
        rule = {"tier": "Admin", "policy": name, "direction": "ingress"}
        eventually(lambda: env.metric("nftpolicy_cluster_denied_packets_total", **rule, rule="1"), 1)
        for _ in range(DENIED_PROBES):
            assert not env.connects("y/d", A)
        eventually(lambda: env.metric("nftpolicy_cluster_denied_packets_total", **rule, rule="1"), 1 + DENIED_PROBES)
        assert env.metric("nftpolicy_cluster_denied_packets_total", **rule, rule="0") == 0
        assert env.connects("x/c", A)  # rule 0 is port 81 only
        _, text = env.http("/metrics")
        assert f'nftpolicy_cluster_denied_packets_total{{direction="ingress",policy="{name}",rule="0",tier="Admin"}} 0.0' in text
        assert "nftpolicy_denied_packets_total{" not in text  # no NetworkPolicy isolates x/a: no pod chain reject
        prefixes = [line.split('log prefix "')[1].split('"')[0] for line in nft(env.netns, "list", "table", "inet", "nftpolicy").splitlines()
                    if "log prefix" in line and "nftpolicy deny" in line]
        assert prefixes == [f"nftpolicy deny Admin ingress rule {i} {name}"[:127] for i in (0, 1)]
    finally:
        env.close()


def test_a_missing_table_gives_no_samples(make_netns):
    collector = RuleCounters(NftDataplane("nftpolicy", make_netns()), dict, 5.0)
    collector.read()
    families = list(collector.collect())
    assert [f.name for f in families] == ["nftpolicy_denied_packets", "nftpolicy_allowed_packets", "nftpolicy_cluster_denied_packets",
                                          "nftpolicy_unknown_pod_over_budget_packets", "nftpolicy_dns_untrusted_packets"]
    assert all(not f.samples for f in families)


class _Listing:
    """A dataplane whose table holds one counted allow of ``packets``; counts its listings."""

    def __init__(self) -> None:
        self.listed, self.packets = 0, 3

    def counted_rules(self):
        self.listed += 1
        return [{"chain": "KUBE-NWPLCY-X", "expr": [{"counter": {"packets": self.packets, "bytes": 180}}, {"accept": None}]}]


def test_scrapes_serve_the_last_read_and_list_nothing(monkeypatch):
    trims = []
    monkeypatch.setattr(rulecounters, "release_memory", lambda: trims.append(len(trims)))
    listing = _Listing()
    collector = RuleCounters(listing, dict, 5.0)
    assert [s for f in collector.collect() for s in f.samples] == []  # before the first read
    collector.read()
    listing.packets = 8  # the kernel counts on; scrapes see it at the next read
    for _ in range(20):
        assert [s.value for f in collector.collect() for s in f.samples] == [3]
    assert (listing.listed, len(trims)) == (1, 1)  # one listing, its memory given back
    collector.read()
    assert [s.value for f in collector.collect() for s in f.samples] == [8] and (listing.listed, len(trims)) == (2, 2)


def test_one_thread_reads_at_each_interval_until_the_stop():
    listing, clock, stop = _Listing(), FakeClock(), threading.Event()
    thread = RuleCounters(listing, dict, 5.0, clock).start(stop)
    assert thread.name == "counters" and thread.daemon
    eventually(lambda: clock.waited, [5.0])  # read at once, then waits
    assert listing.listed == 1
    clock.advance(4.9)
    assert listing.listed == 1
    clock.advance(0.1)
    eventually(lambda: listing.listed, 2)
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive() and listing.listed == 2


def test_labels_come_from_the_chain_owners_and_the_pod_chain_names():
    def rule(chain, comment, field, packets, reject=True, verdict="reject"):
        expr = [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": field}}, "right": "10.0.0.1"}},
                {"counter": {"packets": packets, "bytes": 60 * packets}}]
        expr.append({verdict: None} if reject else {"return": None})
        return {"chain": chain, "comment": comment, "expr": expr}

    long_policy = "shop/" + "a-name-longer-than-the-128-bytes-nft-keeps-of-a-comment-" * 4
    assert len(long_policy) > 128
    owners = {"KUBE-POD-IN-X": ChainOwner(direction="ingress", pod="shop/api-0"), "KUBE-POD-EG-X": ChainOwner(direction="egress", pod="shop/api-0"),
              "KUBE-POD-EG-Y": ChainOwner(direction="egress", pod="shop/db-0"), "KUBE-NWPLCY-P": ChainOwner("shop/api-ingress", "ingress"),
              "KUBE-NWPLCY-Q": ChainOwner(long_policy, "egress")}
    sums = tally([
        rule("KUBE-POD-IN-X", "shop/api-0 reject ingress", "daddr", 2),
        rule("KUBE-POD-IN-X", "shop/api-0 reject ingress", "daddr", 3),  # the tcp reset and the other reject add up
        rule("KUBE-POD-EG-X", "shop/api-0 reject egress", "saddr", 1),
        rule("KUBE-POD-EG-Y", "shop/db-0 drop egress", "saddr", 8, verdict="drop"),  # --deny-action drop
        rule("KUBE-NWPLCY-P", "shop/api-ingress ingress rule 0", "saddr", 4, reject=False),
        rule("KUBE-NWPLCY-P", "shop/api-ingress ingress rule 1", "saddr", 5, reject=False),
        rule("KUBE-NWPLCY-Q", long_policy[:128], "daddr", 6, reject=False),  # the comment nft keeps: cut
        rule("KUBE-NWPLCY-R", "x/changed-by-hand ingress rule 0", "saddr", 7, reject=False),  # no chain of the model
    ], owners)
    assert sums.denied == {("shop", "api-0", "ingress"): 5, ("shop", "api-0", "egress"): 1, ("shop", "db-0", "egress"): 8}
    assert sums.allowed == {("shop", "api-ingress", "ingress"): 9, ("shop", long_policy[5:], "egress"): 6, ("", "KUBE-NWPLCY-R", "unknown"): 7}


def test_tier_denies_are_named_by_the_counted_origins_in_chain_order():
    """A tier chain's k-th counted rule is its owner's k-th counted origin (two counted rules of
    one origin add up: a Deny rule with two peers); a chain the model does not know, or whose counted rules
    differ from the model's, counts under its own name."""
    def rule(chain, packets):
        return {"chain": chain, "comment": "cut or changed: never read", "expr": [{"counter": {"packets": packets, "bytes": 0}}, {"drop": None}]}

    deny_0 = RuleOrigin("guard", "egress", 0, "Admin", "Deny")
    deny_2 = RuleOrigin("guard", "egress", 2, "Admin", "Deny", "rest")
    owners = {"KUBE-ANP-G": ChainOwner("guard", "egress", "Admin", counted=(deny_0, deny_2, deny_2)),
              "KUBE-BANP-H": ChainOwner("base", "ingress", "Baseline", counted=(RuleOrigin("base", "ingress", 0, "Baseline", "Deny"),))}
    sums = tally([rule("KUBE-ANP-G", 1), rule("KUBE-ANP-G", 2), rule("KUBE-ANP-G", 3),
                  rule("KUBE-BANP-H", 4), rule("KUBE-BANP-H", 5),  # two counters, one counted origin: not the model's
                  rule("KUBE-ANP-Z", 6)], owners)
    assert sums.cluster_denied == {("Admin", "guard", "egress", "0"): 1, ("Admin", "guard", "egress", "2"): 5,
                                   ("Baseline", "KUBE-BANP-H", "unknown", "unknown"): 9, ("Admin", "KUBE-ANP-Z", "unknown", "unknown"): 6}
    assert not sums.denied and not sums.allowed


def test_the_dns_holds_counted_rules_are_answers_from_untrusted_resolvers_and_nothing_else():
    """Each hold chain's one counted rule (--dns-learn-from) sums into one sample; without such a
    rule (any resolver trusted) the family has none."""
    def rule(chain, packets):
        return {"chain": chain, "expr": [{"counter": {"packets": packets, "bytes": 0}}]}

    sums = tally([rule("KUBE-DNS-HOLD-FORWARD", 3), rule("KUBE-DNS-HOLD-FORWARD", 4), rule("KUBE-DNS-HOLD-OUTPUT", 5)], {})
    assert sums.dns_untrusted == 12 and not sums.denied and not sums.allowed and not sums.cluster_denied
    [family] = [f for f in RuleCounters._built(sums) if f.name == "nftpolicy_dns_untrusted_packets"]
    assert [(s.name, s.value) for s in family.samples] == [("nftpolicy_dns_untrusted_packets_total", 12)]
    [family] = [f for f in RuleCounters._built(tally([], {})) if f.name == "nftpolicy_dns_untrusted_packets"]
    assert not family.samples
