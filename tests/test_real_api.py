"""The agent end to end against the real kube-apiserver (and etcd) of :class:`ControlPlane`:
objects written through the API -> ``nftpolicy agent`` -> kernel -> real packets between sandbox
pods. The in-repo fake API server stays for fault injection (test_agent_e2e.py); this is the
protocol truth."""

from __future__ import annotations

import json
import threading
import time

import pytest

from nftpolicy.agent import sources
from nftpolicy.agent.controlplane import ControlPlane
from nftpolicy.agent.ops import Metrics

from .agentenv import AgentEnv, RealApi
from .fakeapi import namespace, pod

pytestmark = pytest.mark.kernel

A, B, C, D = "10.244.0.10", "10.244.0.11", "10.244.0.12", "10.244.0.13"
SLOTS = {"x/a": A, "x/b": B, "x/c": C, "y/d": D}


def policy(name: str, spec: dict, ns: str = "x") -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": ns, "name": name}, "spec": spec}


DENY_B = {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"]}


def only_from(labels: dict, ns_labels: dict | None = None) -> dict:
    peer: dict = {"podSelector": {"matchLabels": labels}}
    if ns_labels is not None:
        peer["namespaceSelector"] = {"matchLabels": ns_labels}
    return {"podSelector": {"matchLabels": {"app": "b"}}, "ingress": [{"from": [peer]}]}


@pytest.fixture(scope="module")
def control_plane():
    with ControlPlane() as cp:
        yield cp


def _clear(cp: ControlPlane) -> None:
    """Delete every Pod and NetworkPolicy, so the next test starts from namespaces only."""
    for kind, path in (("NetworkPolicy", "/apis/networking.k8s.io/v1/networkpolicies"), ("Pod", "/api/v1/pods")):
        for item in cp.request("GET", path)["items"]:
            cp.delete(kind, item["metadata"]["name"], item["metadata"]["namespace"])


def _env(cp: ControlPlane, tmp_path, extra_args: tuple[str, ...] = ()) -> AgentEnv:
    env = AgentEnv(tmp_path, SLOTS, extra_args, api=RealApi(cp))
    env.api.put(namespace("y"))
    for key, ip in SLOTS.items():
        ns, name = key.split("/")
        env.api.put(pod(ns, name, ip, app=name))
    return env


@pytest.fixture
def env(control_plane, tmp_path):
    env = _env(control_plane, tmp_path)
    try:
        yield env
    finally:
        env.close()
        _clear(control_plane)


def test_policy_create_update_delete(env):
    env.start_agent()
    assert env.connects("x/c", B)
    env.api.put(policy("deny-b", DENY_B))
    env.eventually(lambda: env.connects("x/c", B), False)
    env.api.put(policy("deny-b", only_from({"app": "a"})))
    env.eventually(lambda: env.connects("x/a", B), True)
    assert not env.connects("x/c", B)
    env.api.delete("NetworkPolicy", "deny-b", "x")
    env.eventually(lambda: env.connects("x/c", B), True)
    env.eventually(lambda: env.metric("nftpolicy_sync_duration_seconds_count", mode="incremental") >= 3, True)
    assert env.metric("nftpolicy_api_errors_total", kind="Pod", reason="5xx") == 0


def test_lists_come_in_pages(control_plane, monkeypatch):
    """The API source follows continue tokens: with pages of 2 objects, every pod arrives, and
    the watch starts from the list's resourceVersion."""
    control_plane.apply(namespace("y"))
    for i in range(5):
        control_plane.apply(pod("y", f"paged-{i}", f"10.244.0.{100 + i}", app="paged"))
    monkeypatch.setattr(sources, "LIST_PAGE", 2)
    metrics, stop = Metrics(), threading.Event()
    store = sources.Store(metrics)
    source = sources.KubeSource(store, metrics, "node1", control_plane.kubeconfig, 5.0, 30, stop)
    try:
        source._list("Pod")
        assert {k for k in store.take()[0].pods if "/paged-" in k} == {f"y/paged-{i}" for i in range(5)}
        assert int(source.versions["Pod"]) >= int(control_plane.request("GET", "/api/v1/namespaces/y/pods/paged-4")["metadata"]["resourceVersion"])
    finally:
        stop.set()
        _clear(control_plane)


def test_pod_and_namespace_label_changes(env):
    env.api.put(policy("from-clients", only_from({"role": "client"}, ns_labels={"team": "blue"})))
    env.start_agent()
    assert not env.connects("y/d", B)
    env.api.put(pod("y", "d", D, app="d", role="client"))  # pod label alone: y is not team=blue
    time.sleep(0.5)
    assert not env.connects("y/d", B)
    env.api.put(namespace("y", team="blue"))
    env.eventually(lambda: env.connects("y/d", B), True)
    env.api.put(namespace("y"))  # the namespace label goes again
    env.eventually(lambda: env.connects("y/d", B), False)
    env.api.put(namespace("y", team="blue"))
    env.eventually(lambda: env.connects("y/d", B), True)
    env.api.put(pod("y", "d", D, app="d"))  # the pod label goes
    env.eventually(lambda: env.connects("y/d", B), False)


def test_pod_deletion_and_ip_reuse(env):
    """A deleted pod's address, reused by a pod that the policies treat differently, gets the
    new pod's verdict in both directions (as a destination and as a peer)."""
    env.api.put(policy("deny-b", DENY_B))
    env.api.put(policy("c-from-a", {"podSelector": {"matchLabels": {"app": "c"}}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a"}}}]}]}))
    env.start_agent()
    assert not env.connects("x/a", B)
    assert env.connects("x/a", C)
    env.api.delete("Pod", "b", "x")  # B is free; nothing selects it any more
    env.api.delete("Pod", "a", "x")
    env.api.put(pod("x", "b2", B, app="other"))
    env.api.put(pod("x", "a2", A, app="not-a"))  # A now belongs to a pod c does not allow
    env.eventually(lambda: env.connects("x/c", B), True)
    env.eventually(lambda: env.connects("x/a", C), False)


def test_watch_that_the_api_server_ends(control_plane, tmp_path):
    """The API server ends every watch after its timeoutSeconds (1 s here); the agent resumes
    from its resourceVersion each time, without a relist, and misses no change."""
    env = _env(control_plane, tmp_path, ("--watch-timeout", "1"))
    try:
        env.start_agent()
        time.sleep(3.5)  # several watches end
        env.api.put(policy("deny-b", DENY_B))
        env.eventually(lambda: env.connects("x/c", B), False)
        time.sleep(2.2)
        env.api.delete("NetworkPolicy", "deny-b", "x")
        env.eventually(lambda: env.connects("x/c", B), True)
        events = [json.loads(line) for line in env.log().splitlines() if line.startswith("{")]
        assert not [e for e in events if "relisting" in e.get("msg", "")], "a watch end must not cause a relist"
        assert env.metric("nftpolicy_api_errors_total", kind="NetworkPolicy", reason="410") == 0
    finally:
        env.close()
        _clear(control_plane)


def test_api_server_restart_keeps_rules_and_resumes(tmp_path):
    """kube-apiserver stops (etcd and its data stay): the rules stay in force; it comes back on
    the same address: the next change is enforced."""
    with ControlPlane() as cp:
        env = _env(cp, tmp_path, ("--watch-timeout", "30"))
        try:
            env.api.put(policy("deny-b", DENY_B))
            env.start_agent()
            assert not env.connects("x/c", B)
            cp.stop_apiserver()
            time.sleep(2)
            assert not env.connects("x/c", B), "the ruleset must stay while the API is away"
            assert env.http("/healthz")[0] == 200
            cp.start_apiserver()
            cp.delete("NetworkPolicy", "deny-b", "x")
            env.eventually(lambda: env.connects("x/c", B), True, timeout=40)
            env.api.put(policy("deny-b", DENY_B))
            env.eventually(lambda: env.connects("x/c", B), False, timeout=40)
        finally:
            env.close()
