"""Traffic from the node to its own pods, with real packets: "traffic to and from the node where
a Pod is running is always allowed" (the NetworkPolicy concepts page; kubelet probes). Our pod
chain accepts it after the policies (a packet a policy allowed needs no address lookup), which
gives the same verdict as an accept before them: a NetworkPolicy only allows, and the ingress
peers of a ClusterNetworkPolicy are namespaces and pods, never a node's address, so no Deny of any
tier refuses it. Another node's address gets no such
pass: a NetworkPolicy that isolates the pod refuses it.
"""

from __future__ import annotations

import pytest

from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.agent.testbed.sandbox import Sandbox

from .conftest import cluster_from_yaml, connect_from_node

pytestmark = pytest.mark.kernel

PODS = """
apiVersion: v1
kind: Namespace
metadata: {name: x}
---
apiVersion: v1
kind: Pod
metadata: {namespace: x, name: server, labels: {app: server}}
spec: {nodeName: node1, containers: [{name: c, ports: [{containerPort: 80}, {containerPort: 81}]}]}
---
apiVersion: v1
kind: Pod
metadata: {namespace: x, name: client, labels: {app: client}}
spec: {nodeName: node1, containers: [{name: c}]}
---
apiVersion: v1
kind: Pod
metadata: {namespace: x, name: remote, labels: {app: remote}}
spec: {nodeName: node2, containers: [{name: c}]}
"""

DENY_ALL = """
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: x, name: deny-all}
spec: {podSelector: {}, policyTypes: [Ingress, Egress]}
"""

ALLOW_CLIENT_80 = """
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: x, name: allow-client-80}
spec:
  podSelector: {matchLabels: {app: server}}
  ingress: [{from: [{podSelector: {matchLabels: {app: client}}}], ports: [{port: 80}]}]
"""

ADMIN_DENY_ALL = """
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: deny-all-into-server}
spec:
  tier: Admin
  priority: 1
  subject: {pods: {podSelector: {matchLabels: {app: server}}}}
  ingress: [{action: Deny, from: [{namespaces: {}}]}]
"""

BASELINE_DENY_ALL = ADMIN_DENY_ALL.replace("tier: Admin", "tier: Baseline")



# policies; may the client reach the server on 80; does a NetworkPolicy isolate the server's and
# the client's ingress (a ClusterNetworkPolicy Deny of every namespace covers pods, not nodes)
CASES = {
    "deny-all": (DENY_ALL, False, True, True),
    "allow-client-80": (ALLOW_CLIENT_80, True, True, False),
    "deny-all+allow-80": (DENY_ALL + ALLOW_CLIENT_80, False, True, True),  # deny-all isolates the client's egress too
    "admin-deny": (ADMIN_DENY_ALL, False, False, False),
    "baseline-deny": (BASELINE_DENY_ALL, False, False, False),
    "admin-deny+allow-80": (ADMIN_DENY_ALL + ALLOW_CLIENT_80, False, True, False),  # the Admin tier comes first
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_the_node_reaches_its_pods_and_another_node_does_not(case, family):
    policies, client_80, server_isolated, client_isolated = CASES[case]
    cluster = cluster_from_yaml(PODS + policies)
    with Sandbox(cluster.pods.values(), families=("ipv4", "ipv6")) as sandbox:
        sandbox.apply(cluster)
        server = sandbox.pods["x/server"].addresses(family)[0]
        client = sandbox.pods["x/client"].addresses(family)[0]
        # Pods first: they serve the ports from then on, and show the policies do refuse.
        seen = {"client 80": sandbox.connect("x/client", server, ProbeSpec(80, "TCP")),
                "client 81": sandbox.connect("x/client", server, ProbeSpec(81, "TCP")),
                "remote 81": sandbox.connect("x/remote", server, ProbeSpec(81, "TCP")),
                "node1 80": connect_from_node(sandbox, "node1", server, 80),
                "node1 81": connect_from_node(sandbox, "node1", server, 81),
                "node2 81": connect_from_node(sandbox, "node2", server, 81),
                "node2 to the client": connect_from_node(sandbox, "node2", client, 80)}
    assert seen == {"client 80": client_80, "client 81": False, "remote 81": False,
                    "node1 80": True, "node1 81": True,  # its own node, always
                    "node2 81": not server_isolated, "node2 to the client": not client_isolated}
