"""RBAC against the real kube-apiserver (``--authorization-mode=RBAC``): the agent runs with a
ServiceAccount token bound to exactly the ClusterRole and ClusterRoleBinding that ``helm
template`` renders from charts/nftpolicy. It syncs and writes its Events; with one verb taken away
it says which verb on which resource it lacks. With the chart's default secure metrics, the
agent checks scrapers' tokens with that ClusterRole: Prometheus, bound to the chart's
metrics-reader ClusterRole, gets /metrics; no token 401, another ServiceAccount 403."""

from __future__ import annotations

import copy
import json

import pytest

from nftpolicy.agent.testbed.controlplane import ControlPlane

from .agentenv import AgentEnv, RealApi
from .conftest import eventually
from .fakeapi import pod
from .test_chart import NAMESPACE, agent_rbac, render
from .test_secure_metrics import scrape
from .test_events import DNS_POLICY

pytestmark = [pytest.mark.kernel, pytest.mark.tools("etcd", "kube-apiserver", "helm")]

B, C = "10.244.0.11", "10.244.0.12"
DENY_B = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "x", "name": "deny-b"},
          "spec": {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"]}}


@pytest.fixture(scope="module")
def chart_rbac():
    docs = render("default")
    role, binding, account = agent_rbac(docs)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}]
    return role, binding, account


@pytest.fixture(scope="module")
def control_plane():
    with ControlPlane(authorization="RBAC") as cp:
        yield cp


@pytest.fixture
def rbac_env(tmp_path, chart_rbac, control_plane):
    """The chart's ClusterRole, ClusterRoleBinding and ServiceAccount (a fresh token), pods x/b
    and x/c, no policy."""
    role, binding, account = chart_rbac
    cp = control_plane
    cp.apply(role)
    cp.apply(binding)
    token = cp.service_account_token(NAMESPACE, account["metadata"]["name"])
    env = AgentEnv(tmp_path, {"x/b": B, "x/c": C}, api=RealApi(cp))
    env.kubeconfig = cp.kubeconfig_for(token, "nftpolicy-agent")
    try:
        for key, ip in {"x/b": B, "x/c": C}.items():
            env.api.put(pod("x", key.split("/")[1], ip, app=key.split("/")[1]))
        yield cp, env, role
    finally:
        env.close()
        cp.delete("NetworkPolicy", "deny-b", "x")


def test_the_charts_clusterrole_is_enough(rbac_env):
    cp, env, _ = rbac_env
    env.start_agent()
    assert env.connects("x/c", B)
    cp.apply(DENY_B)
    eventually(lambda: env.connects("x/c", B), False)
    for kind in ("Pod", "Namespace", "NetworkPolicy", "Node", "ClusterNetworkPolicy"):
        assert env.metric("nftpolicy_api_errors_total", kind=kind, reason="403") == 0
    # discovery needs no rule of the chart's (system:discovery): the version the API prefers is watched
    said = [event["msg"] for event in map(json.loads, filter(lambda line: line.startswith("{"), env.log().splitlines()))]
    assert "ClusterNetworkPolicy: the API serves policy.networking.k8s.io/v1beta1: listing and watching it" in said


@pytest.mark.parametrize("resource, verb", [("pods", "watch"), ("networkpolicies", "list"), ("namespaces", "list")])
def test_a_missing_verb_is_named(rbac_env, resource, verb):
    cp, env, role = rbac_env
    narrowed = copy.deepcopy(role)
    rule = next(r for r in narrowed["rules"] if resource in r["resources"])
    rule["resources"].remove(resource)
    narrowed["rules"] = [r for r in narrowed["rules"] if r["resources"]]
    narrowed["rules"].append({"apiGroups": rule["apiGroups"], "resources": [resource], "verbs": [v for v in rule["verbs"] if v != verb]})
    cp.apply(narrowed)
    env.start_agent(wait_ready=False)
    kind = {"pods": "Pod", "networkpolicies": "NetworkPolicy", "namespaces": "Namespace"}[resource]
    eventually(lambda: env.metric("nftpolicy_api_access_denied", kind=kind, verb=verb), 1, timeout=20)
    # retried (a starting API server refuses for a moment), said at the first refusal; one that
    # lasts 10 s is said once more as an error (tests/test_api_recovery.py)
    said = [event["msg"] for event in map(json.loads, filter(lambda line: line.startswith("{"), env.log().splitlines()))
            if event["msg"].startswith(f"API {kind} request refused")]
    wanted = f'cannot {verb} resource "{resource}"'
    assert len(said) == 1 and wanted in said[0] and "403" in said[0], said


def test_the_charts_clusterrole_lets_the_agent_write_and_count_events(rbac_env):
    """The Event on a ClusterNetworkPolicy the agent fails closed on is created, and patched
    (its count bumped) when the policy changes and still fails the same way."""
    cp, env, _ = rbac_env
    stored = cp.apply(DNS_POLICY)
    try:
        env.start_agent()

        def counts() -> list[int]:
            return [e["count"] for e in cp.request("GET", "/api/v1/events")["items"]
                    if e["involvedObject"].get("uid") == stored["metadata"]["uid"]]

        eventually(counts, [1], timeout=15)
        cp.apply({**DNS_POLICY, "spec": {**DNS_POLICY["spec"], "priority": 6}})
        eventually(counts, [2], timeout=15)
        assert env.metric("nftpolicy_events_total", result="failed") == 0
    finally:
        cp.delete("ClusterNetworkPolicy", DNS_POLICY["metadata"]["name"])


def test_the_charts_default_secure_metrics_answer_401_403_and_200_to_prometheus(rbac_env):
    """The agent as the chart runs it (--metrics-secure true, a self-signed certificate), with
    the chart's ClusterRole: it asks the API server about each scraper's token."""
    cp, env, _ = rbac_env
    reader = next(d for d in render("default") if d["metadata"]["name"].endswith("-metrics-reader"))
    cp.apply(reader)
    cp.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "prometheus-reads-nftpolicy"},
              "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": reader["metadata"]["name"]},
              "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": "monitoring"}]})
    prometheus, nosy = cp.service_account_token("monitoring", "prometheus"), cp.service_account_token("monitoring", "nosy")
    env.extra_args = ("--metrics-secure", "true")
    env.start_agent(wait_ready=False)
    address = ("127.0.0.1", env.port)
    try:
        eventually(lambda: scrape(address, None, "/readyz")[0], 200, timeout=20)  # the probes' path needs no token
        assert scrape(address, None)[0] == 401
        assert scrape(address, nosy)[0] == 403
        status, body = scrape(address, prometheus)
        assert status == 200 and b'nftpolicy_api_errors_total{kind="Pod",reason="403"}' not in body
        assert b'nftpolicy_http_auth_total{result="forbidden"} 1.0' in body
    finally:
        cp.request("DELETE", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/prometheus-reads-nftpolicy")
