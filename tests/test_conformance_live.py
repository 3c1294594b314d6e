"""Every shared conformance case (and our own, tests/conformance/own) through the real control plane, enforced side by side by
``nftpolicy agent`` and by the real kube-router (``sandbox --dataplane both``).

All cases run as one live sequence in one pair of twin sandboxes (two nodes, IPv4): each case is
the complete state at its point, so each is written to the API server as an update of the one
before (policies deleted, labels changed) and both sets of node daemons follow. nftpolicy must
match every expected matrix. kube-router must match them except in the cells listed in
:data:`KUBE_ROUTER_DIFFERENCES`, exactly: each of those is a documented deliberate difference
that ``compare`` explains, and a new difference (or one that went away) fails.
"""

from __future__ import annotations

from contextlib import closing

import pytest

from nftpolicy.agent.testbed.compare import explain
from nftpolicy.agent.testbed.controlplane import ControlPlane
from nftpolicy.agent.testbed.probes import sctp_supported
from nftpolicy.agent.testbed.replay import replay_twins
from nftpolicy.translators.cases import load_case

from .conftest import CONFORMANCE, OWN_CASES

pytestmark = [pytest.mark.kernel, pytest.mark.tools("etcd", "kube-apiserver", "kube-router")]

FILES = sorted(CONFORMANCE.glob("*.yaml")) + sorted(OWN_CASES.glob("*.yaml"))

# (case, "PROTO/port", from, to): the cells where kube-router v2.1.0 gives another verdict than
# the expected matrix (two nodes, IPv4). Every one is explained by compare.explain (docs/migration.md,
# "Deliberate differences"); the upstream cases have none.
KUBE_ROUTER_DIFFERENCES = {
    # one policy with both policyTypes: a rule of one direction allows the other
    ("both-policy-types-one-namespace", "TCP/80", "x/a", "x/c"),
    ("both-policy-types-one-namespace", "TCP/80", "x/c", "x/b"),
    # an except of one ipBlock peer cancels another peer's equal CIDR
    ("ipblock-except-cancels-other-peer", "TCP/80", "y/a", "x/a"),
}


@pytest.fixture(scope="module")
def replayed():
    """{case name: (nftpolicy step, kube-router step)} for every case, in one live sequence."""
    cases = [load_case(path.read_text()) for path in FILES]
    results = {}
    with ControlPlane() as cp, closing(replay_twins(cases, ("node1", "node2"), ("ipv4",), dataplanes=("nft", "kube-router"),
                                                    control_plane=cp)) as steps:
        for _, (ours, theirs), _ in steps:
            results[ours.case.name] = (ours, theirs)
    return results


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_nftpolicy_agent_matches_every_matrix(replayed, path):
    ours, _ = replayed[load_case(path.read_text()).name]
    assert not ours.errors, [str(e) for e in ours.errors]
    assert ours.differences == [], "\n".join(
        f"{ours.case.name} {s.protocol}/{s.port} {fam} {a} -> {b}: expected {'allowed' if w else 'blocked'}"
        for s, fam, a, b, w, _ in ours.differences)
    unprobed = {spec.protocol for spec, _ in ours.not_probed}
    assert unprobed <= ({"SCTP"} if not sctp_supported() else set())


def test_kube_router_differs_only_in_explained_cells(replayed):
    found = set()
    unexplained = []
    for name, (ours, theirs) in replayed.items():
        for spec, family, src, dst, want, got in theirs.differences:
            found.add((name, f"{spec.protocol}/{spec.port}", src, dst))
            if explain(theirs.cluster, spec, src, dst, got, want) is None:
                unexplained.append(f"{name} {spec.protocol}/{spec.port} {src} -> {dst}: expected "
                                   f"{'allowed' if want else 'blocked'}, kube-router {'allowed' if got else 'blocked'}")
    assert unexplained == []
    assert found == KUBE_ROUTER_DIFFERENCES
