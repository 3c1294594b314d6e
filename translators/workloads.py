"""Workloads (Deployments, ReplicaSets, StatefulSets, DaemonSets, Jobs, CronJobs) stand in their
Pods, so that manifests as operators write them (Helm and kustomize output) can be sandboxed,
explained and rendered without a cluster; Services are read for ``explain --to`` (:func:`services_from`).

Each workload becomes the Pods its controller would create from ``spec.template`` (labels and
containers with their ports as the template gives them), named as the controller names them.
Source: the Kubernetes API reference (``apps/v1`` Deployment, ReplicaSet, StatefulSet, DaemonSet;
``batch/v1`` Job, CronJob) and the controllers' naming:

* Deployment ``d``: ``spec.replicas`` (default 1) Pods ``d-<10>-<5>`` (its ReplicaSet
  ``d-<pod-template-hash>``, then 5 characters per Pod);
* ReplicaSet ``r``: ``spec.replicas`` (default 1) Pods ``r-<5>``;
* StatefulSet ``s``: ``spec.replicas`` (default 1) Pods ``s-0``, ``s-1``, ... with the label
  ``statefulset.kubernetes.io/pod-name`` (and ``apps.kubernetes.io/pod-index``) that the
  controller adds;
* DaemonSet ``ds``: one Pod ``ds-<5>`` per node (``spec.nodeName`` set to it);
* Job ``j``: ``spec.parallelism`` (default 1) Pods ``j-<5>`` with the labels ``job-name`` and
  ``batch.kubernetes.io/job-name``; CronJob ``c``: the Pods of one run, a Job ``c-<8 digits>``
  made from ``spec.jobTemplate``.

:func:`place_pods` gives Pods a node and addresses where their manifests give none, as the
sandbox builds them (``sandbox``, ``trace`` and ``explain`` agree on them).

The random characters come from the template (:func:`~nftpolicy.translators.manifests.generated_suffix`),
so a file read twice gives the same names. A workload whose template is not an object, or whose
counts are not whole numbers >= 0, is reported (a :class:`ManifestError`) and left out.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

from .manifests import ManifestError, unread_object
from .validation import InvalidField, generated_suffix
from .model import Family, IPNetwork, Pod, family_of

WORKLOAD_KINDS = ("Deployment", "ReplicaSet", "StatefulSet", "DaemonSet", "Job", "CronJob")


@dataclass(frozen=True)
class StandIn:
    """One workload read as Pods: ``kind``, ``ref`` (``namespace/name``) and the keys
    (``namespace/name``) of the ``pods`` it stands in for."""

    kind: str
    ref: str
    pods: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.kind} {self.ref} ({len(self.pods)})"


def _count(spec: Mapping[str, Any], field: str, path: str) -> int:
    value = spec.get(field)
    if value is None:
        return 1
    if type(value) is not int or value < 0:
        raise InvalidField(f"{path}.{field}", f"must be a whole number >= 0, got {value!r}")
    return value


def _object(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidField(path, "required (an object)" if value is None else f"must be an object, got {type(value).__name__}")
    return value


def _pods(obj: Mapping[str, Any], nodes: Sequence[str]) -> list[dict[str, Any]]:
    """The Pod objects that workload ``obj`` stands in for. Raises InvalidField."""
    kind, meta = obj["kind"], _object(obj.get("metadata"), "metadata")
    name, namespace = meta.get("name"), meta.get("namespace") or "default"
    if not isinstance(name, str) or not name:
        raise InvalidField("metadata.name", "required")
    spec = _object(obj.get("spec"), "spec")
    path = "spec"
    extra_labels: list[dict[str, str]]
    if kind == "CronJob":
        job = _object(spec.get("jobTemplate"), "spec.jobTemplate")
        spec, path = _object(job.get("spec"), "spec.jobTemplate.spec"), "spec.jobTemplate.spec"
        name = f"{name}-" + "".join(str(ord(c) % 10) for c in generated_suffix(spec, 8))  # the run's Job
    template = _object(spec.get("template"), f"{path}.template")
    pod_meta = _object(template.get("metadata") or {}, f"{path}.template.metadata")
    pod_spec = _object(template.get("spec"), f"{path}.template.spec")
    names: list[str]
    node_names: list[str | None]
    if kind == "StatefulSet":
        count = _count(spec, "replicas", path)
        names = [f"{name}-{i}" for i in range(count)]
        extra_labels = [{"statefulset.kubernetes.io/pod-name": n, "apps.kubernetes.io/pod-index": str(i)} for i, n in enumerate(names)]
        node_names = [None] * count
    else:
        if kind == "DaemonSet":
            count, node_names = len(nodes), list(nodes)
        else:
            count = _count(spec, "parallelism" if kind in ("Job", "CronJob") else "replicas", path)
            node_names = [None] * count
        prefix = f"{name}-{generated_suffix(template, 10)}" if kind == "Deployment" else name
        names = [f"{prefix}-{generated_suffix([template, i], 5)}" for i in range(count)]
        job = {"job-name": name, "batch.kubernetes.io/job-name": name} if kind in ("Job", "CronJob") else {}
        extra_labels = [job] * count
    labels = pod_meta.get("labels") or {}
    if not isinstance(labels, Mapping):
        raise InvalidField(f"{path}.template.metadata.labels", f"must be an object, got {type(labels).__name__}")
    pods = []
    for pod_name, extra, node in zip(names, extra_labels, node_names):
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": pod_name, "namespace": namespace, "labels": {**labels, **extra}},
               "spec": {**pod_spec, **({"nodeName": node} if node else {})}}
        pods.append(pod)
    return pods


def stand_in_pods(objects: Iterable[tuple[str, Any]], nodes: Sequence[str], stood: list[StandIn],
                  errors: list[ManifestError]) -> Iterator[tuple[str, Any]]:
    """``(origin, object)`` pairs with every workload replaced by the Pods it stands in for (their
    origin names the workload too: ``shop.yaml, Deployment shop/api``), in order, one object at a
    time. A DaemonSet runs one Pod on each node: ``nodes`` (the command's), the Node objects and
    the Pods' ``spec.nodeName`` (none of them: ``node1``, the sandbox's default node), known only
    once every object is read, so from the first DaemonSet on the objects are held and given at
    the end. Appends one :class:`StandIn` per workload read to ``stood`` and one error per
    workload left out to ``errors``, as the objects go by; other objects pass unchanged."""
    found: set[str] = set()
    held: list[tuple[str, Any]] | None = None
    for origin, obj in objects:
        if isinstance(obj, Mapping) and obj.get("kind") in ("Node", "Pod") and isinstance(obj.get("metadata") or {}, Mapping) \
                and isinstance(obj.get("spec") or {}, Mapping):
            node = str((obj.get("metadata") or {}).get("name")) if obj["kind"] == "Node" else (obj.get("spec") or {}).get("nodeName")
            if isinstance(node, str) and node:
                found.add(node)
        if held is None and isinstance(obj, Mapping) and obj.get("kind") == "DaemonSet":
            held = []
        if held is None:
            yield from _stood_in(origin, obj, (), stood, errors)
        else:
            held.append((origin, obj))
    every_node = sorted({*nodes, *found}) or ["node1"]
    for origin, obj in held or ():
        yield from _stood_in(origin, obj, every_node, stood, errors)


def _stood_in(origin: str, obj: Any, nodes: Sequence[str], stood: list[StandIn], errors: list[ManifestError]) -> list[tuple[str, Any]]:
    """``obj`` itself, or the Pods of workload ``obj`` (on ``nodes``: a DaemonSet's), for :func:`stand_in_pods`."""
    if not (isinstance(obj, Mapping) and obj.get("kind") in WORKLOAD_KINDS):
        return [(origin, obj)]
    unread = unread_object(obj, origin)  # an apiVersion that is not the workload's
    if unread is not None:
        errors.append(unread)
        return []
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    ref = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
    try:
        pods = _pods(obj, nodes)
    except InvalidField as exc:
        errors.append(ManifestError(obj["kind"], ref, str(exc), origin))
        return []
    where = f"{origin}, {obj['kind']} {ref}" if origin else f"{obj['kind']} {ref}"
    stood.append(StandIn(obj["kind"], ref, tuple(f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods)))
    return [(where, pod) for pod in pods]


class PlacementError(ValueError):
    """More pods on one node than its stand-in /24 holds."""


def place_pods(pods: Iterable[Pod], default_nodes: Sequence[str] = ("node1",),
               families: Sequence[Family] = ("ipv4",), pod_cidrs: Mapping[str, Sequence[str]] | None = None) -> dict[str, Pod]:
    """The pods (key -> pod, in key order) as the sandbox builds them: hostNetwork and finished
    (``Succeeded``/``Failed``) pods left out, the others ``Running``; a pod without a node on the
    next of ``default_nodes`` (round-robin, in key order); a pod without addresses gets one per
    family in ``families``: the ``n``-th address of its node's pod CIDR of that family
    (``pod_cidrs``: node -> its ``spec.podCIDRs``, where the cluster's IPAM would take it, so an
    ipBlock on a node's range judges stand-ins as it would the real pods), else
    ``10.<244 + i // 256>.<i % 256>.<n>`` and ``fd00:10:244:<i>::<n>``, ``i`` its node's index
    among the sorted node names; ``n`` counts from 10 on each node, skipping an address another
    pod already has. Raises PlacementError past 244 such pods on one node, or past its CIDR."""
    placed: dict[str, Pod] = {}
    spread = itertools.cycle(default_nodes)
    for pod in sorted((p for p in pods if not p.host_network and p.phase not in ("Succeeded", "Failed")), key=lambda p: p.key):
        placed[pod.key] = dataclasses.replace(pod, node=pod.node or next(spread), phase="Running")
    index = {name: i for i, name in enumerate(sorted({p.node for p in placed.values() if p.node}))}
    counters = {name: itertools.count(10) for name in index}
    taken = {ip for pod in placed.values() for ip in pod.ips}  # never two pods on one address
    for key, pod in placed.items():
        if not pod.ips:
            ranges: dict[Family, IPNetwork] = {}
            for cidr in (pod_cidrs or {}).get(pod.node or "", ()):  # the first of each family, as IPAM takes it
                ranges.setdefault(family_of(cidr), ipaddress.ip_network(cidr, strict=False))
            while True:
                n = next(counters[pod.node])  # type: ignore[index]
                ips = [_nth_address(pod, family, n, index[pod.node], ranges.get(family)) for family in families]  # type: ignore[index]
                if not taken.intersection(ips):
                    break
            taken.update(ips)
            placed[key] = dataclasses.replace(pod, ips=tuple(ips))
    return placed


def _nth_address(pod: Pod, family: Family, n: int, node_index: int, cidr: IPNetwork | None) -> str:
    """:func:`place_pods`' ``n``-th address of ``pod``'s node in ``family``: in ``cidr`` (the
    node's pod CIDR of that family) when given, else in the sandbox's own range of the node.
    Raises PlacementError when the range has no such address."""
    if cidr is not None:
        if n >= min(cidr.num_addresses - 1, 1 << 16):
            raise PlacementError(f"too many pods on node {pod.node} for its pod CIDR {cidr} (pod {pod.key})")
        return str(cidr.network_address + n)
    if family == "ipv4":
        if n >= 255:
            raise PlacementError(f"too many pods on node {pod.node} for the sandbox's /24 (pod {pod.key})")
        return f"10.{244 + node_index // 256}.{node_index % 256}.{n}"
    return f"fd00:10:244:{node_index:x}::{n:x}"


class ServicePort(NamedTuple):
    """One of a Service's ``spec.ports``: ``protocol`` (default TCP), ``port``, ``target`` (its
    targetPort: a number or a container port's name; default: the port) and ``name`` (``""``
    when it has none)."""

    protocol: str
    port: int
    target: int | str
    name: str


@dataclass(frozen=True)
class Service:
    """A Service as ``explain --to`` reads it: ``ref`` (``namespace/name``), its ``selector``
    (``spec.selector``, a plain label map; empty: it selects no pod, as the endpoints controller
    does), its ``ports`` and its ``cluster_ips`` (``spec.clusterIPs``, else ``spec.clusterIP``;
    none for a headless Service's ``None``). Source: the ``core/v1`` Service API reference."""

    ref: str
    selector: tuple[tuple[str, str], ...]
    ports: tuple[ServicePort, ...]
    cluster_ips: tuple[str, ...] = ()

    def selects(self, pod: Pod) -> bool:
        """True when ``pod`` is in the Service's namespace and has every selector label."""
        return bool(self.selector) and pod.namespace == self.ref.split("/")[0] and \
            all(pod.labels.get(k) == v for k, v in self.selector)


def services_from(objects: Iterable[tuple[str, Any]]) -> tuple[dict[str, Service], list[ManifestError]]:
    """Every ``kind: Service`` of the ``(origin, object)`` pairs by ``namespace/name``, and one
    error per Service whose selector or ports cannot be read (it is left out)."""
    services: dict[str, Service] = {}
    errors: list[ManifestError] = []
    for origin, obj in objects:
        if not (isinstance(obj, Mapping) and obj.get("kind") == "Service"):
            continue
        meta = obj.get("metadata")
        meta = meta if isinstance(meta, Mapping) else {}
        ref = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
        try:
            spec = _object(obj.get("spec") or {}, "spec")
            selector = _object(spec.get("selector") or {}, "spec.selector")
            ports = []
            for i, port in enumerate(spec.get("ports") or []):
                port = _object(port, f"spec.ports[{i}]")
                number, target = port.get("port"), port.get("targetPort", port.get("port"))
                if type(number) is not int or not 1 <= number <= 65535:
                    raise InvalidField(f"spec.ports[{i}].port", f"must be a number 1-65535, got {number!r}")
                if not (type(target) is int and 1 <= target <= 65535 or isinstance(target, str) and target):
                    raise InvalidField(f"spec.ports[{i}].targetPort", f"must be a number 1-65535 or a port name, got {target!r}")
                ports.append(ServicePort(str(port.get("protocol") or "TCP"), number, target, str(port.get("name") or "")))
        except InvalidField as exc:
            errors.append(ManifestError("Service", ref, str(exc), origin))
            continue
        ips = spec.get("clusterIPs") or [spec.get("clusterIP")]
        cluster_ips = tuple(str(ip) for ip in ips if isinstance(ip, str) and ip not in ("", "None"))
        services[ref] = Service(ref, tuple(sorted((str(k), str(v)) for k, v in selector.items())), tuple(ports), cluster_ips)
    return services, errors
