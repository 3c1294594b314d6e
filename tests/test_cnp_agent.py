"""The agent and ClusterNetworkPolicy: the API source lists and watches them when their CRD is
installed, says once that it is not (and keeps working), fails closed on an invalid one; end to
end with real packets through ``nftpolicy agent``."""

from __future__ import annotations

import logging
import threading

import pytest

from nftpolicy.agent.daemon import sources
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.sources import KubeSource
from nftpolicy.agent.daemon.store import Store

from nftpolicy.translators.selectors import LabelSelector
from nftpolicy.translators.setstore import SetKey

from .agentenv import AgentEnv
from .conftest import eventually, nft
from .fakeapi import FakeApiServer, namespace, node, pod


A, B, C, D = "10.244.0.10", "10.244.0.11", "10.244.0.12", "10.244.0.13"
SLOTS = {"x/a": A, "x/b": B, "x/c": C, "y/d": D}


def cnp(name: str, action: str, tier: str = "Admin", priority: int = 1, from_ns: str = "y", subject_ns: str = "x") -> dict:
    return {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": name},
            "spec": {"tier": tier, "priority": priority,
                     "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": subject_ns}}},
                     "ingress": [{"action": action, "from": [{"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": from_ns}}}]}]}}


@pytest.fixture
def quick_backoff(monkeypatch):
    monkeypatch.setattr(sources, "MAX_BACKOFF", 0.2)


def _source(api: FakeApiServer, tmp_path) -> tuple[Store, threading.Event]:
    api.put(namespace("x"))
    api.put(node("node1"))
    api.put(pod("x", "a", "10.0.0.1", app="a"))
    stop = threading.Event()
    store = Store(Metrics())
    KubeSource(store, store.metrics, api.kubeconfig(str(tmp_path / "kc.json")), 2.0, 30, stop).start()
    return store, stop


def test_without_the_crd_the_source_says_so_once_and_lists_everything_else(tmp_path, caplog, quick_backoff):
    api = FakeApiServer(bookmark_interval=0.2)
    api.start()
    caplog.set_level(logging.INFO, logger="nftpolicy.sources")
    store, stop = _source(api, tmp_path)
    try:
        eventually(store.listed)
        eventually(lambda: sum("/clusternetworkpolicies" in p and s == 404 for _, p, s in api.requests) >= 3)
        said = [r.getMessage() for r in caplog.records if "clusternetworkpolicies" in r.getMessage()]
        assert said == ["the API has clusternetworkpolicies.policy.networking.k8s.io (its CRD is not installed): "
                        "enforcing without any ClusterNetworkPolicy; checking again every 0s".replace("has", "has no", 1)]
        assert set(store.take()[0].pods) == {"x/a"} and not store.take()[0].cluster_policies
        # the CRD is installed later: its objects are listed and watched from then on
        api.cluster_network_policies = True
        api.put(cnp("deny-y", "Deny"))
        eventually(lambda: "deny-y" in store.take()[0].cluster_policies)
        api.put(cnp("deny-y", "Accept"))
        eventually(lambda: store.take()[0].cluster_policies["deny-y"].ingress[0].action == "Accept")
        assert any(r.getMessage().startswith("the API has clusternetworkpolicies.policy.networking.k8s.io now") for r in caplog.records)
    finally:
        stop.set()
        api.stop()


def test_with_the_crd_the_source_lists_watches_and_fails_closed(tmp_path):
    api = FakeApiServer(bookmark_interval=0.2, cluster_network_policies=True)
    api.start()
    api.put(cnp("accept-y", "Accept"))
    store, stop = _source(api, tmp_path)
    try:
        eventually(store.listed)
        assert set(store.take()[0].cluster_policies) == {"accept-y"}
        bad = cnp("bad", "Pass")
        bad["spec"]["ingress"][0]["from"] = [{"someFuturePeer": {}}]
        api.put(bad)
        eventually(lambda: "bad" in store.take()[0].cluster_policies)
        (rule,) = store.take()[0].cluster_policies["bad"].ingress
        assert rule.action == "Deny" and rule.name == "fail-closed rule 0"  # the API reference's fail closed for Pass
        assert store.metrics.registry.get_sample_value("nftpolicy_invalid_objects", {"kind": "ClusterNetworkPolicy"}) == 1
        api.delete("ClusterNetworkPolicy", "accept-y")
        eventually(lambda: "accept-y" not in store.take()[0].cluster_policies)
    finally:
        stop.set()
        api.stop()


@pytest.mark.kernel
def test_the_agent_enforces_the_tiers_and_follows_changes(tmp_path):
    api = FakeApiServer(bookmark_interval=0.5, cluster_network_policies=True)
    api.start()
    env = AgentEnv(tmp_path, SLOTS, api=api).put_slot_pods()
    try:
        env.start_agent()
        assert env.connects("y/d", A) and env.connects("x/c", A)
        env.api.put(cnp("deny-y", "Deny"))  # Admin: y may not reach x
        eventually(lambda: env.connects("y/d", A), False)
        assert env.connects("x/c", A)
        deny_x = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "x", "name": "deny-all"},
                  "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
        env.api.put(deny_x)  # NetworkPolicy isolates x: x/c -> x/a refused too
        eventually(lambda: env.connects("x/c", A), False)
        env.api.put(cnp("deny-y", "Accept"))  # Admin Accept wins over the NetworkPolicy
        eventually(lambda: env.connects("y/d", A), True)
        assert not env.connects("x/c", A)
        env.api.put(cnp("deny-y", "Pass"))  # Pass: the NetworkPolicy decides
        eventually(lambda: env.connects("y/d", A), False)
        env.api.delete("NetworkPolicy", "deny-all", "x")  # passed by the Admin tier, no NetworkPolicy: allowed
        eventually(lambda: env.connects("y/d", A), True)
        env.api.put(cnp("baseline", "Deny", tier="Baseline", from_ns="x"))  # no NetworkPolicy: Baseline denies x -> x
        eventually(lambda: env.connects("x/c", A), False)
        assert env.connects("y/d", A)  # no Baseline rule for y
        env.api.delete("ClusterNetworkPolicy", "baseline")
        env.api.delete("ClusterNetworkPolicy", "deny-y")
        eventually(lambda: env.connects("x/c", A), True)
        eventually(lambda: env.metric("nftpolicy_watched_objects", kind="ClusterNetworkPolicy"), 0.0)
    finally:
        env.close()


@pytest.mark.kernel
def test_the_agent_without_the_crd_is_ready_and_enforces_networkpolicies(tmp_path):
    env = AgentEnv(tmp_path, SLOTS).put_slot_pods()  # the fake answers 404 for clusternetworkpolicies
    try:
        env.start_agent()
        env.api.put({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "x", "name": "deny-all"},
                     "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}})
        eventually(lambda: env.connects("x/c", A), False)
        assert env.log().count("its CRD is not installed") == 1
    finally:
        env.close()


def infra_nodes_denied() -> dict:
    return {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": "no-infra"},
            "spec": {"tier": "Admin", "priority": 1,
                     "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "x"}}},
                     "egress": [{"action": "Deny", "to": [{"nodes": {"matchLabels": {"role": "infra"}}}],
                                 "protocols": [{"tcp": {"destinationPort": {"number": 80}}}]}]}}


@pytest.mark.kernel
def test_a_node_label_change_moves_its_address_in_the_node_set_without_a_full_sync(tmp_path):
    """The agent watches every Node: relabelling one (or giving it another address) changes the
    elements of the nodes peer's set in an incremental sync, and the pod's connection to that
    node's address follows."""
    api = FakeApiServer(bookmark_interval=0.5, cluster_network_policies=True)
    api.start()
    env = AgentEnv(tmp_path, {"x/a": A}, api=api, serve_node=True).put_slot_pods()
    address = env.sandbox.nodes["node1"].addresses["ipv4"]
    try:
        env.api.put(node("node1", ("InternalIP", address), ("Hostname", "node1"), role="worker"))
        env.api.put(node("node2", ("InternalIP", "172.30.0.2"), role="infra"))  # not in the sandbox: a set element only
        env.api.put(infra_nodes_denied())
        env.start_agent()
        name = SetKey("nodes", "ipv4", nodes=LabelSelector((("role", "infra"),))).name

        def elements() -> str:
            return nft(env.netns, "list", "set", "inet", "nftpolicy", name)

        assert "172.30.0.2" in elements() and address not in elements()
        assert env.connects("x/a", address)
        full = env.metric("nftpolicy_sync_duration_seconds_count", mode="full")
        env.api.put(node("node1", ("InternalIP", address), ("Hostname", "node1"), role="infra"))  # relabelled: now infra
        eventually(lambda: address in elements(), True)
        eventually(lambda: env.connects("x/a", address), False)
        env.api.put(node("node2", ("InternalIP", "172.30.0.3"), role="infra"))  # readdressed
        eventually(lambda: "172.30.0.3" in elements() and "172.30.0.2" not in elements(), True)
        env.api.delete("Node", "node1")
        eventually(lambda: env.connects("x/a", address), True)
        assert address not in elements()
        assert env.metric("nftpolicy_sync_duration_seconds_count", mode="full") == full  # each change was incremental
    finally:
        env.close()
