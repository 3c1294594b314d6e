"""Every ClusterNetworkPolicy case (tests/conformance/cnp-upstream: network-policy-api v0.2.0's
suite; tests/conformance/cnp-own) replayed with real TCP/UDP packets in the sandbox.

Each file from scratch (two nodes over IPv4, one node over IPv6), each ``-stepN`` group as a
live sequence of updates in one sandbox (the order upstream patches its policies in), and every
case through a real kube-apiserver and ``nftpolicy agent`` on two nodes.
The checks are test_conformance.py's: every TCP and UDP cell matches, the diagonal is ignored,
SCTP rules render and load where the kernel cannot probe SCTP.
"""

from __future__ import annotations

import re
from collections import defaultdict
from contextlib import closing
from pathlib import Path

import pytest

from nftpolicy.agent.testbed.compare import explain
from nftpolicy.agent.testbed.controlplane import ControlPlane
from nftpolicy.agent.testbed.replay import replay, replay_twins
from nftpolicy.translators.cases import load_case

from .conftest import clear_api
from .test_conformance import _check

pytestmark = pytest.mark.kernel

ROOT = Path(__file__).parent / "conformance"
FILES = sorted((ROOT / "cnp-upstream").glob("*.yaml")) + sorted((ROOT / "cnp-own").glob("*.yaml"))
GROUPS: dict[str, list[Path]] = defaultdict(list)
for _f in FILES:
    if (_m := re.match(r"(.*)-step\d+\.yaml$", _f.name)):
        GROUPS[_m.group(1)].append(_f)


@pytest.mark.parametrize("layout", ["two-nodes-ipv4", "one-node-ipv6"])
@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_case_from_scratch(path, layout):
    _check([load_case(path.read_text())], layout)


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_steps_as_live_sequence(group):
    steps = [load_case(p.read_text()) for p in sorted(GROUPS[group])]
    assert len(steps) >= 2
    _check(steps, "two-nodes-ipv4")


@pytest.fixture(scope="module")
def through_agents():
    """{case name: step} for every ClusterNetworkPolicy case, written to a real kube-apiserver
    (with the v0.2.0 CRD and its validation) and enforced by ``nftpolicy agent`` on two nodes:
    the upstream cases as one live sequence (they share their pods), our own as another."""
    results = {}
    with ControlPlane() as cp:
        for folder in ("cnp-upstream", "cnp-own"):
            cases = [load_case(p.read_text()) for p in sorted((ROOT / folder).glob("*.yaml"))]
            with closing(replay(cases, ("node1", "node2"), ("ipv4",), control_plane=cp)) as steps:
                results.update((step.case.name, step) for _, step in steps)
            clear_api(cp)
    return results


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
@pytest.mark.tools("etcd", "kube-apiserver")
def test_through_the_agent(through_agents, path):
    step = through_agents[load_case(path.read_text()).name]
    assert not step.errors, [str(e) for e in step.errors]
    assert step.differences == [], "\n".join(
        f"{step.case.name} {s.protocol}/{s.port} {fam} {a} -> {b}: expected {'allowed' if w else 'blocked'}"
        for s, fam, a, b, w, _ in step.differences)


@pytest.mark.tools("etcd", "kube-apiserver", "kube-router")
def test_beside_the_real_kube_router_every_difference_is_a_cluster_policy():
    """kube-router has no ClusterNetworkPolicy: beside it (one API server, twin sandboxes), the
    cells where it differs from nftpolicy are exactly those a ClusterNetworkPolicy decides, each
    explained by compare's note."""
    cases = [load_case(p.read_text()) for p in sorted((ROOT / "cnp-own").glob("*.yaml"))]
    seen = 0
    with ControlPlane() as cp, closing(replay_twins(cases, ("node1", "node2"), ("ipv4",), dataplanes=("nft", "kube-router"),
                                                    control_plane=cp)) as steps:
        for _, (ours, theirs), (disagreeing,) in steps:
            assert ours.differences == [], ours.case.name
            for spec, _, src, dst, nft_verdict, kube_router in disagreeing:
                note = explain(ours.cluster, spec, src, dst, kube_router, nft_verdict)
                assert note is not None and note.startswith("deliberate: kube-router has no ClusterNetworkPolicy"), (ours.case.name, src, dst)
                seen += 1
    assert seen > 0
