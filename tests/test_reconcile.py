"""The reconcile loop's logic on the in-memory dataplane (no root, no kernel): the first sync is a
full replace, later ones carry only the change, a refused transaction keeps the old table and the
next attempt is a full replace, a lost table is restored, and a burst of changes is coalesced.
The kernel tests (test_agent_e2e.py, test_real_api.py) run the same loop on libnftables."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import yaml

from nftpolicy.agent.dataplane.fake import FakeNftDataplane, FakeTable
from nftpolicy.agent.dataplane.nftables import NftDataplane, NftError
from nftpolicy.agent.daemon.clock import REAL_TIME, Clock
from nftpolicy.agent.daemon.health import Health
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.reconcile import HEARTBEAT, Reconciler
from nftpolicy.agent.daemon.store import KINDS, Store
from nftpolicy.translators import nft, transaction
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.model import Cluster
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import Config

from .conftest import REPO, eventually
from .test_api_recovery import normalized
from .fakeclock import FakeClock

NODE = "node1"


def _objects() -> dict[str, list[dict[str, Any]]]:
    documents = list(yaml.safe_load_all((REPO / "examples/shop/cluster.yaml").read_text()))
    return {kind: [d for d in documents if d and d.get("kind") == kind] for kind in KINDS}


def _store(objects: dict[str, list[dict[str, Any]]]) -> Store:
    store = Store(Metrics())
    for kind in KINDS:
        store.replace(kind, objects[kind])
    return store


def _cluster(objects: dict[str, list[dict[str, Any]]]) -> Cluster:
    cluster, errors = build_cluster(("test", obj) for kind in KINDS for obj in objects[kind])
    assert not errors
    return cluster


def _fresh_state(objects: dict[str, list[dict[str, Any]]]) -> Any:
    """The table a full load of ``objects`` gives."""
    return FakeTable().apply(transaction.full(build_rule_model(_cluster(objects), NODE))).state()


def _reconciler(store: Store, dataplane: FakeNftDataplane | NftDataplane, clock: Clock = REAL_TIME, min_interval: float = 0.0) -> Reconciler:
    return Reconciler(store, Config(), NODE, Metrics(), Health(window=30.0), min_interval, 3600.0, dataplane, clock)


def _verbs(tx: transaction.Transaction) -> list[str]:
    """The nft commands of ``tx`` as libnftables takes them: ``"add table"``, ..."""
    return [f"{verb} {next(iter(body))}" for command in nft.transaction_json(tx)["nftables"] for verb, body in command.items()]


def _relabel(store: Store, objects: dict[str, list[dict[str, Any]]], name: str, **labels: str) -> None:
    """Change a pod's labels in ``objects`` and tell the store, as a watch event would."""
    pods = objects["Pod"]
    i = next(i for i, p in enumerate(pods) if p["metadata"]["name"].startswith(name))
    pods[i] = copy.deepcopy(pods[i])
    pods[i]["metadata"]["labels"] = {**pods[i]["metadata"].get("labels", {}), **labels}
    store.apply("Pod", "MODIFIED", pods[i])


def test_first_sync_is_a_full_replace_of_the_fresh_render():
    objects = _objects()
    store, dataplane = _store(objects), FakeNftDataplane()
    reconciler = _reconciler(store, dataplane)
    assert reconciler.sync(full=False)  # nothing committed yet: full whatever was asked
    (batch,) = dataplane.transactions
    assert _verbs(batch)[:2] == ["add table", "delete table"]
    assert dataplane.state.state() == _fresh_state(objects)
    assert reconciler.metrics.sync_duration.labels("full")._sum.get() > 0


def test_a_change_commits_only_what_it_changed():
    objects = _objects()
    store, dataplane = _store(objects), FakeNftDataplane()
    reconciler = _reconciler(store, dataplane)
    reconciler.sync(full=True)
    full_commands = dataplane.transactions[0].commands()
    # prometheus-0 leaves app=prometheus: api's ingress set loses its address
    _relabel(store, objects, "prometheus-0", app="other")
    assert reconciler.sync(full=False)
    batch = dataplane.transactions[-1]
    assert "delete table" not in _verbs(batch)
    assert "delete element" in _verbs(batch)
    assert batch.commands() < full_commands / 10
    assert dataplane.state.state() == _fresh_state(objects)


def test_no_change_commits_nothing():
    store, dataplane = _store(_objects()), FakeNftDataplane()
    reconciler = _reconciler(store, dataplane)
    reconciler.sync(full=True)
    assert reconciler.sync(full=False)
    assert len(dataplane.transactions) == 1


def test_an_incremental_sync_logs_where_its_oldest_events_time_went(caplog):
    objects = _objects()
    store, dataplane = _store(objects), FakeNftDataplane()
    reconciler = _reconciler(store, dataplane)
    reconciler.sync(full=True)
    _relabel(store, objects, "prometheus-0", app="other")
    with caplog.at_level("INFO", logger="nftpolicy.reconcile"):
        assert reconciler.sync(full=False)
    (line,) = [r for r in caplog.records if getattr(r, "mode", None) == "incremental"]
    fields = {k: getattr(line, k) for k in ("event_to_kernel_ms", "waited_ms", "render_ms", "commit_ms", "cpu_ms")}
    assert all(value >= 0 for value in fields.values()), fields
    assert fields["event_to_kernel_ms"] >= fields["waited_ms"] + fields["render_ms"] + fields["commit_ms"] - 0.05  # rounding
    assert reconciler.metrics.event_to_kernel._sum.get() * 1000 >= fields["event_to_kernel_ms"] - 0.01  # the same figure


def test_a_refused_transaction_keeps_the_table_and_the_next_sync_is_full():
    objects = _objects()
    store, dataplane = _store(objects), FakeNftDataplane()
    reconciler = _reconciler(store, dataplane)
    reconciler.sync(full=True)
    before = dataplane.state.state()
    _relabel(store, objects, "prometheus-0", app="other")
    dataplane.refuse_next("Could not process rule: No such file or directory")
    assert not reconciler.sync(full=False)
    assert dataplane.state.state() == before  # the kernel keeps what it had
    assert reconciler.renderer is None and reconciler.failures == 1
    assert reconciler.metrics.sync_failures.labels("incremental")._value.get() == 1
    assert store.pending_since is not None  # the change is still owed to the kernel
    assert reconciler.sync(full=False)
    assert _verbs(dataplane.transactions[-1])[:2] == ["add table", "delete table"]
    assert dataplane.state.state() == _fresh_state(objects)
    assert reconciler.failures == 0


@pytest.mark.parametrize("lost", [True, False])
def test_table_lost_is_noticed_only_when_it_is(lost):
    store, dataplane = _store(_objects()), FakeNftDataplane()
    reconciler = _reconciler(store, dataplane)
    assert not reconciler._table_lost()  # nothing committed yet: nothing to lose
    reconciler.sync(full=True)
    if lost:
        dataplane.lose_table()
    assert reconciler._table_lost() is lost


def _run(reconciler: Reconciler) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=reconciler.run, args=(stop,), daemon=True)
    thread.start()
    return stop, thread


def test_the_loop_waits_for_every_kind_then_syncs_and_follows_changes():
    objects, clock = _objects(), FakeClock()
    store, dataplane = Store(Metrics()), FakeNftDataplane()
    reconciler = _reconciler(store, dataplane, clock=clock)
    stop, thread = _run(reconciler)
    try:
        for kind in KINDS[:-1]:
            store.replace(kind, objects[kind])
        eventually(lambda: len(clock.waited) >= 5, clock=clock)  # the loop looked again and again
        assert dataplane.transactions == [] and not reconciler.health.ready  # Node not listed yet
        store.replace(KINDS[-1], objects[KINDS[-1]])
        eventually(lambda: reconciler.health.ready, clock=clock)
        _relabel(store, objects, "prometheus-0", app="other")
        eventually(lambda: dataplane.state.state() == _fresh_state(objects), clock=clock)
    finally:
        stop.set()
        store.changed.set()
        thread.join(5)
    assert not thread.is_alive()
    assert len(dataplane.transactions) == 2


def test_the_loop_restores_a_lost_table_and_retries_a_refused_sync():
    objects, clock = _objects(), FakeClock()
    store, dataplane = _store(objects), FakeNftDataplane()
    reconciler = _reconciler(store, dataplane, clock=clock)
    dataplane.refuse_next(count=2)
    started = clock.now()
    stop, thread = _run(reconciler)
    try:
        eventually(lambda: reconciler.health.ready, clock=clock)
        assert reconciler.metrics.sync_failures.labels("full")._value.get() == 2
        assert clock.now() - started >= 1.5  # after two refusals: the backoff waits 0.5 s, then 1 s
        dataplane.lose_table()
        eventually(lambda: dataplane.has_table(), clock=clock)
        assert max(clock.waited) <= HEARTBEAT  # the idle loop looks for the table at least every 5 s
        assert dataplane.state.state() == _fresh_state(objects)
    finally:
        stop.set()
        store.changed.set()
        thread.join(5)
    assert not thread.is_alive()


def test_a_burst_of_changes_is_coalesced_into_one_transaction():
    objects, clock = _objects(), FakeClock()
    store, dataplane = _store(objects), FakeNftDataplane()
    reconciler = _reconciler(store, dataplane, clock=clock, min_interval=1.0)
    stop, thread = _run(reconciler)
    try:
        eventually(lambda: reconciler.health.ready, clock=clock)
        for value in ("a", "b", "c", "other"):  # the clock stands still: within the 1 s minimum interval
            _relabel(store, objects, "prometheus-0", app=value)
        eventually(lambda: dataplane.state.state() == _fresh_state(objects), clock=clock)
    finally:
        stop.set()
        store.changed.set()
        thread.join(5)
    assert len(dataplane.transactions) == 2  # the full sync, then the burst in one


def _status_only(obj: dict[str, Any], **status: Any) -> dict[str, Any]:
    """``obj`` with only fields of its status changed (what a heartbeat or a probe writes)."""
    changed = copy.deepcopy(obj)
    changed["metadata"]["resourceVersion"] = "999"
    changed["status"] = {**changed.get("status", {}), **status}
    return changed


def test_a_heartbeat_or_status_only_update_wakes_no_sync_and_commits_nothing():
    objects, clock = _objects(), FakeClock()
    store, dataplane = _store(objects), FakeNftDataplane()
    reconciler = _reconciler(store, dataplane, clock=clock)
    stop, thread = _run(reconciler)
    try:
        eventually(lambda: reconciler.health.ready, clock=clock)
        heartbeat = [{"type": "Ready", "status": "True", "lastHeartbeatTime": "2026-12-02T01:00:00Z"}]
        store.apply("Node", "MODIFIED", _status_only(objects["Node"][0], conditions=heartbeat))
        store.apply("Pod", "MODIFIED", _status_only(objects["Pod"][0], conditions=heartbeat))
        assert not store.changed.is_set() and store.pending_since is None
        waits = len(clock.waited)
        eventually(lambda: len(clock.waited) >= waits + 5, clock=clock)  # the loop looked again and again
        assert len(dataplane.transactions) == 1  # the first full sync only
        _relabel(store, objects, "prometheus-0", app="other")  # a change the translator reads still commits
        eventually(lambda: dataplane.state.state() == _fresh_state(objects), clock=clock)
    finally:
        stop.set()
        store.changed.set()
        thread.join(5)
    assert not thread.is_alive()
    assert len(dataplane.transactions) == 2


def test_incremental_commits_share_one_libnftables_context_and_land_as_a_full_replace_would(make_netns):
    objects = _objects()
    store, dataplane = _store(objects), NftDataplane(Config().table, make_netns())
    reconciler = _reconciler(store, dataplane)
    assert reconciler.sync(full=True)
    kept = []
    for value in ("other", "prometheus", "other"):
        _relabel(store, objects, "prometheus-0", app=value)
        assert reconciler.sync(full=False)
        kept.append((dataplane._deltas._ctx, dataplane._netlink._socket))
    # each is made once, by the first incremental commit that needs it (chains: libnftables;
    # elements only: netlink), and kept
    contexts, sockets = {id(c) for c, _ in kept if c is not None}, {id(s) for _, s in kept if s is not None}
    assert len(contexts) <= 1 and len(sockets) <= 1 and contexts | sockets
    assert [c is not None for c, _ in kept] == sorted(c is not None for c, _ in kept)  # once made, kept
    bad = transaction.Transaction(Config().table, Config().priority)
    bad.delete(transaction.SetName("no-such-set"))
    with pytest.raises(NftError):
        dataplane.run(bad)
    assert dataplane._deltas._ctx is None  # a refused commit drops it
    _relabel(store, objects, "prometheus-0", app="prometheus")
    assert reconciler.sync(full=False)
    incremental = normalized(dataplane.listing())
    assert reconciler.sync(full=True)
    assert normalized(dataplane.listing()) == incremental


def test_the_fake_prints_its_table():
    objects = _objects()
    store, dataplane = _store(objects), FakeNftDataplane()
    _reconciler(store, dataplane).sync(full=True)
    text = dataplane.text()
    model = build_rule_model(_cluster(objects), NODE)
    for chain in model.pod_chains:
        assert f"\tchain {chain.name} {{" in text
    assert "ip daddr vmap @KUBE-POD-IN-MAP4" in text and "ip saddr vmap @KUBE-POD-EG-MAP4" in text
    assert dataplane.remove() and dataplane.text() == "" and not dataplane.remove()


def test_a_new_pods_address_skips_the_minimum_interval_and_a_relabel_waits_it_out():
    """The fast path (issue 31): while the clock stands still within the 10 s minimum interval, a
    pod that gets an address it did not have is committed at once; a label change waits it out."""
    objects, clock = _objects(), FakeClock()
    store, dataplane = _store(objects), FakeNftDataplane()
    reconciler = _reconciler(store, dataplane, clock=clock, min_interval=10.0)
    stop, thread = _run(reconciler)
    try:
        eventually(lambda: reconciler.health.ready, clock=clock)
        new = copy.deepcopy(objects["Pod"][0])
        new["metadata"]["name"], new["status"]["podIP"], new["status"]["podIPs"] = "new-0", "10.244.1.250", [{"ip": "10.244.1.250"}]
        store.apply("Pod", "ADDED", new)
        eventually(lambda: len(dataplane.transactions), 2)  # real time only: the clock never moves
        relabelled = copy.deepcopy(new)
        relabelled["metadata"]["labels"] = {"app": "other"}
        store.apply("Pod", "MODIFIED", relabelled)
        assert not store.new_address_pending()  # the same pod's label change: coalesced, committed once the interval is over
        eventually(lambda: len(dataplane.transactions), 3, clock=clock, step=1.0)
        assert clock.now() >= 10.0
    finally:
        stop.set()
        store.changed.set()
        thread.join(5)


def test_a_sync_rendered_after_the_stop_commits_nothing():
    """SIGTERM while a sync renders (the first full one at scale takes seconds): the agent once
    committed after logging the stop (1 run in 12, issue 34); now the sync ends uncommitted."""
    store, dataplane = _store(_objects()), FakeNftDataplane()
    reconciler = _reconciler(store, dataplane)
    reconciler.stop = threading.Event()
    reconciler.stop.set()
    assert reconciler.sync(full=True) is False
    assert dataplane.transactions == []
    reconciler.stop.clear()
    assert reconciler.sync(full=True) is True and len(dataplane.transactions) == 1
