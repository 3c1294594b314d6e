"""Migration from kube-router: its real dump format, and the deliberate differences.

``kube_router_dump`` writes a cluster the way kube-router v2.11's iptables network policy
controller does (default flags, IPv4): chain layout, rule comments and set naming as documented in
``examples/shop/README.md``. It is checked against the shipped ``examples/shop/node1.*`` dump line
for line, then used to produce kube-router-format dumps of the clusters below, which are replayed
with ``compare`` against nftpolicy. Each deliberate difference listed in the README
("Migration from kube-router") has a test here that shows it with such a dump.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import ipaddress
import re

import pytest

from nftpolicy.agent.compare import BOTH_TYPES_NOTE, ICMP_NOTE, IPBLOCK_NOTE, compare
from nftpolicy.agent.sandbox import ProbeSpec
from nftpolicy.translators.kuberouter import select
from nftpolicy.translators.model import Cluster, NetworkPolicy, Pod

from .conftest import REPO, cluster_from_yaml, example_cluster
from .test_direction import EXPECTED, PODS

SYNC_VERSION = "1795953600123456789"
EXAMPLE = REPO / "examples" / "shop"
# The comments of kube-router's built-in chain jumps and INPUT exemptions carry a hash of the
# chain and rule arguments; with default flags they are these (examples/shop/node1.iptables-save).
BUILTIN_JUMPS = {"INPUT": "4IA2OSFRMVNDXBVV", "FORWARD": "TEMCG2JMHZYE7H7T", "OUTPUT": "VEAAIY32XVBHCSCY"}
INPUT_EXEMPTIONS = [
    '-A KUBE-ROUTER-INPUT -d 10.96.0.0/12 -m comment --comment "allow traffic to primary/secondary cluster IP range - BVHX2PIHDXXEO43X" -j RETURN',
    '-A KUBE-ROUTER-INPUT -p tcp -m comment --comment "allow LOCAL TCP traffic to node ports - LR7XO7NXDBGQJD2M" -m addrtype --dst-type LOCAL -m multiport --dports 30000:32767 -j RETURN',
    '-A KUBE-ROUTER-INPUT -p udp -m comment --comment "allow LOCAL UDP traffic to node ports - 76UCBPIZNGJNWNUZ" -m addrtype --dst-type LOCAL -m multiport --dports 30000:32767 -j RETURN',
    '-A KUBE-ROUTER-INPUT -p sctp -m comment --comment "allow LOCAL SCTP traffic to node ports - YU47VQ3DEDE3VDG7" -m addrtype --dst-type LOCAL -m multiport --dports 30000:32767 -j RETURN',
]
COMMON = [
    '-A KUBE-NWPLCY-COMMON -m comment --comment "\\"rule to drop invalid state for pod\\"" -m conntrack --ctstate INVALID -j DROP',
    '-A KUBE-NWPLCY-COMMON -m comment --comment "\\"rule for stateful firewall for pod\\"" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT',
    '-A KUBE-NWPLCY-COMMON -p icmp -m comment --comment "allow icmp echo requests" -m icmp --icmp-type 8 -j ACCEPT',
    '-A KUBE-NWPLCY-COMMON -p icmp -m comment --comment "allow icmp destination unreachable messages" -m icmp --icmp-type 3 -j ACCEPT',
    '-A KUBE-NWPLCY-COMMON -p icmp -m comment --comment "allow icmp time exceeded messages" -m icmp --icmp-type 11 -j ACCEPT',
]
MARK = "0x10000/0x10000"


def h(*parts: str) -> str:
    """kube-router's hash: base32(sha256(plain concatenation))[:16]."""
    return base64.b32encode(hashlib.sha256("".join(parts).encode()).digest()).decode()[:16]


def _ip_key(ip: str):
    return ipaddress.ip_address(ip)


def _policy_type(policy: NetworkPolicy) -> str:
    return "both" if policy.policy_types == {"ingress", "egress"} else next(iter(policy.policy_types))


def kube_router_dump(cluster: Cluster, node: str) -> tuple[str, str]:
    """(iptables-save, ipset save) of ``node`` as kube-router v2.11 writes them (IPv4)."""
    pods = [p for p in cluster.pods.values() if p.enforceable and p.addresses("ipv4")]
    local = sorted((p for p in pods if p.node == node), key=lambda p: _ip_key(p.addresses("ipv4")[0]))
    chains: dict[str, list[str]] = {c: [] for c in ("INPUT", "FORWARD", "OUTPUT", "KUBE-NWPLCY-COMMON", "KUBE-NWPLCY-DEFAULT",
                                                     "KUBE-NWPLCY-TAIL", "KUBE-ROUTER-FORWARD", "KUBE-ROUTER-INPUT", "KUBE-ROUTER-OUTPUT")}
    sets: dict[str, tuple[str, list[str]]] = {}

    def ipset(name: str, kind: str, members: list[str]) -> str:
        sets[name] = (kind, members)
        return name

    def ips(selected) -> list[str]:
        return sorted({ip for p in selected for ip in p.addresses("ipv4")}, key=_ip_key)

    def selects(policy: NetworkPolicy, pod: Pod) -> bool:
        return pod.namespace == policy.namespace and policy.pod_selector.matches(pod.labels)

    def peer_pods(policy, peer) -> list[Pod]:
        namespaces = {policy.namespace} if peer.namespace_selector is None else {
            n for n in set(cluster.namespaces) | {p.namespace for p in pods} if peer.namespace_selector.matches(cluster.namespace_labels(n))}
        return [p for p in pods if p.namespace in namespaces and (peer.pod_selector is None or peer.pod_selector.matches(p.labels))]

    for builtin, digest in BUILTIN_JUMPS.items():
        chains[builtin].append(f'-A {builtin} -m comment --comment "kube-router netpol - {digest}" -j KUBE-ROUTER-{builtin}')
    chains["KUBE-NWPLCY-COMMON"] = list(COMMON)
    chains["KUBE-NWPLCY-DEFAULT"].append(f'-A KUBE-NWPLCY-DEFAULT -m comment --comment "rule to mark traffic matching a network policy" -j MARK --set-xmark {MARK}')
    chains["KUBE-NWPLCY-TAIL"].append('-A KUBE-NWPLCY-TAIL -m comment --comment "accept netpol-ok" -m mark --mark 0x20000/0x20000 -j ACCEPT')
    policy_chain: dict[str, str] = {}
    for key in sorted(cluster.policies):
        policy = cluster.policies[key]
        ns, name = policy.namespace, policy.name
        chain = policy_chain[key] = f"KUBE-NWPLCY-{h(ns, name, SYNC_VERSION, 'IPv4')}"
        body = chains[chain] = []
        targets = [p for p in pods if selects(policy, p)]

        def add(proto: str | None, text: str, matches: str, port: str | None, chain=chain, key=key, body=body) -> None:
            head = f"-A {chain}" + (f" -p {proto}" if proto else "") + f' -m comment --comment "{key} {text}" {matches}'
            tail = f" -m {proto} --dport {port}" if port else ""
            body.append(f"{head}{tail} -j MARK --set-xmark {MARK}")
            body.append(f"{head}{tail} -m mark --mark {MARK} -j RETURN")

        for direction in ("ingress", "egress"):
            if direction not in policy.policy_types:
                continue
            target_set = ipset(f"KUBE-{'DST' if direction == 'ingress' else 'SRC'}-{h(ns, name, 'IPv4')}", "hash:ip", ips(targets))
            target_side = "dst" if direction == "ingress" else "src"
            peer_side = "src" if direction == "ingress" else "dst"
            peer_prefix = "KUBE-SRC-" if direction == "ingress" else "KUBE-DST-"
            for i, rule in enumerate(policy.rules(direction)):
                alternatives = []  # (comment word, peer match or "")
                selector_peers = [p for p in rule.peers if p.ip_block is None]
                if selector_peers:
                    members = ips(pod for peer in selector_peers for pod in peer_pods(policy, peer))
                    peer_set = ipset(f"{peer_prefix}{h(ns, name, direction + 'rule', str(i), 'IPv4', 'pod')}", "hash:ip", members)
                    alternatives.append(("pods", f"-m set --match-set {peer_set} {peer_side}"))
                blocks = [p.ip_block for p in rule.peers if p.ip_block is not None]
                if blocks:
                    # One set for every ipBlock peer of the rule, each CIDR then its excepts, loaded
                    # with "ipset restore -exist": an element added again keeps the last flag.
                    flags: dict[str, str] = {}
                    for b in blocks:
                        flags[str(b.cidr)] = ""
                        flags.update({str(e): " nomatch" for e in b.excepts})
                    members = [f"{cidr}{flag}" for cidr, flag in flags.items()]
                    peer_set = ipset(f"{peer_prefix}{h(ns, name, direction + 'rule', str(i), 'IPv4', 'ipblock')}", "hash:net", members)
                    alternatives.append(("cidr", f"-m set --match-set {peer_set} {peer_side}"))
                if not rule.peers:
                    alternatives.append(("any", ""))
                for word, peer in alternatives:
                    own = f"-m set --match-set {target_set} {target_side}"
                    matches = " ".join(m for m in ((peer, own) if direction == "ingress" else (own, peer)) if m)
                    if not rule.ports:
                        add(None, f"{direction} {word}", matches, None)
                    endpoint = 0
                    for port in rule.ports:
                        proto = port.protocol.lower()
                        if isinstance(port.port, str):
                            holders = [p for p in targets if p.resolve_port(port.port, port.protocol)]
                            number = holders[0].resolve_port(port.port, port.protocol) if holders else None
                            np_set = ipset(f"KUBE-DST-{h(ns, name, direction + 'rule', str(i), str(endpoint), 'IPv4', 'namedport')}",
                                           "hash:ip", ips(holders))
                            endpoint += 1
                            add(proto, f"{direction} {word} np", f"{peer} -m set --match-set {np_set} dst".strip(), str(number))
                        else:
                            span = str(port.port) if port.port is not None and not port.end_port else \
                                f"{port.port}:{port.end_port}" if port.port is not None else None
                            add(proto, f"{direction} {word}", matches, span)
    for pod in local:
        ip = pod.addresses("ipv4")[0]
        chain = f"KUBE-POD-FW-{h(pod.namespace, pod.name, SYNC_VERSION)}"
        mine = [(k, _policy_type(cluster.policies[k])) for k in sorted(cluster.policies) if selects(cluster.policies[k], pod)]
        body = chains[chain] = [f'-A {chain} -m comment --comment "common netpol rules" -j KUBE-NWPLCY-COMMON',
                                f'-A {chain} -d {ip}/32 -m comment --comment "from local node" -m addrtype --src-type LOCAL -j ACCEPT']
        if not any(t in ("egress", "both") for _, t in mine):
            body.append(f'-A {chain} -s {ip}/32 -m comment --comment "default egress" -j KUBE-NWPLCY-DEFAULT')
        if not any(t in ("ingress", "both") for _, t in mine):
            body.append(f'-A {chain} -d {ip}/32 -m comment --comment "default ingress" -j KUBE-NWPLCY-DEFAULT')
        for key, kind in mine:
            where = {"ingress": f"-d {ip}/32 ", "egress": f"-s {ip}/32 ", "both": ""}[kind]
            body.append(f'-A {chain} {where}-m comment --comment "{key} policy" -j {policy_chain[key]}')
        body += [f'-A {chain} -m comment --comment "{pod.key} log-drop" -m mark ! --mark {MARK} -m limit --limit 10/min --limit-burst 10 -j NFLOG --nflog-group 100',
                 f'-A {chain} -m comment --comment "{pod.key} reject" -m mark ! --mark {MARK} -j REJECT --reject-with icmp-port-unreachable',
                 f"-A {chain} -j MARK --set-xmark 0x0/0x10000",
                 f'-A {chain} -m comment --comment "set netpol-ok mark" -j MARK --set-xmark 0x20000/0x20000']
        for flag, word in (("-d", "in"), ("-s", "out")):
            jump = f'-m comment --comment "{pod.key} {word}" -j {chain}'
            chains["KUBE-ROUTER-FORWARD"] += [f"-A KUBE-ROUTER-FORWARD {flag} {ip}/32 {jump}",
                                              f"-A KUBE-ROUTER-FORWARD {flag} {ip}/32 -m physdev --physdev-is-bridged {jump}"]
            chains["KUBE-ROUTER-OUTPUT"].append(f"-A KUBE-ROUTER-OUTPUT {flag} {ip}/32 {jump}")
        chains["KUBE-ROUTER-INPUT"].append(f'-A KUBE-ROUTER-INPUT -s {ip}/32 -m comment --comment "{pod.key} out" -j {chain}')
    chains["KUBE-ROUTER-INPUT"][:0] = INPUT_EXEMPTIONS
    for name in ("KUBE-ROUTER-FORWARD", "KUBE-ROUTER-INPUT", "KUBE-ROUTER-OUTPUT"):
        chains[name] += [f'-A {name} -m comment --comment "rule to explicitly handle traffic for network policies ACCEPT/REJECT decision" -j KUBE-NWPLCY-TAIL',
                         f'-A {name} -m comment --comment "rule to explicitly ACCEPT traffic that comply to network policies" -m mark --mark 0x20000/0x20000 -j ACCEPT']
    order = ["INPUT", "FORWARD", "OUTPUT"] + sorted(c for c in chains if c not in ("INPUT", "FORWARD", "OUTPUT"))
    lines = ["# Generated by iptables-save v1.8.9 (nf_tables)", "*filter"]
    lines += [f":{c} ACCEPT [0:0]" if c in ("INPUT", "FORWARD", "OUTPUT") else f":{c} - [0:0]" for c in order]
    lines += [rule for c in order for rule in chains[c]]
    lines += ["COMMIT", "# Completed"]
    saved = []
    for name in sorted(sets):
        kind, members = sets[name]
        saved.append(f"create {name} {kind} family inet hashsize 1024 maxelem 65536 timeout 0 bucketsize 12 initval 0x00000000")
        for member in members:
            address, _, flag = member.partition(" ")
            address = address.removesuffix("/32")
            saved.append(f"add {name} {address} timeout 0" + (f" {flag}" if flag else ""))
    return "\n".join(lines) + "\n", "\n".join(saved) + "\n"


def _significant(text: str) -> list[str]:
    return [re.sub(r"initval 0x[0-9a-f]+", "initval", line) for line in text.splitlines() if line and not line.startswith("#")]


def test_emulator_writes_the_shipped_example_dump():
    iptables_save, ipset_save = kube_router_dump(example_cluster(), "node1")
    assert _significant(iptables_save) == _significant((EXAMPLE / "node1.iptables-save").read_text())
    assert _significant(ipset_save) == _significant((EXAMPLE / "node1.ipset-save").read_text())


def _placed(cluster: Cluster, node: str) -> Cluster:
    """Every pod on ``node`` with an address from 10.244.1.10 up, as a running cluster has them."""
    pods = {key: dataclasses.replace(pod, node=node, ips=(f"10.244.1.{10 + i}",))
            for i, (key, pod) in enumerate(sorted(cluster.pods.items()))}
    return dataclasses.replace(cluster, pods=pods)


def _compare(cluster: Cluster, node: str, **kwargs):
    iptables_save, ipset_save = kube_router_dump(cluster, node)
    dump = select({"ipv4": iptables_save}, ipset_save)
    assert dump.left_out == []
    return compare(cluster, node, dump, **kwargs)


@pytest.mark.kernel
@pytest.mark.parametrize("case", EXPECTED)
def test_direction_for_policies_with_both_types(case):
    """Deliberate difference 1: kube-router jumps to a policy with both policyTypes without ``-d``
    or ``-s``, so a selected pod's rule of one direction is also checked for the other. With the
    two clusters of test_direction.py on one node, kube-router allows exactly the cells that the
    API forbids and test_direction.py asserts blocked; nftpolicy gives the API's verdict."""
    manifests, expected = EXPECTED[case]
    cluster = _placed(cluster_from_yaml(manifests), "node1")
    report = _compare(cluster, "node1")
    cells = {(d.src, d.dst): (d.kube_router, d.nftpolicy) for d in report.differences}
    # a -> b, the cell each case is built around: kube-router allows it, the API does not.
    assert cells == {("x/a", "x/b"): (True, False)}
    assert expected[("x/a", "x/b")] is False
    assert [d.note for d in report.differences] == [BOTH_TYPES_NOTE.format("x/both")]
    assert report.differences[0].policies == ("x/both (ingress of x/b)", "x/both (egress of x/a)")


# x/c serves; x/a (10.244.1.10 once placed) is allowed by the first peer and excepted by the second.
IPBLOCK_OVERLAP = PODS + """
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: x, name: blocks}
spec:
  podSelector: {matchLabels: {pod: c}}
  ingress:
  - from:
    - ipBlock: {cidr: 10.244.1.10/32}
    - ipBlock: {cidr: 10.244.1.0/24, except: [10.244.1.10/32]}
"""


@pytest.mark.kernel
def test_one_ipblock_peers_except_never_cancels_another_peer():
    """Deliberate difference 3: kube-router puts every ipBlock peer of a rule into one hash:net set
    (``ipset restore -exist``), so when one peer's except equals another peer's CIDR the later
    ``nomatch`` wins and the address is denied, although the other peer allows it (the API: each
    except applies to its own peer). nftpolicy applies each except to its own peer."""
    cluster = _placed(cluster_from_yaml(IPBLOCK_OVERLAP), "node1")
    _, ipset_save = kube_router_dump(cluster, "node1")
    assert "10.244.1.10 timeout 0 nomatch" in ipset_save
    report = _compare(cluster, "node1")
    assert [(d.spec, d.src, d.dst, d.kube_router, d.nftpolicy) for d in report.differences] == [
        (ProbeSpec(80, "TCP"), "x/a", "x/c", False, True)]
    assert report.differences[0].note == IPBLOCK_NOTE.format("x/blocks")


@pytest.mark.kernel
def test_icmp_echo_is_always_allowed_by_kube_router():
    """Deliberate difference 2: kube-router's KUBE-NWPLCY-COMMON accepts every ICMP echo request,
    so a default-deny policy does not stop ping; nftpolicy leaves echo to the policies (only ICMP
    errors are always allowed)."""
    cluster = example_cluster()
    report = _compare(cluster, "node1", icmp=True)
    assert report.differences, "kube-router must allow pings that the policies deny"
    for d in report.differences:
        assert d.spec == ProbeSpec(0, "ICMP") and (d.kube_router, d.nftpolicy) == (True, False) and d.note == ICMP_NOTE
    assert ("ops/prometheus-0", "shop/api-5f6b7c9d4-q8w2n") in {(d.src, d.dst) for d in report.differences}
