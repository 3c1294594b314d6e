"""Golden output for the shop example: names and text are stable across runs and input order.

Regenerate after an intended change with
``nftpolicy render --node node1 examples/shop > tests/golden/shop-node1.nft`` (and ``--format json``).
"""

from __future__ import annotations

import random

import pytest
import yaml

from nftpolicy.translators import nft, nfttext
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.noderender import build_rule_model

from .conftest import REPO

GOLDEN = REPO / "tests" / "golden"
EXAMPLE = REPO / "examples" / "shop" / "cluster.yaml"


def _objects(seed: int | None):
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    if seed is not None:
        random.Random(seed).shuffle(docs)
    return [("example", d) for d in docs]


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_text_matches_golden_in_any_input_order(seed):
    cluster, errors = build_cluster(_objects(seed))
    assert not errors
    assert nfttext.to_text(build_rule_model(cluster, "node1")) == (GOLDEN / "shop-node1.nft").read_text()


def test_json_matches_golden():
    cluster, _ = build_cluster(_objects(None))
    assert nft.to_json(build_rule_model(cluster, "node1")) + "\n" == (GOLDEN / "shop-node1.json").read_text()


def test_golden_names_follow_the_hashing_rule():
    text = (GOLDEN / "shop-node1.nft").read_text()
    from nftpolicy.translators.rules import hashed_name
    assert hashed_name("KUBE-NWPLCY-", "shop", "api-ingress", "ingress") in text
    assert hashed_name("KUBE-POD-IN-", "shop", "api-5f6b7c9d4-q8w2n") in text
    assert "meta mark set meta mark & 0xfffeffff" in text and "meta mark set 0x" not in text
