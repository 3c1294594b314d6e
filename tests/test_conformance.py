"""Every upstream conformance case (and each of our own, tests/conformance/own), replayed with
real packets in the sandbox.

Each file from scratch (one node and two nodes, IPv4 and IPv6), and each ``-stepN`` group as a live sequence
of updates in one sandbox. Every TCP and UDP cell must match; the diagonal is ignored (upstream's
ignoreLoopback); SCTP rules must render and load even where the kernel cannot probe SCTP.
"""

from __future__ import annotations

from contextlib import closing

import re
from collections import defaultdict

import pytest

from nftpolicy.agent.testbed.probes import sctp_supported
from nftpolicy.agent.testbed.replay import replay
from nftpolicy.translators.cases import load_case

from .conftest import CONFORMANCE, OWN_CASES

pytestmark = pytest.mark.kernel

FILES = sorted(CONFORMANCE.glob("*.yaml")) + sorted(OWN_CASES.glob("*.yaml"))
GROUPS: dict[str, list] = defaultdict(list)
for _f in FILES:
    if (_m := re.match(r"(.*)-step\d+\.yaml$", _f.name)):
        GROUPS[_m.group(1)].append(_f)
LAYOUTS = {
    "one-node-ipv4": (("node1",), ("ipv4",)),
    "two-nodes-ipv4": (("node1", "node2"), ("ipv4",)),
    "one-node-ipv6": (("node1",), ("ipv6",)),
    "two-nodes-ipv6": (("node1", "node2"), ("ipv6",)),
}


def _check(steps, layout: str) -> None:
    compared = 0
    with closing(replay(steps, *LAYOUTS[layout])) as replayed:  # the sandbox goes even when an assertion fails
        for _, step in replayed:
            assert not step.errors, [str(e) for e in step.errors]
            assert step.differences == [], "\n".join(
                f"{step.case.name} {s.protocol}/{s.port} {fam} {a} -> {b}: expected {'allowed' if w else 'blocked'}"
                for s, fam, a, b, w, _ in step.differences)
            for (spec, _), matrix in step.results.items():
                assert spec.protocol in ("TCP", "UDP") or sctp_supported()
                compared += sum(1 for a, b in matrix if a != b)
            unprobed = {spec.protocol for spec, _ in step.not_probed}
            assert unprobed <= ({"SCTP"} if not sctp_supported() else set())
    assert compared > 0 or all(p.protocol == "SCTP" for s in steps for p in s.probes)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_case_from_scratch(path, layout):
    _check([load_case(path.read_text())], layout)


@pytest.mark.parametrize("layout", ["one-node-ipv4", "two-nodes-ipv4"])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_steps_as_live_sequence(group, layout):
    steps = [load_case(p.read_text()) for p in sorted(GROUPS[group])]
    assert len(steps) >= 2
    _check(steps, layout)
