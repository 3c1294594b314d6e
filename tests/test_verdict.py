"""The verdict engine (nftpolicy.translators.verdict).

* Pure: for every shared conformance case (tests/conformance/upstream and tests/conformance/own),
  with the pods at the addresses the sandbox gives them (one node and two nodes, IPv4 and IPv6),
  the engine's matrix equals the case's expected matrix (diagonal ignored, as upstream).
* Its reasons: the policy and rule index that allowed, the policies that isolate, the
  exemptions, and what the rules do allow when none did.
* Kernel: on random small clusters (hypothesis), the engine's verdict equals the real packet's
  verdict in a sandbox, for TCP, UDP and ICMP echo, same node and across nodes, and from a pod
  to itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.agent.testbed.sandbox import Sandbox
from nftpolicy.translators.cases import Case, case_manifests, load_case, target_address
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.model import Cluster, Family
from nftpolicy.translators.verdict import (
    Connection,
    Enforcement,
    enforcement_from_json,
    enforcement_json,
    enforcement_of,
    verdict_lines,
)

from .conftest import CONFORMANCE, OWN_CASES, REPO
from .fakeapi import namespace
from .test_rules import cluster_of, labels, netpol, peers, pod, port_entries, selectors

FILES = sorted(CONFORMANCE.glob("*.yaml")) + sorted(OWN_CASES.glob("*.yaml"))
LAYOUTS = {"one-node-ipv4": (("node1",), "ipv4"), "two-nodes-ipv4": (("node1", "node2"), "ipv4"),
           "two-nodes-ipv6": (("node1", "node2"), "ipv6")}


@contextlib.contextmanager
def sandbox_addresses(pods: Any, nodes: tuple[str, ...], family: Family, served_nodes: Any = ()) -> Iterator[Sandbox]:
    """A Sandbox object that is never entered: it gives the pods and nodes the nodes and
    addresses the sandbox would (agent/testbed/sandbox.py), and creates no namespace."""
    sandbox = Sandbox(pods, nodes, (family,), served_nodes=sorted(served_nodes))
    try:
        yield sandbox
    finally:
        sandbox.prober.close()


def case_cluster(case: Case, nodes: tuple[str, ...], family: Family) -> Cluster:
    """The case's cluster as agent/testbed/replay.py builds it: the pods of the case at sandbox addresses."""
    skeleton, _ = build_cluster(("case", o) for o in case_manifests(dataclasses.replace(case, policies=()), {}))
    with sandbox_addresses(skeleton.pods.values(), nodes, family, case.nodes) as sandbox:
        ips = {key: list(p.ips) for key, p in sandbox.pods.items()}
        cluster, errors = build_cluster(("case", o) for o in case_manifests(case, ips))
        assert errors == [], [str(e) for e in errors]
        return sandbox.with_sandbox_pods(cluster)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_engine_matrix_equals_the_expected_matrix(path, layout):
    nodes, family = LAYOUTS[layout]
    case = load_case(path.read_text())
    cluster = case_cluster(case, nodes, family)
    assert {p.node for p in cluster.pods.values()} == set(nodes)
    enforcement = enforcement_of(cluster, nodes)
    wrong = []
    for probe in case.probes:
        for (src, dst), expected in probe.expected.items():
            if src == dst:
                continue
            conn = Connection(cluster.pods[src].ips[0], target_address(cluster, dst, family), probe.protocol, probe.port)
            if enforcement.verdict(conn).allowed is not expected:
                wrong.append(f"{probe.protocol}/{probe.port} {src} -> {dst}: expected {'allowed' if expected else 'blocked'}")
    assert wrong == []


# --------------------------------------------------------------------------- reasons

SHOP = REPO / "examples" / "shop" / "cluster.yaml"
FRONTEND, API, PROMETHEUS, DB, DEBUG = "10.244.1.10", "10.244.1.11", "10.244.1.12", "10.244.2.10", "10.244.2.12"


@pytest.fixture(scope="module")
def shop() -> Enforcement:
    from nftpolicy.agent.daemon.manifestfiles import load_cluster

    cluster, errors = load_cluster([str(SHOP)])
    assert errors == []
    return enforcement_of(cluster)


def test_denied_names_the_isolating_policy_and_what_its_rules_allow(shop):
    v = shop.verdict(Connection(FRONTEND, DB, "TCP", 5432))
    assert v.allowed is False
    assert (v.egress.pod, v.egress.node, v.egress.isolated, v.egress.policies) == \
        ("shop/frontend-7d9c8b6f5-x2k4p", "node1", True, ("shop/frontend-egress",))
    assert v.egress.allowed is False and v.egress.allowed_by is None
    assert [(r.rule, r.peers, r.ports) for r in v.egress.rules] == [
        (0, ("pods in shop: app=api",), ("any port",)), (1, ("any destination",), ("UDP/53", "TCP/53"))]
    # the db's ingress is evaluated on node2, and its ipBlock excepts the frontend
    assert (v.ingress.pod, v.ingress.node, v.ingress.allowed, v.ingress.policies) == ("shop/db-0", "node2", False, ("shop/db-ingress",))
    assert [(r.rule, r.peers, r.ports) for r in v.ingress.rules] == [
        (0, ("ipBlock 10.244.1.0/24 except 10.244.1.10/32",), ("TCP/5432",))]


def test_allowed_names_the_policy_and_rule(shop):
    v = shop.verdict(Connection(PROMETHEUS, API, "TCP", 9090))
    assert v.allowed is True
    assert not v.egress.isolated and v.egress.allowed and v.egress.policies == ()
    by = v.ingress.allowed_by
    assert (by.policy, by.direction, by.rule) == ("shop/api-ingress", "ingress", 1)
    assert by.peers == ("pods in namespaces team=ops: app=prometheus",)
    assert by.ports == ("port metrics/TCP of local pods in shop: app=api",)
    assert not shop.verdict(Connection(PROMETHEUS, API, "TCP", 8080)).allowed


def test_lines_read_as_the_issue_shows(shop):
    lines = verdict_lines(shop.verdict(Connection(API, DB, "TCP", 5432)))
    assert lines == [
        "ALLOWED  shop/api-5f6b7c9d4-q8w2n -> shop/db-0 TCP/5432",
        "  egress of shop/api-5f6b7c9d4-q8w2n: not isolated (no policy selects it for egress), allowed",
        "  ingress of shop/db-0: isolated by shop/db-ingress; allowed by shop/db-ingress rule 0 "
        "(from ipBlock 10.244.1.0/24 except 10.244.1.10/32 on TCP/5432)",
    ]


def test_exemptions():
    m = cluster_of(namespace("x"), pod("x/a", "10.0.0.1", node="n1", app="a"), pod("x/b", "10.0.0.2", node="n1", app="b"),
                   netpol("x/deny", {}, types=["Ingress", "Egress"]),
                   {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"},
                    "status": {"addresses": [{"type": "InternalIP", "address": "172.18.0.2"}]}})
    e = enforcement_of(m)
    assert e.verdict(Connection("10.0.0.1", "10.0.0.2", "TCP", 80)).allowed is False
    assert e.verdict(Connection("10.0.0.1", "10.0.0.2", "ICMP")).allowed is False  # echo goes through the policies
    for conn, exemption in [
        (Connection("10.0.0.1", "10.0.0.2", "TCP", 80, established=True), "established"),
        (Connection("10.0.0.1", "10.0.0.2", "ICMP", icmp_type="destination-unreachable"), "essential ICMP error"),
    ]:
        v = e.verdict(conn)
        assert v.allowed and v.egress.exemption == v.ingress.exemption == exemption
    v = e.verdict(Connection("172.18.0.2", "10.0.0.2", "TCP", 80))
    assert v.allowed and v.ingress.exemption == "node-local source" and v.egress.pod is None
    v = e.verdict(Connection("10.0.0.1", "172.18.0.2", "TCP", 30080))
    assert v.allowed and v.egress.exemption == "node port"
    assert not e.verdict(Connection("10.0.0.1", "172.18.0.2", "TCP", 22)).allowed
    assert e.verdict(Connection("10.0.0.1", "10.96.0.10", "UDP", 53)).egress.exemption == "service cluster IP"


def test_a_pod_to_its_own_address_is_allowed(shop):
    """The packet stays on the pod's loopback: no chain of any node sees it (the sandbox's
    diagonal is connected), even when the pod is isolated in both directions."""
    m = cluster_of(namespace("x"), pod("x/a", "10.0.0.1", "fd00::1", node="n1", app="a"), netpol("x/deny", {}, types=["Ingress", "Egress"]))
    for address in ("10.0.0.1", "fd00::1"):
        v = enforcement_of(m).verdict(Connection(address, address, "TCP", 80))
        assert v.allowed is True and v.egress.exemption == v.ingress.exemption == "own address"
        assert verdict_lines(v)[1] == "  egress of x/a: allowed: to its own address (it never leaves the pod)"
    v = shop.verdict(Connection(DB, DB, "TCP", 5432))  # isolated for ingress, and no rule allows it
    assert v.allowed is True and v.ingress.exemption == "own address"


def test_a_node_whose_model_is_absent_is_unknown(shop):
    node1 = Enforcement({"node1": shop.models["node1"]}, shop.pods, shop.node_addresses)
    v = node1.verdict(Connection(FRONTEND, DB, "TCP", 5432))
    assert v.allowed is False and v.ingress.known is False and v.ingress.allowed is None
    v = node1.verdict(Connection(API, DB, "TCP", 5432))
    assert v.allowed is None and "enforced on node node2" in verdict_lines(v)[2]


def test_json_round_trip(shop):
    again = enforcement_from_json(enforcement_json(shop))
    assert again.models == shop.models and again.pods == shop.pods
    conn = Connection(PROMETHEUS, API, "TCP", 9090)
    assert again.verdict(conn) == shop.verdict(conn)


def test_a_policy_name_longer_than_a_comment_loses_nothing():
    # nft keeps 128 bytes of a comment: the rule's policy and index are fields of the model, so a
    # name of 253 characters (the longest a NetworkPolicy may have) still names its second rule.
    name = "a-very-long-policy-name-" + "x" * 229
    cluster = cluster_of(namespace("x"), pod("x/a", "10.0.0.1", app="a"), pod("x/b", "10.0.0.2", app="b"),
                         netpol(f"x/{name}", labels(app="b"), ingress=[
                             {"from": [{"podSelector": labels(app="nobody")}], "ports": [{"port": 80}]},
                             {"from": [{"podSelector": labels(app="a")}], "ports": [{"port": 8080}]}]))
    engine = enforcement_of(cluster)
    chain = engine.models[next(iter(engine.models))].policy_chains[0]
    assert all(len(r.comment.encode()) <= 128 for r in chain.rules) and f"x/{name}" not in chain.rules[0].comment
    assert [(r.origin.policy, r.origin.index) for r in chain.rules] == [(f"x/{name}", 0), (f"x/{name}", 1)]
    side = engine.verdict(Connection("10.0.0.1", "10.0.0.2", "TCP", 8080)).ingress
    assert side.allowed and side.allowed_by is not None
    assert (side.allowed_by.policy, side.allowed_by.direction, side.allowed_by.rule) == (f"x/{name}", "ingress", 1)


# --------------------------------------------------------------------------- against the kernel

V4 = [f"10.0.0.{i}" for i in range(1, 6)]
SPECS = [ProbeSpec(80, "TCP"), ProbeSpec(53, "UDP"), ProbeSpec(0, "ICMP")]


@st.composite
def some_rules(draw, peers_key: str) -> list[dict]:
    """One or two rules, most with peers and ports (an empty rule allows everything)."""
    rules = []
    for _ in range(draw(st.integers(1, 2))):
        rule: dict[str, Any] = {}
        if draw(st.integers(0, 3)):
            rule[peers_key] = draw(st.lists(peers, min_size=1, max_size=2))
        if draw(st.integers(0, 3)):
            rule["ports"] = draw(st.lists(port_entries, min_size=1, max_size=2))
        rules.append(rule)
    return rules


@st.composite
def small_clusters(draw):
    objects: list[dict] = [namespace("x", team=draw(st.sampled_from(["red", "blue"]))), namespace("y", team="blue")]
    for i in range(draw(st.integers(3, 4))):
        ports = (("http", 80, "TCP"),) if draw(st.booleans()) else (("dns", 53, "UDP"),)
        objects.append(pod(f"{draw(st.sampled_from(['x', 'y']))}/p{i}", V4[i], node=draw(st.sampled_from(["n1", "n2"])),
                           ports=ports, app=draw(st.sampled_from(["a", "b", "c"]))))
    for i in range(draw(st.integers(1, 2))):
        spec: dict[str, Any] = {}
        types = draw(st.sampled_from([None, ["Ingress"], ["Egress"], ["Ingress", "Egress"]]))
        if types is None or "Ingress" in types:
            spec["ingress"] = draw(some_rules("from"))
        if types is None or "Egress" in types:
            spec["egress"] = draw(some_rules("to"))
        objects.append(netpol(f"{draw(st.sampled_from(['x', 'y']))}/np{i}", draw(selectors), types=types, **spec))
    return objects


@pytest.mark.kernel
@settings(max_examples=8, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(objects=small_clusters())
def test_engine_verdict_equals_the_packet_verdict(objects):
    cluster = cluster_of(*objects)
    with Sandbox(cluster.pods.values(), ("n1",), ("ipv4",), timeout=0.5) as sandbox:
        cluster = sandbox.with_sandbox_pods(cluster)
        sandbox.apply(cluster)
        enforcement = enforcement_of(cluster, list(sandbox.nodes))
        results = sandbox.probe(SPECS, ("ipv4",))
        wrong = []
        for (spec, _), matrix in results.items():
            for (src, dst), connected in matrix.items():
                conn = Connection(cluster.pods[src].ips[0], cluster.pods[dst].ips[0], spec.protocol,  # type: ignore[arg-type]
                                  None if spec.protocol == "ICMP" else spec.port)
                if enforcement.verdict(conn).allowed is not connected:
                    wrong.append(f"{spec.protocol}/{spec.port} {src} -> {dst}: packet {connected}, engine {not connected}")
        assert wrong == [], "\n".join(wrong)
