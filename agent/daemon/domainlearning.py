"""The agent's side of domainNames peers: the learner (:mod:`.dnslearn`), the hold of DNS
answers (:mod:`.dnshold`) and the commits of what they teach, kept in step with the rendered
domain sets (docs/domain-names.md).

The reconcile loop calls :meth:`DomainLearning.sets_changed` after each committed sync with
the model's domain sets: the hold runs while there is one (so a node without domainNames
policies queues no DNS answer), and stops when the last goes. With a ``mark``, the hold queues
only answers to the sets' clients (the subject pods): a full replace of the table carries the
hold's set of their addresses and its marking chains (:meth:`DomainLearning.carry`,
:func:`~nftpolicy.translators.domainnames.with_hold_marks`), an incremental sync changes that
set's elements (through netlink), and the hold starts only once they are in the kernel (the
first domain set that an incremental sync brings asks for a full replace, which comes at once); a hold that cannot start (its
queue still bound by an agent that is stopping, iptables-nft failing) is tried again at the first
sync :data:`HOLD_RETRY_SECONDS` later (a periodic resync comes at least every
``--resync-interval``). A full replace of the table
carries what is learned (:meth:`DomainLearning.learned`), without holding the learning's lock
across its render and commit (which would stall every held answer for the sync's length):
inside :meth:`DomainLearning.replacing` answers are learned and committed as ever (through
netlink, never waiting for libnftables), and what they taught since the snapshot is committed
again once the replace is done, so an element that the replace's new table lacked is back.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator, Literal, Sequence

from nftpolicy.translators.domainnames import HOLD_SETS, DomainSet, hold_subjects, with_hold_marks
from nftpolicy.translators.layout import Table
from nftpolicy.translators.model import Family
from nftpolicy.translators.rules import TimedAddress

from nftpolicy.agent.dataplane.iptables import IptablesError

from .clock import REAL_TIME, Clock
from .dnshold import DEFAULT_BUDGET, DnsHold, DnsSegment, remove_hold_chain
from .dnslearn import RESULTS, DomainLearner
from .metrics import Metrics

log = logging.getLogger("nftpolicy.domainnames")

HoldMode = Literal["off", "bypass", "fail-closed"]
HOLD_MODES: tuple[HoldMode, ...] = ("off", "bypass", "fail-closed")
DEFAULT_RATE = 200  # answers a second to one pod that the kernel queues at most (--dns-pod-rate)
HOLD_RETRY_SECONDS = 30.0  # a hold that could not start is tried again at the first sync this much later


class DomainLearning:
    """Learns from DNS answers into the domain sets through ``add_elements`` (the dataplane's
    :meth:`~nftpolicy.agent.dataplane.nftables.NftDataplane.add_timed_elements`). ``hold``:
    ``off`` (nothing is learned: domainNames rules match nothing), ``bypass`` or
    ``fail-closed`` (what the kernel does with answers while the agent does not read them);
    ``queue``: the nfqueue number; ``netns_name``: as the dataplane's; ``clock``: when a hold
    that failed to start is tried again (:mod:`.clock`; tests give their own); ``budget``:
    answers one pod may have waiting in the hold (:class:`~.dnshold.DnsHold`); ``mark``: the
    bit that marks answers to subjects (None: the hold queues every answer to a pod, and no
    object of the hold is carried); ``rate``: answers a second to one pod the kernel queues at
    most, after a burst of as many plus ``budget`` (the rest pass unheld); ``change_elements``: with a mark, commits ``(verb, set,
    elements)`` changes of the hold's sets (the dataplane's
    :meth:`~nftpolicy.agent.dataplane.nftables.NftDataplane.change_elements`); ``learn_from``: with a mark, the
    addresses or CIDRs of the resolvers whose answers are learned (``--dns-learn-from``; None: any,
    with a warning when the hold starts)."""

    def __init__(self, learner: DomainLearner, add_elements: Callable[[Sequence[tuple[str, TimedAddress]]], None],
                 metrics: Metrics, hold: HoldMode, queue: int, netns_name: str | None, clock: Clock = REAL_TIME,
                 budget: int = DEFAULT_BUDGET, mark: int | None = None, rate: int = DEFAULT_RATE,
                 change_elements: Callable[[Sequence[tuple[str, str, tuple[str, ...]]]], None] | None = None,
                 learn_from: Sequence[str] | None = None) -> None:
        self.mark, self.rate, self.change_elements, self.learn_from = mark, rate, change_elements, learn_from
        self._carried: dict[Family, frozenset[str]] | None = None  # the subjects the last rendered full table carried
        self._subjects: dict[Family, frozenset[str]] | None = None  # those in the kernel (None: no hold set there)
        self.learner, self.add_elements, self.metrics = learner, add_elements, metrics
        self.hold_mode, self.queue, self.netns, self.clock, self.budget = hold, queue, netns_name, clock, budget
        self._over_budget = self._unmarked = 0  # the hold's over_budget and unmarked already counted in the metrics
        self.lock = threading.RLock()
        self._hold: DnsHold | None = None
        self._counted = dict.fromkeys(RESULTS, 0)
        self.failure: str | None = None  # why the hold could not start last time (None: it did, or was not tried)
        self._failed_at = 0.0  # when, on the clock
        self._left_checked = False  # whether a chain an earlier agent left was looked for
        self._since_snapshot: list[tuple[str, TimedAddress]] | None = None  # taught during a replace (replacing)

    def carry(self, table: Table, sets: Sequence[DomainSet]) -> Table:
        """``table`` (a full replace's, of a model with domain sets ``sets``) with the hold's
        objects when the hold is to run with a mark; else ``table``."""
        if self.mark is None or not sets or self.hold_mode == "off":
            self._carried = None
            return table
        self._carried = hold_subjects(sets)
        return with_hold_marks(table, self._carried, self.mark, self.rate, self.budget, self.learn_from)

    def _follow_subjects(self, sets: Sequence[DomainSet], replaced: bool) -> bool:
        """Keep the kernel's hold sets equal to ``sets``' clients; False while they are not in
        the kernel (a full replace has to bring them). A failed change forgets what is there:
        the next full replace settles it."""
        if replaced:
            self._subjects = self._carried
        if self._subjects is None:
            return False
        subjects = hold_subjects(sets)
        changes = [(verb, HOLD_SETS[family], tuple(sorted(addresses)))
                   for family in HOLD_SETS
                   for verb, addresses in (("delete", self._subjects[family] - subjects[family]),
                                           ("add", subjects[family] - self._subjects[family])) if addresses]
        if changes and self.change_elements is not None:
            try:
                self.change_elements(changes)
            except Exception as exc:  # noqa: BLE001 - the hold goes on with the set the kernel has
                log.error("could not change the DNS hold's subjects, a full replace will: %s: %s", type(exc).__name__,
                          " ".join(str(exc).split()))
                self._subjects = None
                return False
        self._subjects = subjects
        return True

    def sets_changed(self, sets: Sequence[DomainSet], replaced: bool = False) -> bool:
        """The domain sets of the committed model (``replaced``: by a full replace, which
        carried :meth:`carry`'s objects): the learner follows, the hold starts or stops. The
        first time no hold is to run (``off``, or no domain set), a hold chain that an earlier
        agent left is removed: nobody would read its queue (and with ``fail-closed`` it would
        drop every DNS answer the node forwards). True when the hold waits for a full replace
        to bring its objects (the caller makes the next sync one)."""
        with self.lock:
            self.learner.update(sets)
            self.metrics.dns_learned_elements.set(self.learner.size())
        wants = bool(sets) and self.hold_mode != "off"
        if wants and self.mark is not None and not self._follow_subjects(sets, replaced):
            return True
        holds = wants and (self.failure is None or self.clock.now() - self._failed_at >= HOLD_RETRY_SECONDS)
        if not wants and self._hold is None and not self._left_checked:  # nobody will read the queue
            self._left_checked = True
            if remove_hold_chain(self.netns):
                log.info("removed the hold chain of DNS answers that an earlier agent left: this one holds none")
        if holds and self._hold is None:
            hold = DnsHold(self.commit, self.queue, bypass=self.hold_mode == "bypass", netns_name=self.netns, mark=self.mark,
                           budget=self.budget, released=self.released)
            try:
                hold.start()
            except (IptablesError, OSError) as exc:  # enforcement goes on; domainNames rules match no address
                hold.close(remove_chain=False)  # start left no chain of its own; one that is there is another agent's
                self.failure, self._failed_at = " ".join(str(exc).split()), self.clock.now()
                log.error("cannot hold DNS answers, domainNames peers learn nothing until it can (tried again at the first "
                          "sync %.0f s from now): %s", HOLD_RETRY_SECONDS, self.failure)
                return False
            self._hold, self.failure, self._over_budget, self._unmarked = hold, None, 0, 0
            log.info("holding DNS answers in nfqueue %d until what they teach is committed (%s while the agent is away)",
                     self.queue, self.hold_mode)
            if self.learn_from is None:
                log.warning("learning from the DNS answers of any server a subject pod asks: a pod that can reach a DNS server of its "
                            "own can add any address to the sets of every policy with the same domainNames; set --dns-learn-from "
                            "to the cluster DNS (docs/domain-names.md)")
        elif not sets and self._hold is not None:
            self._hold.close()
            self._hold = None
        if not wants and replaced:
            self._subjects = None  # the replace carried no hold set
        return False

    def adopt(self, elements: dict[str, list[TimedAddress]]) -> None:
        """Keep what an earlier agent learned (the kernel's domain set elements, before this
        agent's first sync replaces the table), each until it expires."""
        now = time.monotonic()
        with self.lock:
            for set_name, items in elements.items():
                for item in items:
                    self.learner.adopt(set_name, item.address, item.timeout, now)
        if elements:
            log.info("kept %d addresses an earlier agent learned from DNS answers", sum(map(len, elements.values())))

    @contextlib.contextmanager
    def replacing(self) -> Iterator[None]:
        """Around a full replace of the table, which carries :meth:`learned` (taken inside):
        what answers teach from the start on is kept, and committed again at the end (after
        the replace committed or failed: an element the old table had already is only renewed).
        A commit that fails then is counted and logged as an answer's would be."""
        with self.lock:
            self._since_snapshot = []
        try:
            yield
        finally:
            with self.lock:
                taught, self._since_snapshot = self._since_snapshot, None
                taught = [(name, element) for name, element in taught or () if self.learner.has_set(name)]
                if taught:
                    try:
                        self.add_elements(taught)
                    except Exception as exc:  # noqa: BLE001 - the next answer or full replace puts them back
                        log.error("could not commit again %d addresses learned during a full replace: %s: %s", len(taught),
                                  type(exc).__name__, " ".join(str(exc).split()))

    def learned(self) -> dict[str, tuple[TimedAddress, ...]]:
        """Every learned element by set, with the time it has left."""
        found: dict[str, list[TimedAddress]] = {}
        with self.lock:
            for item in self.learner.held(time.monotonic()):
                found.setdefault(item.set_name, []).append(TimedAddress(item.address, item.timeout))
        return {name: tuple(elements) for name, elements in found.items()}

    def taught(self) -> dict[str, dict[str, str]]:
        """Domain set -> live learned address -> ``name`` (or ``name (pattern)`` when a
        wildcard matched): what ``explain --agent`` says allowed an address."""
        found: dict[str, dict[str, str]] = {}
        with self.lock:
            for item in self.learner.held(time.monotonic()):
                found.setdefault(item.set_name, {})[item.address] = item.name if item.name == item.pattern else f"{item.name} ({item.pattern})"
        return found

    def commit(self, segment: DnsSegment) -> None:
        """Learn from one held DNS segment and commit it (the hold releases it after this)."""
        with self.lock:
            learned = self.learner.learn(segment.client, segment.payload, time.monotonic(), segment.tcp)
            if learned:
                elements = [(x.set_name, TimedAddress(x.address, x.timeout)) for x in learned]
                if self._since_snapshot is not None:
                    self._since_snapshot += elements
                self.add_elements(elements)
            for result, total in self.learner.counts.items():
                if total > self._counted[result]:
                    self.metrics.dns_answers.labels(result).inc(total - self._counted[result])
                    self._counted[result] = total
            self.metrics.dns_learned_elements.set(self.learner.size())

    def released(self, segment: DnsSegment, seconds: float) -> None:
        """The hold let ``segment`` go on after ``seconds`` (waiting behind other pods' answers,
        learn and commit): the metrics, with the answers let through over a pod's budget or
        without the mark (``untrusted``)."""
        self.metrics.dns_hold_seconds.observe(seconds)
        if self._hold is not None and self._hold.over_budget > self._over_budget:
            self.metrics.dns_over_budget.inc(self._hold.over_budget - self._over_budget)
            self._over_budget = self._hold.over_budget
        if self._hold is not None and self._hold.unmarked > self._unmarked:
            self.metrics.dns_answers.labels("untrusted").inc(self._hold.unmarked - self._unmarked)
            self._unmarked = self._hold.unmarked

    def close(self) -> None:
        """The agent stops: stop reading the queue, leave the hold chain (answers pass or drop
        as ``hold`` says until an agent reads again); learned elements stay until they expire."""
        if self._hold is not None:
            self._hold.close(remove_chain=False)
            self._hold = None
