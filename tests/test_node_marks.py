"""The node's own connections to its pods leave our chains with our policy bit cleared, on every
dataplane, with real packets (the check of ``tests/test_marks.py``, for the OUTPUT hook).

The pod chain accepts the node's traffic (``fib saddr type local`` / ``-m addrtype --src-type
LOCAL``) after the policy jumps, for unmarked packets only. In nft a packet a policy (or
``KUBE-NWPLCY-DEFAULT``) allowed has left through "allowed" before it (bit cleared, passed set);
the iptables variant leaves the "allowed" returns out, so there such a packet must go past the
accept to the tail, which clears the bit, instead of taking the accept with 0x10000 still set.
"""

from __future__ import annotations

import json

import pytest

from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.agent.testbed.sandbox import Sandbox

from .conftest import cluster_from_yaml, connect_from_node, nft

pytestmark = pytest.mark.kernel

PODS = """
apiVersion: v1
kind: Namespace
metadata: {name: x}
---
apiVersion: v1
kind: Pod
metadata: {namespace: x, name: server, labels: {app: server}}
spec: {nodeName: node1, containers: [{name: c, ports: [{containerPort: 80}]}]}
---
apiVersion: v1
kind: Pod
metadata: {namespace: x, name: client, labels: {app: client}}
spec: {nodeName: node1, containers: [{name: c}]}
"""

POLICIES = {
    # the server's ingress is isolated by no policy: KUBE-NWPLCY-DEFAULT sets the policy bit
    "egress-only": """
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: x, name: egress-only}
spec: {podSelector: {matchLabels: {app: server}}, policyTypes: [Egress]}
""",
    # a rule with ports only allows every source, the node's address included
    "ingress-port-80-from-anywhere": """
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: x, name: port-80}
spec:
  podSelector: {matchLabels: {app: server}}
  ingress: [{ports: [{port: 80}]}]
""",
}

FOREIGN = 0x2000  # another system's bit (kube-proxy's hostport mark)


def _other_system(server_ip: str) -> str:
    """Another system's table on the OUTPUT hook: marks the node's packets to the server before us
    (priority -10) and counts them after us (priority 10)."""
    return f"""
table inet othersys {{
    chain before {{
        type filter hook output priority -10; policy accept;
        ip daddr {server_ip} tcp dport 80 meta mark set meta mark | {FOREIGN:#x}
    }}
    chain after {{
        type filter hook output priority 10; policy accept;
        ip daddr {server_ip} tcp dport 80 counter comment "all"
        ip daddr {server_ip} tcp dport 80 meta mark & {FOREIGN:#x} == {FOREIGN:#x} counter comment "foreign mark kept"
        ip daddr {server_ip} tcp dport 80 meta mark & 0x10000 == 0x10000 counter comment "policy mark left set"
    }}
}}
"""


def _counters(ns: str) -> dict[str, int]:
    listing = json.loads(nft(ns, "-j", "list", "chain", "inet", "othersys", "after"))
    return {item["rule"]["comment"]: next(e["counter"]["packets"] for e in item["rule"]["expr"] if "counter" in e)
            for item in listing["nftables"] if "rule" in item}



@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dataplane", ["nft", "iptables-nft", "iptables-legacy"])
def test_the_nodes_allowed_traffic_leaves_with_the_policy_mark_cleared(dataplane, policy):
    cluster = cluster_from_yaml(PODS + POLICIES[policy])
    with Sandbox(cluster.pods.values(), dataplane=dataplane) as sandbox:
        sandbox.apply(cluster)
        node = sandbox.node_netns("node1")
        server = sandbox.pods["x/server"].ips[0]
        assert sandbox.connect("x/client", server, ProbeSpec(80, "TCP"))  # the server listens on 80 from then on
        nft(node, "-f", "-", stdin=_other_system(server))
        connected = connect_from_node(sandbox, "node1", server, 80)
        counters = _counters(node)
    assert connected
    assert counters["all"] >= 1, counters  # the node's SYN went through the output hook
    assert counters["foreign mark kept"] == counters["all"], counters
    assert counters["policy mark left set"] == 0, counters
