"""Per-object caps (issue 30 item 2): what one policy may cost is counted from the object alone
(nftpolicy.translators.objectcost), and an object beyond a cap is enforced fail-closed for its
subjects by the agent's store, with an Event naming the cap and a metric by cap.

The counts are checked against what the chain builders really emit (a full render), so the
upper bound stays an upper bound; no kernel: the store and the recorder are the agent's own."""

from __future__ import annotations

from typing import Any

import pytest

from nftpolicy.agent.daemon.events import OVER_LIMIT, EventRecorder
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.store import Store
from nftpolicy.translators import layout
from nftpolicy.translators.clusterpolicy import cluster_policy_from
from nftpolicy.translators.manifests import build_cluster, policy_from
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.objectcost import ObjectLimits, OverLimit, over_limit, policy_cost

from .test_events import MemoryWriter, drain


def netpol(spec: dict[str, Any], name: str = "p") -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "x", "name": name, "uid": "u1",
                                                                                        "generation": 1}, "spec": spec}


def peers_by_ports(peers: int, ports: int, direction: str = "ingress", named: bool = False) -> dict[str, Any]:
    key = "from" if direction == "ingress" else "to"
    port = [{"port": f"p{i}"} if named else {"port": 1000 + i} for i in range(ports)]
    return netpol({"podSelector": {}, "policyTypes": [direction.title()],
                   direction: [{key: [{"podSelector": {"matchLabels": {"app": f"a{i}"}}} for i in range(peers)], "ports": port}]})


DUAL_STACK_POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": "x", "name": "a", "labels": {"app": "a0"}},
                  "spec": {"nodeName": "n1", "containers": [{"name": "c", "ports": [{"name": "p0", "containerPort": 80}]}]},
                  "status": {"phase": "Running", "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}]}}


@pytest.mark.parametrize("obj", [
    peers_by_ports(30, 40), peers_by_ports(1, 40), peers_by_ports(30, 1), peers_by_ports(5, 4, named=True),
    peers_by_ports(5, 4, "egress", named=True), peers_by_ports(5, 4, "egress"),
    netpol({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16", "10.2.3.0/24"]}},
                                                     {"podSelector": {}}], "ports": [{"port": 1}, {"port": 2}]}]}),
])
def test_the_count_bounds_what_the_chain_builders_emit(obj):
    cluster, errors = build_cluster([("t", obj), ("t", DUAL_STACK_POD)])
    assert not errors
    model = build_rule_model(cluster, None)
    table = layout.table(model)
    emitted = sum(len(c.rules) for c in table.chains if c.name.startswith("KUBE-NWPLCY-") and c.name not in (
        layout.COMMON_CHAIN, layout.DEFAULT_CHAIN))
    networks = sum(len(s.elements) for s in model.sets if s.kind == "interval")
    cost = policy_cost(policy_from(obj))
    assert emitted <= cost.rules and networks <= cost.elements  # an upper bound (of the iptables variant too: a rule per port)


def test_peers_and_ports_count_as_a_sum_and_egress_named_ports_as_the_product_they_are():
    # the 1000 pod peers are one union set per family: 2 peer rules, the ports' 1000 (the iptables variant's), the "decided" return
    assert policy_cost(policy_from(peers_by_ports(1000, 1000))).rules == 2 + 1000 + 1
    assert policy_cost(policy_from(peers_by_ports(100, 100, "egress", named=True))).rules == 100 * 2 * 100
    block = netpol({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "::/0", "except": [f"fd00::{i:x}/128" for i in range(50)]}}]}]})
    assert policy_cost(policy_from(block)).elements == 1 + 50 * 128


def test_over_limit_names_the_first_cap_exceeded():
    limits = ObjectLimits(rules=10, elements=5)
    beyond = over_limit(policy_cost(policy_from(peers_by_ports(6, 12))), limits)
    assert isinstance(beyond, OverLimit) and (beyond.limit, beyond.value) == ("rules", 2 + 12 + 1)
    assert "exceed the cap of 10 per object (--max-object-rules)" in str(beyond)
    assert over_limit(policy_cost(policy_from(peers_by_ports(2, 2))), limits) is None


def test_the_store_enforces_an_object_beyond_a_cap_fail_closed_with_an_event_and_a_metric():
    metrics = Metrics()
    store = Store(metrics, ObjectLimits(rules=100, elements=1000))
    writer = MemoryWriter()
    recorder = EventRecorder(writer, "node1", metrics)
    store.failed_closed = recorder.failed_closed
    store.replace("NetworkPolicy", [peers_by_ports(60, 120), netpol({"podSelector": {}, "ingress": [{}]}, name="fine")])
    closed, fine = store.get("NetworkPolicy", "x/p"), store.get("NetworkPolicy", "x/fine")
    assert closed.policy_types == frozenset({"ingress"}) and closed.ingress == () and fine.ingress != ()
    sample = metrics.registry.get_sample_value
    assert sample("nftpolicy_over_limit_objects", {"kind": "NetworkPolicy", "limit": "rules"}) == 1
    assert sample("nftpolicy_over_limit_objects", {"kind": "NetworkPolicy", "limit": "elements"}) == 0
    assert sample("nftpolicy_invalid_objects", {"kind": "NetworkPolicy"}) == 1
    drain(recorder)
    (event,) = writer.events.values()
    assert event["reason"] == OVER_LIMIT and "123 rules exceed the cap of 100 per object (--max-object-rules)" in event["message"]
    store.apply("NetworkPolicy", "MODIFIED", peers_by_ports(5, 5))  # back within the caps: enforced as written
    assert store.get("NetworkPolicy", "x/p").ingress != ()
    assert sample("nftpolicy_over_limit_objects", {"kind": "NetworkPolicy", "limit": "rules"}) == 0


def test_a_cluster_policy_beyond_a_cap_keeps_its_subject_and_denies_with_its_deny_rules():
    obj = {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": "big"},
           "spec": {"tier": "Admin", "priority": 1, "subject": {"namespaces": {}}, "ingress": [
               {"action": action, "from": [{"namespaces": {"matchLabels": {"p": str(i)}}} for i in range(25)],
                "protocols": [{"tcp": {"destinationPort": {"number": 1000 + i}}} for i in range(25)]} for action in ("Accept", "Deny")]}}
    assert policy_cost(cluster_policy_from(obj)).rules == 2 * (2 + 25 + 1)  # the 25 peers: one union set per family
    store = Store(Metrics(), ObjectLimits(rules=50))
    store.replace("ClusterNetworkPolicy", [obj])
    closed = store.get("ClusterNetworkPolicy", "big")
    assert closed.tier == "Admin" and [r.action for r in closed.ingress] == ["Deny"]
