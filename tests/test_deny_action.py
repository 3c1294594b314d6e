"""What a refused connection gets, with real packets between sandbox pods: a ClusterNetworkPolicy
``Deny`` (Admin and Baseline tier) drops, so the client hears nothing and times out, as
network-policy-api's conformance suite requires; what no NetworkPolicy allowed is rejected by
default (a TCP reset, ICMP port unreachable for UDP: the client fails at once, as with
kube-router) and dropped with ``--deny-action drop``, in the nft ruleset and in the iptables
variant, over IPv4 and IPv6.

A connection's outcome tells the answers apart: ``refused`` is ECONNREFUSED, which a TCP reset
gives a TCP connect and ICMP (ICMPv6) port unreachable gives a connected UDP socket at once;
``timeout`` means nothing came back within :data:`WAIT` seconds."""

from __future__ import annotations

import socket
import time

import pytest

from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.agent.testbed.sandbox import Sandbox
from nftpolicy.translators import transaction
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import Config

from .conftest import cluster_from_yaml

pytestmark = pytest.mark.kernel

WAIT = 1.0  # seconds a client waits for an answer
SPECS = (ProbeSpec(80, "TCP"), ProbeSpec(80, "UDP"))


def _namespace(name: str) -> str:
    return f"{{namespaces: {{matchLabels: {{kubernetes.io/metadata.name: {name}}}}}}}"


PODS = "".join(f"""
---
apiVersion: v1
kind: Pod
metadata: {{namespace: {ns}, name: {name}}}
spec: {{nodeName: node1, containers: [{{name: c, image: i}}]}}
""" for ns, name in (("x", "a"), ("x", "ok"), ("y", "admin"), ("w", "baseline"), ("z", "isolated")))
# y/admin: an Admin Deny from x; w/baseline: a Baseline Deny from x; z/isolated: a NetworkPolicy
# that allows nothing (its pod chain's implicit deny); x/ok: nothing selects it.
CLUSTER_POLICIES = "".join(f"""
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {{name: {tier.lower()}-deny-x}}
spec:
  tier: {tier}
  priority: 10
  subject: {_namespace(subject)}
  ingress: [{{action: Deny, from: [{_namespace("x")}]}}]
""" for tier, subject in (("Admin", "y"), ("Baseline", "w")))
NETWORK_POLICY = """
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: z, name: deny-all}
spec: {podSelector: {}, policyTypes: [Ingress]}
"""


def outcome(sandbox: Sandbox, src: str, address: str, spec: ProbeSpec) -> str:
    """``connected`` (TCP: the handshake completed; UDP: the echo came back), ``refused``
    (ECONNREFUSED: a TCP reset, or ICMP port unreachable to a connected UDP socket) or
    ``timeout`` (nothing came back within :data:`WAIT` seconds), from sandbox pod ``src``."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with netns.entered(sandbox.pod_netns[src]):
        sock = socket.socket(family, socket.SOCK_STREAM if spec.protocol == "TCP" else socket.SOCK_DGRAM)
    sock.settimeout(WAIT)
    try:
        sock.connect((address, spec.port))
        if spec.protocol == "UDP":
            sock.send(b"nftpolicy-deny-action")
            sock.recv(64)
        return "connected"
    except ConnectionRefusedError:
        return "refused"
    except socket.timeout:
        return "timeout"
    finally:
        sock.close()


def load(sandbox: Sandbox, config: Config, yaml_text: str) -> None:
    """Load the rules of ``yaml_text`` (pods and policies) with ``config`` into every node of
    ``sandbox`` (the nft ruleset, or the iptables variant of the same model as Sandbox.apply
    loads it)."""
    cluster = sandbox.with_sandbox_pods(cluster_from_yaml(yaml_text))
    for node in sandbox.nodes:
        if sandbox.dataplane == "nft":
            sandbox.node_dataplane(node).run(transaction.full(build_rule_model(cluster, node, config)))
        else:
            sandbox.config = config
            sandbox.apply(cluster)


def outcomes(sandbox: Sandbox, config: Config, yaml_text: str, family: str) -> dict[tuple[str, str], tuple[str, float]]:
    """Load ``yaml_text`` with ``config`` (:func:`load`) and try x/a -> every other pod on each
    of :data:`SPECS`: {(pod, protocol): (outcome, seconds)}."""
    load(sandbox, config, yaml_text)
    sandbox.probe(SPECS, (family,), [])  # every pod serves the specs
    found = {}
    for key, pod in sandbox.pods.items():
        if key == "x/a":
            continue
        address = next(ip for ip in pod.ips if (":" in ip) == (family == "ipv6"))
        for spec in SPECS:
            started = time.monotonic()
            # the client blocks in a thread while the prober's loop runs the pods' UDP echo servers
            attempt = sandbox.prober.loop.run_in_executor(None, outcome, sandbox, "x/a", address, spec)
            found[(key, spec.protocol)] = (sandbox.prober.loop.run_until_complete(attempt), time.monotonic() - started)
    return found


@pytest.fixture(scope="module", params=["ipv4", "ipv6"])
def sandbox(request):
    with Sandbox(cluster_from_yaml(PODS).pods.values(), families=(request.param,)) as built:
        yield built, request.param


@pytest.mark.parametrize("deny_action", ["reject", "drop"])
def test_a_cluster_network_policy_deny_drops_whatever_the_deny_action(sandbox, deny_action):
    built, family = sandbox
    found = outcomes(built, Config(deny_action=deny_action), PODS + CLUSTER_POLICIES + NETWORK_POLICY, family)
    for pod in ("y/admin", "w/baseline"):
        for protocol in ("TCP", "UDP"):
            result, seconds = found[(pod, protocol)]
            assert result == "timeout" and seconds >= WAIT * 0.9, (pod, protocol, result)
    assert found[("x/ok", "TCP")][0] == found[("x/ok", "UDP")][0] == "connected"
    implicit = {"reject": "refused", "drop": "timeout"}[deny_action]
    assert found[("z/isolated", "TCP")][0] == found[("z/isolated", "UDP")][0] == implicit


def test_the_implicit_deny_rejects_at_once_by_default(sandbox):
    """A reset (TCP) and port unreachable (UDP) come back well before the client's wait ends."""
    built, family = sandbox
    found = outcomes(built, Config(), PODS + NETWORK_POLICY, family)
    for protocol in ("TCP", "UDP"):
        result, seconds = found[("z/isolated", protocol)]
        assert result == "refused" and seconds < WAIT / 2, (protocol, result, seconds)
    assert all(found[(pod, "TCP")][0] == "connected" for pod in ("x/ok", "y/admin", "w/baseline"))


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
@pytest.mark.parametrize("deny_action, expected", [("reject", "refused"), ("drop", "timeout")])
def test_the_iptables_variant_follows_the_deny_action(family, deny_action, expected):
    """REJECT (kube-router's) or DROP, loaded with iptables-nft-restore: the same outcomes."""
    with Sandbox(cluster_from_yaml(PODS).pods.values(), families=(family,), dataplane="iptables-nft") as built:
        found = outcomes(built, Config(deny_action=deny_action), PODS + NETWORK_POLICY, family)
    assert found[("z/isolated", "TCP")][0] == found[("z/isolated", "UDP")][0] == expected
    assert found[("x/ok", "TCP")][0] == "connected"
