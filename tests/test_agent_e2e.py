"""The agent end to end: fake API server -> ``nftpolicy agent`` -> kernel -> real packets between
sandbox pods. Every verdict is a real connection."""

from __future__ import annotations

import json
import threading
import time

import pytest

from nftpolicy.agent.testbed.probes import ProbeSpec

from .agentenv import AgentEnv, RealApi
from .conftest import clear_api, eventually, nft
from .fakeapi import namespace, pod

pytestmark = pytest.mark.kernel

A, B, C, D = "10.244.0.10", "10.244.0.11", "10.244.0.12", "10.244.0.13"
SLOTS = {"x/a": A, "x/b": B, "x/c": C, "y/d": D}


def policy(name: str, spec: dict, ns: str = "x") -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": ns, "name": name}, "spec": spec}


def only_from(labels: dict, target: dict | None = None, ns_labels: dict | None = None) -> dict:
    peer: dict = {"podSelector": {"matchLabels": labels}}
    if ns_labels is not None:
        peer["namespaceSelector"] = {"matchLabels": ns_labels}
    return {"podSelector": {"matchLabels": target or {"app": "b"}}, "ingress": [{"from": [peer]}]}


def _env(tmp_path, api=None) -> AgentEnv:
    return AgentEnv(tmp_path, SLOTS, api=api).put_slot_pods()


@pytest.fixture
def env(tmp_path):
    """The agent on the fake API server (for the scenarios that inject faults)."""
    env = _env(tmp_path)
    try:
        yield env
    finally:
        env.close()


@pytest.fixture(params=["fake API server", pytest.param("kube-apiserver", marks=pytest.mark.tools("etcd", "kube-apiserver"))])
def either_env(request, tmp_path):
    """The same scenario against the in-repo fake and against the real kube-apiserver."""
    real = request.param == "kube-apiserver"
    cp = request.getfixturevalue("control_plane") if real else None
    env = _env(tmp_path, RealApi(cp) if real else None)
    try:
        yield env
    finally:
        env.close()
        if real:
            clear_api(cp)


def test_policy_create_update_delete(either_env):
    env = either_env
    env.start_agent()
    assert env.connects("x/c", B)
    env.api.put(policy("deny-b", {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"]}))
    eventually(lambda: env.connects("x/c", B), False)
    env.api.put(policy("deny-b", only_from({"app": "a"})))
    eventually(lambda: env.connects("x/a", B), True)
    assert not env.connects("x/c", B)
    env.api.delete("NetworkPolicy", "deny-b", "x")
    eventually(lambda: env.connects("x/c", B), True)
    eventually(lambda: env.metric("nftpolicy_sync_duration_seconds_count", mode="incremental") >= 3, True)
    eventually(lambda: env.metric("nftpolicy_event_to_kernel_seconds_count") >= 3, True)


def test_pod_and_namespace_label_changes(either_env):
    env = either_env
    env.api.put(policy("from-clients", only_from({"role": "client"}, ns_labels={"team": "blue"})))
    env.start_agent()
    assert not env.connects("y/d", B)
    env.api.put(pod("y", "d", D, app="d", role="client"))  # pod label: not enough, namespace is not team=blue
    time.sleep(0.3)
    assert not env.connects("y/d", B)
    env.api.put(namespace("y", team="blue"))
    eventually(lambda: env.connects("y/d", B), True)
    env.api.put(pod("y", "d", D, app="d"))  # label removed again
    eventually(lambda: env.connects("y/d", B), False)


def test_pod_that_gets_its_ip_late(either_env):
    env = either_env
    env.api.put(pod("x", "b", None, app="b"))  # Pending, no IP yet
    env.api.put(policy("deny-b", {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"]}))
    env.api.put(policy("b-from-late", {"podSelector": {"matchLabels": {"app": "a"}}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "late"}}}]}]}))
    env.api.delete("Pod", "c", "x")
    env.api.put(pod("x", "late", None, app="late"))
    env.start_agent()
    assert env.connects("x/c", B)          # b has no IP in the API: nothing is enforced for it
    assert not env.connects("x/c", A)      # no pod with IP C is a peer yet
    env.api.put(pod("x", "b", B, app="b"))
    env.api.put(pod("x", "late", C, app="late"))
    eventually(lambda: env.connects("x/c", B), False)
    eventually(lambda: env.connects("x/c", A), True)


def test_finished_pod_releases_its_ip_to_a_new_pod(either_env):
    env = either_env
    env.api.put(policy("b-from-clients", only_from({"role": "client"})))
    env.api.put(pod("x", "c", C, app="c", role="client"))
    env.start_agent()
    assert env.connects("x/c", B)
    env.api.put(pod("x", "c", C, app="c", role="client", phase="Succeeded"))
    env.api.put(pod("x", "c-new", C, app="c-new"))  # same IP, not a client
    eventually(lambda: env.connects("x/c", B), False)


def test_api_outage_keeps_rules_and_catches_up_deletes(env):
    env.api.put(policy("deny-b", {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"]}))
    env.api.put(policy("a-from-b", only_from({"app": "b"}, target={"app": "a"})))
    env.start_agent()
    assert not env.connects("x/c", B) and env.connects("x/b", A) and not env.connects("x/c", A)
    with env.api.outage():
        env.api.delete("NetworkPolicy", "deny-b", "x")   # lost from the watch history: only a relist sees it
        env.api.put(policy("a-from-b", only_from({"app": "c"}, target={"app": "a"})))
        time.sleep(1.0)
        assert not env.connects("x/c", B)                # the last ruleset stays in force
        assert env.http("/healthz")[0] == 200
    eventually(lambda: env.connects("x/c", B), True, timeout=20)
    eventually(lambda: env.connects("x/c", A), True)
    assert not env.connects("x/b", A)
    assert env.metric("nftpolicy_api_retries_total", kind="NetworkPolicy", reason="connection") >= 1
    assert "relisting NetworkPolicy" in env.log()


def test_restart_never_lets_a_denied_pair_through(env):
    env.api.put(policy("deny-b", {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"]}))
    env.start_agent()
    assert not env.connects("x/c", B)
    # Probe continuously from another thread while the agent stops and starts again.
    probes, leaks, done = [], [], threading.Event()

    def hammer():
        while not done.is_set():
            ok = env.sandbox.connect("x/c", B, ProbeSpec(80, "TCP"))
            probes.append(ok)
            if ok:
                leaks.append(time.monotonic())

    # Only this thread uses the sandbox's event loop until it is joined.
    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        time.sleep(0.3)
        assert env.stop_agent() == 143  # SIGTERM's code (agent/interrupts.py)
        assert "KUBE-ROUTER-FORWARD" in nft(env.netns, "list", "table", "inet", "nftpolicy")  # rules stay
        time.sleep(0.3)
        env.start_agent()
        time.sleep(0.5)
    finally:
        done.set()
        thread.join()
    assert len(probes) > 20 and leaks == []


def test_nft_failure_in_one_sync_keeps_old_rules_and_recovers(env):
    env.api.put(policy("b-from-clients", only_from({"role": "client"})))
    env.api.put(pod("x", "a", A, app="a", role="client"))
    env.api.put(pod("x", "c", C, app="c", role="client"))
    env.start_agent()
    assert env.connects("x/a", B) and env.connects("x/c", B)
    # Make the kernel diverge from what the agent committed: remove c from the peer set behind its
    # back, so the next incremental sync (which deletes that element) is refused by the kernel.
    listing = json.loads(nft(env.netns, "-j", "list", "sets", "inet"))["nftables"]
    peer_set = next(o["set"]["name"] for o in listing if "set" in o and C in json.dumps(o["set"].get("elem", [])))
    nft(env.netns, "delete", "element", "inet", "nftpolicy", peer_set, "{", C, "}")
    env.api.put(pod("x", "c", C, app="c"))  # c is no longer a client: the sync deletes its element
    eventually(lambda: env.metric("nftpolicy_sync_failures_total", mode="incremental"), 1.0)
    assert "sync failed, the kernel keeps the previous ruleset" in env.log()
    # The failed transaction changed nothing; the full retry then lands and a is still allowed.
    eventually(lambda: env.metric("nftpolicy_sync_duration_seconds_count", mode="full"), 2.0)
    assert env.connects("x/a", B) and not env.connects("x/c", B)


def test_malformed_policy_fails_closed_and_the_rest_is_enforced(env):
    env.api.put(policy("broken", {"podSelector": {"matchLabels": {"app": "b"}},
                                  "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/33"}}]}]}))
    env.api.put(policy("a-from-c", only_from({"app": "c"}, target={"app": "a"})))
    env.start_agent()
    assert not env.connects("x/c", B)       # the broken policy isolates b (fails closed)
    assert env.connects("x/c", A) and not env.connects("y/d", A)
    assert env.connects("x/b", C)           # unrelated pods are untouched
    assert env.metric("nftpolicy_invalid_objects", kind="NetworkPolicy") == 1
    assert "NetworkPolicy x/broken: spec.ingress[0].from[0].ipBlock.cidr: invalid CIDR '10.0.0.0/33'" in env.log()


def test_a_flushed_ruleset_is_restored(env):
    env.api.put(policy("deny-b", {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"]}))
    env.start_agent()
    assert not env.connects("x/c", B)
    nft(env.netns, "flush", "ruleset")  # what a distribution's nftables service reload does
    assert env.connects("x/c", B)
    eventually(lambda: env.connects("x/c", B), False, timeout=15)
    assert "our table is gone or incomplete" in env.log()


def test_health_and_readiness(tmp_path):
    env = AgentEnv(tmp_path, {"x/a": A})
    try:
        env.api.fail(503, count=1000)  # the API is down before the agent starts
        env.start_agent(wait_ready=False)
        eventually(lambda: env.http("/healthz")[0], 200)
        eventually(lambda: sum(1 for _, path, code in env.api.requests if code == 503 and "/pods" in path) >= 2, True)
        assert env.http("/readyz")[0] == 503
        env.api.heal()
        eventually(lambda: env.http("/readyz")[0], 200, timeout=40)
        assert env.metric("nftpolicy_api_errors_total", kind="Pod", reason="5xx") >= 2
        assert env.metric("nftpolicy_api_retries_total", kind="Pod", reason="5xx") >= 2
    finally:
        env.close()
