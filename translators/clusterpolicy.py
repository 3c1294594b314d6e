"""ClusterNetworkPolicy (``policy.networking.k8s.io/v1beta1`` and ``v1alpha2``): reading and
validating it into :class:`~nftpolicy.translators.model.ClusterNetworkPolicy`.

Source: sigs.k8s.io/network-policy-api v0.3.0, ``apis/v1beta1/clusternetworkpolicy_types.go``
and the CRD it generates (``config/crd/{standard,experimental}``: the OpenAPI limits and the CEL
rules). v0.3.0 serves both versions from one schema ("The v1beta1 and v1alpha2 schemas are
identical, so no conversion webhook is required", its CHANGELOG; v1beta1 is stored), the same
as v0.2.0's v1alpha2 but for two validation fixes of v0.2.1 (a CIDR with host bits is refused,
see :data:`MASKED_SINCE`; the DomainName pattern's ``A-z`` became ``A-Z``, which this module
always read). A ClusterNetworkPolicy sits in the Admin tier (before every NetworkPolicy) or the
Baseline tier (after them, for pods no NetworkPolicy isolates); ``tests/tiers.py``
evaluates the order. Peers are namespaces, pods (a namespace selector AND a pod selector) and,
for egress, networks (CIDRs), nodes (a label selector over Node objects: their InternalIP and
ExternalIP addresses) and domain names (``domainNames``: the addresses that DNS answers to the
subject pods gave for those names, learned by the agent, see
:mod:`nftpolicy.translators.domainnames`); ports are TCP, UDP or SCTP destination ports (a number
or a range) or a destination named port.

Validation is the CRD's: ``priority`` 0-1000, ``subject`` and every peer and protocol with
exactly one field, at most 25 rules per direction, 1-25 peers and protocols per rule, 1-25
networks per peer (no duplicates), rule names of at most 100 characters, port ranges with
``start < end``, no named port in an egress rule towards networks, nodes or domain names; a
domain name matches the type's pattern (``DomainName``: an optional ``*.`` prefix, then labels),
1-25 names per peer without duplicates, and (the type's documentation: "DomainNames is only
supported for Accept rules") only in an Accept rule. Every peer of both versions is enforced.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from typing import Any, Mapping

from .model import ACTIONS, TIERS, ClusterNetworkPolicy, ClusterPeer, ClusterPort, ClusterRule, Direction, IPNetwork, Protocol
from .selectors import LabelSelector
from .validation import InvalidField, known_fields, list_field, mapping_field, network_field, object_name, selector_from

API_VERSION = "policy.networking.k8s.io/v1beta1"  # network-policy-api v0.3.0's storage version
# Every apiVersion read, the preferred first (the agent watches the first one the API serves).
API_VERSIONS = (API_VERSION, "policy.networking.k8s.io/v1alpha2")
# network-policy-api v0.2.1 (and so v0.3.0, for both versions) refuses a networks CIDR with host
# bits set ("CIDR fields must now be in canonical (masked) form", CEL: cidr(self) ==
# cidr(self).masked()); v0.2.0 took them, and the API server keeps serving what it stored then.
MASKED_SINCE = "network-policy-api v0.2.1"
MAX_PRIORITY = 1000
MAX_RULES = 25  # per direction (MaxItems on spec.ingress and spec.egress)
MAX_ITEMS = 25  # peers, protocols and networks (MaxItems)
MAX_RULE_NAME = 100
# DomainName's kubebuilder Pattern (v0.2.0; its ``A-z`` ranges read as the ``A-Z`` they mean)
DOMAIN_NAME = re.compile(r"^(\*\.)?([a-zA-Z0-9]([-a-zA-Z0-9_]*[a-zA-Z0-9])?\.)+[a-zA-Z0-9]([-a-zA-Z0-9_]*[a-zA-Z0-9])?\.?$")
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
    entry = mapping_field(value, path)
    known_fields(entry, _FIELDS["pods"], path)
    if entry.get("podSelector") is None:
        raise InvalidField(f"{path}.podSelector", "required")
    return (selector_from(entry.get("namespaceSelector"), f"{path}.namespaceSelector"),
            selector_from(entry["podSelector"], f"{path}.podSelector"))


def _networks(value: Any, path: str, new: bool) -> tuple[IPNetwork, ...]:
    """The CIDRs of a networks peer; ``new``: refuse host bits, as the CRD does since
    :data:`MASKED_SINCE` (else they are masked, as for an object stored before)."""
    networks = []
    for i, text in enumerate(_count(list_field(value, path), path, 1, MAX_ITEMS)):
        if not isinstance(text, str) or len(text) > 43:
            raise InvalidField(f"{path}[{i}]", f"Invalid CIDR format provided: {text!r}")
        if text in value[:i]:
            raise InvalidField(f"{path}[{i}]", f"duplicate value {text!r} (a set)")
        try:
            network = network_field(text, f"{path}[{i}]")
        except InvalidField:
            raise InvalidField(f"{path}[{i}]", f"Invalid CIDR format provided: {text!r}") from None
        if new and str(network) != text:
            raise InvalidField(f"{path}[{i}]", f"CIDR must be in canonical form (host bits masked, as {MASKED_SINCE} requires): "
                                               f"{text!r}, use {str(network)!r}")
        networks.append(network)
    return tuple(networks)


def _peer(value: Any, path: str, direction: Direction, new: bool) -> ClusterPeer:
    entry = mapping_field(value, path)
    part = "ingressPeer" if direction == "ingress" else "egressPeer"
    known_fields(entry, _FIELDS[part], path)
    kind = _one_of(entry, path, part)
    where = f"{path}.{kind}"
    if kind == "namespaces":
        return ClusterPeer(namespaces=selector_from(entry[kind], where))
    if kind == "pods":
        return ClusterPeer(pods=_namespaced_pods(entry[kind], where))
    if kind == "networks":
        return ClusterPeer(networks=_networks(entry[kind], where, new))
    if kind == "domainNames":
        return ClusterPeer(domain_names=_domain_names(entry[kind], where))
    return ClusterPeer(nodes=selector_from(entry[kind], where))  # the last of _FIELDS["egressPeer"]


def _domain_names(value: Any, path: str) -> tuple[str, ...]:
    """The names of a domainNames peer, lower case without a trailing dot (DNS names compare
    without case; ``a.example.`` and ``a.example`` are one name)."""
    names: list[str] = []
    for i, text in enumerate(_count(list_field(value, path), path, 1, MAX_ITEMS)):
        if not isinstance(text, str) or not DOMAIN_NAME.match(text):
            raise InvalidField(f"{path}[{i}]", f"must be a domain name, optionally with a '*.' prefix, got {text!r}")
        if text in value[:i]:
            raise InvalidField(f"{path}[{i}]", f"duplicate value {text!r} (a set)")
        names.append(text.lower().rstrip("."))
    return tuple(dict.fromkeys(names))


def _port_number(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise InvalidField(path, f"must be a number 1-65535, got {value!r}")
    return int(value)


def _protocol(value: Any, path: str) -> ClusterPort:
    entry = mapping_field(value, path)
    known_fields(entry, _FIELDS["protocol"], path)
    kind = _one_of(entry, path, "protocol")
    where = f"{path}.{kind}"
    if kind == "destinationNamedPort":
        name = entry[kind]
        if not isinstance(name, str) or not name:
            raise InvalidField(where, f"must be a container port name, got {name!r}")
        return ClusterPort(protocol=None, name=name)
    ports = mapping_field(entry[kind], where)
    known_fields(ports, _FIELDS["protocolPorts"], where)
    if ports.get("destinationPort") is None:
        raise InvalidField(f"{where}.destinationPort", "required")
    port = mapping_field(ports["destinationPort"], f"{where}.destinationPort")
    known_fields(port, _FIELDS["port"], f"{where}.destinationPort")
    which = _one_of(port, f"{where}.destinationPort", "port")
    ppath = f"{where}.destinationPort.{which}"
    if which == "number":
        number = _port_number(port["number"], ppath)
        return ClusterPort(_PROTOCOL_FIELDS[kind], number, number)
    span = mapping_field(port["range"], ppath)
    known_fields(span, _FIELDS["range"], ppath)
    start, end = _port_number(span.get("start"), f"{ppath}.start"), _port_number(span.get("end"), f"{ppath}.end")
    if not start < end:
        raise InvalidField(ppath, f"Start port must be less than End port, got {start}-{end}")
    return ClusterPort(_PROTOCOL_FIELDS[kind], start, end)


def _rules(value: Any, path: str, direction: Direction, new: bool) -> tuple[ClusterRule, ...]:
    peers_key = "from" if direction == "ingress" else "to"
    rules = []
    for i, item in enumerate(_count(list_field(value, path), path, 0, MAX_RULES)):
        rpath = f"{path}[{i}]"
        rule = mapping_field(item, rpath)
        known_fields(rule, _FIELDS[direction], rpath)
        name = rule.get("name") or ""
        if not isinstance(name, str) or len(name) > MAX_RULE_NAME:
            raise InvalidField(f"{rpath}.name", f"must be a string of at most {MAX_RULE_NAME} characters")
        action = rule.get("action")
        if action not in ACTIONS:
            raise InvalidField(f"{rpath}.action", f"must be Accept, Deny or Pass, got {action!r}")
        if rule.get(peers_key) is None:
            raise InvalidField(f"{rpath}.{peers_key}", "required")
        peer_items = _count(list_field(rule[peers_key], f"{rpath}.{peers_key}"), f"{rpath}.{peers_key}", 1, MAX_ITEMS)
        peers = tuple(_peer(p, f"{rpath}.{peers_key}[{j}]", direction, new) for j, p in enumerate(peer_items))
        ports: tuple[ClusterPort, ...] = ()
        if rule.get("protocols") is not None:
            items = _count(list_field(rule["protocols"], f"{rpath}.protocols"), f"{rpath}.protocols", 1, MAX_ITEMS)
            ports = tuple(_protocol(p, f"{rpath}.protocols[{j}]") for j, p in enumerate(items))
        if any(p.domain_names for p in peers) and action != "Accept":
            raise InvalidField(f"{rpath}.action", f"a domainNames peer is only supported in Accept rules, got {action}")
        if any(p.networks or p.domain_names or p.nodes is not None for p in peers) and any(p.name is not None for p in ports):
            raise InvalidField(rpath, "networks/nodes/domainNames peer cannot be set with namedPorts since there are "
                                      "no namedPorts for networks/nodes/domainNames")
        rules.append(ClusterRule(action=action, peers=peers, ports=ports, name=name))
    return tuple(rules)


def cluster_policy_from(obj: Mapping[str, Any], new: bool = False) -> ClusterNetworkPolicy:
    """A ClusterNetworkPolicy object (an apiVersion of :data:`API_VERSIONS`: the two have one
    schema) -> :class:`ClusterNetworkPolicy`, validated as the v0.3.0 CRD validates it (see the
    module). ``new``: as it validates a create (manifests); without, as the API server serves
    what it stored, which may predate :data:`MASKED_SINCE` (host bits of a CIDR masked).

    Raises :class:`~nftpolicy.translators.manifests.InvalidField` naming the first invalid field.
    """
    if obj.get("apiVersion") not in API_VERSIONS:
        raise InvalidField("apiVersion", f"must be {' or '.join(API_VERSIONS)} (the versions nftpolicy implements), "
                                         f"got {obj.get('apiVersion')!r}")
    name = object_name(obj)
    spec = mapping_field(obj.get("spec"), "spec")
    known_fields(spec, _FIELDS["spec"], "spec")
    tier = spec.get("tier")
    if tier not in TIERS:
        raise InvalidField("spec.tier", f"must be Admin or Baseline, got {tier!r}")
    priority = spec.get("priority")
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
        raise InvalidField("spec.priority", f"must be a number 0-{MAX_PRIORITY}, got {priority!r}")
    if spec.get("subject") is None:
        raise InvalidField("spec.subject", "required")
    subject = mapping_field(spec["subject"], "spec.subject")
    known_fields(subject, _FIELDS["subject"], "spec.subject")
    kind = _one_of(subject, "spec.subject", "subject")
    return ClusterNetworkPolicy(
        name=name, tier=tier, priority=priority,
        subject_namespaces=selector_from(subject[kind], "spec.subject.namespaces") if kind == "namespaces" else None,
        subject_pods=_namespaced_pods(subject[kind], "spec.subject.pods") if kind == "pods" else None,
        ingress=_rules(spec.get("ingress"), "spec.ingress", "ingress", new),
        egress=_rules(spec.get("egress"), "spec.egress", "egress", new),
    )


def fail_closed_cluster_policy(obj: Mapping[str, Any], reason: str) -> ClusterNetworkPolicy | None:
    """For a ClusterNetworkPolicy that failed validation (the agent should never meet one from
    the API server; an incompatible CRD version could hold fields it does not know): the policy
    with each rule that fails validation replaced as the API reference prescribes for a peer it
    cannot read ("For Accept rules, fail closed means: treat the rule as matching no traffic.
    For Deny and Pass rules, fail closed means: treat the rule as a 'Deny all' rule"): an Accept
    rule is left out, any other becomes Deny from/to every pod (and, for egress, every address);
    ``reason`` (the validation error) is kept as ``fail_closed``, for explain to name.

    None when the tier, priority or subject cannot be read (the policy cannot be placed).
    """
    try:
        skeleton = cluster_policy_from({**obj, "spec": {k: v for k, v in mapping_field(obj.get("spec"), "spec").items()
                                                        if k not in ("ingress", "egress")}})
    except InvalidField:
        return None
    spec = obj["spec"]
    kept: dict[str, list[ClusterRule]] = {"ingress": [], "egress": []}
    for direction in ("ingress", "egress"):
        items = spec.get(direction) if isinstance(spec.get(direction), list) else []
        for i, item in enumerate(items[:MAX_RULES]):
            try:
                kept[direction].extend(_rules([item], f"spec.{direction}", direction, False))
            except InvalidField:
                action = item.get("action") if isinstance(item, Mapping) else None
                if action != "Accept":
                    kept[direction].append(deny_everything(direction, i))
    return ClusterNetworkPolicy(name=skeleton.name, tier=skeleton.tier, priority=skeleton.priority,
                                subject_namespaces=skeleton.subject_namespaces, subject_pods=skeleton.subject_pods,
                                ingress=tuple(kept["ingress"]), egress=tuple(kept["egress"]), fail_closed=reason)


def deny_everything(direction: Direction, index: int) -> ClusterRule:
    """What a ``Deny`` or ``Pass`` rule at ``index`` of ``direction`` that cannot be enforced
    becomes (the API reference: fail closed is "Deny all"): Deny from or to every pod and, for
    egress, every address."""
    everything = [ClusterPeer(namespaces=LabelSelector())]
    if direction == "egress":
        everything.append(ClusterPeer(networks=(ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))))
    return ClusterRule("Deny", tuple(everything), name=f"fail-closed rule {index}")


def closed_cluster_policy(policy: ClusterNetworkPolicy, reason: str) -> ClusterNetworkPolicy:
    """``policy`` with every rule failed closed as the API reference prescribes for a rule it
    cannot read (see :func:`fail_closed_cluster_policy`): each ``Accept`` rule left out, each
    other :func:`deny_everything`; tier, priority and subject kept, ``reason`` as ``fail_closed``."""
    def closed(direction: Direction, rules: tuple[ClusterRule, ...]) -> tuple[ClusterRule, ...]:
        return tuple(deny_everything(direction, i) for i, rule in enumerate(rules) if rule.action != "Accept")
    return dataclasses.replace(policy, ingress=closed("ingress", policy.ingress), egress=closed("egress", policy.egress),
                               fail_closed=reason)
