"""A fuzzer for the text and shape of objects (issue 29): hypothesis strategies that build what
the API server accepts, at its schemas' limits, and what it refuses, and :func:`trial`, which
feeds one such cluster to the agent's path (store, reconcile loop, real libnftables), to
``render``'s (YAML, nft syntax through ``nft -f``) and to the iptables variant (``ipset restore``,
``iptables-restore``), each in a network namespace of the caller's.

What the API server accepts (kube-apiserver 1.36 validation; the ClusterNetworkPolicy CRD of
sigs.k8s.io/network-policy-api v0.2.0, ``.tools/crd/clusternetworkpolicies.yaml``):

* object names: a Namespace an RFC 1123 label (63), a Pod, NetworkPolicy, Node or
  ClusterNetworkPolicy an RFC 1123 subdomain (253, the CRD's names too);
* label keys ``[prefix/]name`` (prefix a subdomain, name 63 of ``[A-Za-z0-9_.-]``), values 63;
  NetworkPolicy selectors the same; port names IANA service names (15);
* in a ClusterNetworkPolicy only what its schema checks: rule ``name`` any string of at most 100
  characters, ``destinationNamedPort`` any string, selectors' keys and values any string (the
  schema has no pattern there: the agent's validation refuses what Kubernetes' label rules
  refuse, and fails closed), ``domainNames`` the DomainName pattern, ``networks`` CIDRs of at
  most 43 characters; 25 rules per direction, 25 peers, protocols, networks and names per rule.

What it refuses, for the agent's validation path (:func:`refused_by_the_api`): any field of any
object replaced by another type or by hostile text.
"""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import subprocess
from dataclasses import dataclass, field
from typing import Any

import yaml
from hypothesis import strategies as st

from nftpolicy.agent.dataplane.iptables import IptablesDataplane, IptablesError
from nftpolicy.agent.dataplane.nftables import NftDataplane
from nftpolicy.agent.daemon.health import Health
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.reconcile import Reconciler
from nftpolicy.agent.daemon.store import KINDS, Store
from nftpolicy.translators import nfttext, transaction
from nftpolicy.translators.manifests import build_cluster, parse_documents
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import Config

NODE = "node1"
MAX_ITEMS = 25  # the CRD's MaxItems for rules per direction, peers, protocols, networks, domain names
SPECIAL = ['"', "'", "\\", "{", "}", "#", "\n", "\r", "\t", "$", ";", "\x00", "\x7f", "\x85", "\u202e", "\u2028", "\ufeff",
           "\ud800", "é", "😀", " ", "@", "`", "%"]
# hostile text: any code point (surrogates too: a YAML manifest can hold one), the special ones often
hostile = st.text(st.one_of(st.sampled_from(SPECIAL), st.characters(exclude_categories=())), max_size=100)
_LABEL_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"


def _name(chars: str, inner: str, low: int, high: int) -> st.SearchStrategy[str]:
    """Names of ``low``-``high`` characters of ``chars`` and ``inner`` (never first or last)."""
    def edges(text: str) -> str:
        return "".join("a" if c in inner and i in (0, len(text) - 1) else c for i, c in enumerate(text))
    return st.text(chars + inner, min_size=low, max_size=high).map(edges)


dns_label = st.one_of(_name(_LABEL_CHARS, "-", 1, 8), _name(_LABEL_CHARS, "-", 63, 63))


def _subdomain(labels: list[str]) -> str:
    return ".".join(labels)[:253].rstrip(".-")


subdomain = st.one_of(
    st.lists(_name(_LABEL_CHARS, "-", 1, 10), min_size=1, max_size=3).map(_subdomain),
    st.tuples(*[_name(_LABEL_CHARS, "-", n, n) for n in (63, 63, 63, 61)]).map(lambda p: ".".join(p)),  # 253 exactly
)
_KEY_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
label_name = st.one_of(_name(_KEY_CHARS, "-_.", 1, 10), _name(_KEY_CHARS, "-_.", 63, 63))
label_key = st.one_of(label_name, st.builds(lambda p, n: f"{p}/{n}", subdomain, label_name))
label_value = st.one_of(st.just(""), label_name)
labels = st.dictionaries(label_key, label_value, max_size=4)
iana_name = _name("abcdefghijklmnopqrstuvwxyz", "-", 1, 15).filter(lambda s: "--" not in s)
port = st.integers(1, 65535)
protocol = st.sampled_from(["TCP", "UDP", "SCTP"])


def _network(version: int, address: int, prefix: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    bits = 32 if version == 4 else 128
    network = address >> (bits - prefix) << (bits - prefix) if prefix else 0
    return ipaddress.IPv4Network((network, prefix)) if version == 4 else ipaddress.IPv6Network((network, prefix))


@st.composite
def cidr(draw: st.DrawFn) -> str:
    """A CIDR of either family with its host bits clear (what a new object must have)."""
    version = draw(st.sampled_from([4, 6]))
    bits = 32 if version == 4 else 128
    return str(_network(version, draw(st.integers(0, 2**bits - 1)), draw(st.integers(0, bits))))


@st.composite
def address(draw: st.DrawFn) -> str:
    """An address of either family."""
    version = draw(st.sampled_from([4, 6]))
    return str(_network(version, draw(st.integers(0, 2**(32 if version == 4 else 128) - 1)), 32 if version == 4 else 128).network_address)


def _odds(hostile_odds: int, valid: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """``valid``, or one time in ``hostile_odds`` (0: never) :data:`hostile` text."""
    return st.integers(1, hostile_odds).flatmap(lambda i: hostile if i == 1 else valid) if hostile_odds else valid


@st.composite
def selector(draw: st.DrawFn, known: list[dict[str, str]], hostile_odds: int = 0) -> dict[str, Any]:
    """A meta/v1 LabelSelector: half the time empty (every object), else some labels of one of
    the ``known`` label sets (it selects that object) or labels of its own, and now and then
    expressions; keys and values :data:`hostile` one time in ``hostile_odds``."""
    keys, values = _odds(hostile_odds, label_key), _odds(hostile_odds, label_value)
    out: dict[str, Any] = {}
    choice = draw(st.integers(0, 3))
    if choice == 1 and any(known):
        pairs = sorted(draw(st.sampled_from([k for k in known if k])).items())
        out["matchLabels"] = dict(draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=2, unique=True)))
    elif choice == 2:
        out["matchLabels"] = draw(st.dictionaries(keys, values, max_size=3))
    if draw(st.integers(0, 3)) == 0:
        known_keys = sorted({k for labels in known for k in labels})
        expressions = []
        for _ in range(draw(st.integers(1, 2))):
            op = draw(st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"]))
            entry: dict[str, Any] = {"key": draw(st.sampled_from(known_keys) if known_keys and draw(st.booleans()) else keys), "operator": op}
            if op in ("In", "NotIn"):
                entry["values"] = draw(st.lists(values, min_size=1, max_size=3))
            expressions.append(entry)
        out["matchExpressions"] = expressions
    return out


def _count(draw: st.DrawFn, high: int, at_limit: bool) -> int:
    """A list length: small mostly, the limit now and then (``at_limit``: allowed here)."""
    return MAX_ITEMS if at_limit and draw(st.integers(0, 15)) == 0 else draw(st.integers(0 if high == 0 else 1, high))


@st.composite
def network_policy(draw: st.DrawFn, namespaces: list[str], port_names: list[str], pods: list[dict[str, str]],
                   namespace_labels: list[dict[str, str]]) -> dict[str, Any]:
    """A NetworkPolicy the API server accepts (selectors often of the ``pods``' and
    ``namespace_labels``' label sets)."""
    def peer() -> dict[str, Any]:
        kind = draw(st.sampled_from(["pod", "namespace", "both", "block"]))
        if kind == "block":
            base = draw(cidr())
            network = ipaddress.ip_network(base)
            excepts = [str(s) for s in draw(st.lists(st.sampled_from(list(network.subnets(prefixlen_diff=1)) if network.prefixlen < network.max_prefixlen
                                                                         else [network]), max_size=2, unique=True)) if s != network]
            return {"ipBlock": {"cidr": base, **({"except": excepts} if excepts else {})}}
        out: dict[str, Any] = {}
        if kind in ("pod", "both"):
            out["podSelector"] = draw(selector(pods))
        if kind in ("namespace", "both"):
            out["namespaceSelector"] = draw(selector(namespace_labels))
        return out

    def ports() -> list[dict[str, Any]]:
        found = []
        for _ in range(draw(st.integers(0, 3))):
            entry: dict[str, Any] = {"protocol": draw(protocol)}
            choice = draw(st.integers(0, 3))
            if choice == 1:
                first = draw(port)
                entry["port"] = first
                if draw(st.booleans()):
                    entry["endPort"] = draw(st.integers(first, 65535))
            elif choice == 2:
                entry["port"] = draw(st.sampled_from(port_names) if port_names and draw(st.booleans()) else iana_name)
            elif choice == 3:
                entry["port"] = draw(port)
            found.append(entry)
        return found

    spec: dict[str, Any] = {"podSelector": draw(selector(pods))}
    for direction, key in (("ingress", "from"), ("egress", "to")):
        if draw(st.booleans()):
            spec[direction] = [{key: [peer() for _ in range(draw(st.integers(0, 3)))], "ports": ports()}
                               for _ in range(draw(st.integers(0, 3)))]
    if draw(st.booleans()):
        spec["policyTypes"] = draw(st.lists(st.sampled_from(["Ingress", "Egress"]), min_size=1, max_size=2, unique=True))
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"namespace": draw(st.sampled_from(namespaces)), "name": draw(subdomain), "uid": draw(iana_name)}, "spec": spec}


domain_name = st.builds(lambda wild, labels, dot: ("*." if wild else "") + ".".join(labels) + ("." if dot else ""),
                        st.booleans(), st.lists(_name(_KEY_CHARS, "-_", 1, 12), min_size=2, max_size=4), st.booleans())
CNP_HOSTILE_ODDS = 40  # a ClusterNetworkPolicy selector's key or value: the CRD checks nothing there (the agent does)


@st.composite
def cluster_network_policy(draw: st.DrawFn, pod_labels: list[dict[str, str]], namespace_labels: list[dict[str, str]],
                           node_labels: list[dict[str, str]]) -> dict[str, Any]:
    """A ClusterNetworkPolicy the API server accepts (the CRD's schema and CEL rules), its
    selectors often of the given label sets, their keys and values sometimes hostile."""
    namespaces = selector(namespace_labels, CNP_HOSTILE_ODDS)

    def pods() -> dict[str, Any]:
        return {"namespaceSelector": draw(namespaces), "podSelector": draw(selector(pod_labels, CNP_HOSTILE_ODDS))}

    def rule(direction: str, small: bool) -> dict[str, Any]:
        action = draw(st.sampled_from(["Accept", "Deny", "Pass"]))
        kinds = ["namespaces", "pods"] + (["networks", "nodes"] + (["domainNames"] if action == "Accept" else []) if direction == "egress" else [])
        peers = []
        for _ in range(1 if small else _count(draw, 3, True)):
            kind = draw(st.sampled_from(kinds))
            if kind == "namespaces":
                peers.append({kind: draw(namespaces)})
            elif kind == "nodes":
                peers.append({kind: draw(selector(node_labels, CNP_HOSTILE_ODDS))})
            elif kind == "pods":
                peers.append({"pods": pods()})
            elif kind == "networks":
                peers.append({"networks": draw(st.lists(cidr(), min_size=1, max_size=1 if small else _count(draw, 3, True), unique=True))})
            else:
                peers.append({"domainNames": draw(st.lists(domain_name, min_size=1, max_size=_count(draw, 3, not small),
                                                           unique_by=lambda n: n.lower().rstrip(".")))})
        out: dict[str, Any] = {"action": action, ("from" if direction == "ingress" else "to"): peers}
        if draw(st.booleans()):
            out["name"] = draw(st.one_of(hostile, st.text(st.sampled_from(SPECIAL), min_size=100, max_size=100)))
        named_ok = not any(set(p) & {"networks", "nodes", "domainNames"} for p in peers)
        if draw(st.booleans()):
            protocols = []
            for _ in range(1 if small else _count(draw, 3, True)):
                if named_ok and draw(st.integers(0, 3)) == 0:
                    protocols.append({"destinationNamedPort": draw(st.one_of(iana_name, hostile.filter(bool)))})
                    continue
                first = draw(st.integers(1, 65534))
                where = {"number": first} if draw(st.booleans()) else {"range": {"start": first, "end": draw(st.integers(first + 1, 65535))}}
                protocols.append({draw(st.sampled_from(["tcp", "udp", "sctp"])): {"destinationPort": where}})
            out["protocols"] = protocols
        return out

    spec: dict[str, Any] = {"tier": draw(st.sampled_from(["Admin", "Baseline"])), "priority": draw(st.integers(0, 1000)),
                            "subject": {"namespaces": draw(namespaces)} if draw(st.booleans()) else {"pods": pods()}}
    for direction in ("ingress", "egress"):
        count = _count(draw, 2, True) if draw(st.booleans()) else 0
        if count:
            spec[direction] = [rule(direction, small=count == MAX_ITEMS) for _ in range(count)]
    return {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
            "metadata": {"name": draw(subdomain), "uid": draw(iana_name), "generation": 1}, "spec": spec}


@st.composite
def cluster(draw: st.DrawFn, cluster_policies: bool = True) -> list[dict[str, Any]]:
    """The API objects of a small cluster the API server accepts: Namespaces, the Nodes
    ``node1`` and ``node2``, Pods on them (running, one or two addresses, named container
    ports), NetworkPolicies and (``cluster_policies``) ClusterNetworkPolicies."""
    names = draw(st.lists(dns_label, min_size=1, max_size=3, unique=True))
    objects: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n, "labels": draw(labels)}} for n in names]
    namespace_labels = [{**o["metadata"]["labels"], "kubernetes.io/metadata.name": o["metadata"]["name"]} for o in objects]
    node_labels = []
    for node in (NODE, "node2"):
        addresses = [{"type": draw(st.sampled_from(["InternalIP", "ExternalIP", "Hostname"])), "address": draw(address())}
                     for _ in range(draw(st.integers(0, 3)))]
        node_labels.append(draw(labels))
        objects.append({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": node_labels[-1]}, "status": {"addresses": addresses}})
    port_names: list[str] = []
    pod_labels = []
    for i in range(draw(st.integers(1, 4))):
        name_ports = [{"name": draw(iana_name), "containerPort": draw(port), "protocol": draw(protocol)} for _ in range(draw(st.integers(0, 2)))]
        port_names += [p["name"] for p in name_ports]
        ips = [{"ip": f"10.244.{i}.{draw(st.integers(1, 254))}"}] + ([{"ip": f"fd00::{i}:{draw(st.integers(1, 65535)):x}"}] if draw(st.booleans()) else [])
        pod_labels.append(draw(labels))
        objects.append({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"namespace": draw(st.sampled_from(names)), "name": draw(subdomain), "labels": pod_labels[-1]},
                        "spec": {"nodeName": draw(st.sampled_from([NODE, NODE, "node2"])), "containers": [{"name": "c", "ports": name_ports}]},
                        "status": {"phase": "Running", "podIPs": ips}})
    objects += [draw(network_policy(names, port_names, pod_labels, namespace_labels)) for _ in range(draw(st.integers(0, 3)))]
    if cluster_policies:
        objects += [draw(cluster_network_policy(pod_labels, namespace_labels, node_labels)) for _ in range(draw(st.integers(0, 3)))]
    return objects


anything = st.one_of(st.none(), st.booleans(), st.integers(-2, 70000), st.floats(allow_nan=True), hostile,
                     st.lists(st.one_of(st.integers(), hostile), max_size=2), st.dictionaries(hostile, hostile, max_size=2))


@st.composite
def refused_by_the_api(draw: st.DrawFn, cluster_policies: bool = True) -> list[dict[str, Any]]:
    """A :func:`cluster` in which one to three fields (at any depth, of any object) hold another
    type or hostile text: what the API server would refuse, for the agent's and render's own
    validation."""
    objects = draw(cluster(cluster_policies))
    for _ in range(draw(st.integers(1, 3))):
        places = []

        def walk(value: Any) -> None:
            for key in (value if isinstance(value, dict) else range(len(value)) if isinstance(value, list) else ()):
                places.append((value, key))
                walk(value[key])
        target = draw(st.sampled_from(objects))
        walk(target)
        holder, key = draw(st.sampled_from(places))
        holder[key] = draw(anything)
    return objects


# ---- one trial ----------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What one cluster gave: ``refused``, each batch a tool refused (what and why)."""

    refused: list[str] = field(default_factory=list)


def trial(objects: list[dict[str, Any]], nft_ns: str, iptables_ns: str, loader: str) -> Outcome:
    """Feed ``objects`` (deep-copied) to: the agent's store and reconcile loop, committing to
    the real libnftables in ``nft_ns`` (a full sync: refused if the sync fails or any policy had
    to be held fail-closed); ``render``'s path (YAML text, :func:`parse_documents`,
    :func:`build_cluster`, nft syntax loaded by ``nft -f`` in ``nft_ns``); and the iptables
    variant of the NetworkPolicies (``ipset restore`` and ``iptables-<loader>-restore`` in
    ``iptables_ns``). Returns what was refused; any other exception propagates (a traceback)."""
    outcome = Outcome()
    store, told = Store(Metrics()), []
    store.kernel_refused = lambda kind, obj, reason: told.append(f"{kind}: {reason}")
    for kind in KINDS:
        store.replace(kind, [copy.deepcopy(o) for o in objects if isinstance(o, dict) and o.get("kind") == kind])
    reconciler = Reconciler(store, Config(), NODE, Metrics(), Health(30.0), 0.0, 3600.0, NftDataplane("nftpolicy", nft_ns))
    if not reconciler.sync(full=True):
        outcome.refused.append(f"agent sync: {reconciler.health.sync_failure}")
    outcome.refused += [f"agent held {t}" for t in told]
    text = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects}, allow_unicode=False)
    documents, _ = parse_documents(text)
    built, _ = build_cluster(documents)
    model = build_rule_model(built, NODE)
    loaded = subprocess.run(["ip", "netns", "exec", nft_ns, "nft", "-f", "-"], input=nfttext.to_text(model), capture_output=True, text=True)
    if loaded.returncode != 0:
        outcome.refused.append(f"nft -f: {' '.join(loaded.stderr.split())[:300]}")
    without = build_rule_model(dataclasses.replace(built, cluster_policies={}), NODE)  # the variant declines them
    try:
        IptablesDataplane(iptables_ns, loader).run(transaction.full(without))
    except IptablesError as exc:
        outcome.refused.append(f"iptables-{loader}: {exc}")
    return outcome
