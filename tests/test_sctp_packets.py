"""SCTP enforcement with real packets on a kernel without SCTP sockets (CONFIG_IP_SCTP unset;
conntrack's SCTP and nft's matching are there): each probe is one crafted INIT chunk
(:mod:`tests.sctpraw`: raw sockets of protocol 132, a correct CRC32c, a fresh source port)
from x/c's network namespace to a sandbox pod, where a raw socket receives what arrives.

The verdicts, told apart by what arrives where within :data:`WAIT` seconds: ``accepted`` (the
INIT reached the destination pod), ``rejected`` (it did not, and x/c got ICMP port unreachable
quoting it: what nft's ``reject`` sends for SCTP, in the inet family ``icmpx port-unreachable``,
ICMPv6 type 1 code 4 for IPv6; never an SCTP ABORT, which x/c would receive on its own raw
socket), ``dropped`` (nothing anywhere). A wrong checksum would make conntrack call the INIT
invalid and our table drop it, so every ``accepted`` cell also proves the packer right.

The rules cover SCTP ports (a number, a range), named ports (a NetworkPolicy's and a
ClusterNetworkPolicy's, resolved on the destination pod's SCTP container port), Deny, Pass and
Accept in the Admin tier, Deny in the Baseline tier, a NetworkPolicy's allows and its implicit
deny (rejected, or dropped with ``--deny-action drop``), and an egress Deny, over IPv4 and IPv6.
"""

from __future__ import annotations

import itertools
import select
import socket
import time

import pytest

from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.testbed.sandbox import Sandbox
from nftpolicy.translators.rules import Config

from . import sctpraw
from .conftest import cluster_from_yaml
from .test_deny_action import load

pytestmark = pytest.mark.kernel

WAIT = 1.0  # seconds every probe of a round has to arrive or be answered
CLIENT = "x/c"


def _pod(namespace: str, name: str, port: int | None = None) -> str:
    ports = f", ports: [{{name: assoc, containerPort: {port}, protocol: SCTP}}]" if port else ""
    return f"""
---
apiVersion: v1
kind: Pod
metadata: {{namespace: {namespace}, name: {name}}}
spec: {{nodeName: node1, containers: [{{name: c, image: i{ports}}}]}}
"""


def _namespaces(*names: str) -> str:
    return f"{{namespaces: {{matchExpressions: [{{key: kubernetes.io/metadata.name, operator: In, values: [{', '.join(names)}]}}]}}}}"


def _cnp(name: str, version: str, tier: str, priority: int, subject: str, direction: str, rules: list[str]) -> str:
    lines = "".join(f"\n    - {rule}" for rule in rules)
    return f"""
---
apiVersion: policy.networking.k8s.io/{version}
kind: ClusterNetworkPolicy
metadata: {{name: {name}}}
spec:
  tier: {tier}
  priority: {priority}
  subject: {subject}
  {direction}:{lines}
"""


def _sctp(port: int, end: int | None = None) -> str:
    where = f"range: {{start: {port}, end: {end}}}" if end else f"number: {port}"
    return f"{{sctp: {{destinationPort: {{{where}}}}}}}"


# y/s: a NetworkPolicy isolates it (SCTP 5000 and its named port assoc = 5001 from x);
# z/t: no NetworkPolicy (named port assoc = 7003), so the Baseline tier applies to it.
PODS = _pod("x", "c") + _pod("y", "s", 5001) + _pod("z", "t", 7003)
POLICIES = PODS + f"""
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{namespace: y, name: from-x}}
spec:
  podSelector: {{}}
  ingress:
    - from: [{{namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: x}}}}}}]
      ports: [{{protocol: SCTP, port: 5000}}, {{protocol: SCTP, port: assoc}}]
"""
FROM_X = f"from: [{_namespaces('x')}]"
POLICIES += _cnp("admin-sctp", "v1beta1", "Admin", 1, _namespaces("y", "z"), "ingress", [
    f"{{action: Deny, {FROM_X}, protocols: [{_sctp(6000)}]}}",
    f"{{action: Pass, {FROM_X}, protocols: [{_sctp(5002, 5003)}]}}",
    f"{{action: Accept, {FROM_X}, protocols: [{_sctp(6001)}]}}"])
POLICIES += _cnp("admin-egress-sctp", "v1beta1", "Admin", 2, _namespaces("x"), "egress", [
    f"{{action: Deny, to: [{_namespaces('z')}], protocols: [{_sctp(7005)}]}}"])
POLICIES += _cnp("baseline-sctp", "v1alpha2", "Baseline", 1, _namespaces("z"), "ingress", [
    f"{{action: Deny, {FROM_X}, protocols: [{_sctp(5002)}, {{destinationNamedPort: assoc}}]}}"])
IMPLICIT = {"reject": "rejected", "drop": "dropped"}
# (destination pod, SCTP port) -> the verdict, "implicit" where the NetworkPolicy's implicit deny decides
EXPECTED = {
    ("y/s", 5000): "accepted",  # the NetworkPolicy's port
    ("y/s", 5001): "accepted",  # the NetworkPolicy's named port, on y/s's SCTP container port
    ("y/s", 5002): "implicit",  # Admin Pass (a range), then the NetworkPolicy allows nothing of it
    ("y/s", 5004): "implicit",  # no ClusterNetworkPolicy rule; the NetworkPolicy allows nothing of it
    ("y/s", 6000): "dropped",  # Admin Deny
    ("y/s", 6001): "accepted",  # Admin Accept over the NetworkPolicy
    ("z/t", 5002): "dropped",  # Admin Pass, then Baseline Deny
    ("z/t", 5003): "accepted",  # Admin Pass, nothing in the Baseline tier: allowed
    ("z/t", 6000): "dropped",  # Admin Deny
    ("z/t", 7003): "dropped",  # Baseline Deny of the named port, on z/t's SCTP container port
    ("z/t", 7004): "accepted",  # nothing selects it for this port
    ("z/t", 7005): "dropped",  # x's Admin egress Deny
}


def _raw(sandbox: Sandbox, pod: str, family: int, protocol: int) -> socket.socket:
    with netns.entered(sandbox.pod_netns[pod]):
        sock = socket.socket(family, socket.SOCK_RAW, protocol)
    sock.setblocking(False)
    return sock


def probe_round(sandbox: Sandbox, family: str, targets: list[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """One INIT from :data:`CLIENT` to each ``(pod, port)`` of ``targets``, all at once (each
    from its own source port), then :data:`WAIT` seconds of listening: the verdict of each."""
    af = socket.AF_INET if family == "ipv4" else socket.AF_INET6
    receivers = {pod: _raw(sandbox, pod, af, sctpraw.PROTOCOL) for pod in sorted({p for p, _ in targets})}
    client = _raw(sandbox, CLIENT, af, sctpraw.PROTOCOL)
    errors = _raw(sandbox, CLIENT, af, socket.IPPROTO_ICMP if af == socket.AF_INET else socket.IPPROTO_ICMPV6)
    sockets = [*receivers.values(), client, errors]
    sent = {}
    try:
        for source_port, (pod, port) in zip(itertools.count(40000), targets):
            tag = sctpraw.new_tag()
            address = next(ip for ip in sandbox.pods[pod].ips if (":" in ip) == (af == socket.AF_INET6))
            client.sendto(sctpraw.init_packet(source_port, port, tag), (address, 0))
            sent[(source_port, port)] = (pod, port, tag)
        arrived, answered, back = set(), set(), []
        deadline = time.monotonic() + WAIT
        while (left := deadline - time.monotonic()) > 0:
            for sock in select.select(sockets, [], [], left)[0]:
                data = sock.recv(4096)
                if sock is errors:
                    error = sctpraw.icmp_error_of(af, data)
                    if error is not None and error[:2] == sctpraw.ICMP_PORT_UNREACHABLE[af]:
                        answered.add(error[2:])
                    continue
                packet = sctpraw.sctp_of(af, data)
                if packet is None:
                    continue
                if sock is client:
                    back.append(packet)  # an ABORT or anything else SCTP sent back to x/c
                elif packet.chunk == sctpraw.INIT and sent.get((packet.source_port, packet.destination_port), ())[2:] == (packet.initiate_tag,):
                    arrived.add((packet.source_port, packet.destination_port))
        assert [p for p in back if (p.destination_port, p.source_port) in sent] == [], "an SCTP answer came back"
        return {(pod, port): "accepted" if key in arrived else "rejected" if key in answered else "dropped"
                for key, (pod, port, _) in sent.items()}
    finally:
        for sock in sockets:
            sock.close()


@pytest.fixture(scope="module", params=["ipv4", "ipv6"])
def sandbox(request):
    with Sandbox(cluster_from_yaml(PODS).pods.values(), families=(request.param,)) as built:
        yield built, request.param


def test_without_rules_every_init_arrives(sandbox):
    """The packer and the receivers: with no table at all, every INIT reaches its pod."""
    built, family = sandbox
    load(built, Config(), PODS)
    assert set(probe_round(built, family, list(EXPECTED)).values()) == {"accepted"}


@pytest.mark.parametrize("deny_action", ["reject", "drop"])
def test_sctp_rules_give_their_verdicts(sandbox, deny_action):
    built, family = sandbox
    load(built, Config(deny_action=deny_action), POLICIES)
    expected = {target: IMPLICIT[deny_action] if verdict == "implicit" else verdict for target, verdict in EXPECTED.items()}
    assert probe_round(built, family, list(EXPECTED)) == expected
