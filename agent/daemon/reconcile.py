"""The reconcile loop: cluster snapshot -> desired table -> one typed transaction (DESIGN.md section 4).

* The first sync waits until every source has listed, and is a full replace (``add table``,
  ``delete table``, everything) in one transaction: the old ruleset stays in force until the
  new one is committed, so a restart opens no window.
* Later syncs feed only the objects that changed to the node's renderer
  (:class:`~nftpolicy.translators.noderender.NodeRenderer`) and commit only what that changed in
  the model (set elements, sets, chains, dispatch map elements): the cost of a change is what it
  touches, not the cluster. A full replace again on the resync timer and after any failure.
* Changes are coalesced: two syncs are at least ``min_interval`` seconds apart, except the
  fast path: a new pod's address alone, or any change while the hold of unknown pods' packets
  (:mod:`.podhold`) has packets waiting, is committed at once; the hold is told after every commit.
* A refused transaction leaves the kernel as it was; it is logged with libnftables' reason and
  retried with exponential backoff (full replace). A refused full replace first has the policies
  responsible singled out and failed closed (:mod:`.quarantine`), and the rest committed.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Mapping, Sequence

from nftpolicy.translators import layout, refusals, transaction
from nftpolicy.translators.domainnames import with_learned
from nftpolicy.translators.delta import delta_transaction
from nftpolicy.translators.noderender import NodeRenderer
from nftpolicy.translators.rules import ChainOwner, Config
from nftpolicy.translators.transaction import Replace, Transaction

from nftpolicy.agent.dataplane import CheckedDataplane, DataplaneError
from .clock import REAL_TIME, Clock
from .domainlearning import DomainLearning
from .health import Health
from .memory import gc_paused
from .metrics import Metrics
from .podhold import PodHold
from nftpolicy.agent.dataplane.nftables import release_memory
from .quarantine import Quarantine, find_refused
from .store import Store

log = logging.getLogger("nftpolicy.reconcile")
HEARTBEAT = 5.0
MAX_RETRY_DELAY = 30.0


def empty_table_reason(renderer: NodeRenderer, pod_chains: int) -> str | None:
    """Why the table has no pod chain (None when it has ``pod_chains``): no running pod with an
    address on the node, or no policy selects one of them."""
    if pod_chains:
        return None
    local = renderer.local_pods()  # kept by the renderer: no walk over the cluster's pods per sync
    if not local:
        return f"no running pod with an IP address on node {renderer.node} ({len(renderer.pods)} pods in the cluster)"
    return f"no NetworkPolicy selects any of the {local} pods on node {renderer.node}"


class Reconciler:
    """Keeps our table in ``dataplane`` equal to what ``store`` describes, for node ``node``
    (``dataplane``: the kernel's or the in-memory fake's)."""

    def __init__(self, store: Store, config: Config, node: str, metrics: Metrics, health: Health,
                 min_interval: float, resync_interval: float, dataplane: CheckedDataplane,
                 clock: Clock = REAL_TIME, learning: DomainLearning | None = None, hold: PodHold | None = None) -> None:
        self.store, self.config, self.node = store, config, node
        self.learning = learning  # domainNames: what DNS answers teach (None: not learned)
        self.hold = hold  # unknown pods' packets, released once their pod is committed (None: not held)
        self.metrics, self.health = metrics, health
        self.min_interval, self.resync_interval = min_interval, resync_interval
        self.clock = clock  # when the loop syncs, resyncs and retries (tests give their own)
        self.dataplane = dataplane
        # The model the kernel holds (None: unknown, the next sync replaces the table).
        self.renderer: NodeRenderer | None = None
        self._owners: dict[str, ChainOwner] | None = None  # chain_owners() of that model, made once per sync
        self.lock = threading.Lock()  # held by each sync: readers (the debug endpoint) see a committed model
        self.failures = 0
        self.empty_reason: str | None = None  # why the committed table isolates no pod (logged once)
        self.quarantine = Quarantine(metrics)  # policies the kernel refused, enforced fail-closed
        self.stop: threading.Event | None = None  # run()'s: once set (SIGTERM), a sync rendered is not committed

    def chain_owners(self) -> Mapping[str, ChainOwner]:
        """Chain name -> what it enforces (policy and direction, or pod; a tier chain's counted
        rules too), of the model the kernel holds (empty before the first sync); waits for a sync
        under way. Made once per committed sync, not at every metrics scrape."""
        with self.lock:
            if self._owners is None:
                self._owners = self.renderer.chain_owners() if self.renderer is not None else {}
            return self._owners

    def _table_lost(self) -> bool:
        """True when what we committed is no longer in the kernel: our table or its FORWARD base
        chain is missing (a cheap look-up, done while idle)."""
        return self.renderer is not None and not self.dataplane.has_table()

    def _full_transaction(self) -> tuple[Transaction, float | None, NodeRenderer]:
        """Render the whole snapshot from scratch: the transaction replaces the table."""
        cluster, since = self.store.take()
        with gc_paused():
            renderer = NodeRenderer(self.node, self.config).load(self.quarantine.substituted(cluster))
            renderer.take_changes()  # the full replace carries everything
            return transaction.replacing(self._table(renderer)), since, renderer

    def _table(self, renderer: NodeRenderer) -> layout.Table:
        """The whole table of ``renderer``'s model, with what DNS answers taught (inside the
        learning's :meth:`~.domainlearning.DomainLearning.replacing`, see _sync)."""
        table = layout.table(renderer.model(ordered=False, unions=False))
        if self.learning is None:
            return table
        return self.learning.carry(with_learned(table, self.learning.learned()), renderer.domain_sets())

    def _delta_transaction(self) -> tuple[Transaction | None, float | None]:
        """Feed the objects that changed to the renderer; the transaction of what that changed
        (None: nothing in the table changes)."""
        assert self.renderer is not None
        changes, since = self.store.take_changes()
        for kind, key, obj in changes:
            self.renderer.apply(kind, key, self.quarantine.change(kind, key, obj))
        delta = self.renderer.take_changes()
        return (delta_transaction(self.config, delta) if delta else None), since

    def sync(self, full: bool) -> bool:
        """Commit the changes since the last sync (everything when ``full``); True when the
        kernel took them."""
        with self.lock:
            return self._sync(full)

    def _sync(self, full: bool) -> bool:
        started, cpu = time.monotonic(), time.thread_time()
        tx: Transaction | None
        if full or self.renderer is None:
            mode = "full"
            if self.learning is not None:
                with self.learning.replacing():  # what answers teach meanwhile is committed again after the replace
                    tx, since, renderer = self._full_transaction()
                    return self._commit(tx, since, renderer, mode, started, cpu)
            tx, since, renderer = self._full_transaction()
        else:
            mode, renderer = "incremental", self.renderer
            tx, since = self._delta_transaction()
        return self._commit(tx, since, renderer, mode, started, cpu)

    def _commit(self, tx: Transaction | None, since: float | None, renderer: NodeRenderer, mode: str, started: float,
                cpu: float) -> bool:
        """Commit ``tx`` (rendered from ``started`` on, monotonic seconds, and from ``cpu`` on,
        this thread's CPU seconds) and account for it: metrics, the sync's log line."""
        if tx is None:
            if since is not None:
                self.metrics.event_to_kernel.observe(time.monotonic() - since)
            return True
        changed = tx.summary()
        commands = sum(changed.values())
        rendered = time.monotonic()
        if self.stop is not None and self.stop.is_set():  # stopping: the kernel keeps what it has, as at any stop
            log.info("stopping: the %s sync rendered meanwhile is not committed", mode)
            return False
        try:
            tx = self._run(tx, renderer)
            committed = time.monotonic()
            changed = tx.summary()  # the transaction committed (the isolated one, after a refusal)
            commands = sum(changed.values())
            del tx  # committed: its objects go before the collection and the trim below
        except (DataplaneError, OSError) as exc:
            self.failures += 1
            self.renderer, self._owners = None, None  # the kernel's state is unknown: the next attempt is a full replace
            self.metrics.sync_failures.labels(mode).inc()
            if since is not None and self.store.pending_since is None:
                self.store.pending_since = since  # still owed to the kernel
            self.health.sync_failure = " ".join(str(exc).split())
            log.error("sync failed, the kernel keeps the previous ruleset: %s", str(exc).strip(),
                      extra={"mode": mode, "commands": commands})
            return False
        took = committed - started
        self.failures = 0
        self.health.sync_failure = None
        self.renderer, self._owners = renderer, None
        if self.hold is not None:
            self.hold.programmed(renderer.known_addresses())
        self.metrics.sync_duration.labels(mode).observe(took)
        self.metrics.transaction_commands.labels(mode).observe(commands)
        self.metrics.last_success.set(time.time())
        self.metrics.table_generation.inc()
        counts = renderer.counts()
        for kind, value in counts.items():
            self.metrics.table_objects.labels(kind).set(value)
        # Where an event's time goes (the log line's fields): waiting (for the minimum interval,
        # or a sync under way), render (the renderer, the transaction), commit (libnftables).
        timings = {"render_ms": round((rendered - started) * 1000, 2), "commit_ms": round((committed - rendered) * 1000, 2)}
        if since is not None:
            self.metrics.event_to_kernel.observe(committed - since)
            timings.update(event_to_kernel_ms=round((committed - since) * 1000, 2), waited_ms=round((started - since) * 1000, 2))
        if self.learning is not None and self.learning.sets_changed(renderer.domain_sets(), replaced=mode == "full"):
            self.renderer = None  # the hold's objects come with a full replace: the next sync, at once
            self.store.changed.set()
        if (why := empty_table_reason(renderer, counts["pod chains"])) != self.empty_reason and why:
            log.info("the table isolates no pod: %s", why)
        self.empty_reason = why
        if mode == "full":
            # The model lives long: collect once, then keep it out of later collections, whose
            # pauses would otherwise dominate the sync latency tail; give freed memory back.
            gc.collect()
            gc.freeze()
            release_memory()
        log.info("sync %s in %.1f ms: %s; table has %d pod chains, %d policy chains, %d sets, %d set elements", mode,
                 took * 1000, ", ".join(f"{n} {what}" for what, n in sorted(changed.items())), counts["pod chains"],
                 counts["policy chains"], counts["sets"], counts["elements"],
                 extra={"mode": mode, "commands": commands, "duration_ms": round(took * 1000, 1),
                        "cpu_ms": round((time.thread_time() - cpu) * 1000, 2), **timings})
        return True

    def _run(self, tx: Transaction, renderer: NodeRenderer) -> Transaction:
        """Commit ``tx``; when the kernel refuses a full replace, the one :meth:`_isolated` makes
        of it instead. Returns the transaction committed; raises what the dataplane raised when
        no policy is to blame (or the kernel refuses the replace without them too)."""
        try:
            self.dataplane.run(tx)
            return tx
        except DataplaneError:
            isolated = self._isolated(tx, renderer) if any(isinstance(op, Replace) for op in tx.operations) else None
            if isolated is None:
                raise
        self.dataplane.run(isolated)
        return isolated

    def _isolated(self, tx: Transaction, renderer: NodeRenderer) -> Transaction | None:
        """The full replace ``tx`` (refused) with each policy responsible
        (:func:`~.quarantine.find_refused`) held in :attr:`quarantine` and enforced as its
        fail-closed stand-in in ``renderer`` (logged, and an Event through the store); None when
        the kernel takes what the table holds of all its policies (the fault is elsewhere)."""
        (table,) = [op.table for op in tx.operations if isinstance(op, Replace)]
        suspects = refusals.policies_in(table)

        def refused(group: Sequence[refusals.PolicyRef]) -> str | None:
            try:
                self.dataplane.check(transaction.replacing(refusals.only(table, group)))
            except DataplaneError as exc:
                return str(exc)
            return None

        why = refused(suspects) if suspects else None
        if why is None:
            return None
        found = find_refused(suspects, why, refused)
        for (kind, key), reason in found.items():
            policy = renderer.policy(kind, key)
            assert policy is not None  # it has rules in the table
            self.quarantine.hold((kind, key), policy, reason)
            renderer.apply(kind, key, refusals.stand_in(policy, reason))
            log.error("the kernel refused the rules of %s %s, enforcing it fail-closed until it changes: %s", kind, key, reason,
                      extra={"kind": kind, "object": key})
            self.store.report_refused(kind, key, reason)
        renderer.take_changes()
        return transaction.replacing(self._table(renderer))

    def _fast_path(self) -> bool:
        """True when the pending change goes to the kernel at once, not after the minimum
        interval: a new pod's address alone (:meth:`Store.new_address_pending`), or any change
        while the hold has packets of unknown pods waiting (each may be the one they wait for)."""
        return self.store.new_address_pending() or (self.hold is not None and bool(self.hold.waiting))

    def run(self, stop: threading.Event) -> None:
        """Loop until ``stop`` is set; rules are left in place when it ends, and a sync under way
        when it is set commits nothing (its log line would follow the stop's)."""
        self.stop = stop
        while not self.store.listed() and not self.clock.wait(stop, 0.05):
            self.health.beat()
        last_sync, last_full = float("-inf"), float("-inf")  # a full sync is due at once
        retry_at: float | None = None
        while not stop.is_set():
            self.health.beat()
            now = self.clock.now()
            if retry_at is not None:
                if now < retry_at:
                    self.clock.wait(stop, min(HEARTBEAT, retry_at - now))
                    continue
            else:
                resync_at = last_full + self.resync_interval
                if not self.store.changed.is_set() and now < resync_at:
                    if not self.clock.wait(self.store.changed, min(HEARTBEAT, resync_at - now)) and self._table_lost():
                        log.warning("our table is gone or incomplete (another tool flushed the ruleset?): restoring it")
                        self.renderer, retry_at = None, self.clock.now()
                    continue
                if now - last_sync < self.min_interval and not self._fast_path():  # coalesce a burst of changes
                    self.clock.wait(stop, min(HEARTBEAT, self.min_interval - (now - last_sync)))
                    continue
            full = self.renderer is None or now - last_full >= self.resync_interval
            last_sync = self.clock.now()
            if self.sync(full):
                retry_at = None
                self.health.ready = True
                if full:
                    last_full = last_sync
            else:
                retry_at = self.clock.now() + min(MAX_RETRY_DELAY, 0.5 * 2 ** (self.failures - 1))
