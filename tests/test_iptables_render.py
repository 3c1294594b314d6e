"""The iptables variant's rendering (pure): shapes, names and limits, and the ipset ``hash:net``
encoding of ipBlocks (longest-prefix match with ``nomatch``)."""

from __future__ import annotations

import ipaddress
import re
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from nftpolicy.translators import iptables, layout
from nftpolicy.translators.model import IPBlock
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import Config

from .conftest import example_cluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import synthetic  # noqa: E402

STANDARD = {"ACCEPT", "DROP", "RETURN", "REJECT", "MARK", "NFLOG"}


def lpm_contains(entries: list[tuple[str, bool]], address: str) -> bool:
    """ipset hash:net lookup: the most specific entry decides; a nomatch entry means no match."""
    ip = ipaddress.ip_address(address)
    hits = [(ipaddress.ip_network(cidr), nomatch) for cidr, nomatch in entries if ip in ipaddress.ip_network(cidr)]
    if not hits:
        return False
    return not max(hits, key=lambda h: h[0].prefixlen)[1]


def test_an_except_is_one_nomatch_entry_like_kube_routers():
    block = IPBlock(ipaddress.ip_network("10.244.1.0/24"), (ipaddress.ip_network("10.244.1.10/32"),))
    assert iptables.lpm_entries([str(n) for n in block.networks()], "ipv4") == [("10.244.1.0/24", False), ("10.244.1.10", True)]


def test_everything_is_two_halves_because_ipset_has_no_slash_zero():
    assert iptables.lpm_entries(["0.0.0.0/0"], "ipv4") == [("0.0.0.0/1", False), ("128.0.0.0/1", False)]
    assert iptables.lpm_entries(["::/0"], "ipv6") == [("::/1", False), ("8000::/1", False)]
    everything_but = [str(n) for n in ipaddress.ip_network("0.0.0.0/0").address_exclude(ipaddress.ip_network("10.0.0.0/8"))]
    assert iptables.lpm_entries(everything_but, "ipv4") == [("0.0.0.0/1", False), ("10.0.0.0/8", True), ("128.0.0.0/1", False)]
    assert iptables.lpm_entries([], "ipv4") == []


@st.composite
def blocks(draw, version: int):
    bits = 32 if version == 4 else 128
    base = draw(st.integers(0, 2**bits - 1))
    length = draw(st.integers(1 if bits == 32 else 100, bits))
    cidr = ipaddress.ip_network((base >> (bits - length) << (bits - length), length))
    excepts = []
    for _ in range(draw(st.integers(0, 4))):
        sub = draw(st.integers(length, bits))
        offset = draw(st.integers(0, 2 ** (bits - length) - 1)) >> (bits - sub) << (bits - sub)
        excepts.append(ipaddress.ip_network((int(cidr.network_address) + offset, sub)))
    return IPBlock(cidr, tuple(excepts))


@settings(max_examples=300, deadline=None, database=None)
@given(version=st.sampled_from([4, 6]), data=st.data())
def test_lpm_entries_match_exactly_the_networks(version, data):
    family = "ipv4" if version == 4 else "ipv6"
    peers = data.draw(st.lists(blocks(version), min_size=1, max_size=4))
    networks = list(ipaddress.collapse_addresses(n for b in peers for n in b.networks()))
    entries = iptables.lpm_entries([str(n) for n in networks], family)
    assert len(entries) <= len(networks) + 1  # never worse than listing the networks (+1: /0 split)
    probes = {int(n.network_address) + d for n in networks for d in (-1, 0)} | {int(n.broadcast_address) + d for n in networks for d in (0, 1)}
    probes |= {int(e.network_address) for b in peers for e in b.excepts} | {int(b.cidr.network_address) for b in peers}
    top = 2 ** (32 if version == 4 else 128) - 1
    for value in probes:
        if 0 <= value <= top:
            address = str(ipaddress.ip_address(value) if version == 4 else ipaddress.IPv6Address(value))
            assert lpm_contains(entries, address) == any(ipaddress.ip_address(address) in n for n in networks), address


def _check_table(text: str, ipset_text: str) -> None:
    declared = set(re.findall(r"^:(\S+)", text, re.M))
    created = set(re.findall(r"^create (\S+)", ipset_text, re.M))
    for line in text.splitlines():
        if line.startswith("-A"):
            words = line.split()
            target = words[words.index("-j") + 1]
            assert target in STANDARD or target in declared, line
            for name in re.findall(r"--match-set (\S+)", line):
                assert name in created, line
    assert all(len(c) <= 28 for c in declared)
    assert all(len(s) <= 31 for s in created)


def test_example_renders_kube_routers_topology():
    model = build_rule_model(example_cluster(), "node1")
    table = layout.table(model)
    text, sets = iptables.to_restore(table, "ipv4"), iptables.to_ipset(table)
    _check_table(text, sets)
    (api,) = (p for p in model.pod_chains if p.pod.endswith("api-5f6b7c9d4-q8w2n"))  # isolated for ingress only
    (frontend,) = (p for p in model.pod_chains if p.pod.endswith("frontend-7d9c8b6f5-x2k4p"))  # for egress only
    assert (api.direction, frontend.direction) == ("ingress", "egress")
    # Direction: a chain per direction, entered on -d for ingress and -s for egress, with that direction's policy chains.
    assert re.search(rf"-A KUBE-ROUTER-FORWARD -d 10.244.1.11/32 .* -j {api.name}$", text, re.M)
    assert re.search(rf"-A KUBE-ROUTER-INPUT -s 10.244.1.10/32 .* -j {frontend.name}$", text, re.M)
    assert "-s 10.244.1.11/32" not in text and "-d 10.244.1.10/32" not in text
    assert re.search(rf"-A {api.name} .* -j {api.policies[0]}$", text, re.M)
    assert re.search(rf"-A {frontend.name} .* -j {frontend.policies[0]}$", text, re.M)
    assert "-j MARK --set-xmark 0x10000/0x10000" in text and "-j MARK --set-xmark 0x0/0x10000" in text
    assert "-j NFLOG --nflog-group 100" in text and "--reject-with icmp-port-unreachable" in text
    assert "--icmp-type echo-request" not in text and "KUBE-NWPLCY-TAIL" not in text
    assert "hash:ip,port family inet" in sets and "add TMP-KUBE-PORT-TDLZJ4AODB2WVLTO 10.244.1.11,tcp:9090" in sets
    node2 = iptables.to_ipset(layout.table(build_rule_model(example_cluster(), "node2")))
    assert re.search(r"add (\S+) 10\.244\.1\.0/24\nadd \1 10\.244\.1\.10 nomatch\n", node2)


def test_the_deny_action_drop_becomes_one_drop_per_pod_chain_in_both_families():
    """--deny-action drop: each pod chain's two REJECTs become one DROP (the same match), in
    iptables-restore and ip6tables-restore input; reject stays kube-router's default."""
    syn = synthetic.generate(pods=200, policies=30, namespaces=6, dual_stack=True)
    for cluster, node, family in ((example_cluster(), "node1", "ipv4"), (syn.cluster, synthetic.NODE, "ipv6")):
        dropped = layout.table(build_rule_model(cluster, node, Config(deny_action="drop")))
        text = iptables.to_restore(dropped, family)
        _check_table(text, iptables.to_ipset(dropped))
        pod_chains = [c.name for c in dropped.chains if c.name.startswith(("KUBE-POD-IN-", "KUBE-POD-EG-"))
                      and layout.refused_by(c.rules[-2]) and re.search(rf"-j {c.name}$", text, re.M)]
        assert "REJECT" not in text and pod_chains, family
        for name in pod_chains:
            assert len(re.findall(rf"^-A {name} .*-m mark ! --mark 0x10000/0x10000 -j DROP$", text, re.M)) == 1
        rejected = iptables.to_restore(layout.table(build_rule_model(cluster, node)), family)
        assert "--reject-with tcp-reset" in rejected and not re.search(r"^-A KUBE-POD-\S+ .* -j DROP$", rejected, re.M)


def test_ipv6_renders_for_ip6tables_and_inet6_sets():
    syn = synthetic.generate(pods=400, policies=60, namespaces=12, dual_stack=True)
    model = build_rule_model(syn.cluster, synthetic.NODE)
    table = layout.table(model)
    sets = iptables.to_ipset(table)
    v4, v6 = iptables.to_restore(table, "ipv4"), iptables.to_restore(table, "ipv6")
    _check_table(v4, sets)
    _check_table(v6, sets)
    assert "family inet6" in sets and "-p ipv6-icmp" in v6 and "icmp6-port-unreachable" in v6
    assert not re.search(r"-[sd] [0-9a-f:]*:[0-9a-f:]*/128", v4) and re.search(r"-[sd] fd00:\S+/128", v6)
    # the same rule model: every policy chain in both tables, pod chains where the pod has addresses
    assert {c.name for c in model.policy_chains} <= set(re.findall(r"^:(\S+)", v6, re.M))
