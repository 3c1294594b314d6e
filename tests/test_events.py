"""Kubernetes Events on what the agent fails closed on (agent/daemon/events.py): the recorder's
rules with a writer in memory and a clock of the test's own; the agent against the in-repo fake
API (Event writes that fail); and against the real kube-apiserver, where ``kubectl describe``
shows the Event."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading

import pytest

from nftpolicy.agent.daemon import events
from nftpolicy.agent.daemon.events import (CRD_MISSING, INVALID, EventGone, EventRecorder, Subject,
                                           TokenBucket)
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.testbed.controlplane import free_port
from nftpolicy.translators.validation import InvalidField

from .agentenv import NFTPOLICY, AgentEnv, RealApi
from .conftest import clear_api, eventually, http_get
from .fakeapi import FakeApiServer
from .fakeclock import FakeClock

# ---- the recorder -------------------------------------------------------------------------------


class MemoryWriter:
    """Events in a dict; ``fail`` exceptions are raised by the coming writes, one each."""

    def __init__(self) -> None:
        self.events: dict[tuple[str, str], dict] = {}
        self.writes: list[str] = []
        self.fail: list[Exception] = []

    def create(self, namespace: str, body: dict) -> None:
        self.writes.append("create")
        if self.fail:
            raise self.fail.pop(0)
        self.events[(namespace, body["metadata"]["name"])] = body

    def patch(self, namespace: str, name: str, body: dict) -> None:
        self.writes.append("patch")
        if self.fail:
            raise self.fail.pop(0)
        if (namespace, name) not in self.events:
            raise EventGone(name)
        self.events[(namespace, name)].update(body)


def recorder(**kwargs) -> tuple[EventRecorder, MemoryWriter, Metrics]:
    writer, metrics = MemoryWriter(), Metrics()
    return EventRecorder(writer, "node1", metrics, **kwargs), writer, metrics


def drain(rec: EventRecorder) -> None:
    """Write every queued Event (the writer thread's work, in the test's thread)."""
    while not rec.queue.empty():
        rec.write(rec.queue.get_nowait())


def count(metrics: Metrics, result: str) -> float:
    return metrics.registry.get_sample_value("nftpolicy_events_total", {"result": result}) or 0.0


def policy(generation: int = 1, name: str = "bad", ns: str = "x") -> dict:
    return {"metadata": {"namespace": ns, "name": name, "uid": f"uid-{name}", "generation": generation, "resourceVersion": "7"},
            "spec": {}}


def test_one_event_per_object_reason_and_generation_then_the_count_goes_up():
    rec, writer, metrics = recorder()
    exc = InvalidField("spec.ingress[0].ports[0].port", "must be 1-65535")
    for _ in range(3):  # a relist sees the same generation again
        rec.failed_closed("NetworkPolicy", policy(1), exc, True)
    drain(rec)
    assert writer.writes == ["create"]
    [(namespace, name)] = writer.events
    event = writer.events[(namespace, name)]
    assert namespace == "x" and name.startswith("bad.")
    assert event["involvedObject"] == {"kind": "NetworkPolicy", "apiVersion": "networking.k8s.io/v1", "namespace": "x",
                                       "name": "bad", "uid": "uid-bad"}
    assert (event["type"], event["reason"], event["count"]) == ("Warning", INVALID, 1)
    assert event["source"] == {"component": "nftpolicy", "host": "node1"}
    assert event["message"].startswith("spec.ingress[0].ports[0].port: must be 1-65535; enforced fail-closed")
    rec.failed_closed("NetworkPolicy", policy(2), exc, True)  # edited, still invalid the same way
    drain(rec)
    assert writer.writes == ["create", "patch"] and event["count"] == 2
    assert (count(metrics, "created"), count(metrics, "patched")) == (1, 1)
    rec.failed_closed("NetworkPolicy", policy(3), InvalidField("spec.podSelector", "other"), True)  # another problem
    drain(rec)
    assert writer.writes == ["create", "patch", "create"] and len(writer.events) == 2


def test_what_the_recorder_remembers_is_bounded_and_a_forgotten_object_gets_a_new_event(monkeypatch):
    """A long-running agent sees many objects fail over time: it keeps the newest REMEMBERED
    keys of each map; a forgotten object seen failing again is a new Event, not a lost one."""
    monkeypatch.setattr(events, "REMEMBERED", 3)
    rec, writer, _ = recorder()
    exc = InvalidField("spec", "x")
    for name in ("p0", "p1", "p2", "p3", "p4"):
        rec.failed_closed("NetworkPolicy", policy(name=name), exc, True)
    drain(rec)
    assert len(rec._queued) == 3 and len(rec._written) == 3
    assert [key[2] for key in rec._written] == ["p2", "p3", "p4"]
    rec.failed_closed("NetworkPolicy", policy(name="p2"), exc, True)  # remembered: same generation, nothing
    rec.failed_closed("NetworkPolicy", policy(2, name="p2"), exc, True)  # a new generation: counted, p2 is newest
    rec.failed_closed("NetworkPolicy", policy(name="p0"), exc, True)  # forgotten: a new Event
    drain(rec)
    assert writer.writes == ["create"] * 5 + ["patch", "create"]
    assert [key[2] for key in rec._written] == ["p4", "p2", "p0"]


def test_the_event_of_a_long_named_object_has_a_valid_name():
    """Event names are DNS subdomains (at most 253 characters): the object's name is cut, not
    the stamp that makes it unique."""
    rec, writer, _ = recorder()
    long = "a" * 200 + "-" + "b" * 52  # 253 characters, a valid policy name
    rec.failed_closed("NetworkPolicy", policy(name=long), InvalidField("spec", "x"), True)
    drain(rec)
    [(_, name)] = writer.events
    assert len(name) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", name)
    assert name.startswith("a" * 200)


def test_an_expired_event_is_created_again():
    rec, writer, _ = recorder()
    exc = InvalidField("spec", "x")
    rec.failed_closed("NetworkPolicy", policy(1), exc, True)
    drain(rec)
    writer.events.clear()  # the API server's event TTL
    rec.failed_closed("NetworkPolicy", policy(2), exc, True)
    drain(rec)
    assert writer.writes == ["create", "patch", "create"]
    assert [e["count"] for e in writer.events.values()] == [1]


def test_reasons_and_cluster_scoped_objects():
    rec, writer, _ = recorder()
    cnp = {"apiVersion": "policy.networking.k8s.io/v1alpha2", "metadata": {"name": "dns", "uid": "u1", "generation": 1}}
    rec.failed_closed("ClusterNetworkPolicy", cnp, InvalidField("spec.egress[0].action", "a domainNames peer is only supported in Accept rules, got Deny"), True)
    rec.crd_missing("clusternetworkpolicies.policy.networking.k8s.io")
    drain(rec)
    events = sorted(writer.events.items(), key=lambda item: item[1]["reason"])
    assert [(ns, e["reason"], e["type"], e["involvedObject"]["kind"], e["involvedObject"]["uid"]) for (ns, _), e in events] == [
        ("default", CRD_MISSING, "Normal", "Node", "node1"), ("default", INVALID, "Warning", "ClusterNetworkPolicy", "u1")]
    assert "namespace" not in events[1][1]["involvedObject"]
    assert events[1][1]["involvedObject"]["apiVersion"] == "policy.networking.k8s.io/v1alpha2"  # the version it was read at


def test_an_event_names_the_version_the_object_was_read_at():
    """A ClusterNetworkPolicy carries the apiVersion the agent watches (v1beta1 or v1alpha2); a
    NetworkPolicy list item carries none: networking.k8s.io/v1."""
    rec, writer, _ = recorder()
    rec.failed_closed("ClusterNetworkPolicy", {"apiVersion": "policy.networking.k8s.io/v1beta1", "metadata": {"name": "a", "uid": "u2"}},
                      InvalidField("spec.priority", "bad"), True)
    rec.failed_closed("NetworkPolicy", {"metadata": {"namespace": "x", "name": "b", "uid": "u3"}}, InvalidField("spec", "bad"), True)
    drain(rec)
    assert sorted(e["involvedObject"]["apiVersion"] for e in writer.events.values()) == [
        "networking.k8s.io/v1", "policy.networking.k8s.io/v1beta1"]


def test_the_token_bucket_refills_with_its_clock():
    clock = FakeClock(start=0.0)
    bucket = TokenBucket(2, 10.0, clock)
    assert [bucket.take() for _ in range(3)] == [True, True, False]
    clock.advance(9.9)
    assert not bucket.take()
    clock.advance(0.1)  # 10 s since the start
    assert bucket.take() and not bucket.take()
    clock.advance(990.0)  # never more than the capacity
    assert [bucket.take() for _ in range(3)] == [True, True, False]


def test_writes_over_the_rate_are_dropped_and_counted_and_the_next_sighting_tries_again():
    clock = FakeClock(start=0.0)
    rec, writer, metrics = recorder(clock=clock, burst=2, refill_seconds=10.0)
    for i in range(4):
        rec.failed_closed("NetworkPolicy", policy(1, name=f"p{i}"), InvalidField("spec", "x"), True)
    drain(rec)
    assert (len(writer.events), count(metrics, "rate_limited")) == (2, 2)
    clock.advance(10.0)
    rec.failed_closed("NetworkPolicy", policy(1, name="p2"), InvalidField("spec", "x"), True)  # seen again: tried again
    drain(rec)
    assert len(writer.events) == 3


def test_record_never_blocks_a_full_queue_drops():
    rec, writer, metrics = recorder(queue_size=2)  # no writer thread: the queue fills
    done = threading.Event()

    def flood() -> None:
        for i in range(10):
            rec.failed_closed("NetworkPolicy", policy(1, name=f"p{i}"), InvalidField("spec", "x"), True)
        done.set()

    threading.Thread(target=flood, daemon=True).start()
    assert done.wait(2), "record blocked"
    assert count(metrics, "queue_full") == 8
    drain(rec)
    assert len(writer.events) == 2


def test_a_failed_write_is_counted_and_tried_at_the_next_sighting(caplog):
    rec, writer, metrics = recorder()
    writer.fail = [ConnectionError("connection refused")]
    rec.failed_closed("NetworkPolicy", policy(1), InvalidField("spec", "x"), True)
    drain(rec)
    assert count(metrics, "failed") == 1 and not writer.events
    assert "cannot write Event InvalidPolicy on NetworkPolicy x/bad: connection refused" in caplog.text
    rec.failed_closed("NetworkPolicy", policy(1), InvalidField("spec", "x"), True)
    drain(rec)
    assert len(writer.events) == 1


def test_subject_generation_falls_back_to_the_resource_version():
    assert Subject.of({"metadata": {"name": "a", "resourceVersion": "12"}}).generation == "12"
    assert Subject.of({"metadata": {"name": "a", "resourceVersion": "12", "generation": 3}}).generation == "3"


# ---- the agent ----------------------------------------------------------------------------------

B, C = "10.244.0.11", "10.244.0.12"
SLOTS = {"x/b": B, "x/c": C}
# Valid to the fake (which validates nothing), invalid to nftpolicy: it fails closed on x/b.
INVALID_POLICY = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                  "metadata": {"namespace": "x", "name": "bad-port", "uid": "0d5c1e1e-1", "generation": 1},
                  "spec": {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"],
                           "ingress": [{"ports": [{"port": 70000}]}]}}


def fake_events(api: FakeApiServer, reason: str) -> list[dict]:
    with api.lock:
        return [e for e in api.events.values() if e["reason"] == reason]


@pytest.mark.kernel
def test_the_agent_records_an_event_on_an_invalid_policy_and_the_crd_missing(tmp_path):
    env = AgentEnv(tmp_path, SLOTS).put_slot_pods()  # the fake has no ClusterNetworkPolicy CRD
    try:
        env.api.put(INVALID_POLICY)
        env.start_agent()
        assert not env.connects("x/c", B), "the invalid policy fails closed"
        eventually(lambda: len(fake_events(env.api, INVALID)), 1)
        [event] = fake_events(env.api, INVALID)
        assert event["involvedObject"]["name"] == "bad-port" and event["involvedObject"]["uid"] == "0d5c1e1e-1"
        assert "spec.ingress[0].ports[0].port" in event["message"]
        eventually(lambda: len(fake_events(env.api, CRD_MISSING)), 1)
        env.api.put({**INVALID_POLICY, "metadata": {**INVALID_POLICY["metadata"], "generation": 2}})
        eventually(lambda: fake_events(env.api, INVALID)[0]["count"], 2)
        assert len(fake_events(env.api, INVALID)) == 1
    finally:
        env.close()


@pytest.mark.kernel
def test_failing_event_writes_never_stop_enforcement(tmp_path):
    env = AgentEnv(tmp_path, SLOTS).put_slot_pods()
    try:
        env.api.fail_events(500, count=1000)
        env.api.put(INVALID_POLICY)
        env.start_agent()
        assert not env.connects("x/c", B)
        eventually(lambda: env.metric("nftpolicy_events_total", result="failed") >= 2, True)  # the policy and the CRD
        env.api.delete("NetworkPolicy", "bad-port", "x")
        eventually(lambda: env.connects("x/c", B), True)
        said = [e["msg"] for e in map(json.loads, filter(lambda line: line.startswith("{"), env.log().splitlines()))
                if e["msg"].startswith("cannot write Event")]
        assert any("InvalidPolicy on NetworkPolicy x/bad-port: 500" in m for m in said), said
        assert env.http("/healthz")[0] == 200
    finally:
        env.close()


# ---- the real API server ------------------------------------------------------------------------

# The CRD accepts a domainNames peer in a Deny rule; its documentation supports it in Accept rules
# only, so nftpolicy refuses it: that rule fails closed (Deny all).
DNS_POLICY = {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": "deny-names"},
              "spec": {"tier": "Admin", "priority": 5, "subject": {"namespaces": {}},
                       "egress": [{"name": "example", "action": "Deny", "to": [{"domainNames": ["example.com"]}]}]}}


@pytest.mark.kernel
@pytest.mark.tools("etcd", "kube-apiserver")
def test_kubectl_describe_shows_the_event(control_plane, tmp_path):
    env = AgentEnv(tmp_path, SLOTS, api=RealApi(control_plane)).put_slot_pods()
    try:
        stored = control_plane.apply(DNS_POLICY)
        env.start_agent()

        def events() -> list[dict]:
            return [e for e in control_plane.request("GET", "/api/v1/events")["items"] if e["involvedObject"].get("uid") == stored["metadata"]["uid"]]

        eventually(lambda: len(events()), 1)
        [event] = events()
        assert (event["reason"], event["type"], event["source"]) == (INVALID, "Warning", {"component": "nftpolicy", "host": "node1"})
        assert event["metadata"]["namespace"] == "default" and event["count"] == 1
        assert event["message"].startswith("spec.egress[0].action: a domainNames peer is only supported in Accept rules, got Deny")
        kubectl = shutil.which("kubectl")
        if kubectl:
            described = subprocess.run([kubectl, "--kubeconfig", control_plane.kubeconfig, "describe", "clusternetworkpolicy",
                                        "deny-names"], capture_output=True, text=True, timeout=30, check=True).stdout
            assert INVALID in described and "only supported in Accept rules" in described, described
        assert env.metric("nftpolicy_events_total", result="failed") == 0
    finally:
        env.close()
        clear_api(control_plane)


# ---- one writer per object ------------------------------------------------------------------------

NODES = frozenset(f"node-{i}" for i in range(5))


def subject(i: int) -> Subject:
    return Subject("NetworkPolicy", "networking.k8s.io/v1", "x", f"p{i}", f"uid-{i}", "1")


def test_every_agent_picks_the_same_writer_and_a_node_leaving_moves_only_its_objects():
    """Rendezvous hashing (events.event_writer): the choice depends on the set of Ready Nodes
    alone (not its order), spreads the objects over the nodes, and a node that leaves hands on
    only the objects it wrote."""
    chosen = {i: events.event_writer(subject(i), NODES) for i in range(1000)}
    assert chosen == {i: events.event_writer(subject(i), frozenset(sorted(NODES, reverse=True))) for i in range(1000)}
    spread = sorted(list(chosen.values()).count(node) for node in NODES)
    assert spread[0] > 120 and spread[-1] < 280, spread  # 200 each, give or take
    fewer = {i: events.event_writer(subject(i), NODES - {"node-3"}) for i in range(1000)}
    assert {i for i in chosen if chosen[i] != fewer[i]} == {i for i in chosen if chosen[i] == "node-3"}
    assert events.event_writer(subject(1), frozenset()) is None


@pytest.mark.parametrize("ready", [NODES, frozenset()])
def test_an_invalid_object_s_event_is_written_by_one_agent_of_the_ready_nodes(ready):
    """Five agents see the same invalid policy: one of them writes its Event when Nodes are
    Ready (the others count other_writer); with no Ready Node known, each writes its own."""
    written = {}
    for node in sorted(NODES):
        writer, metrics = MemoryWriter(), Metrics()
        rec = EventRecorder(writer, node, metrics, ready_nodes=lambda: ready)
        rec.failed_closed("NetworkPolicy", policy(), InvalidField("spec.ingress", "bad"), True)
        rec.record(Subject.node(node), CRD_MISSING, "no CRD", event_type="Normal")  # a node's own: always written
        drain(rec)
        written[node] = (sorted(e["reason"] for e in writer.events.values()), count(metrics, "other_writer"))
    if ready:
        [first] = [node for node, (reasons, _) in written.items() if INVALID in reasons]
        assert first == events.event_writer(Subject.of({**policy(), "kind": "NetworkPolicy"}), ready)
        assert {node: w for node, w in written.items() if node != first} == {
            node: ([CRD_MISSING], 1.0) for node in NODES - {first}}
    else:
        assert written == {node: ([CRD_MISSING, INVALID], 0.0) for node in NODES}


def test_a_kernel_refusal_is_each_node_s_own_event():
    writer, metrics = MemoryWriter(), Metrics()
    rec = EventRecorder(writer, "node-0", metrics, ready_nodes=lambda: NODES)
    for i in range(20):  # whoever ranks first for them, a refusal of this node's kernel is said here
        rec.kernel_refused("NetworkPolicy", policy(name=f"p{i}"), "Invalid argument")
    drain(rec)
    assert len(writer.events) == 20 and count(metrics, "other_writer") == 0


def test_the_store_knows_the_ready_nodes_from_lists_and_watches():
    from nftpolicy.agent.daemon.store import Store

    def node(name: str, status: str | None) -> dict:
        conditions = [{"type": "MemoryPressure", "status": "False"}] + ([{"type": "Ready", "status": status}] if status else [])
        return {"metadata": {"name": name}, "spec": {}, "status": {"conditions": conditions}}

    store = Store(Metrics())
    store.replace("Node", [node("a", "True"), node("b", "False"), node("c", None), node("d", "True")])
    assert store.ready_nodes() == {"a", "d"}
    store.take()
    store.apply("Node", "MODIFIED", node("b", "True"))
    assert not store.changed.is_set(), "a Node's readiness is no rule's: no sync"
    store.apply("Node", "MODIFIED", node("a", "Unknown"))  # the node controller's verdict on a silent kubelet
    store.apply("Node", "DELETED", node("d", "True"))
    assert store.ready_nodes() == {"b"}


def dns_policy(i: int, name: str = "example.com") -> dict:
    """A ClusterNetworkPolicy the CRD accepts and nftpolicy refuses (DNS_POLICY's Deny of a name)."""
    return {**DNS_POLICY, "metadata": {"name": f"deny-names-{i}"},
            "spec": {**DNS_POLICY["spec"], "priority": 10 + i, "egress": [{**DNS_POLICY["spec"]["egress"][0], "to": [{"domainNames": [name]}]}]}}


@pytest.mark.kernel
@pytest.mark.tools("etcd", "kube-apiserver")
def test_three_agents_write_one_event_per_invalid_object(control_plane, make_netns, tmp_path):
    """Three agents against the real kube-apiserver, on nodes a and b (Ready) and c (its Ready
    condition Unknown: the node controller's verdict on a silent kubelet), see eight invalid
    ClusterNetworkPolicies: each gets one Event, from the agent that event_writer names among
    the Ready Nodes; c's agent writes none (issue 34: 5,000 Events of one invalid policy at
    5,000 nodes)."""
    ready = {"node-a": "True", "node-b": "True", "node-c": "Unknown"}
    for name, status in ready.items():
        control_plane.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                             "status": {"conditions": [{"type": "Ready", "status": status}]}})
    stored = [control_plane.apply(dns_policy(i)) for i in range(8)]
    agents, logs, ports = [], [], {name: free_port() for name in ready}
    try:
        for name in ready:
            logs.append(tmp_path / f"{name}.log")
            agents.append(subprocess.Popen(
                [NFTPOLICY, "agent", "--kubeconfig", control_plane.kubeconfig, "--node", name, "--netns", make_netns(),
                 "--http-address", f"127.0.0.1:{ports[name]}", "--debug-address", "", "--min-sync-interval", "0.05"],
                stdout=subprocess.DEVNULL, stderr=logs[-1].open("w")))

        def left_to_others(node: str) -> float:
            status, text = http_get(f"http://127.0.0.1:{ports[node]}/metrics")
            found = re.search(r'^nftpolicy_events_total\{result="other_writer"\} (\S+)$', text, re.M) if status == 200 else None
            return float(found.group(1)) if found else -1.0

        def invalid_events() -> dict[str, list[str]]:
            found: dict[str, list[str]] = {}
            for e in control_plane.request("GET", "/api/v1/namespaces/default/events")["items"]:
                if e["reason"] == INVALID and e["involvedObject"]["uid"] in uids:  # not an earlier test's
                    found.setdefault(e["involvedObject"]["name"], []).append(f"{e['source']['host']} {e['count']}")
            return found

        uids = {p["metadata"]["uid"] for p in stored}
        writers = frozenset(name for name, status in ready.items() if status == "True")
        expected = {p["metadata"]["name"]: [f"{events.event_writer(Subject.of({**p, 'kind': 'ClusterNetworkPolicy'}), writers)} 1"]
                    for p in stored}
        assert {hosts[0].split()[0] for hosts in expected.values()} == writers, "eight objects spread over both"
        eventually(invalid_events, expected, timeout=30)
        for name in ready:  # each agent saw all eight and left to the others those it does not write
            mine = sum(1 for hosts in expected.values() if hosts[0].startswith(f"{name} "))
            eventually(lambda: left_to_others(name), 8.0 - mine, timeout=30)
        assert invalid_events() == expected
        assert all(agent.poll() is None for agent in agents), [log.read_text()[-2000:] for log in logs]
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.wait(timeout=15)
        clear_api(control_plane)
        for name in ready:
            control_plane.delete("Node", name)


def test_an_invalid_object_s_event_waits_for_the_nodes_to_be_listed():
    """Before the Nodes are listed nobody knows the writer: the Event waits (else every agent of
    a rollout would write its own), then goes to the one event_writer names."""
    nodes: list[frozenset[str] | None] = [None]
    writer, metrics = MemoryWriter(), Metrics()
    rec = EventRecorder(writer, "node-0", metrics, ready_nodes=lambda: nodes[0])
    rec.failed_closed("NetworkPolicy", policy(), InvalidField("spec.ingress", "bad"), True)
    pending = rec.queue.get_nowait()
    assert rec.write(pending) is False and writer.writes == []
    nodes[0] = frozenset({"node-0"})
    assert rec.write(pending) is True and writer.writes == ["create"]


def test_an_over_limit_object_s_event_has_one_writer_too():
    """PolicyOverLimit is seen alike by every agent too (a hostile review: it was written by each)."""
    written = {}
    for node in sorted(NODES):
        writer, metrics = MemoryWriter(), Metrics()
        rec = EventRecorder(writer, node, metrics, ready_nodes=lambda: NODES)
        rec.record(Subject.of({**policy(), "kind": "NetworkPolicy", "apiVersion": "networking.k8s.io/v1"}), events.OVER_LIMIT,
                   "over --max-object-rules")
        drain(rec)
        written[node] = len(writer.events)
    assert sorted(written.values()) == [0, 0, 0, 0, 1]
