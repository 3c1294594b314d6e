"""IPv6 and dual-stack: every pod address of every family counts, probed over both families."""

from __future__ import annotations

from contextlib import closing

import pytest

from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.agent.testbed.replay import replay
from nftpolicy.agent.testbed.sandbox import Sandbox
from nftpolicy.translators.cases import load_case

from .conftest import CONFORMANCE, cluster_from_yaml

pytestmark = pytest.mark.kernel

# Cases without ipBlock placeholders: their matrices hold for both families at once.
DUAL_STACK_CASES = ["003-allow-from-same-ns-podselector", "006-allow-only-from-other-ns-nsselector",
                    "014-ports", "017-ingress-named-port", "019-egress-named-port", "027-ingress-egress-together",
                    "030-ingress-any-port-by-protocol", "044-udp-ports"]


@pytest.mark.parametrize("name", DUAL_STACK_CASES)
def test_conformance_case_over_both_families(name):
    case = load_case((CONFORMANCE / f"{name}.yaml").read_text())
    with closing(replay([case], ("node1", "node2"), ("ipv4", "ipv6"))) as replayed:  # the sandbox goes even when an assertion fails
        for sandbox, step in replayed:
            assert all(len(p.ips) == 2 for p in sandbox.pods.values())
            assert {family for _, family in step.results} == {"ipv4", "ipv6"}
            assert step.differences == []


IPBLOCK_BY_FAMILY = """
apiVersion: v1
kind: Pod
metadata: {namespace: x, name: client}
spec: {nodeName: node1, containers: [{name: c, ports: [{containerPort: 80}]}]}
status: {podIPs: [{ip: 10.244.0.10}, {ip: "fd00:10:244::10"}]}
---
apiVersion: v1
kind: Pod
metadata: {namespace: x, name: other}
spec: {nodeName: node2, containers: [{name: c, ports: [{containerPort: 80}]}]}
status: {podIPs: [{ip: 10.244.1.10}, {ip: "fd00:10:244:1::10"}]}
---
apiVersion: v1
kind: Pod
metadata: {namespace: x, name: server, labels: {app: server}}
spec: {nodeName: node2, containers: [{name: c, ports: [{containerPort: 80}]}]}
status: {podIPs: [{ip: 10.244.1.11}, {ip: "fd00:10:244:1::11"}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: x, name: v6-from-node1-pods}
spec:
  podSelector: {matchLabels: {app: server}}
  ingress:
  - from: [{ipBlock: {cidr: "fd00:10:244::/64"}}, {ipBlock: {cidr: "10.244.1.0/24", except: ["10.244.1.10/32"]}}]
"""


def test_ipblock_applies_to_its_own_family_only():
    cluster = cluster_from_yaml(IPBLOCK_BY_FAMILY)
    spec = ProbeSpec(80, "TCP")
    with Sandbox(cluster.pods.values()) as sandbox:
        sandbox.apply(cluster)
        result = sandbox.probe([spec])
    v4, v6 = result[(spec, "ipv4")], result[(spec, "ipv6")]
    assert v6[("x/client", "x/server")] is True    # in fd00:10:244::/64
    assert v4[("x/client", "x/server")] is False   # 10.244.0.10 is in no IPv4 block
    assert v4[("x/other", "x/server")] is False    # the except of the IPv4 block
    assert v6[("x/other", "x/server")] is False    # fd00:10:244:1::10 is outside the IPv6 block
    assert v4[("x/server", "x/client")] is True    # egress is not isolated
