"""Our ruleset never touches another table: loads, reloads, failures and removal leave every
foreign table byte-for-byte as it was (handles included)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from nftpolicy.agent.dataplane.nftables import NftDataplane, NftError
from nftpolicy.translators import layout, transaction
from nftpolicy.translators import nfttext
from nftpolicy.translators.transaction import ChainRule
from nftpolicy.translators.noderender import build_rule_model

from .conftest import example_cluster, nft

pytestmark = pytest.mark.kernel

FOREIGN = """
table inet foreign {
    set blocked {
        type ipv4_addr; flags interval
        elements = { 192.0.2.0/24, 198.51.100.7 }
    }
    map ports {
        type inet_service : verdict
        elements = { 22 : accept, 23 : drop }
    }
    chain guard {
        type filter hook input priority -5; policy accept;
        ip saddr @blocked counter drop
        tcp dport vmap @ports
    }
    chain marker {
        meta mark set meta mark | 0x4000
    }
    chain from_pods {
        type filter hook forward priority 0; policy accept;
        jump marker
    }
}
table ip nftpolicy {
    chain same-name-other-family {
        type filter hook output priority 0; policy accept;
        counter
    }
}
table ip6 mangle6 {
    chain pre {
        type filter hook prerouting priority -150; policy accept;
        meta mark set 0x8000
    }
}
"""


def _foreign_state(ns: str) -> str:
    listing = json.loads(nft(ns, "-j", "-a", "list", "ruleset"))
    kept = [o for o in listing["nftables"] if "metainfo" not in o and not _ours(o)]
    return json.dumps(kept, sort_keys=True)


def _ours(obj: dict) -> bool:
    body = next(iter(obj.values()))
    family = body.get("family")
    table = body.get("table", body.get("name")) if "table" in obj else body.get("table")
    return family == "inet" and table == "nftpolicy"


def test_foreign_tables_unchanged_by_load_reload_failure_and_removal(make_netns, tmp_path):
    ns = make_netns()
    nft(ns, "-f", "-", stdin=FOREIGN)
    before = _foreign_state(ns)
    cluster = example_cluster()
    model = build_rule_model(cluster, "node1")

    text = tmp_path / "rules.nft"
    text.write_text(nfttext.to_text(model))
    nft(ns, "-f", str(text))                      # first load (text)
    assert _foreign_state(ns) == before
    nft(ns, "-f", str(text))                      # reload (text)
    assert _foreign_state(ns) == before
    NftDataplane("nftpolicy", ns).run(transaction.full(model))  # reload (libnftables JSON)
    assert _foreign_state(ns) == before

    smaller = dataclasses.replace(cluster, policies={k: v for k, v in cluster.policies.items() if "api" not in k})
    dataplane = NftDataplane("nftpolicy", ns)
    dataplane.run(transaction.full(build_rule_model(smaller, "node1")))
    broken = transaction.full(model)
    broken.add(ChainRule("KUBE-NWPLCY-DEFAULT", layout.Rule((layout.Jump("NO-SUCH-CHAIN"),), "")))
    ours_before_failure = nft(ns, "-j", "list", "table", "inet", "nftpolicy")
    with pytest.raises(NftError):
        dataplane.run(broken)
    assert nft(ns, "-j", "list", "table", "inet", "nftpolicy") == ours_before_failure
    assert _foreign_state(ns) == before

    nft(ns, "delete", "table", "inet", "nftpolicy")
    assert _foreign_state(ns) == before
    assert "table inet nftpolicy" not in nft(ns, "list", "tables")
    assert "table ip nftpolicy" in nft(ns, "list", "tables")
