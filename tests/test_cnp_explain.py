"""The verdict engine (translators/verdict.py, behind ``nftpolicy explain``) with
ClusterNetworkPolicies: its matrix equals every ClusterNetworkPolicy case's, and it names the
tier and the rule that decided. Pure: the sandbox's addressing only, no namespace."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nftpolicy.translators.cases import load_case, target_address
from nftpolicy.translators.rules import Config
from nftpolicy.translators.verdict import REFUSAL_TEXT, Connection, enforcement_from_json, enforcement_json, enforcement_of, verdict_lines

from .test_verdict import LAYOUTS, build_cluster, case_manifests, sandbox_addresses

ROOT = Path(__file__).parent / "conformance"
FILES = sorted((ROOT / "cnp-upstream").glob("*.yaml")) + sorted((ROOT / "cnp-own").glob("*.yaml"))


def case_cluster(case, nodes, family):
    """The case at sandbox addresses, as agent/testbed/replay.py builds it."""
    skeleton, _ = build_cluster(("case", o) for o in case_manifests(dataclasses.replace(case, policies=(), cluster_policies=()), {}))
    with sandbox_addresses(skeleton.pods.values(), nodes, family, case.nodes) as sandbox:
        ips = {key: list(p.ips) for key, p in sandbox.pods.items()}
        cluster, errors = build_cluster(("case", o) for o in case_manifests(case, ips))
        assert errors == [], [str(e) for e in errors]
        return sandbox.with_sandbox_pods(cluster)


@pytest.mark.parametrize("layout", ["two-nodes-ipv4", "two-nodes-ipv6"])
@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_engine_matrix_equals_the_expected_matrix(path, layout):
    nodes, family = LAYOUTS[layout]
    case = load_case(path.read_text())
    cluster = case_cluster(case, nodes, family)
    enforcement = enforcement_of(cluster, nodes)
    wrong = [f"{probe.protocol}/{probe.port} {src} -> {dst}"
             for probe in case.probes for (src, dst), expected in probe.expected.items()
             if src != dst and enforcement.verdict(Connection(cluster.pods[src].ips[0], target_address(cluster, dst, family),
                                                             probe.protocol, probe.port)).allowed is not expected]
    assert wrong == []


@pytest.fixture(scope="module")
def pass_chain():
    case = load_case((ROOT / "cnp-own" / "301-pass-chain.yaml").read_text())
    cluster = case_cluster(case, ("node1",), "ipv4")
    return cluster, enforcement_of(cluster, ("node1",))


def lines(pass_chain, src: str, dst: str) -> list[str]:
    cluster, enforcement = pass_chain
    return verdict_lines(enforcement.verdict(Connection(cluster.pods[src].ips[0], cluster.pods[dst].ips[0], "TCP", 80)))


def test_a_deny_names_its_tier_policy_and_rule(pass_chain):
    # deny-y-admin (Admin, priority 2) selects every namespace: y's traffic into z is denied
    assert lines(pass_chain, "y/a", "z/a")[0] == "DENIED  y/a -> z/a TCP/80"
    assert lines(pass_chain, "y/a", "z/a")[2] == ("  ingress of z/a: denied by the Admin tier: ClusterNetworkPolicy deny-y-admin "
                                                   "rule 0 (from pods in namespaces ns=y: (any) on any port); "
                                                   "the kernel drops it (no answer: the client times out)")
    assert (pass_chain[1].verdict(Connection(pass_chain[0].pods["y/a"].ips[0], pass_chain[0].pods["z/a"].ips[0], "TCP", 80))
            .ingress.refusal) == "drop"


@pytest.mark.parametrize("deny_action, protocol, refusal", [
    ("reject", "TCP", "TCP reset"), ("reject", "UDP", "ICMP port unreachable"), ("reject", "SCTP", "ICMP port unreachable"),
    ("drop", "TCP", "drop"), ("drop", "UDP", "drop")])
def test_the_implicit_deny_says_what_the_kernel_does(pass_chain, deny_action, protocol, refusal):
    """x's NetworkPolicy denies what y sends after pass-y passed it: --deny-action decides what
    the kernel does, and explain names it (the JSON's ``refusal`` too)."""
    cluster = pass_chain[0]
    enforcement = enforcement_of(cluster, ("node1",), Config(deny_action=deny_action))
    verdict = enforcement.verdict(Connection(cluster.pods["y/a"].ips[0], cluster.pods["x/a"].ips[0], protocol, 80))
    assert verdict.allowed is False and verdict.ingress.refusal == refusal
    assert verdict.as_json()["ingress"]["refusal"] == refusal
    assert verdict_lines(verdict)[2].endswith("; " + REFUSAL_TEXT[refusal])
    assert verdict.egress.refusal is None  # allowed: nothing refused


def test_a_pass_goes_on_to_the_networkpolicy_and_a_baseline_pass_to_the_default(pass_chain):
    # pass-y passes y into x, so x's NetworkPolicy decides (it allows z only)
    assert lines(pass_chain, "y/a", "x/a")[2].startswith("  ingress of x/a: isolated by x/allow-from-z; no rule allows y/a on TCP/80")
    assert lines(pass_chain, "z/a", "x/a")[2].startswith("  ingress of x/a: isolated by x/allow-from-z; allowed by")
    # pass-all-z (Baseline) passes x into z: nothing else decides, allowed
    assert lines(pass_chain, "x/a", "z/a")[2] == "  ingress of z/a: not isolated (no policy selects it for ingress), allowed"
    # pass-x passes x into y (Admin), no NetworkPolicy: baseline-deny-x denies
    assert lines(pass_chain, "x/a", "y/a")[2].startswith("  ingress of y/a: denied by the Baseline tier: ClusterNetworkPolicy baseline-deny-x rule 0")


def test_json_round_trip_keeps_the_tier_chains(pass_chain):
    cluster, enforcement = pass_chain
    again = enforcement_from_json(enforcement_json(enforcement))
    assert again.models == enforcement.models and any(m.tier_chains for m in again.models.values())
    conn = Connection(cluster.pods["y/a"].ips[0], cluster.pods["z/a"].ips[0], "TCP", 80)
    assert again.verdict(conn) == enforcement.verdict(conn)


def test_a_nodes_peer_decision_names_the_peer_and_the_node():
    case = load_case((ROOT / "cnp-own" / "305-nodes-peer.yaml").read_text())
    cluster = case_cluster(case, ("node1", "node2"), "ipv4")
    enforcement = enforcement_of(cluster, ("node1", "node2"))

    def to_node(src: str, node: str, protocol: str, port: int) -> list[str]:
        return verdict_lines(enforcement.verdict(Connection(cluster.pods[src].ips[0], cluster.nodes[node].addresses[0], protocol, port)))

    node1, node2 = cluster.nodes["node1"].addresses[0], cluster.nodes["node2"].addresses[0]
    assert to_node("x/b", "node1", "TCP", 80)[:2] == [
        f"ALLOWED  x/b -> {node1} TCP/80",
        "  egress of x/b: allowed by the Admin tier: ClusterNetworkPolicy x-to-nodes rule 0 (to nodes role=infra on TCP/80), "
        f"{node1} is an address of node node1"]
    assert to_node("x/a", "node2", "TCP", 80)[1] == (
        "  egress of x/a: denied by the Admin tier: ClusterNetworkPolicy x-to-nodes rule 1 (to nodes (any) on any port), "
        f"{node2} is an address of node node2; the kernel drops it (no answer: the client times out)")
    assert to_node("y/a", "node2", "UDP", 81)[1] == (
        "  egress of y/a: denied by the Baseline tier: ClusterNetworkPolicy y-baseline-workers rule 0 (to nodes role=worker on UDP/81), "
        f"{node2} is an address of node node2; the kernel drops it (no answer: the client times out)")
    assert to_node("y/a", "node2", "UDP", 80)[0].startswith("ALLOWED")  # passed by the Admin tier, not denied by the Baseline one
