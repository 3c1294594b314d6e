"""Conformance cases evaluated with the tier evaluator (no kernel): a case's cluster at fixed
addresses, and the matrix :mod:`nftpolicy.translators.tiers` gives for one of its probes."""

from __future__ import annotations

from nftpolicy.translators.cases import Case, CaseProbe, Matrix, case_manifests
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.model import Cluster
from nftpolicy.translators.tiers import connection_allowed


def case_cluster(case: Case) -> Cluster:
    """The case's objects with pod i at 10.0.<i // 250>.<i % 250 + 1> (all inside one /4, as the
    format's ``largeCIDR`` placeholder assumes); every object must be valid."""
    ips = {p.key: [f"10.0.{i // 250}.{i % 250 + 1}"] for i, p in enumerate(case.pods)}
    cluster, errors = build_cluster(("case", o) for o in case_manifests(case, ips))
    assert not errors, [str(e) for e in errors]
    return cluster


def evaluated_matrix(cluster: Cluster, case: Case, probe: CaseProbe) -> Matrix:
    """Every (from, to) cell of ``probe`` as the tier evaluator decides it."""
    pods = [cluster.pods[p.key] for p in case.pods]
    return {(a.key, b.key): connection_allowed(cluster, a, b, probe.protocol, probe.port) for a in pods for b in pods}
