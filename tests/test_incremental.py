"""Incremental rendering equals rendering from scratch.

A :class:`NodeRenderer` takes random sequences of object changes (pods relabelled, moved,
finished, deleted and re-created; namespaces relabelled; policies deleted, re-created and
rewritten so that shared sets appear and disappear; ClusterNetworkPolicies deleted, re-created,
moved in priority and tier, rewritten). After every step, its model equals a render
of the same cluster from scratch, and the transaction of its changes (``delta_transaction``), applied
to the table that the previous step left (an in-memory table that refuses what the kernel
refuses), gives exactly the table that a full load of the fresh render gives.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nftpolicy.translators import transaction
from nftpolicy.translators.delta import delta_transaction
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.model import Cluster, Namespace
from nftpolicy.translators.noderender import NodeRenderer, build_rule_model
from nftpolicy.translators.rules import Config

from .conftest import example_cluster
from nftpolicy.agent.dataplane.fake import FakeTable

CONFIG = Config()


def _extra_policies() -> dict:
    """Policies that share selectors with each other and with the example, named ports to and
    from peers, ipBlocks with excepts: the shapes whose sets are shared."""
    def netpol(ns: str, name: str, spec: dict) -> tuple[str, dict]:
        return ("extra", {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                          "metadata": {"namespace": ns, "name": name}, "spec": spec})
    ops = {"namespaceSelector": {"matchLabels": {"team": "ops"}}}
    objects = [
        netpol("shop", "from-ops", {"podSelector": {}, "ingress": [{"from": [ops]}]}),
        netpol("shop", "from-ops-too", {"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"from": [ops], "ports": [{"port": 5432}]}]}),
        netpol("ops", "to-shop-named", {"podSelector": {}, "policyTypes": ["Egress"], "egress": [
            {"to": [{"namespaceSelector": {"matchLabels": {"team": "shop"}}}], "ports": [{"port": "metrics"}, {"port": "http"}]},
            {"to": [{"ipBlock": {"cidr": "10.244.0.0/16", "except": ["10.244.2.0/24"]}}], "ports": [{"port": "metrics"}]},
            {"ports": [{"port": "dns", "protocol": "UDP"}]}]}),
        netpol("shop", "peers-by-ports", {"podSelector": {"matchLabels": {"app": "api"}}, "ingress": [  # a peer chain
            {"from": [ops, {"podSelector": {"matchLabels": {"app": "web"}}}, {"ipBlock": {"cidr": "10.244.2.0/24"}}],
             "ports": [{"port": 8080}, {"port": 9000, "endPort": 9010}, {"port": "http"}]}]}),
        netpol("ops", "to-peers-by-ports", {"podSelector": {}, "policyTypes": ["Egress"], "egress": [
            {"to": [{"namespaceSelector": {"matchLabels": {"team": "shop"}}, "podSelector": {"matchLabels": {"app": "db"}}}, ops],
             "ports": [{"port": 5432}, {"protocol": "UDP"}, {"port": "metrics"}]}]}),
        netpol("shop", "cidr", {"podSelector": {"matchLabels": {"app": "api"}}, "ingress": [
            {"from": [{"ipBlock": {"cidr": "10.244.0.0/16", "except": ["10.244.1.0/24"]}}, {"ipBlock": {"cidr": "10.244.1.12/32"}}]}]}),
    ]
    cluster, errors = build_cluster(objects)
    assert not errors
    return dict(cluster.policies)


def _cluster_policies() -> dict:
    """ClusterNetworkPolicies of both tiers over the example: every action, a priority tie,
    named ports both ways, networks, subjects by namespace labels that the changes move."""
    def cnp(name: str, tier: str, priority: int, subject: dict, **rules: list) -> tuple[str, dict]:
        return ("extra", {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
                          "metadata": {"name": name}, "spec": {"tier": tier, "priority": priority, "subject": subject, **rules}})
    ops, shop = {"matchLabels": {"team": "ops"}}, {"matchLabels": {"team": "shop"}}
    objects = [
        cnp("db-guard", "Admin", 10, {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "db"}}}}, ingress=[
            {"action": "Deny", "from": [{"namespaces": ops}], "protocols": [{"tcp": {"destinationPort": {"number": 5432}}}]},
            {"action": "Accept", "from": [{"namespaces": {}}], "protocols": [{"destinationNamedPort": "metrics"}]}]),
        cnp("shop-pass", "Admin", 10, {"namespaces": shop}, ingress=[{"action": "Pass", "from": [{"namespaces": shop}]}], egress=[
            {"action": "Deny", "to": [{"networks": ["10.244.2.0/24", "10.0.0.0/8"]}],
             "protocols": [{"udp": {"destinationPort": {"range": {"start": 50, "end": 60}}}}]}]),
        cnp("default-deny", "Baseline", 100, {"namespaces": {}}, ingress=[{"action": "Deny", "from": [{"namespaces": {}}]}], egress=[
            {"action": "Accept", "to": [{"pods": {"podSelector": {"matchLabels": {"app": "api"}}}}], "protocols": [{"destinationNamedPort": "http"}]},
            {"action": "Pass", "to": [{"namespaces": ops}]}]),
        cnp("peers-by-ports", "Admin", 20, {"namespaces": {}}, ingress=[  # peer chains, one of each action
            {"action": action, "from": [{"namespaces": ops}, {"pods": {"namespaceSelector": shop, "podSelector": {"matchLabels": {"app": app}}}}],
             "protocols": [{"tcp": {"destinationPort": {"number": port}}}, {"udp": {"destinationPort": {"range": {"start": port, "end": port + 9}}}},
                           {"destinationNamedPort": "metrics"}]}
            for action, app, port in (("Deny", "web", 7000), ("Pass", "api", 7100), ("Accept", "db", 7200))]),
    ]
    cluster, errors = build_cluster(objects)
    assert not errors, errors
    return dict(cluster.cluster_policies)


BASE = example_cluster()
POLICIES = {**BASE.policies, **_extra_policies()}
CLUSTER_POLICIES = _cluster_policies()
START = dataclasses.replace(BASE, policies=POLICIES, cluster_policies=CLUSTER_POLICIES)


def _mutate(cluster: Cluster, rng: random.Random) -> tuple[str, str, object]:
    """One random change: ``(kind, key, new object or None)``."""
    action = rng.randrange(12)
    if action >= 9:
        name = rng.choice(sorted(CLUSTER_POLICIES))
        if action == 9:
            return "ClusterNetworkPolicy", name, None if name in cluster.cluster_policies else CLUSTER_POLICIES[name]
        other = CLUSTER_POLICIES[rng.choice(sorted(CLUSTER_POLICIES))]
        if action == 10:  # another priority (ties included) or the other tier
            return "ClusterNetworkPolicy", name, dataclasses.replace(CLUSTER_POLICIES[name], priority=rng.choice([0, 10, 100]),
                                                                     tier=rng.choice(["Admin", "Baseline"]))
        return "ClusterNetworkPolicy", name, dataclasses.replace(CLUSTER_POLICIES[name], ingress=other.ingress, egress=other.egress)
    key = rng.choice(sorted(BASE.pods))
    pod = cluster.pods.get(key) or BASE.pods[key]
    if action == 0:
        return "Pod", key, dataclasses.replace(pod, labels={**pod.labels, "app": rng.choice(["frontend", "api", "db", "cache", "x"])})
    if action == 1:
        return "Pod", key, dataclasses.replace(pod, phase=rng.choice(["Running", "Succeeded", "Pending"]))
    if action == 2:
        return "Pod", key, dataclasses.replace(pod, ips=(f"10.244.{rng.choice([1, 2])}.{rng.randrange(10, 16)}",))
    if action == 3:
        return "Pod", key, None if key in cluster.pods else BASE.pods[key]
    if action == 4:
        return "Pod", key, dataclasses.replace(pod, node=rng.choice(["node1", "node2"]))
    if action == 5:
        name = rng.choice(sorted(cluster.namespaces))
        ns = cluster.namespaces[name]
        return "Namespace", name, Namespace(name, {**ns.labels, "team": rng.choice(["ops", "shop", "none"])})
    name = rng.choice(sorted(POLICIES))
    if action == 6:
        return "NetworkPolicy", name, None
    if action == 7:
        return "NetworkPolicy", name, POLICIES[name]
    other = POLICIES[rng.choice(sorted(POLICIES))]  # another policy's rules under this name
    policy = POLICIES[name]
    return "NetworkPolicy", name, dataclasses.replace(policy, ingress=other.ingress, egress=other.egress, policy_types=other.policy_types)


def _apply(cluster: Cluster, kind: str, key: str, obj: object) -> Cluster:
    field = {"Pod": "pods", "Namespace": "namespaces", "NetworkPolicy": "policies", "ClusterNetworkPolicy": "cluster_policies"}[kind]
    objects = dict(getattr(cluster, field))
    if obj is None:
        objects.pop(key, None)
    else:
        objects[key] = obj
    return dataclasses.replace(cluster, **{field: objects})


@pytest.mark.parametrize("node", ["node1", "node2", None])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 25), batch=st.integers(1, 4))
def test_incremental_equals_scratch(node, seed, steps, batch):
    rng = random.Random(seed)
    cluster = START
    renderer = NodeRenderer(node, CONFIG).load(cluster)
    renderer.take_changes()
    table = FakeTable().apply(transaction.full(renderer.model()))
    for _ in range(steps):
        for _ in range(batch):  # several changes within one sync
            kind, key, obj = _mutate(cluster, rng)
            cluster = _apply(cluster, kind, key, obj)
            renderer.apply(kind, key, obj)
        fresh = build_rule_model(cluster, node, CONFIG)
        assert renderer.model() == fresh
        changes = renderer.take_changes()
        table.apply(delta_transaction(CONFIG, changes))
        assert table.state() == FakeTable().apply(transaction.full(fresh)).state()


def test_nothing_changed_gives_no_changes():
    renderer = NodeRenderer("node1", CONFIG).load(START)
    renderer.take_changes()
    pod = START.pods[sorted(START.pods)[0]]
    renderer.set_pod(pod.key, dataclasses.replace(pod))  # an equal object
    assert not renderer.take_changes()


def test_a_label_change_of_a_remote_pod_only_moves_elements():
    """A pod on another node changes labels: only set elements change, in the sets whose
    selectors it enters or leaves."""
    renderer = NodeRenderer("node1", CONFIG).load(START)
    renderer.take_changes()
    remote = next(p for p in START.pods.values() if p.node == "node2")
    renderer.set_pod(remote.key, dataclasses.replace(remote, labels={**remote.labels, "app": "api"}))
    changes = renderer.take_changes()
    assert changes.elements_added or changes.elements_removed
    assert not changes.chains and not changes.sets_added and not changes.sets_removed


def test_a_namespace_label_change_only_moves_the_elements_of_the_selectors_it_changes():
    """A namespace label that no namespaceSelector reads changes nothing; one that makes
    ``team=ops`` stop matching takes that namespace's pods out of those selectors' sets, and
    nothing else changes (no set or chain made, dropped or rewritten)."""
    renderer = NodeRenderer("node1", CONFIG).load(START)
    renderer.take_changes()
    ops = START.namespaces["ops"]
    renderer.set_namespace("ops", Namespace("ops", {**ops.labels, "unrelated": "x"}))
    assert not renderer.take_changes()
    renderer.set_namespace("ops", Namespace("ops", {**ops.labels, "team": "none"}))
    changes = renderer.take_changes()
    assert changes.elements_removed and not changes.elements_added
    assert not changes.chains and not changes.sets_added and not changes.sets_removed
    assert renderer.model() == build_rule_model(_apply(START, "Namespace", "ops", Namespace("ops", {**ops.labels, "team": "none"})), "node1", CONFIG)


@pytest.mark.parametrize("change", ["label", "delete", "create"])
def test_a_local_pod_change_rebuilds_only_its_own_pod_chains(monkeypatch, change):
    """A local pod is relabelled, deleted or created: the renderer builds that pod's chains and no
    other (the cost does not grow with local pods x policies); the model still equals a render
    from scratch."""
    from nftpolicy.translators import noderender
    local = [p for p in BASE.pods.values() if p.node == "node1" and p.enforceable]
    assert len(local) >= 3
    pod = local[0]
    start = _apply(START, "Pod", pod.key, None) if change == "create" else START
    renderer = NodeRenderer("node1", CONFIG).load(start)
    renderer.take_changes()
    built: list[str] = []
    real = noderender.build_pod_chains
    monkeypatch.setattr(noderender, "build_pod_chains", lambda p, *a: built.append(p.key) or real(p, *a))
    new = {"label": dataclasses.replace(pod, labels={**pod.labels, "app": "api"}), "delete": None, "create": pod}[change]
    renderer.set_pod(pod.key, new)
    renderer.take_changes()
    assert set(built) <= {pod.key}
    assert renderer.model() == build_rule_model(_apply(start, "Pod", pod.key, new), "node1", CONFIG)


def test_a_shared_set_goes_with_its_last_user():
    renderer = NodeRenderer(None, CONFIG).load(START)
    renderer.take_changes()
    model = renderer.model()
    (shared,) = [s.name for s in model.sets if s.comment == "pods in namespaces team=ops: (any)"]
    users = sorted({("NetworkPolicy", c.policy) for c in model.policy_chains
                    for r in (*c.rules, *(p for peers in c.peer_chains for p in peers.rules)) if r.peer_set == shared}
                   | {("ClusterNetworkPolicy", c.policy) for c in model.tier_chains
                      for r in (*c.rules, *(p for peers in c.peer_chains for p in peers.rules)) if r.peer_set == shared})
    assert len(users) >= 3 and {kind for kind, _ in users} == {"NetworkPolicy", "ClusterNetworkPolicy"}
    for kind, key in users[:-1]:
        renderer.apply(kind, key, None)
        assert shared in {s.name for s in renderer.model().sets}
    renderer.apply(*users[-1], None)
    assert shared not in {s.name for s in renderer.model().sets}
    assert shared in renderer.take_changes().sets_removed


def test_the_fake_refuses_an_address_mapped_to_another_pod_chain_as_the_kernel_does():
    """``nft add element`` of a verdict-map key that maps to another chain fails ("File
    exists"): a delta that re-maps an address without deleting it first must fail here too."""
    from nftpolicy.agent.dataplane.fake import FakeNftError
    from nftpolicy.translators.layout import POD_MAPS, MapElement
    from nftpolicy.translators.transaction import Elements, Transaction
    model = build_rule_model(example_cluster(), "node1")
    table = FakeTable().apply(transaction.full(model))
    first, second = model.pod_chains[0], model.pod_chains[1]
    same = Transaction(model.config.table, model.config.priority)
    same.add(Elements(POD_MAPS[first.direction]["ipv4"], (MapElement(first.ips[0], first.name, first.pod),)))
    table.apply(same)  # the same mapping again: nft accepts it
    other = Transaction(model.config.table, model.config.priority)
    other.add(Elements(POD_MAPS[first.direction]["ipv4"], (MapElement(first.ips[0], second.name, second.pod),)))
    with pytest.raises(FakeNftError, match=f"{first.ips[0]} is mapped to {first.name} already"):
        table.apply(other)
