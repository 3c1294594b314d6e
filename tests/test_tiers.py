"""Unit tests of the tier evaluator (tests/tiers.py, the spec oracle): the tier order of ClusterNetworkPolicy.

Pure. Each table row quotes the sentence of the API reference (network-policy-api v0.2.0,
``apis/v1alpha2/clusternetworkpolicy_types.go``) it checks. The NetworkPolicy tier is checked
against every NetworkPolicy conformance case's expected matrices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from nftpolicy.translators.cases import load_case
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.model import Cluster

from .tiers import connection_allowed, direction_decision, evaluated_matrix, tier_order

from . import fakeapi
from .fakeapi import namespace

CASES = Path(__file__).parent / "conformance"


def pod(key: str, ip: str, **labels: str) -> dict[str, Any]:
    """Pod ``key`` (``ns/name``) on n1, labelled ``pod: name``, with ports web (80) and dns (53/UDP)."""
    namespace, name = key.split("/")
    return fakeapi.pod(namespace, name, ip, node="n1", ports=(("web", 80, "TCP"), ("dns", 53, "UDP")), **{"pod": name, **labels})


def cnp(name: str, tier: str, priority: int, *, subject: dict | None = None, ingress: list | None = None,
        egress: list | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"tier": tier, "priority": priority,
                            "subject": subject or {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "x"}}}}
    if ingress is not None:
        spec["ingress"] = ingress
    if egress is not None:
        spec["egress"] = egress
    return {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": name}, "spec": spec}


def from_ns(action: str, namespace: str, *ports: dict) -> dict[str, Any]:
    rule: dict[str, Any] = {"action": action, "from": [{"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}]}
    if ports:
        rule["protocols"] = list(ports)
    return rule


def to(action: str, peer: dict, *ports: dict) -> dict[str, Any]:
    rule: dict[str, Any] = {"action": action, "to": [peer]}
    if ports:
        rule["protocols"] = list(ports)
    return rule


def tcp(number: int) -> dict[str, Any]:
    return {"tcp": {"destinationPort": {"number": number}}}


def netpol(key: str, types: list[str], ingress: list | None = None, egress: list | None = None, selector: dict | None = None) -> dict[str, Any]:
    namespace, name = key.split("/")
    spec: dict[str, Any] = {"podSelector": selector or {}, "policyTypes": types}
    if ingress is not None:
        spec["ingress"] = ingress
    if egress is not None:
        spec["egress"] = egress
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": namespace, "name": name}, "spec": spec}


BASE = [namespace("x"), namespace("y"), namespace("z"), pod("x/a", "10.0.0.1"), pod("y/a", "10.0.1.1"), pod("z/a", "10.0.2.1")]
NP_ALLOW_FROM_Z = netpol("x/allow-z", ["Ingress"], ingress=[{"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "z"}}}]}])
NP_DENY_ALL = netpol("x/deny-all", ["Ingress"])


def cluster(*objects: dict[str, Any]) -> Cluster:
    result, errors = build_cluster(("test", o) for o in [*BASE, *objects])
    assert not errors, errors
    return result


def allowed(c: Cluster, src: str, dst: str, port: int = 80, protocol: str = "TCP") -> bool:
    return connection_allowed(c, c.pods[src], c.pods[dst], protocol, port)  # type: ignore[arg-type]


# (sentence, objects, [(from, to, port, allowed)])
TABLE = [
    ("Accept: No further ClusterNetworkPolicy or NetworkPolicy rules will be processed",
     [cnp("accept-y", "Admin", 1, ingress=[from_ns("Accept", "y")]), NP_DENY_ALL],
     [("y/a", "x/a", 80, True), ("z/a", "x/a", 80, False)]),
    ("Deny: Drops the selected traffic. No further ClusterNetworkPolicy or NetworkPolicy rules will be processed",
     [cnp("deny-y", "Admin", 1, ingress=[from_ns("Deny", "y")]), netpol("x/allow-all", ["Ingress"], ingress=[{}])],
     [("y/a", "x/a", 80, False), ("z/a", "x/a", 80, True)]),
    ("Pass: Skips all further ClusterNetworkPolicy rules in the current tier ... and passes evaluation to the next tier",
     [cnp("pass-y", "Admin", 1, ingress=[from_ns("Pass", "y")]), cnp("deny-y", "Admin", 2, ingress=[from_ns("Deny", "y")])],
     [("y/a", "x/a", 80, True)]),
    ("Pass ... if an Admin tier CNP uses Pass action, NetworkPolicy evaluation will happen next",
     [cnp("pass-y", "Admin", 1, ingress=[from_ns("Pass", "y")]), NP_ALLOW_FROM_Z],
     [("y/a", "x/a", 80, False), ("z/a", "x/a", 80, True)]),
    ("Pass in the Admin tier reaches the Baseline tier when no NetworkPolicy selects the pod",
     [cnp("pass-y", "Admin", 1, ingress=[from_ns("Pass", "y")]), cnp("base-deny-y", "Baseline", 1, ingress=[from_ns("Deny", "y")])],
     [("y/a", "x/a", 80, False), ("z/a", "x/a", 80, True)]),
    ("Policies with lower priority values have higher precedence",
     [cnp("b-accept", "Admin", 5, ingress=[from_ns("Accept", "y")]), cnp("a-deny", "Admin", 6, ingress=[from_ns("Deny", "y")])],
     [("y/a", "x/a", 80, True)]),
    ("Policies with lower priority values ... are checked before policies with higher priority values (the other way round)",
     [cnp("b-accept", "Admin", 7, ingress=[from_ns("Accept", "y")]), cnp("a-deny", "Admin", 6, ingress=[from_ns("Deny", "y")])],
     [("y/a", "x/a", 80, False)]),
    ("The relative precedence of ingress rules within a single CNP object ... determined by the order in which the rule is written",
     [cnp("order", "Admin", 1, ingress=[from_ns("Accept", "y", tcp(80)), from_ns("Deny", "y")])],
     [("y/a", "x/a", 80, True), ("y/a", "x/a", 81, False)]),
    ("All Admin tier rules have higher precedence than NetworkPolicy or Baseline tier rules",
     [cnp("base-accept", "Baseline", 0, ingress=[from_ns("Accept", "y")]), cnp("admin-deny", "Admin", 1000, ingress=[from_ns("Deny", "y")])],
     [("y/a", "x/a", 80, False)]),
    ("Baseline tier is a cluster-wide policy that can be overridden by the v1.NetworkPolicy",
     [cnp("base-deny", "Baseline", 1, ingress=[from_ns("Deny", "z")]), NP_ALLOW_FROM_Z],
     [("z/a", "x/a", 80, True), ("y/a", "x/a", 80, False)]),
    ("v1.NetworkPolicy always makes a final decision for selected pods. Further evaluation only happens for Pods not selected",
     [cnp("base-accept", "Baseline", 1, ingress=[from_ns("Accept", "y")]), NP_ALLOW_FROM_Z],
     [("y/a", "x/a", 80, False)]),
    ("A NetworkPolicy of the other direction does not select the pod for this one: Baseline applies",
     [cnp("base-deny", "Baseline", 1, ingress=[from_ns("Deny", "y")]), netpol("x/egress-only", ["Egress"], egress=[{}])],
     [("y/a", "x/a", 80, False)]),
    ("If a given connection wasn't allowed or denied by any of the tiers ... all pods can communicate with each other",
     [cnp("base-pass", "Baseline", 1, ingress=[from_ns("Pass", "y")]), cnp("base-deny", "Baseline", 2, ingress=[from_ns("Deny", "y")])],
     [("y/a", "x/a", 80, True)]),
    ("CNPs with no ingress rules do not affect ingress traffic",
     [cnp("egress-only", "Admin", 1, egress=[to("Deny", {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "z"}}})])],
     [("y/a", "x/a", 80, True), ("x/a", "z/a", 80, False), ("x/a", "y/a", 80, True)]),
    ("Accept (egress) ... any ingress rules at the destination do apply (each end decides its own direction)",
     [cnp("egress-accept", "Admin", 1, egress=[to("Accept", {"namespaces": {}})]),
      netpol("z/deny-all", ["Ingress"])],
     [("x/a", "z/a", 80, False), ("x/a", "y/a", 80, True)]),
    ("Networks ... cluster-internal traffic will be checked against the rule as well",
     [cnp("deny-net", "Admin", 1, egress=[to("Deny", {"networks": ["10.0.2.0/24"]})])],
     [("x/a", "z/a", 80, False), ("x/a", "y/a", 80, True)]),
    ("Pods is used to select pods via namespace AND pod selectors",
     [cnp("deny-pod", "Admin", 1, ingress=[{"action": "Deny", "from": [
         {"pods": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "y"}}, "podSelector": {"matchLabels": {"pod": "b"}}}}]}])],
     [("y/a", "x/a", 80, True)]),
    ("DestinationNamedPort selects a destination port on a pod based on the ContainerPort name",
     [cnp("deny-web", "Admin", 1, ingress=[from_ns("Deny", "y", {"destinationNamedPort": "web"})]),
      cnp("deny-dns", "Admin", 2, egress=[to("Deny", {"namespaces": {}}, {"destinationNamedPort": "dns"})])],
     [("y/a", "x/a", 80, False), ("y/a", "x/a", 81, True), ("x/a", "z/a", 53, True)]),
    ("Subject namespaces: the policy selects the pods of the namespaces it matches only",
     [cnp("deny-all", "Admin", 1, ingress=[{"action": "Deny", "from": [{"namespaces": {}}]}])],
     [("y/a", "x/a", 80, False), ("x/a", "y/a", 80, True)]),
]


@pytest.mark.parametrize("sentence, objects, probes", TABLE, ids=[row[0][:60] for row in TABLE])
def test_tier_order(sentence, objects, probes):
    c = cluster(*objects)
    assert [(src, dst, port, allowed(c, src, dst, port)) for src, dst, port, _ in probes] == probes


def test_named_port_matches_the_container_ports_protocol():
    c = cluster(cnp("deny-dns", "Admin", 1, ingress=[from_ns("Deny", "y", {"destinationNamedPort": "dns"})]))
    assert not allowed(c, "y/a", "x/a", 53, "UDP")
    assert allowed(c, "y/a", "x/a", 53, "TCP")


def test_port_ranges_are_inclusive_and_per_protocol():
    c = cluster(cnp("deny-range", "Admin", 1, ingress=[from_ns("Deny", "y", {"udp": {"destinationPort": {"range": {"start": 80, "end": 90}}}})]))
    assert [allowed(c, "y/a", "x/a", p, "UDP") for p in (79, 80, 90, 91)] == [True, False, False, True]
    assert allowed(c, "y/a", "x/a", 85, "TCP")


def test_priority_ties_are_broken_by_name():
    c = cluster(cnp("b-deny", "Admin", 4, ingress=[from_ns("Deny", "y")]), cnp("a-accept", "Admin", 4, ingress=[from_ns("Accept", "y")]))
    assert [p.name for p in tier_order(c, "Admin")] == ["a-accept", "b-deny"]
    assert allowed(c, "y/a", "x/a")
    assert direction_decision(c, "ingress", c.pods["x/a"], c.pods["y/a"], "TCP", 80).by == "ClusterNetworkPolicy a-accept ingress rule 0 (Accept)"


def test_an_address_outside_the_pods_is_matched_by_networks_only():
    c = cluster(cnp("deny", "Admin", 1, egress=[to("Deny", {"networks": ["192.0.2.0/24"]}), to("Deny", {"namespaces": {}})]))
    assert not connection_allowed(c, c.pods["x/a"], "192.0.2.7", "TCP", 80)
    assert not connection_allowed(c, c.pods["x/a"], c.pods["y/a"], "TCP", 80)
    assert connection_allowed(c, c.pods["x/a"], "198.51.100.1", "TCP", 80)


def test_ipv6_networks_never_match_ipv4_addresses():
    c = cluster(cnp("deny-v6", "Admin", 1, egress=[to("Deny", {"networks": ["::/0"]})]))
    assert connection_allowed(c, c.pods["x/a"], c.pods["y/a"], "TCP", 80)
    assert connection_allowed(c, c.pods["x/a"], "192.0.2.7", "TCP", 80)


def test_a_nodes_peer_matches_the_nodes_its_selector_selects_and_no_pod():
    infra = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": {"role": "infra"}},
             "status": {"addresses": [{"type": "InternalIP", "address": "172.18.0.2"}]}}
    worker = {**infra, "metadata": {"name": "n2", "labels": {"role": "worker"}}}
    c = cluster(infra, worker, cnp("nodes", "Admin", 1, egress=[to("Accept", {"nodes": {"matchLabels": {"role": "infra"}}}, tcp(80)),
                                                             to("Deny", {"nodes": {}})]))
    n1, n2 = c.nodes["n1"], c.nodes["n2"]
    assert connection_allowed(c, c.pods["x/a"], n1, "TCP", 80) and not connection_allowed(c, c.pods["x/a"], n1, "TCP", 81)
    assert not connection_allowed(c, c.pods["x/a"], n2, "TCP", 80)  # the second rule: every Node
    assert connection_allowed(c, c.pods["x/a"], c.pods["y/a"], "TCP", 81)  # a pod is no Node
    assert not connection_allowed(c, c.pods["x/a"], "172.18.0.2", "TCP", 81)  # n1's address, as an address
    assert connection_allowed(c, c.pods["x/a"], "172.18.0.9", "TCP", 81)  # no Node's


def test_host_network_pods_are_never_subjects_or_peers():
    host = pod("y/host", "10.0.1.9")
    host["spec"]["hostNetwork"] = True
    c = cluster(host, cnp("deny-y", "Admin", 1, ingress=[from_ns("Deny", "y")]), cnp("deny-all-y", "Admin", 2, subject={"namespaces": {}},
                                                                                     egress=[to("Deny", {"namespaces": {}})]))
    assert allowed(c, "y/host", "x/a") and not allowed(c, "y/a", "x/a")


NETPOL_CASES = sorted(p for p in CASES.glob("*/*.yaml") if "clusterNetworkPolicies" not in p.read_text())


@pytest.mark.parametrize("path", NETPOL_CASES, ids=[p.stem for p in NETPOL_CASES])
def test_the_network_policy_tier_gives_every_networkpolicy_case_its_expected_matrix(path):
    case = load_case(path.read_text())
    for probe in case.probes:
        evaluated = evaluated_matrix(case, probe)
        wrong = {cell: want for cell, want in probe.expected.items() if cell[0] != cell[1] and evaluated[cell] != want}
        assert not wrong, f"{probe.protocol}/{probe.port}: {wrong}"


def test_the_network_policy_tier_reads_end_port_as_an_inclusive_range():
    c = cluster(netpol("x/range", ["Ingress"], ingress=[{"ports": [{"port": 80, "endPort": 82}]}]))
    assert [allowed(c, "y/a", "x/a", p) for p in (79, 80, 82, 83)] == [False, True, True, False]
