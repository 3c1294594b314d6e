"""Validation parity: the real kube-apiserver (v1.36, :class:`ControlPlane`) against our translator.

For each object of the tables below, the API server's verdict (created or rejected, through a
server-side dry run, ``fieldValidation=Strict`` as ``kubectl`` sends it) is compared with ours
(:func:`build_cluster` keeps the object, or reports it). Where they disagree the API server is
right, and the translator is what gets fixed.

- NetworkPolicies (mostly malformed, a few valid but unusual): both verdicts must be the same,
  and every object the API accepts must also be accepted by us as the API returns it (defaulted,
  as the agent reads it).
- Pods and Namespaces (mostly odd but valid): an object the API server accepts must never be
  dropped by us; a dropped pod loses its isolation (fail-open). Pod status is written through the
  ``status`` subresource of real pods. A few malformed ones show that we reject them, or at
  least keep the rest of the cluster (no exception).

Each row's id says what it tests and, by its prefix, the API server's verdict (``ok-``/``bad-``).
"""

from __future__ import annotations

import ipaddress
import secrets

import pytest

from nftpolicy.agent.daemon.store import CONVERT
from nftpolicy.agent.testbed.controlplane import ApiError, ControlPlane
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.validation import InvalidField

pytestmark = [pytest.mark.kernel, pytest.mark.tools("etcd", "kube-apiserver")]

NS = "parity"
NETPOL = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"
PODS = f"/api/v1/namespaces/{NS}/pods"
DRY_RUN = "?dryRun=All&fieldValidation=Strict"


@pytest.fixture(scope="module")
def cp():
    with ControlPlane() as plane:
        plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
        yield plane


def api_create(cp: ControlPlane, path: str, obj: dict, query: str = DRY_RUN) -> tuple[dict | None, str]:
    """(the object as the API returns it, "") when created; (None, the API's reason) when rejected."""
    try:
        return cp.request("POST", path + query, obj), ""
    except ApiError as error:
        if error.status not in (400, 422):  # anything else is not a validation verdict
            raise
        return None, error.reason


def ours(obj: dict) -> str:
    """Our verdict: "" when the object is kept, else the error lines."""
    cluster, errors = build_cluster([("parity", obj)])
    return "; ".join(str(e) for e in errors)


def agent_reads(obj: dict):
    """The model object that the agent's API source makes of ``obj``; AssertionError when it drops it."""
    try:
        return CONVERT[obj["kind"]](obj)
    except InvalidField as error:
        raise AssertionError(f"the stored {obj['kind']} (what the agent reads) is dropped: {error}") from None


def verdicts(stored: dict | None, reason: str, our_errors: str) -> str:
    api = "created" if stored is not None else f"rejected: {reason}"
    return f"API server {api} | ours: {our_errors or 'rendered'}"


def should_accept(request) -> bool:
    """The API server's verdict that the row's id announces."""
    return request.node.callspec.id.startswith("ok-")


# ---- NetworkPolicies -----------------------------------------------------------------------


def policy(spec: dict | None = None, name: str = "p", **meta) -> dict:
    obj = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": NS, "name": name, **meta}}
    if spec is not None:
        obj["spec"] = spec
    return obj


def peer(p: dict) -> dict:
    return policy({"podSelector": {}, "ingress": [{"from": [p]}]})


def cidr(c, *excepts) -> dict:
    return peer({"ipBlock": {"cidr": c, **({"except": list(excepts)} if excepts else {})}})


def port(entry: dict) -> dict:
    return policy({"podSelector": {}, "ingress": [{"ports": [entry]}]})


def selector(sel) -> dict:
    return policy({"podSelector": sel})


def expr(key, operator, values=None) -> dict:
    e = {"key": key, "operator": operator}
    if values is not None:
        e["values"] = values
    return selector({"matchExpressions": [e]})


def types(t) -> dict:
    return policy({"podSelector": {}, "policyTypes": t})


POLICIES = [
    # CIDRs
    pytest.param(cidr("10.0.0.1/24"), id="bad-cidr-with-host-bits"),
    pytest.param(cidr("10.0.0.0"), id="bad-cidr-without-prefix"),
    pytest.param(cidr("10.0.0.0/33"), id="bad-cidr-prefix-33"),
    pytest.param(cidr("010.0.0.0/8"), id="bad-cidr-leading-zero"),
    pytest.param(cidr("::ffff:10.0.0.0/104"), id="bad-cidr-ipv4-mapped-ipv6"),
    pytest.param(cidr(""), id="bad-cidr-empty"),
    pytest.param(cidr(10), id="bad-cidr-number"),
    pytest.param(cidr("fe80::%eth0/64"), id="bad-cidr-ipv6-zone"),
    pytest.param(cidr("fd00::/64"), id="ok-cidr-ipv6"),
    pytest.param(cidr("FD00::/64"), id="ok-cidr-ipv6-upper-case"),
    pytest.param(cidr("fd00::/129"), id="bad-cidr-ipv6-prefix-129"),
    pytest.param(cidr("::/0", "fd00::/8"), id="ok-cidr-ipv6-all-with-except"),
    pytest.param(cidr("10.0.0.0/16", "10.0.1.0/24"), id="ok-except-inside-cidr"),
    pytest.param(cidr("10.0.0.0/8", "10.1.2.3/16"), id="bad-except-with-host-bits"),
    pytest.param(cidr("10.0.0.0/16", "10.1.0.0/24"), id="bad-except-outside-cidr"),
    pytest.param(cidr("10.0.0.0/16", "10.0.0.0/8"), id="bad-except-larger-than-cidr"),
    pytest.param(cidr("10.0.0.0/16", "10.0.0.0/16"), id="bad-except-equal-to-cidr"),
    pytest.param(cidr("10.0.0.0/8", "fd00::/64"), id="bad-except-ipv6-in-ipv4-cidr"),
    pytest.param(cidr("::/0", "0.0.0.0/1"), id="bad-except-ipv4-in-ipv6-cidr"),
    pytest.param(cidr("10.0.0.0/8", "10.0.0.0/40"), id="bad-except-invalid-cidr"),
    # ports
    pytest.param(port({"port": 0}), id="bad-port-0"),
    pytest.param(port({"port": 65536}), id="bad-port-65536"),
    pytest.param(port({"port": -1}), id="bad-port-negative"),
    pytest.param(port({"port": 65535}), id="ok-port-65535"),
    pytest.param(port({"port": [80]}), id="bad-port-as-list"),
    pytest.param(port({"port": 80.5}), id="bad-port-as-float"),
    pytest.param(port({"port": True}), id="bad-port-as-bool"),
    pytest.param(port({"port": "80"}), id="bad-port-as-string-number"),
    pytest.param(port({"port": ""}), id="bad-port-empty-string"),
    pytest.param(port({"protocol": "UDP", "port": None}), id="ok-port-null-protocol-only"),
    pytest.param(port({"endPort": 90}), id="bad-endport-without-port"),
    pytest.param(port({"port": 90, "endPort": 80}), id="bad-endport-less-than-port"),
    pytest.param(port({"port": 80, "endPort": 80}), id="ok-endport-equal-to-port"),
    pytest.param(port({"port": 80, "endPort": 65536}), id="bad-endport-65536"),
    pytest.param(port({"port": 80, "endPort": "90"}), id="bad-endport-as-string"),
    pytest.param(port({"port": "http", "endPort": 90}), id="bad-endport-with-named-port"),
    # named ports (IANA service names)
    pytest.param(port({"port": "http"}), id="ok-named-port-http"),
    pytest.param(port({"port": "a23456789012345"}), id="ok-named-port-15-chars"),
    pytest.param(port({"port": "a234567890123456"}), id="bad-named-port-16-chars"),
    pytest.param(port({"port": "HTTP"}), id="bad-named-port-upper-case"),
    pytest.param(port({"port": "my--port"}), id="bad-named-port-double-hyphen"),
    pytest.param(port({"port": "1-2"}), id="bad-named-port-no-letter"),
    pytest.param(port({"port": "-http"}), id="bad-named-port-leading-hyphen"),
    pytest.param(port({"port": "http-"}), id="bad-named-port-trailing-hyphen"),
    pytest.param(port({"port": "my_port"}), id="bad-named-port-underscore"),
    # protocols
    pytest.param(port({"protocol": "tcp", "port": 80}), id="bad-protocol-lower-case"),
    pytest.param(port({"protocol": "ICMP"}), id="bad-protocol-icmp"),
    pytest.param(port({"protocol": "", "port": 80}), id="bad-protocol-empty"),
    pytest.param(port({"protocol": "SCTP", "port": 80}), id="ok-protocol-sctp"),
    pytest.param(port({"protocol": None, "port": 80}), id="ok-protocol-null-is-tcp"),
    # selectors
    pytest.param(expr("app", "Equals", ["a"]), id="bad-operator-unknown"),
    pytest.param(expr("app", "in", ["a"]), id="bad-operator-lower-case"),
    pytest.param(expr("app", "In", []), id="bad-in-with-empty-values"),
    pytest.param(expr("app", "NotIn"), id="bad-notin-without-values"),
    pytest.param(expr("app", "Exists", ["a"]), id="bad-exists-with-values"),
    pytest.param(expr("app", "DoesNotExist", ["a"]), id="bad-doesnotexist-with-values"),
    pytest.param(expr("app", "NotIn", ["a", "b"]), id="ok-notin"),
    pytest.param(expr("app", "DoesNotExist"), id="ok-doesnotexist"),
    pytest.param(expr("example.com/app", "Exists", []), id="ok-exists-prefixed-key-empty-values"),
    pytest.param(expr("", "Exists"), id="bad-expression-empty-key"),
    pytest.param(expr("app", "In", ["a b"]), id="bad-expression-value-with-space"),
    pytest.param(expr("app", "In", ["a" * 64]), id="bad-expression-value-64-chars"),
    pytest.param(selector({"matchLabels": {"-app": "a"}}), id="bad-label-key-leading-hyphen"),
    pytest.param(selector({"matchLabels": {"Example.com/app": "a"}}), id="bad-label-key-upper-case-prefix"),
    pytest.param(selector({"matchLabels": {"a/b/c": "a"}}), id="bad-label-key-two-slashes"),
    pytest.param(selector({"matchLabels": {"a" * 64: "a"}}), id="bad-label-key-name-64-chars"),
    pytest.param(selector({"matchLabels": {"app": "a b"}}), id="bad-label-value-with-space"),
    pytest.param(selector({"matchLabels": {"app": "a-"}}), id="bad-label-value-trailing-hyphen"),
    pytest.param(selector({"matchLabels": {"app": "a" * 64}}), id="bad-label-value-64-chars"),
    pytest.param(selector({"matchLabels": {"app": 5}}), id="bad-label-value-number"),
    pytest.param(selector({"matchLabels": {"/app": "a"}}), id="bad-label-key-empty-prefix"),
    pytest.param(selector({"matchLabels": {"app/": "a"}}), id="bad-label-key-empty-name"),
    pytest.param(selector({"matchLabels": {"a" * 254 + "/app": "a"}}), id="bad-label-key-prefix-254-chars"),
    pytest.param(selector({"matchLabels": {"a" * 253 + "/" + "b" * 63: "a"}}), id="ok-label-key-longest"),
    pytest.param(selector({"matchLabels": {"app": "a" * 63, "example.com/x_y.z": ""}}), id="ok-label-value-63-chars-and-empty"),
    pytest.param(expr("app", "In", [5]), id="bad-expression-value-number"),
    pytest.param(selector("app=a"), id="bad-podselector-as-string"),
    pytest.param(selector({"matchLabel": {"app": "a"}}), id="bad-selector-unknown-field"),
    pytest.param(selector({}), id="ok-empty-podselector"),
    pytest.param(selector(None), id="ok-null-podselector"),
    pytest.param(policy({"policyTypes": ["Ingress"]}), id="ok-podselector-missing"),
    pytest.param(policy(), id="ok-spec-missing"),
    # policyTypes
    pytest.param(types(["ingress"]), id="bad-policytypes-lower-case"),
    pytest.param(types(["Both"]), id="bad-policytypes-unknown"),
    pytest.param(types(["Ingress", "Ingress"]), id="ok-policytypes-duplicated"),
    pytest.param(types(["Ingress", "Egress", "Ingress"]), id="bad-policytypes-three-entries"),
    pytest.param(types("Ingress"), id="bad-policytypes-as-string"),
    pytest.param(types([]), id="ok-policytypes-empty-list"),
    pytest.param(types(["Egress"]), id="ok-policytypes-egress-only"),
    # peers and rules
    pytest.param(peer({"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}), id="bad-ipblock-with-podselector"),
    pytest.param(peer({"ipBlock": {"cidr": "10.0.0.0/8"}, "namespaceSelector": {}}), id="bad-ipblock-with-namespaceselector"),
    pytest.param(peer({}), id="bad-empty-peer"),
    pytest.param(peer({"podSelector": {}, "namespaceSelector": {}}), id="ok-pod-and-namespace-selector"),
    pytest.param(peer({"ipBlock": {"except": ["10.0.0.0/24"]}}), id="bad-ipblock-without-cidr"),
    pytest.param(policy({"podSelector": {}, "ingress": [{}]}), id="ok-empty-ingress-rule"),
    pytest.param(policy({"podSelector": {}, "ingress": {}}), id="bad-ingress-as-object"),
    pytest.param(policy({"podSelector": {}, "egress": [{"from": [{"podSelector": {}}]}]}), id="bad-from-in-egress-rule"),
    pytest.param(policy({"podSelector": {}, "ingres": []}), id="bad-unknown-spec-field"),
    # names and metadata
    pytest.param(policy({"podSelector": {}}, name="Deny"), id="bad-name-upper-case"),
    pytest.param(policy({"podSelector": {}}, name="a_b"), id="bad-name-underscore"),
    pytest.param(policy({"podSelector": {}}, name="a."), id="bad-name-trailing-dot"),
    pytest.param(policy({"podSelector": {}}, name="a" * 254), id="bad-name-254-chars"),
    pytest.param(policy({"podSelector": {}}, name=""), id="bad-name-missing"),
    pytest.param(policy({"podSelector": {}}, name="a.b-c.d"), id="ok-name-with-dots"),
    pytest.param(policy({"podSelector": {}}, name="a" * 253), id="ok-name-253-chars"),
    pytest.param(policy({"podSelector": {}}, labels={"-bad": "x"}), id="bad-metadata-label-key"),
    pytest.param(policy({"podSelector": {}}, annotations={"a b": "x"}), id="bad-metadata-annotation-key"),
    pytest.param(policy({"podSelector": {}}, annotations={"a": 1}), id="bad-metadata-annotation-value-number"),
    pytest.param(policy({"podSelector": {}}, annotations={"Example.com/Note": "any text: ok!", "-": ""}), id="bad-metadata-annotation-key-hyphen"),
    pytest.param(policy({"podSelector": {}}, annotations={"Example.com/Note": "any text, even  spaces!"}), id="ok-metadata-annotation-upper-case-key"),
    pytest.param(policy({"podSelector": {}}, name="", generateName="deny-"), id="ok-generate-name-only"),
    pytest.param(policy({"podSelector": {}}, name="", generateName="Deny-"), id="bad-generate-name-upper-case"),
    pytest.param(policy({"podSelector": {}}, name="", generateName="a" * 100), id="ok-generate-name-long-is-truncated"),
]


@pytest.mark.parametrize("obj", POLICIES)
def test_policy_verdicts_agree(cp, obj, request):
    stored, reason = api_create(cp, NETPOL, obj)
    our_errors = ours(obj)
    both = verdicts(stored, reason, our_errors)
    assert (stored is not None) == should_accept(request), f"the table's id is wrong: {both}"
    assert (stored is not None) == (not our_errors), both
    if stored is not None:
        agent_reads(stored)


UNKNOWN_FIELDS = [
    pytest.param(policy({"podSelector": {}, "ingres": [{}]}), id="spec-ingres"),
    pytest.param(policy({"podSelector": {}, "egress": [{"from": [{"podSelector": {}}]}]}), id="egress-from"),
    pytest.param(port({"port": 80, "portEnd": 90}), id="port-portEnd"),
]


@pytest.mark.parametrize("obj", UNKNOWN_FIELDS)
def test_unknown_fields_warn_mode_drops_them_and_we_enforce_the_stored_object(cp, obj):
    """The API server's own default (fieldValidation=Warn) stores the object without the unknown
    field; ``kubectl`` (Strict, the rows above) refuses it, as we do for manifests. What the agent
    reads from the API is the stored object, and that one we must enforce."""
    stored, reason = api_create(cp, NETPOL, obj, query="?dryRun=All")
    assert stored is not None, f"API server rejected it in Warn mode: {reason}"
    assert ours(obj), "we should refuse the typo in a manifest, as kubectl's Strict validation does"
    agent_reads(stored)


OUTSIDE_SPEC = [
    pytest.param({**policy({"podSelector": {}}), "status": {}}, id="status"),  # NetworkPolicy had a status field in 1.24-1.27: "status: {}" in dumps
    pytest.param(policy({"podSelector": {}}, foo="bar"), id="metadata-foo"),
]


@pytest.mark.parametrize("obj", OUTSIDE_SPEC)
def test_unknown_fields_outside_spec_are_ignored_as_in_warn_mode(cp, obj):
    """Outside ``spec`` an unknown field changes nothing we enforce, and refusing one would drop
    every policy of an old ``kubectl get -o yaml`` dump; so here we follow the API server's
    default (Warn: stored without it), not kubectl's Strict (refused)."""
    assert api_create(cp, NETPOL, obj)[0] is None, "kubectl's Strict validation now accepts it"
    stored, reason = api_create(cp, NETPOL, obj, query="?dryRun=All")
    assert stored is not None, f"API server rejected it in Warn mode: {reason}"
    assert not ours(obj), verdicts(stored, reason, ours(obj))
    agent_reads(stored)


# ---- Pods and Namespaces -------------------------------------------------------------------

IMAGE = "registry.invalid/parity:0"


def pod(name: str = "p", labels: dict | None = None, containers: list | None = None, **spec) -> dict:
    meta = {"namespace": NS, "name": name, **({"labels": labels} if labels is not None else {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": containers or [{"name": "c", "image": IMAGE}], **spec}}


def ports(*entries: dict, name: str = "c") -> dict:
    return {"name": name, "image": IMAGE, "ports": list(entries)}


PODS_SPEC = [
    pytest.param(pod(labels={"example.com/app": "web", "app.kubernetes.io/name": "a.b_c-D", "a.b/c_d": "x"}), id="ok-labels-prefixed-dots-slashes"),
    pytest.param(pod(labels={"app": "v" * 63, "tier": ""}), id="ok-label-value-63-chars-and-empty"),
    pytest.param(pod(labels={"a" * 253 + "/" + "b" * 63: "x"}), id="ok-label-key-longest"),
    pytest.param(pod("web.v1.example-2"), id="ok-name-with-dots"),
    pytest.param(pod("a" * 253), id="ok-name-253-chars"),
    pytest.param(pod(containers=[ports({"name": "http", "containerPort": 80}, {"name": "dns", "containerPort": 53, "protocol": "UDP", "hostPort": 5353},
                                       {"name": "a23456789012345", "containerPort": 9, "protocol": "SCTP"})]), id="ok-named-ports-hostport-sctp"),
    pytest.param(pod(containers=[ports({"containerPort": 53, "protocol": "TCP"}, {"containerPort": 53, "protocol": "UDP"})]), id="ok-same-port-tcp-and-udp"),
    pytest.param(pod(containers=[ports({"name": f"p{i}", "containerPort": 8000 + i}, name=f"c{i}") for i in range(12)]), id="ok-12-containers"),
    pytest.param(pod(containers=[ports({"containerPort": 8080, "hostPort": 8080})], hostNetwork=True), id="ok-host-network"),
    pytest.param(pod(nodeName="node-1.example.com"), id="ok-node-name-with-dots"),
    pytest.param({**pod(), "metadata": {"namespace": NS, "generateName": "web-"}}, id="ok-generate-name-only"),
    pytest.param(pod("Web"), id="bad-name-upper-case"),
    pytest.param(pod("a" * 254), id="bad-name-254-chars"),
    pytest.param(pod(labels={"app": "v" * 64}), id="bad-label-value-64-chars"),
    pytest.param(pod(labels={"/app": "a"}), id="bad-label-key-empty-prefix"),
    pytest.param(pod(containers=[ports({"containerPort": 0})]), id="bad-container-port-0"),
    pytest.param(pod(containers=[ports({"containerPort": 80, "protocol": "ICMP"})]), id="bad-container-protocol-icmp"),
    pytest.param(pod(containers=[ports({"name": "HTTP", "containerPort": 80})]), id="bad-container-port-name-upper-case"),
    pytest.param(pod(hostNetwork="false"), id="bad-host-network-as-string"),
    pytest.param(pod(containers={"name": "c", "image": IMAGE}), id="bad-containers-as-object"),
]


@pytest.mark.parametrize("obj", PODS_SPEC)
def test_pod_accepted_by_the_api_is_kept(cp, obj, request):
    stored, reason = api_create(cp, PODS, obj)
    our_errors = ours(obj)
    both = verdicts(stored, reason, our_errors)
    assert (stored is not None) == should_accept(request), f"the table's id is wrong: {both}"
    if stored is not None:
        assert not our_errors, f"fail-open: {both}"
        agent_reads(stored)


def status(phase: str, *ips: str) -> dict:
    return {"phase": phase, **({"podIP": ips[0], "podIPs": [{"ip": ip} for ip in ips]} if ips else {})}


POD_STATUSES = [
    pytest.param(status("Running", "10.244.0.5"), id="ok-running-ipv4"),
    pytest.param(status("Running", "fd00:10:244::5"), id="ok-running-ipv6"),
    pytest.param(status("Running", "10.244.0.6", "fd00:10:244::6"), id="ok-dual-stack-ipv4-first"),
    pytest.param(status("Running", "fd00:10:244::7", "10.244.0.7"), id="ok-dual-stack-ipv6-first"),
    pytest.param(status("Pending"), id="ok-pending-without-ip"),
    pytest.param(status("Pending", "10.244.0.8"), id="ok-pending-with-ip"),
    pytest.param(status("Unknown", "10.244.0.9"), id="ok-unknown-phase"),
    pytest.param(status("Succeeded", "10.244.0.10"), id="ok-succeeded"),
    pytest.param(status("Failed", "10.244.0.11"), id="ok-failed"),
    pytest.param(status("Running", "FD00:10:244::C"), id="ok-ipv6-upper-case"),
    pytest.param(status("Running", "10.244.0.13", "10.244.0.14"), id="bad-two-ipv4-addresses"),
    pytest.param(status("Running", "10.244.0.300"), id="bad-ip-octet-300"),
    pytest.param(status("Running", "010.244.0.15"), id="bad-ip-leading-zero"),
]


@pytest.mark.parametrize("st", POD_STATUSES)
def test_pod_status_accepted_by_the_api_is_kept(cp, st, request):
    """Status goes through the ``status`` subresource of a real pod (not dry-runnable as a create)."""
    name = f"s-{secrets.token_hex(4)}"
    created = cp.request("POST", PODS, pod(name, labels={"app": "s"}, nodeName="node1"))
    try:
        stored, reason = cp.request("PUT", f"{PODS}/{name}/status", {**created, "status": {**created.get("status", {}), **st}}), ""
    except ApiError as error:
        if error.status != 422:
            raise
        stored, reason = None, error.reason
    finally:
        cp.delete("Pod", name, NS)
    manifest = {**pod(name, labels={"app": "s"}, nodeName="node1"), "status": st}
    our_errors = ours(manifest)
    both = verdicts(stored, reason, our_errors)
    assert (stored is not None) == should_accept(request), f"the table's id is wrong: {both}"
    if stored is not None:
        assert not our_errors, f"fail-open: {both}"
        kept = agent_reads(stored)
        api_ips = [str(ipaddress.ip_address(e["ip"])) for e in stored["status"].get("podIPs", [])]
        assert (list(kept.ips), kept.phase) == (api_ips, stored["status"]["phase"]), f"API server: {stored['status']}"


def namespace(name: str = "n", labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, **({"labels": labels} if labels is not None else {})}}


NAMESPACES = [
    pytest.param(namespace(labels={"example.com/team": "a.b_c-D", "env": "", "x": "v" * 63}), id="ok-labels-prefixed-empty-63-chars"),
    pytest.param(namespace("n" * 63), id="ok-name-63-chars"),
    pytest.param(namespace("0-a-1"), id="ok-name-leading-digit"),
    pytest.param(namespace(labels={"kubernetes.io/metadata.name": "other"}), id="ok-name-label-is-overwritten"),
    pytest.param({**namespace(), "metadata": {"generateName": "team-"}}, id="ok-generate-name-only"),
    pytest.param(namespace("a.b"), id="bad-name-with-dot"),
    pytest.param(namespace("n" * 64), id="bad-name-64-chars"),
    pytest.param(namespace("Team"), id="bad-name-upper-case"),
    pytest.param(namespace(labels={"a b": "c"}), id="bad-label-key-with-space"),
    pytest.param(namespace(labels={"app": "-a"}), id="bad-label-value-leading-hyphen"),
]


@pytest.mark.parametrize("obj", NAMESPACES)
def test_namespace_accepted_by_the_api_is_kept(cp, obj, request):
    stored, reason = api_create(cp, "/api/v1/namespaces", obj)
    our_errors = ours(obj)
    both = verdicts(stored, reason, our_errors)
    assert (stored is not None) == should_accept(request), f"the table's id is wrong: {both}"
    if stored is not None:
        assert not our_errors, f"namespace dropped: {both}"
        assert dict(agent_reads(stored).labels) == stored["metadata"]["labels"]
