"""Every ClusterNetworkPolicy case (tests/conformance/cnp-upstream: network-policy-api v0.2.0's
suite; tests/conformance/cnp-own) replayed with real TCP/UDP packets in the sandbox.

Each file from scratch (two nodes over IPv4, one node over IPv6), and each ``-stepN`` group
as a live sequence of updates in one sandbox (the order upstream patches its policies in).
The checks are test_conformance.py's: every TCP and UDP cell matches, the diagonal is ignored,
SCTP rules render and load where the kernel cannot probe SCTP.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

from nftpolicy.translators.cases import load_case

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
