"""Migration from kube-router: its real dump format, and the deliberate differences.

``kube_router_dump`` writes a node the way the real kube-router v2.1.0 network policy controller
leaves it (default flags, IPv4; the logic of its ``pkg/controllers/netpol``): chain layout, rule
comments, set names and each rule in the form ``iptables-save`` prints it. It is checked against
every real dump in ``tests/fixtures/kube-router-v2.1.0`` (saved from the real binary by
``tools/kube_router_dumps.py``): given the fixture's sync version, the same chains with the same
rules and the same sets with the same members, where only what comes from Go's map iteration
order (local pods, policy jumps, named-port endpoints, set members) is compared as a set. It then
writes kube-router dumps of other clusters, which are replayed with ``compare`` against nftpolicy.
Each deliberate difference listed in docs/migration.md ("Deliberate differences") has a test here that
shows it with such a dump; ``tests/test_real_dumps.py`` shows them with the real dumps.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import ipaddress
import re

import pytest

from nftpolicy.agent.testbed.compare import BOTH_TYPES_NOTE, ICMP_NOTE, IPBLOCK_NOTE, NAMED_PORT_NOTE, compare
from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.translators.kuberouter import parse_iptables_save, parse_ipset_save, select
from nftpolicy.translators.model import Cluster, NetworkPolicy, Peer, Pod, PolicyPort

from .conftest import REPO, cluster_from_yaml, example_cluster
from .test_direction import EXPECTED, PODS

SYNC_VERSION = "1796000000000000000"
FIXTURES = REPO / "tests" / "fixtures" / "kube-router-v2.1.0"
MARK = "0x10000/0x10000"
# The comments of kube-router's built-in chain jumps and KUBE-ROUTER-INPUT exemptions carry a
# hash of the chain and rule arguments; with default flags they are these.
BUILTIN_JUMPS = {"INPUT": "4IA2OSFRMVNDXBVV", "FORWARD": "TEMCG2JMHZYE7H7T", "OUTPUT": "VEAAIY32XVBHCSCY"}
INPUT_EXEMPTIONS = [
    '-A KUBE-ROUTER-INPUT -d 10.96.0.0/12 -m comment --comment "allow traffic to primary/secondary cluster IP range - BVHX2PIHDXXEO43X" -j RETURN',
    '-A KUBE-ROUTER-INPUT -p tcp -m comment --comment "allow LOCAL TCP traffic to node ports - LR7XO7NXDBGQJD2M" -m addrtype --dst-type LOCAL -m multiport --dports 30000:32767 -j RETURN',
    '-A KUBE-ROUTER-INPUT -p udp -m comment --comment "allow LOCAL UDP traffic to node ports - 76UCBPIZNGJNWNUZ" -m addrtype --dst-type LOCAL -m multiport --dports 30000:32767 -j RETURN',
]
EXPLICIT_ACCEPT = ('-m comment --comment "rule to explicitly ACCEPT traffic that comply to network policies" '
                   '-m mark --mark 0x20000/0x20000 -j ACCEPT')


def h(*parts: str) -> str:
    """kube-router's hash: base32(sha256(plain concatenation))[:16]."""
    return base64.b32encode(hashlib.sha256("".join(parts).encode()).digest()).decode()[:16]


def _v4(pods) -> list[str]:
    return [ip for p in pods for ip in p.addresses("ipv4")]


@dataclasses.dataclass
class _Endpoints:
    """kube-router's ``endPoints``: a resolved named port and the addresses that have it. ``ips``
    is shared by every endpoint taken from one pod (Go map aliasing in grabNamedPortFromPod)."""

    ips: dict[str, list[str]]
    protocol: str
    port: int


def _grab_named_ports(pods, found: dict) -> None:
    """grabNamedPortFromPod for each pod: name -> protocol -> number -> endpoints."""
    for pod in pods:
        ips = {"ipv4": list(pod.addresses("ipv4"))}
        for port in pod.ports:
            by_number = found.setdefault(port.name or "", {}).setdefault(port.protocol, {})
            if port.port not in by_number:
                by_number[port.port] = _Endpoints(ips, port.protocol, port.port)
            else:
                eps = by_number[port.port]
                eps.ips["ipv4"] = eps.ips["ipv4"] + ips["ipv4"]


def _ports(ports: tuple[PolicyPort, ...], named: dict) -> tuple[list[tuple[str, str, str]], list[_Endpoints]]:
    """processNetworkPolicyPorts: (protocol, port, end port) numbers and resolved named ports (a
    name no pod resolves is dropped)."""
    numeric, resolved = [], []
    for port in ports:
        if port.port is None:
            numeric.append((port.protocol, "", ""))
        elif isinstance(port.port, int):
            end = str(port.end_port) if port.end_port and port.end_port >= port.port else ""
            numeric.append((port.protocol, str(port.port), end))
        else:
            resolved.extend(named.get(port.port, {}).get(port.protocol, {}).values())
    return numeric, resolved


def _ip_block_entries(peers: tuple[Peer, ...]) -> list[tuple[str, str]]:
    """evalIPBlockPeer over the ipBlock peers of a rule (IPv4): (element, flag), in order."""
    entries = []
    for peer in peers:
        block = peer.ip_block
        if block is None or peer.pod_selector is not None or peer.namespace_selector is not None or block.cidr.version != 4:
            continue
        for net, flag in [(block.cidr, "")] + [(e, "nomatch") for e in block.excepts]:
            halves = ["0.0.0.0/1", "128.0.0.0/1"] if net.prefixlen == 0 else [str(net)]
            entries += [(n, flag) for n in halves]
    return entries


def kube_router_dump(cluster: Cluster, node: str, sync_version: str = SYNC_VERSION) -> tuple[str, str]:
    """(iptables-save, ipset save) of ``node`` as kube-router v2.1.0 leaves them (IPv4).

    Orders that kube-router takes from Go maps (local pods, policies, named-port endpoints) are
    sorted here; ``ipset save`` members are in insertion order.
    """
    actionable = [p for p in cluster.pods.values() if p.enforceable]
    namespaces = sorted(set(cluster.namespaces) | {p.namespace for p in actionable})
    chains: dict[str, list[str]] = {"INPUT": [], "FORWARD": [], "OUTPUT": [], "KUBE-NWPLCY-DEFAULT": [
        f'-A KUBE-NWPLCY-DEFAULT -m comment --comment "rule to mark traffic matching a network policy" -j MARK --set-xmark {MARK}'],
        "KUBE-ROUTER-FORWARD": [], "KUBE-ROUTER-INPUT": list(INPUT_EXEMPTIONS), "KUBE-ROUTER-OUTPUT": []}
    sets: dict[str, tuple[str, dict[str, str]]] = {}

    def refresh(name: str, kind: str, entries) -> str:
        # ipset restore -exist: an element added again keeps the last flag.
        sets[name] = (kind, {element: flag for element, flag in entries})
        return name

    def plain(ips) -> list[tuple[str, str]]:
        return [(ip, "") for ip in ips]

    def peer_pods(policy: NetworkPolicy, peer: Peer) -> list[Pod]:
        """evalPodPeer."""
        if peer.namespace_selector is not None:
            chosen = [n for n in namespaces if peer.namespace_selector.matches(cluster.namespace_labels(n))]
            return [p for n in chosen for p in actionable
                    if p.namespace == n and (peer.pod_selector is None or peer.pod_selector.matches(p.labels))]
        if peer.pod_selector is not None:
            return [p for p in actionable if p.namespace == policy.namespace and peer.pod_selector.matches(p.labels)]
        return []

    policy_chain, targets_of = {}, {}
    for key in sorted(cluster.policies):
        policy = cluster.policies[key]
        ns, name = policy.namespace, policy.name
        chain = policy_chain[key] = f"KUBE-NWPLCY-{h(ns, name, sync_version, 'IPv4')}"
        chains[chain] = []
        targets = targets_of[key] = [p for p in actionable if p.namespace == ns and policy.pod_selector.matches(p.labels)]

        def append(comment: str, src: str, dst: str, protocol: str, port: str, end: str, chain=chain) -> None:
            head = f"-A {chain}" + (f" -p {protocol.lower()}" if protocol else "") + f' -m comment --comment "{comment}"'
            head += (f" -m set --match-set {src} src" if src else "") + (f" -m set --match-set {dst} dst" if dst else "")
            head += f" -m {protocol.lower()} --dport {port}" + (f":{end}" if end else "") if port else ""
            chains[chain].extend([f"{head} -j MARK --set-xmark {MARK}", f"{head} -m mark --mark {MARK} -j RETURN"])

        pods_comment = f"rule to ACCEPT traffic from source pods to dest pods selected by policy name {name} namespace {ns}"
        if "ingress" in policy.policy_types:
            named_in: dict = {}
            _grab_named_ports(targets, named_in)
            dst = refresh(f"KUBE-DST-{h(ns, name, 'IPv4')}", "hash:ip", plain(_v4(targets)))
            everyone = f"rule to ACCEPT traffic from all sources to dest pods selected by policy name: {name} namespace {ns}"
            blocks_comment = f"rule to ACCEPT traffic from specified ipBlocks to dest pods selected by policy name: {name} namespace {ns}"
            for i, rule in enumerate(policy.ingress):
                sources = [p for peer in rule.peers for p in peer_pods(policy, peer)]
                numeric, named = _ports(rule.ports, named_in) if rule.ports else ([], [])

                def named_set(j: int, kind: str = "hash:ip", i=i, named=named) -> str:
                    return refresh(f"KUBE-DST-{h(ns, name, 'ingressrule', str(i), str(j), 'IPv4', 'namedport')}", kind,
                                   plain(named[j].ips["ipv4"]))

                if sources:
                    src = refresh(f"KUBE-SRC-{h(ns, name, 'ingressrule', str(i), 'IPv4', 'pod')}", "hash:ip", plain(_v4(sources)))
                    for protocol, port, end in numeric:
                        append(pods_comment, src, dst, protocol, port, end)
                    for j, eps in enumerate(named):
                        append(pods_comment, src, named_set(j), eps.protocol, str(eps.port), "")
                    if not numeric and not named:
                        append(pods_comment, src, dst, "", "", "")
                if not rule.peers and rule.ports:
                    for protocol, port, end in numeric:
                        append(everyone, "", dst, protocol, port, end)
                    for j, eps in enumerate(named):
                        append(everyone, "", named_set(j), eps.protocol, str(eps.port), "")
                if not rule.peers and not rule.ports:
                    append(everyone, "", dst, "", "", "")
                entries = _ip_block_entries(rule.peers)
                if entries:
                    src = refresh(f"KUBE-SRC-{h(ns, name, 'ingressrule', str(i), 'IPv4', 'ipblock')}", "hash:net", entries)
                    if rule.ports:
                        for protocol, port, end in numeric:
                            append(blocks_comment, src, dst, protocol, port, end)
                        for j, eps in enumerate(named):
                            append(blocks_comment, src, named_set(j, "hash:net"), eps.protocol, str(eps.port), "")
                    else:
                        append(blocks_comment, src, dst, "", "", "")
        if "egress" in policy.policy_types:
            src = refresh(f"KUBE-SRC-{h(ns, name, 'IPv4')}", "hash:ip", plain(_v4(targets)))
            anywhere = f"rule to ACCEPT traffic from source pods to all destinations selected by policy name: {name} namespace {ns}"
            blocks_comment = f"rule to ACCEPT traffic from source pods to specified ipBlocks selected by policy name: {name} namespace {ns}"
            for i, rule in enumerate(policy.egress):
                destinations = [p for peer in rule.peers for p in peer_pods(policy, peer)]
                named_out: dict = {}
                if not rule.peers and any(isinstance(p.port, str) for p in rule.ports):
                    # A named port of a rule without `to` resolves on the policy's own namespace.
                    _grab_named_ports([p for p in actionable if p.namespace == ns], named_out)
                else:
                    _grab_named_ports(destinations, named_out)
                numeric, named = _ports(rule.ports, named_out) if rule.ports else ([], [])
                if destinations:
                    dst = refresh(f"KUBE-DST-{h(ns, name, 'egressrule', str(i), 'IPv4', 'pod')}", "hash:ip", plain(_v4(destinations)))
                    for protocol, port, end in numeric:
                        append(pods_comment, src, dst, protocol, port, end)
                    for j, eps in enumerate(named):
                        endpoints = refresh(f"KUBE-DST-{h(ns, name, 'egressrule', str(i), str(j), 'IPv4', 'namedport')}", "hash:ip",
                                            plain(eps.ips["ipv4"]))
                        append(pods_comment, src, endpoints, eps.protocol, str(eps.port), "")
                    if not numeric and not named:
                        append(pods_comment, src, dst, "", "", "")
                if not rule.peers and rule.ports:
                    for protocol, port, end in numeric:
                        append(anywhere, src, "", protocol, port, end)
                    for eps in named:
                        append(anywhere, src, "", eps.protocol, str(eps.port), "")
                if not rule.peers and not rule.ports:
                    append(anywhere, src, "", "", "", "")
                entries = _ip_block_entries(rule.peers)
                if entries:
                    dst = refresh(f"KUBE-DST-{h(ns, name, 'egressrule', str(i), 'IPv4', 'ipblock')}", "hash:net", entries)
                    if rule.ports:
                        for protocol, port, end in numeric:
                            append(blocks_comment, src, dst, protocol, port, end)
                    else:
                        append(blocks_comment, src, dst, "", "", "")

    local = sorted((p for p in actionable if p.node == node and p.addresses("ipv4")),
                   key=lambda p: ipaddress.ip_address(p.addresses("ipv4")[0]))
    for pod in local:
        ip, ns, name = pod.addresses("ipv4")[0], pod.namespace, pod.name
        chain = f"KUBE-POD-FW-{h(ns, name, sync_version)}"
        mine = [k for k in sorted(cluster.policies) if pod in targets_of[k]]
        types = {t for k in mine for t in cluster.policies[k].policy_types}
        body = chains[chain] = [
            f'-A {chain} -m comment --comment "rule for stateful firewall for pod" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT',
            f'-A {chain} -m comment --comment "rule to drop invalid state for pod" -m conntrack --ctstate INVALID -j DROP',
            f'-A {chain} -d {ip}/32 -m comment --comment "rule to permit the traffic traffic to pods when source is the pod\\\'s local node" '
            "-m addrtype --src-type LOCAL -j ACCEPT",
        ]
        if "egress" not in types:
            body.append(f'-A {chain} -s {ip}/32 -m comment --comment "run through default egress network policy chain" -j KUBE-NWPLCY-DEFAULT')
        if "ingress" not in types:
            body.append(f'-A {chain} -d {ip}/32 -m comment --comment "run through default ingress network policy chain" -j KUBE-NWPLCY-DEFAULT')
        for key in reversed(mine):  # each inserted at position 1
            kinds = cluster.policies[key].policy_types
            where = "" if len(kinds) == 2 else f"-d {ip}/32 " if "ingress" in kinds else f"-s {ip}/32 "
            body.append(f'-A {chain} {where}-m comment --comment "run through nw policy {cluster.policies[key].name}" -j {policy_chain[key]}')
        body += [
            f'-A {chain} -m comment --comment "rule to log dropped traffic POD name:{name} namespace: {ns}" -m mark ! --mark {MARK} '
            "-m limit --limit 10/min --limit-burst 10 -j NFLOG --nflog-group 100",
            f'-A {chain} -m comment --comment "rule to REJECT traffic destined for POD name:{name} namespace: {ns}" -m mark ! --mark {MARK} '
            "-j REJECT --reject-with icmp-port-unreachable",
            f"-A {chain} -j MARK --set-xmark 0x0/0x10000",
            f'-A {chain} -m comment --comment "set mark to ACCEPT traffic that comply to network policies" -j MARK --set-xmark 0x20000/0x20000',
        ]
        to = f'-m comment --comment "rule to jump traffic destined to POD name:{name} namespace: {ns} to chain {chain}" -j {chain}'
        out = f'-m comment --comment "rule to jump traffic from POD name:{name} namespace: {ns} to chain {chain}" -j {chain}'
        chains["KUBE-ROUTER-FORWARD"] += [f"-A KUBE-ROUTER-FORWARD -d {ip}/32 {to}", f"-A KUBE-ROUTER-FORWARD -d {ip}/32 -m physdev --physdev-is-bridged {to}",
                                          f"-A KUBE-ROUTER-FORWARD -s {ip}/32 {out}", f"-A KUBE-ROUTER-FORWARD -s {ip}/32 -m physdev --physdev-is-bridged {out}"]
        chains["KUBE-ROUTER-OUTPUT"] += [f"-A KUBE-ROUTER-OUTPUT -d {ip}/32 {to}", f"-A KUBE-ROUTER-OUTPUT -s {ip}/32 {out}"]
        chains["KUBE-ROUTER-INPUT"].append(f"-A KUBE-ROUTER-INPUT -s {ip}/32 {out}")
    for builtin, digest in BUILTIN_JUMPS.items():
        chains[builtin].append(f'-A {builtin} -m comment --comment "kube-router netpol - {digest}" -j KUBE-ROUTER-{builtin}')
        chains[f"KUBE-ROUTER-{builtin}"].append(f"-A KUBE-ROUTER-{builtin} {EXPLICIT_ACCEPT}")
    order = ["INPUT", "FORWARD", "OUTPUT"] + sorted(c for c in chains if c not in BUILTIN_JUMPS)
    lines = ["# Generated by iptables-save v1.8.9 (nf_tables)", "*filter"]
    lines += [f":{c} ACCEPT [0:0]" if c in BUILTIN_JUMPS else f":{c} - [0:0]" for c in order]
    lines += [rule for c in order for rule in chains[c]] + ["COMMIT", "# Completed"]
    saved = []
    for name in sorted(sets):
        kind, members = sets[name]
        saved.append(f"create {name} {kind} family inet hashsize 1024 maxelem 65536 timeout 0 bucketsize 12 initval 0x00000000")
        saved += [f"add {name} {element.removesuffix('/32')} timeout 0" + (f" {flag}" if flag else "") for element, flag in members.items()]
    return "\n".join(lines) + "\n", "\n".join(saved) + "\n"


def normalized(iptables_save: str, ipset_save: str) -> tuple[dict[str, list[str]], list[str]]:
    """A dump without the orders that kube-router takes from Go maps: ({chain: rules}, set names).

    Each ``--match-set NAME`` becomes the set's type and sorted members (named-port sets are
    numbered in map order); a policy chain's rules (MARK/RETURN pairs: any order gives the same
    verdict) are sorted; elsewhere each run of consecutive jumps to pod chains or to policy chains
    is sorted. Set names are returned sorted.
    """
    sets = {}
    for name, saved in parse_ipset_save(ipset_save).items():
        members = sorted(" ".join(w for w in add.split()[2:] if w not in ("timeout", "0")) for add in saved.adds)
        sets[name] = f"<{saved.create.split()[2]} {','.join(members)}>"
    table = parse_iptables_save(iptables_save)["filter"]
    chains: dict[str, list[str]] = {c: [] for c in table.chains}
    for rule in table.rules:
        chains[rule.chain].append(re.sub(r"--match-set (\S+)", lambda m: f"--match-set {sets[m.group(1)]}", rule.text))
    for chain, rules in chains.items():
        if re.fullmatch(r"KUBE-NWPLCY-[A-Z2-7]{16}", chain):
            chains[chain] = sorted(rules)
            continue
        runs: list[list[str]] = []
        for rule in rules:
            kind = re.search(r"-j (KUBE-POD-FW|KUBE-NWPLCY)-", rule)
            if runs and kind and runs[-1][0] == kind.group(1):
                runs[-1].append(rule)
            else:
                runs.append([kind.group(1) if kind else "", rule])
        chains[chain] = [r for run in runs for r in (sorted(run[1:]) if run[0] else run[1:])]
    return chains, sorted(sets)


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.iterdir()))
def test_emulator_writes_what_the_real_kube_router_wrote(fixture):
    """The emulator, given the fixture's cluster and sync version, writes the real v2.1.0 dump
    (up to Go's map orders): every chain, rule, comment, set name and set member."""
    base = FIXTURES / fixture
    sync_version = re.search(r"sync version (\d+)", (base / "README.md").read_text()).group(1)  # type: ignore[union-attr]
    ours = kube_router_dump(cluster_from_yaml((base / "cluster.yaml").read_text()), "node1", sync_version)
    real = (base / "node1.iptables-save").read_text(), (base / "node1.ipset-save").read_text()
    assert normalized(*ours) == normalized(*real)


def _placed(cluster: Cluster, node: str) -> Cluster:
    """Every pod on ``node`` with an address from 10.244.1.10 up, as a running cluster has them."""
    pods = {key: dataclasses.replace(pod, node=node, ips=(f"10.244.1.{10 + i}",))
            for i, (key, pod) in enumerate(sorted(cluster.pods.items()))}
    return dataclasses.replace(cluster, pods=pods)


def _compare(cluster: Cluster, node: str, iptables_save: str | None = None, **kwargs):
    emulated, ipset_save = kube_router_dump(cluster, node)
    dump = select({"ipv4": iptables_save or emulated}, ipset_save)
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
    """Deliberate difference 2: kube-router puts every ipBlock peer of a rule into one hash:net set
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


NAMED_PORTS = FIXTURES / "named-ports-and-ranges" / "cluster.yaml"


@pytest.mark.kernel
def test_named_port_of_an_egress_rule_without_to():
    """Deliberate difference 3: np/client-egress allows UDP port ``dns`` to any pod. kube-router
    resolves ``dns`` on the pods of namespace np (5353) and allows UDP 5353 to every destination;
    by the API each destination pod resolves it (other/dns: 53; pods without a port named dns:
    nothing). nftpolicy follows the API: exactly these five cells differ."""
    cluster = cluster_from_yaml(NAMED_PORTS.read_text())
    report = _compare(cluster, "node1")
    assert {(d.spec, d.src, d.dst, d.kube_router, d.nftpolicy) for d in report.differences} == {
        (ProbeSpec(53, "UDP"), "np/client", "other/dns", False, True),
        (ProbeSpec(5353, "UDP"), "np/client", "np/batch", True, False),
        (ProbeSpec(5353, "UDP"), "np/client", "np/web-2", True, False),
        (ProbeSpec(5353, "UDP"), "np/client", "other/dns", True, False),
        (ProbeSpec(5353, "UDP"), "np/client", "other/mdns", True, False),
    }
    assert {d.note for d in report.differences} == {NAMED_PORT_NOTE.format("np/client-egress")}


def with_icmp_echo_accept(iptables_save: str) -> str:
    """The dump with what later kube-router releases add: a ``KUBE-NWPLCY-COMMON`` chain that
    accepts ICMP echo requests, jumped to first from every pod chain."""
    text = iptables_save.replace("*filter\n", "*filter\n:KUBE-NWPLCY-COMMON - [0:0]\n", 1)
    text = re.sub(r'^(-A (KUBE-POD-FW-\S+) -m comment --comment "rule for stateful firewall for pod")',
                  r"-A \2 -j KUBE-NWPLCY-COMMON\n\1", text, flags=re.M)
    echo = '-A KUBE-NWPLCY-COMMON -p icmp -m comment --comment "allow icmp echo requests" -m icmp --icmp-type 8 -j ACCEPT'
    return text.replace("COMMIT\n", echo + "\nCOMMIT\n", 1)


@pytest.mark.kernel
def test_icmp_echo_goes_through_the_policies_unless_the_dump_accepts_it():
    """kube-router v2.1.0 has no ICMP rule of its own: a ping goes through the policies like any
    packet, as in nftpolicy, so the shop example gives no difference with ``--icmp``. A dump of a
    later release, whose KUBE-NWPLCY-COMMON accepts every echo request, lets through the pings that
    the policies deny; each such cell carries the ICMP note."""
    cluster = example_cluster()
    assert _compare(cluster, "node1", icmp=True).differences == []
    emulated, _ = kube_router_dump(cluster, "node1")
    report = _compare(cluster, "node1", with_icmp_echo_accept(emulated), icmp=True)
    assert report.differences, "the echo rule must allow pings that the policies deny"
    for d in report.differences:
        assert d.spec == ProbeSpec(0, "ICMP") and (d.kube_router, d.nftpolicy) == (True, False) and d.note == ICMP_NOTE
    assert ("ops/prometheus-0", "shop/api-5f6b7c9d4-q8w2n") in {(d.src, d.dst) for d in report.differences}
