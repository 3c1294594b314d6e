"""ClusterNetworkPolicy (``policy.networking.k8s.io/v1alpha2``): the model and its validation.

Source: sigs.k8s.io/network-policy-api v0.2.0, ``apis/v1alpha2/clusternetworkpolicy_types.go``
and the CRD it generates (``config/crd/{standard,experimental}``: the OpenAPI limits and the CEL
rules). A ClusterNetworkPolicy sits in the Admin tier (before every NetworkPolicy) or the
Baseline tier (after them, for pods no NetworkPolicy isolates); :mod:`nftpolicy.translators.tiers`
evaluates the order. Peers are namespaces, pods (a namespace selector AND a pod selector) and,
for egress, networks (CIDRs); ports are TCP, UDP or SCTP destination ports (a number or a range)
or a destination named port.

Validation is the CRD's: ``priority`` 0-1000, ``subject`` and every peer and protocol with
exactly one field, at most 25 rules per direction, 1-25 peers and protocols per rule, 1-25
networks per peer (no duplicates), rule names of at most 100 characters, port ranges with
``start < end``, no named port in an egress rule towards networks. The experimental ``nodes`` and
``domainNames`` peers are refused as not supported (nftpolicy does not enforce them), so that
an object is never read as allowing or denying less than it says.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from .manifests import InvalidField, _list, _mapping, _name, _network, selector_from
from .model import Direction, IPNetwork, LabelSelector, Protocol

API_VERSION = "policy.networking.k8s.io/v1alpha2"
Tier = Literal["Admin", "Baseline"]
Action = Literal["Accept", "Deny", "Pass"]
TIERS: tuple[Tier, ...] = ("Admin", "Baseline")
ACTIONS: tuple[Action, ...] = ("Accept", "Deny", "Pass")
MAX_PRIORITY = 1000
MAX_RULES = 25  # per direction (MaxItems on spec.ingress and spec.egress)
MAX_ITEMS = 25  # peers, protocols and networks (MaxItems)
MAX_RULE_NAME = 100
_PROTOCOL_FIELDS: dict[str, Protocol] = {"tcp": "TCP", "udp": "UDP", "sctp": "SCTP"}
_FIELDS = {
    "spec": {"tier", "priority", "subject", "ingress", "egress"},
    "subject": {"namespaces", "pods"},
    "ingress": {"name", "action", "from", "protocols"},
    "egress": {"name", "action", "to", "protocols"},
    "ingressPeer": {"namespaces", "pods"},
    "egressPeer": {"namespaces", "pods", "networks", "nodes", "domainNames"},
    "pods": {"namespaceSelector", "podSelector"},
    "protocol": {"tcp", "udp", "sctp", "destinationNamedPort"},
    "protocolPorts": {"destinationPort"},
    "port": {"number", "range"},
    "range": {"start", "end"},
}


class UnsupportedPeer(InvalidField):
    """A peer the CRD accepts and nftpolicy does not enforce (``nodes``, ``domainNames``)."""


@dataclass(frozen=True, slots=True)
class ClusterPeer:
    """One ``from``/``to`` peer: exactly one of ``namespaces`` (every pod of the namespaces it
    matches), ``pods`` (``(namespace selector, pod selector)``: pods matching both) or
    ``networks`` (egress only: CIDRs, host bits masked)."""

    namespaces: LabelSelector | None = None
    pods: tuple[LabelSelector, LabelSelector] | None = None
    networks: tuple[IPNetwork, ...] = ()


@dataclass(frozen=True, slots=True)
class ClusterPort:
    """One ``protocols`` entry: ``protocol`` with the destination ports ``first..last``
    (inclusive; a single number has ``first == last``), or a destination named port ``name``
    (``protocol`` None: the container port's own protocol)."""

    protocol: Protocol | None
    first: int = 0
    last: int = 0
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ClusterRule:
    """An ingress or egress rule: ``action`` on traffic from/to any of ``peers`` on any of
    ``ports`` (empty ``ports``: every port and protocol). ``name`` is the optional rule name."""

    action: Action
    peers: tuple[ClusterPeer, ...]
    ports: tuple[ClusterPort, ...] = ()
    name: str = ""


@dataclass(frozen=True, slots=True)
class ClusterNetworkPolicy:
    """A ClusterNetworkPolicy: ``tier``, ``priority`` (lower first), the subject (exactly one of
    ``subject_namespaces`` and ``subject_pods``, as in :class:`ClusterPeer`) and its rules in
    their written order (the first matching rule of a policy decides: the API reference)."""

    name: str
    tier: Tier
    priority: int
    subject_namespaces: LabelSelector | None = None
    subject_pods: tuple[LabelSelector, LabelSelector] | None = None
    ingress: tuple[ClusterRule, ...] = ()
    egress: tuple[ClusterRule, ...] = ()

    @property
    def key(self) -> str:
        """The object's name (cluster-scoped)."""
        return self.name

    def rules(self, direction: Direction) -> tuple[ClusterRule, ...]:
        """The rules of one direction, in precedence order."""
        return self.ingress if direction == "ingress" else self.egress

    def selects(self, namespace_labels: Mapping[str, str], pod_labels: Mapping[str, str]) -> bool:
        """True when the subject selects a pod with ``pod_labels`` in a namespace with
        ``namespace_labels`` (callers pass only enforceable pods: host-networked pods are never
        selected, says the API reference)."""
        return _selects(self.subject_namespaces, self.subject_pods, namespace_labels, pod_labels)


def _selects(namespaces: LabelSelector | None, pods: tuple[LabelSelector, LabelSelector] | None,
             namespace_labels: Mapping[str, str], pod_labels: Mapping[str, str]) -> bool:
    if namespaces is not None:
        return namespaces.matches(namespace_labels)
    assert pods is not None
    return pods[0].matches(namespace_labels) and pods[1].matches(pod_labels)


def peer_selects(peer: ClusterPeer, namespace_labels: Mapping[str, str], pod_labels: Mapping[str, str]) -> bool:
    """True when a namespaces or pods ``peer`` selects a pod with these labels (a networks peer
    selects addresses, not pods: False)."""
    if peer.networks:
        return False
    return _selects(peer.namespaces, peer.pods, namespace_labels, pod_labels)


def _known(value: Mapping[str, Any], part: str, path: str) -> None:
    unknown = sorted(str(k) for k in value if k not in _FIELDS[part])
    if unknown:
        raise InvalidField(f"{path}.{unknown[0]}", f"unknown field (expected one of {', '.join(sorted(_FIELDS[part]))})")


def _one_of(value: Mapping[str, Any], path: str, what: str) -> str:
    """The one field set in ``value`` (MinProperties=1, MaxProperties=1)."""
    present = [k for k, v in value.items() if v is not None]
    if len(present) != 1:
        fields = ", ".join(sorted(_FIELDS[what]))
        got = f"got {', '.join(sorted(present))}" if present else "got none"
        raise InvalidField(path, f"exactly one of {fields} must be set, {got}")
    return present[0]


def _count(items: list[Any], path: str, minimum: int, maximum: int) -> list[Any]:
    if not minimum <= len(items) <= maximum:
        raise InvalidField(path, f"must have {minimum} to {maximum} items, got {len(items)}")
    return items


def _namespaced_pods(value: Any, path: str) -> tuple[LabelSelector, LabelSelector]:
    """A NamespacedPod: ``namespaceSelector`` (absent or empty: every namespace) AND the required
    ``podSelector`` (empty: every pod)."""
    entry = _mapping(value, path)
    _known(entry, "pods", path)
    if entry.get("podSelector") is None:
        raise InvalidField(f"{path}.podSelector", "required")
    return (selector_from(entry.get("namespaceSelector"), f"{path}.namespaceSelector"),
            selector_from(entry["podSelector"], f"{path}.podSelector"))


def _networks(value: Any, path: str) -> tuple[IPNetwork, ...]:
    networks = []
    for i, text in enumerate(_count(_list(value, path), path, 1, MAX_ITEMS)):
        if not isinstance(text, str) or len(text) > 43:
            raise InvalidField(f"{path}[{i}]", f"Invalid CIDR format provided: {text!r}")
        if text in value[:i]:
            raise InvalidField(f"{path}[{i}]", f"duplicate value {text!r} (a set)")
        try:
            networks.append(_network(text, f"{path}[{i}]"))
        except InvalidField:
            raise InvalidField(f"{path}[{i}]", f"Invalid CIDR format provided: {text!r}") from None
    return tuple(networks)


def _peer(value: Any, path: str, direction: Direction) -> ClusterPeer:
    entry = _mapping(value, path)
    part = "ingressPeer" if direction == "ingress" else "egressPeer"
    _known(entry, part, path)
    kind = _one_of(entry, path, part)
    where = f"{path}.{kind}"
    if kind == "namespaces":
        return ClusterPeer(namespaces=selector_from(entry[kind], where))
    if kind == "pods":
        return ClusterPeer(pods=_namespaced_pods(entry[kind], where))
    if kind == "networks":
        return ClusterPeer(networks=_networks(entry[kind], where))
    raise UnsupportedPeer(where, "not supported by nftpolicy (experimental peer; supported: namespaces, pods, networks)")


def _port_number(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise InvalidField(path, f"must be a number 1-65535, got {value!r}")
    return int(value)


def _protocol(value: Any, path: str) -> ClusterPort:
    entry = _mapping(value, path)
    _known(entry, "protocol", path)
    kind = _one_of(entry, path, "protocol")
    where = f"{path}.{kind}"
    if kind == "destinationNamedPort":
        name = entry[kind]
        if not isinstance(name, str) or not name:
            raise InvalidField(where, f"must be a container port name, got {name!r}")
        return ClusterPort(protocol=None, name=name)
    ports = _mapping(entry[kind], where)
    _known(ports, "protocolPorts", where)
    if ports.get("destinationPort") is None:
        raise InvalidField(f"{where}.destinationPort", "required")
    port = _mapping(ports["destinationPort"], f"{where}.destinationPort")
    _known(port, "port", f"{where}.destinationPort")
    which = _one_of(port, f"{where}.destinationPort", "port")
    ppath = f"{where}.destinationPort.{which}"
    if which == "number":
        number = _port_number(port["number"], ppath)
        return ClusterPort(_PROTOCOL_FIELDS[kind], number, number)
    span = _mapping(port["range"], ppath)
    _known(span, "range", ppath)
    start, end = _port_number(span.get("start"), f"{ppath}.start"), _port_number(span.get("end"), f"{ppath}.end")
    if not start < end:
        raise InvalidField(ppath, f"Start port must be less than End port, got {start}-{end}")
    return ClusterPort(_PROTOCOL_FIELDS[kind], start, end)


def _rules(value: Any, path: str, direction: Direction) -> tuple[ClusterRule, ...]:
    peers_key = "from" if direction == "ingress" else "to"
    rules = []
    for i, item in enumerate(_count(_list(value, path), path, 0, MAX_RULES)):
        rpath = f"{path}[{i}]"
        rule = _mapping(item, rpath)
        _known(rule, direction, rpath)
        name = rule.get("name") or ""
        if not isinstance(name, str) or len(name) > MAX_RULE_NAME:
            raise InvalidField(f"{rpath}.name", f"must be a string of at most {MAX_RULE_NAME} characters")
        action = rule.get("action")
        if action not in ACTIONS:
            raise InvalidField(f"{rpath}.action", f"must be Accept, Deny or Pass, got {action!r}")
        if rule.get(peers_key) is None:
            raise InvalidField(f"{rpath}.{peers_key}", "required")
        peer_items = _count(_list(rule[peers_key], f"{rpath}.{peers_key}"), f"{rpath}.{peers_key}", 1, MAX_ITEMS)
        peers = tuple(_peer(p, f"{rpath}.{peers_key}[{j}]", direction) for j, p in enumerate(peer_items))
        ports: tuple[ClusterPort, ...] = ()
        if rule.get("protocols") is not None:
            items = _count(_list(rule["protocols"], f"{rpath}.protocols"), f"{rpath}.protocols", 1, MAX_ITEMS)
            ports = tuple(_protocol(p, f"{rpath}.protocols[{j}]") for j, p in enumerate(items))
        if any(p.networks for p in peers) and any(p.name is not None for p in ports):
            raise InvalidField(rpath, "networks/nodes/domainNames peer cannot be set with namedPorts since there are "
                                      "no namedPorts for networks/nodes/domainNames")
        rules.append(ClusterRule(action=action, peers=peers, ports=ports, name=name))
    return tuple(rules)


def cluster_policy_from(obj: Mapping[str, Any]) -> ClusterNetworkPolicy:
    """A ClusterNetworkPolicy object (``policy.networking.k8s.io/v1alpha2``) ->
    :class:`ClusterNetworkPolicy`, validated as the v0.2.0 CRD validates it (see the module).

    Raises :class:`~nftpolicy.translators.manifests.InvalidField` naming the first invalid field.
    """
    if obj.get("apiVersion") != API_VERSION:
        raise InvalidField("apiVersion", f"must be {API_VERSION} (the version nftpolicy implements), got {obj.get('apiVersion')!r}")
    name = _name(obj)
    spec = _mapping(obj.get("spec"), "spec")
    _known(spec, "spec", "spec")
    tier = spec.get("tier")
    if tier not in TIERS:
        raise InvalidField("spec.tier", f"must be Admin or Baseline, got {tier!r}")
    priority = spec.get("priority")
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
        raise InvalidField("spec.priority", f"must be a number 0-{MAX_PRIORITY}, got {priority!r}")
    if spec.get("subject") is None:
        raise InvalidField("spec.subject", "required")
    subject = _mapping(spec["subject"], "spec.subject")
    _known(subject, "subject", "spec.subject")
    kind = _one_of(subject, "spec.subject", "subject")
    return ClusterNetworkPolicy(
        name=name, tier=tier, priority=priority,
        subject_namespaces=selector_from(subject[kind], "spec.subject.namespaces") if kind == "namespaces" else None,
        subject_pods=_namespaced_pods(subject[kind], "spec.subject.pods") if kind == "pods" else None,
        ingress=_rules(spec.get("ingress"), "spec.ingress", "ingress"),
        egress=_rules(spec.get("egress"), "spec.egress", "egress"),
    )


def network_contains(peer: ClusterPeer, address: str) -> bool:
    """True when ``address`` is in one of a networks peer's CIDRs."""
    ip = ipaddress.ip_address(address)
    return any(ip.version == n.version and ip in n for n in peer.networks)


def fail_closed_cluster_policy(obj: Mapping[str, Any]) -> ClusterNetworkPolicy | None:
    """For a ClusterNetworkPolicy that failed validation (the agent should never meet one from
    the API server; an incompatible CRD version could hold fields it does not know): the policy
    with each rule that fails validation replaced as the API reference prescribes for a peer it
    cannot read ("For Accept rules, fail closed means: treat the rule as matching no traffic.
    For Deny and Pass rules, fail closed means: treat the rule as a 'Deny all' rule"): an Accept
    rule is left out, any other becomes Deny from/to every pod (and, for egress, every address).

    None when the tier, priority or subject cannot be read (the policy cannot be placed).
    """
    try:
        skeleton = cluster_policy_from({**obj, "spec": {k: v for k, v in _mapping(obj.get("spec"), "spec").items()
                                                        if k not in ("ingress", "egress")}})
    except InvalidField:
        return None
    spec = obj["spec"]
    kept: dict[str, list[ClusterRule]] = {"ingress": [], "egress": []}
    for direction in ("ingress", "egress"):
        items = spec.get(direction) if isinstance(spec.get(direction), list) else []
        for i, item in enumerate(items[:MAX_RULES]):
            try:
                kept[direction].extend(_rules([item], f"spec.{direction}", direction))
            except InvalidField:
                action = item.get("action") if isinstance(item, Mapping) else None
                if action != "Accept":
                    everything = [ClusterPeer(namespaces=LabelSelector())]
                    if direction == "egress":
                        everything.append(ClusterPeer(networks=(ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))))
                    kept[direction].append(ClusterRule("Deny", tuple(everything), name=f"fail-closed rule {i}"))
    return ClusterNetworkPolicy(name=skeleton.name, tier=skeleton.tier, priority=skeleton.priority,
                                subject_namespaces=skeleton.subject_namespaces, subject_pods=skeleton.subject_pods,
                                ingress=tuple(kept["ingress"]), egress=tuple(kept["egress"]))
