"""The iptables variant against the same conformance cases as the nft ruleset, cell by cell.

Every upstream case (and every ``-stepN`` group as a live sequence of reloads) is replayed on twin
sandboxes with the same pods and addresses: the nft ruleset, and the iptables variant of the same
rule model loaded with ``iptables-nft-restore`` and with ``iptables-legacy-restore``. Each must
match the expected matrices, and the dataplanes must agree on every probed cell, diagonal
included. To keep the suite fast this runs on one layout (two nodes, IPv4: same-node and
cross-node pairs); IPv6 (``ip6tables-restore``, ipset ``family inet6``) runs every case once with
the nft loader.
"""

from __future__ import annotations

from contextlib import closing

import pytest

from nftpolicy.agent.testbed.replay import replay_twins
from nftpolicy.translators.cases import load_case

from .test_conformance import FILES, GROUPS

pytestmark = pytest.mark.kernel

TWO_NODES = ("node1", "node2")


def _check(paths, families, dataplanes) -> None:
    steps = [load_case(p.read_text()) for p in paths]
    probed = 0
    with closing(replay_twins(steps, TWO_NODES, families, dataplanes=dataplanes)) as replayed:  # the sandbox goes even when an assertion fails
        for _, results, disagreements in replayed:
            for dataplane, step in zip(dataplanes, results):
                assert not step.errors, [str(e) for e in step.errors]
                assert step.differences == [], f"{dataplane}: " + "\n".join(
                    f"{step.case.name} {s.protocol}/{s.port} {fam} {a} -> {b}: expected {'allowed' if w else 'blocked'}"
                    for s, fam, a, b, w, _ in step.differences)
            for dataplane, cells in zip(dataplanes[1:], disagreements):
                assert cells == [], f"{dataplane} disagrees with {dataplanes[0]}: " + "\n".join(
                    f"{s.protocol}/{s.port} {fam} {a} -> {b}: {x} vs {y}" for s, fam, a, b, x, y in cells)
            probed += sum(len(m) for m in results[0].results.values())
    assert probed > 0 or all(p.protocol == "SCTP" for s in steps for p in s.probes)


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_case_agrees_with_nft_under_both_loaders(path):
    _check([path], ("ipv4",), ("nft", "iptables-nft", "iptables-legacy"))


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_steps_reload_and_agree(group):
    _check(sorted(GROUPS[group]), ("ipv4",), ("nft", "iptables-nft", "iptables-legacy"))


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_case_ipv6_agrees_with_nft(path):
    _check([path], ("ipv6",), ("nft", "iptables-nft"))
