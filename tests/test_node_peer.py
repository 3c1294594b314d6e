"""The ClusterNetworkPolicy ``nodes`` egress peer in the rule model (translators/setstore.py,
chainbuilders.py, noderender.py): its shared set keys, and Node changes that move only that
Node's elements. Pure: no kernel."""

from __future__ import annotations

import dataclasses
from typing import Any

from nftpolicy.translators import layout
from nftpolicy.translators.manifests import build_cluster, node_from
from nftpolicy.translators.model import Cluster
from nftpolicy.translators.noderender import NodeRenderer, build_rule_model
from nftpolicy.translators.rules import AddressSet, RuleModel
from nftpolicy.translators.selectors import LabelSelector
from nftpolicy.translators.setstore import SetKey

from . import fakeapi

INFRA = {"matchLabels": {"role": "infra"}}


def node(name: str, v4: str, v6: str | None = None, **labels: str) -> dict[str, Any]:
    """A Node with an InternalIP (and an IPv6 one), an ExternalIP 198.51.100.<n> and a
    Hostname that is an IP (not a peer address)."""
    n = name[-1]
    addresses = [("InternalIP", v4), ("ExternalIP", f"198.51.100.{n}"), ("Hostname", f"192.0.2.{n}")]
    if v6:
        addresses.append(("InternalIP", v6))
    return fakeapi.node(name, *addresses, **labels)


def cnp(name: str, *rules: dict[str, Any], priority: int = 1, tier: str = "Admin") -> dict[str, Any]:
    return {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": name},
            "spec": {"tier": tier, "priority": priority, "subject": {"namespaces": {}}, "egress": list(rules)}}


def to_nodes(action: str, selector: dict[str, Any], port: int | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"action": action, "to": [{"nodes": selector}]}
    if port is not None:
        rule["protocols"] = [{"tcp": {"destinationPort": {"number": port}}}]
    return rule


PODS = [fakeapi.pod("x", "a", "10.0.0.1", node="n1", pod="a"), fakeapi.pod("x", "b", "fd00::1", node="n1", pod="b")]
NODES = [node("n1", "172.18.0.1", "fd00:18::1", role="infra"), node("n2", "172.18.0.2", "fd00:18::2", role="infra"),
         node("n3", "172.18.0.3", role="worker")]


def cluster(*objects: dict[str, Any]) -> Cluster:
    built, errors = build_cluster(("t", o) for o in [*PODS, *NODES, *objects])
    assert not errors, [str(e) for e in errors]
    return built


def node_sets(model: RuleModel) -> dict[str, AddressSet]:
    return {s.name: s for s in model.sets if s.name.startswith("KUBE-NODES-")}


def test_node_from_reads_labels_and_internal_and_external_addresses_of_both_families():
    n1 = node_from(node("n1", "172.18.0.1", "FD00:18::1", role="infra"))
    assert dict(n1.labels) == {"role": "infra"}
    assert n1.peer_addresses == ("172.18.0.1", "198.51.100.1", "fd00:18::1")
    assert "192.0.2.1" in n1.addresses and "192.0.2.1" not in n1.peer_addresses  # a Hostname is no peer address


def test_a_nodes_peer_is_one_shared_address_set_per_family_named_after_its_selector():
    model = build_rule_model(cluster(cnp("p", to_nodes("Accept", INFRA, 10250)), cnp("q", to_nodes("Deny", INFRA), priority=2)), "n1")
    sets = node_sets(model)
    v4, v6 = (SetKey("nodes", f, nodes=LabelSelector((("role", "infra"),))) for f in ("ipv4", "ipv6"))
    assert set(sets) == {v4.name, v6.name}  # two policies, one set per family
    assert sets[v4.name].kind == "addr" and sets[v4.name].comment == "nodes role=infra"
    assert sets[v4.name].elements == ("172.18.0.1", "172.18.0.2", "198.51.100.1", "198.51.100.2")
    assert sets[v6.name].elements == ("fd00:18::1", "fd00:18::2")
    everything = node_sets(build_rule_model(cluster(cnp("p", to_nodes("Accept", {}))), "n1"))
    assert {s.comment for s in everything.values()} == {"nodes (any)"}
    assert {"172.18.0.3", "198.51.100.3"} <= set(next(s.elements for s in everything.values() if s.family == "ipv4"))


def test_node_set_names_differ_by_family_and_selector():
    # (the other kinds' names are those of before: tests/golden holds them)
    names = {SetKey("nodes", f, nodes=s).name for f in ("ipv4", "ipv6") for s in (LabelSelector(), LabelSelector((("a", "b"),)))}
    assert len(names) == 4 and all(n.startswith("KUBE-NODES-") and len(n) <= 27 for n in names)


def test_the_tier_rule_matches_the_node_set_with_its_port_and_action():
    t = layout.table(build_rule_model(cluster(cnp("p", to_nodes("Deny", INFRA, 10250))), "n1"))
    (tier,) = [c for c in t.chains if c.name.startswith("KUBE-ANP-")]
    matches = [s for r in tier.rules for s in r.statements if isinstance(s, layout.AddressInSet)]
    assert {m.name for m in matches} == set(node_sets(build_rule_model(cluster(cnp("p", to_nodes("Deny", INFRA, 10250))), "n1")))
    assert all(m.field == "daddr" for m in matches)
    assert any(isinstance(s, layout.DestinationPorts) and (s.first, s.last) == (10250, 10250) for r in tier.rules for s in r.statements)


def renderer() -> NodeRenderer:
    r = NodeRenderer("n1").load(cluster(cnp("p", to_nodes("Accept", INFRA, 10250)), cnp("q", to_nodes("Deny", {"matchLabels": {"role": "worker"}}), priority=2)))
    r.take_changes()
    return r


def set_of(family: str, role: str) -> str:
    """The name of the node set of ``role=<role>`` Nodes of ``family``."""
    return SetKey("nodes", family, nodes=LabelSelector((("role", role),))).name  # type: ignore[arg-type]


def only_elements(changes: Any) -> dict[str, Any]:
    assert not changes.chains and not changes.sets_added and not changes.sets_removed
    return {"added": changes.elements_added, "removed": changes.elements_removed}


def test_a_node_added_adds_only_its_addresses():
    r = renderer()
    r.set_node("n4", node_from(node("n4", "172.18.0.4", "fd00:18::4", role="infra")))
    assert only_elements(r.take_changes()) == {
        "added": {set_of("ipv4", "infra"): ["172.18.0.4", "198.51.100.4"], set_of("ipv6", "infra"): ["fd00:18::4"]},
        "removed": {}}


def test_a_node_removed_removes_only_its_addresses():
    r = renderer()
    r.apply("Node", "n2", None)
    assert only_elements(r.take_changes()) == {
        "added": {}, "removed": {set_of("ipv4", "infra"): ["172.18.0.2", "198.51.100.2"], set_of("ipv6", "infra"): ["fd00:18::2"]}}


def test_a_relabelled_node_moves_from_one_set_to_the_other():
    r = renderer()
    r.set_node("n3", node_from(node("n3", "172.18.0.3", role="infra")))
    assert only_elements(r.take_changes()) == {
        "added": {set_of("ipv4", "infra"): ["172.18.0.3", "198.51.100.3"]},
        "removed": {set_of("ipv4", "worker"): ["172.18.0.3", "198.51.100.3"]}}


def test_a_changed_address_moves_only_that_address():
    r = renderer()
    r.set_node("n2", node_from(node("n2", "172.18.0.22", "fd00:18::2", role="infra")))
    assert only_elements(r.take_changes()) == {"added": {set_of("ipv4", "infra"): ["172.18.0.22"]},
                                               "removed": {set_of("ipv4", "infra"): ["172.18.0.2"]}}


def test_an_unrelated_label_change_changes_nothing():
    r = renderer()
    r.set_node("n2", node_from(node("n2", "172.18.0.2", "fd00:18::2", role="infra", zone="b")))
    assert not r.take_changes()


def test_an_address_two_nodes_give_stays_until_the_last_goes():
    r = renderer()
    r.set_node("n4", node_from(fakeapi.node("n4", ("InternalIP", "172.18.0.2"), role="infra")))  # n2's address too
    assert not r.take_changes()
    r.set_node("n2", None)
    changes = r.take_changes()
    assert changes.elements_removed == {set_of("ipv4", "infra"): ["198.51.100.2"], set_of("ipv6", "infra"): ["fd00:18::2"]}


def test_incremental_equals_a_full_render():
    r = renderer()
    for name, obj in (("n4", node("n4", "172.18.0.4", role="infra")), ("n1", None), ("n3", node("n3", "172.18.0.3", role="infra"))):
        r.set_node(name, node_from(obj) if obj else None)
    full = NodeRenderer("n1")
    c = cluster(cnp("p", to_nodes("Accept", INFRA, 10250)), cnp("q", to_nodes("Deny", {"matchLabels": {"role": "worker"}}), priority=2))
    nodes = dict(c.nodes)
    nodes.pop("n1")
    nodes["n4"] = node_from(node("n4", "172.18.0.4", role="infra"))
    nodes["n3"] = node_from(node("n3", "172.18.0.3", role="infra"))
    assert r.model() == full.load(dataclasses.replace(c, nodes=nodes)).model()


def test_the_last_policy_gone_takes_the_node_set_and_a_new_one_makes_it_with_current_nodes():
    r = renderer()
    r.set_cluster_policy("q", None)
    changes = r.take_changes()
    assert sorted(changes.sets_removed) == sorted(set_of(f, "worker") for f in ("ipv4", "ipv6"))
    r.set_node("n5", node_from(node("n5", "172.18.0.5", role="worker")))
    assert not r.take_changes()  # no set selects workers any more
    r.set_cluster_policy("q", build_cluster([("t", cnp("q", to_nodes("Deny", {"matchLabels": {"role": "worker"}}), priority=2))])[0]
                         .cluster_policies["q"])
    added = {s.name: s.elements for s in r.take_changes().sets_added}
    assert added[set_of("ipv4", "worker")] == ("172.18.0.3", "172.18.0.5", "198.51.100.3", "198.51.100.5")
