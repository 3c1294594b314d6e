"""Unit tests of nftpolicy.translators.clusterpolicy: the ClusterNetworkPolicy model and validation.

Pure. Every expectation comes from sigs.k8s.io/network-policy-api v0.3.0
(``apis/v1beta1/clusternetworkpolicy_types.go`` and the CRD's OpenAPI limits and CEL rules: one
schema for v1beta1 and v1alpha2; v0.2.0's v1alpha2 differs only in taking CIDRs with host bits).
"""

from __future__ import annotations

import copy
import ipaddress
from typing import Any

import pytest
from nftpolicy.translators.clusterpolicy import cluster_policy_from
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.model import ClusterPeer, ClusterPort, ClusterRule, domain_name_matches
from nftpolicy.translators.selectors import LabelSelector
from nftpolicy.translators.validation import InvalidField

from .conftest import REPO

HOUSE = {"matchLabels": {"kubernetes.io/metadata.name": "ravenclaw"}}
RAVENCLAW = LabelSelector((("kubernetes.io/metadata.name", "ravenclaw"),))


def cnp(name: str = "p", *, tier: Any = "Admin", priority: Any = 3, subject: Any = None,
        ingress: Any = None, egress: Any = None, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"tier": tier, "priority": priority,
                            "subject": subject if subject is not None else {"namespaces": {}}}
    for key, value in (("ingress", ingress), ("egress", egress)):
        if value is not None:
            spec[key] = value
    spec.update(extra)
    return {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
            "metadata": {"name": name}, "spec": spec}


def rule(action: str = "Accept", peers: Any = None, key: str = "from", **fields: Any) -> dict[str, Any]:
    return {"action": action, key: peers if peers is not None else [{"namespaces": HOUSE}], **fields}


def tcp(number: int) -> dict[str, Any]:
    return {"tcp": {"destinationPort": {"number": number}}}


def test_a_complete_policy_reads_every_field():
    policy = cluster_policy_from(cnp(
        "ingress-tcp", priority=3,
        subject={"pods": {"namespaceSelector": HOUSE, "podSelector": {"matchLabels": {"app": "db"}}}},
        ingress=[rule("Deny", name="deny-80", protocols=[tcp(80), {"udp": {"destinationPort": {"range": {"start": 53, "end": 60}}}},
                                                          {"destinationNamedPort": "web"}])],
        egress=[rule("Pass", [{"networks": ["10.0.0.0/8", "fd00::/8"]}, {"pods": {"podSelector": {}}}], key="to")],
    ))
    assert (policy.name, policy.tier, policy.priority) == ("ingress-tcp", "Admin", 3)
    assert policy.subject_namespaces is None
    assert policy.subject_pods == (RAVENCLAW, LabelSelector((("app", "db"),)))
    assert policy.ingress == (ClusterRule("Deny", (ClusterPeer(namespaces=RAVENCLAW),),
                                          (ClusterPort("TCP", 80, 80), ClusterPort("UDP", 53, 60), ClusterPort(None, name="web")),
                                          name="deny-80"),)
    assert policy.egress == (ClusterRule("Pass", (
        ClusterPeer(networks=(ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8"))),
        ClusterPeer(pods=(LabelSelector(), LabelSelector())))),)


def test_namespaced_pods_without_a_namespace_selector_selects_every_namespace():
    policy = cluster_policy_from(cnp(subject={"pods": {"podSelector": {"matchLabels": {"app": "db"}}}}))
    assert policy.subject_pods == (LabelSelector(), LabelSelector((("app", "db"),)))
    assert policy.selects({"kubernetes.io/metadata.name": "any"}, {"app": "db"})
    assert not policy.selects({"kubernetes.io/metadata.name": "any"}, {"app": "web"})


def test_networks_keep_their_masked_network():
    policy = cluster_policy_from(cnp(egress=[rule("Deny", [{"networks": ["10.1.2.3/16"]}], key="to")]))
    assert policy.egress[0].peers[0].networks == (ipaddress.ip_network("10.1.0.0/16"),)


@pytest.mark.parametrize("version", ["v1beta1", "v1alpha2"])
def test_both_versions_read_the_same_schema_into_the_same_policy(version):
    """v0.3.0 serves one schema at both versions: the same object under either apiVersion is the
    same policy, and a new one is refused with host bits in a CIDR at either (since v0.2.1);
    one read back from the API (stored before) has them masked."""
    obj = cnp(ingress=[rule("Accept", protocols=[tcp(80)])], egress=[rule("Deny", [{"networks": ["10.1.0.0/16", "fd00::/64"]}], key="to")])
    assert cluster_policy_from({**obj, "apiVersion": f"policy.networking.k8s.io/{version}"}, new=True) == cluster_policy_from(obj)
    stored = {**cnp(egress=[rule("Deny", [{"networks": ["10.1.2.3/16"]}], key="to")]), "apiVersion": f"policy.networking.k8s.io/{version}"}
    with pytest.raises(InvalidField) as caught:
        cluster_policy_from(stored, new=True)
    assert str(caught.value) == ("spec.egress[0].to[0].networks[0]: CIDR must be in canonical form (host bits masked, as "
                                 "network-policy-api v0.2.1 requires): '10.1.2.3/16', use '10.1.0.0/16'")
    assert cluster_policy_from(stored).egress[0].peers[0].networks == (ipaddress.ip_network("10.1.0.0/16"),)
    cluster, errors = build_cluster([("a.yaml", stored)])
    assert not cluster.cluster_policies and [e.message for e in errors] == [str(caught.value)]


def test_domain_names_are_read_lower_case_without_the_root_dot():
    policy = cluster_policy_from(cnp(egress=[rule("Accept", [{"domainNames": ["API.Partner.example.", "*.cdn.example", "under_score.example"]}],
                                                  key="to", protocols=[tcp(443)])]))
    assert policy.egress[0].peers == (ClusterPeer(domain_names=("api.partner.example", "*.cdn.example", "under_score.example")),)


@pytest.mark.parametrize("pattern, name, matches", [
    # network-policy-api v0.2.0, DomainName's examples
    ("kubernetes.io", "kubernetes.io", True),
    ("kubernetes.io", "www.kubernetes.io", False),
    ("kubernetes.io", "my-kubernetes.io", False),
    ("blog.kubernetes.io", "www.kubernetes.io", False),
    ("*.kubernetes.io", "www.kubernetes.io", True),
    ("*.kubernetes.io", "latest.blog.kubernetes.io", True),
    ("*.kubernetes.io", "kubernetes.io", False),
    ("*.kubernetes.io", "wikipedia.org", False),
    ("*.kubernetes.io", "my-kubernetes.io", False),
    # DNS names compare without case and with or without the root's dot
    ("kubernetes.io", "KUBERNETES.io.", True),
    ("*.kubernetes.io", "WWW.Kubernetes.IO.", True),
])
def test_domain_name_matching(pattern, name, matches):
    assert domain_name_matches(pattern, name) is matches

def test_a_nodes_peer_reads_its_label_selector_and_refuses_a_named_port():
    policy = cluster_policy_from(cnp(egress=[rule("Accept", [{"nodes": {"matchLabels": {"role": "infra"}}}, {"nodes": {}}], key="to",
                                                  protocols=[tcp(10250)])]))
    assert policy.egress[0].peers == (ClusterPeer(nodes=LabelSelector((("role", "infra"),))), ClusterPeer(nodes=LabelSelector()))
    with pytest.raises(InvalidField, match=r"spec.egress\[0\]: networks/nodes/domainNames peer cannot be set with namedPorts"):
        cluster_policy_from(cnp(egress=[rule("Accept", [{"pods": {"podSelector": {}}}, {"nodes": {}}], key="to",
                                             protocols=[{"destinationNamedPort": "web"}])]))


def _with(path: list[Any], value: Any) -> dict[str, Any]:
    """A valid policy with one field (path into the object) replaced; ``...`` deletes it."""
    obj = cnp(ingress=[rule("Accept", protocols=[tcp(80)])], egress=[rule("Deny", [{"networks": ["10.0.0.0/8"]}], key="to")])
    target: Any = obj
    for step in path[:-1]:
        target = target[step]
    if value is ...:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return obj


MANY = [{"namespaces": {}}] * 26


@pytest.mark.parametrize("path, value, error", [
    (["apiVersion"], "policy.networking.k8s.io/v1alpha1",
     "apiVersion: must be policy.networking.k8s.io/v1beta1 or policy.networking.k8s.io/v1alpha2 (the versions nftpolicy implements)"),
    (["metadata", "name"], "Bad_Name", "metadata.name: invalid name 'Bad_Name'"),
    (["spec", "tier"], "Application", "spec.tier: must be Admin or Baseline, got 'Application'"),
    (["spec", "tier"], ..., "spec.tier: must be Admin or Baseline, got None"),
    (["spec", "priority"], 1001, "spec.priority: must be a number 0-1000, got 1001"),
    (["spec", "priority"], -1, "spec.priority: must be a number 0-1000, got -1"),
    (["spec", "priority"], ..., "spec.priority: must be a number 0-1000, got None"),
    (["spec", "priority"], "3", "spec.priority: must be a number 0-1000, got '3'"),
    (["spec", "subject"], ..., "spec.subject: required"),
    (["spec", "subject"], {}, "spec.subject: exactly one of namespaces, pods must be set, got none"),
    (["spec", "subject"], {"namespaces": {}, "pods": {"podSelector": {}}},
     "spec.subject: exactly one of namespaces, pods must be set, got namespaces, pods"),
    (["spec", "subject"], {"pods": {"namespaceSelector": {}}}, "spec.subject.pods.podSelector: required"),
    (["spec", "podSelector"], {}, "spec.podSelector: unknown field"),
    (["spec", "ingress"], [rule()] * 26, "spec.ingress: must have 0 to 25 items, got 26"),
    (["spec", "ingress", 0, "action"], "Allow", "spec.ingress[0].action: must be Accept, Deny or Pass, got 'Allow'"),
    (["spec", "ingress", 0, "name"], "n" * 101, "spec.ingress[0].name: must be a string of at most 100 characters"),
    (["spec", "ingress", 0, "from"], ..., "spec.ingress[0].from: required"),
    (["spec", "ingress", 0, "from"], [], "spec.ingress[0].from: must have 1 to 25 items, got 0"),
    (["spec", "ingress", 0, "from"], MANY, "spec.ingress[0].from: must have 1 to 25 items, got 26"),
    (["spec", "ingress", 0, "to"], [], "spec.ingress[0].to: unknown field"),
    (["spec", "ingress", 0, "from"], [{"networks": ["10.0.0.0/8"]}], "spec.ingress[0].from[0].networks: unknown field"),
    (["spec", "ingress", 0, "from"], [{}], "spec.ingress[0].from[0]: exactly one of namespaces, pods must be set, got none"),
    (["spec", "ingress", 0, "protocols"], [], "spec.ingress[0].protocols: must have 1 to 25 items, got 0"),
    (["spec", "ingress", 0, "protocols"], [{"tcp": {}}], "spec.ingress[0].protocols[0].tcp.destinationPort: required"),
    (["spec", "ingress", 0, "protocols"], [{"icmp": {}}], "spec.ingress[0].protocols[0].icmp: unknown field"),
    (["spec", "ingress", 0, "protocols"], [{**tcp(80), "destinationNamedPort": "web"}],
     "spec.ingress[0].protocols[0]: exactly one of destinationNamedPort, sctp, tcp, udp must be set"),
    (["spec", "ingress", 0, "protocols"], [tcp(0)], "spec.ingress[0].protocols[0].tcp.destinationPort.number: must be a number 1-65535, got 0"),
    (["spec", "ingress", 0, "protocols"], [tcp(65536)], "number: must be a number 1-65535, got 65536"),
    (["spec", "ingress", 0, "protocols"], [{"udp": {"destinationPort": {"number": 53, "range": {"start": 1, "end": 2}}}}],
     "spec.ingress[0].protocols[0].udp.destinationPort: exactly one of number, range must be set, got number, range"),
    (["spec", "ingress", 0, "protocols"], [{"sctp": {"destinationPort": {"range": {"start": 90, "end": 90}}}}],
     "spec.ingress[0].protocols[0].sctp.destinationPort.range: Start port must be less than End port, got 90-90"),
    (["spec", "ingress", 0, "protocols"], [{"tcp": {"destinationPort": {"range": {"start": 90}}}}],
     "spec.ingress[0].protocols[0].tcp.destinationPort.range.end: must be a number 1-65535, got None"),
    (["spec", "ingress", 0, "protocols"], [{"destinationNamedPort": ""}],
     "spec.ingress[0].protocols[0].destinationNamedPort: must be a container port name, got ''"),
    (["spec", "egress", 0, "to"], [{"networks": []}], "spec.egress[0].to[0].networks: must have 1 to 25 items, got 0"),
    (["spec", "egress", 0, "to"], [{"networks": ["10.0.0.0"]}], "spec.egress[0].to[0].networks[0]: Invalid CIDR format provided: '10.0.0.0'"),
    (["spec", "egress", 0, "to"], [{"networks": ["10.0.0.0/8", "10.0.0.0/8"]}], "spec.egress[0].to[0].networks[1]: duplicate value '10.0.0.0/8'"),
    (["spec", "egress", 0, "to"], [{"networks": [f"10.0.{i}.0/24" for i in range(26)]}], "networks: must have 1 to 25 items, got 26"),
    (["spec", "egress", 0, "to"], [{"domainNames": []}], "spec.egress[0].to[0].domainNames: must have 1 to 25 items, got 0"),
    (["spec", "egress", 0, "to"], [{"domainNames": ["a.example", "a.example"]}], "spec.egress[0].to[0].domainNames[1]: duplicate value 'a.example'"),
    (["spec", "egress", 0, "to"], [{"domainNames": ["www.*.example"]}],
     "spec.egress[0].to[0].domainNames[0]: must be a domain name, optionally with a '*.' prefix, got 'www.*.example'"),
    (["spec", "egress", 0, "to"], [{"domainNames": ["*"]}], "domainNames[0]: must be a domain name"),
    (["spec", "egress", 0, "to"], [{"domainNames": ["example"]}], "domainNames[0]: must be a domain name"),
    (["spec", "egress", 0, "to"], [{"domainNames": ["-a.example"]}], "domainNames[0]: must be a domain name"),
    (["spec", "egress", 0, "to"], [{"domainNames": [f"n{i}.example" for i in range(26)]}], "domainNames: must have 1 to 25 items, got 26"),
    (["spec", "egress", 0, "to"], [{"domainNames": ["a.example"]}],
     "spec.egress[0].action: a domainNames peer is only supported in Accept rules, got Deny"),
    (["spec", "egress", 0, "to"], [{"nodes": {"matchLabels": {"a": "b c"}}}], "spec.egress[0].to[0].nodes.matchLabels.a: invalid label value 'b c'"),
    (["spec", "egress", 0, "to"], [{"nodes": None}], "spec.egress[0].to[0]: exactly one of domainNames, namespaces, networks, nodes, pods must be set, got none"),
    (["spec", "egress", 0, "protocols"], [{"destinationNamedPort": "web"}],
     "spec.egress[0]: networks/nodes/domainNames peer cannot be set with namedPorts"),
    (["spec", "ingress", 0, "from", 0, "namespaces"], {"matchLabels": {"a": "b c"}},
     "spec.ingress[0].from[0].namespaces.matchLabels.a: invalid label value 'b c'"),
])
def test_validation(path, value, error):
    obj = _with(path, value)
    with pytest.raises(InvalidField) as caught:
        cluster_policy_from(obj)
    assert error in str(caught.value)


def test_validation_cases_start_from_a_valid_policy():
    cluster_policy_from(_with(["spec", "priority"], 3))


def test_priority_bounds_are_inclusive():
    assert cluster_policy_from(cnp(priority=0)).priority == 0
    assert cluster_policy_from(cnp(priority=1000)).priority == 1000


def test_rule_limits_are_inclusive():
    policy = cluster_policy_from(cnp(ingress=[rule(peers=[{"namespaces": {}}] * 25, protocols=[tcp(80)] * 25)] * 25))
    assert len(policy.ingress) == 25 and len(policy.ingress[0].peers) == 25 and len(policy.ingress[0].ports) == 25


def test_build_cluster_reads_the_kind_and_reports_an_invalid_one_on_one_line():
    good, bad = cnp("good"), cnp("bad", priority=2000)
    cluster, errors = build_cluster([("a.yaml", good), ("a.yaml", bad)])
    assert list(cluster.cluster_policies) == ["good"]
    assert [str(e) for e in errors] == [
        "ClusterNetworkPolicy bad: spec.priority: must be a number 0-1000, got 2000 (a.yaml)"]


def test_the_input_object_is_not_modified():
    obj = cnp(ingress=[rule(protocols=[tcp(80)])])
    before = copy.deepcopy(obj)
    cluster_policy_from(obj)
    assert obj == before


def test_fail_closed_keeps_good_rules_drops_bad_accepts_and_denies_for_bad_deny_and_pass():
    from nftpolicy.translators.clusterpolicy import fail_closed_cluster_policy

    obj = cnp("p", ingress=[rule("Accept"), rule("Accept", [{"future": {}}]), rule("Pass", [{"future": {}}])],
              egress=[rule("Deny", [{"future": {}}], key="to")])
    with pytest.raises(InvalidField):
        cluster_policy_from(obj)
    policy = fail_closed_cluster_policy(obj, "spec.ingress[0]: bad")
    assert policy is not None and (policy.name, policy.tier, policy.priority) == ("p", "Admin", 3)
    assert policy.ingress == (ClusterRule("Accept", (ClusterPeer(namespaces=RAVENCLAW),)),
                              ClusterRule("Deny", (ClusterPeer(namespaces=LabelSelector()),), name="fail-closed rule 2"))
    assert policy.egress == (ClusterRule("Deny", (ClusterPeer(namespaces=LabelSelector()), ClusterPeer(networks=(
        ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")))), name="fail-closed rule 0"),)


def test_fail_closed_needs_tier_priority_and_subject():
    from nftpolicy.translators.clusterpolicy import fail_closed_cluster_policy

    assert fail_closed_cluster_policy(cnp(priority=5000), "x") is None
    assert fail_closed_cluster_policy(cnp(subject={}), "x") is None


@pytest.mark.parametrize("command", [
    ["render", "--node", "node1"], ["render", "--node", "node2", "--format", "json"],
    ["explain", "--from", "shop/web", "--to", "172.18.0.2", "--port", "10250"],
    ["explain", "--from", "shop/api", "--to", "172.18.0.3", "--port", "10250", "--output", "json"],
])
def test_the_commands_read_the_nodes_peer_example_at_either_version(tmp_path, capsys, command):
    """examples/nodes-peer (v1alpha2) rewritten to v1beta1: the same output, exit code and
    stderr from render and explain (sandbox, trace and compare read manifests the same way)."""
    from nftpolicy.agent.cli.main import main

    example = REPO / "examples" / "nodes-peer" / "cluster.yaml"
    text = example.read_text()
    assert "apiVersion: policy.networking.k8s.io/v1alpha2" in text
    beta = tmp_path / "cluster.yaml"
    beta.write_text(text.replace("policy.networking.k8s.io/v1alpha2", "policy.networking.k8s.io/v1beta1"))
    results = []
    for path in (example, beta):
        code = main([*command, str(path)])
        results.append((code, *capsys.readouterr()))
    assert results[0] == results[1] and results[0][1]
