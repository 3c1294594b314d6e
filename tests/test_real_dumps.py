"""``compare`` on real kube-router v2.1.0 dumps (``tests/fixtures/kube-router-v2.1.0``).

Each fixture is a cluster (``cluster.yaml``) and the ``iptables-save`` / ``ipset save`` of its
node1, saved from the real kube-router v2.1.0 running against a real kube-apiserver holding that
cluster (``tools/kube_router_dumps.py``; each fixture's README.md gives the command and the
versions). Every dump must be read completely (nothing left out) and ``compare`` must report
exactly the expected cells, each explained by its documented deliberate difference (docs/migration.md,
"Deliberate differences"); ICMP echo is probed everywhere, since v2.1.0 has no ICMP rule of its own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nftpolicy.agent.testbed.compare import BOTH_TYPES_NOTE, IPBLOCK_NOTE, NAMED_PORT_NOTE, compare, format_report
from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.translators.kuberouter import CHAIN, select

from .conftest import REPO, cluster_from_yaml

pytestmark = pytest.mark.kernel

FIXTURES = REPO / "tests" / "fixtures" / "kube-router-v2.1.0"
NFTPOLICY = str(Path(sys.executable).parent / "nftpolicy")
TCP80, ECHO = ProbeSpec(80, "TCP"), ProbeSpec(0, "ICMP")
BOTH = BOTH_TYPES_NOTE.format("x/both")
DNS = NAMED_PORT_NOTE.format("np/client-egress")

# fixture -> {(spec, family, from, to, kube-router's verdict, nftpolicy's verdict, note)}
EXPECTED = {
    "shop": set(),
    "both-types-ingress-allows-egress": {
        (ECHO, "ipv4", "x/a", "x/b", True, False, BOTH),
        (TCP80, "ipv4", "x/a", "x/b", True, False, BOTH),
    },
    "both-types-egress-allows-ingress": {
        (ECHO, "ipv4", "x/a", "x/b", True, False, BOTH),
        (TCP80, "ipv4", "x/a", "x/b", True, False, BOTH),
    },
    "ipblock-except-overlap": {
        (ECHO, "ipv4", "x/a", "x/c", False, True, IPBLOCK_NOTE.format("x/blocks")),
        (TCP80, "ipv4", "x/a", "x/c", False, True, IPBLOCK_NOTE.format("x/blocks")),
    },
    "named-ports-and-ranges": {
        (ProbeSpec(53, "UDP"), "ipv4", "np/client", "other/dns", False, True, DNS),
        (ProbeSpec(5353, "UDP"), "ipv4", "np/client", "np/batch", True, False, DNS),
        (ProbeSpec(5353, "UDP"), "ipv4", "np/client", "np/web-2", True, False, DNS),
        (ProbeSpec(5353, "UDP"), "ipv4", "np/client", "other/dns", True, False, DNS),
        (ProbeSpec(5353, "UDP"), "ipv4", "np/client", "other/mdns", True, False, DNS),
    },
    "namespace-selectors": set(),
}


def fixture_dump(name: str):
    base = FIXTURES / name
    return select({"ipv4": (base / "node1.iptables-save").read_text()}, (base / "node1.ipset-save").read_text())


def fixture_cluster(name: str):
    return cluster_from_yaml((FIXTURES / name / "cluster.yaml").read_text())


def test_every_fixture_is_expected():
    assert sorted(p.name for p in FIXTURES.iterdir()) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_real_dump_is_read_completely(name):
    """Everything in a v2.1.0 dump is kube-router's network policy: nothing is left out, every set
    a rule names is in the ipset save and every set there is used; no ICMP echo rule."""
    dump = fixture_dump(name)
    assert dump.left_out == [] and dump.loader == "nft" and not dump.accepts_icmp_echo
    chains, rules = dump.kept["ipv4"]
    assert all(CHAIN.match(c) for c in chains) and "KUBE-NWPLCY-DEFAULT" in chains
    assert {s for r in rules for s in r.sets} == set(dump.sets)
    assert all(r.target not in ("KUBE-NWPLCY-COMMON", "KUBE-NWPLCY-TAIL") for r in rules)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_compare_finds_exactly_the_documented_differences(name):
    report = compare(fixture_cluster(name), "node1", fixture_dump(name), icmp=True)
    found = {(d.spec, d.family, d.src, d.dst, d.kube_router, d.nftpolicy, d.note) for d in report.differences}
    assert found == EXPECTED[name], format_report(report)
    assert len(report.differences) == len(found)
    assert report.left_out == [] and report.not_built == []


@pytest.mark.parametrize("loader", ["nft", "legacy"])
def test_the_shop_dump_under_both_loaders(loader):
    """The real dump (saved from iptables-nft) also loads with iptables-legacy-restore and gives
    the same verdicts: every cell of the shop example, ICMP included, equals nftpolicy's."""
    report = compare(fixture_cluster("shop"), "node1", fixture_dump("shop"), loader=loader, icmp=True)
    assert report.differences == [], format_report(report)
    assert report.loader == loader and report.rules_kept == 72
    assert report.cells == 10 * (6 * 5 - 3 * 2)


def test_cli_compare_on_real_dumps():
    base = FIXTURES / "named-ports-and-ranges"
    args = [NFTPOLICY, "compare", "--node", "node1", "--iptables-save", str(base / "node1.iptables-save"),
            "--ipset-save", str(base / "node1.ipset-save"), str(base / "cluster.yaml")]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr  # every difference is a documented one (exit 1: one that is not)
    assert (f"DIFF UDP/5353 ipv4 np/client -> other/mdns: kube-router allowed, nftpolicy blocked; "
            f"policies: np/client-egress (egress of np/client) [{DNS}]") in out.stdout
    assert out.stdout.rstrip().endswith("5 cells differ (5 by a documented deliberate difference)")
    shop = FIXTURES / "shop"
    same = subprocess.run([NFTPOLICY, "compare", "--node", "node1", "--icmp", "--iptables-save", str(shop / "node1.iptables-save"),
                           "--ipset-save", str(shop / "node1.ipset-save"), str(shop / "cluster.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert same.returncode == 0 and "no difference" in same.stdout, same.stdout + same.stderr
