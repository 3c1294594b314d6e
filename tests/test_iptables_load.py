"""The iptables variant in the kernel: it loads with iptables-nft and iptables-legacy, reloads
replace it atomically, and its sets live in the namespace that loaded them. Every command runs in
a namespace the test created."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

from nftpolicy.agent.dataplane import iptables
from nftpolicy.translators import iptables as render
from nftpolicy.translators import layout, transaction
from nftpolicy.translators.noderender import build_rule_model

from .conftest import example_cluster

pytestmark = pytest.mark.kernel


def sh(ns: str, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], input=stdin, capture_output=True, text=True)


def test_ipsets_belong_to_one_network_namespace(make_netns):
    a, b = make_netns(), make_netns()
    assert sh(a, "ipset", "create", "KUBE-SRC-ONLYINA", "hash:ip").returncode == 0
    assert "KUBE-SRC-ONLYINA" in iptables.set_list(a)
    assert "KUBE-SRC-ONLYINA" not in iptables.set_list(b)
    assert sh(b, "ipset", "create", "KUBE-SRC-ONLYINA", "hash:net").returncode == 0  # no clash


def test_refuses_a_namespace_that_does_not_exist():
    with pytest.raises(iptables.IptablesError, match="no network namespace"):
        iptables.run("nftp-test-no-such-namespace", ["iptables-save"])


@pytest.mark.parametrize("loader", iptables.LOADERS)
def test_render_output_loads_reloads_and_drops_stale_sets(make_netns, loader):
    ns = make_netns()
    cluster = example_cluster()
    for node in ("node1", "node2"):
        model = build_rule_model(cluster, node)
        iptables.IptablesDataplane(ns, loader).run(transaction.full(model))
        saved = sh(ns, f"iptables-{loader}-save", "-t", "filter").stdout
        for chain in [p.name for p in model.pod_chains] + [c.name for c in model.policy_chains]:
            assert f":{chain} - " in saved
        assert "-A FORWARD -m comment --comment \"nftpolicy: kube-router network policy\" -j KUBE-ROUTER-FORWARD" in saved
        assert sorted(n for n in iptables.set_list(ns) if n.startswith("KUBE-")) == sorted(render.set_names(layout.table(model)))
        assert not [n for n in iptables.set_list(ns) if n.startswith("TMP-")]
        assert sh(ns, f"ip6tables-{loader}-save", "-t", "filter").stdout.count("KUBE-ROUTER-FORWARD") >= 2
    # node2 again after node1: node1's chains and sets are gone (full table replace + destroy).
    empty = build_rule_model(dataclasses.replace(cluster, policies={}), "node1")
    iptables.IptablesDataplane(ns, loader).run(transaction.full(empty))
    assert "KUBE-POD-" not in sh(ns, f"iptables-{loader}-save", "-t", "filter").stdout
    assert [n for n in iptables.set_list(ns) if n.startswith("KUBE-")] == []


@pytest.mark.parametrize("loader", iptables.LOADERS)
def test_a_failed_load_keeps_the_previous_rules(make_netns, loader):
    ns = make_netns()
    model = build_rule_model(example_cluster(), "node1")
    iptables.IptablesDataplane(ns, loader).run(transaction.full(model))
    before = sh(ns, f"iptables-{loader}-save", "-t", "filter").stdout
    broken = render.to_restore(layout.table(model), "ipv4").replace("COMMIT", "-A KUBE-ROUTER-INPUT -j NO-SUCH-CHAIN\nCOMMIT")
    with pytest.raises(iptables.IptablesError):
        iptables.IptablesDataplane(ns, loader).load(iptables.IptablesBatch("", {"ipv4": broken}, frozenset()))
    after = sh(ns, f"iptables-{loader}-save", "-t", "filter").stdout
    strip = lambda text: [l for l in text.splitlines() if not l.startswith("#")]  # noqa: E731
    assert strip(after) == strip(before)


def test_cli_render_formats_load(make_netns, tmp_path):
    import sys
    from pathlib import Path

    from .conftest import REPO
    tool = str(Path(sys.executable).parent / "nftpolicy")
    ns = make_netns()
    outputs = {}
    for fmt in ("ipset", "iptables", "ip6tables"):
        out = subprocess.run([tool, "render", "--node", "node1", "--format", fmt, str(REPO / "examples" / "shop")],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        outputs[fmt] = out.stdout
    for command, fmt in (("ipset restore", "ipset"), ("iptables-legacy-restore", "iptables"), ("ip6tables-nft-restore", "ip6tables")):
        result = sh(ns, *command.split(), stdin=outputs[fmt])
        assert result.returncode == 0, (command, result.stderr)
    assert outputs["ipset"].count("swap ") == len(render.set_names(layout.table(build_rule_model(example_cluster(), "node1"))))


@pytest.mark.parametrize("loader", iptables.LOADERS)
def test_the_dataplane_says_whether_its_chains_are_there_and_removes_them(make_netns, loader):
    ns = make_netns()
    dataplane = iptables.IptablesDataplane(ns, loader)
    assert not dataplane.has_table() and dataplane.missing_features() == []
    dataplane.run(transaction.full(build_rule_model(example_cluster(), "node1")))
    assert dataplane.has_table()
    sh(ns, "ipset", "create", "KUBE-SRC-NOT-OURS", "hash:ip")  # kube-router's name: never ours to remove
    assert dataplane.remove()
    assert not dataplane.has_table()
    assert "KUBE-ROUTER" not in sh(ns, f"iptables-{loader}-save", "-t", "filter").stdout
    assert iptables.set_list(ns) == ["KUBE-SRC-NOT-OURS"]
    assert not dataplane.remove()
