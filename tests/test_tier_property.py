"""Random clusters with both kinds of policy: the tier evaluator (tests/tiers.py, straight
from the API reference, the spec oracle) and the table the node renderer and layout decide give
the same verdict on every cell.

The table is run by the table walk (``translators/tablewalk.py``: what nft does with the layout's
statements: jumps and returns, marks under masks, set lookups, rejects), packet by packet through
``KUBE-ROUTER-FORWARD``, so the check covers the tier chains, their place in the pod chain, the
marks and the shared sets, without a kernel; the verdict engine behind ``nftpolicy explain``
(translators/verdict.py, which walks each node's table) gives the evaluator's verdict and names
the rule that decided; a few random clusters also run in the sandbox with real packets.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.agent.testbed.sandbox import Sandbox
from nftpolicy.translators import layout
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.tablewalk import TableWalker
from nftpolicy.translators.verdict import Connection, DirectionVerdict, enforcement_of

from .fakeapi import namespace, pod
from .tiers import connection_allowed, direction_decision

NAMESPACES = ("x", "y", "z")
PODS = [(ns, name) for ns in NAMESPACES for name in ("a", "b")]
PROBES = (("TCP", 80), ("TCP", 81), ("UDP", 53), ("UDP", 55))


def _ip(i: int) -> str:
    return f"10.0.{i // 2}.{i % 2 + 1}"


SELECTOR = st.sampled_from([{}, {"matchLabels": {"team": "blue"}}, {"matchLabels": {"kubernetes.io/metadata.name": "x"}},
                            {"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["blue"]}]}])
POD_SELECTOR = st.sampled_from([{}, {"matchLabels": {"app": "a"}}, {"matchLabels": {"app": "b"}}])
PEER = st.one_of(st.builds(lambda s: {"namespaces": s}, SELECTOR),
                 st.builds(lambda n, p: {"pods": {"namespaceSelector": n, "podSelector": p}}, SELECTOR, POD_SELECTOR))
NETWORK = st.builds(lambda i, wide: {"networks": ["10.0.0.0/16" if wide else f"{_ip(i)}/32", "fd00::/8"]}, st.integers(0, 5), st.booleans())
PORT = st.sampled_from([{"tcp": {"destinationPort": {"number": 80}}}, {"udp": {"destinationPort": {"range": {"start": 50, "end": 54}}}},
                        {"destinationNamedPort": "web"}, {"destinationNamedPort": "dns"}, {"sctp": {"destinationPort": {"number": 80}}}])


@st.composite
def cluster_policy(draw: Any, i: int) -> dict[str, Any]:
    def rules(direction: str) -> list[dict[str, Any]]:
        found = []
        for _ in range(draw(st.integers(0, 3))):
            peers = draw(st.lists(PEER | NETWORK if direction == "egress" else PEER, min_size=1, max_size=2))
            rule: dict[str, Any] = {"action": draw(st.sampled_from(["Accept", "Deny", "Pass"])),
                                    "from" if direction == "ingress" else "to": peers}
            ports = draw(st.lists(PORT, max_size=2))
            if any("networks" in p for p in peers):
                ports = [p for p in ports if "destinationNamedPort" not in p]  # the CRD's CEL rule
            if ports:
                rule["protocols"] = ports
            found.append(rule)
        return found

    subject = draw(st.one_of(st.builds(lambda s: {"namespaces": s}, SELECTOR),
                             st.builds(lambda n, p: {"pods": {"namespaceSelector": n, "podSelector": p}}, SELECTOR, POD_SELECTOR)))
    return {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": f"cnp-{i}"},
            "spec": {"tier": draw(st.sampled_from(["Admin", "Baseline"])), "priority": draw(st.sampled_from([1, 2])),
                     "subject": subject, "ingress": rules("ingress"), "egress": rules("egress")}}


@st.composite
def network_policy(draw: Any, i: int) -> dict[str, Any]:
    peer = st.sampled_from([{"podSelector": {"matchLabels": {"app": "a"}}}, {"namespaceSelector": {"matchLabels": {"team": "blue"}}},
                            {"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.0.1.0/24"]}}])
    port = st.sampled_from([{"port": 80}, {"protocol": "UDP", "port": 50, "endPort": 54}, {"port": "web"}])
    rule = st.builds(lambda peers, ports: {k: v for k, v in (("peers", peers), ("ports", ports)) if v},
                     st.lists(peer, max_size=2), st.lists(port, max_size=2))
    types = draw(st.sampled_from([["Ingress"], ["Egress"], ["Ingress", "Egress"]]))
    spec: dict[str, Any] = {"podSelector": draw(POD_SELECTOR), "policyTypes": types}
    for t in types:
        key, peers_key = t.lower(), "from" if t == "Ingress" else "to"
        spec[key] = [{(peers_key if k == "peers" else k): v for k, v in r.items()} for r in draw(st.lists(rule, max_size=2))]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"namespace": draw(st.sampled_from(NAMESPACES)), "name": f"np-{i}"}, "spec": spec}


@st.composite
def clusters(draw: Any, nodes: tuple[str, ...] = ("n1",)) -> list[dict[str, Any]]:
    """Namespaces, pods on ``nodes`` (two each of x, y, z), up to two NetworkPolicies and one to
    four ClusterNetworkPolicies."""
    objects: list[dict[str, Any]] = [namespace(ns, team=draw(st.sampled_from(["blue", "red"]))) for ns in NAMESPACES]
    for i, (ns, name) in enumerate(PODS):
        web = draw(st.sampled_from([80, 81]))  # "web" is 80 on some pods, 81 on others
        app = draw(st.sampled_from(["a", "b"]))
        objects.append(pod(ns, name, _ip(i), node=draw(st.sampled_from(nodes)), ports=(("web", web, "TCP"), ("dns", 53, "UDP")), app=app))
    objects += [draw(network_policy(i)) for i in range(draw(st.integers(0, 2)))]
    objects += [draw(cluster_policy(i)) for i in range(draw(st.integers(1, 4)))]
    return objects


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(objects=clusters())
def test_the_table_gives_the_evaluators_verdict_on_every_cell(objects):
    cluster, errors = build_cluster(("random", o) for o in objects)
    assert not errors, [str(e) for e in errors]
    walker = TableWalker(layout.table(build_rule_model(cluster, None)))
    pods = list(cluster.pods.values())
    for protocol, port in PROBES:
        for src in pods:
            for dst in pods:
                if src is dst:
                    continue
                want = connection_allowed(cluster, src, dst, protocol, port)  # type: ignore[arg-type]
                got = walker.walk(Connection(src.ips[0], dst.ips[0], protocol, port)).allowed
                assert got == want, f"{src.key} -> {dst.key} {protocol}/{port}: table {got}, evaluator {want}"


def _reason(side: DirectionVerdict) -> str:
    """What decided one direction, in the tier evaluator's words (tests/tiers.py
    ``Decision.by``); a NetworkPolicy by the isolating policy's rule that allowed it."""
    if side.cluster_rule is not None and side.cluster_action is not None:
        rule = side.cluster_rule
        return f"ClusterNetworkPolicy {rule.policy} {rule.direction} rule {rule.rule} ({side.cluster_action.split()[1]})"
    if side.allowed_by is not None:
        assert side.allowed_by.policy in side.policies
        return "NetworkPolicy"
    if side.isolated:
        assert not side.allowed and side.exemption is None
        return "no NetworkPolicy allows it"
    return "default"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(objects=clusters(nodes=("n1", "n2")))
def test_the_verdict_engine_gives_the_evaluators_verdict_and_reason(objects):
    """The engine behind ``explain`` (each node's table walked for the directions it enforces)
    against the tier evaluator, direction by direction: the same verdict, and the same
    ClusterNetworkPolicy rule, NetworkPolicy tier or default deciding it. Of several
    NetworkPolicies that allow a connection the evaluator names the first by key, the table the
    first it jumps to: the reason is only "a NetworkPolicy" there."""
    cluster, errors = build_cluster(("random", o) for o in objects)
    assert not errors, [str(e) for e in errors]
    engine = enforcement_of(cluster)
    pods = list(cluster.pods.values())
    for protocol, port in PROBES:
        for src in pods:
            for dst in pods:
                if src is dst:
                    continue
                verdict = engine.verdict(Connection(src.ips[0], dst.ips[0], protocol, port))  # type: ignore[arg-type]
                cell = f"{src.key} -> {dst.key} {protocol}/{port}"
                for side, pod, other in ((verdict.egress, src, dst), (verdict.ingress, dst, src)):
                    want = direction_decision(cluster, side.direction, pod, other, protocol, port)  # type: ignore[arg-type]
                    got = (side.allowed, _reason(side))
                    reason = "NetworkPolicy" if want.by.startswith("NetworkPolicy ") else want.by
                    assert got == (want.allowed, reason), f"{cell} {side.direction}: engine {got}, evaluator {want}"
                assert verdict.allowed == connection_allowed(cluster, src, dst, protocol, port), cell  # type: ignore[arg-type]


@pytest.mark.kernel
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(objects=clusters())
def test_the_kernel_gives_the_evaluators_verdict_on_random_clusters(objects):
    cluster, errors = build_cluster(("random", o) for o in objects)
    assert not errors, [str(e) for e in errors]
    specs = [ProbeSpec(port, protocol) for protocol, port in PROBES]  # type: ignore[arg-type]
    with Sandbox(cluster.pods.values(), ("n1",)) as sandbox:
        sandbox.apply(cluster)
        results = sandbox.probe(specs, ["ipv4"])
    pods = {p.key: p for p in cluster.pods.values()}
    assert all(len(results[(spec, "ipv4")]) == len(pods) ** 2 for spec in specs)
    for spec in specs:
        for (src, dst), got in results[(spec, "ipv4")].items():
            if src != dst:
                want = connection_allowed(cluster, pods[src], pods[dst], spec.protocol, spec.port)
                assert got == want, f"{src} -> {dst} {spec.protocol}/{spec.port}: kernel {got}, evaluator {want}"
