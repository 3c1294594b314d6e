"""What the agent asks the kernel at start, before its first sync, with the real libnftables in
a namespace this test made: the feature probe (one dry-run batch; each probe alone only when
the kernel refuses it) and the learned DNS elements (read from the ``flags timeout`` sets only)."""

from __future__ import annotations

import pytest

from nftpolicy.agent.dataplane import nftables as nftables_dataplane
from nftpolicy.agent.dataplane.nftables import FEATURE_TABLE, NftDataplane

from .conftest import nft

pytestmark = pytest.mark.kernel

TABLE = """table inet kube-router {
    set KUBE-SRC-pods { type ipv4_addr; elements = { 10.0.0.1, 10.0.0.2 }; }
    set KUBE-DNS-A { type ipv4_addr; flags timeout; elements = { 192.0.2.7 timeout 60s }; }
    set KUBE-DNS-B { type ipv4_addr; flags timeout; }
}
"""


def test_every_feature_passes_in_one_dry_run_that_leaves_nothing(make_netns):
    ns = make_netns()
    assert NftDataplane("kube-router", ns).missing_features() == []
    assert nft(ns, "list", "ruleset").strip() == ""  # a dry run: not even the scratch table


def test_a_refused_probe_is_named_alone(make_netns, monkeypatch):
    refused = "no such expression (a stand-in for a missing kernel module)"
    probes = {**nftables_dataplane.FEATURE_PROBES, refused: "add chain inet {t} probe_x\nadd rule inet {t} probe_x nosuchexpr"}
    monkeypatch.setattr(nftables_dataplane, "FEATURE_PROBES", probes)
    ns = make_netns()
    [missing] = NftDataplane("kube-router", ns).missing_features()
    assert missing.startswith(f"{refused}: ") and "syntax error" in missing
    assert FEATURE_TABLE not in nft(ns, "list", "ruleset")


def test_timed_elements_come_from_the_timeout_sets_only(make_netns):
    ns = make_netns()
    dataplane = NftDataplane("kube-router", ns)
    assert dataplane.timed_elements() == {}  # no table yet
    nft(ns, "-f", "-", stdin=TABLE)
    found = dataplane.timed_elements()
    assert set(found) == {"KUBE-DNS-A", "KUBE-DNS-B"} and found["KUBE-DNS-B"] == []
    [element] = found["KUBE-DNS-A"]
    assert element.address == "192.0.2.7" and 50 <= element.timeout <= 60


def test_another_tables_timeout_sets_are_not_read(make_netns, monkeypatch):
    """libnftables lists the sets of every inet table for ``list sets`` (the table it is given
    or not): only ours are read, one ``list set`` each."""
    ns = make_netns()
    nft(ns, "-f", "-", stdin=TABLE + """table inet other {
    set KUBE-DNS-X { type ipv4_addr; flags timeout; elements = { 198.51.100.1 timeout 60s }; }
    set KUBE-DNS-A { type ipv4_addr; flags timeout; elements = { 198.51.100.9 timeout 60s }; }
}
""")
    dataplane = NftDataplane("kube-router", ns)
    batches = []
    run = dataplane._cmd
    monkeypatch.setattr(dataplane, "_cmd", lambda batch, **kwargs: batches.append(batch) or run(batch, **kwargs))
    found = dataplane.timed_elements()
    assert {name: [e.address for e in elements] for name, elements in found.items()} == {"KUBE-DNS-A": ["192.0.2.7"], "KUBE-DNS-B": []}
    read = [b["nftables"][0]["list"]["set"]["name"] for b in batches if "set" in b["nftables"][0]["list"]]
    assert sorted(read) == ["KUBE-DNS-A", "KUBE-DNS-B"]
