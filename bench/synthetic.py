"""Deterministic synthetic clusters for the benchmarks, built directly as model objects.

The shape follows what a mid-sized production cluster looks like:

* namespaces ``<team>-<env>`` (labels ``team``, ``env``, ``kubernetes.io/metadata.name``) plus the
  system namespaces ``kube-system`` (CoreDNS, hostNetwork kube-proxy on every other node),
  ``monitoring`` (Prometheus) and ``ingress-nginx``;
* pods in Deployments (``app``, ``tier``, ``app.kubernetes.io/part-of``, ``pod-template-hash``)
  and StatefulSets (plus a per-pod ``statefulset.kubernetes.io/pod-name`` label), with named
  container ports by tier (``http``, ``grpc``, ``metrics``, ``postgres``, ``redis``,
  ``statsd``/UDP, ``diameter``/SCTP ...);
* a few pods that never count: Succeeded (some with an IP reused by a running pod), Pending
  without an IP, hostNetwork;
* ``node_pods`` running pods on ``node-0`` (the node rendered), the rest on ``node-1..`` with at
  most 110 pods each, each node with its own /24 (and /80 on dual-stack) pod CIDR;
* policies: per-namespace baselines (default-deny ingress or default-deny all + DNS egress), then
  a seeded stream of application policies mixing podSelector / namespaceSelector / both-in-one-peer
  peers, matchExpressions, ipBlock with except (and overlapping ipBlocks across peers), numeric
  ports, endPort ranges, protocol-only ports, named ports (ingress and egress), both policy types.

Everything is drawn from ``random.Random`` instances seeded from ``seed`` and a purpose string, so
equal arguments give equal clusters, and the policy stream is a prefix-stable sequence:
``generate(policies=2000)`` holds every policy of ``generate(policies=1000)`` (same names).

No selector in the stream is ``namespaceSelector: {}`` without a podSelector (a peer of every pod
in the cluster), so :func:`add_unmatched_pods` can add pods that no policy matches.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import random
from dataclasses import dataclass, replace
from typing import Any, Iterator

from nftpolicy.translators.model import (
    NAMESPACE_NAME_LABEL,
    Cluster,
    ContainerPort,
    IPBlock,
    Namespace,
    NetworkPolicy,
    Node,
    Peer,
    Pod,
    PolicyPort,
    PolicyRule,
)
from nftpolicy.translators.selectors import LabelSelector, Labels, Requirement

NODE = "node-0"
MAX_PODS_PER_NODE = 110

TEAMS = [
    "payments", "checkout", "catalog", "search", "identity", "billing", "shipping", "inventory",
    "pricing", "reviews", "recommend", "ads", "analytics", "notify", "media", "profile", "support",
    "fraud", "ledger", "loyalty", "partners", "geo", "booking", "chat", "feeds", "growth", "mobile",
    "platform", "data", "ml", "risk", "tax", "orders", "returns", "warehouse", "fleet", "quotes",
    "docs", "reports", "audit", "sso", "gateway", "cms", "seo", "mail", "sms", "wallet", "cards",
]
ENVS = ("prod", "staging", "dev")


def _ports(*spec: tuple[str, int, str]) -> tuple[ContainerPort, ...]:
    return tuple(ContainerPort(name, port, proto) for name, port, proto in spec)  # type: ignore[arg-type]


@dataclass(frozen=True)
class AppKind:
    """A workload template: app base name, tier, StatefulSet or Deployment, container ports."""

    base: str
    tier: str
    stateful: bool
    ports: tuple[ContainerPort, ...]


CATALOGUE = (
    AppKind("web", "frontend", False, _ports(("http", 8080, "TCP"), ("metrics", 9090, "TCP"))),
    AppKind("storefront", "frontend", False, _ports(("http", 8080, "TCP"), ("metrics", 9090, "TCP"))),
    AppKind("bff", "frontend", False, _ports(("http", 3000, "TCP"), ("https", 8443, "TCP"), ("metrics", 9090, "TCP"))),
    AppKind("api", "backend", False, _ports(("http", 8080, "TCP"), ("grpc", 9000, "TCP"), ("metrics", 9090, "TCP"))),
    AppKind("auth", "backend", False, _ports(("http", 8081, "TCP"), ("grpc", 9001, "TCP"), ("metrics", 9090, "TCP"))),
    AppKind("orders", "backend", False, _ports(("grpc", 9000, "TCP"), ("metrics", 9090, "TCP"))),
    AppKind("search", "backend", False, _ports(("http", 8080, "TCP"), ("metrics", 9090, "TCP"))),
    AppKind("worker", "worker", False, _ports(("metrics", 9090, "TCP"),)),
    AppKind("scheduler", "worker", False, _ports(("metrics", 9090, "TCP"),)),
    AppKind("postgres", "db", True, _ports(("postgres", 5432, "TCP"), ("metrics", 9187, "TCP"))),
    AppKind("mysql", "db", True, _ports(("mysql", 3306, "TCP"), ("metrics", 9104, "TCP"))),
    AppKind("redis", "cache", True, _ports(("redis", 6379, "TCP"), ("metrics", 9121, "TCP"))),
    AppKind("memcached", "cache", False, _ports(("memcache", 11211, "TCP"), ("metrics", 9150, "TCP"))),
    AppKind("kafka", "queue", True, _ports(("kafka", 9092, "TCP"), ("metrics", 9308, "TCP"))),
    AppKind("statsd", "telemetry", False, _ports(("statsd", 8125, "UDP"), ("metrics", 9102, "TCP"))),
    AppKind("diameter", "backend", False, _ports(("diameter", 3868, "SCTP"), ("metrics", 9090, "TCP"))),
)
CATALOGUE_WEIGHTS = (10, 4, 3, 12, 5, 5, 4, 8, 3, 4, 2, 4, 2, 2, 2, 1)
REPLICAS = (1, 2, 2, 3, 3, 3, 4, 5, 6, 8, 10, 12, 20)


@dataclass
class App:
    """One Deployment/StatefulSet of a namespace (what policies refer to)."""

    namespace: str
    name: str
    kind: AppKind
    replicas: int = 0


@dataclass
class NsInfo:
    name: str
    team: str
    env: str
    apps: list[App]

    def apps_of(self, *tiers: str) -> list[App]:
        return [a for a in self.apps if a.kind.tier in tiers]


def _rng(seed: int, purpose: str) -> random.Random:
    return random.Random(f"{seed}:{purpose}")


def _hash(*parts: object) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:10]


def sel(**labels: str) -> LabelSelector:
    """``matchLabels`` selector (keys with ``_`` spelt as given; use dict unpacking for others)."""
    return LabelSelector(match_labels=tuple(sorted(labels.items())))


def sel_of(labels: dict[str, str], *exprs: Requirement) -> LabelSelector:
    return LabelSelector(match_labels=tuple(sorted(labels.items())), match_expressions=tuple(exprs))


def req(key: str, op: str, *values: str) -> Requirement:
    return Requirement(key, op, frozenset(values))  # type: ignore[arg-type]


def net(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(text)


def block(cidr: str, *excepts: str) -> Peer:
    return Peer(ip_block=IPBlock(net(cidr), tuple(net(e) for e in excepts)))


ALL = LabelSelector()


# ---- nodes and addresses ----------------------------------------------------------------------

def node_cidr4(i: int) -> str:
    return f"10.{244 + i // 256}.{i % 256}.0/24"


def node_cidr6(i: int) -> str:
    return f"fd00:10:244:{i:x}::/80"


def node_address4(i: int) -> str:
    return f"192.168.{i // 250}.{i % 250 + 2}"


def pod_ip4(node: int, slot: int) -> str:
    return f"10.{244 + node // 256}.{node % 256}.{slot + 2}"


def pod_ip6(node: int, slot: int) -> str:
    return f"fd00:10:244:{node:x}::{slot + 2:x}"


def _nodes(count: int, dual_stack: bool) -> dict[str, Node]:
    nodes = {}
    for i in range(count):
        cidrs = (node_cidr4(i), node_cidr6(i)) if dual_stack else (node_cidr4(i),)
        addrs = (node_address4(i), f"fd00:192:168::{i + 2:x}") if dual_stack else (node_address4(i),)
        nodes[f"node-{i}"] = Node(f"node-{i}", addrs, cidrs)
    return nodes


# ---- workloads ---------------------------------------------------------------------------------

@dataclass
class _PodSpec:
    namespace: str
    name: str
    labels: dict[str, str]
    ports: tuple[ContainerPort, ...]
    host_network: bool = False


def _workload_pods(app: App, team: str, rng: random.Random) -> list[_PodSpec]:
    kind = app.kind
    common = {"app": app.name, "tier": kind.tier, "app.kubernetes.io/part-of": team}
    pods = []
    if kind.stateful:
        revision = f"{app.name}-{_hash(app.namespace, app.name)[:10]}"
        for i in range(app.replicas):
            name = f"{app.name}-{i}"
            labels = dict(common, **{"controller-revision-hash": revision, "statefulset.kubernetes.io/pod-name": name})
            pods.append(_PodSpec(app.namespace, name, labels, kind.ports))
    else:
        template = _hash(app.namespace, app.name, "rs")
        canary = app.replicas >= 4 and rng.random() < 0.15
        for i in range(app.replicas):
            labels = dict(common, **{"pod-template-hash": template, "version": "v2"})
            if canary and i == 0:
                labels.update({"pod-template-hash": _hash(app.namespace, app.name, "canary"), "version": "canary"})
            name = f"{app.name}-{labels['pod-template-hash']}-{_hash(app.namespace, app.name, i)[:5]}"
            if any(p.name == name for p in pods):  # a 5-character suffix repeats in big deployments
                name = f"{app.name}-{labels['pod-template-hash']}-{_hash(app.namespace, app.name, i)[:10]}"
            pods.append(_PodSpec(app.namespace, name, labels, kind.ports))
    return pods


@dataclass
class Synthetic:
    """A generated cluster plus what the policy generator needs to refer to it."""

    cluster: Cluster
    namespaces: list[NsInfo]
    seed: int
    node_pods: int
    dual_stack: bool


def generate(pods: int, policies: int, namespaces: int, node_pods: int = 110, seed: int = 1,
             dual_stack: bool = False) -> Synthetic:
    """A cluster of exactly ``pods`` pods and ``policies`` policies in ``namespaces`` namespaces,
    ``node_pods`` of the pods running on ``node-0``."""
    if namespaces < 4:
        raise ValueError("need at least 4 namespaces (3 system + 1 application)")
    rng = _rng(seed, "workloads")
    nodes_needed = 1 + math.ceil(max(pods - node_pods, 0) / (MAX_PODS_PER_NODE - 1))
    # ---- namespaces
    teams = TEAMS[: max(2, (namespaces - 3 + 1) // 2)]
    infos: list[NsInfo] = [
        NsInfo("kube-system", "platform", "prod", []),
        NsInfo("monitoring", "platform", "prod", []),
        NsInfo("ingress-nginx", "platform", "prod", []),
    ]
    names_used: set[str] = set()
    for k in range(namespaces - 3):
        team = teams[k % len(teams)]
        env = ENVS[(k // len(teams)) % len(ENVS)]
        name = f"{team}-{env}"
        n = 2
        while name in names_used:
            name, n = f"{team}-{env}-{n}", n + 1
        names_used.add(name)
        infos.append(NsInfo(name, team, env, []))
    ns_objects = {}
    for info in infos:
        labels = {NAMESPACE_NAME_LABEL: info.name, "team": info.team, "env": info.env}
        if info.team == "platform":
            labels["purpose"] = "system"
        elif rng.random() < 0.3:
            labels["istio-injection"] = "enabled"
        ns_objects[info.name] = Namespace(info.name, labels)
    # ---- workloads: system first, then application namespaces by weighted quota
    specs: list[_PodSpec] = []
    dns = 2 + pods // 2500
    specs += [_PodSpec("kube-system", f"coredns-{_hash('dns', i)[:10]}-{_hash('dnsp', i)[:5]}",
                       {"k8s-app": "kube-dns", "pod-template-hash": _hash("dns")},
                       _ports(("dns", 53, "UDP"), ("dns-tcp", 53, "TCP"), ("metrics", 9153, "TCP"))) for i in range(dns)]
    specs += [_PodSpec("kube-system", f"kube-proxy-{_hash('kp', i)[:5 if nodes_needed <= 100 else 8]}", {"k8s-app": "kube-proxy"}, (), host_network=True)
              for i in range(nodes_needed - 1)]
    specs += [_PodSpec("monitoring", f"prometheus-k8s-{i}", {"app": "prometheus", "app.kubernetes.io/name": "prometheus",
                                                             "statefulset.kubernetes.io/pod-name": f"prometheus-k8s-{i}"},
                       _ports(("web", 9090, "TCP"))) for i in range(2)]
    specs += [_PodSpec("ingress-nginx", f"ingress-nginx-controller-{_hash('ing', i)[:5]}",
                       {"app.kubernetes.io/name": "ingress-nginx", "app.kubernetes.io/component": "controller"},
                       _ports(("http", 80, "TCP"), ("https", 443, "TCP"), ("metrics", 10254, "TCP")))
              for i in range(2 + pods // 2000)]
    remaining = pods - len(specs)
    app_infos = infos[3:]
    weights = [rng.lognormvariate(0, 0.7) for _ in app_infos]
    total_w = sum(weights)
    quotas = [max(3, int(remaining * w / total_w)) for w in weights]
    quotas[-1] += remaining - sum(quotas)
    if quotas[-1] < 1:
        raise ValueError("too many namespaces for this many pods")
    for info, quota in zip(app_infos, quotas):
        ns_rng = _rng(seed, f"ns:{info.name}")
        left = quota
        counts: dict[str, int] = {}
        while left > 0:
            kind = ns_rng.choices(CATALOGUE, CATALOGUE_WEIGHTS)[0]
            counts[kind.base] = counts.get(kind.base, 0) + 1
            name = kind.base if counts[kind.base] == 1 else f"{kind.base}-{counts[kind.base]}"
            replicas = min(left, ns_rng.choice(REPLICAS))
            app = App(info.name, name, kind, replicas)
            info.apps.append(app)
            specs += _workload_pods(app, info.team, ns_rng)
            left -= replicas
    assert len(specs) == pods, (len(specs), pods)
    # ---- placement: node_pods running pods on node-0, the rest fill node-1.. (kube-proxy one per node)
    place = _rng(seed, "placement")
    eligible = [i for i, s in enumerate(specs) if not s.host_network]
    place.shuffle(eligible)
    local = set(eligible[:node_pods])
    node_of: dict[int, int] = {i: 0 for i in local}
    others = [i for i in range(len(specs)) if i not in local and not specs[i].host_network]
    place.shuffle(others)
    proxies = [i for i, s in enumerate(specs) if s.host_network]
    for n, i in enumerate(proxies):
        node_of[i] = n + 1
    per_node = MAX_PODS_PER_NODE - 1
    for k, i in enumerate(others):
        node_of[i] = 1 + k // per_node
    node_count = 1 + max([0] + [n for n in node_of.values()])
    # ---- addresses and phases (only pods not on node-0 are given odd phases)
    slots: dict[int, int] = {}
    status = _rng(seed, "status")
    pod_objects: dict[str, Pod] = {}
    running_ips_by_node: dict[int, list[tuple[str, ...]]] = {}
    order = sorted(range(len(specs)), key=lambda i: (node_of[i], i))
    for i in order:
        s, n = specs[i], node_of[i]
        phase = "Running"
        if s.host_network:
            ips: tuple[str, ...] = (node_address4(n),)
        else:
            roll = status.random() if n != 0 else 1.0
            if roll < 0.005:
                phase, ips = "Pending", ()
            elif roll < 0.015 and running_ips_by_node.get(n):
                # finished pod whose IP the kubelet already gave to a running pod
                phase, ips = status.choice(("Succeeded", "Failed")), status.choice(running_ips_by_node[n])
            else:
                slot = slots.get(n, 0)
                slots[n] = slot + 1
                ips = (pod_ip4(n, slot), pod_ip6(n, slot)) if dual_stack else (pod_ip4(n, slot),)
                if roll < 0.02:
                    phase = "Succeeded"  # finished pod still listing its (released) IP
                else:
                    running_ips_by_node.setdefault(n, []).append(ips)
        pod = Pod(s.namespace, s.name, Labels.interned(s.labels), f"node-{n}", ips, phase, s.host_network, s.ports)
        pod_objects[pod.key] = pod
    assert len(pod_objects) == pods, "pod names collided"
    synthetic = Synthetic(Cluster(ns_objects, pod_objects, {}, _nodes(node_count, dual_stack)), infos, seed, node_pods, dual_stack)
    return with_policies(synthetic, policies)


# ---- policies -----------------------------------------------------------------------------------

RFC1918 = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
DNS_PEER = Peer(pod_selector=sel(**{"k8s-app": "kube-dns"}), namespace_selector=sel(**{NAMESPACE_NAME_LABEL: "kube-system"}))
DNS_PORTS = (PolicyPort("UDP", 53), PolicyPort("TCP", 53))
INGRESS_CONTROLLER = Peer(pod_selector=sel(**{"app.kubernetes.io/name": "ingress-nginx"}),
                          namespace_selector=sel(**{NAMESPACE_NAME_LABEL: "ingress-nginx"}))
PROMETHEUS = Peer(pod_selector=sel(app="prometheus"), namespace_selector=sel(purpose="system", team="platform"))


def _policy(ns: str, name: str, target: LabelSelector, ingress=None, egress=None, types=None) -> NetworkPolicy:
    if types is None:
        types = {"ingress"} | ({"egress"} if egress is not None else set())
    return NetworkPolicy(ns, name, target, frozenset(types), tuple(ingress or ()), tuple(egress or ()))


def _baseline(info: NsInfo, rng: random.Random, dual_stack: bool) -> list[NetworkPolicy]:
    roll = rng.random()
    if roll < 0.65:
        return [_policy(info.name, "default-deny-ingress", ALL, types={"ingress"})]
    if roll < 0.85:
        return [_policy(info.name, "default-deny-all", ALL, types={"ingress", "egress"}),
                _policy(info.name, "allow-dns", ALL, egress=[PolicyRule((DNS_PEER,), DNS_PORTS)], types={"egress"})]
    return []


class _Stream:
    """Application policies drawn one after another from one seeded generator."""

    def __init__(self, syn: Synthetic) -> None:
        self.syn = syn
        self.rng = _rng(syn.seed, "policy-stream")
        self.app_ns = [i for i in syn.namespaces if i.apps]
        self.weights = [sum(a.replicas for a in i.apps) ** 0.5 for i in self.app_ns]
        self.teams = sorted({i.team for i in self.app_ns})
        self.templates = [
            (self.frontend_to_backend, 14), (self.from_ingress_controller, 8), (self.prometheus_scrape, 8),
            (self.backend_to_db, 10), (self.db_from_backend, 8), (self.egress_internet, 6),
            (self.partner_cidrs, 4), (self.cross_team_api, 7), (self.team_to_team_egress, 5),
            (self.match_expressions, 6), (self.cache_both_ways, 6), (self.udp_telemetry, 3),
            (self.allow_all_ingress, 2), (self.same_namespace, 4), (self.nodeport_egress, 2),
            (self.sctp_signalling, 1), (self.deny_egress, 2), (self.named_port_any_source, 2),
            (self.dns_by_name_anywhere, 1), (self.ingress_any_namespace_with_pod, 2),
        ]

    def next(self, k: int) -> NetworkPolicy:
        rng = self.rng
        info = rng.choices(self.app_ns, self.weights)[0]
        template = rng.choices([t for t, _ in self.templates], [w for _, w in self.templates])[0]
        policy = template(info, rng)
        return replace(policy, name=f"{policy.name}-{k:05d}")

    # helpers
    def app(self, info: NsInfo, rng: random.Random, *tiers: str) -> App:
        return rng.choice(info.apps_of(*tiers) or info.apps)

    def other_team(self, info: NsInfo, rng: random.Random) -> str:
        return rng.choice([t for t in self.teams if t != info.team] or self.teams)

    @staticmethod
    def target(app: App) -> LabelSelector:
        return sel(app=app.name)

    # templates
    def frontend_to_backend(self, info, rng):
        app = self.app(info, rng, "backend")
        port = PolicyPort("TCP", "http") if rng.random() < 0.5 else PolicyPort("TCP", 8080)
        return _policy(info.name, f"allow-frontend-to-{app.name}", self.target(app),
                       ingress=[PolicyRule((Peer(pod_selector=sel(tier="frontend")),), (port,))])

    def from_ingress_controller(self, info, rng):
        app = self.app(info, rng, "frontend")
        return _policy(info.name, f"allow-ingress-nginx-{app.name}", self.target(app),
                       ingress=[PolicyRule((INGRESS_CONTROLLER,), (PolicyPort("TCP", "http"), PolicyPort("TCP", 8443)))])

    def prometheus_scrape(self, info, rng):
        target = ALL if rng.random() < 0.4 else self.target(self.app(info, rng))
        return _policy(info.name, "allow-prometheus", target, ingress=[PolicyRule((PROMETHEUS,), (PolicyPort("TCP", "metrics"),))])

    def backend_to_db(self, info, rng):
        db = self.app(info, rng, "db")
        port = {"postgres": 5432, "mysql": 3306}.get(db.kind.base, 5432)
        ports = (PolicyPort("TCP", port),) if rng.random() < 0.5 else (PolicyPort("TCP", db.kind.ports[0].name),)
        return _policy(info.name, f"backend-to-{db.name}", sel(tier="backend"),
                       egress=[PolicyRule((Peer(pod_selector=self.target(db)),), ports),
                               PolicyRule((DNS_PEER,), DNS_PORTS)], types={"egress"})

    def db_from_backend(self, info, rng):
        db = self.app(info, rng, "db")
        same_team_backends = Peer(pod_selector=sel(tier="backend"),
                                  namespace_selector=sel_of({"team": info.team}, req("env", "In", "prod", "staging")))
        return _policy(info.name, f"{db.name}-from-backends", self.target(db),
                       ingress=[PolicyRule((Peer(pod_selector=sel(tier="backend")), same_team_backends),
                                           (PolicyPort("TCP", db.kind.ports[0].name),)),
                                PolicyRule((Peer(pod_selector=self.target(db)),), ())])  # replication between members

    def egress_internet(self, info, rng):
        app = self.app(info, rng, "backend", "worker")
        peers = [block("0.0.0.0/0", *RFC1918, "169.254.169.254/32")]
        if self.syn.dual_stack:
            peers.append(block("::/0", "fd00::/8", "fe80::/10"))
        return _policy(info.name, f"{app.name}-to-internet", self.target(app),
                       egress=[PolicyRule(tuple(peers), (PolicyPort("TCP", 443), PolicyPort("TCP", 80)))], types={"egress"})

    def partner_cidrs(self, info, rng):
        app = self.app(info, rng, "frontend", "backend")
        peers = (block("203.0.113.0/24", "203.0.113.128/25"), block("198.51.100.0/24"),
                 block("198.51.100.64/26"), block("203.0.113.192/26"))  # overlaps: another peer's except is not ours
        return _policy(info.name, f"{app.name}-from-partners", self.target(app),
                       ingress=[PolicyRule(peers, (PolicyPort("TCP", 443), PolicyPort("TCP", 8000, 8999)))])

    def cross_team_api(self, info, rng):
        app = self.app(info, rng, "backend")
        peers = (Peer(namespace_selector=sel(team=self.other_team(info, rng))),)
        return _policy(info.name, f"{app.name}-from-other-team", self.target(app),
                       ingress=[PolicyRule(peers, (PolicyPort("TCP", "grpc"), PolicyPort("TCP", 9000, 9100)))])

    def team_to_team_egress(self, info, rng):
        other = self.other_team(info, rng)
        peer = Peer(pod_selector=sel(tier="backend"), namespace_selector=sel(team=other, env=info.env))
        return _policy(info.name, f"backends-to-{other}", sel(tier="backend"),
                       egress=[PolicyRule((peer,), (PolicyPort("TCP", "grpc"), PolicyPort("TCP", "http")))], types={"egress"})

    def match_expressions(self, info, rng):
        a, b = (self.app(info, rng).name for _ in range(2))
        target = sel_of({}, req("tier", "In", "frontend", "backend"), req("version", "NotIn", "canary"))
        peers = (Peer(pod_selector=sel_of({}, req("app", "In", a, b))),
                 Peer(pod_selector=sel_of({}, req("tier", "Exists")),
                      namespace_selector=sel_of({}, req("env", "In", "prod", "staging"),
                                                req("team", "In", info.team, self.other_team(info, rng)))))
        return _policy(info.name, "allow-selected-tiers", target, ingress=[PolicyRule(peers, (PolicyPort("TCP", 8080),))])

    def cache_both_ways(self, info, rng):
        cache = self.app(info, rng, "cache")
        port = cache.kind.ports[0].name
        users = Peer(pod_selector=sel_of({}, req("tier", "In", "backend", "worker")))
        return _policy(info.name, f"{cache.name}-access", self.target(cache),
                       ingress=[PolicyRule((users,), (PolicyPort("TCP", port),))],
                       egress=[PolicyRule((Peer(pod_selector=self.target(cache)),), (PolicyPort("TCP", port),)),
                               PolicyRule((DNS_PEER,), DNS_PORTS)],
                       types={"ingress", "egress"})

    def udp_telemetry(self, info, rng):
        app = self.app(info, rng, "backend", "worker", "frontend")
        return _policy(info.name, f"{app.name}-telemetry", self.target(app),
                       egress=[PolicyRule((block("10.20.0.0/16", "10.20.255.0/24"),), (PolicyPort("UDP"),)),
                               PolicyRule((Peer(pod_selector=sel(tier="telemetry")),), (PolicyPort("UDP", "statsd"),))],
                       types={"egress"})

    def allow_all_ingress(self, info, rng):
        app = self.app(info, rng, "frontend")
        return _policy(info.name, f"{app.name}-allow-all", self.target(app), ingress=[PolicyRule()])

    def same_namespace(self, info, rng):
        return _policy(info.name, "allow-same-namespace", ALL, ingress=[PolicyRule((Peer(pod_selector=ALL),))])

    def nodeport_egress(self, info, rng):
        app = self.app(info, rng, "backend", "worker")
        return _policy(info.name, f"{app.name}-to-nodeports", self.target(app),
                       egress=[PolicyRule((block("192.168.0.0/16"),),
                                          (PolicyPort("TCP", 30000, 32767), PolicyPort("UDP", 30000, 32767)))], types={"egress"})

    def sctp_signalling(self, info, rng):
        app = self.app(info, rng, "backend")
        return _policy(info.name, f"{app.name}-sctp", self.target(app),
                       ingress=[PolicyRule((Peer(namespace_selector=sel(team=self.other_team(info, rng))),),
                                           (PolicyPort("SCTP", 3868), PolicyPort("SCTP", "diameter")))])

    def deny_egress(self, info, rng):
        app = self.app(info, rng, "worker", "db")
        return _policy(info.name, f"{app.name}-deny-egress", self.target(app), types={"egress"})

    def named_port_any_source(self, info, rng):
        app = self.app(info, rng, "frontend", "backend")
        return _policy(info.name, f"{app.name}-http-from-anywhere", self.target(app),
                       ingress=[PolicyRule((), (PolicyPort("TCP", "http"), PolicyPort("TCP", "https")))])

    def dns_by_name_anywhere(self, info, rng):
        app = self.app(info, rng)
        return _policy(info.name, f"{app.name}-dns-by-name", self.target(app),
                       egress=[PolicyRule((), (PolicyPort("UDP", "dns"), PolicyPort("TCP", "dns-tcp")))], types={"egress"})

    def ingress_any_namespace_with_pod(self, info, rng):
        app = self.app(info, rng, "frontend", "backend")
        peer = Peer(pod_selector=sel(**{"app.kubernetes.io/name": "prometheus"}), namespace_selector=ALL)
        return _policy(info.name, f"{app.name}-metrics-any-ns", self.target(app),
                       ingress=[PolicyRule((peer,), (PolicyPort("TCP", 9090),))])


def with_policies(syn: Synthetic, count: int) -> Synthetic:
    """The same pods with ``count`` policies: baselines per namespace first, then the stream."""
    base_rng = _rng(syn.seed, "baseline")
    baseline = [p for info in syn.namespaces if info.apps for p in _baseline(info, base_rng, syn.dual_stack)]
    baseline = baseline[: count // 2]
    stream = _Stream(syn)
    policies = baseline + [stream.next(k) for k in range(count - len(baseline))]
    by_key = {p.key: p for p in policies}
    assert len(by_key) == count, "policy names collided"
    return replace(syn, cluster=replace(syn.cluster, policies=by_key))


def add_unmatched_pods(syn: Synthetic, count: int, namespaces: int = 50) -> Synthetic:
    """``count`` more running pods on new nodes, in new namespaces (``team=batch``) with labels
    and port names that no policy of the stream refers to."""
    rng = _rng(syn.seed, "unmatched")
    cluster = syn.cluster
    first_node = len(cluster.nodes)
    ns_objects = dict(cluster.namespaces)
    pods = dict(cluster.pods)
    names = [f"batch-{k:03d}" for k in range(namespaces)]
    for name in names:
        ns_objects[name] = Namespace(name, {NAMESPACE_NAME_LABEL: name, "team": "batch", "env": "batch"})
    per_node = MAX_PODS_PER_NODE
    made = 0
    app_no = 0
    while made < count:
        ns = names[app_no % len(names)]
        replicas = min(count - made, rng.choice(REPLICAS))
        template = _hash(ns, app_no)
        for r in range(replicas):
            idx = made + r
            n, slot = first_node + idx // per_node, idx % per_node
            ips = (pod_ip4(n, slot), pod_ip6(n, slot)) if syn.dual_stack else (pod_ip4(n, slot),)
            pod = Pod(ns, f"etl-{app_no}-{template}-{r}", Labels.interned({"app": f"etl-{app_no}", "tier": "batch", "pod-template-hash": template}),
                      f"node-{n}", ips, "Running", False, _ports(("web", 8080, "TCP"), ("prom", 9100, "TCP")))
            pods[pod.key] = pod
        made += replicas
        app_no += 1
    node_count = first_node + math.ceil(count / per_node)
    nodes = _nodes(node_count, syn.dual_stack)
    return replace(syn, cluster=Cluster(ns_objects, pods, cluster.policies, nodes))


def pods_matched_by_policies(cluster: Cluster, keys) -> int:
    """How many of the pods ``keys`` any policy selects as a target or names as a peer: by
    selector, or as a pod resolving a named port of an egress rule with no peers or ipBlock peers
    (the translator enumerates every pod for those)."""
    targets: set[tuple[str, LabelSelector]] = set()
    peers: set[tuple[str, Peer]] = set()
    named: set[tuple[str, str]] = set()
    for pol in cluster.policies.values():
        targets.add((pol.namespace, pol.pod_selector))
        for direction in ("ingress", "egress"):
            for rule in pol.rules(direction):
                peers.update((pol.namespace, p) for p in rule.peers if p.ip_block is None)
                if direction == "egress" and (not rule.peers or any(p.ip_block for p in rule.peers)):
                    named.update((pp.port, pp.protocol) for pp in rule.ports if isinstance(pp.port, str))
    groups: dict[tuple[str, frozenset], list[Pod]] = {}
    for key in keys:
        pod = cluster.pods[key]
        groups.setdefault((pod.namespace, frozenset(pod.labels.items())), []).append(pod)
    by_ns: dict[str, list[LabelSelector | None]] = {}
    for ns in {ns for ns, _ in groups}:
        ns_labels = cluster.namespace_labels(ns)
        selectors: list[LabelSelector | None] = [s for n, s in targets if n == ns]
        for pol_ns, peer in peers:
            if (peer.namespace_selector is None and pol_ns == ns) or (
                    peer.namespace_selector is not None and peer.namespace_selector.matches(ns_labels)):
                selectors.append(peer.pod_selector)
        by_ns[ns] = selectors
    matched = 0
    for (ns, labels_fs), members in groups.items():
        labels = dict(labels_fs)
        if any(s is None or s.matches(labels) for s in by_ns[ns]) or any(
                (p.name, p.protocol) in named for m in members for p in m.ports):
            matched += len(members)
    return matched


# ---- the cluster as API manifests ----------------------------------------------------------------

def _selector(sel: LabelSelector | None) -> dict[str, Any] | None:
    if sel is None:
        return None
    out: dict[str, Any] = {}
    if sel.match_labels:
        out["matchLabels"] = dict(sel.match_labels)
    if sel.match_expressions:
        out["matchExpressions"] = [{"key": r.key, "operator": r.operator, **({"values": sorted(r.values)} if r.values else {})}
                                   for r in sel.match_expressions]
    return out


def _peer(peer: Peer) -> dict[str, Any]:
    if peer.ip_block is not None:
        return {"ipBlock": {"cidr": str(peer.ip_block.cidr), **({"except": [str(e) for e in peer.ip_block.excepts]} if peer.ip_block.excepts else {})}}
    out = {}
    if peer.pod_selector is not None:
        out["podSelector"] = _selector(peer.pod_selector)
    if peer.namespace_selector is not None:
        out["namespaceSelector"] = _selector(peer.namespace_selector)
    return out


def _port(port: PolicyPort) -> dict[str, Any]:
    out: dict[str, Any] = {"protocol": port.protocol}
    if port.port is not None:
        out["port"] = port.port
    if port.end_port is not None:
        out["endPort"] = port.end_port
    return out


def _rules(rules: tuple[PolicyRule, ...], peers_key: str) -> list[dict[str, Any]]:
    return [{**({peers_key: [_peer(p) for p in r.peers]} if r.peers else {}), **({"ports": [_port(p) for p in r.ports]} if r.ports else {})}
            for r in rules]


def policy_object(p: NetworkPolicy) -> dict[str, Any]:
    """A NetworkPolicy manifest for a model policy."""
    spec: dict[str, Any] = {"podSelector": _selector(p.pod_selector), "policyTypes": sorted(t.capitalize() for t in p.policy_types)}
    if p.ingress:
        spec["ingress"] = _rules(p.ingress, "from")
    if p.egress:
        spec["egress"] = _rules(p.egress, "to")
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": p.namespace, "name": p.name}, "spec": spec}


def pod_object(p: Pod) -> dict[str, Any]:
    """A Pod manifest (spec.nodeName, status.podIPs) for a model pod; labels in key order, as
    the API server (Go's JSON encoding of a map) sends them."""
    status: dict[str, Any] = {"phase": p.phase}
    if p.ips:
        status.update(podIP=p.ips[0], podIPs=[{"ip": ip} for ip in p.ips])
    ports = [{"containerPort": c.port, "protocol": c.protocol, **({"name": c.name} if c.name else {})} for c in p.ports]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": p.namespace, "name": p.name, "labels": dict(sorted(p.labels.items()))},
            "spec": {"nodeName": p.node, "hostNetwork": p.host_network, "containers": [{"name": "c", "ports": ports}]}, "status": status}


def namespace_object(ns: Namespace) -> dict[str, Any]:
    """A Namespace manifest for a model namespace."""
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns.name, "labels": dict(sorted(ns.labels.items()))}}


def api_objects(cluster: Cluster) -> Iterator[dict[str, Any]]:
    """Every namespace, pod and policy of ``cluster`` as API manifests (the inverse of
    translators.manifests, for serving a synthetic cluster or dumping it)."""
    for ns in cluster.namespaces.values():
        yield namespace_object(ns)
    for pod in cluster.pods.values():
        yield pod_object(pod)
    for policy in cluster.policies.values():
        yield policy_object(policy)
