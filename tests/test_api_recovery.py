"""Back within seconds after a control-plane fault (issue 23): for each fault, the time from the
API's return to the agent's table in the kernel being exactly the render of what the API holds
then, and the table never leaving the kernel meanwhile.

Against the real kube-apiserver and etcd of :class:`ControlPlane`, with the agent under a
ServiceAccount token bound to the chart's ClusterRole (as in production: a restarting API server
refuses such a token until its RBAC authorizer has loaded, which an admin token never sees):
kube-apiserver SIGKILLed and SIGTERMed then restarted on the same etcd, etcd stopped and started
under a running kube-apiserver, etcd's history compacted past every resourceVersion the agent
holds (410 Gone: relist), the ClusterRoleBinding removed then restored. Against the in-repo fake
API server, running with the agent in a namespace of their own: every open API connection goes
silent (its packets are dropped, the socket stays open) while new connections are served.

"Equal to the render": the model of every object the API lists now (the agent's own conversion,
:class:`Store`) rendered for node1 (``build_rule_model``) and committed into a scratch namespace;
both tables listed by libnftables and compared without handles and with set elements sorted.
Each case records its time as the ``catch_up_seconds`` property, and the time the API took to
accept the change after its return as ``change_accepted_seconds`` (``--junitxml`` shows them):
the reliability table of docs/operations.md. The agent must be done within 5 s of the change's acceptance
(which follows the return by under 0.1 s but after etcd's return, when it takes seconds).
"""

from __future__ import annotations

import base64
import json
import subprocess
import threading
import time
import urllib.request
from typing import Any, Callable, Iterable, Mapping

import pytest

from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.testbed.controlplane import ApiError, ControlPlane
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.dataplane.nftables import NftDataplane
from nftpolicy.agent.daemon.store import KINDS, Store
from nftpolicy.translators import transaction
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import Config

from .agentenv import AgentEnv, RealApi
from .conftest import clear_api, eventually, nft
from .fakeapi import FakeApiServer, namespace, pod
from .test_chart import NAMESPACE, agent_rbac, render

pytestmark = pytest.mark.kernel
# every test but the silent watch's (on the fake API server) uses `plane`: the chart's RBAC through helm
REAL_PLANE = pytest.mark.tools("etcd", "kube-apiserver", "helm")

CATCH_UP = 5.0  # seconds from the API's return (and its acceptance of the change) to the table equal to the render
TABLE = "nftpolicy"
AGENT_CONFIG = Config(unknown_pods="hold")  # what the agent enforces with its default flags
A, B, C = "10.244.0.10", "10.244.0.11", "10.244.0.12"
SLOTS = {"x/a": A, "x/b": B, "x/c": C}


def policy(name: str, app: str) -> dict[str, Any]:
    """A NetworkPolicy of namespace x that isolates the pods labelled ``app`` for ingress."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "x", "name": name},
            "spec": {"podSelector": {"matchLabels": {"app": app}}, "policyTypes": ["Ingress"]}}


# What changes once the API is back: a policy goes, another comes, and it only takes effect
# through a pod label and a namespace label, so the table is the render only once the Pod,
# Namespace and NetworkPolicy watches are all back.
WEB_FROM_BLUE_A = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "x", "name": "web"},
                   "spec": {"podSelector": {"matchLabels": {"tier": "web"}}, "ingress": [{"from": [
                       {"namespaceSelector": {"matchLabels": {"team": "blue"}}, "podSelector": {"matchLabels": {"app": "a"}}}]}]}}


def change(api: FakeApiServer | RealApi) -> None:
    """The change after the API's return (in this order): deny-b deleted, WEB_FROM_BLUE_A,
    pod x/c labelled tier=web, namespace x labelled team=blue. Then x/a reaches B and C, x/b
    does not reach C."""
    api.delete("NetworkPolicy", "deny-b", "x")
    api.put(WEB_FROM_BLUE_A)
    api.put(pod("x", "c", C, app="c", tier="web"))
    api.put(namespace("x", team="blue"))


def check_packets(env: AgentEnv) -> None:
    """The verdicts of the state :func:`change` leaves, with real packets."""
    assert env.connects("x/a", B) and env.connects("x/a", C) and not env.connects("x/b", C)


class FaultPlane(ControlPlane):
    """A :class:`ControlPlane` with the faults of a control-plane upgrade or incident."""

    def kill_apiserver(self) -> None:
        """SIGKILL kube-apiserver: no graceful shutdown, its connections reset by the kernel."""
        assert self._apiserver is not None
        self._apiserver.kill()
        self._apiserver.wait()
        self._apiserver = None

    def stop_etcd(self) -> None:
        """Stop etcd (SIGTERM); its data stays, :meth:`start_etcd` starts it again."""
        assert self._etcd is not None
        self._etcd_argv = [str(a) for a in self._etcd.args]
        self._stop(self._etcd)
        self._etcd = None

    def start_etcd(self) -> None:
        """Start etcd again with the same flags and data; return once it is healthy."""
        self._etcd = self._spawn("etcd", self._etcd_argv)
        self._wait("etcd", self._etcd, self._etcd_healthy, 30)

    def wait_ready(self, timeout: float = 90) -> None:
        """Return once kube-apiserver's /readyz says ok (every check: etcd included)."""
        assert self._apiserver is not None
        self._wait("kube-apiserver", self._apiserver, self._apiserver_ready, timeout)

    def _etcd_v3(self, call: str, body: Mapping[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.etcd_port}/v3/{call}", data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=10) as reply:
            result: dict[str, Any] = json.loads(reply.read())
        return result

    def compact_past_everything(self) -> int:
        """Write one key outside the API's prefix (``/registry``), so that etcd's revision
        passes every resourceVersion handed out so far, delete it, and compact etcd's history
        up to that revision (etcd's gRPC gateway: ``/v3/kv/put``, ``deleterange``,
        ``compaction``). Returns the revision compacted to."""
        key = base64.b64encode(b"/nftpolicy-test/compaction").decode()
        self._etcd_v3("kv/put", {"key": key, "value": base64.b64encode(b"1").decode()})
        revision = int(self._etcd_v3("kv/deleterange", {"key": key})["header"]["revision"])
        self._etcd_v3("kv/compaction", {"revision": revision, "physical": True})
        return revision


# ---- the kernel side ----------------------------------------------------------------------------

def normalized(listing: Iterable[Mapping[str, Any]]) -> tuple[dict[tuple[str, str], Any], dict[str, list[Any]]]:
    """A table listing (libnftables JSON objects) without handles, in a form that does not
    depend on the order objects were created in: non-rule objects by (type, name), with set
    and map elements sorted; rules per chain, in their order."""
    objects: dict[tuple[str, str], Any] = {}
    rules: dict[str, list[Any]] = {}
    for item in listing:
        (kind, body), = item.items()
        body = {k: v for k, v in body.items() if k != "handle"}
        if kind == "rule":
            rules.setdefault(body["chain"], []).append(body)
            continue
        if "elem" in body:
            body["elem"] = sorted(body["elem"], key=lambda e: json.dumps(e, sort_keys=True))
        objects[(kind, body["name"])] = body
    return objects, rules


class Kernel:
    """The agent's table in the sandbox node's namespace, and the render it should equal,
    committed into ``scratch`` (a namespace of the test)."""

    def __init__(self, env: AgentEnv, scratch: str) -> None:
        self.agent, self.reference = NftDataplane(TABLE, env.netns), NftDataplane(TABLE, scratch)

    def table(self) -> tuple[dict[tuple[str, str], Any], dict[str, list[Any]]]:
        return normalized(self.agent.listing())

    def render(self, objects: Mapping[str, list[Mapping[str, Any]]]) -> tuple[dict[tuple[str, str], Any], dict[str, list[Any]]]:
        """The table of ``objects`` (kind -> API objects) for node1, as the kernel lists it."""
        store = Store(Metrics())
        for kind in KINDS:
            store.replace(kind, objects.get(kind, []))
        self.reference.run(transaction.full(build_rule_model(store.take()[0], "node1", AGENT_CONFIG)))
        return normalized(self.reference.listing())

    def converged(self, expected: object, since: float, timeout: float = 60.0) -> float:
        """Seconds from ``since`` (monotonic) until the agent's table equals ``expected``
        (polled every 20 ms); fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.table() == expected:
                return time.monotonic() - since
            time.sleep(0.02)
        raise AssertionError(f"the agent's table is not the render of the API {timeout:.0f}s after its return")


class Presence(threading.Thread):
    """While running, checks every 20 ms that the agent's table is in the kernel (``has_table``);
    ``missing`` holds the moments it was not."""

    def __init__(self, env: AgentEnv) -> None:
        super().__init__(daemon=True)
        self.dataplane, self.missing, self.checks = NftDataplane(TABLE, env.netns), list[float](), 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            self.checks += 1
            if not self.dataplane.has_table():
                self.missing.append(time.monotonic())

    def __enter__(self) -> "Presence":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.join()


# ---- the real control plane ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def plane():
    """A FaultPlane (RBAC) with the chart's ClusterRole, ClusterRoleBinding and ServiceAccount;
    ``plane.agent_kubeconfig`` authenticates with a token of that ServiceAccount."""
    docs = render("default")
    role, binding, account = agent_rbac(docs)
    with FaultPlane() as cp:
        cp.apply(role)
        cp.apply(binding)
        token = cp.service_account_token(NAMESPACE, account["metadata"]["name"])
        cp.agent_kubeconfig = cp.kubeconfig_for(token, "nftpolicy-agent")  # type: ignore[attr-defined]
        cp.binding = binding  # type: ignore[attr-defined]
        yield cp


@pytest.fixture
def real(plane, tmp_path, make_netns):
    """(plane, env, kernel): slot pods x/a, x/b, x/c and policy deny-b in the API; the agent not
    started yet (``--watch-timeout 30``, the agent's kubeconfig). Afterwards the API holds only
    namespaces again (x without labels) and the binding."""
    env = AgentEnv(tmp_path, SLOTS, ("--watch-timeout", "30"), api=RealApi(plane)).put_slot_pods()
    env.kubeconfig = plane.agent_kubeconfig
    try:
        env.api.put(policy("deny-b", "b"))
        yield plane, env, Kernel(env, make_netns())
    finally:
        env.close()
        clear_api(plane)
        plane.apply(namespace("x"))
        plane.apply(plane.binding)


def api_objects(cp: ControlPlane) -> dict[str, list[dict[str, Any]]]:
    """Every object of every kind the agent reads, as the API lists them now (as the admin).
    A restarted kube-apiserver is ready (/readyz) before the watch caches of CRDs are: their
    lists answer 429 for a moment, and are asked again."""
    objects = {}
    for kind in KINDS:
        for attempt in range(100):
            try:
                objects[kind] = cp.items(kind)
                break
            except ApiError as error:
                if error.status != 429 or attempt == 99:
                    raise
                time.sleep(0.05)
    return objects


def through_fault(cp: ControlPlane, env: AgentEnv, kernel: Kernel, fault: Callable[[], None], record_property) -> None:
    """Start the agent, check that its table is the render, then run ``fault`` (which returns
    when the API answers again) with the table watched; right after, :func:`change`. Records
    the seconds from the API's return to the new render in the kernel, and the time the API
    took to accept the change; the render must come within CATCH_UP of that acceptance, and the
    table must never have left the kernel."""
    env.start_agent()
    kernel.converged(kernel.render(api_objects(cp)), time.monotonic(), timeout=10)
    with Presence(env) as presence:
        fault()
        back = time.monotonic()
        change(env.api)
        accepted = time.monotonic() - back
        took = kernel.converged(kernel.render(api_objects(cp)), back)
    record_property("catch_up_seconds", round(took, 2))
    record_property("change_accepted_seconds", round(accepted, 2))
    print(f"catch-up {took:.2f} s (the API accepted the change after {accepted:.2f} s)")
    assert presence.checks > 10 and presence.missing == [], "the table left the kernel during the fault"
    check_packets(env)
    # The API decides when it holds the change: right after etcd returns, kube-apiserver takes
    # seconds to accept writes. The agent's part starts there.
    assert took - accepted <= CATCH_UP, f"caught up {took:.1f}s after the API's return, {took - accepted:.1f}s after it accepted the change"


@REAL_PLANE
def test_api_server_sigkill(real, record_property):
    """kube-apiserver killed outright, restarted on the same etcd: the restarted server refuses
    the agent's token (403) until its RBAC authorizer has loaded; the agent retries that as
    any other error."""
    cp, env, kernel = real

    def fault() -> None:
        cp.kill_apiserver()
        cp.start_apiserver()

    through_fault(cp, env, kernel, fault, record_property)


@REAL_PLANE
def test_api_server_sigterm(real, record_property):
    """kube-apiserver stopped gracefully (it ends every watch first), restarted on the same etcd."""
    cp, env, kernel = real

    def fault() -> None:
        cp.stop_apiserver()
        cp.start_apiserver()

    through_fault(cp, env, kernel, fault, record_property)


@REAL_PLANE
def test_etcd_stopped_and_started(real, record_property):
    """etcd stopped for 15 s under a running kube-apiserver, then started on its data: the API's
    return is kube-apiserver's /readyz ok again."""
    cp, env, kernel = real

    def fault() -> None:
        cp.stop_etcd()
        time.sleep(15)
        cp.start_etcd()
        cp.wait_ready()

    through_fault(cp, env, kernel, fault, record_property)


@REAL_PLANE
def test_compaction_past_every_resource_version(real, record_property):
    """While kube-apiserver is down, etcd's revision moves past every resourceVersion the agent
    holds and its history is compacted there: the restarted server answers each of the agent's
    watches 410 Gone, and the agent relists every kind."""
    cp, env, kernel = real

    def fault() -> None:
        cp.kill_apiserver()  # (a graceful stop takes 10 s here, and adds nothing to this case)
        cp.compact_past_everything()
        cp.start_apiserver()

    through_fault(cp, env, kernel, fault, record_property)
    for kind in ("Namespace", "Pod", "NetworkPolicy", "Node"):
        eventually(lambda: env.metric("nftpolicy_api_errors_total", kind=kind, reason="410") >= 1, True)


@REAL_PLANE
def test_role_binding_removed_then_restored(real, record_property):
    """The agent's ClusterRoleBinding is deleted: each watch, once it ends (``--watch-timeout 2``
    here), is refused with 403, which is retried with backoff, reported once per kind with the
    verb once they have lasted 10 s, and shown by nftpolicy_api_access_denied; then the binding
    is back."""
    cp, env, kernel = real
    env.extra_args = ("--watch-timeout", "2")
    kinds = ("Namespace", "Pod", "NetworkPolicy", "Node")

    def errors() -> list[str]:
        events = map(json.loads, filter(lambda line: line.startswith("{"), env.log().splitlines()))
        return [event["msg"] for event in events if event.get("level") == "error"]

    def fault() -> None:
        cp.delete("ClusterRoleBinding", cp.binding["metadata"]["name"])
        # refused for 10 s or more: each kind says so once, as an error
        eventually(lambda: {m.split()[1] for m in errors() if m.startswith("API ")} >= set(kinds), True, timeout=40)
        assert all(max(env.metric("nftpolicy_api_access_denied", kind=k, verb=v) for v in ("list", "watch")) == 1 for k in kinds)
        cp.apply(cp.binding)

    through_fault(cp, env, kernel, fault, record_property)
    eventually(lambda: all(env.metric("nftpolicy_api_access_denied", kind=k, verb=v) == 0 for k in kinds for v in ("list", "watch")), True)
    for kind, resource in (("Pod", "pods"), ("Namespace", "namespaces"), ("NetworkPolicy", "networkpolicies"), ("Node", "nodes")):
        said = [m for m in errors() if m.startswith(f"API {kind} requests refused")]
        assert len(said) == 1 and "403" in said[0], said
        assert f'cannot watch resource "{resource}"' in said[0] or f'cannot list resource "{resource}"' in said[0], said
        assert env.metric("nftpolicy_api_retries_total", kind=kind, reason="403") >= 3, kind


# ---- a silent connection (the fake API server) --------------------------------------------------

def established_ports(ns: str, server_port: int) -> list[int]:
    """The client ports of every TCP connection established to ``server_port`` in ``ns``."""
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Htn", "state", "established", f"( dport = :{server_port} )"],
                         capture_output=True, text=True, check=True).stdout
    return sorted({int(line.split()[2].rpartition(":")[2]) for line in out.splitlines() if line.strip()})


def test_a_watch_that_goes_silent(tmp_path, make_netns, record_property):
    """Every API connection open now goes silent, in both directions: its packets are dropped,
    the socket stays open (a load balancer or NAT that forgot the flows, an API server host
    that lost power), while new connections are served. TCP keepalive resets the silent ones;
    the agent watches again and catches up. The fake serves on the loopback of a namespace of
    the test, where the agent runs too and where the drop rule lives."""
    ns = make_netns()
    netns.ip_batch(["link set lo up"], ns)
    api = FakeApiServer(bookmark_interval=0.5)
    with netns.entered(ns):
        api.start()
    env = AgentEnv(tmp_path, SLOTS, api=api, agent_netns=ns).put_slot_pods()
    try:
        kernel = Kernel(env, make_netns())

        def objects() -> dict[str, list[dict[str, Any]]]:
            return {kind: [obj for (k, _, _), obj in api.objects.items() if k == kind] for kind in KINDS}

        api.put(policy("deny-b", "b"))
        env.start_agent()
        kernel.converged(kernel.render(objects()), time.monotonic(), timeout=10)
        with Presence(env) as presence:
            ports = established_ports(ns, api.port)
            assert len(ports) >= 4, ports  # a watch per kind at least
            elements = ", ".join(map(str, ports))
            nft(ns, "-f", "-", stdin=f"table inet silent {{ set dark {{ type inet_service; elements = {{ {elements} }}; }}\n"
                                     "chain out { type filter hook output priority 0; tcp sport @dark drop; tcp dport @dark drop; }\n}\n")
            silent = time.monotonic()
            change(api)
            took = kernel.converged(kernel.render(objects()), silent)
        record_property("catch_up_seconds", round(took, 2))
        print(f"catch-up {took:.2f} s")
        assert presence.checks > 10 and presence.missing == []
        assert all(port not in ports for port in established_ports(ns, api.port)), "the silent connections must be gone"
        check_packets(env)
        assert took <= CATCH_UP, f"caught up {took:.1f}s after the connections went silent"
    finally:
        env.close()
