"""Direction: with both policy types, an ingress rule only allows as ingress of the destination
pod and an egress rule only as egress of the source pod (NetworkPolicy API reference; DESIGN.md
section 3). kube-router jumps such policies without a direction check, so one selected pod's
egress rule can satisfy another selected pod's ingress; these cases would pass there."""

from __future__ import annotations

import pytest

from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.agent.testbed.sandbox import Sandbox

from .conftest import cluster_from_yaml

pytestmark = pytest.mark.kernel

PODS = """
apiVersion: v1
kind: Namespace
metadata: {name: x}
---
""" + "\n---\n".join(
    f"""apiVersion: v1
kind: Pod
metadata: {{namespace: x, name: {name}, labels: {{pod: {name}, role: {role}}}}}
spec: {{containers: [{{name: c, ports: [{{containerPort: 80}}]}}]}}""" for name, role in (("a", "selected"), ("b", "selected"), ("c", "other")))

# a -> b: b's ingress allows a, but a's egress only allows c. kube-router's shared chain lets the
# ingress rule (from a, to the selected pods) mark a's egress as allowed.
INGRESS_MUST_NOT_ALLOW_EGRESS = PODS + """
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: x, name: both}
spec:
  podSelector: {matchLabels: {role: selected}}
  policyTypes: [Ingress, Egress]
  ingress: [{from: [{podSelector: {matchLabels: {pod: a}}}]}]
  egress: [{to: [{podSelector: {matchLabels: {pod: c}}}]}]
"""

# a -> b: a's egress allows b, but b's ingress only allows c. kube-router's shared chain lets the
# egress rule (from the selected pods, to b) mark b's ingress as allowed.
EGRESS_MUST_NOT_ALLOW_INGRESS = PODS + """
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: x, name: both}
spec:
  podSelector: {matchLabels: {role: selected}}
  policyTypes: [Ingress, Egress]
  ingress: [{from: [{podSelector: {matchLabels: {pod: c}}}]}]
  egress: [{to: [{podSelector: {matchLabels: {pod: b}}}]}]
"""

# (from, to) -> connected, by the API: a selected pod needs its own egress rule and the
# destination's ingress rule.
EXPECTED = {
    "ingress-must-not-allow-egress": (INGRESS_MUST_NOT_ALLOW_EGRESS, {
        ("x/a", "x/b"): False,  # a's egress allows only c
        ("x/b", "x/a"): False,  # b's egress allows only c
        ("x/a", "x/c"): True,
        ("x/c", "x/a"): False,  # a's ingress allows only a
        ("x/c", "x/b"): False,
    }),
    "egress-must-not-allow-ingress": (EGRESS_MUST_NOT_ALLOW_INGRESS, {
        ("x/a", "x/b"): False,  # b's ingress allows only c
        ("x/b", "x/b"): True,
        ("x/c", "x/b"): True,
        ("x/c", "x/a"): True,
        ("x/a", "x/c"): False,  # a's egress allows only b
    }),
}


@pytest.mark.parametrize("nodes", [("node1",), ("node1", "node2", "node3")], ids=["same-node", "one-pod-per-node"])
@pytest.mark.parametrize("case", EXPECTED)
def test_one_direction_never_allows_the_other(case, nodes):
    manifests, expected = EXPECTED[case]
    cluster = cluster_from_yaml(manifests)
    with Sandbox(cluster.pods.values(), nodes) as sandbox:
        sandbox.apply(cluster)
        matrix = sandbox.probe([ProbeSpec(80, "TCP")], ["ipv4"])[(ProbeSpec(80, "TCP"), "ipv4")]
    assert {cell: matrix[cell] for cell in expected} == expected
