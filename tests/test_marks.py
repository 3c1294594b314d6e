"""The seed's check (kube-router "mask mark reset"), automated with real packets.

A table of another system marks packets at an earlier priority; our chains must let allowed
traffic through with that mark intact and our own 0x10000 bit cleared, counted by counters in a
chain at a later priority, exactly as the seed PR did with iptables counters.
"""

from __future__ import annotations

import json

import pytest

from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.agent.testbed.sandbox import Sandbox

from .conftest import cluster_from_yaml, nft

pytestmark = pytest.mark.kernel

CLUSTER = """
apiVersion: v1
kind: Pod
metadata: {namespace: x, name: client, labels: {app: client}}
spec: {nodeName: node1, containers: [{name: c, ports: [{containerPort: 80}, {containerPort: 81}]}]}
---
apiVersion: v1
kind: Pod
metadata: {namespace: x, name: server, labels: {app: server}}
spec: {nodeName: node1, containers: [{name: c, ports: [{containerPort: 80}, {containerPort: 81}]}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: x, name: allow-client-80}
spec:
  podSelector: {matchLabels: {app: server}}
  ingress: [{from: [{podSelector: {matchLabels: {app: client}}}], ports: [{port: 80}]}]
"""


def _other_system(server_ip: str, mark: int) -> str:
    """Another system's table: marks every packet to the server before us (priority -10) and
    counts what arrives after us (priority 10), like the seed's TEST_MARK_POLICY chain."""
    return f"""
table inet othersys {{
    chain before {{
        type filter hook forward priority -10; policy accept;
        ip daddr {server_ip} tcp dport {{ 80, 81 }} meta mark set meta mark | {mark:#x}
    }}
    chain after {{
        type filter hook forward priority 10; policy accept;
        ip daddr {server_ip} tcp dport 80 counter comment "all"
        ip daddr {server_ip} tcp dport 80 meta mark & {mark:#x} == {mark:#x} counter comment "foreign mark kept"
        ip daddr {server_ip} tcp dport 80 meta mark & 0x10000 == 0x10000 counter comment "policy mark left set"
        ip daddr {server_ip} tcp dport 80 meta mark & 0x20000 == 0x20000 counter comment "passed mark set"
        ip daddr {server_ip} tcp dport 80 meta mark & 0x40000 == 0x40000 counter comment "pass mark left set"
    }}
}}
"""


def _counters(ns: str) -> dict[str, int]:
    listing = json.loads(nft(ns, "-j", "list", "chain", "inet", "othersys", "after"))
    counters = {}
    for item in listing["nftables"]:
        rule = item.get("rule")
        if rule:
            packets = next(e["counter"]["packets"] for e in rule["expr"] if "counter" in e)
            counters[rule["comment"]] = packets
    return counters


@pytest.mark.parametrize("foreign_mark", [0x2000, 0xFFFCFFFF], ids=["hostport-0x2000", "every-other-bit"])
def test_foreign_mark_survives_and_policy_mark_is_cleared(foreign_mark):
    cluster = cluster_from_yaml(CLUSTER)
    with Sandbox(cluster.pods.values()) as sandbox:
        sandbox.apply(cluster)
        node = sandbox.nodes["node1"].netns
        server_ip = sandbox.pods["x/server"].ips[0]
        nft(node, "-f", "-", stdin=_other_system(server_ip, foreign_mark))
        result = sandbox.probe([ProbeSpec(80, "TCP"), ProbeSpec(81, "TCP")], ["ipv4"])
        assert result[(ProbeSpec(80, "TCP"), "ipv4")][("x/client", "x/server")] is True
        assert result[(ProbeSpec(81, "TCP"), "ipv4")][("x/client", "x/server")] is False
        counters = _counters(node)
    assert counters["all"] >= 1, counters  # the allowed SYN went through the forward hook
    assert counters["foreign mark kept"] == counters["all"], counters
    assert counters["policy mark left set"] == 0, counters
    assert counters["passed mark set"] >= 1, counters


def test_policy_mark_set_by_someone_else_does_not_allow():
    """A packet that arrives carrying our 0x10000 bit is still judged by the policies."""
    cluster = cluster_from_yaml(CLUSTER)
    with Sandbox(cluster.pods.values()) as sandbox:
        sandbox.apply(cluster)
        node = sandbox.nodes["node1"].netns
        nft(node, "-f", "-", stdin=_other_system(sandbox.pods["x/server"].ips[0], 0x10000))
        result = sandbox.probe([ProbeSpec(81, "TCP")], ["ipv4"])
    assert result[(ProbeSpec(81, "TCP"), "ipv4")][("x/client", "x/server")] is False


CLUSTER_POLICY = """
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: pass-80-deny-rest}
spec:
  tier: Admin
  priority: 1
  subject: {pods: {podSelector: {matchLabels: {app: server}}}}
  ingress:
  - {action: Pass, from: [{pods: {podSelector: {matchLabels: {app: client}}}}], protocols: [{tcp: {destinationPort: {number: 80}}}]}
  - {action: Deny, from: [{namespaces: {}}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: x, name: allow-client-81}
spec:
  podSelector: {matchLabels: {app: server}}
  ingress: [{from: [{podSelector: {matchLabels: {app: client}}}], ports: [{port: 81}]}]
"""


@pytest.mark.parametrize("foreign_mark", [0x2000, 0xFFF8FFFF, 0x40000], ids=["hostport-0x2000", "every-other-bit", "our-pass-bit"])
def test_the_pass_mark_stays_inside_the_pod_chain(foreign_mark):
    """With a ClusterNetworkPolicy Pass rule (mark 0x40000) on the path: foreign bits (all but
    0x10000, 0x20000, 0x40000) survive, the pass and policy marks leave cleared, and a pass bit
    set by someone else skips no Admin rule (TCP 81 stays denied, though a NetworkPolicy allows it)."""
    cluster = cluster_from_yaml(CLUSTER + CLUSTER_POLICY)
    assert cluster.cluster_policies
    with Sandbox(cluster.pods.values()) as sandbox:
        sandbox.apply(cluster)
        node = sandbox.nodes["node1"].netns
        nft(node, "-f", "-", stdin=_other_system(sandbox.pods["x/server"].ips[0], foreign_mark))
        result = sandbox.probe([ProbeSpec(80, "TCP"), ProbeSpec(81, "TCP")], ["ipv4"])
        assert result[(ProbeSpec(80, "TCP"), "ipv4")][("x/client", "x/server")] is True
        assert result[(ProbeSpec(81, "TCP"), "ipv4")][("x/client", "x/server")] is False
        counters = _counters(node)
    walked = counters["passed mark set"]  # the packets that walked the pod chain (the SYN): later ones are established
    assert walked >= 1, counters
    if foreign_mark == 0x40000:  # our bit: cleared in the pod chain, untouched on established packets
        assert counters["foreign mark kept"] == counters["pass mark left set"] == counters["all"] - walked, counters
    else:
        assert counters["foreign mark kept"] == counters["all"] and counters["pass mark left set"] == 0, counters
    assert counters["policy mark left set"] == 0, counters
