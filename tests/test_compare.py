"""``nftpolicy compare``: a kube-router dump replayed against nftpolicy's ruleset for the same node.

The dump here is ``examples/shop/node1.*``, which is synthetic, not saved from a node: its
layout (a ``KUBE-NWPLCY-COMMON`` chain that accepts ICMP echo, ``KUBE-NWPLCY-TAIL``, an SCTP
node-port exemption) is modelled on later kube-router sources, with comments of its own. kube-router
v2.1.0 writes none of these (its real dumps are in ``tests/fixtures/kube-router-v2.1.0``, replayed
by ``tests/test_real_dumps.py``); the reader keeps accepting them for later releases."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nftpolicy.agent.testbed.compare import compare, explain, format_report
from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.translators.kuberouter import DumpError, parse_iptables_save, select
from nftpolicy.translators.manifests import build_cluster

from .conftest import REPO, example_cluster
from .test_tiers import BASE, cnp, from_ns, tcp

EXAMPLE = REPO / "examples" / "shop"
NFTPOLICY = str(Path(sys.executable).parent / "nftpolicy")
API = "shop/api-5f6b7c9d4-q8w2n"
PROMETHEUS = "ops/prometheus-0"


def example_dump() -> tuple[str, str]:
    return (EXAMPLE / "node1.iptables-save").read_text(), (EXAMPLE / "node1.ipset-save").read_text()


def with_foreign_rules(iptables_save: str) -> str:
    """The example dump as a real node would have it: other tools' chains and rules around it."""
    text = iptables_save.replace(":INPUT ACCEPT [0:0]", ":INPUT ACCEPT [12:3456]").replace(":FORWARD ACCEPT [0:0]", ":FORWARD DROP [0:0]")
    text = text.replace(":KUBE-NWPLCY-COMMON - [0:0]", ":DOCKER-USER - [0:0]\n:KUBE-NWPLCY-COMMON - [0:0]", 1)
    extra = "\n".join([
        "[7:420] -A INPUT -p tcp -m tcp --dport 22 -j ACCEPT",
        "-A FORWARD -j DOCKER-USER",
        "-A DOCKER-USER -j RETURN",
        "-A KUBE-ROUTER-FORWARD -m set --match-set ban_egress_dst dst -j DROP",
        "-A KUBE-ROUTER-OUTPUT -j DOCKER-USER",
    ])
    text = text.replace("COMMIT\n", extra + "\nCOMMIT\n", 1)
    return text + "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n"


# ---- reading dumps (pure) ----------------------------------------------------------------------

def test_the_example_dump_is_all_kube_routers():
    dump = select({"ipv4": example_dump()[0]}, example_dump()[1])
    assert dump.left_out == [] and dump.loader == "nft" and dump.accepts_icmp_echo  # KUBE-NWPLCY-COMMON
    chains, rules = dump.kept["ipv4"]
    assert len(rules) == 79 and len(chains) == 13 and len(dump.sets) == 10
    restore = dump.restore("ipv4")
    assert restore.startswith("*filter\n:INPUT ACCEPT [0:0]\n") and restore.endswith("COMMIT\n")


def test_the_dump_says_which_node_it_was_taken_on():
    """kube-router makes pod chains for its node's pods only: their addresses name the node."""
    dump = select({"ipv4": example_dump()[0]}, example_dump()[1])
    cluster = example_cluster()
    assert dump.pod_addresses == {ip for pod in cluster.pods.values() if pod.node == "node1" and not pod.host_network
                                  for ip in pod.ips} and len(dump.pod_addresses) == 3


@pytest.mark.parametrize("node, message", [
    ("node1", ""),
    ("node2", "its pod chains are for pods of node node1 (3 of 3), none of --node node2's: give --node node1, or node2's dump"),
    ("node9", "its pod chains are for pods of node node1 (3 of 3), none of --node node9's: give --node node1, or node9's dump"),
])
def test_a_dump_of_another_node_is_refused_in_one_line(node, message):
    from nftpolicy.agent.cli.commands.compare import dump_of_another_node
    dump = select({"ipv4": example_dump()[0]}, example_dump()[1])
    assert dump_of_another_node(example_cluster(), node, dump.pod_addresses) == message
    assert dump_of_another_node(example_cluster(), node, {"10.9.9.9"}) == ""  # no pod of the manifests: nothing to say


def test_foreign_rules_are_left_out_and_listed():
    iptables_save, ipset_save = example_dump()
    dump = select({"ipv4": with_foreign_rules(iptables_save)},
                  ipset_save + "create ban_egress_dst hash:ip family inet hashsize 1024 maxelem 65536\nadd ban_egress_dst 192.0.2.1\n")
    assert dump.rule_count == 79
    listed = "\n".join(dump.left_out)
    for expected in ("-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT  (not a jump to kube-router's chain)",
                     "-A FORWARD -j DOCKER-USER  (not a jump to kube-router's chain)",
                     "filter chain DOCKER-USER (1 rules): not a kube-router chain",
                     "-A KUBE-ROUTER-FORWARD -m set --match-set ban_egress_dst dst -j DROP  (matches set ban_egress_dst, not a kube-router set)",
                     "-A KUBE-ROUTER-OUTPUT -j DOCKER-USER  (jumps to DOCKER-USER, not a kube-router chain)",
                     "filter FORWARD policy DROP: loaded as ACCEPT",
                     "table nat: 1 rules in 2 chains",
                     "set ban_egress_dst: no kube-router rule of the dump references it"):
        assert expected in listed, listed
    assert "DOCKER-USER" not in dump.restore("ipv4") and "ban_egress_dst" not in dump.ipset()


def test_a_set_missing_from_the_ipset_save_is_an_error():
    iptables_save, ipset_save = example_dump()
    lines = [line for line in ipset_save.splitlines() if "KUBE-SRC-7EV6Q4CPTKLPVZ5C" not in line]
    with pytest.raises(DumpError, match="KUBE-SRC-7EV6Q4CPTKLPVZ5C"):
        select({"ipv4": iptables_save}, "\n".join(lines))


def test_counters_and_legacy_headers_are_read():
    tables = parse_iptables_save("# Generated by iptables-save v1.8.9 on today\n*filter\n:INPUT ACCEPT [1:2]\n"
                                 "[3:4] -A INPUT -m comment --comment \"a \\\"quoted\\\" word\" -j KUBE-ROUTER-INPUT\nCOMMIT\n")
    rule = tables["filter"].rules[0]
    assert rule.text.startswith("-A INPUT") and rule.target == "KUBE-ROUTER-INPUT" and 'a "quoted" word' in rule.words
    assert select({"ipv4": "# Generated by iptables-save v1.8.9 on today\n*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n"}, "").loader == "legacy"
    with pytest.raises(DumpError, match="iptables-save:1"):
        parse_iptables_save("-A INPUT -j ACCEPT\n")


# ---- replay (kernel) ---------------------------------------------------------------------------

@pytest.mark.kernel
@pytest.mark.parametrize("loader", ["nft", "legacy"])
def test_the_example_node_gives_nftpolicys_verdicts(loader):
    iptables_save, ipset_save = example_dump()
    report = compare(example_cluster(), "node1", select({"ipv4": with_foreign_rules(iptables_save)}, ipset_save), loader=loader)
    assert report.differences == [], format_report(report)
    assert report.local_pods == [PROMETHEUS, API, "shop/frontend-7d9c8b6f5-x2k4p"]
    # Every container port, every policy port, endPort's both ends and the port after it.
    assert {(s.protocol, s.port) for s in report.specs} == {
        ("TCP", 53), ("UDP", 53), ("TCP", 5432), ("TCP", 6000), ("TCP", 6379), ("TCP", 6999), ("TCP", 7000), ("TCP", 8080), ("TCP", 9090)}
    assert report.cells == 9 * (6 * 5 - 3 * 2)  # pairs with an end on node1 (the 3 node2 pods among themselves excluded)
    assert len(report.left_out) == 7


@pytest.mark.kernel
def test_a_changed_policy_is_reported_with_the_exact_cell():
    """Drop api-ingress's second rule (prometheus -> api on the named port metrics) from the
    manifests: the dump still allows it, nftpolicy no longer does; nothing else changes."""
    cluster = example_cluster()
    key = "shop/api-ingress"
    policy = cluster.policies[key]
    changed = dataclasses.replace(cluster, policies={**cluster.policies, key: dataclasses.replace(policy, ingress=policy.ingress[:1])})
    report = compare(changed, "node1", select({"ipv4": example_dump()[0]}, example_dump()[1]))
    assert [(d.spec, d.family, d.src, d.dst, d.kube_router, d.nftpolicy, d.note) for d in report.differences] == [
        (ProbeSpec(9090, "TCP"), "ipv4", PROMETHEUS, API, True, False, None)]
    assert report.differences[0].policies == (f"{key} (ingress of {API})",)
    assert f"DIFF TCP/9090 ipv4 {PROMETHEUS} -> {API}: kube-router allowed, nftpolicy blocked; policies: {key} (ingress of {API})" \
        in format_report(report)


@pytest.mark.kernel
def test_cli_compare(tmp_path):
    args = [NFTPOLICY, "compare", "--node", "node1", "--iptables-save", str(EXAMPLE / "node1.iptables-save"),
            "--ipset-save", str(EXAMPLE / "node1.ipset-save")]
    same = subprocess.run(args + ["--deny-action", "reject", str(EXAMPLE / "cluster.yaml")], capture_output=True, text=True, timeout=120)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "no difference" in same.stdout
    changed = tmp_path / "cluster.yaml"
    changed.write_text((EXAMPLE / "cluster.yaml").read_text().replace("port: 8080", "port: 8081", 1))
    out = subprocess.run(args + [str(changed)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "DIFF TCP/8080 ipv4 shop/frontend-7d9c8b6f5-x2k4p -> shop/api-5f6b7c9d4-q8w2n: kube-router allowed, nftpolicy blocked" in out.stdout
    assert "DIFF TCP/8081 ipv4 shop/frontend-7d9c8b6f5-x2k4p -> shop/api-5f6b7c9d4-q8w2n: kube-router blocked, nftpolicy allowed" in out.stdout
    missing = subprocess.run(args[:2] + ["--node", "node1", "--ipset-save", str(EXAMPLE / "node1.ipset-save"), str(EXAMPLE)],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--iptables-save" in missing.stderr
    other = subprocess.run([*args[:3], "node2", *args[4:], str(EXAMPLE / "cluster.yaml")], capture_output=True, text=True, timeout=60)
    assert (other.returncode, other.stdout) == (2, "") and other.stderr.splitlines() == [
        f"nftpolicy: --iptables-save {EXAMPLE / 'node1.iptables-save'}: its pod chains are for pods of node node1 (3 of 3), "
        "none of --node node2's: give --node node1, or node2's dump"]


@pytest.mark.kernel
def test_a_dual_stack_dump_saved_from_a_node(make_netns):
    """IPv4 and IPv6 together (``--ip6tables-save``), from real ``iptables-legacy-save``,
    ``ip6tables-legacy-save`` and ``ipset save`` output: our own iptables variant, loaded into a
    namespace and saved, with its set names given kube-router's prefixes (ours are ``KUBE-PODS-``,
    ``KUBE-NET-`` and ``KUBE-PORT-``, which the reader rightly leaves out), is recognised as
    kube-router's layout and gives nftpolicy's verdicts. (No real dump serves here: kube-router
    v2.1.0 enforces nothing over IPv6, cloudnativelabs/kube-router#1653.)"""
    from nftpolicy.agent.dataplane import iptables
    from nftpolicy.translators import transaction
    from nftpolicy.translators.noderender import build_rule_model

    cluster = example_cluster()
    pods = {}
    for key, pod in cluster.pods.items():
        _, _, x, y = pod.ips[0].split(".") if pod.ips else ("", "", "", "")
        pods[key] = dataclasses.replace(pod, ips=pod.ips + ((f"fd00:10:244:{x}::{y}",) if pod.ips else ()))
    cluster = dataclasses.replace(cluster, pods=pods)
    ns = make_netns()
    iptables.IptablesDataplane(ns, "legacy").run(transaction.full(build_rule_model(cluster, "node1")))
    saved = {f: subprocess.run(["ip", "netns", "exec", ns, tool, "-t", "filter"], capture_output=True, text=True, check=True).stdout
             for f, tool in (("ipv4", "iptables-legacy-save"), ("ipv6", "ip6tables-legacy-save"))}
    ipset_save = subprocess.run(["ip", "netns", "exec", ns, "ipset", "save"], capture_output=True, text=True, check=True).stdout
    prefixes = {"KUBE-PODS-": "KUBE-SRC-", "KUBE-NET-": "KUBE-DST-", "KUBE-PORT-": "KUBE-DST-"}

    def kube_router_names(text: str) -> str:
        # kube-router has one KUBE-POD-FW- chain per pod, ours one per direction with the same hash: the egress
        # chain gets the hash reversed, so that the two stay two chains
        text = re.sub(r"KUBE-POD-IN-(?=[A-Z2-7]{16}\b)", "KUBE-POD-FW-", text)
        text = re.sub(r"KUBE-POD-EG-([A-Z2-7]{16})\b", lambda m: f"KUBE-POD-FW-{m.group(1)[::-1]}", text)
        return re.sub(r"KUBE-(?:PODS|NET|PORT)-(?=[A-Z2-7]{16}\b)", lambda m: prefixes[m.group(0)], text)

    dump = select({f: kube_router_names(t) for f, t in saved.items()}, kube_router_names(ipset_save))
    assert dump.loader == "legacy" and dump.left_out == [] and "family inet6" in dump.ipset()
    report = compare(cluster, "node1", dump)
    assert report.families == ["ipv4", "ipv6"] and report.cells == 2 * 9 * 24
    assert report.differences == [], format_report(report)


def test_a_cell_a_cluster_policy_decides_names_its_rule():
    """kube-router has no ClusterNetworkPolicy: the note names the rule that decides the cell in
    nftpolicy, as the verdict engine reads it from the tables (pure: no sandbox)."""
    cluster, errors = build_cluster(("t", o) for o in [*BASE, cnp("deny-y", "Admin", 1, ingress=[from_ns("Deny", "y", tcp(80))])])
    assert not errors
    note = explain(cluster, ProbeSpec(80, "TCP"), "y/a", "x/a", kube_router=True, ours=False)
    assert note == "deliberate: kube-router has no ClusterNetworkPolicy; in nftpolicy ClusterNetworkPolicy deny-y ingress rule 0 (Deny) " \
        "decides this cell"
    assert explain(cluster, ProbeSpec(81, "TCP"), "y/a", "x/a", kube_router=True, ours=False) is None  # no rule of it matches


def test_the_report_says_why_each_left_out_item_is_left_out():
    """An unreferenced set of kube-router's own is no 'not kube-router's network policy' (issue 34
    item 10): the heading says they are not loaded, each line why."""
    from nftpolicy.agent.testbed.compare import Comparison, format_report

    report = Comparison(node="node1", local_pods=[], rules_kept=0, loader="nft", specs=[], families=["ipv4"], cells=0,
                        differences=[], left_out=["ipset save: set KUBE-SRC-X: no kube-router rule of the dump references it"],
                        not_built=[])
    assert format_report(report).splitlines()[3:5] == [
        "left out of the dump (1: not loaded into kube-router's twin; each line says why):",
        "  ipset save: set KUBE-SRC-X: no kube-router rule of the dump references it"]
