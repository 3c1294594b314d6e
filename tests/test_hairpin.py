"""Hairpin, with real packets: a pod reaching itself through a Service. After the Service's DNAT
the packet's source and destination are both the pod's address, so the node's table dispatches
it to the pod's ingress chain (on the destination) and then to its egress chain (on the source):
both directions decide, as the API reference has every connection allowed by the source's
egress and the destination's ingress. (With one pod chain for both directions, the ingress
allow returned before the egress policy was ever evaluated.)

The Service is a stand-in: in the sandbox node's namespace a table of the test's own DNATs
``SERVICE_IP``:80 to the pod and masquerades the hairpin (as kube-proxy does, so the reply comes
back through the node and is un-NATed); our filter hooks see the packet between the two.
"""

from __future__ import annotations

import subprocess

import pytest

from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.agent.testbed.sandbox import Sandbox

from .conftest import cluster_from_yaml

pytestmark = pytest.mark.kernel

SERVICE_IP = "10.96.0.50"

POD = """
apiVersion: v1
kind: Namespace
metadata: {name: a}
---
apiVersion: v1
kind: Pod
metadata: {name: p, namespace: a, labels: {app: p}}
spec: {nodeName: node1, containers: [{name: c, ports: [{containerPort: 80}]}]}
"""


def policy(ingress: str, egress: str) -> str:
    """A policy that isolates the pod in both directions with these rule lists (YAML flow)."""
    return f"""
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{name: both, namespace: a}}
spec:
  podSelector: {{matchLabels: {{app: p}}}}
  policyTypes: [Ingress, Egress]
  ingress: {ingress}
  egress: {egress}
"""


def service_nat(pod_ip: str) -> str:
    """The stand-in Service: DNAT ``SERVICE_IP``:80 to the pod; masquerade what goes back to the
    pod it came from (a hairpin)."""
    return f"""table ip hairpin-service {{
    chain prerouting {{ type nat hook prerouting priority dstnat; ip daddr {SERVICE_IP} tcp dport 80 dnat to {pod_ip}:80; }}
    chain postrouting {{ type nat hook postrouting priority srcnat; ip saddr {pod_ip} ip daddr {pod_ip} masquerade; }}
}}
"""


# ingress rules, egress rules -> may the pod reach itself through the Service
CASES = {
    "both allow": ("[{}]", "[{ports: [{port: 80}]}]", True),
    "ingress allows, egress does not": ("[{}]", "[{ports: [{port: 53, protocol: UDP}]}]", False),  # /tmp/lead/hairpin.yaml
    "egress allows, ingress does not": ("[{ports: [{port: 81}]}]", "[{}]", False),
}


@pytest.mark.parametrize("case", CASES)
def test_hairpin_through_a_service_is_decided_by_both_directions(case):
    ingress, egress, allowed = CASES[case]
    cluster = cluster_from_yaml(POD + policy(ingress, egress))
    with Sandbox(cluster.pods.values(), families=("ipv4",)) as sandbox:
        sandbox.apply(cluster)
        pod_ip = sandbox.pods["a/p"].addresses("ipv4")[0]
        subprocess.run(["ip", "netns", "exec", sandbox.node_netns("node1"), "nft", "-f", "-"], input=service_nat(pod_ip),
                       text=True, check=True)
        assert sandbox.connect("a/p", SERVICE_IP, ProbeSpec(80, "TCP")) is allowed
