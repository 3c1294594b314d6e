"""Replay a kube-router node in the sandbox and compare its verdicts with nftpolicy's.

``nftpolicy compare --iptables-save FILE --ipset-save FILE --node NAME MANIFESTS...``: twin
sandboxes with the same pods at their real addresses (``status.podIPs`` from the manifests) and the
nodes' real addresses. In the first, node NAME's namespace gets kube-router's rules from the dump
(:mod:`nftpolicy.translators.kuberouter`: only its network policy chains, rules and sets, loaded
with ``ipset restore`` and ``iptables-restore`` of the loader the dump was saved with); in the
twin, the same namespace gets nftpolicy's nft ruleset for NAME. Other nodes get no rules in
either, so every difference comes from node NAME. Then every pair with an end on NAME is probed
on every port that a container or a policy names, and each cell where the two disagree is
reported with the pods, port, verdicts and the policies that select either end on that node.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Sequence

from nftpolicy.translators.kuberouter import Dump
from nftpolicy.translators.cases import target_address
from nftpolicy.translators.model import Cluster, Family, NetworkPolicy, Pod, PolicyRule
from nftpolicy.translators.rules import FAMILIES, Config
from nftpolicy.translators.verdict import Connection, DirectionVerdict, Enforcement, enforcement_of

from nftpolicy.agent.dataplane.iptables import IptablesBatch, IptablesDataplane
from .probes import ProbeSpec
from .replay import disagreements
from .sandbox import Sandbox, SandboxError

# The deliberate differences (docs/migration.md, "Deliberate differences"); each was seen with the real
# kube-router v2.1.0 (tests/fixtures/kube-router-v2.1.0, tests/test_real_dumps.py; CLUSTER_POLICY_NOTE:
# tests/test_cnp_conformance.py, the real kube-router beside the agents) except ICMP_NOTE,
# which only applies to a dump that has such an ACCEPT rule (Dump.accepts_icmp_echo): v2.1.0 has none.
ICMP_NOTE = ("deliberate: this kube-router accepts every ICMP echo request before the policies "
             "(KUBE-NWPLCY-COMMON of releases after v2.1.0); nftpolicy leaves echo to the policies")
BOTH_TYPES_NOTE = ("deliberate: kube-router jumps to a policy with both policyTypes without a direction "
                   "check, so one selected pod's rule of one direction allows the other direction ({})")
IPBLOCK_NOTE = ("deliberate: kube-router keeps every ipBlock peer of a rule in one hash:net set, so one peer's "
                "except (nomatch) cancels another peer's equal CIDR ({})")
CLUSTER_POLICY_NOTE = "deliberate: kube-router has no ClusterNetworkPolicy; in nftpolicy {} decides this cell"
NAMED_PORT_NOTE = ("deliberate: for an egress rule without `to`, kube-router resolves a named port on the pods "
                   "of the policy's own namespace and allows those numbers to every destination; nftpolicy "
                   "resolves it on each destination pod ({})")


@dataclass(frozen=True)
class Difference:
    """One cell where kube-router's dump and nftpolicy disagree (verdict None: not probed)."""

    spec: ProbeSpec
    family: Family
    src: str
    dst: str
    kube_router: bool | None
    nftpolicy: bool | None
    policies: tuple[str, ...]
    note: str | None = None


@dataclass
class Comparison:
    """What ``compare`` found: the cells probed and every difference, plus what was left out."""

    node: str
    local_pods: list[str]
    specs: list[ProbeSpec]
    families: list[Family]
    cells: int
    loader: str
    rules_kept: int
    differences: list[Difference] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    not_built: list[str] = field(default_factory=list)


def _selects(policy: NetworkPolicy, pod: Pod) -> bool:
    return pod.enforceable and policy.namespace == pod.namespace and policy.pod_selector.matches(pod.labels)


def involved_policies(engine: Enforcement, node: str, src: Pod, dst: Pod, family: Family) -> tuple[str, ...]:
    """``<ns>/<policy> (ingress of <pod>)`` for the policies isolating ``dst`` for ingress when it
    runs on ``node``, and ``(egress of <pod>)`` for those isolating ``src`` for egress there, as
    the verdict engine reads them from ``engine``'s rule model of ``node``."""
    verdict = engine.verdict(Connection(src.addresses(family)[0], dst.addresses(family)[0]))
    found = [(policy, side.direction, side.pod) for side in (verdict.ingress, verdict.egress) if side.node == node
             for policy in side.policies]
    return tuple(f"{policy} ({direction} of {pod})" for policy, direction, pod in sorted(found, key=lambda f: (f[0], f[1] != "ingress")))


def _except_cancels_peer(rule: PolicyRule) -> bool:
    blocks = [p.ip_block for p in rule.peers if p.ip_block is not None]
    return any(e == other.cidr for b in blocks for e in b.excepts for other in blocks if other is not b)


def _peerless_named_port(cluster: Cluster, policy: NetworkPolicy, spec: ProbeSpec, dst: Pod | None,
                         kube_router_allows: bool) -> bool:
    """True when an egress rule of ``policy`` without peers names a port that kube-router v2.1.0
    resolves otherwise than the API for ``spec`` to ``dst``.

    kube-router (pkg/controllers/netpol/policy.go, buildNetworkPoliciesInfo and processEgressRules)
    resolves such a name on the running pods of the policy's namespace and allows each number to
    any destination; the API resolves it on the destination pod (DESIGN.md section 3). With
    ``kube_router_allows`` the cell is one kube-router allows and the API does not, else the reverse.
    """
    for rule in policy.egress:
        if rule.peers:
            continue
        for port in rule.ports:
            if not isinstance(port.port, str) or port.protocol != spec.protocol:
                continue
            theirs = {p.resolve_port(port.port, port.protocol) for p in cluster.pods.values()
                      if p.enforceable and p.namespace == policy.namespace}
            ours = dst is not None and dst.resolve_port(port.port, port.protocol) == spec.port
            if (spec.port in theirs and not ours) if kube_router_allows else (ours and spec.port not in theirs):
                return True
    return False


def _cluster_rule(side: DirectionVerdict) -> str | None:
    """``ClusterNetworkPolicy <name> <direction> rule <i> (<action>)`` when a ClusterNetworkPolicy
    rule decided ``side``, else None."""
    if side.cluster_rule is None or side.cluster_action is None:
        return None
    rule = side.cluster_rule
    return f"ClusterNetworkPolicy {rule.policy} {rule.direction} rule {rule.rule} ({side.cluster_action.split()[1]})"


def explain(cluster: Cluster, spec: ProbeSpec, src: str, dst: str, kube_router: bool | None, ours: bool | None,
            icmp_echo_accepted: bool = False, family: Family = "ipv4", engine: Enforcement | None = None) -> str | None:
    """The documented deliberate difference that accounts for a cell of ``family``, if one does
    (docs/migration.md, "Deliberate differences"), else None. Which ClusterNetworkPolicy rule
    decides a cell is the verdict engine's answer (:mod:`nftpolicy.translators.verdict`) for every
    node: ``engine`` (one for every node of ``cluster``), else one made for this call.

    ``icmp_echo_accepted``: kube-router's rules accept every ICMP echo request before the policies
    (:attr:`~nftpolicy.translators.kuberouter.Dump.accepts_icmp_echo`; the real kube-router v2.1.0
    has no such rule, so a live v2.1.0 leaves it False).
    """
    if spec.protocol == "ICMP" and kube_router and not ours and icmp_echo_accepted:
        return ICMP_NOTE
    a, b = cluster.pods.get(src), cluster.pods.get(dst)
    source, destination = target_address(cluster, src, family), target_address(cluster, dst, family)
    if cluster.cluster_policies and source and destination and spec.protocol != "ICMP" and kube_router != ours:
        cell = Connection(source, destination, spec.protocol, spec.port)  # type: ignore[arg-type]
        verdict = (engine or enforcement_of(cluster)).verdict(cell)
        tiers = [rule for rule in map(_cluster_rule, (verdict.egress, verdict.ingress)) if rule is not None]
        if tiers:
            return CLUSTER_POLICY_NOTE.format(" and ".join(tiers))
    if ours and kube_router is False:
        overlapping = []
        for key, policy in sorted(cluster.policies.items()):
            for direction, pod in (("ingress", b), ("egress", a)):
                if pod and direction in policy.policy_types and _selects(policy, pod) \
                        and any(_except_cancels_peer(rule) for rule in policy.rules(direction)):
                    overlapping.append(key)
                    break
        if overlapping:
            return IPBLOCK_NOTE.format(", ".join(overlapping))
    if kube_router and not ours:
        both = [k for k, p in sorted(cluster.policies.items())
                if p.policy_types == {"ingress", "egress"} and a and b and _selects(p, a) and _selects(p, b)]
        if both:
            return BOTH_TYPES_NOTE.format(", ".join(both))
    if kube_router is not None and ours is not None and kube_router != ours and a:
        named = [k for k, p in sorted(cluster.policies.items())
                 if "egress" in p.policy_types and _selects(p, a) and _peerless_named_port(cluster, p, spec, b, kube_router)]
        if named:
            return NAMED_PORT_NOTE.format(", ".join(named))
    return None


def probe_specs(cluster: Cluster, extra: Sequence[ProbeSpec] = (), icmp: bool = False) -> list[ProbeSpec]:
    """Every container port, every numeric port a policy names (a range: both ends and the port
    after it), plus ``extra``; with ``icmp``, an echo request."""
    specs = {ProbeSpec(p.port, p.protocol) for pod in cluster.pods.values() if pod.enforceable for p in pod.ports}
    for policy in cluster.policies.values():
        for rule in policy.ingress + policy.egress:
            for port in rule.ports:
                if isinstance(port.port, int):
                    specs.add(ProbeSpec(port.port, port.protocol))
                    if port.end_port:
                        specs.add(ProbeSpec(port.end_port, port.protocol))
                        if port.end_port < 65535:
                            specs.add(ProbeSpec(port.end_port + 1, port.protocol))
    specs.update(extra)
    if icmp:
        specs.add(ProbeSpec(0, "ICMP"))
    return sorted(specs, key=lambda s: (s.protocol != "ICMP", s.port, s.protocol))


def compare(cluster: Cluster, node: str, dump: Dump, config: Config = Config(), timeout: float = 1.0,
            loader: str | None = None, extra: Sequence[ProbeSpec] = (), icmp: bool = False) -> Comparison:
    """Build the twins, load kube-router's dump and nftpolicy's ruleset on ``node``, probe, compare.

    ``loader`` (``nft``/``legacy``) defaults to what the dump's header says, else ``nft``.
    Raises SandboxError when ``node`` runs no pod of the cluster, IptablesError / NftError when a
    ruleset does not load.
    """
    loader = loader or dump.loader or "nft"
    pods, not_built = [], []
    for key in sorted(cluster.pods):
        pod = cluster.pods[key]
        if not pod.enforceable or not pod.node:
            why = "hostNetwork" if pod.host_network else f"phase {pod.phase}" if pod.phase in ("Succeeded", "Failed") \
                else "no IP" if not pod.ips else "no node"
            not_built.append(f"{key} ({why})")
        else:
            pods.append(pod)
    local = [p.key for p in pods if p.node == node]
    if not local:
        raise SandboxError(f"no running pod with an IP on node {node!r} in the manifests")
    families: list[Family] = [f for f in FAMILIES if f in dump.kept and any(p.addresses(f) for p in pods)]
    if not families:
        raise SandboxError(f"no pod has an address of the dump's families ({', '.join(sorted(dump.kept)) or 'none'})")
    specs = probe_specs(cluster, extra, icmp)
    pairs = [(a.key, b.key) for a in pods for b in pods if a.key != b.key and node in (a.node, b.node)]
    node_addresses = {n.name: n.addresses for n in cluster.nodes.values()}
    with contextlib.ExitStack() as stack:
        theirs = stack.enter_context(Sandbox(pods, (node,), families, node_addresses, config, timeout, f"iptables-{loader}"))
        ours = stack.enter_context(Sandbox(pods, (node,), families, node_addresses, config, timeout, "nft"))
        restore = {family: dump.restore(family) for family in families}
        their_dataplane = theirs.node_dataplane(node)
        assert isinstance(their_dataplane, IptablesDataplane)
        their_dataplane.load(IptablesBatch(dump.ipset(), restore, frozenset()))  # kube-router's, as saved
        ours.apply(cluster, nodes=[node])
        kube_router = theirs.probe(specs, families, pairs)
        nftpolicy = ours.probe(specs, families, pairs)
    report = Comparison(node, local, [s for s in specs if any(k[0] == s for k in nftpolicy)], families,
                    sum(len(m) for m in nftpolicy.values()), loader, dump.rule_count,
                    left_out=list(dump.left_out), not_built=not_built)
    engine = enforcement_of(cluster, [node], config)
    every_node = enforcement_of(cluster, config=config) if cluster.cluster_policies else None  # once, not per cell
    for spec, family, src, dst, a, b in disagreements(kube_router, nftpolicy):
        policies = involved_policies(engine, node, cluster.pods[src], cluster.pods[dst], family)
        report.differences.append(Difference(spec, family, src, dst, a, b, policies,
                                             explain(cluster, spec, src, dst, a, b, dump.accepts_icmp_echo, family, every_node)))
    return report


def cells_differ(count: int) -> str:
    """``1 cell differs`` or ``N cells differ``."""
    return f"{count} cell differs" if count == 1 else f"{count} cells differ"


def verdict(value: bool | None) -> str:
    """A probed cell as a word: ``allowed``, ``blocked``, or ``not probed`` (None)."""
    return "not probed" if value is None else "allowed" if value else "blocked"


def _spec(spec: ProbeSpec) -> str:
    return "ICMP/echo" if spec.protocol == "ICMP" else f"{spec.protocol}/{spec.port}"


def format_report(report: Comparison) -> str:
    """The report as ``nftpolicy compare`` prints it."""
    lines = [
        f"node {report.node}: {len(report.local_pods)} local pods ({', '.join(report.local_pods)})",
        f"kube-router: {report.rules_kept} rules of the dump loaded with iptables-{report.loader}-restore; "
        f"nftpolicy: nft ruleset for {report.node}",
        f"probed {report.cells} cells: {' '.join(_spec(s) for s in report.specs)} "
        f"({', '.join(report.families)}), every pair with an end on {report.node}",
    ]
    for d in report.differences:
        line = (f"DIFF {_spec(d.spec)} {d.family} {d.src} -> {d.dst}: kube-router {verdict(d.kube_router)}, "
                f"nftpolicy {verdict(d.nftpolicy)}; policies: {', '.join(d.policies) or 'none'}")
        lines.append(line + (f" [{d.note}]" if d.note else ""))
    if report.left_out:
        lines.append(f"left out of the dump ({len(report.left_out)}: not loaded into kube-router's twin; each line says why):")
        lines += [f"  {item}" for item in report.left_out]
    if report.not_built:
        lines.append(f"pods not built ({len(report.not_built)}): {', '.join(report.not_built)}")
    explained = sum(1 for d in report.differences if d.note)
    if report.differences:
        lines.append(f"{cells_differ(len(report.differences))} ({explained} by a documented deliberate difference)")
    else:
        lines.append("no difference: kube-router's rules and nftpolicy give the same verdict in every cell")
    return "\n".join(lines)
