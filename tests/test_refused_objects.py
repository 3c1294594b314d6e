"""One object the kernel refuses never blocks the others (agent/daemon/quarantine.py): the
reconcile loop singles out the policies of a refused full replace by dry runs, enforces them
fail-closed (an Event each), commits the rest, and keeps them so until they change; the failure
text that reaches logs, Events and health is bounded. On the in-memory dataplane (which refuses
a policy's rules on request) and in the real kernel, where a printer with the text rule of
before (the issue's NUL byte) makes libnftables refuse a batch for real."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
import yaml

from nftpolicy.agent.dataplane import REASON_MAX_BYTES, bounded_reason
from nftpolicy.agent.dataplane.fake import FakeNftDataplane, FakeTable
from nftpolicy.agent.dataplane.nftables import NftDataplane, refusal
from nftpolicy.agent.daemon.events import REFUSED, EventRecorder
from nftpolicy.agent.daemon.health import Health
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.quarantine import MAX_CHECKS, find_refused
from nftpolicy.agent.daemon.reconcile import Reconciler
from nftpolicy.agent.daemon.store import KINDS, Store
from nftpolicy.translators import chainbuilders, layout, nft, refusals, transaction
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import Config

from .agentenv import AgentEnv, RealApi
from .conftest import REPO, clear_api, nft as nft_cli
from .test_events import MemoryWriter, drain

NODE = "node1"
CNP = "policy.networking.k8s.io/v1alpha2"


def _shop() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((REPO / "examples/shop/cluster.yaml").read_text()) if d]


def _extra_policies(count: int) -> list[dict[str, Any]]:
    """``count`` NetworkPolicies selecting the api pod (on node1), each allowing its own port."""
    return [{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "shop", "name": f"extra-{i}", "uid": f"u{i}"},
             "spec": {"podSelector": {"matchLabels": {"app": "api"}},
                      "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "frontend"}}}], "ports": [{"port": 1000 + i}]}]}}
            for i in range(count)]


def _cnp(name: str, rule_name: str = "deny-debug") -> dict[str, Any]:
    return {"apiVersion": CNP, "kind": "ClusterNetworkPolicy", "metadata": {"name": name, "uid": f"uid-{name}", "generation": 1},
            "spec": {"tier": "Admin", "priority": 5, "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "shop"}}},
                     "ingress": [{"name": "allow-ops", "action": "Accept", "from": [{"namespaces": {"matchLabels": {"team": "ops"}}}]},
                                 {"name": rule_name, "action": "Deny", "from": [{"pods": {"namespaceSelector": {},
                                                                                           "podSelector": {"matchLabels": {"app": "debug"}}}}]}]}}


def _of(policy: str, rule: str | None = None):
    """The rules of ``policy`` (only those of its rule named ``rule``, if given)."""
    return lambda r: r.origin is not None and r.origin.policy == policy and rule in (None, r.origin.name)


def _store(objects: list[dict[str, Any]]) -> tuple[Store, list[tuple[str, dict, str]]]:
    """The store of ``objects``, and the list its kernel_refused callback appends to."""
    store, told = Store(Metrics()), []
    store.kernel_refused = lambda kind, obj, reason: told.append((kind, obj, reason))
    for kind in KINDS:
        store.replace(kind, [o for o in objects if o.get("kind") == kind])
    return store, told


def _reconciler(store: Store, dataplane) -> Reconciler:
    return Reconciler(store, Config(), NODE, Metrics(), Health(window=30.0), 0.0, 3600.0, dataplane)


def _expected(objects: list[dict[str, Any]], refused: set[tuple[str, str]]) -> Any:
    """The fake table of ``objects`` where each refused policy is its stand-in."""
    cluster, errors = build_cluster(("test", o) for o in objects)
    assert not errors
    cluster.policies.update({k: refusals.stand_in(p, "refused") for k, p in cluster.policies.items() if ("NetworkPolicy", k) in refused})
    cluster.cluster_policies.update({k: refusals.stand_in(p, "refused") for k, p in cluster.cluster_policies.items()
                                     if ("ClusterNetworkPolicy", k) in refused})
    return FakeTable().apply(transaction.full(build_rule_model(cluster, NODE))).state()


def _synced_refusing(objects: list[dict[str, Any]], *where) -> tuple[list, FakeNftDataplane, Reconciler]:
    """A fresh node's first full sync of ``objects`` on a fake that refuses the rules ``where``
    picks: what the store told, the fake, the reconciler."""
    store, told = _store(objects)
    dataplane = FakeNftDataplane()
    for picked in where:
        dataplane.refuse_rules(picked)
    reconciler = _reconciler(store, dataplane)
    assert reconciler.sync(full=True)  # the table is committed
    return told, dataplane, reconciler


def _refused_gauge(reconciler: Reconciler, kind: str) -> float:
    return reconciler.metrics.registry.get_sample_value("nftpolicy_refused_objects", {"kind": kind})


# ---- the search ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n, bad", [(1, {0}), (2, {1}), (7, {3}), (64, {0}), (64, {63}), (300, {17, 200}), (256, {1, 2, 3, 255}),
                                    (10, set(range(10)))])
def test_find_refused_names_exactly_the_bad_ones_within_its_bound(n, bad):
    suspects = [("NetworkPolicy", f"ns/p{i}") for i in range(n)]
    calls = []

    def refused(group):
        calls.append(len(group))
        hit = sorted(int(k[4:]) for _, k in group if int(k[4:]) in bad)
        return f"refused p{hit[0]}" if hit else None

    found = find_refused(suspects, refused(suspects), refused)
    assert found == {("NetworkPolicy", f"ns/p{i}"): f"refused p{i}" for i in bad}
    assert len(calls) - 1 <= min(MAX_CHECKS, 2 * len(bad) * math.ceil(math.log2(n)))


def test_find_refused_past_its_budget_holds_each_unresolved_group_whole():
    suspects = [("NetworkPolicy", f"ns/p{i}") for i in range(64)]
    found = find_refused(suspects, "all", lambda group: "refused", budget=3)  # every group is refused
    assert set(found) == set(suspects)


def test_what_a_table_holds_of_a_policy_includes_its_union_sets():
    """A rule of several pod peers and ipBlocks and several ports: its union sets (pods, and
    the ipBlocks' networks) go with its chains into the dry run of that policy alone."""
    union = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "shop", "name": "union", "uid": "uu"},
             "spec": {"podSelector": {"matchLabels": {"app": "api"}}, "ingress": [{"from": [
                 {"podSelector": {"matchLabels": {"app": "frontend"}}}, {"podSelector": {"matchLabels": {"app": "db"}}},
                 {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}, {"ipBlock": {"cidr": "10.1.2.0/24"}}],
                 "ports": [{"port": 80}, {"port": 443}]}]}}
    cluster, errors = build_cluster(("test", o) for o in _shop() + [union])
    assert not errors
    model = build_rule_model(cluster, NODE)
    unions = {u.name for u in model.unions}
    assert len(unions) == 2
    part = refusals.only(layout.table(model), [("NetworkPolicy", "shop/union")])
    assert unions <= {s.name for s in part.sets}
    looked_up = {s.name for c in part.chains for r in c.rules for s in r.statements if isinstance(s, layout.AddressInSet)}
    assert looked_up == {s.name for s in part.sets} and unions <= looked_up


# ---- the reconcile loop, in memory --------------------------------------------------------------

def test_a_refused_policy_fails_closed_the_rest_is_committed_and_it_costs_log2_checks():
    objects = _shop() + _extra_policies(40)
    told, dataplane, reconciler = _synced_refusing(objects, _of("shop/extra-17"))
    assert dataplane.state.state() == _expected(objects, {("NetworkPolicy", "shop/extra-17")})
    suspects = 2 + 40  # api-ingress and frontend-egress of the shop select pods of node1, and the 40
    assert 2 <= len(dataplane.checked) <= 1 + 2 * math.ceil(math.log2(suspects))
    assert all(len(tx.operations[0].table.chains) < 40 for tx in dataplane.checked[1:])  # parts of the table, not all of it
    [(kind, obj, reason)] = told
    assert (kind, obj["metadata"]["name"], obj["metadata"]["uid"]) == ("NetworkPolicy", "extra-17", "u17")
    assert reason == "Could not process rule: Invalid argument (shop/extra-17 ingress rule 0)"
    assert _refused_gauge(reconciler, "NetworkPolicy") == 1
    assert reconciler.metrics.sync_failures.labels("full")._value.get() == 0
    assert reconciler.health.sync_failure is None


def test_a_held_policy_stays_closed_at_no_cost_until_it_changes_and_is_enforced_again_then():
    objects = _shop() + _extra_policies(8)
    told, dataplane, reconciler = _synced_refusing(objects, _of("shop/extra-3"))
    store = reconciler.store
    checks = len(dataplane.checked)
    # unrelated changes, a resync and a relist of the same object: no check, still closed
    frontend = next(o for o in objects if o["metadata"]["name"].startswith("frontend-"))
    moved = copy.deepcopy(frontend)
    moved["metadata"]["labels"]["extra"] = "x"
    store.apply("Pod", "MODIFIED", moved)
    assert reconciler.sync(full=False)
    assert reconciler.sync(full=True)
    store.replace("NetworkPolicy", [o for o in objects if o["kind"] == "NetworkPolicy"])
    assert reconciler.sync(full=False)
    assert len(dataplane.checked) == checks and len(told) == 1
    assert dataplane.state.state() == _expected([moved if o is frontend else o for o in objects], {("NetworkPolicy", "shop/extra-3")})
    # the object changes (its owner fixed it): enforced as it now is
    fixed = copy.deepcopy(next(o for o in objects if o["metadata"]["name"] == "extra-3"))
    fixed["spec"]["ingress"][0]["ports"] = [{"port": 2000}]
    dataplane.stop_refusing()
    store.apply("NetworkPolicy", "MODIFIED", fixed)
    assert reconciler.sync(full=False)
    now = [moved if o is frontend else fixed if o["metadata"]["name"] == "extra-3" else o for o in objects]
    assert dataplane.state.state() == _expected(now, set())
    assert _refused_gauge(reconciler, "NetworkPolicy") == 0 and not reconciler.quarantine.held


def test_a_refused_policy_that_comes_later_fails_its_delta_then_the_full_retry_isolates_it():
    objects = _shop() + _extra_policies(4)
    told, dataplane, reconciler = _synced_refusing(objects, _of("shop/extra-9"))
    late = _extra_policies(10)[9]
    reconciler.store.apply("NetworkPolicy", "ADDED", late)
    assert not reconciler.sync(full=False)  # the delta is refused whole: the table stays as it was
    assert reconciler.renderer is None and not told
    assert reconciler.sync(full=True)  # the loop's retry, a full replace: extra-9 singled out
    assert [obj["metadata"]["name"] for _, obj, _ in told] == ["extra-9"]
    assert dataplane.state.state() == _expected(objects + [late], {("NetworkPolicy", "shop/extra-9")})


def test_a_refused_cluster_network_policy_denies_what_it_denied_and_accepts_nothing():
    objects = _shop() + [_cnp("guard"), _cnp("other")]
    told, dataplane, reconciler = _synced_refusing(objects, _of("guard", "allow-ops"))
    assert dataplane.state.state() == _expected(objects, {("ClusterNetworkPolicy", "guard")})
    stand_in = reconciler.renderer.policy("ClusterNetworkPolicy", "guard")
    assert [(r.action, r.name) for r in stand_in.ingress] == [("Deny", "fail-closed rule 1")]
    assert [t[0] for t in told] == ["ClusterNetworkPolicy"]


def test_a_refusal_no_policy_explains_fails_the_sync_as_before_after_one_check():
    store, told = _store(_shop())
    dataplane = FakeNftDataplane()
    dataplane.refuse_next("Could not process rule: No buffer space available")
    reconciler = _reconciler(store, dataplane)
    assert not reconciler.sync(full=True)
    assert len(dataplane.checked) == 1 and not told and not reconciler.quarantine.held
    assert reconciler.health.sync_failure == "Could not process rule: No buffer space available"


def test_the_common_path_checks_nothing():
    store, _ = _store(_shop() + [_cnp("guard")])
    dataplane = FakeNftDataplane()
    reconciler = _reconciler(store, dataplane)
    assert reconciler.sync(full=True) and reconciler.sync(full=True) and reconciler.sync(full=False)
    assert dataplane.checked == []


def test_the_failure_text_is_bounded_and_never_the_batch(caplog):
    store, _ = _store(_shop())
    dataplane = FakeNftDataplane()
    dataplane.refuse_next("Error: syntax error, unexpected '{'\n" + '{"nftables": [' + "x" * 6_300_000)
    reconciler = _reconciler(store, dataplane)
    with caplog.at_level("ERROR", logger="nftpolicy.reconcile"):
        assert not reconciler.sync(full=True)
    assert len(reconciler.health.sync_failure.encode()) <= REASON_MAX_BYTES
    assert max(len(r.getMessage().encode()) for r in caplog.records) < REASON_MAX_BYTES + 100


def test_libnftables_reason_leaves_the_echoed_batch_out():
    batch = json.dumps({"nftables": [{"add": {"table": {"family": "inet", "name": "nftpolicy"}}}] * 10_000})
    error = f"Error: syntax error, unexpected '{{'\n{batch}\n^\n"
    assert refusal(error, 1) == "Error: syntax error, unexpected '{'"
    two = "internal:0:0-0: Error: Could not process rule: Numerical result out of range\n" * 2
    assert refusal(two, 1) == "; ".join(["internal:0:0-0: Error: Could not process rule: Numerical result out of range"] * 2)
    assert refusal("", 7) == "libnftables returned 7"
    assert len(bounded_reason("é" * 2000).encode()) <= REASON_MAX_BYTES


def test_the_event_names_the_refusal():
    writer, metrics = MemoryWriter(), Metrics()
    rec = EventRecorder(writer, NODE, metrics)
    rec.kernel_refused("ClusterNetworkPolicy", {"metadata": {"name": "guard", "uid": "u1", "generation": 2}}, "Error: x")
    drain(rec)
    [event] = writer.events.values()
    assert (event["reason"], event["involvedObject"]["uid"], event["metadata"]["namespace"]) == (REFUSED, "u1", "default")
    assert event["message"].startswith("the kernel refused its rules: Error: x; enforced fail-closed")


# ---- the real kernel ----------------------------------------------------------------------------

def _before(text: str, limit: int = 128) -> str:
    """The text rule of before issue 29 (double quotes replaced, control characters kept)."""
    return text.replace('"', "'").encode()[:limit].decode(errors="ignore")


def _chains(ns: str) -> dict[str, list[dict]]:
    listed = json.loads(nft_cli(ns, "-j", "list", "table", "inet", "nftpolicy"))["nftables"]
    chains: dict[str, list[dict]] = {o["chain"]["name"]: [] for o in listed if "chain" in o}
    for o in listed:
        if "rule" in o:
            chains[o["rule"]["chain"]].append(o["rule"])
    return chains


@pytest.mark.kernel
def test_a_nul_byte_the_kernel_refuses_fails_only_its_policy_closed_on_a_fresh_node(make_netns, monkeypatch):
    """The issue's case for real: a printer without the text rule (monkeypatched back to the old
    one) sends a ClusterNetworkPolicy rule name with a NUL byte, and libnftables refuses the batch
    (``syntax error, unexpected '{'``). The fresh node still gets its table: the other policies'
    rules as rendered, the refused policy as its stand-in (deny what it denied, accept nothing),
    and one Event."""
    monkeypatch.setattr(nft, "comment", _before)
    monkeypatch.setattr(chainbuilders, "comment", _before)
    objects = _shop() + _extra_policies(12) + [_cnp("guard", "deny\x00debug"), _cnp("other")]
    store, told = _store(objects)
    ns = make_netns()
    reconciler = _reconciler(store, NftDataplane("nftpolicy", ns))
    assert reconciler.sync(full=True)
    [(kind, obj, reason)] = told
    assert (kind, obj["metadata"]["name"]) == ("ClusterNetworkPolicy", "guard")
    assert reason == "Error: syntax error, unexpected '{'"
    renderer = reconciler.renderer
    chains = _chains(ns)
    tiers = {c.policy: c.name for c in renderer.model().tier_chains}
    guard = [r["comment"] for r in chains[tiers["guard"]]]  # the Deny's log and its drop: only the stand-in's rule
    assert guard and set(guard) == {"guard Admin ingress rule 0 fail-closed rule 1 (Deny)"}
    assert any("allow-ops" in r["comment"] for r in chains[tiers["other"]])
    expected_policies = {c.name: len(c.rules) for c in build_rule_model(build_cluster(("t", o) for o in objects)[0], NODE).policy_chains}
    assert {name: len(chains[name]) for name in expected_policies} == expected_policies


@pytest.mark.kernel
@pytest.mark.parametrize("code", [*range(0x20), 0x7F, *range(0x80, 0xA0)])
def test_each_control_character_in_a_rule_name_is_enforced_as_written_on_a_fresh_node(make_netns, code):
    """With the text rule: every C0, DEL and C1 character in a ClusterNetworkPolicy rule name,
    the table is committed whole at the first try, the policy enforced as written (its comment
    shows the escape)."""
    objects = _shop() + [_cnp("guard", f"deny{chr(code)}debug")]
    store, told = _store(objects)
    ns = make_netns()
    reconciler = _reconciler(store, NftDataplane("nftpolicy", ns))
    assert reconciler.sync(full=True) and not told and not reconciler.quarantine.held
    tiers = {c.policy: c.name for c in reconciler.renderer.model().tier_chains}
    comments = [r["comment"] for r in _chains(ns)[tiers["guard"]]]
    assert f"guard Admin ingress rule 1 deny\\x{code:02x}debug (Deny)" in comments


SLOTS = {"x/a": "10.244.0.10", "x/c": "10.244.0.12", "y/d": "10.244.0.13"}
CONTROL = "".join(map(chr, [*range(0x20), 0x7F, *range(0x80, 0xA0)]))  # every C0 character, DEL and every C1: 66


@pytest.mark.kernel
def test_the_real_api_server_keeps_every_control_character_in_a_rule_name_and_a_fresh_node_enforces_it(control_plane, tmp_path):
    """The issue's case end to end: the CRD checks a rule name's length only, so the real
    kube-apiserver stores one of every C0, DEL and C1 character; ``nftpolicy agent`` on a fresh
    node commits its table at the first sync and enforces that Deny rule and everything else."""
    env = AgentEnv(tmp_path, SLOTS, api=RealApi(control_plane)).put_slot_pods()
    try:
        deny = {"apiVersion": CNP, "kind": "ClusterNetworkPolicy", "metadata": {"name": "deny-y"},
                "spec": {"tier": "Admin", "priority": 1, "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "x"}}},
                         "ingress": [{"name": CONTROL, "action": "Deny",
                                      "from": [{"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "y"}}}]}]}}
        stored = control_plane.apply(deny)
        assert stored["spec"]["ingress"][0]["name"] == CONTROL
        control_plane.apply({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "x", "name": "only-c"},
                             "spec": {"podSelector": {"matchLabels": {"app": "a"}},
                                      "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "c"}}}]}]}})
        env.start_agent()  # ready: the first sync committed
        assert not env.connects("y/d", SLOTS["x/a"])  # the Deny rule named with control characters
        assert env.connects("x/c", SLOTS["x/a"])  # the NetworkPolicy's allow
        assert env.metric("nftpolicy_sync_failures_total", mode="full") == 0
        assert env.metric("nftpolicy_refused_objects", kind="ClusterNetworkPolicy") == 0
        comments = [r["rule"].get("comment", "") for r in json.loads(nft_cli(env.netns, "-j", "list", "table", "inet", "nftpolicy"))["nftables"]
                    if "rule" in r]
        assert any(c.startswith("deny-y Admin ingress rule 0 \\x00\\x01\\x02") for c in comments)
    finally:
        env.close()
        clear_api(control_plane)
