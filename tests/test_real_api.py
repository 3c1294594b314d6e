"""The agent end to end against the real kube-apiserver (and etcd) of :class:`ControlPlane`:
objects written through the API -> ``nftpolicy agent`` -> kernel -> real packets between sandbox
pods. The scenarios that both API servers share run on both in test_agent_e2e.py (policy
create/update/delete, label changes, late IPs, finished pods); here is what only the real one
shows: pagination, deletion and IP reuse through the real pod lifecycle, watches the server
ends, a restart of kube-apiserver. The in-repo fake stays for fault injection."""

from __future__ import annotations

import json
import threading
import time

import pytest

from nftpolicy.agent.daemon import sources
from nftpolicy.agent.testbed.controlplane import ControlPlane, write_token_kubeconfig
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.store import Store

from .agentenv import AgentEnv, RealApi
from .conftest import clear_api, eventually
from .fakeapi import namespace, pod
from .stallproxy import StallProxy

pytestmark = [pytest.mark.kernel, pytest.mark.tools("etcd", "kube-apiserver")]

A, B, C, D = "10.244.0.10", "10.244.0.11", "10.244.0.12", "10.244.0.13"
SLOTS = {"x/a": A, "x/b": B, "x/c": C, "y/d": D}


def policy(name: str, spec: dict, ns: str = "x") -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": ns, "name": name}, "spec": spec}


DENY_B = {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"]}


def _env(cp: ControlPlane, tmp_path, extra_args: tuple[str, ...] = ()) -> AgentEnv:
    return AgentEnv(tmp_path, SLOTS, extra_args, api=RealApi(cp)).put_slot_pods()


@pytest.fixture
def env(control_plane, tmp_path):
    env = _env(control_plane, tmp_path)
    try:
        yield env
    finally:
        env.close()
        clear_api(control_plane)


def test_lists_come_in_pages(control_plane, monkeypatch):
    """The API source follows continue tokens: with pages of 2 objects, every pod arrives, and
    the watch starts from the list's resourceVersion."""
    control_plane.apply(namespace("y"))
    for i in range(5):
        control_plane.apply(pod("y", f"paged-{i}", f"10.244.0.{100 + i}", app="paged"))
    monkeypatch.setattr(sources, "LIST_PAGE", 2)
    metrics, stop = Metrics(), threading.Event()
    store = Store(metrics)
    source = sources.KubeSource(store, metrics, control_plane.kubeconfig, 5.0, 30, stop)
    try:
        source._list("Pod")
        assert {k for k in store.take()[0].pods if "/paged-" in k} == {f"y/paged-{i}" for i in range(5)}
        assert int(source.versions["Pod"]) >= int(control_plane.request("GET", "/api/v1/namespaces/y/pods/paged-4")["metadata"]["resourceVersion"])
    finally:
        stop.set()
        clear_api(control_plane)


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
    eventually(lambda: env.connects("x/c", B), True)
    eventually(lambda: env.connects("x/a", C), False)


def test_watch_that_the_api_server_ends(control_plane, tmp_path):
    """The API server ends every watch after its timeoutSeconds (1 s here); the agent resumes
    from its resourceVersion each time, without a relist, and misses no change."""
    env = _env(control_plane, tmp_path, ("--watch-timeout", "1"))
    try:
        env.start_agent()
        time.sleep(3.5)  # several watches end
        env.api.put(policy("deny-b", DENY_B))
        eventually(lambda: env.connects("x/c", B), False)
        time.sleep(2.2)
        env.api.delete("NetworkPolicy", "deny-b", "x")
        eventually(lambda: env.connects("x/c", B), True)
        events = [json.loads(line) for line in env.log().splitlines() if line.startswith("{")]
        assert not [e for e in events if "relisting" in e.get("msg", "")], "a watch end must not cause a relist"
        assert env.metric("nftpolicy_api_errors_total", kind="NetworkPolicy", reason="410") == 0
    finally:
        env.close()
        clear_api(control_plane)


@pytest.mark.parametrize("kind", ["Pod", "ClusterNetworkPolicy"])
def test_bookmarks_move_a_quiet_kind_on(control_plane, kind):
    """kube-apiserver sends BOOKMARKs to the agent's watches (they ask for them), for a
    CustomResource too, and the next watch starts from a bookmark's resourceVersion. Nothing of
    ``kind`` is written: a namespace is, then a consistent list of ``kind`` makes its watch cache
    catch up with etcd (a bookmark carries the cache's version, and only one newer than the
    watch's start is sent). A watch of 4 s gets its bookmark 2 s before its end (the cacher's
    deadline bookmark; the periodic one comes every minute)."""
    metrics, stop = Metrics(), threading.Event()
    store = Store(metrics)
    source = sources.KubeSource(store, metrics, control_plane.kubeconfig, 5.0, 4, stop)
    call, kwargs = source.calls[kind]
    watched_from: list[str] = []

    def recording(**query):
        if query.get("watch"):
            watched_from.append(query["resource_version"])
        return call(**query)

    source.calls[kind] = (recording, kwargs)
    try:
        source.start()
        eventually(store.listed)
        listed, held = int(source.versions[kind]), store.take()[0]
        written = int(control_plane.apply(namespace("bookmarked", at=str(time.monotonic())))["metadata"]["resourceVersion"])
        control_plane.items(kind)
        eventually(lambda: int(source.versions[kind]) >= written, timeout=15)
        bookmarked = source.versions[kind]
        eventually(lambda: bookmarked in watched_from, timeout=10)
        assert int(bookmarked) > listed and watched_from[0] == str(listed)
        now = store.take()[0]
        assert (now.pods, now.cluster_policies) == (held.pods, held.cluster_policies)  # no event of the kind came
    finally:
        stop.set()
        control_plane.delete("Namespace", "bookmarked")


def test_a_watch_behind_a_stalled_proxy_is_watched_again_within_the_idle_timeout(control_plane, tmp_path, record_property):
    """The agent reaches kube-apiserver through a TCP proxy that stops forwarding (both
    connections stay open: a stuck load balancer; keepalive sees live peers). A deny policy
    written after the stall is enforced once the watches have been silent for
    --watch-idle-timeout (3 s here, where the 60 s bookmarks cannot keep them alive: each quiet
    watch is watched again every 3 s before the stall too), not after --watch-timeout +
    --api-timeout (310 s, the defaults given here); from the last resourceVersion, no relist.
    bench/silent_watch.py measures the default 130 s."""
    with StallProxy(("127.0.0.1", control_plane.port)) as proxy:
        env = _env(control_plane, tmp_path, ("--watch-timeout", "300", "--api-timeout", "10", "--watch-idle-timeout", "3",
                                              "--log-level", "debug"))
        env.kubeconfig = str(tmp_path / "proxied.kubeconfig")
        write_token_kubeconfig(env.kubeconfig, f"https://127.0.0.1:{proxy.port}", control_plane.ca_file, control_plane.admin_token,
                               "nftpolicy-admin")
        try:
            env.start_agent()
            assert env.connects("x/c", B)
            assert len(proxy.stall()) >= 5  # a watch per kind at least
            since = time.monotonic()
            env.api.put(policy("deny-b", DENY_B))
            eventually(lambda: env.connects("x/c", B), False, timeout=30)
            took = time.monotonic() - since
            record_property("enforced_seconds", round(took, 2))
            print(f"a deny policy written after the stall enforced in {took:.2f} s")
            assert took <= 3 + 1.2 + 1.5, f"enforced {took:.1f}s after the stall"
            assert env.metric("nftpolicy_api_retries_total", kind="NetworkPolicy", reason="silent") >= 1
            messages = [json.loads(line).get("msg", "") for line in env.log().splitlines() if line.startswith("{")]
            assert any(m.startswith("API NetworkPolicy watch silent for 3s") for m in messages)
            assert not [m for m in messages if "relisting" in m]
            assert len([m for m in messages if m.startswith("listed NetworkPolicy:")]) == 1
        finally:
            env.close()
            clear_api(control_plane)


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
            eventually(lambda: env.connects("x/c", B), True, timeout=40)
            env.api.put(policy("deny-b", DENY_B))
            eventually(lambda: env.connects("x/c", B), False, timeout=40)
        finally:
            env.close()
