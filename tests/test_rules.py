"""Unit tests of the rule model (nftpolicy.translators.noderender's build_rule_model, the shared
selector sets) and the model helpers.

Pure: no kernel, no root. Clusters are built from manifest dicts through ``build_cluster`` so the
tests read like the Kubernetes API. Verdicts are checked with :func:`model_allows`, the verdict
engine (nftpolicy.translators.verdict) on one rule model: a packet passes when the source pod's
egress and the destination pod's ingress both allow it (a direction no policy isolates allows
everything); the property test checks it against a reference evaluator written from the API.

Semantics: DESIGN.md section 3 and the ``networking.k8s.io/v1`` NetworkPolicy API reference.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import random
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.model import (
    NAMESPACE_NAME_LABEL,
    IPBlock,
    Namespace,
    family_of,
)
from nftpolicy.translators.selectors import LabelSelector, Requirement
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.verdict import Connection, Enforcement
from nftpolicy.translators.rules import (
    COMMENT_MAX_BYTES,
    AddressSet,
    PortMatch,
    RuleModel,
    comment,
    hashed_name,
)

from .fakeapi import namespace

# --------------------------------------------------------------------------- manifest helpers


def pod(key: str, *ips: str, node: str | None = "n1", phase: str | None = None, host_network: bool = False,
        ports: tuple = (), **labels: str) -> dict[str, Any]:
    """A Pod manifest; ``key`` is ``ns/name``; ``ports`` are ``(name, number, protocol)``."""
    namespace, name = key.split("/")
    status: dict[str, Any] = {"podIPs": [{"ip": ip} for ip in ips]}
    if phase is not None:
        status["phase"] = phase
    containers = [{"name": "c", "ports": [{"name": n, "containerPort": num, "protocol": proto} for n, num, proto in ports]}]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": namespace, "name": name, "labels": dict(labels)},
            "spec": {"nodeName": node, "hostNetwork": host_network, "containers": containers},
            "status": status}


def netpol(key: str, selector: dict | None = None, *, ingress: list | None = None, egress: list | None = None,
           types: list[str] | None = None) -> dict[str, Any]:
    """A NetworkPolicy manifest; ``ingress``/``egress`` None are absent from the spec."""
    namespace, name = key.split("/")
    spec: dict[str, Any] = {"podSelector": selector if selector is not None else {}}
    if ingress is not None:
        spec["ingress"] = ingress
    if egress is not None:
        spec["egress"] = egress
    if types is not None:
        spec["policyTypes"] = types
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"namespace": namespace, "name": name}, "spec": spec}


def labels(**kv: str) -> dict[str, Any]:
    """A selector with matchLabels."""
    return {"matchLabels": dict(kv)}


def ip_block(cidr: str, *excepts: str) -> dict[str, Any]:
    block: dict[str, Any] = {"cidr": cidr}
    if excepts:
        block["except"] = list(excepts)
    return {"ipBlock": block}


def cluster_of(*objects: dict[str, Any]):
    cluster, errors = build_cluster([("test", o) for o in objects])
    assert errors == [], [str(e) for e in errors]
    return cluster


def model_of(*objects: dict[str, Any], node: str | None = None) -> RuleModel:
    return build_rule_model(cluster_of(*objects), node)


# --------------------------------------------------------------------------- rule model verdicts


def model_allows(m: RuleModel, src: str, dst: str, protocol: str = "TCP", port: int = 80) -> bool:
    """True when the rule model lets ``src`` -> ``dst`` (``protocol``/``port``) through: the
    verdict engine (nftpolicy.translators.verdict) on ``m`` alone, which walks the source's pod
    chain for egress and the destination's for ingress (a pod without one is not isolated)."""
    return Enforcement({None: m}).verdict(Connection(src, dst, protocol, port)).allowed is True


def pod_chain(m: RuleModel, key: str):
    found = [pc for pc in m.pod_chains if pc.pod == key]
    return found[0] if found else None


def jumps_of(m: RuleModel, key: str, direction: str):
    """The policy chains that pod ``key``'s chain of ``direction`` jumps to (None: no
    NetworkPolicy isolates it for ``direction``)."""
    chain = next((pc for pc in m.pod_chains if pc.pod == key and pc.direction == direction), None)
    return chain.policies if chain is not None else None


def policy_chain(m: RuleModel, key: str, direction: str):
    found = [c for c in m.policy_chains if c.policy == key and c.direction == direction]
    return found[0] if found else None


def set_named(m: RuleModel, name: str) -> AddressSet:
    return next(s for s in m.sets if s.name == name)


def rule_sets(m: RuleModel, key: str, direction: str, kind: str) -> list[AddressSet]:
    """The sets of one kind that the rules of a policy direction use."""
    chain = policy_chain(m, key, direction)
    names = {n for r in chain.rules for n in (r.peer_set, r.named_port_set) if n}
    return sorted((s for s in m.sets if s.name in names and s.kind == kind), key=lambda s: s.family)


# --------------------------------------------------------------------------- label selectors


@pytest.mark.parametrize("req, pod_labels, expected", [
    (Requirement("env", "In", frozenset({"dev", "prod"})), {"env": "dev"}, True),
    (Requirement("env", "In", frozenset({"dev", "prod"})), {"env": "test"}, False),
    (Requirement("env", "In", frozenset({"dev"})), {}, False),
    (Requirement("env", "In", frozenset({""})), {"env": ""}, True),
    (Requirement("env", "NotIn", frozenset({"prod"})), {"env": "dev"}, True),
    (Requirement("env", "NotIn", frozenset({"prod"})), {"env": "prod"}, False),
    (Requirement("env", "NotIn", frozenset({"prod"})), {}, True),  # a missing key matches NotIn
    (Requirement("env", "NotIn", frozenset({"prod"})), {"other": "prod"}, True),
    (Requirement("env", "Exists"), {"env": ""}, True),
    (Requirement("env", "Exists"), {"envx": "a"}, False),
    (Requirement("env", "Exists"), {}, False),
    (Requirement("env", "DoesNotExist"), {}, True),
    (Requirement("env", "DoesNotExist"), {"env": "x"}, False),
    (Requirement("env", "DoesNotExist"), {"other": "x"}, True),
])
def test_requirement_operators(req, pod_labels, expected):
    assert req.matches(pod_labels) is expected


@pytest.mark.parametrize("selector, pod_labels, expected", [
    (LabelSelector(), {}, True),
    (LabelSelector(), {"a": "b"}, True),
    (LabelSelector((("app", "a"),)), {"app": "a", "x": "y"}, True),
    (LabelSelector((("app", "a"),)), {"app": "b"}, False),
    (LabelSelector((("app", "a"),)), {}, False),
    (LabelSelector((("app", "a"), ("tier", "fe"))), {"app": "a"}, False),  # matchLabels are AND'ed
    (LabelSelector((("app", "a"),), (Requirement("env", "Exists"),)), {"app": "a", "env": "1"}, True),
    (LabelSelector((("app", "a"),), (Requirement("env", "Exists"),)), {"app": "a"}, False),  # labels AND expressions
    (LabelSelector((), (Requirement("env", "Exists"), Requirement("env", "NotIn", frozenset({"prod"})))), {"env": "prod"}, False),
    (LabelSelector((), (Requirement("env", "Exists"), Requirement("env", "NotIn", frozenset({"prod"})))), {"env": "dev"}, True),
])
def test_label_selector(selector, pod_labels, expected):
    assert selector.matches(pod_labels) is expected


@pytest.mark.parametrize("expr, expected_targets", [
    ({"key": "app", "operator": "In", "values": ["a", "b"]}, {"x/a", "x/b"}),
    ({"key": "app", "operator": "NotIn", "values": ["a"]}, {"x/b", "x/nolabel"}),
    ({"key": "app", "operator": "Exists"}, {"x/a", "x/b"}),
    ({"key": "app", "operator": "DoesNotExist"}, {"x/nolabel"}),
])
def test_match_expressions_choose_isolated_pods(expr, expected_targets):
    m = model_of(
        pod("x/a", "10.0.0.1", app="a"), pod("x/b", "10.0.0.2", app="b"), pod("x/nolabel", "10.0.0.3"),
        netpol("x/p", {"matchExpressions": [expr]}),
    )
    assert {pc.pod for pc in m.pod_chains} == expected_targets


def test_empty_pod_selector_selects_every_pod_of_the_policy_namespace_only():
    m = model_of(pod("x/a", "10.0.0.1", app="a"), pod("x/b", "10.0.0.2"), pod("y/a", "10.0.1.1", app="a"),
                 netpol("x/deny", {}))
    assert {pc.pod for pc in m.pod_chains} == {"x/a", "x/b"}


# --------------------------------------------------------------------------- ClusterIndex

INDEX_OBJECTS = (
    namespace("x", team="red"), namespace("y", team="blue"), namespace("z", team="red"), namespace("empty", team="red"),
    pod("x/a", "10.0.0.1", app="a"), pod("x/b", "10.0.0.2", app="b"),
    pod("y/a", "10.0.1.1", app="a"), pod("y/b", "10.0.1.2", app="b"),
    pod("z/a", "10.0.2.1", app="a"),
    pod("w/a", "10.0.3.1", app="a"),  # namespace without a Namespace object
    pod("x/pending", phase="Pending", app="a"),
    pod("x/done", "10.0.0.9", phase="Succeeded", app="a"),
    pod("x/failed", "10.0.0.10", phase="Failed", app="a"),
    pod("x/host", "192.168.0.1", host_network=True, app="a"),
)


INDEX_IP = {"x/a": "10.0.0.1", "x/b": "10.0.0.2", "y/a": "10.0.1.1", "y/b": "10.0.1.2", "z/a": "10.0.2.1", "w/a": "10.0.3.1"}


def peer_pods(peer: dict[str, Any], *extra: dict[str, Any]) -> list[str]:
    """The pods that the shared set of one ingress peer of policy x/p holds (by address)."""
    m = model_of(*INDEX_OBJECTS, *extra, netpol("x/p", {}, ingress=[{"from": [peer]}]))
    (rule,) = policy_chain(m, "x/p", "ingress").rules
    elements = set(set_named(m, rule.peer_set).elements)
    return sorted(key for key, ip in INDEX_IP.items() if ip in elements)


@pytest.mark.parametrize("namespace, selector, expected", [
    ("x", {}, ["x/a", "x/b"]),
    ("x", labels(app="a"), ["x/a"]),
    ("y", labels(app="b"), ["y/b"]),
    ("empty", {}, []),
    ("nonexistent", {}, []),
    ("w", labels(app="a"), ["w/a"]),
])
def test_a_scope_holds_only_enforceable_pods(namespace, selector, expected):
    peer = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}}, "podSelector": selector}
    assert peer_pods(peer) == expected


@pytest.mark.parametrize("selector, expected", [
    ({}, ["w/a", "x/a", "x/b", "y/a", "y/b", "z/a"]),
    (labels(team="red"), ["x/a", "x/b", "z/a"]),
    (labels(team="blue"), ["y/a", "y/b"]),
    ({"matchLabels": {NAMESPACE_NAME_LABEL: "w"}}, ["w/a"]),  # automatic label of a namespace known only from pods
    ({"matchExpressions": [{"key": "team", "operator": "DoesNotExist"}]}, ["w/a"]),
    ({"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["red"]}]}, ["w/a", "y/a", "y/b"]),
])
def test_namespace_selector_scopes(selector, expected):
    assert peer_pods({"namespaceSelector": selector}) == expected


@pytest.mark.parametrize("peer, expected", [
    pytest.param({"podSelector": labels(app="a")}, ["x/a"], id="podSelector-only-policy-namespace"),
    pytest.param({"podSelector": {}}, ["x/a", "x/b"], id="empty-podSelector-policy-namespace"),
    pytest.param({"namespaceSelector": labels(team="red"), "podSelector": labels(app="a")}, ["x/a", "z/a"], id="both-AND"),
    pytest.param({"namespaceSelector": labels(team="blue"), "podSelector": labels(app="b")}, ["y/b"], id="both-AND-other"),
    pytest.param({"namespaceSelector": labels(team="green")}, [], id="no-namespace"),
])
def test_peer_scopes(peer, expected):
    assert peer_pods(peer) == expected


def test_namespace_label_change_moves_its_pods_in_and_out():
    peer = {"namespaceSelector": labels(team="blue")}
    assert peer_pods(peer, namespace("z", team="blue")) == ["y/a", "y/b", "z/a"]
    assert peer_pods(peer, namespace("y", team="red")) == []


# --------------------------------------------------------------------------- peers, end to end

PEER_PODS = (
    namespace("x", team="red"), namespace("y", team="blue"), namespace("z", team="red"),
    pod("x/a", "10.0.0.1", app="a"), pod("x/b", "10.0.0.2", app="b"), pod("x/c", "10.0.0.3", app="c"),
    pod("y/a", "10.0.1.1", app="a"), pod("y/b", "10.0.1.2", app="b"),
    pod("z/a", "10.0.2.1", app="a"), pod("z/b", "10.0.2.2", app="b"),
)
IP = {"x/a": "10.0.0.1", "x/b": "10.0.0.2", "x/c": "10.0.0.3", "y/a": "10.0.1.1", "y/b": "10.0.1.2",
      "z/a": "10.0.2.1", "z/b": "10.0.2.2"}
SOURCES = ["x/b", "x/c", "y/a", "y/b", "z/a", "z/b"]


@pytest.mark.parametrize("peers, allowed", [
    pytest.param([{"podSelector": labels(app="b")}], {"x/b"}, id="podSelector-is-policy-namespace"),
    pytest.param([{"podSelector": {}}], {"x/b", "x/c"}, id="all-pods-of-policy-namespace"),
    pytest.param([{"namespaceSelector": labels(team="red")}], {"x/b", "x/c", "z/a", "z/b"}, id="namespaceSelector-all-pods"),
    pytest.param([{"namespaceSelector": {}}], set(SOURCES), id="all-namespaces"),
    pytest.param([{"namespaceSelector": labels(team="red"), "podSelector": labels(app="b")}], {"x/b", "z/b"}, id="one-peer-AND"),
    pytest.param([{"namespaceSelector": labels(team="red")}, {"podSelector": labels(app="b")}],
                 {"x/b", "x/c", "z/a", "z/b"}, id="two-peers-OR"),
    pytest.param([{"namespaceSelector": labels(team="blue")}, {"podSelector": labels(app="c")}],
                 {"y/a", "y/b", "x/c"}, id="two-peers-OR-disjoint"),
    pytest.param([{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: "y"}}, "podSelector": labels(app="a")}],
                 {"y/a"}, id="automatic-namespace-label"),
    pytest.param([ip_block("10.0.1.0/24")], {"y/a", "y/b"}, id="ipBlock-matches-pod-ips"),
    pytest.param([ip_block("10.0.0.0/16", "10.0.1.0/24")], {"x/b", "x/c", "z/a", "z/b"}, id="ipBlock-except"),
])
def test_ingress_peers(peers, allowed):
    m = model_of(*PEER_PODS, netpol("x/p", labels(app="a"), ingress=[{"from": peers}]))
    got = {src for src in SOURCES if model_allows(m, IP[src], IP["x/a"])}
    assert got == allowed


@pytest.mark.parametrize("peers, allowed", [
    pytest.param([{"podSelector": labels(app="b")}], {"x/b"}, id="podSelector-is-policy-namespace"),
    pytest.param([{"namespaceSelector": labels(team="red"), "podSelector": labels(app="b")}], {"x/b", "z/b"}, id="one-peer-AND"),
    pytest.param([{"namespaceSelector": labels(team="blue")}, {"podSelector": labels(app="b")}],
                 {"x/b", "y/a", "y/b"}, id="two-peers-OR"),
])
def test_egress_peers(peers, allowed):
    m = model_of(*PEER_PODS, netpol("x/p", labels(app="a"), egress=[{"to": peers}], types=["Egress"]))
    got = {dst for dst in SOURCES if model_allows(m, IP["x/a"], IP[dst])}
    assert got == allowed
    assert model_allows(m, "10.0.1.2", IP["x/a"])  # ingress of x/a is not isolated by an egress-only policy


def test_a_selector_peer_alone_in_its_rule_has_its_own_set_named_after_what_it_selects():
    m = model_of(*PEER_PODS, netpol("x/p", labels(app="a"), ingress=[
        {"from": [{"podSelector": labels(app="b")}]}, {"from": [{"namespaceSelector": labels(team="blue"), "podSelector": labels(app="a")}]}]))
    sets = rule_sets(m, "x/p", "ingress", "addr")
    assert {s.comment: s.elements for s in sets} == {"pods in x: app=b": ("10.0.0.2",),
                                                     "pods in namespaces team=blue: app=a": ("10.0.1.1",)}
    assert all(s.name.startswith("KUBE-PODS-") for s in sets) and not m.unions


def test_a_rule_of_several_selector_peers_has_one_union_set_that_knows_which_peer_gives_what():
    """kube-router's ipset per rule: the rule's pod-selector peers are one set per family, named
    after all of them (the same peers in another order or policy: the same set); the model says
    which peer gives which address, for explain and trace."""
    both = [{"podSelector": labels(app="b")}, {"namespaceSelector": labels(team="blue"), "podSelector": labels(app="a")}]
    m = model_of(*PEER_PODS, netpol("x/p", labels(app="a"), ingress=[{"from": both}]),
                 netpol("x/q", labels(app="c"), egress=[{"to": both[::-1]}], types=["Egress"]))
    (union,) = rule_sets(m, "x/p", "ingress", "addr")
    assert rule_sets(m, "x/q", "egress", "addr") == [union] and len([s for s in m.sets if s.kind == "addr"]) == 1
    assert union.name.startswith("KUBE-PODS-") and union.elements == ("10.0.0.2", "10.0.1.1")
    assert union.comment == "2 peers: pods in x: app=b; pods in namespaces team=blue: app=a"
    (peers,) = m.unions
    assert peers.name == union.name
    assert {p.text: p.elements for p in peers.peers} == {"pods in x: app=b": ("10.0.0.2",), "pods in namespaces team=blue: app=a": ("10.0.1.1",)}
    assert peers.matching("10.0.1.1") == ("pods in namespaces team=blue: app=a",) and peers.matching("10.0.0.3") == ()
    assert {src for src in SOURCES if model_allows(m, IP[src], IP["x/a"])} == {"x/b", "y/a"}
    verdict = Enforcement({None: m}).verdict(Connection(IP["y/a"], IP["x/a"], "TCP", 80))
    assert verdict.ingress.allowed_by.peers == ("pods in namespaces team=blue: app=a",)  # the peer that gave the address
    denied = Enforcement({None: m}).verdict(Connection(IP["z/a"], IP["x/a"], "TCP", 80))
    assert denied.ingress.rules[0].peers == ("pods in x: app=b", "pods in namespaces team=blue: app=a")  # every peer of the rule
    from nftpolicy.translators.verdict import enforcement_from_json, enforcement_json
    again = enforcement_from_json(json.loads(json.dumps(enforcement_json(Enforcement({None: m})))))  # the agent's debug endpoint
    assert again.models[None].unions == m.unions
    assert again.verdict(Connection(IP["y/a"], IP["x/a"], "TCP", 80)).ingress.allowed_by == verdict.ingress.allowed_by


def test_a_union_set_counts_each_address_once_per_peer_that_gives_it():
    """Pod y/a is in both peers of the union: relabelled out of one, its address stays; out of
    both, it goes, and only that element changes (no set or chain rewritten)."""
    from nftpolicy.translators.noderender import NodeRenderer

    rule = [{"namespaceSelector": labels(team="blue")}, {"namespaceSelector": {}, "podSelector": labels(app="a")}]
    cluster = cluster_of(*PEER_PODS, netpol("x/p", labels(app="a"), ingress=[{"from": rule}]))
    renderer = NodeRenderer(None).load(cluster)
    renderer.take_changes()
    (union,) = [s for s in renderer.model().sets if s.kind == "addr"]
    assert IP["y/a"] in union.elements
    y_a = cluster.pods["y/a"]
    renderer.set_pod("y/a", dataclasses.replace(y_a, labels={"app": "z"}))  # still in namespace y (team=blue)
    assert not renderer.take_changes()
    renderer.set_namespace("y", Namespace("y", {"kubernetes.io/metadata.name": "y", "team": "none"}))  # and out of the first peer too
    changes = renderer.take_changes()
    assert changes.elements_removed == {union.name: [IP["y/a"], IP["y/b"]]} and not changes.elements_added
    assert not changes.chains and not changes.sets_added and not changes.sets_removed


def test_policies_that_select_the_same_peers_share_one_set():
    peer = {"namespaceSelector": labels(team="blue")}
    m = model_of(*PEER_PODS, netpol("x/p1", labels(app="a"), ingress=[{"from": [peer]}]),
                 netpol("x/p2", labels(app="b"), egress=[{"to": [peer]}], types=["Egress"]),
                 netpol("z/p3", {}, ingress=[{"from": [peer]}, {"from": [peer], "ports": [{"port": 81}]}]))
    users = {rule.peer_set for chain in m.policy_chains for rule in chain.rules}
    assert len(users) == 1 and len([s for s in m.sets if s.kind == "addr"]) == 1
    assert set_named(m, users.pop()).elements == ("10.0.1.1", "10.0.1.2")


def test_equal_selectors_written_differently_share_one_set():
    m = model_of(*PEER_PODS,
                 netpol("x/p1", labels(app="a"), ingress=[{"from": [{"podSelector": {"matchLabels": {"app": "b", "tier": "x"}}}]}]),
                 netpol("x/p2", labels(app="a"), ingress=[{"from": [{"podSelector": {"matchLabels": {"tier": "x", "app": "b"}}}]}]),
                 netpol("x/p3", labels(app="a"), ingress=[{"from": [{"podSelector": {}}]}]),
                 netpol("x/p4", labels(app="a"), ingress=[{"from": [{"podSelector": {"matchLabels": {}}}]}]))
    names = {c.policy: c.rules[0].peer_set for c in m.policy_chains}
    assert names["x/p1"] == names["x/p2"] and names["x/p3"] == names["x/p4"] and names["x/p1"] != names["x/p3"]


def test_rules_are_ored_within_a_policy_and_across_policies():
    m = model_of(*PEER_PODS,
                 netpol("x/p1", labels(app="a"), ingress=[{"from": [{"podSelector": labels(app="b")}]},
                                                          {"from": [{"namespaceSelector": labels(team="blue"),
                                                                     "podSelector": labels(app="a")}]}]),
                 netpol("x/p2", labels(app="a"), ingress=[{"from": [{"namespaceSelector": labels(team="red"),
                                                                     "podSelector": labels(app="b")}]}]))
    assert {src for src in SOURCES if model_allows(m, IP[src], IP["x/a"])} == {"x/b", "y/a", "z/b"}
    assert len(jumps_of(m, "x/a", "ingress")) == 2


@pytest.mark.parametrize("rule, probes", [
    # (src, dst-port, protocol, expected)
    pytest.param({"from": [{"podSelector": labels(app="b")}], "ports": [{"port": 80}]},
                 [("x/b", 80, "TCP", True), ("x/b", 81, "TCP", False), ("x/b", 80, "UDP", False), ("x/c", 80, "TCP", False)],
                 id="peers-AND-ports"),
    pytest.param({"ports": [{"port": 80}, {"port": 53, "protocol": "UDP"}]},
                 [("x/c", 80, "TCP", True), ("y/b", 53, "UDP", True), ("y/b", 53, "TCP", False), ("y/b", 80, "UDP", False)],
                 id="ports-ORed-any-peer"),
    pytest.param({"from": [{"podSelector": labels(app="b")}]},
                 [("x/b", 1, "TCP", True), ("x/b", 65535, "UDP", True), ("x/b", 9, "SCTP", True), ("x/c", 80, "TCP", False)],
                 id="no-ports-means-all"),
    pytest.param({}, [("x/c", 1, "TCP", True), ("z/b", 5000, "UDP", True)], id="empty-rule-allows-all"),
])
def test_ports_and_peers_anded_within_rule(rule, probes):
    m = model_of(*PEER_PODS, netpol("x/p", labels(app="a"), ingress=[rule]))
    for src, port, proto, expected in probes:
        assert model_allows(m, IP[src], IP["x/a"], proto, port) is expected, (src, port, proto)


# --------------------------------------------------------------------------- which pods count

LIFECYCLE = (
    pod("x/run", "10.0.0.1", app="t"),
    pod("x/pending", phase="Pending", app="t"),
    pod("x/pending-ip", "10.0.0.2", phase="Pending", app="t"),
    pod("x/done", "10.0.0.3", phase="Succeeded", app="t"),
    pod("x/failed", "10.0.0.4", phase="Failed", app="t"),
    pod("x/host", "192.168.0.10", host_network=True, app="t"),
    pod("x/peer", "10.0.0.9", app="peer"),
)


def test_only_running_pods_with_ip_are_targets():
    m = model_of(*LIFECYCLE, netpol("x/p", labels(app="t")))
    # A pod with an IP that is still Pending (init containers) is enforced, as in kube-router.
    assert {pc.pod for pc in m.pod_chains} == {"x/run", "x/pending-ip"}
    assert all(pc.ips for pc in m.pod_chains)
    assert "192.168.0.10" not in {ip for pc in m.pod_chains for ip in pc.ips}


def test_only_running_pods_with_ip_are_peers():
    m = model_of(*LIFECYCLE, netpol("x/p", labels(app="peer"), ingress=[{"from": [{"podSelector": labels(app="t")}]}]))
    (addr,) = rule_sets(m, "x/p", "ingress", "addr")
    assert addr.elements == ("10.0.0.1", "10.0.0.2")
    for finished_or_host in ("10.0.0.3", "10.0.0.4", "192.168.0.10"):
        assert not model_allows(m, finished_or_host, "10.0.0.9")
    assert model_allows(m, "10.0.0.1", "10.0.0.9")


def test_finished_pod_ip_reused_by_running_pod():
    m = model_of(pod("x/old", "10.0.0.5", phase="Succeeded", app="old"), pod("x/new", "10.0.0.5", app="new"),
                 pod("x/dst", "10.0.0.6", app="dst"),
                 netpol("x/p", labels(app="dst"), ingress=[{"from": [{"podSelector": labels(app="old")}]}]))
    (addr,) = rule_sets(m, "x/p", "ingress", "addr")
    assert addr.elements == ()
    assert not model_allows(m, "10.0.0.5", "10.0.0.6")


def test_policy_selecting_only_unenforceable_pods_renders_nothing():
    m = model_of(*LIFECYCLE, netpol("x/p", {"matchExpressions": [{"key": "app", "operator": "In", "values": ["nothing"]}]}),
                 netpol("x/q", labels(app="t"), types=["Ingress"]))
    assert [c.policy for c in m.policy_chains] == ["x/q"]
    m2 = model_of(pod("x/host", "192.168.0.10", host_network=True, app="h"), pod("x/gone", "10.0.0.3", phase="Failed", app="h"),
                  netpol("x/p", labels(app="h")))
    assert m2.policy_chains == () and m2.pod_chains == () and m2.sets == ()


# --------------------------------------------------------------------------- isolation per direction

ISO_PODS = (pod("x/a", "10.0.0.1", app="a"), pod("x/b", "10.0.0.2", app="b"))


@pytest.mark.parametrize("policy, ingress_rules, egress_rules", [
    # expected number of AllowRules per direction, None when the direction is not isolated
    pytest.param(netpol("x/p", labels(app="a")), 0, None, id="no-rules-deny-ingress"),
    pytest.param(netpol("x/p", labels(app="a"), ingress=[]), 0, None, id="empty-ingress-deny"),
    pytest.param(netpol("x/p", labels(app="a"), ingress=[{}]), 1, None, id="allow-all-ingress"),
    pytest.param(netpol("x/p", labels(app="a"), egress=[]), 0, None, id="empty-egress-list-is-ingress-only"),
    pytest.param(netpol("x/p", labels(app="a"), egress=[{}]), 0, 1, id="egress-rule-adds-egress-type"),
    pytest.param(netpol("x/p", labels(app="a"), types=["Egress"]), None, 0, id="egress-only-deny"),
    pytest.param(netpol("x/p", labels(app="a"), types=["Egress"], ingress=[{}]), None, 0, id="ingress-rules-ignored"),
    pytest.param(netpol("x/p", labels(app="a"), types=["Ingress", "Egress"]), 0, 0, id="deny-all-both"),
    pytest.param(netpol("x/p", labels(app="a"), types=["Ingress", "Egress"], ingress=[{}], egress=[{}, {}]), 1, 2, id="allow-both"),
])
def test_isolation_per_direction(policy, ingress_rules, egress_rules):
    m = model_of(*ISO_PODS, policy)
    assert pod_chain(m, "x/a") is not None
    assert pod_chain(m, "x/b") is None  # not selected: not isolated at all
    for direction, expected in (("ingress", ingress_rules), ("egress", egress_rules)):
        jumps = jumps_of(m, "x/a", direction)
        if expected is None:
            assert jumps is None
            assert policy_chain(m, "x/p", direction) is None
        else:
            pc = policy_chain(m, "x/p", direction)
            assert jumps == (pc.name,)
            assert len(pc.rules) == expected


def test_deny_all_ingress_verdicts():
    m = model_of(*ISO_PODS, netpol("x/p", labels(app="a")))
    assert not model_allows(m, "10.0.0.2", "10.0.0.1")  # b -> a: a isolated for ingress
    assert model_allows(m, "10.0.0.1", "10.0.0.2")  # a -> b: a not isolated for egress, b not isolated
    assert not model_allows(m, "203.0.113.1", "10.0.0.1")


def test_ingress_rule_never_allows_as_egress():
    # x/a may receive from x/b; that must not let x/a send to anything on its (deny-all) egress.
    m = model_of(*ISO_PODS, netpol("x/in", labels(app="a"), ingress=[{"from": [{"podSelector": labels(app="b")}]}]),
                 netpol("x/out", labels(app="a"), types=["Egress"]))
    assert model_allows(m, "10.0.0.2", "10.0.0.1")
    assert not model_allows(m, "10.0.0.1", "10.0.0.2")
    assert jumps_of(m, "x/a", "ingress") == (policy_chain(m, "x/in", "ingress").name,)
    assert jumps_of(m, "x/a", "egress") == (policy_chain(m, "x/out", "egress").name,)


def test_egress_rule_of_one_pod_does_not_satisfy_ingress_of_another():
    # x/b allows egress to x/a; x/a denies all ingress. The kube-router trap: b's egress rule must not open a's ingress.
    m = model_of(*ISO_PODS, netpol("x/deny-a", labels(app="a")),
                 netpol("x/b-out", labels(app="b"), egress=[{"to": [{"podSelector": labels(app="a")}]}], types=["Egress"]))
    assert not model_allows(m, "10.0.0.2", "10.0.0.1")
    assert jumps_of(m, "x/b", "ingress") is None and pod_chain(m, "x/b") is not None
    assert jumps_of(m, "x/a", "egress") is None and pod_chain(m, "x/a") is not None


# --------------------------------------------------------------------------- ipBlock


def ipblock_model(*peers: dict[str, Any], direction: str = "ingress") -> RuleModel:
    rule_key = "from" if direction == "ingress" else "to"
    return model_of(pod("x/a", "10.200.0.1", "fd00:200::1", app="a"),
                    netpol("x/p", labels(app="a"), **{direction: [{rule_key: list(peers)}]}))


def interval_sets(m: RuleModel, direction: str = "ingress") -> dict[str, tuple]:
    """The ipBlock sets a policy direction uses: comment -> elements."""
    return {s.comment: s.elements for s in rule_sets(m, "x/p", direction, "interval")}


@pytest.mark.parametrize("peers, expected", [
    pytest.param([ip_block("0.0.0.0/0")], {"ipBlock 0.0.0.0/0": ("0.0.0.0/0",)}, id="v4-any-exact"),
    pytest.param([ip_block("::/0")], {"ipBlock ::/0": ("::/0",)}, id="v6-any-exact"),
    pytest.param([ip_block("0.0.0.0/0"), ip_block("::/0")], {"ipBlock 0.0.0.0/0": ("0.0.0.0/0",), "ipBlock ::/0": ("::/0",)},
                 id="both-any"),
    pytest.param([ip_block("10.0.0.0/24"), ip_block("10.0.0.0/24")], {"ipBlock 10.0.0.0/24": ("10.0.0.0/24",)}, id="duplicate-one-set"),
    pytest.param([ip_block("10.0.0.0/16", "10.0.5.0/24"), ip_block("10.0.5.0/24")],
                 {"2 peers: ipBlock 10.0.0.0/16 except 10.0.5.0/24; ipBlock 10.0.5.0/24": ("10.0.0.0/16",)},
                 id="each-peer-its-own-except"),
    pytest.param([ip_block("10.0.0.0/16", "10.0.5.0/24"), ip_block("10.1.0.0/16"), ip_block("fd00::/64")],
                 {"2 peers: ipBlock 10.0.0.0/16 except 10.0.5.0/24; ipBlock 10.1.0.0/16": (
                     "10.0.0.0/22", "10.0.4.0/24", "10.0.6.0/23", "10.0.8.0/21", "10.0.16.0/20", "10.0.32.0/19", "10.0.64.0/18",
                     "10.0.128.0/17", "10.1.0.0/16"),
                  "ipBlock fd00::/64": ("fd00::/64",)}, id="union-per-family"),
    pytest.param([ip_block("10.0.0.0/30", "10.0.0.1/32")], {"ipBlock 10.0.0.0/30 except 10.0.0.1/32": ("10.0.0.0/32", "10.0.0.2/31")},
                 id="except-hole"),
    pytest.param([ip_block("fd00::/126", "fd00::/128")], {"ipBlock fd00::/126 except fd00::/128": ("fd00::1/128", "fd00::2/127")},
                 id="v6-except-hole"),
])
def test_ipblock_interval_sets(peers, expected):
    """One set per ipBlock (its CIDR minus its own excepts), named after it, shared by every rule
    that names the same ipBlock; a rule's several ipBlocks of a family: one union set (each
    block minus its own excepts, merged); elements disjoint and in address order."""
    got = interval_sets(ipblock_model(*peers))
    assert got == expected
    for elements in got.values():
        nets = [ipaddress.ip_network(e) for e in elements]
        assert nets == sorted(nets)
        assert all(not a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1:])


@pytest.mark.parametrize("peers, probes", [
    pytest.param([ip_block("10.0.0.0/8", "10.1.0.0/16"), ip_block("10.1.2.0/24")],
                 {"10.1.2.3": True, "10.1.3.3": False, "10.2.0.1": True, "11.0.0.1": False}, id="own-except-only"),
    pytest.param([ip_block("10.1.2.0/24"), ip_block("10.0.0.0/8", "10.1.0.0/16")],
                 {"10.1.2.3": True, "10.1.3.3": False}, id="own-except-only-reversed"),
    pytest.param([ip_block("10.0.0.0/8", "10.1.0.0/16", "10.2.0.0/16")],
                 {"10.1.0.1": False, "10.2.255.255": False, "10.3.0.0": True}, id="several-excepts"),
    pytest.param([ip_block("10.0.0.0/8", "10.1.0.0/16", "10.1.2.0/24")],
                 {"10.1.2.3": False, "10.1.9.9": False, "10.9.9.9": True}, id="nested-excepts"),
    pytest.param([ip_block("0.0.0.0/0", "10.0.0.0/8")],
                 {"1.2.3.4": True, "255.255.255.255": True, "0.0.0.0": True, "10.4.4.4": False, "fd00::5": False},
                 id="everything-but"),
    pytest.param([ip_block("::/0", "fd00::/8")], {"2001:db8::1": True, "fd12::1": False, "1.2.3.4": False}, id="v6-everything-but"),
])
def test_ipblock_verdicts(peers, probes):
    m = ipblock_model(*peers)
    for src, expected in probes.items():
        dst = "10.200.0.1" if family_of(src) == "ipv4" else "fd00:200::1"
        assert model_allows(m, src, dst) is expected, src
    me = ipblock_model(*peers, direction="egress")
    for dst, expected in probes.items():
        src = "10.200.0.1" if family_of(dst) == "ipv4" else "fd00:200::1"
        assert model_allows(me, src, dst) is expected, dst


def test_explain_names_the_ipblocks_of_a_union_that_hold_the_address():
    """Several ipBlocks of a rule are one union set: explain names the block(s) whose networks
    (each minus its own excepts) hold the peer, never one whose except removed it."""
    m = ipblock_model(ip_block("10.0.0.0/8", "10.1.0.0/16"), ip_block("10.1.2.0/24"), ip_block("10.0.0.0/16"))
    (union,) = m.unions
    assert [p.text for p in union.peers] == ["ipBlock 10.0.0.0/16", "ipBlock 10.0.0.0/8 except 10.1.0.0/16", "ipBlock 10.1.2.0/24"]

    def peers_of(src: str) -> tuple[str, ...]:
        verdict = Enforcement({None: m}).verdict(Connection(src, "10.200.0.1", "TCP", 80))
        return verdict.ingress.allowed_by.peers

    assert peers_of("10.1.2.3") == ("ipBlock 10.1.2.0/24",)  # inside the first block's except: only the block that gives it
    assert peers_of("10.0.0.9") == ("ipBlock 10.0.0.0/16", "ipBlock 10.0.0.0/8 except 10.1.0.0/16")
    assert not model_allows(m, "10.1.3.3", "10.200.0.1")


@pytest.mark.parametrize("block, expected", [
    (IPBlock(ipaddress.ip_network("10.0.0.0/24")), ["10.0.0.0/24"]),
    (IPBlock(ipaddress.ip_network("10.0.0.0/24"), (ipaddress.ip_network("10.0.0.0/25"),)), ["10.0.0.128/25"]),
    (IPBlock(ipaddress.ip_network("10.0.0.0/24"), (ipaddress.ip_network("10.0.0.64/26"),)), ["10.0.0.0/26", "10.0.0.128/25"]),
    (IPBlock(ipaddress.ip_network("10.0.0.0/24"), (ipaddress.ip_network("10.0.0.0/25"), ipaddress.ip_network("10.0.0.0/26"))),
     ["10.0.0.128/25"]),
    (IPBlock(ipaddress.ip_network("10.0.0.0/24"), (ipaddress.ip_network("10.0.0.0/26"), ipaddress.ip_network("10.0.0.0/25"))),
     ["10.0.0.128/25"]),
    (IPBlock(ipaddress.ip_network("10.0.0.0/30"), (ipaddress.ip_network("10.0.0.0/32"), ipaddress.ip_network("10.0.0.3/32"))),
     ["10.0.0.1/32", "10.0.0.2/32"]),
    (IPBlock(ipaddress.ip_network("0.0.0.0/0")), ["0.0.0.0/0"]),
    (IPBlock(ipaddress.ip_network("0.0.0.0/0"), (ipaddress.ip_network("128.0.0.0/1"),)), ["0.0.0.0/1"]),
    (IPBlock(ipaddress.ip_network("::/0"), (ipaddress.ip_network("8000::/1"),)), ["::/1"]),
    (IPBlock(ipaddress.ip_network("fd00::/64"), (ipaddress.ip_network("fd00::/65"),)), ["fd00::8000:0:0:0/65"]),
])
def test_ipblock_networks(block, expected):
    assert [str(n) for n in block.networks()] == expected


def _network(bits: int, address: int, length: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    kind = ipaddress.IPv4Network if bits == 32 else ipaddress.IPv6Network
    return kind((address >> (bits - length) << (bits - length), length))


@settings(max_examples=300, deadline=None)
@given(v6=st.booleans(), data=st.data())
def test_a_union_of_ipblocks_is_what_ipaddress_makes_of_it(v6, data):
    """The union set's networks (integer ranges: :func:`span_networks`) equal each block minus its
    own excepts by ``address_exclude``, then ``collapse_addresses``: the fewest networks, in order."""
    from nftpolicy.translators.model import span_networks
    bits = 128 if v6 else 32
    base = (0x20010DB8 << 96) if v6 else (10 << 24)
    blocks = []
    for _ in range(data.draw(st.integers(1, 4))):
        cidr = _network(bits, base + data.draw(st.integers(0, 4095)), data.draw(st.integers(bits - 12, bits)))
        holes = [_network(bits, int(cidr.network_address) + data.draw(st.integers(0, cidr.num_addresses - 1)),
                          data.draw(st.integers(cidr.prefixlen + 1, bits)))
                 for _ in range(data.draw(st.integers(0, 3))) if cidr.prefixlen < bits]
        blocks.append(IPBlock(cidr, tuple(holes)))
    expected = []
    for block in blocks:
        remaining = [block.cidr]
        for hole in block.excepts:
            remaining = [part for net in remaining for part in ([net] if not net.overlaps(hole) else
                                                                [] if net.subnet_of(hole) else net.address_exclude(hole))]
        assert block.networks() == sorted(remaining)
        expected += remaining
    spans = sorted(span for block in blocks for span in block.spans())
    assert span_networks(spans, 6 if v6 else 4) == list(ipaddress.collapse_addresses(expected))


@pytest.mark.parametrize("block, address, expected", [
    (IPBlock(ipaddress.ip_network("10.0.0.0/24")), "10.0.0.0", True),
    (IPBlock(ipaddress.ip_network("10.0.0.0/24")), "10.0.0.255", True),
    (IPBlock(ipaddress.ip_network("10.0.0.0/24")), "10.0.1.0", False),
    (IPBlock(ipaddress.ip_network("10.0.0.0/24"), (ipaddress.ip_network("10.0.0.0/25"),)), "10.0.0.127", False),
    (IPBlock(ipaddress.ip_network("10.0.0.0/24"), (ipaddress.ip_network("10.0.0.0/25"),)), "10.0.0.128", True),
    (IPBlock(ipaddress.ip_network("0.0.0.0/0")), "255.255.255.255", True),
    (IPBlock(ipaddress.ip_network("0.0.0.0/0")), "::1", False),
    (IPBlock(ipaddress.ip_network("::/0"), (ipaddress.ip_network("fd00::/8"),)), "fd00::1", False),
    (IPBlock(ipaddress.ip_network("::/0"), (ipaddress.ip_network("fd00::/8"),)), "2001:db8::1", True),
    (IPBlock(ipaddress.ip_network("::/0")), "10.0.0.1", False),
])
def test_ipblock_contains(block, address, expected):
    assert block.contains(address) is expected


def test_ipblock_networks_agree_with_contains():
    rnd = random.Random(7)
    for _ in range(200):
        prefix = rnd.randint(24, 28)
        cidr = ipaddress.ip_network(f"10.0.{rnd.randint(0, 3)}.0/{prefix}", strict=False)
        subnets = list(cidr.subnets(new_prefix=min(32, prefix + rnd.randint(1, 3))))
        excepts = tuple(rnd.sample(subnets, rnd.randint(0, min(3, len(subnets)))))
        block = IPBlock(cidr, excepts)
        nets = block.networks()
        for host in ipaddress.ip_network("10.0.0.0/22"):
            assert block.contains(str(host)) is any(host in n for n in nets)


# --------------------------------------------------------------------------- ports


def port_matches(*port_entries: dict[str, Any]) -> list[PortMatch | None]:
    m = model_of(*ISO_PODS, netpol("x/p", labels(app="a"), ingress=[{"ports": list(port_entries)}]))
    return [r.port for r in policy_chain(m, "x/p", "ingress").rules]


@pytest.mark.parametrize("entries, expected", [
    pytest.param([{"port": 80}], [PortMatch("TCP", 80, 80)], id="single-port"),
    pytest.param([{"port": 8000, "endPort": 8080}], [PortMatch("TCP", 8000, 8080)], id="range"),
    pytest.param([{"port": 443, "endPort": 443}], [PortMatch("TCP", 443, 443)], id="range-of-one"),
    pytest.param([{"protocol": "UDP", "port": 1, "endPort": 65535}], [PortMatch("UDP", 1, 65535)], id="udp-full-range"),
    pytest.param([{"protocol": "UDP"}], [PortMatch("UDP", None, None)], id="protocol-only"),
    pytest.param([{}], [PortMatch("TCP", None, None)], id="empty-entry-all-tcp"),
    pytest.param([{"protocol": "SCTP", "port": 9}], [PortMatch("SCTP", 9, 9)], id="sctp"),
    pytest.param([{"port": 80}, {"protocol": "UDP", "port": 53}], [PortMatch("TCP", 80, 80), PortMatch("UDP", 53, 53)],
                 id="one-rule-per-port"),
])
def test_port_matches(entries, expected):
    assert port_matches(*entries) == expected


@pytest.mark.parametrize("entry, probes", [
    pytest.param({"port": 8000, "endPort": 8080},
                 [(7999, "TCP", False), (8000, "TCP", True), (8040, "TCP", True), (8080, "TCP", True), (8081, "TCP", False),
                  (8000, "UDP", False)], id="range-inclusive"),
    pytest.param({"protocol": "UDP"}, [(1, "UDP", True), (65535, "UDP", True), (53, "TCP", False), (53, "SCTP", False)],
                 id="protocol-only-all-ports"),
])
def test_port_verdicts(entry, probes):
    m = model_of(*ISO_PODS, netpol("x/p", labels(app="a"), ingress=[{"ports": [entry]}]))
    for port, proto, expected in probes:
        assert model_allows(m, "10.0.0.2", "10.0.0.1", proto, port) is expected, (port, proto)


# --------------------------------------------------------------------------- named ports

NAMED = (
    namespace("x"), namespace("y", team="blue"),
    pod("x/a", "10.0.0.1", app="web", ports=(("http", 80, "TCP"), ("dns", 53, "UDP"))),
    pod("x/b", "10.0.0.2", "fd00::2", app="web", ports=(("http", 8080, "TCP"), ("dns", 53, "TCP"))),
    pod("x/c", "10.0.0.3", app="web", ports=(("metrics", 9090, "TCP"),)),
    pod("x/client", "10.0.0.9", app="client", ports=(("http", 7070, "TCP"),)),
    pod("y/d", "10.0.1.4", app="web", ports=(("http", 8443, "TCP"),)),
)


def named_elements(m: RuleModel, key: str, direction: str) -> set[tuple]:
    return {e for s in rule_sets(m, key, direction, "named_port") for e in s.elements}


def test_named_port_ingress_resolves_on_selected_pods():
    m = model_of(*NAMED, netpol("x/p", labels(app="web"), ingress=[{"ports": [{"port": "http"}]}]))
    assert named_elements(m, "x/p", "ingress") == {("10.0.0.1", "tcp", 80), ("10.0.0.2", "tcp", 8080), ("fd00::2", "tcp", 8080)}
    assert all(r.port is None and r.named_port_set for r in policy_chain(m, "x/p", "ingress").rules)
    ok = [("10.0.0.1", 80, True), ("10.0.0.1", 8080, False), ("10.0.0.2", 8080, True), ("10.0.0.2", 80, False),
          ("10.0.0.3", 80, False), ("10.0.0.3", 9090, False), ("10.0.0.3", 8080, False)]
    for dst, port, expected in ok:
        assert model_allows(m, "10.0.0.9", dst, "TCP", port) is expected, (dst, port)
    # the client's own "http" (7070) is not a target of the policy: it is never in the set
    assert not any(e[0] == "10.0.0.9" for e in named_elements(m, "x/p", "ingress"))


def test_named_port_ingress_dual_stack_target():
    m = model_of(*NAMED, netpol("x/p", labels(app="web"), ingress=[{"ports": [{"port": "http"}]}]))
    by_family = {s.family: s.elements for s in rule_sets(m, "x/p", "ingress", "named_port")}
    assert by_family == {"ipv4": (("10.0.0.1", "tcp", 80), ("10.0.0.2", "tcp", 8080)), "ipv6": (("fd00::2", "tcp", 8080),)}


@pytest.mark.parametrize("entry, expected", [
    pytest.param({"port": "dns", "protocol": "UDP"}, {("10.0.0.1", "udp", 53)}, id="udp-only-where-udp"),
    pytest.param({"port": "dns"}, {("10.0.0.2", "tcp", 53), ("fd00::2", "tcp", 53)}, id="tcp-default-only-where-tcp"),
    pytest.param({"port": "dns", "protocol": "SCTP"}, set(), id="no-sctp-dns"),
    pytest.param({"port": "nothing"}, set(), id="unknown-name"),
])
def test_named_port_protocol_must_match(entry, expected):
    m = model_of(*NAMED, netpol("x/p", labels(app="web"), ingress=[{"ports": [entry]}]))
    assert named_elements(m, "x/p", "ingress") == expected
    assert model_allows(m, "10.0.0.9", "10.0.0.1", entry.get("protocol", "TCP"), 53) is (("10.0.0.1", "udp", 53) in expected)


def test_named_port_ingress_with_peers_and_ports():
    m = model_of(*NAMED, netpol("x/p", labels(app="web"),
                                ingress=[{"from": [{"podSelector": labels(app="client")}], "ports": [{"port": "http"}]}]))
    assert model_allows(m, "10.0.0.9", "10.0.0.1", "TCP", 80)
    assert not model_allows(m, "10.0.0.3", "10.0.0.1", "TCP", 80)  # not a peer
    assert not model_allows(m, "10.0.0.9", "10.0.0.1", "TCP", 8080)  # x/b's http, not x/a's


def test_named_port_egress_resolves_on_peer_pods():
    m = model_of(*NAMED, netpol("x/p", labels(app="client"), egress=[{"to": [{"podSelector": labels(app="web")}],
                                                                       "ports": [{"port": "http"}]}]))
    # peers x/a, x/b (x/c lacks the name; y/d is in another namespace); the client's own http never
    # counts (to its own address the client never leaves its pod: test_verdict.py)
    assert named_elements(m, "x/p", "egress") == {("10.0.0.1", "tcp", 80), ("10.0.0.2", "tcp", 8080), ("fd00::2", "tcp", 8080)}
    for dst, port, expected in [("10.0.0.1", 80, True), ("10.0.0.1", 8080, False), ("10.0.0.2", 8080, True),
                                ("10.0.0.3", 9090, False), ("10.0.1.4", 8443, False)]:
        assert model_allows(m, "10.0.0.9", dst, "TCP", port) is expected, (dst, port)


def test_named_port_egress_without_peers_resolves_on_every_pod():
    m = model_of(*NAMED, netpol("x/p", labels(app="client"), egress=[{"ports": [{"port": "http"}]}]))
    assert named_elements(m, "x/p", "egress") == {("10.0.0.1", "tcp", 80), ("10.0.0.2", "tcp", 8080), ("fd00::2", "tcp", 8080),
                                                  ("10.0.0.9", "tcp", 7070), ("10.0.1.4", "tcp", 8443)}
    assert model_allows(m, "10.0.0.9", "10.0.1.4", "TCP", 8443)
    assert not model_allows(m, "10.0.0.9", "203.0.113.1", "TCP", 80)


def test_named_port_egress_with_namespace_peer_and_ipblock():
    m = model_of(*NAMED, netpol("x/p", labels(app="client"), egress=[{"to": [{"namespaceSelector": labels(team="blue")},
                                                                              ip_block("10.0.0.0/30")],
                                                                       "ports": [{"port": "http"}]}]))
    # y/d by namespace; x/a by ipBlock (x/b 10.0.0.2 is in the block too, but fd00::2 is not)
    assert named_elements(m, "x/p", "egress") == {("10.0.1.4", "tcp", 8443), ("10.0.0.1", "tcp", 80), ("10.0.0.2", "tcp", 8080)}


def test_named_and_numeric_ports_in_one_rule():
    m = model_of(*NAMED, netpol("x/p", labels(app="web"), ingress=[{"ports": [{"port": "http"}, {"port": 9090}]}]))
    assert model_allows(m, "10.0.0.9", "10.0.0.3", "TCP", 9090)
    assert model_allows(m, "10.0.0.9", "10.0.0.1", "TCP", 80)
    assert not model_allows(m, "10.0.0.9", "10.0.0.3", "TCP", 80)


# --------------------------------------------------------------------------- node filtering

NODE_OBJECTS = (
    pod("x/a1", "10.0.0.1", node="n1", app="a"), pod("x/a2", "10.0.0.2", node="n2", app="a"),
    pod("x/b2", "10.0.0.3", node="n2", app="b"), pod("x/c1", "10.0.0.4", node="n1", app="c"),
    netpol("x/pa", labels(app="a"), ingress=[{"from": [{"podSelector": labels(app="b")}]}]),
    netpol("x/pb", labels(app="b"), egress=[{}]),
    netpol("x/pc", labels(app="c"), types=["Egress"]),
)


@pytest.mark.parametrize("node, policies, pods", [
    ("n1", {("x/pa", "ingress"), ("x/pc", "egress")}, {"x/a1", "x/c1"}),
    ("n2", {("x/pa", "ingress"), ("x/pb", "ingress"), ("x/pb", "egress")}, {"x/a2", "x/b2"}),
    ("n3", set(), set()),
    (None, {("x/pa", "ingress"), ("x/pb", "ingress"), ("x/pb", "egress"), ("x/pc", "egress")}, {"x/a1", "x/a2", "x/b2", "x/c1"}),
])
def test_only_policies_selecting_a_local_pod_are_rendered(node, policies, pods):
    m = model_of(*NODE_OBJECTS, node=node)
    assert {(c.policy, c.direction) for c in m.policy_chains} == policies
    assert {pc.pod for pc in m.pod_chains} == pods


def test_remote_peers_still_in_sets():
    m = model_of(*NODE_OBJECTS, node="n1")
    (addr,) = rule_sets(m, "x/pa", "ingress", "addr")
    assert addr.elements == ("10.0.0.3",)  # x/b2 lives on n2 but is a peer
    assert model_allows(m, "10.0.0.3", "10.0.0.1")
    assert not model_allows(m, "10.0.0.4", "10.0.0.1")


def test_pod_chain_carries_every_address():
    m = model_of(pod("x/a", "fd00::1", "10.0.0.1", app="a"), netpol("x/p", labels(app="a")))
    assert pod_chain(m, "x/a").ips == ("10.0.0.1", "fd00::1")


# --------------------------------------------------------------------------- names and comments

STABLE_OBJECTS = [
    namespace("x", team="red"), namespace("y", team="blue"),
    pod("x/a", "10.0.0.1", "fd00::1", app="a", tier="fe", ports=(("http", 80, "TCP"),)),
    pod("x/b", "10.0.0.2", app="b", ports=(("http", 8080, "TCP"),)),
    pod("y/c", "10.0.1.3", app="c", node="n2"),
    netpol("x/p1", labels(app="a"), ingress=[{"from": [{"podSelector": labels(app="b")}, ip_block("10.9.0.0/16", "10.9.1.0/24")],
                                              "ports": [{"port": "http"}, {"port": 443}]}]),
    netpol("x/p2", {}, egress=[{"to": [{"namespaceSelector": labels(team="blue")}], "ports": [{"port": "http"}]}]),
    netpol("y/p3", {}, ingress=[{"from": [{"namespaceSelector": {}}]}]),
]


def _relabel(obj: dict[str, Any]) -> dict[str, Any]:
    """The same object with its label maps in reverse insertion order."""
    obj = {**obj, "metadata": dict(obj["metadata"])}
    if "labels" in obj["metadata"]:
        obj["metadata"]["labels"] = dict(reversed(list(obj["metadata"]["labels"].items())))
    return obj


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("node", [None, "n1"])
def test_model_independent_of_input_order(seed, node):
    reference = model_of(*STABLE_OBJECTS, node=node)
    shuffled = [_relabel(o) for o in STABLE_OBJECTS]
    random.Random(seed).shuffle(shuffled)
    assert model_of(*shuffled, node=node) == reference
    assert reference.policy_chains and reference.sets and reference.pod_chains


def test_model_is_deterministic_and_sorted():
    m = model_of(*STABLE_OBJECTS)
    assert [s.name for s in m.sets] == sorted(s.name for s in m.sets)
    assert [c.name for c in m.policy_chains] == sorted(c.name for c in m.policy_chains)
    assert [c.name for c in m.pod_chains] == sorted(c.name for c in m.pod_chains)
    assert len({s.name for s in m.sets}) == len(m.sets)
    assert len({c.name for c in m.policy_chains}) == len(m.policy_chains)


NAME_RE = re.compile(r"^(KUBE-POD-IN-|KUBE-POD-EG-|KUBE-NWPLCY-|KUBE-PODS-|KUBE-NET-|KUBE-PORT-)[A-Z2-7]{16}$")


def test_every_generated_name_has_prefix_and_16_base32_chars():
    m = model_of(*STABLE_OBJECTS)
    names = [s.name for s in m.sets] + [c.name for c in m.policy_chains] + [c.name for c in m.pod_chains]
    assert names and all(NAME_RE.match(n) for n in names), names
    assert {n.split("-")[1] for n in names} >= {"POD", "NWPLCY", "PODS", "PORT"}


@pytest.mark.parametrize("prefix, identity", [
    ("KUBE-NWPLCY-", ("x", "p", "ingress")),
    ("KUBE-POD-IN-", ("x", "a")),
    ("KUBE-PODS-", ("ipv4", "pods in x: app=b")),
    ("KUBE-NET-", ()),
])
def test_hashed_name_deterministic(prefix, identity):
    name = hashed_name(prefix, *identity)
    assert name == hashed_name(prefix, *identity)
    assert name.startswith(prefix) and len(name) == len(prefix) + 16
    assert re.fullmatch(r"[A-Z2-7]{16}", name[len(prefix):])


def test_hashed_name_known_value_and_separation():
    # base32(sha256("x\0p\0ingress"))[:16], computed independently
    import base64
    import hashlib
    expected = "KUBE-NWPLCY-" + base64.b32encode(hashlib.sha256(b"x\x00p\x00ingress").digest()).decode()[:16]
    assert hashed_name("KUBE-NWPLCY-", "x", "p", "ingress") == expected
    assert hashed_name("P-", "ab", "c") != hashed_name("P-", "a", "bc")
    assert hashed_name("P-", "x", "p", "ingress") != hashed_name("P-", "x", "p", "egress")


def test_names_do_not_depend_on_unrelated_changes():
    base = model_of(*STABLE_OBJECTS)
    more = model_of(*STABLE_OBJECTS, pod("y/new", "10.0.1.99", app="zzz"), netpol("y/other", labels(app="nothing")))
    assert {c.name for c in base.policy_chains} <= {c.name for c in more.policy_chains}
    assert pod_chain(base, "x/a").name == pod_chain(more, "x/a").name


@pytest.mark.parametrize("text", [
    "a" * 200,
    "é" * 100,
    "a" + "é" * 100,
    "€" * 60,
    "x/" + "😀" * 40 + " ingress",
    "short",
])
def test_comment_never_exceeds_limit_and_never_cuts_a_character(text):
    out = comment(text)
    assert len(out.encode()) <= COMMENT_MAX_BYTES
    assert text.startswith(out)
    if len(text.encode()) <= COMMENT_MAX_BYTES:
        assert out == text
    else:
        # as long as possible: the next character would not have fitted
        assert len(out.encode()) + len(text[len(out)].encode()) > COMMENT_MAX_BYTES


def test_comments_of_long_names_fit():
    long_ns, long_name = "n" * 63, "q" * 200
    m = model_of(
        pod(f"{long_ns}/{'p' * 200}", "10.0.0.1", app="a", ports=(("http", 80, "TCP"),)),
        pod(f"{long_ns}/b", "10.0.0.2", app="b"),
        netpol(f"{long_ns}/{long_name}", labels(app="a"),
               ingress=[{"from": [{"podSelector": labels(app="b")}, ip_block("10.1.0.0/16")], "ports": [{"port": "http"}]}],
               egress=[{"to": [{"podSelector": {}}], "ports": [{"port": "http"}]}]),
    )
    named_after_policy = ([c.comment for c in m.policy_chains] + [c.comment for c in m.pod_chains]
                          + [r.comment for c in m.policy_chains for r in c.rules])
    comments = [s.comment for s in m.sets] + named_after_policy
    assert len(comments) > 8
    for text in comments:
        assert len(text.encode()) <= COMMENT_MAX_BYTES
    assert all(text.startswith(long_ns[:10]) for text in named_after_policy)
    assert any(len(t.encode()) == COMMENT_MAX_BYTES for t in comments)


@pytest.mark.parametrize("text", ["ñ" * 70, "名前" * 30, "a" * 127 + "é", "x" * 200])
def test_comment_cuts_at_128_bytes_never_mid_character(text):
    cut = comment(text)
    assert len(cut.encode()) <= COMMENT_MAX_BYTES and text.startswith(cut)
    assert len(cut.encode()) > COMMENT_MAX_BYTES - 4


def test_comment_text_format():
    m = model_of(*ISO_PODS, netpol("x/p", labels(app="a"), ingress=[{"from": [{"podSelector": {}}]}]))
    assert policy_chain(m, "x/p", "ingress").comment == "x/p ingress"
    assert pod_chain(m, "x/a").comment == "x/a pod ingress"
    assert policy_chain(m, "x/p", "ingress").rules[0].comment == "x/p ingress rule 0"


# --------------------------------------------------------------------------- size


def sized_cluster(remote: int) -> RuleModel:
    objects = [
        namespace("x"), namespace("y", team="blue"),
        pod("x/a", "10.0.0.1", node="n1", app="a", ports=(("http", 80, "TCP"),)),
        pod("x/b", "10.0.0.2", node="n1", app="b"),
        netpol("x/pa", labels(app="a"), ingress=[{"from": [{"podSelector": {}}, {"namespaceSelector": {}}], "ports": [{"port": "http"}]}],
               egress=[{"to": [{"podSelector": {}}], "ports": [{"port": "http"}, {"port": 53, "protocol": "UDP"}]}]),
        netpol("x/pb", labels(app="b"), ingress=[{"from": [{"namespaceSelector": labels(team="blue")}]}]),
        # a policy that selects only remote pods of its own label: never local on n1
        netpol("y/remote-only", labels(app="selected-remote")),
        pod("y/sr", "10.1.255.1", node="n2", app="selected-remote"),
    ]
    for i in range(remote):
        ns = "x" if i % 2 else "y"
        objects.append(pod(f"{ns}/r{i}", f"10.1.{i // 250}.{i % 250 + 1}", node=f"n{2 + i % 3}", app="other",
                           ports=(("http", 8080, "TCP"),)))
    return model_of(*objects, node="n1")


def _size(m: RuleModel) -> tuple[int, int, int, int]:
    return (len(m.pod_chains), len(m.policy_chains), sum(len(c.rules) for c in m.policy_chains), len(m.sets))


@pytest.mark.parametrize("n", [10, 150])
def test_rule_count_does_not_grow_with_unselected_remote_pods(n):
    small, big = sized_cluster(n), sized_cluster(2 * n)
    assert _size(small) == _size(big)
    assert _size(small)[2] > 0
    # the peers did grow: only set elements scale with remote pods
    assert sum(len(s.elements) for s in big.sets) > sum(len(s.elements) for s in small.sets)
    assert {c.policy for c in big.policy_chains} == {"x/pa", "x/pb"}


# --------------------------------------------------------------------------- property: model vs reference evaluator


def _ref_selector(sel: dict | None, lbls: dict[str, str]) -> bool:
    sel = sel or {}
    for k, v in (sel.get("matchLabels") or {}).items():
        if lbls.get(k) != v:
            return False
    for e in sel.get("matchExpressions") or []:
        k, op, vals = e["key"], e["operator"], e.get("values") or []
        ok = {"In": k in lbls and lbls[k] in vals, "NotIn": not (k in lbls and lbls[k] in vals),
              "Exists": k in lbls, "DoesNotExist": k not in lbls}[op]
        if not ok:
            return False
    return True


def reference_allows(objects: list[dict], src: str, dst: str, protocol: str, port: int) -> bool:
    """The NetworkPolicy API reference, straight from the manifests (no nftpolicy code)."""
    ns_labels = {o["metadata"]["name"]: {**(o["metadata"].get("labels") or {}), NAMESPACE_NAME_LABEL: o["metadata"]["name"]}
                 for o in objects if o["kind"] == "Namespace"}
    pods = [o for o in objects if o["kind"] == "Pod" and o["status"].get("podIPs")
            and not o["spec"].get("hostNetwork") and o["status"].get("phase", "Running") not in ("Succeeded", "Failed")]
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]

    def pod_at(ip: str):
        a = ipaddress.ip_address(ip)
        return next((p for p in pods if any(ipaddress.ip_address(e["ip"]) == a for e in p["status"]["podIPs"])), None)

    def labels_of_ns(name: str):
        return ns_labels.get(name, {NAMESPACE_NAME_LABEL: name})

    def peer_matches(policy, peer, ip: str) -> bool:
        if "ipBlock" in peer:
            a = ipaddress.ip_address(ip)
            cidr = ipaddress.ip_network(peer["ipBlock"]["cidr"], strict=False)
            if a.version != cidr.version or a not in cidr:
                return False
            return not any(a in ipaddress.ip_network(x, strict=False) for x in peer["ipBlock"].get("except") or [])
        p = pod_at(ip)
        if p is None:
            return False
        pns = p["metadata"]["namespace"]
        if "namespaceSelector" in peer:
            if not _ref_selector(peer["namespaceSelector"], labels_of_ns(pns)):
                return False
        elif pns != policy["metadata"]["namespace"]:
            return False
        return "podSelector" not in peer or _ref_selector(peer["podSelector"], p["metadata"].get("labels") or {})

    def port_matches(entry, dst_pod) -> bool:
        if entry.get("protocol", "TCP") != protocol:
            return False
        want = entry.get("port")
        if want is None:
            return True
        if isinstance(want, int):
            return want <= port <= entry.get("endPort", want)
        if dst_pod is None:
            return False
        return any(cp.get("name") == want and cp.get("protocol", "TCP") == protocol and cp["containerPort"] == port
                   for c in dst_pod["spec"]["containers"] for cp in c.get("ports") or [])

    def types_of(policy):
        spec = policy["spec"]
        return spec.get("policyTypes") or (["Ingress", "Egress"] if spec.get("egress") else ["Ingress"])

    def direction_allows(target_ip: str, ptype: str, peer_ip: str) -> bool:
        target = pod_at(target_ip)
        if target is None:
            return True
        selecting = [pol for pol in policies if pol["metadata"]["namespace"] == target["metadata"]["namespace"]
                     and _ref_selector(pol["spec"]["podSelector"], target["metadata"].get("labels") or {})
                     and ptype in types_of(pol)]
        if not selecting:
            return True
        key, peers_key = ("ingress", "from") if ptype == "Ingress" else ("egress", "to")
        for pol in selecting:
            for rule in pol["spec"].get(key) or []:
                peers = rule.get(peers_key) or []
                if peers and not any(peer_matches(pol, pe, peer_ip) for pe in peers):
                    continue
                ports = rule.get("ports") or []
                if ports and not any(port_matches(e, pod_at(dst)) for e in ports):
                    continue
                return True
        return False

    return direction_allows(src, "Egress", dst) and direction_allows(dst, "Ingress", src)


POD_V4 = [f"10.0.0.{i}" for i in range(1, 7)]
POD_V6 = [f"fd00::{i}" for i in range(1, 7)]
EXTERNAL = ["10.0.0.200", "10.0.1.7", "192.168.0.99", "203.0.113.5", "fd00::99", "2001:db8::7"]
BLOCKS = [
    {"cidr": "10.0.0.0/24", "except": ["10.0.0.0/30"]},
    {"cidr": "10.0.0.2/32"},
    {"cidr": "10.0.0.4/30"},
    {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]},
    {"cidr": "0.0.0.0/0"},
    {"cidr": "10.0.0.0/16", "except": ["10.0.0.0/24"]},
    {"cidr": "fd00::/64", "except": ["fd00::1/128", "fd00::2/127"]},
    {"cidr": "::/0"},
    {"cidr": "192.168.0.0/16"},
]
LABEL_VALUES = ["a", "b", "c"]
NODES = ["n1", "n2"]

selectors = st.one_of(
    st.just({}),
    st.builds(lambda v: {"matchLabels": {"app": v}}, st.sampled_from(LABEL_VALUES)),
    st.builds(lambda op, vals: {"matchExpressions": [{"key": "app", "operator": op, "values": vals}]},
              st.sampled_from(["In", "NotIn"]), st.lists(st.sampled_from(LABEL_VALUES), min_size=1, max_size=2, unique=True)),
    st.builds(lambda op: {"matchExpressions": [{"key": "app", "operator": op}]}, st.sampled_from(["Exists", "DoesNotExist"])),
)
ns_selectors = st.one_of(
    st.just({}),
    st.builds(lambda v: {"matchLabels": {"team": v}}, st.sampled_from(["red", "blue"])),
    st.builds(lambda v: {"matchLabels": {NAMESPACE_NAME_LABEL: v}}, st.sampled_from(["x", "y"])),
)
peers = st.one_of(
    st.builds(lambda s: {"podSelector": s}, selectors),
    st.builds(lambda s: {"namespaceSelector": s}, ns_selectors),
    st.builds(lambda a, b: {"namespaceSelector": a, "podSelector": b}, ns_selectors, selectors),
    st.builds(lambda b: {"ipBlock": b}, st.sampled_from(BLOCKS)),
)
port_entries = st.sampled_from([
    {"port": 80}, {"protocol": "UDP", "port": 53}, {"port": 80, "endPort": 90}, {"protocol": "UDP"},
    {"port": "http"}, {"port": "dns", "protocol": "UDP"}, {"port": "dns"},
])


@st.composite
def rules_lists(draw, peers_key: str):
    rules = []
    for _ in range(draw(st.integers(0, 2))):
        rule: dict[str, Any] = {}
        if draw(st.booleans()):
            rule[peers_key] = draw(st.lists(peers, max_size=2))
        if draw(st.booleans()):
            rule["ports"] = draw(st.lists(port_entries, max_size=2))
        rules.append(rule)
    return rules


@st.composite
def clusters(draw):
    objects: list[dict] = [namespace("x", team=draw(st.sampled_from(["red", "blue"]))), namespace("y", team=draw(st.sampled_from(["red", "blue"])))]
    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["v4", "v4", "v4", "dual", "pending", "done", "host"]))
        # a finished pod may hold an address that a running pod (index 0) reuses
        ips = {"v4": (POD_V4[i],), "dual": (POD_V4[i], POD_V6[i]), "pending": (),
               "done": (POD_V4[draw(st.sampled_from([0, i]))],), "host": (POD_V4[i],)}[kind]
        ports = []
        http = draw(st.sampled_from([None, ("http", 80, "TCP"), ("http", 85, "TCP"), ("http", 8080, "UDP")]))
        dns = draw(st.sampled_from([None, ("dns", 53, "UDP"), ("dns", 53, "TCP")]))
        ports = tuple(p for p in (http, dns) if p)
        lbl = draw(st.sampled_from([None, *LABEL_VALUES]))
        objects.append(pod(f"{draw(st.sampled_from(['x', 'y']))}/p{i}", *ips, node=draw(st.sampled_from(NODES)),
                           phase={"pending": "Pending", "done": "Succeeded"}.get(kind),
                           host_network=kind == "host", ports=ports, **({"app": lbl} if lbl else {})))
    for i in range(draw(st.integers(1, 3))):
        spec: dict[str, Any] = {}
        if draw(st.booleans()):
            spec["ingress"] = draw(rules_lists("from"))
        if draw(st.booleans()):
            spec["egress"] = draw(rules_lists("to"))
        types = draw(st.sampled_from([None, ["Ingress"], ["Egress"], ["Ingress", "Egress"]]))
        objects.append(netpol(f"{draw(st.sampled_from(['x', 'y']))}/np{i}", draw(selectors), types=types, **spec))
    return objects


ADDRESSES = POD_V4 * 3 + POD_V6 + EXTERNAL
probes = st.lists(st.tuples(st.sampled_from(ADDRESSES), st.sampled_from(ADDRESSES), st.sampled_from(["TCP", "UDP"]),
                            st.sampled_from([53, 80, 85, 90, 91, 8080])), min_size=1, max_size=25)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(objects=clusters(), probe_list=probes)
def test_rule_model_agrees_with_reference_evaluator(objects, probe_list):
    """Every pod local (node None), and per node: the source's node enforces its egress and the
    destination's node its ingress, so the AND over every node's model is the cluster's verdict."""
    m = model_of(*objects)
    per_node = [model_of(*objects, node=n) for n in NODES]
    for src, dst, proto, port in probe_list:
        if src == dst or family_of(src) != family_of(dst):
            continue
        expected = reference_allows(objects, src, dst, proto, port)
        assert model_allows(m, src, dst, proto, port) is expected, (src, dst, proto, port)
        assert all(model_allows(mn, src, dst, proto, port) for mn in per_node) is expected, ("per node", src, dst, proto, port)


def test_an_exists_term_on_a_key_called_all_is_not_the_empty_selector():
    """Set names hash the selector's structure, not its words (review finding: ``all`` Exists
    read like the empty selector, and two selections shared one kernel set)."""
    m = model_of(*PEER_PODS, pod("x/d", "10.0.0.4", all="yes", app="d"),
                 netpol("x/narrow", labels(app="a"), ingress=[{"from": [{"podSelector": {"matchExpressions": [{"key": "all", "operator": "Exists"}]}}]}]),
                 netpol("x/broad", labels(app="b"), ingress=[{"from": [{"podSelector": {}}]}]))
    narrow, broad = (policy_chain(m, k, "ingress").rules[0].peer_set for k in ("x/narrow", "x/broad"))
    assert narrow != broad
    assert set_named(m, narrow).elements == ("10.0.0.4",) and len(set_named(m, broad).elements) == 4
    assert set_named(m, broad).comment == "pods in x: (any)" and set_named(m, narrow).comment == "pods in x: all"


def test_egress_rules_with_only_named_ports_make_no_address_sets():
    """Their named-port sets are the peer match: no unused address set (review finding)."""
    m = model_of(*PEER_PODS, pod("x/db", "10.0.0.9", app="db", ports=(("pg", 5432, "TCP"),)),
                 netpol("x/p", labels(app="a"), egress=[{"to": [{"namespaceSelector": {}}], "ports": [{"port": "pg"}]}], types=["Egress"]))
    assert [s.kind for s in m.sets] == ["named_port"]
    assert set_named(m, policy_chain(m, "x/p", "egress").rules[0].named_port_set).elements == (("10.0.0.9", "tcp", 5432),)



# --------------------------------------------------------------------------- peers + ports, never peers x ports


def _peers_by_ports(peers: int, ports: int) -> RuleModel:
    """A policy whose one ingress rule names ``peers`` podSelector peers and ``ports`` ports."""
    objects = [namespace("x"), pod("x/db", "10.0.0.1", app="db")]
    objects += [pod(f"x/p{i}", f"10.0.1.{i}", app=f"p{i}") for i in range(peers)]
    objects.append(netpol("x/p", labels(app="db"), ingress=[{"from": [{"podSelector": labels(app=f"p{i}")} for i in range(peers)],
                                                             "ports": [{"port": 1000 + i} for i in range(ports)]}]))
    return model_of(*objects)


def test_a_rule_of_several_peers_and_ports_costs_peers_plus_ports_rules():
    from nftpolicy.translators import layout

    m = _peers_by_ports(30, 40)
    chain = policy_chain(m, "x/p", "ingress")
    (peers,) = chain.peer_chains
    assert [r.port.first for r in chain.rules] == list(range(1000, 1040))
    assert {r.peer_chain for r in chain.rules} == {peers.name} and all(r.peer_set is None for r in chain.rules)
    (union,) = peers.rules  # the 30 peers: one union set
    assert union.port is None and len(set_named(m, union.peer_set).elements) == 30 and len(m.sets) == 1
    assert peers.name.startswith("KUBE-NWPLCY-") and peers.name != chain.name
    laid = {c.name: c for c in layout.table(m).chains}
    jump, done = laid[chain.name].rules  # the 40 ports as one port set, and the "decided" return
    assert layout.DestinationPortSet(((1000, 1039),)) in jump.statements and layout.Jump(peers.name) in jump.statements
    assert len(laid[peers.name].rules) == 1
    assert model_allows(m, "10.0.1.7", "10.0.0.1", port=1039) and model_allows(m, "10.0.1.29", "10.0.0.1", port=1000)
    assert not model_allows(m, "10.0.1.7", "10.0.0.1", port=1040) and not model_allows(m, "10.0.0.9", "10.0.0.1", port=1000)


def test_explain_names_the_peer_and_the_port_of_a_peer_chain():
    m = _peers_by_ports(3, 3)
    verdict = Enforcement({None: m}).verdict(Connection("10.0.1.2", "10.0.0.1", "TCP", 1001))
    assert verdict.allowed is True
    assert verdict.ingress.allowed_by.peers == ("pods in x: app=p2",) and verdict.ingress.allowed_by.ports == ("TCP/1001",)
    denied = Enforcement({None: m}).verdict(Connection("10.0.0.9", "10.0.0.1", "TCP", 1001))
    (rule,) = denied.ingress.rules
    assert rule.peers == ("pods in x: app=p0", "pods in x: app=p1", "pods in x: app=p2") and rule.ports == ("TCP/1000", "TCP/1001", "TCP/1002")


def test_a_rule_of_one_peer_or_one_port_stays_one_match_each():
    chain = policy_chain(_peers_by_ports(1, 5), "x/p", "ingress")
    assert not chain.peer_chains and len(chain.rules) == 5 and all(r.peer_set for r in chain.rules)
    (rule,) = policy_chain(_peers_by_ports(5, 1), "x/p", "ingress").rules  # the 5 peers' union set and the port
    assert rule.peer_set and rule.port == PortMatch("TCP", 1000, 1000)


def test_a_port_set_merges_overlapping_ranges_and_explain_names_the_port_that_matched():
    from nftpolicy.translators import layout

    objects = [namespace("x"), pod("x/db", "10.0.0.1", app="db"), pod("x/a", "10.0.1.1", app="a"), pod("x/b", "10.0.1.2", app="b")]
    objects.append(netpol("x/p", labels(app="db"), ingress=[{"from": [{"podSelector": labels(app="a")}, {"podSelector": labels(app="b")}],
                                                             "ports": [{"port": 10, "endPort": 20}, {"port": 15, "endPort": 30}, {"port": 31},
                                                                       {"port": 50}, {"port": 53, "protocol": "UDP"}]}]))
    m = model_of(*objects)
    chain = policy_chain(m, "x/p", "ingress")
    tcp, udp, _ = {c.name: c for c in layout.table(m).chains}[chain.name].rules
    assert layout.DestinationPortSet(((10, 31), (50, 50))) in tcp.statements and layout.Protocols(("udp",)) in udp.statements
    verdict = Enforcement({None: m}).verdict(Connection("10.0.1.2", "10.0.0.1", "TCP", 25))
    assert verdict.allowed is True and verdict.ingress.allowed_by.ports in (("TCP/10-20",), ("TCP/15-30",))
    assert Enforcement({None: m}).verdict(Connection("10.0.1.2", "10.0.0.1", "TCP", 50)).ingress.allowed_by.ports == ("TCP/50",)
    assert not model_allows(m, "10.0.1.2", "10.0.0.1", port=40) and model_allows(m, "10.0.1.1", "10.0.0.1", "UDP", 53)
