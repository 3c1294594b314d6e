"""The protobuf path (agent/daemon/kubeproto.py): on the real kube-apiserver, lists and watches in
protobuf give the model objects that JSON gives for the same API objects; the framing and the
envelope refuse what the serializer never writes; a field newer than the pinned API under a
NetworkPolicy's spec fails closed as the JSON path's strict reading does."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from nftpolicy.agent.daemon import k8s_pb2, kubeproto
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.sources import KubeSource
from nftpolicy.agent.daemon.store import Store
from nftpolicy.translators.manifests import policy_from
from nftpolicy.translators.validation import InvalidField

from .conftest import clear_api

KINDS = ("Namespace", "Pod", "NetworkPolicy", "Node")


def test_the_decoder_is_built_and_is_upb():
    assert kubeproto.UNAVAILABLE is None
    assert kubeproto.accept("Pod") == kubeproto.ACCEPT and kubeproto.accept("ClusterNetworkPolicy") == "application/json"


OBJECTS: list[dict[str, Any]] = [
    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "proto-a", "labels": {"team": "x", "empty": ""}}},
    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "proto-b"}},
    {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "proto-node", "labels": {"zone": "z1"}},
     "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:1::/64"]},
     "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.10"}, {"type": "ExternalIP", "address": "2001:db8::a"},
                              {"type": "Hostname", "address": "proto-node"}]}},
    {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-0", "namespace": "proto-a", "labels": {"app": "web", "tier": "1"}},
     "spec": {"nodeName": "proto-node", "containers": [
         {"name": "c", "ports": [{"containerPort": 80, "name": "http"}, {"containerPort": 53, "protocol": "UDP", "name": "dns"}]},
         {"name": "d", "ports": [{"containerPort": 9000, "protocol": "SCTP"}]}]},
     "status": {"phase": "Running", "podIP": "10.244.1.5", "podIPs": [{"ip": "10.244.1.5"}, {"ip": "fd00:1::5"}]}},
    {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "host", "namespace": "proto-a"},
     "spec": {"hostNetwork": True, "containers": [{"name": "c"}]}, "status": {"phase": "Running", "podIP": "192.0.2.10"}},
    {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "pending", "namespace": "proto-b", "labels": {"app": "db"}},
     "spec": {"containers": [{"name": "c"}]}},
    {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "done", "namespace": "proto-b"},
     "spec": {"containers": [{"name": "c"}]}, "status": {"phase": "Succeeded", "podIP": "10.244.1.9"}},
    {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "mixed", "namespace": "proto-a"},
     "spec": {"podSelector": {"matchLabels": {"app": "web"}, "matchExpressions": [{"key": "tier", "operator": "In", "values": ["1", "2"]}]},
              "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
                                    {"namespaceSelector": {"matchLabels": {"team": "x"}}, "podSelector": {}},
                                    {"podSelector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]}}],
                           "ports": [{"port": "http"}, {"port": 8000, "endPort": 8080, "protocol": "UDP"}, {"protocol": "SCTP"}]},
                          {}],
              "egress": [{"to": [{"ipBlock": {"cidr": "fd00::/8"}}]}, {"ports": [{"port": 53, "protocol": "UDP"}]}]}},
    {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "deny", "namespace": "proto-b"},
     "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}},
]


def listed(cp, json_only: bool) -> tuple[Store, threading.Event]:
    """A Store fed by the agent's KubeSource (JSON only, or protobuf where the kind has it),
    once every kind is listed."""
    metrics, stop = Metrics(), threading.Event()
    store = Store(metrics)
    source = KubeSource(store, metrics, cp.kubeconfig, 10.0, 300, stop)
    if json_only:
        for kind in KINDS:
            source.calls[kind][0].accept = "application/json"  # type: ignore[attr-defined]
    source.start()
    deadline = time.monotonic() + 30
    while not store.listed(KINDS):
        assert time.monotonic() < deadline, f"not listed: {store.unlisted()}"
        time.sleep(0.02)
    return store, stop


def wait_equal(a: Store, b: Store, want: Any) -> None:
    deadline = time.monotonic() + 30
    while True:
        ca, cb = a.take()[0], b.take()[0]
        if ca == cb and want(cb):
            return
        assert time.monotonic() < deadline, f"JSON and protobuf stores differ:\n{ca}\n{cb}"
        time.sleep(0.05)


def test_protobuf_and_json_give_equal_models_from_the_real_api_server(control_plane):
    cp = control_plane
    for obj in OBJECTS:
        cp.apply(obj)
    json_store, stop_json = listed(cp, json_only=True)
    proto_store, stop_proto = listed(cp, json_only=False)
    try:
        wait_equal(json_store, proto_store, lambda c: "proto-a/web-0" in c.pods and "proto-a/mixed" in c.policies)
        cluster = proto_store.take()[0]
        web = cluster.pods["proto-a/web-0"]
        assert web.ips == ("10.244.1.5", "fd00:1::5") and web.node == "proto-node" and web.phase == "Running"
        assert [(p.name, p.port, p.protocol) for p in web.ports] == [("http", 80, "TCP"), ("dns", 53, "UDP"), (None, 9000, "SCTP")]
        assert cluster.pods["proto-a/host"].host_network and cluster.pods["proto-b/pending"].node is None
        assert cluster.nodes["proto-node"].peer_addresses == ("192.0.2.10", "2001:db8::a")
        assert cluster.namespaces["proto-a"].labels == {"team": "x", "empty": "", "kubernetes.io/metadata.name": "proto-a"}
        assert cluster.policies["proto-b/deny"].policy_types == frozenset({"ingress", "egress"})
        # watch events, both ways: a relabel, a new pod with its status, a deletion, a replaced policy
        cp.apply({**OBJECTS[3], "metadata": {**OBJECTS[3]["metadata"], "labels": {"app": "web", "tier": "2"}}})
        cp.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "new", "namespace": "proto-b", "labels": {"app": "db"}},
                  "spec": {"containers": [{"name": "c", "ports": [{"containerPort": 5432, "name": "pg"}]}]},
                  "status": {"phase": "Running", "podIPs": [{"ip": "10.244.1.7"}]}})
        cp.delete("Pod", "done", "proto-b")
        cp.apply({**OBJECTS[-1], "spec": {"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"ports": [{"port": "pg"}]}]}})
        wait_equal(json_store, proto_store, lambda c: c.pods.get("proto-b/new") is not None and c.pods["proto-b/new"].ips
                   and "proto-b/done" not in c.pods and c.pods["proto-a/web-0"].labels.get("tier") == "2"
                   and c.policies["proto-b/deny"].ingress)
    finally:
        stop_json.set()
        stop_proto.set()
        clear_api(cp)


def test_protobuf_answers_are_what_the_agent_asks_for(control_plane):
    """The real API server answers the agent's Accept in protobuf for the four kinds (lists,
    watches, errors), and a protobuf Status error reads as its JSON message."""
    cp = control_plane
    metrics, stop = Metrics(), threading.Event()
    source = KubeSource(Store(metrics), metrics, cp.kubeconfig, 10.0, 300, stop)
    for kind in KINDS:
        response = source.calls[kind][0](limit=1, _request_timeout=10)
        assert kubeproto.is_protobuf(response), kind
        items, version, _ = kubeproto.list_page(kind, response.data)
        assert version
    from nftpolicy.agent.daemon.kubeclient import Collection, client

    missing = Collection(source.api, "/api/v1/namespaces/proto-none/pods/nope", kubeproto.ACCEPT, kubeproto.status_json)
    with pytest.raises(client.ApiException) as raised:
        missing(_request_timeout=10)
    assert raised.value.status == 404 and '"message":"pods \\"nope\\" not found"' in raised.value.body


class Stream:
    """A watch response's body, read as urllib3's ``read(n)`` reads it."""

    headers = {"Content-Type": "application/vnd.kubernetes.protobuf;stream=watch"}

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, n: int) -> bytes:
        chunk, self.data = self.data[:n], self.data[n:]
        return chunk


def frame(event_type: str, kind: str, raw: bytes) -> bytes:
    envelope = k8s_pb2.Unknown(typeMeta=k8s_pb2.Unknown_typeMeta(apiVersion="v1", kind=kind), raw=raw)
    event = k8s_pb2.WatchEvent(type=event_type, object=k8s_pb2.WatchEvent_object(raw=kubeproto.MAGIC + envelope.SerializeToString()))
    body = event.SerializeToString()
    return len(body).to_bytes(4, "big") + body


def test_watch_frames_are_read_and_what_the_serializer_never_writes_is_refused():
    pod = k8s_pb2.Pod()
    pod.metadata.name, pod.metadata.namespace, pod.metadata.resourceVersion = "p", "n", "7"
    status = k8s_pb2.Status(message="too old resource version", reason="Expired", code=410)
    stream = frame("ADDED", "Pod", pod.SerializeToString()) + frame("ERROR", "Status", status.SerializeToString())
    events = list(kubeproto.watch_events(Stream(stream), "Pod"))
    assert events[0][0] == "ADDED" and kubeproto.resource_version(events[0][1]) == "7"
    assert events[1] == ("ERROR", {"kind": "Status", "apiVersion": "v1", "message": "too old resource version",
                                   "reason": "Expired", "code": 410})
    for broken, why in ((stream[:-3], "cut inside a frame"), (stream[:2], "cut inside a frame's length"),
                        ((kubeproto.MAX_FRAME + 1).to_bytes(4, "big"), "watch frame of"),
                        (frame("ADDED", "Node", b""), "a watch event of Pod expected"),
                        (frame("ERROR", "Pod", b""), "a watch ERROR event holds a Status")):
        with pytest.raises(kubeproto.ProtobufError, match=why):
            list(kubeproto.watch_events(Stream(broken), "Pod"))
    with pytest.raises(kubeproto.ProtobufError, match="must start with"):
        kubeproto.unwrap(b"{}")
    gzipped = kubeproto.MAGIC + k8s_pb2.Unknown(contentEncoding="gzip").SerializeToString()
    with pytest.raises(kubeproto.ProtobufError, match="content encoding"):
        kubeproto.unwrap(gzipped)


def test_a_spec_field_newer_than_the_pinned_api_fails_closed_as_in_json():
    policy = k8s_pb2.NetworkPolicy()
    policy.metadata.name, policy.metadata.namespace = "new", "n"
    rule = policy.spec.ingress.add()
    rule.ports.add().protocol = "TCP"
    known = policy.SerializeToString()
    assert policy_from(kubeproto.as_mapping(k8s_pb2.NetworkPolicy.FromString(known))).ingress
    # field 9 of NetworkPolicyIngressRule (a string "x"), which v0.36.3 does not have; and the
    # same appended to a Pod's metadata, whose message is cut on purpose: ignored there
    newer = k8s_pb2.NetworkPolicyIngressRule.FromString(rule.SerializeToString() + b"\x4a\x01x")
    policy.spec.ingress[0].CopyFrom(newer)
    mapping = kubeproto.as_mapping(policy)
    with pytest.raises(InvalidField, match=r"spec.ingress\[0\].field 9: unknown field"):
        policy_from(mapping)
    pod = k8s_pb2.Pod.FromString(b"\x0a\x05\x0a\x01p\x4a\x00")
    assert kubeproto.pod_of(pod).name == "p"
