"""The nft text and the libnftables JSON are the same ruleset, and a load replaces ours atomically."""

from __future__ import annotations

import dataclasses
import json

import pytest

from nftpolicy.agent.dataplane.nftables import NftDataplane
from nftpolicy.translators import nfttext, transaction
from nftpolicy.translators.noderender import build_rule_model

from .conftest import example_cluster, nft
from .test_transaction import scenarios

pytestmark = pytest.mark.kernel


def _listing(ns: str) -> list:
    """Our table as the kernel holds it, without handles and without set comments (libnftables
    1.0.6 drops comments of sets given as JSON)."""
    objects = json.loads(nft(ns, "-j", "list", "table", "inet", "nftpolicy"))["nftables"]
    out = []
    for obj in objects:
        (kind, body), = obj.items()
        if kind == "metainfo":
            continue
        body = {k: v for k, v in body.items() if k != "handle" and not (kind in ("set", "map") and k == "comment")}
        out.append({kind: body})
    return out


@pytest.mark.parametrize("node", ["node1", "node2", None])
def test_text_and_json_load_the_same_ruleset(make_netns, tmp_path, node):
    model = build_rule_model(example_cluster(), node)
    text_ns, json_ns = make_netns(), make_netns()
    path = tmp_path / "r.nft"
    path.write_text(nfttext.to_text(model))
    nft(text_ns, "-f", str(path))
    NftDataplane(model.config.table, json_ns).run(transaction.full(model))
    assert _listing(text_ns) == _listing(json_ns)
    chains = {next(iter(o.values()))["name"] for o in _listing(text_ns) if "chain" in o}
    assert {c.name for c in model.policy_chains} | {c.name for c in model.pod_chains} <= chains


def test_deltas_as_text_and_json_load_the_same_ruleset(make_netns):
    """A full sync and deltas of random changes (every kind of operation), each printed as nft
    text and as libnftables JSON, leave the same table after each step."""
    text_ns, json_ns = make_netns(), make_netns()
    _, steps = next(scenarios())
    for tx in steps:
        nft(text_ns, "-f", "-", stdin=nfttext.transaction_text(tx))
        NftDataplane(tx.table, json_ns).run(tx)
        assert _listing(text_ns) == _listing(json_ns)


def test_reload_removes_stale_chains_and_sets(make_netns, tmp_path):
    cluster = example_cluster()
    ns = make_netns()
    full = build_rule_model(cluster, "node1")
    nft(ns, "-f", "-", stdin=nfttext.to_text(full))
    without_api = dataclasses.replace(cluster, policies={k: v for k, v in cluster.policies.items() if k != "shop/api-ingress"})
    smaller = build_rule_model(without_api, "node1")
    nft(ns, "-f", "-", stdin=nfttext.to_text(smaller))
    listing = nft(ns, "list", "table", "inet", "nftpolicy")
    gone = set(c.name for c in full.policy_chains) - set(c.name for c in smaller.policy_chains)
    assert gone and not any(name in listing for name in gone)
    assert all(s.name in listing for s in smaller.sets)
    assert not any(s.name in listing for s in full.sets if s not in smaller.sets and "api-ingress" in s.comment)


def test_failed_load_keeps_previous_ruleset(make_netns):
    ns = make_netns()
    model = build_rule_model(example_cluster(), "node1")
    nft(ns, "-f", "-", stdin=nfttext.to_text(model))
    before = nft(ns, "-j", "-a", "list", "ruleset")
    broken = nfttext.to_text(model).replace("KUBE-NWPLCY-DEFAULT {", "KUBE-NWPLCY-DEFAULT {\n\t\tjump NO-SUCH-CHAIN", 1)
    with pytest.raises(AssertionError, match="nft -f - failed"):
        nft(ns, "-f", "-", stdin=broken)
    assert nft(ns, "-j", "-a", "list", "ruleset") == before
