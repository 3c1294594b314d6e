"""NetworkPolicy conformance cases (``tests/conformance/**/*.yaml``) -> manifests and expected matrices.

Format: ``tests/conformance/README.md`` (from the upstream Kubernetes e2e suite,
``test/e2e/network/netpol``). Defaults: namespaces x, y, z; pods a, b, c in each, labelled
``pod: <name>``, serving 80 and 81 on TCP, UDP and SCTP with container ports named
``serve-<port>-<protocol>``. ``${hostCIDR:ns/pod}`` and ``${largeCIDR:ns/pod}`` in policies are
filled from the pods' addresses (host prefix, and the /4 around the address).
``clusterNetworkPolicies`` lists ClusterNetworkPolicy manifests (placeholders filled the same way);
a probe's optional ``upstream`` table lists the cells an upstream test asserts
(``<from> <to> ./X`` per line), which its ``expected`` matrix must agree with.
``nodes`` (name -> labels) lists Node objects; an ``expected`` column ``node:<name>`` is that
Node's address (a destination only: the rows are pods), for ClusterNetworkPolicy ``nodes`` peers.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from .errors import OneLineError
from .model import NAMESPACE_NAME_LABEL, Cluster, Family, Protocol, family_of

DEFAULT_NAMESPACES = ("x", "y", "z")
DEFAULT_POD_NAMES = ("a", "b", "c")
DEFAULT_PORTS = tuple({"name": f"serve-{port}-{proto.lower()}", "port": port, "protocol": proto}
                      for port in (80, 81) for proto in ("TCP", "UDP", "SCTP"))
NODE_TARGET = "node:"  # a matrix column naming a Node's address: node:<name>
_PLACEHOLDER = re.compile(r"\$\{(hostCIDR|largeCIDR):([^/}]+)/([^}]+)\}")

Matrix = dict[tuple[str, str], bool]


class CaseError(OneLineError, ValueError):
    """A case file that does not follow the format; the message names the field."""


@dataclass(frozen=True)
class CaseProbe:
    """One expected matrix: ``expected[(from, to)]`` is True when the connection must succeed."""

    port: int
    protocol: Protocol
    expected: Matrix
    upstream: Matrix = field(default_factory=dict)


@dataclass(frozen=True)
class CasePod:
    """A pod of a case: ``ports`` are ``{name, port, protocol}`` mappings."""

    namespace: str
    name: str
    labels: Mapping[str, str]
    node: str | None
    ports: tuple[Mapping[str, Any], ...]

    @property
    def key(self) -> str:
        """``namespace/name``."""
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Case:
    """A parsed case: namespaces (name -> labels), pods, policy manifests (placeholders unfilled),
    probes and Nodes (name -> labels)."""

    name: str
    namespaces: Mapping[str, Mapping[str, str]]
    pods: tuple[CasePod, ...]
    policies: tuple[Mapping[str, Any], ...]
    probes: tuple[CaseProbe, ...]
    cluster_policies: tuple[Mapping[str, Any], ...] = ()
    nodes: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


def target_address(cluster: Cluster, key: str, family: Family) -> str | None:
    """The first address of ``family`` of a matrix column ``key``: pod ``ns/name`` of
    ``cluster``, or a Node's (``node:<name>``); None when it has none."""
    if key.startswith(NODE_TARGET):
        node = cluster.nodes.get(key[len(NODE_TARGET):])
        addresses = node.addresses if node is not None else ()
    else:
        pod = cluster.pods.get(key)
        addresses = pod.ips if pod is not None else ()
    return next((a for a in addresses if family_of(a) == family), None)


def is_case(document: Any) -> bool:
    """True when a parsed YAML document is a conformance case (it has ``probes``)."""
    return isinstance(document, Mapping) and "probes" in document and "kind" not in document


def parse_matrix(text: str, where: str) -> Matrix:
    """Parse an ``expected`` table: header ``- <to>...``, rows ``<from> ./X ...``."""
    rows = [line.split() for line in text.strip().splitlines() if line.strip()]
    if not rows or rows[0][0] != "-":
        raise CaseError(f"{where}: the first line must be '-' followed by the pod names")
    columns = rows[0][1:]
    matrix: Matrix = {}
    for row in rows[1:]:
        if len(row) != len(columns) + 1 or any(c not in ".X" for c in row[1:]):
            raise CaseError(f"{where}: bad row {' '.join(row)!r}")
        for to, cell in zip(columns, row[1:]):
            matrix[(row[0], to)] = cell == "."
    return matrix


def parse_case(document: Mapping[str, Any]) -> Case:
    """A case document -> :class:`Case`, with the format's defaults applied. Raises CaseError."""
    name = str(document.get("name") or "case")
    namespaces = document.get("namespaces") or {n: {"ns": n} for n in DEFAULT_NAMESPACES}
    namespaces = {n: {**(labels or {}), NAMESPACE_NAME_LABEL: n} for n, labels in namespaces.items()}
    pod_docs = document.get("pods") or [{"namespace": ns, "name": p, "labels": {"pod": p}}
                                        for ns in namespaces for p in DEFAULT_POD_NAMES]
    pods = tuple(CasePod(namespace=p["namespace"], name=p["name"], labels=dict(p.get("labels") or {}),
                         node=p.get("node"), ports=tuple(p.get("ports") or DEFAULT_PORTS)) for p in pod_docs)
    probes = []
    for i, probe in enumerate(document.get("probes") or []):
        protocol = probe.get("protocol", "TCP")
        if protocol not in ("TCP", "UDP", "SCTP"):
            raise CaseError(f"{name}: probes[{i}].protocol: unknown protocol {protocol!r}")
        probes.append(CaseProbe(port=int(probe["port"]), protocol=protocol,
                                expected=parse_matrix(probe["expected"], f"{name}: probes[{i}].expected"),
                                upstream=parse_cells(probe.get("upstream") or "", f"{name}: probes[{i}].upstream")))
    nodes = {str(n): dict(labels or {}) for n, labels in (document.get("nodes") or {}).items()}
    for i, probe in enumerate(probes):
        unknown = sorted({to for _, to in probe.expected if to.startswith(NODE_TARGET) and to[len(NODE_TARGET):] not in nodes})
        if unknown:
            raise CaseError(f"{name}: probes[{i}].expected: column {unknown[0]} names no node of 'nodes'")
    return Case(name=name, namespaces=namespaces, pods=pods, policies=tuple(document.get("policies") or ()), probes=tuple(probes),
                cluster_policies=tuple(document.get("clusterNetworkPolicies") or ()), nodes=nodes)


def parse_cells(text: str, where: str) -> Matrix:
    """Parse single cells, one per line: ``<from> <to> .`` (allowed) or ``X`` (blocked)."""
    cells: Matrix = {}
    for line in text.strip().splitlines():
        parts = line.split()
        if len(parts) != 3 or parts[2] not in ".X":
            raise CaseError(f"{where}: bad cell {line.strip()!r} (expected '<from> <to> ./X')")
        cells[(parts[0], parts[1])] = parts[2] == "."
    return cells


def fill_placeholders(value: Any, address_of: Mapping[str, str]) -> Any:
    """Replace ``${hostCIDR:ns/pod}`` / ``${largeCIDR:ns/pod}`` in every string of ``value``.

    ``address_of`` maps ``ns/pod`` to the address to use. Raises CaseError for an unknown pod.
    """
    if isinstance(value, str):
        def replace(m: re.Match[str]) -> str:
            key = f"{m.group(2)}/{m.group(3)}"
            if key not in address_of:
                raise CaseError(f"placeholder {m.group(0)} names an unknown pod")
            ip = ipaddress.ip_address(address_of[key])
            if m.group(1) == "hostCIDR":
                return f"{ip}/{ip.max_prefixlen}"
            return str(ipaddress.ip_network(f"{ip}/4", strict=False))
        return _PLACEHOLDER.sub(replace, value)
    if isinstance(value, Mapping):
        return {k: fill_placeholders(v, address_of) for k, v in value.items()}
    if isinstance(value, list):
        return [fill_placeholders(v, address_of) for v in value]
    return value


def case_manifests(case: Case, ips: Mapping[str, list[str]], node_ips: Mapping[str, list[str]] | None = None) -> list[dict[str, Any]]:
    """Kubernetes objects for a case whose pods have the addresses ``ips`` (``ns/pod`` -> list,
    first entry used for placeholders) and whose Nodes have the InternalIP addresses
    ``node_ips`` (name -> list; none when absent)."""
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n, "labels": dict(labels)}}
        for n, labels in case.namespaces.items()
    ]
    objects.extend({"apiVersion": "v1", "kind": "Node", "metadata": {"name": n, "labels": dict(labels)},
                    "status": {"addresses": [{"type": "InternalIP", "address": a} for a in (node_ips or {}).get(n, [])]}}
                   for n, labels in case.nodes.items())
    for pod in case.pods:
        ports = [{"name": p.get("name"), "containerPort": int(p["port"]), "protocol": p.get("protocol", "TCP")} for p in pod.ports]
        objects.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": pod.namespace, "name": pod.name, "labels": dict(pod.labels)},
            "spec": {"nodeName": pod.node, "containers": [{"name": "server", "ports": ports}]},
            "status": {"phase": "Running", "podIPs": [{"ip": ip} for ip in ips.get(pod.key, [])]},
        })
    primary = {key: addresses[0] for key, addresses in ips.items() if addresses}
    objects.extend(fill_placeholders(dict(p), primary) for p in (*case.policies, *case.cluster_policies))
    return objects


def load_case(text: str) -> Case:
    """Parse case YAML text (one document). Raises CaseError when it is not a case."""
    document = yaml.safe_load(text)
    if not is_case(document):
        raise CaseError("not a conformance case (no 'probes')")
    return parse_case(document)


def format_matrix(pods: list[str], matrix: Matrix) -> str:
    """The matrix in the cases' table format: rows from, columns to, ``.`` connected, ``X`` not,
    ``?`` not probed."""
    width = max([len(p) for p in pods] + [1])
    lines = [" ".join(["-".ljust(width)] + [p.ljust(width) for p in pods]).rstrip()]
    for src in pods:
        cells = ["?" if (src, dst) not in matrix else "." if matrix[(src, dst)] else "X" for dst in pods]
        lines.append(" ".join([src.ljust(width)] + [c.ljust(width) for c in cells]).rstrip())
    return "\n".join(lines)


def differences(expected: Matrix, actual: Matrix) -> list[tuple[str, str, bool, bool | None]]:
    """Cells where ``actual`` differs from ``expected``, diagonal ignored (a pod's traffic to
    itself never leaves its namespace): ``(from, to, expected, actual or None if not probed)``."""
    return [(src, dst, want, actual.get((src, dst)))
            for (src, dst), want in sorted(expected.items())
            if src != dst and actual.get((src, dst)) != want]
