"""The ClusterNetworkPolicy conformance cases (tests/conformance/cnp-upstream, from
network-policy-api v0.2.0's suite by tools/cnp_conformance_cases.py, and tests/conformance/cnp-own)
agree with upstream's assertions and with the tier evaluator. Pure: no kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
from nftpolicy.translators.cases import load_case

from .tiers import evaluated_matrix

ROOT = Path(__file__).parent / "conformance"
UPSTREAM = sorted((ROOT / "cnp-upstream").glob("*.yaml"))
OWN = sorted((ROOT / "cnp-own").glob("*.yaml"))


def test_every_translatable_upstream_scenario_is_a_case():
    # 92 t.Run sub-tests in v0.2.0's conformance/tests, less the 5 of the two node-peer tests
    assert len(UPSTREAM) == 87
    assert sum(len(p.upstream) for path in UPSTREAM for p in load_case(path.read_text()).probes) == 280


@pytest.mark.parametrize("path", UPSTREAM + OWN, ids=[p.stem for p in UPSTREAM + OWN])
def test_expected_matrices_agree_with_upstream_and_the_tier_evaluator(path):
    case = load_case(path.read_text())
    assert case.cluster_policies and case.probes
    for probe in case.probes:
        assert {cell: probe.expected[cell] for cell in probe.upstream} == probe.upstream
        evaluated = evaluated_matrix(case, probe)
        assert {c: v for c, v in probe.expected.items() if c[0] != c[1]} == {c: v for c, v in evaluated.items() if c[0] != c[1]}
