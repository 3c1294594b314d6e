"""The ClusterNetworkPolicy tiers in the table (translators/layout.py, tierchains.py,
noderender.py): tier chains, their place in the pod chain, the marks. Pure: no kernel."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from nftpolicy.translators import iptables, layout, nft
from nftpolicy.translators.layout import (
    AddressInSet, ClearAndSetMark, ClearMark, CounterStatement, DestinationPorts, Jump, Limit, Log, Protocols, Reject, SetMark, Unmarked,
    VerdictStatement,
)
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.noderender import NodeRenderer, build_rule_model
from nftpolicy.translators.rules import LOG_PREFIX_MAX_BYTES, Config

from . import fakeapi

CONFIG = Config()
OURS = CONFIG.policy_mark | CONFIG.passed_mark | CONFIG.pass_mark


def pod(key: str, ip: str, node: str = "n1") -> dict[str, Any]:
    """Pod ``key`` (``ns/name``) labelled ``pod: name``, with port web (80)."""
    namespace, name = key.split("/")
    return fakeapi.pod(namespace, name, ip, node=node, ports=(("web", 80, "TCP"),), pod=name)


def cnp(name: str, tier: str, priority: int, namespace: str = "x", **rules: Any) -> dict[str, Any]:
    return {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": name},
            "spec": {"tier": tier, "priority": priority,
                     "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}, **rules}}


FROM_Y = [{"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "y"}}}]
NETPOL = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "x", "name": "np"},
          "spec": {"podSelector": {}, "policyTypes": ["Ingress"],
                   "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "y"}}}]}]}}
PODS = [pod("x/a", "10.0.0.1"), pod("y/a", "10.0.1.1"), pod("z/a", "10.0.2.1", node="n2")]


def table(*objects: dict[str, Any], node: str | None = "n1") -> layout.Table:
    cluster, errors = build_cluster(("t", o) for o in [*PODS, *objects])
    assert not errors, [str(e) for e in errors]
    return layout.table(build_rule_model(cluster, node, CONFIG))


def chain(t: layout.Table, prefix: str) -> list[layout.Chain]:
    return [c for c in t.chains if c.name.startswith(prefix)]


def test_each_action_becomes_its_verdict_in_written_order():
    t = table(cnp("p", "Admin", 1, ingress=[
        {"action": "Accept", "from": FROM_Y, "protocols": [{"tcp": {"destinationPort": {"number": 80}}}]},
        {"action": "Pass", "from": FROM_Y, "protocols": [{"udp": {"destinationPort": {"range": {"start": 53, "end": 60}}}}]},
        {"action": "Deny", "from": FROM_Y}]))
    (tier,) = chain(t, "KUBE-ANP-")
    actions = [r.statements[-2:] for r in tier.rules]
    deny_log = Log("nftpolicy deny Admin ingress rule 2 p: ", CONFIG.nflog_group)
    assert actions == [(SetMark(CONFIG.policy_mark), VerdictStatement("return")), (SetMark(CONFIG.pass_mark), VerdictStatement("return")),
                       (Limit(*layout.LOG_RATE), deny_log), (CounterStatement(), VerdictStatement("drop"))]
    assert tier.rules[0].statements[1:3] == (Protocols(("tcp",)), DestinationPorts(80, 80))
    assert tier.rules[1].statements[1:3] == (Protocols(("udp",)), DestinationPorts(53, 60))
    assert tier.rules[3].statements[1:] == (CounterStatement(), VerdictStatement("drop"))  # every protocol, no answer
    assert all(isinstance(r.statements[0], AddressInSet) and r.statements[0].field == "saddr" for r in tier.rules)
    assert [r.comment for r in tier.rules] == ["p Admin ingress rule 0 (Accept)", "p Admin ingress rule 1 (Pass)",
                                               *["p Admin ingress rule 2 (Deny)"] * 2]
    assert not any(isinstance(s, Reject) for r in tier.rules for s in r.statements)


@pytest.mark.parametrize("deny_action", ["reject", "drop"])
def test_a_deny_drops_whatever_the_deny_action(deny_action):
    """--deny-action is NetworkPolicy's implicit deny only: a Deny rule drops in either case
    ("Deny: Drops the selected traffic", network-policy-api v0.3.0)."""
    cluster, errors = build_cluster(("t", o) for o in [*PODS, cnp("p", "Admin", 1, ingress=[
        {"action": "Deny", "from": FROM_Y, "protocols": [{"tcp": {"destinationPort": {"number": 80}}}]}])])
    assert not errors
    (tier,) = chain(layout.table(build_rule_model(cluster, "n1", Config(deny_action=deny_action))), "KUBE-ANP-")
    assert [layout.refused_by(r) for r in tier.rules] == [None, "drop"]


@pytest.mark.parametrize("deny_action, refusals", [
    ("reject", [((Protocols(("tcp",)), CounterStatement(), Reject(tcp_reset=True)), "x/a reject ingress"),
                ((CounterStatement(), Reject()), "x/a reject ingress")]),
    ("drop", [((CounterStatement(), VerdictStatement("drop")), "x/a drop ingress")]),
])
def test_the_implicit_deny_of_a_pod_chain_follows_the_deny_action(deny_action, refusals):
    """What no NetworkPolicy allowed: kube-router's reject by default (a TCP reset, else ICMP
    port unreachable), one counted drop with --deny-action drop; logged first either way, with
    the same prefix."""
    cluster, errors = build_cluster(("t", o) for o in [*PODS, NETPOL])
    assert not errors
    config = Config(deny_action=deny_action)
    (pod_chain,) = chain(layout.table(build_rule_model(cluster, "n1", config)), "KUBE-POD-IN-")
    refusing = [r for r in pod_chain.rules if layout.refused_by(r)]
    assert [(r.statements[1:], r.comment) for r in refusing] == refusals
    assert all(r.statements[0] == Unmarked(config.policy_mark) for r in refusing)
    log = pod_chain.rules[pod_chain.rules.index(refusing[0]) - 1]
    assert log.statements[-1] == Log("nftpolicy reject ingress x/a: ", config.nflog_group)
    assert {layout.refused_by(r) for r in refusing} == {deny_action}


def test_a_deny_is_logged_once_then_counted_on_its_drop_and_named_from_its_origin():
    """The NFLOG rule comes first (the pod chains' rate), then a counter before the drop; the
    renderer's chain owners name each counted rule by its origin, in chain order."""
    objects = [cnp("p", "Admin", 1, ingress=[
        {"action": "Accept", "from": FROM_Y, "protocols": [{"tcp": {"destinationPort": {"number": 80}}}]},
        {"action": "Deny", "from": FROM_Y, "protocols": [{"udp": {"destinationPort": {"number": 53}}}]},
        {"action": "Deny", "from": FROM_Y, "name": "rest"}])]
    cluster, errors = build_cluster(("t", o) for o in [*PODS, *objects])
    assert not errors
    renderer = NodeRenderer("n1", CONFIG)
    renderer.load(cluster)
    model = renderer.model()
    (tier,) = model.tier_chains
    (laid_out,) = chain(layout.table(model), "KUBE-ANP-")
    logs = [r for r in laid_out.rules if any(isinstance(s, Log) for s in r.statements)]
    assert [[s for s in r.statements if isinstance(s, (Limit, Log))] for r in logs] == [
        [Limit(*layout.LOG_RATE), Log(f"nftpolicy deny Admin ingress rule {i} p: ", CONFIG.nflog_group)] for i in (1, 2)]
    counted = renderer.chain_owners()[tier.name].counted
    assert [(o.tier, o.policy, o.direction, o.index, o.name) for o in counted] == [
        ("Admin", "p", "ingress", 1, ""), ("Admin", "p", "ingress", 2, "rest")]
    assert counted == layout.counted_origins(layout.tier_chain(CONFIG, tier))


def test_a_deny_prefix_keeps_within_the_kernel_limit_for_the_longest_name():
    """A 253-character policy name: the printed prefix is cut to 127 bytes (NF_LOG_PREFIXLEN
    less the NUL) after tier, direction and rule index, which come first."""
    name = ("a" * 62 + ".") * 4 + "b"
    assert len(name) == 253
    t = table(cnp(name, "Baseline", 1, ingress=[{"action": "Accept", "from": FROM_Y}, {"action": "Deny", "from": FROM_Y}]))
    (tier,) = chain(t, "KUBE-BANP-")
    printed = [nft.statement_json(s)["log"]["prefix"] for r in tier.rules for s in r.statements if isinstance(s, Log)]
    assert printed == [f"nftpolicy deny Baseline ingress rule 1 {name}"[:127]]
    assert len(printed[0].encode()) == LOG_PREFIX_MAX_BYTES == 127


def _jumps(c: layout.Chain) -> list[tuple[str, Any]]:
    """The pod chain as (what, guard): jump targets by prefix and the pass-mark clears."""
    found = []
    for r in c.rules:
        last = r.statements[-1]
        if isinstance(last, Jump) and last.target != layout.COMMON_CHAIN:
            guard = next(s for s in r.statements if isinstance(s, Unmarked))
            found.append((last.target.rsplit("-", 1)[0], guard.bits))
        elif last == ClearMark(CONFIG.pass_mark):
            found.append(("clear pass", None))
    return found


TIER_GUARD = CONFIG.policy_mark | CONFIG.pass_mark


def test_admin_before_networkpolicy_and_no_baseline_where_a_networkpolicy_isolates():
    t = table(NETPOL, cnp("admin", "Admin", 1, ingress=[{"action": "Pass", "from": FROM_Y}]),
              cnp("base", "Baseline", 1, ingress=[{"action": "Deny", "from": FROM_Y}]))
    (pod_chain,) = chain(t, "KUBE-POD-IN-")
    assert _jumps(pod_chain) == [("KUBE-ANP", TIER_GUARD), ("clear pass", None), ("KUBE-NWPLCY", CONFIG.policy_mark)]  # the ingress policy
    assert not chain(t, "KUBE-POD-EG-")  # nothing isolates its egress
    assert not chain(t, "KUBE-BANP-")  # it selects x/a only, whose ingress a NetworkPolicy isolates


def test_baseline_where_no_networkpolicy_isolates_then_default():
    t = table(cnp("admin", "Admin", 1, egress=[{"action": "Pass", "to": FROM_Y}]),
              cnp("base-b", "Baseline", 2, ingress=[{"action": "Deny", "from": FROM_Y}]),
              cnp("base-a", "Baseline", 2, ingress=[{"action": "Accept", "from": FROM_Y}]))
    (pod_chain,) = chain(t, "KUBE-POD-IN-")
    (egress_chain,) = chain(t, "KUBE-POD-EG-")
    names = {c.name: c for c in t.chains}
    assert _jumps(pod_chain) == [("KUBE-BANP", TIER_GUARD), ("KUBE-BANP", TIER_GUARD), ("clear pass", None),
                                 ("KUBE-NWPLCY", CONFIG.policy_mark)]  # ingress DEFAULT
    assert _jumps(egress_chain) == [("KUBE-ANP", TIER_GUARD), ("clear pass", None), ("KUBE-NWPLCY", CONFIG.policy_mark)]  # egress DEFAULT
    banp = [r.statements[-1].target for r in pod_chain.rules if isinstance(r.statements[-1], Jump) and "BANP" in r.statements[-1].target]
    assert [names[b].rules[0].comment.split()[0] for b in banp] == ["base-a", "base-b"]  # (priority, name)
    assert pod_chain.rules[1].statements == (ClearMark(CONFIG.policy_mark | CONFIG.pass_mark),)


def test_a_pod_only_a_cluster_policy_selects_gets_a_pod_chain_and_its_dispatch():
    t = table(cnp("deny-y", "Admin", 1, ingress=[{"action": "Deny", "from": FROM_Y}]))
    (pod_chain,) = chain(t, "KUBE-POD-IN-")
    assert not chain(t, "KUBE-POD-EG-")
    assert [(m.name, e.address, e.chain) for m in t.maps for e in m.elements] == [("KUBE-POD-IN-MAP4", "10.0.0.1", pod_chain.name)]


def test_a_cluster_policy_without_a_local_subject_renders_nothing():
    t = table(cnp("far", "Admin", 1, namespace="z", ingress=[{"action": "Deny", "from": FROM_Y}]))
    assert not chain(t, "KUBE-ANP-") and not chain(t, "KUBE-POD-")


def test_a_remote_cluster_policy_change_touches_no_chain():
    cluster, _ = build_cluster(("t", o) for o in PODS)
    renderer = NodeRenderer("n1", CONFIG).load(cluster)
    renderer.take_changes()
    far, _ = build_cluster([("t", cnp("far", "Admin", 1, namespace="z", ingress=[{"action": "Deny", "from": FROM_Y}]))])
    renderer.apply("ClusterNetworkPolicy", "far", far.cluster_policies["far"])
    assert not renderer.take_changes()


def test_every_mark_we_write_is_inside_our_bits():
    t = table(NETPOL, cnp("admin", "Admin", 1, ingress=[{"action": "Pass", "from": FROM_Y}],
                          egress=[{"action": "Accept", "to": FROM_Y}]),
              cnp("base", "Baseline", 1, namespace="y", ingress=[{"action": "Pass", "from": FROM_Y}]), node=None)
    written = [s.bits for c in t.chains for r in c.rules for s in r.statements if isinstance(s, (SetMark, ClearMark))]
    written += [s.clear | s.set for c in t.chains for r in c.rules for s in r.statements if isinstance(s, ClearAndSetMark)]
    assert CONFIG.pass_mark in written and CONFIG.policy_mark | CONFIG.passed_mark in written  # the pod chain's "allowed" and tail
    assert all(bits & ~OURS == 0 for bits in written)


def test_named_ports_resolve_on_the_destination_pods_for_each_protocol():
    t = table(cnp("web", "Admin", 1, ingress=[{"action": "Deny", "from": FROM_Y, "protocols": [{"destinationNamedPort": "web"}]}]))
    named = sorted((s.comment, s.elements) for s in t.sets if s.kind == "named_port")
    assert named == [("port web/SCTP of local pods in namespaces kubernetes.io/metadata.name=x: (any)", ()),
                     ("port web/TCP of local pods in namespaces kubernetes.io/metadata.name=x: (any)", (("10.0.0.1", "tcp", 80),)),
                     ("port web/UDP of local pods in namespaces kubernetes.io/metadata.name=x: (any)", ())]


def test_the_iptables_variant_declines_cluster_policies():
    cluster, _ = build_cluster(("t", o) for o in [*PODS, cnp("deny-y", "Admin", 1, ingress=[{"action": "Deny", "from": FROM_Y}])])
    model = build_rule_model(cluster, "n1", CONFIG)
    with pytest.raises(iptables.Unsupported, match=r"^the iptables variant does not enforce ClusterNetworkPolicy .*deny-y selects pods of this node"):
        iptables.to_restore(layout.table(model))
    with pytest.raises(iptables.Unsupported):
        iptables.to_ipset(layout.table(model))


def test_the_three_marks_must_be_different_bits(capsys):
    from nftpolicy.agent.cli.main import main

    assert main(["render", "--policy-mark", hex(CONFIG.pass_mark), "examples/shop"]) == 2
    assert capsys.readouterr().err == "nftpolicy: --policy-mark and --pass-mark must differ (both 0x40000)\n"
    assert main(["render", "--pass-mark", hex(CONFIG.passed_mark), "examples/shop"]) == 2
    assert capsys.readouterr().err == "nftpolicy: --passed-mark and --pass-mark must differ (both 0x20000)\n"


def test_the_pass_mark_is_a_setting(tmp_path, capsys):
    """--pass-mark moves every use of the pass mark (set by a Pass rule, guarded and cleared in
    the pod chain) to the bit it names; the other marks stay."""
    from nftpolicy.agent.cli.main import main

    manifest = tmp_path / "cluster.json"
    manifest.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        *PODS, cnp("pass-y", "Admin", 1, ingress=[{"action": "Pass", "from": FROM_Y}])]}))
    assert main(["render", "--node", "n1", str(manifest)]) == 0
    default = capsys.readouterr().out
    assert main(["render", "--node", "n1", "--pass-mark", "0x80000", str(manifest)]) == 0
    moved = capsys.readouterr().out
    assert "0x00040000" in default and "0x00080000" in moved

    def swapped(number: int) -> int:  # bit 0x40000 and bit 0x80000 trade places
        return number & ~0xC0000 | (number & 0x40000) << 1 | (number & 0x80000) >> 1

    hex_numbers = re.compile(r"0x[0-9a-f]{8}")
    assert hex_numbers.sub("0x", moved) == hex_numbers.sub("0x", default)
    assert [int(m, 16) for m in hex_numbers.findall(moved)] == [swapped(int(d, 16)) for d in hex_numbers.findall(default)]


def test_a_tier_rule_of_several_peers_and_ports_jumps_to_its_peer_chain():
    """25 peers x 25 ports of a Deny rule: one jump from the 25 ports' set and the log and drop of
    the 25 peers' union set, not 625 of each; an Accept rule's chain returns once its peer chain
    set the policy mark."""
    from nftpolicy.translators.manifests import build_cluster
    from nftpolicy.translators.noderender import build_rule_model

    def cnp(action: str) -> dict:
        return {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": action.lower()},
                "spec": {"tier": "Admin", "priority": 1, "subject": {"namespaces": {}}, "ingress": [
                    {"action": action, "from": [{"namespaces": {"matchLabels": {"p": str(i)}}} for i in range(25)],
                     "protocols": [{"tcp": {"destinationPort": {"number": 1000 + i}}} for i in range(25)]}]}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": "x", "name": "a"}, "spec": {"nodeName": "n1", "containers": [{"name": "c"}]},
           "status": {"phase": "Running", "podIPs": [{"ip": "10.0.0.1"}]}}
    cluster, errors = build_cluster([("t", cnp("Deny")), ("t", cnp("Accept")), ("t", pod)])
    assert not errors
    m = build_rule_model(cluster, None, CONFIG)
    chains = {c.name: c for c in layout.table(m).chains}
    for tier in m.tier_chains:
        (peers,) = tier.peer_chains
        own, peer = chains[tier.name].rules, chains[peers.name].rules
        if tier.policy == "deny":
            assert len(own) == 1 and len(peer) == 2  # NFLOG and the counted drop of the union set
            assert layout.DestinationPortSet(((1000, 1024),)) in own[0].statements
            assert len(layout.counted_origins(chains[peers.name])) == 1
        else:
            assert len(own) == 1 + 1 and own[-1].statements == (layout.Marked(CONFIG.policy_mark), layout.VerdictStatement("return"))
            assert len(peer) == 1
