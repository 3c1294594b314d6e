"""The element cap counted on the cluster (issue 30, item 2): what a policy's shared selector
sets hold depends on the pods its peers select, not on the object alone, so the node renderer
counts it (``NodeRenderer(max_elements=...)``, ``SelectorSets.elements``) before it builds a
policy's chains and again when a set they use gains elements; beyond ``--max-object-elements``
the policy is enforced fail-closed, with the same log line, Event and metric as the caps read
from the object (nftpolicy.translators.objectcost).

The hostile shape: one NetworkPolicy whose peers all have distinct selectors that all match
every pod (``matchExpressions: [{key: xN, operator: DoesNotExist}]``, ``namespaceSelector: {}``),
a rule each: N sets of every pod's address, N x pods elements from an object of N peers. No kernel: the
store, the recorder and the reconciler are the agent's own, over the in-memory dataplane."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from nftpolicy.agent.dataplane.fake import FakeNftDataplane
from nftpolicy.agent.daemon.events import OVER_LIMIT, EventRecorder, Subject, event_writer
from nftpolicy.agent.daemon.health import Health
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.reconcile import Reconciler
from nftpolicy.agent.daemon.store import KINDS, Store
from nftpolicy.translators.manifests import build_cluster, pod_from
from nftpolicy.translators.model import Cluster
from nftpolicy.translators.noderender import NodeRenderer
from nftpolicy.translators.objectcost import ObjectLimits
from nftpolicy.translators.rules import Config

from .test_events import MemoryWriter, drain

CAP = 20_000
NODE = "n0"


def pod(i: int, ns: str = "x") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": ns, "name": f"p{i}", "labels": {"app": f"a{i % 50}"}},
            "spec": {"nodeName": f"n{i % 3}", "containers": [{"name": "c"}]},
            "status": {"phase": "Running", "podIPs": [{"ip": f"10.{i // 65536}.{i // 256 % 256}.{i % 256}"}]}}


def all_selecting(peers: int, name: str = "hostile") -> dict[str, Any]:
    """A NetworkPolicy of ``peers`` distinct peers that each select every pod of the cluster, a
    rule each (so that no set per rule could merge them)."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "x", "name": name, "uid": "u-" + name,
                                                                                        "generation": 1},
            "spec": {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {"matchExpressions": [
                {"key": f"x{i}", "operator": "DoesNotExist"}]}}]} for i in range(peers)]}}


FINE = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "x", "name": "fine"},
        "spec": {"podSelector": {"matchLabels": {"app": "a1"}}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a2"}}}]}]}}


def cluster(pods: int, *policies: dict[str, Any]) -> Cluster:
    built, errors = build_cluster([("t", pod(i)) for i in range(pods)] + [("t", p) for p in policies])
    assert not errors
    return built


def chain_of(renderer: NodeRenderer, key: str):
    ((chain, _),) = [entry for (k, _), entry in renderer.policies.chains.items() if k == key]
    return chain


def test_distinct_all_selecting_peers_are_enforced_fail_closed_and_the_rest_as_written():
    hostile = cluster(500, all_selecting(300), FINE)
    uncapped = NodeRenderer(NODE).load(hostile)
    assert uncapped.counts()["sets"] == 301 and uncapped.counts()["elements"] == 300 * 500 + 10  # the hole: 150,000 from 300 peers
    renderer = NodeRenderer(NODE, max_elements=CAP).load(hostile)
    (why,) = renderer.over_limit().values()
    assert list(renderer.over_limit()) == [("NetworkPolicy", "x/hostile")]
    # counted set by set, stopped once beyond the cap: 41 sets of 500 addresses
    assert str(why) == ("spec: 20500 or more set elements beyond one per pod address (the addresses of the pods and nodes its peers select, its networks) "
                        "exceed the cap of 20000 per object (--max-object-elements): enforced fail-closed")
    closed = chain_of(renderer, "x/hostile")
    assert closed.rules == () and closed.fail_closed == (  # its pods isolated, nothing allowed; explain says why
        "spec: more set elements beyond one per pod address (the addresses of the pods and nodes its peers select, its networks) than the cap of 20000 per "
        "object (--max-object-elements): enforced fail-closed")
    assert chain_of(renderer, "x/fine").rules  # the other policy still enforced
    assert renderer.counts()["sets"] == 1 and renderer.counts()["elements"] == 10
    assert renderer.policy("NetworkPolicy", "x/hostile") == hostile.policies["x/hostile"]  # the object as given


def test_an_object_under_the_cap_is_rendered_as_without_one():
    within = cluster(500, all_selecting(41), FINE)  # 41 x 500, beyond one per pod address: 20,000 (and FINE's 10: a cap per object)
    assert NodeRenderer(NODE, max_elements=20_000).load(within).model() == NodeRenderer(NODE).load(within).model()
    assert list(NodeRenderer(NODE, max_elements=19_999).load(within).over_limit()) == [("NetworkPolicy", "x/hostile")]


def test_pods_that_arrive_push_an_object_over_and_it_closes_as_a_full_render_would():
    renderer = NodeRenderer(NODE, max_elements=CAP).load(cluster(500, all_selecting(41), FINE))  # 41 x 500 - 500 = 20,000
    renderer.take_changes()
    assert not renderer.over_limit()
    for i in range(500, 520):  # 41 x 520 - 520 = 20,800: beyond
        renderer.set_pod(f"x/p{i}", pod_from(pod(i)))
    changes = renderer.take_changes()
    assert list(renderer.over_limit()) == [("NetworkPolicy", "x/hostile")]
    assert len(changes.sets_removed) == 41 and chain_of(renderer, "x/hostile").rules == ()
    assert renderer.model() == NodeRenderer(NODE, max_elements=CAP).load(cluster(520, all_selecting(41), FINE)).model()
    # it stays closed when pods go (counting a closed object's sets would cost each pod change
    # what building them would), until the object changes or a full render counts it again
    for i in range(100):
        renderer.set_pod(f"x/p{i}", None)
    renderer.take_changes()
    assert list(renderer.over_limit()) == [("NetworkPolicy", "x/hostile")]
    renderer.set_policy("x/hostile", cluster(0, all_selecting(41)).policies["x/hostile"])  # the same object, sent again
    assert not renderer.over_limit() and chain_of(renderer, "x/hostile").rules


def test_a_burst_of_pods_within_one_sync_adds_at_most_the_cap_before_the_object_closes():
    renderer = NodeRenderer(NODE, max_elements=CAP).load(cluster(3, all_selecting(300), FINE))  # 900 elements
    renderer.take_changes()
    most = 0
    for i in range(3, 2000):  # 2,000 pods would be 600,000 elements; no output in between
        renderer.set_pod(f"x/p{i}", pod_from(pod(i)))
        most = max(most, renderer.sets.counts()[1])
    assert list(renderer.over_limit()) == [("NetworkPolicy", "x/hostile")]
    assert CAP < most <= 2 * CAP + 300 and renderer.sets.counts()[1] < 100  # FINE's set only, at the end
    renderer.take_changes()
    assert renderer.model() == NodeRenderer(NODE, max_elements=CAP).load(cluster(2000, all_selecting(300), FINE)).model()


@settings(max_examples=25, deadline=None)
@given(order=st.permutations(range(60)), batches=st.integers(1, 6), cap=st.integers(1_000, 3_000))
def test_growth_rendered_incrementally_equals_a_full_render_with_the_cap(order, batches, cap):
    """Pods arriving in any order and batching: after each sync, the model (which objects are
    closed included) equals a full render of the same cluster with the same cap."""
    policies = [all_selecting(20, "big"), all_selecting(8, "small"), FINE]
    pods = {f"x/p{i}": pod_from(pod(i)) for i in range(60)}
    renderer = NodeRenderer(NODE, max_elements=cap).load(cluster(0, *policies))
    present: list[int] = []
    for start in range(0, 60, batches):
        for i in order[start:start + batches]:
            renderer.set_pod(f"x/p{i}", pods[f"x/p{i}"])
            present.append(i)
        renderer.take_changes()
        fresh = NodeRenderer(NODE, max_elements=cap).load(dataclasses.replace(cluster(0, *policies), pods={
            f"x/p{i}": pods[f"x/p{i}"] for i in present}))
        assert renderer.model() == fresh.model() and renderer.over_limit().keys() == fresh.over_limit().keys()


def cnp(rules: int) -> dict[str, Any]:
    """A ClusterNetworkPolicy of ``rules`` ingress rules (the CRD allows 25) of one all-selecting
    peer each, with distinct selectors (one peer a rule: a union set per rule cannot merge them),
    the first half Accept, the rest Deny."""
    return {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": "wide"},
            "spec": {"tier": "Admin", "priority": 1, "subject": {"namespaces": {}}, "ingress": [
                {"action": "Accept" if i < rules // 2 else "Deny", "from": [{"pods": {"namespaceSelector": {}, "podSelector": {
                    "matchExpressions": [{"key": f"x{i}", "operator": "DoesNotExist"}]}}}]} for i in range(rules)]}}


def test_a_cluster_policy_whose_sets_would_hold_too_much_denies_everything_with_its_deny_rules():
    wide = cluster(1000, cnp(25))  # 25 distinct sets of 1,000
    renderer = NodeRenderer(NODE, max_elements=CAP).load(wide)
    renderer.model()
    assert list(renderer.over_limit()) == [("ClusterNetworkPolicy", "wide")]
    ((chain, keys),) = renderer.tiers.chains.values()
    assert {r.origin.action for r in chain.rules} == {"Deny"}  # its Accept rules left out
    assert {k.description for k in keys} == {"pods in namespaces (any): (any)"} and renderer.counts()["elements"] == 1000  # one set: every pod
    assert renderer.subject_nodes("ClusterNetworkPolicy", "wide") == {"n0", "n1", "n2"}
    assert not NodeRenderer(NODE, max_elements=25_000).load(wide).over_limit()


def test_the_agent_logs_it_records_one_event_from_a_node_that_sees_it_and_counts_it(caplog):
    metrics = Metrics()
    store = Store(metrics, ObjectLimits(elements=CAP))
    writer = MemoryWriter()
    # the Ready Nodes: n0, n1, n2 run pods the policy selects (their renderers count it);
    # node-10 runs none, and would rank first for the object among all four
    ready = frozenset({"n0", "n1", "n2", "node-10"})
    subject = Subject("NetworkPolicy", "networking.k8s.io/v1", "x", "hostile", "u-hostile", "1")
    assert event_writer(subject, ready) == "node-10" and event_writer(subject, ready - {"node-10"}) == NODE
    recorder = EventRecorder(writer, NODE, metrics, ready_nodes=lambda: ready)
    store.failed_closed = recorder.failed_closed
    objects = {"Pod": [pod(i) for i in range(500)], "NetworkPolicy": [all_selecting(300), FINE]}
    for kind in KINDS:
        store.replace(kind, objects.get(kind, []))
    reconciler = Reconciler(store, Config(), NODE, metrics, Health(window=30.0), 0.0, 3600.0, FakeNftDataplane())
    with caplog.at_level(logging.ERROR, "nftpolicy.sources"):
        assert reconciler.sync(full=True)
    assert reconciler.renderer is not None and reconciler.renderer.counts()["sets"] == 1  # FINE's only
    assert any(r.getMessage().startswith("invalid object: NetworkPolicy x/hostile: spec: 20500 or more set elements") for r in caplog.records)
    sample = metrics.registry.get_sample_value
    assert sample("nftpolicy_over_limit_objects", {"kind": "NetworkPolicy", "limit": "elements"}) == 1
    (pending,) = list(recorder.queue.queue)
    assert pending.writers == {"n0", "n1", "n2"}
    drain(recorder)
    (event,) = writer.events.values()
    assert event["reason"] == OVER_LIMIT and event["involvedObject"]["uid"] == "u-hostile" and event["source"]["host"] == NODE
    assert "exceed the cap of 20000 per object (--max-object-elements)" in event["message"]
    assert reconciler.sync(full=True)  # counted again: nothing new to say
    assert recorder.queue.empty()
    for i in range(200, 500):  # fewer pods: 200 x 300 = 60,000 elements, still beyond
        store.apply("Pod", "DELETED", pod(i))
    assert reconciler.sync(full=False) and list(reconciler.renderer.over_limit()) == [("NetworkPolicy", "x/hostile")]
    for i in range(60, 200):  # 60 x 300 = 18,000: closed until a full render counts it again
        store.apply("Pod", "DELETED", pod(i))
    assert reconciler.sync(full=False) and list(reconciler.renderer.over_limit()) == [("NetworkPolicy", "x/hostile")]
    with caplog.at_level(logging.INFO, "nftpolicy.sources"):
        assert reconciler.sync(full=True) and not reconciler.renderer.over_limit()
    assert "NetworkPolicy x/hostile: within --max-object-elements again, enforced as written" in caplog.text
    assert sample("nftpolicy_over_limit_objects", {"kind": "NetworkPolicy", "limit": "elements"}) == 0
    assert reconciler.renderer.counts()["sets"] == 301
    for i in range(60, 500):
        store.apply("Pod", "ADDED", pod(i))
    assert reconciler.sync(full=False) and list(reconciler.renderer.over_limit()) == [("NetworkPolicy", "x/hostile")]
    assert reconciler.renderer.counts()["sets"] == 1
    store.apply("NetworkPolicy", "MODIFIED", all_selecting(3))  # edited within the cap: enforced as written
    assert reconciler.sync(full=False)
    assert sample("nftpolicy_over_limit_objects", {"kind": "NetworkPolicy", "limit": "elements"}) == 0
    assert reconciler.renderer.counts()["sets"] == 4


def test_a_set_counted_before_it_is_made_holds_what_it_holds_once_made():
    """``SelectorSets.size`` of a set not made, from the indexes alone, equals the elements the
    set holds once made (pods of a scope, named ports, local targets, ipBlocks, a ClusterNetworkPolicy's
    networks and pods); its bounds are at least that."""
    from .test_incremental import START
    nodes, errors = build_cluster([("t", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"node{i}", "labels": {"role": "w"}},
                                          "status": {"addresses": [{"type": "InternalIP", "address": f"192.168.0.{i}"},
                                                                   {"type": "ExternalIP", "address": f"fd00::{i}"}]}}) for i in (1, 2, 3)]
                                  + [("t", {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
                                            "metadata": {"name": "to-nodes"}, "spec": {
                                                "tier": "Admin", "priority": 3, "subject": {"namespaces": {}},
                                                "egress": [{"action": "Accept", "to": [{"nodes": {"matchLabels": {"role": "w"}}}]}]}})])
    assert not errors
    everything = dataclasses.replace(START, nodes=nodes.nodes, cluster_policies={**START.cluster_policies, **nodes.cluster_policies})
    made = NodeRenderer("node1").load(everything)
    held = {s.name: len(s.elements) for s in made.sets.address_sets()}
    index = NodeRenderer("node1").load(dataclasses.replace(everything, policies={}, cluster_policies={}))
    keys = list(made.sets._sets)
    assert {k.kind for k in keys} >= {"addr", "named_port", "interval", "nodes"} and any(k.scope and k.scope.local for k in keys)
    for key in keys:
        assert index.sets.size(key) == held[key.name], key.description
        assert index.sets.size(key, exact=False) >= held[key.name] and index.sets._bound(key) >= held[key.name]
    assert index.sets.elements(keys, 10**6) >= sum(held.values()) and not index.sets._sets  # nothing made
