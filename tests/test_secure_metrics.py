"""``--metrics-secure`` against the real kube-apiserver (RBAC): /metrics over TLS, for a bearer
token whose user may ``get`` the non-resource URL /metrics, as the API server's TokenReview and
SubjectAccessReview say. The agent's ServiceAccount has exactly the chart's ClusterRole; the
scrapers' permission is the chart's metrics-reader ClusterRole, bound as an operator binds it to
Prometheus' ServiceAccount. No token: 401; a ServiceAccount without the permission: 403;
Prometheus': 200. Answers are kept a short while (a fake clock moves past it), errors never."""

from __future__ import annotations

import http.client
import ssl

import pytest

from nftpolicy.agent.daemon.health import Health, serve_http
from nftpolicy.agent.daemon.kubeauth import ALLOW_TTL, DENY_TTL, DelegatedAuth
from nftpolicy.agent.daemon.kubeclient import client as k8s
from nftpolicy.agent.daemon.kubeclient import load_configuration
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.serving import ServingCertificate
from nftpolicy.agent.testbed.controlplane import ControlPlane

from .conftest import eventually
from .fakeclock import FakeClock
from .test_chart import NAMESPACE, render

pytestmark = pytest.mark.tools("etcd", "kube-apiserver", "helm")
MONITORING = "monitoring"


def named(docs: list[dict], kind: str, suffix: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return found


def api_client(kubeconfig: str) -> k8s.ApiClient:
    configuration = k8s.Configuration()
    load_configuration(kubeconfig, configuration)
    configuration.retries = False
    return k8s.ApiClient(configuration)


def scrape(address, token: str | None, path: str = "/metrics") -> tuple[int, bytes]:
    """GET over TLS (the self-signed certificate is not checked: a ServiceMonitor's
    insecureSkipVerify), with ``token`` as the bearer token; (0, b"") when nothing answers."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    connection = http.client.HTTPSConnection(*address[:2], timeout=15, context=context)
    try:
        connection.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        reply = connection.getresponse()
        return reply.status, reply.read()
    except OSError:
        return 0, b""
    finally:
        connection.close()


@pytest.fixture(scope="module")
def cluster():
    """The control plane with the chart's agent ClusterRole and binding, the metrics-reader
    ClusterRole bound to ServiceAccount monitoring/prometheus, and a token each for the agent,
    Prometheus and monitoring/nosy (no binding)."""
    docs = render("default")
    with ControlPlane(authorization="RBAC") as cp:
        agent_role, reader = named(docs, "ClusterRole", "nftpolicy"), named(docs, "ClusterRole", "-metrics-reader")
        cp.apply(agent_role)
        cp.apply(named(docs, "ClusterRoleBinding", "nftpolicy"))
        cp.apply(reader)
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "prometheus-nftpolicy"},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": reader["metadata"]["name"]},
                   "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": MONITORING}]}
        cp.apply(binding)
        account = named(docs, "ServiceAccount", "nftpolicy")["metadata"]["name"]
        tokens = {"agent": cp.service_account_token(NAMESPACE, account), "prometheus": cp.service_account_token(MONITORING, "prometheus"),
                  "nosy": cp.service_account_token(MONITORING, "nosy")}
        yield cp, tokens, binding, agent_role


@pytest.fixture
def secure(cluster):
    """The agent's HTTP server with --metrics-secure: TLS, the guard asking as the agent."""
    cp, tokens, binding, role = cluster
    clock, metrics = FakeClock(), Metrics()
    auth = DelegatedAuth(api_client(cp.kubeconfig_for(tokens["agent"], "agent")), 10, metrics, clock=clock)
    server = serve_http("127.0.0.1:0", metrics, Health(window=60), tls=ServingCertificate(None, None, ["node1"]), guard=auth)
    yield server, tokens, clock, metrics
    server.shutdown()


def results(metrics: Metrics) -> dict[str, float]:
    return {s.labels["result"]: s.value for f in metrics.registry.collect() if f.name == "nftpolicy_http_auth" for s in f.samples
            if s.name.endswith("_total")}


def test_401_without_a_token_403_without_the_permission_200_for_prometheus(secure):
    server, tokens, _, metrics = secure
    assert scrape(server.server_address, None) == (401, b"unauthorized: a bearer token is needed\n")
    assert scrape(server.server_address, "not-a-token")[0] == 401
    status, body = scrape(server.server_address, tokens["nosy"])
    assert (status, body) == (403, b"forbidden: system:serviceaccount:monitoring:nosy may not get /metrics\n")
    status, body = scrape(server.server_address, tokens["prometheus"])
    assert status == 200 and b"nftpolicy_table_generation" in body
    # the probes' paths need no token, and say nothing but ok or a short reason
    assert scrape(server.server_address, None, "/healthz") == (200, b"ok\n")
    assert scrape(server.server_address, None, "/readyz")[0] == 503
    assert results(metrics) == {"allowed": 1, "unauthenticated": 2, "forbidden": 1, "error": 0, "rate_limited": 0}


def test_answers_are_kept_briefly(cluster, secure):
    """A permission taken away still serves until ALLOW_TTL has passed; a refusal is kept
    DENY_TTL only, so a permission granted works within it."""
    cp, _, binding, _ = cluster
    server, tokens, clock, _ = secure
    assert scrape(server.server_address, tokens["prometheus"])[0] == 200
    cp.request("DELETE", f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{binding['metadata']['name']}")
    try:
        assert scrape(server.server_address, tokens["prometheus"])[0] == 200  # kept
        # (the API server's RBAC takes a moment to see the change: each try is after ALLOW_TTL)
        eventually(lambda: scrape(server.server_address, tokens["prometheus"])[0], 403, clock=clock, step=ALLOW_TTL)
    finally:
        cp.apply(binding)
    assert scrape(server.server_address, tokens["prometheus"])[0] == 403  # the refusal is kept...
    eventually(lambda: scrape(server.server_address, tokens["prometheus"])[0], 200, clock=clock, step=DENY_TTL)  # ...briefly


def test_an_agent_that_may_not_ask_answers_503_and_keeps_no_answer(cluster, secure):
    """Without create on tokenreviews the agent cannot know who calls: 503, never a guess, and
    nothing kept: once the permission is back, the next scrape is answered."""
    cp, _, _, role = cluster
    server, tokens, _, metrics = secure
    narrowed = {**role, "rules": [r for r in role["rules"] if "tokenreviews" not in r["resources"]]}
    cp.apply(narrowed)
    try:
        assert scrape(server.server_address, tokens["prometheus"]) == (503, b"cannot check the token with the API server now\n")
    finally:
        cp.apply(role)
    assert scrape(server.server_address, tokens["prometheus"])[0] == 200
    assert results(metrics)["error"] == 1


def test_random_tokens_cannot_flood_the_api_server(secure):
    """Tokens not seen before cost one TokenReview each, at most REVIEW_BURST at once and
    REVIEWS_PER_SECOND after: beyond that 429, and the API server is not asked."""
    from nftpolicy.agent.daemon.kubeauth import REVIEW_BURST

    server, tokens, _, metrics = secure
    codes = [scrape(server.server_address, f"random-{i}")[0] for i in range(REVIEW_BURST + 5)]
    assert codes == [401] * REVIEW_BURST + [429] * 5
    assert results(metrics)["rate_limited"] == 5
