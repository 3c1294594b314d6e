"""Which fields of the Kubernetes API's protobuf messages the agent reads (:mod:`.kubeproto`).

The build step (``setup.py``: ``build_py``) compiles the ``generated.proto`` files of the
``k8s.io/api`` and ``k8s.io/apimachinery`` modules that ``tools/k8s/go.mod`` pins, then keeps of
each message named here only the fields named here, with their upstream numbers and types, in
one file of its own (``k8s.proto``, package ``nftpolicy.k8s``), from which protoc generates
``k8s_pb2.py``. A field left out is skipped by the decoder as an unknown field (its bytes are
kept, never parsed): a Pod's managedFields, annotations, volumes, environment and container
statuses cost a copy, not a parse.

Each entry is ``(upstream message, {field: entry or None})`` (None: a scalar, a repeated scalar
or a map, kept as it is), or ``(upstream message, ALL)``: every field of the message and of
the messages under it, so that an unknown field under it can only be one newer than the pinned
modules (:func:`.kubeproto.as_mapping` refuses it as the JSON path's strict reading does). A
message named twice as one object is one generated message (the Pod of a PodList and of a
watch event). This module imports nothing: the build reads it before the package is installed.
"""

from __future__ import annotations

from typing import Union

ALL = "*"
Entry = tuple[str, Union[dict[str, Union["Entry", None]], str]]

META = "k8s.io.apimachinery.pkg.apis.meta.v1"
RUNTIME = "k8s.io.apimachinery.pkg.runtime"
CORE = "k8s.io.api.core.v1"
NETWORKING = "k8s.io.api.networking.v1"

LIST_META: Entry = (f"{META}.ListMeta", {"resourceVersion": None, "continue": None})
# metadata.generation, uid, annotations: the Events of a fail-closed NetworkPolicy, and its validation
POLICY_META: Entry = (f"{META}.ObjectMeta", {"name": None, "generateName": None, "namespace": None, "uid": None,
                                             "resourceVersion": None, "generation": None, "labels": None, "annotations": None})
CLUSTER_META: Entry = (f"{META}.ObjectMeta", {"name": None, "generateName": None, "resourceVersion": None, "labels": None})
POD: Entry = (f"{CORE}.Pod", {
    "metadata": (f"{META}.ObjectMeta", {"name": None, "generateName": None, "namespace": None, "resourceVersion": None,
                                       "labels": None}),
    "spec": (f"{CORE}.PodSpec", {"nodeName": None, "hostNetwork": None, "containers": (f"{CORE}.Container", {
        "ports": (f"{CORE}.ContainerPort", {"name": None, "containerPort": None, "protocol": None})})}),
    "status": (f"{CORE}.PodStatus", {"phase": None, "podIP": None, "podIPs": (f"{CORE}.PodIP", {"ip": None})}),
})
NAMESPACE: Entry = (f"{CORE}.Namespace", {"metadata": CLUSTER_META})
NODE: Entry = (f"{CORE}.Node", {
    "metadata": CLUSTER_META,
    "spec": (f"{CORE}.NodeSpec", {"podCIDR": None, "podCIDRs": None}),
    "status": (f"{CORE}.NodeStatus", {"addresses": (f"{CORE}.NodeAddress", {"type": None, "address": None}),
                                      "conditions": (f"{CORE}.NodeCondition", {"type": None, "status": None})}),
})
NETWORK_POLICY: Entry = (f"{NETWORKING}.NetworkPolicy", {"metadata": POLICY_META,
                                                         "spec": (f"{NETWORKING}.NetworkPolicySpec", ALL)})

# The generated message of each name (a kind's object first: it keeps the kind's name).
MESSAGES: dict[str, Entry] = {
    # the envelope of every body (runtime.Unknown after the 4 bytes "k8s\0"), and of a watch's events
    "Unknown": (f"{RUNTIME}.Unknown", {"typeMeta": (f"{RUNTIME}.TypeMeta", {"apiVersion": None, "kind": None}),
                                       "raw": None, "contentEncoding": None, "contentType": None}),
    "WatchEvent": (f"{META}.WatchEvent", {"type": None, "object": (f"{RUNTIME}.RawExtension", {"raw": None})}),
    "Status": (f"{META}.Status", {"message": None, "reason": None, "code": None}),
    "Pod": POD,
    "Namespace": NAMESPACE,
    "Node": NODE,
    "NetworkPolicy": NETWORK_POLICY,
    "PodList": (f"{CORE}.PodList", {"metadata": LIST_META, "items": POD}),
    "NamespaceList": (f"{CORE}.NamespaceList", {"metadata": LIST_META, "items": NAMESPACE}),
    "NodeList": (f"{CORE}.NodeList", {"metadata": LIST_META, "items": NODE}),
    "NetworkPolicyList": (f"{NETWORKING}.NetworkPolicyList", {"metadata": LIST_META, "items": NETWORK_POLICY}),
}
# The files that define them, by import path (protoc's -I root: k8s.io/api/..., k8s.io/apimachinery/...).
PROTO_FILES = ("k8s.io/api/core/v1/generated.proto", "k8s.io/api/networking/v1/generated.proto")
