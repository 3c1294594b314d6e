"""libnftables: the one module that talks to the kernel's nftables (through Debian's python3-nftables).

:class:`NftDataplane` commits typed transactions, printed as libnftables JSON batches
(:func:`nftpolicy.translators.nft.transaction_json`, libnftables-json(5)), inside one network
namespace; the kernel takes each batch as one transaction: it lands whole or not at all.

**One owner.** libnftables 1.0.6 is not thread-safe: ``set_dtype_json`` walks a type's name
with ``strtok()`` (one hidden pointer for the whole process), so two listings at once abort the
process (``json.c:71: set_dtype_json: Assertion '__out' failed``) or print corrupted JSON. Every
libnftables call of the process therefore holds :data:`LIBNFTABLES`, one lock for every
:class:`NftDataplane` and :class:`KeptContext`: making a context, running a command, freeing the
context (``nft_ctx_free``), and forking :class:`TraceMonitor`'s child (which then starts from a
library no other thread was inside). A lock rather than one dataplane thread that runs every
call: a call needs its caller's network namespace (setns(2) is per thread) and its answer, and
the incremental commits, whose event-to-kernel latency is the agent's main figure, would pay a
hand-off to another thread and back on every sync for the same exclusion. JSON is encoded and
decoded outside the lock. What may wait on it is bounded: the rule counters are listed by one
thread at most every ``--counters-interval`` seconds (:mod:`nftpolicy.agent.daemon.rulecounters`),
never per scrape; a commit waits at most for one such listing.

The element-only commits of :mod:`.nfnetlink` do not enter libnftables and do not take the lock
(an incremental sync's commit then never waits for a counters' listing): the kernel serialises
the nf_tables transactions of a network namespace (one commit mutex per namespace, held from a
batch's begin to its commit or abort), so such a batch and a libnftables commit run one after
the other whichever comes first, and a libnftables listing that a netlink commit overlaps sees
the ruleset's generation move in its dump and dumps again (libnftables' cache replays on a
generation change), never a torn listing. They come from the reconcile loop only, as every
other commit of our sets does, so no two commits of the agent race on the same set.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import select
import signal
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, Iterator, Sequence

import nftables
import orjson

from nftpolicy.translators import nft
from nftpolicy.translators.nft import Json
from nftpolicy.translators.rules import AddressSet, TimedAddress
from nftpolicy.translators.layout import VerdictMap
from nftpolicy.translators.transaction import Elements, OurTable, Replace, SetName, Transaction, removing

from . import DataplaneError, netns, nfnetlink


class NftError(DataplaneError):
    """libnftables refused a batch; the kernel still holds the ruleset it had before."""


# The start of a libnftables error line: ``Error: ...`` or ``<location>: Error: ...``.
ERROR_LINE = re.compile(r"^(\S+: )?Error: ")


def refusal(error: str, rc: int) -> str:
    """libnftables' reason for refusing a batch, from its error output: the ``Error:`` lines,
    joined, without the input that libnftables echoes after each (for a JSON batch the whole
    batch on one line: 6.3 MB at 1k pods) and the line that points into it; its first line when
    it has none, ``libnftables returned <rc>`` when it is empty. :class:`NftError` cuts it to
    1 KB."""
    lines = [line.strip() for line in error.splitlines() if ERROR_LINE.match(line)]
    return "; ".join(lines) or (error.strip().splitlines()[0] if error.strip() else f"libnftables returned {rc}")


# Each nft feature the ruleset needs, as a batch the kernel must accept (DESIGN.md section 2).
FEATURE_PROBES = {
    "inet family table with filter base chains (nf_tables, nf_tables_inet)":
        "add chain inet {t} probe_0 {{ type filter hook forward priority 0; policy accept; }}",
    "verdict maps (nft_lookup, nft_immediate)":
        "add map inet {t} m {{ type ipv4_addr : verdict; }}\nadd chain inet {t} probe_1\nadd rule inet {t} probe_1 ip daddr vmap @m",
    "interval sets (nft_set_rbtree)":
        "add set inet {t} s {{ type ipv4_addr; flags interval; elements = {{ 10.0.0.0/8 }}; }}",
    "concatenated sets (nft_set_hash)":
        "add set inet {t} n {{ type ipv4_addr . inet_proto . inet_service; elements = {{ 10.0.0.1 . tcp . 80 }}; }}",
    "fib expression (nft_fib_inet)": "add chain inet {t} probe_2\nadd rule inet {t} probe_2 fib saddr type local accept",
    "conntrack state (nft_ct)": "add chain inet {t} probe_3\nadd rule inet {t} probe_3 ct state established,related accept",
    "meta mark (nft_meta)": "add chain inet {t} probe_4\nadd rule inet {t} probe_4 meta mark set meta mark | 0x10000",
    "reject (nft_reject_inet)": "add chain inet {t} probe_5\nadd rule inet {t} probe_5 meta l4proto tcp reject with tcp reset\nadd rule inet {t} probe_5 reject",
    "rate limit and NFLOG (nft_limit, nft_log, nfnetlink_log)":
        "add chain inet {t} probe_6\nadd rule inet {t} probe_6 limit rate 10/minute burst 10 packets log group 100",
}
FEATURE_TABLE = "nftpolicy-feature-check"
NETLINK_NETFILTER = 12  # <linux/netlink.h>
NFNLGRP_NFTRACE = 9  # <linux/netfilter/nfnetlink.h>: the group trace events are sent to
MONITOR_START_TIMEOUT = 30.0  # seconds for ``monitor trace`` to join it
# Held by every libnftables call of the process (module docstring). Reentrant: the garbage
# collector may free a kept context (KeptContext.__del__) in a thread that holds it.
LIBNFTABLES = threading.RLock()


def release_memory() -> None:
    """Give the memory that a big commit freed back to the system (glibc ``malloc_trim(0)``):
    libnftables' JSON parsing and netlink buffers otherwise keep the process at about twice its
    model's size. A no-op where the C library has no malloc_trim."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


class KeptContext:
    """One libnftables context kept for a stream of small commits (making a context and its
    netlink socket costs more than parsing a small batch): made at the first :meth:`cmd` inside
    ``entered()`` (the namespace: its socket stays there), one command at a time in the process
    (:data:`LIBNFTABLES`), and dropped after a refusal, so the next command gets a fresh one."""

    def __init__(self, entered: Callable[[], Any]) -> None:
        self._entered = entered
        self._ctx: Any = None  # an nftables.Nftables once made

    def __repr__(self) -> str:
        return f"KeptContext({'made' if self._ctx is not None else 'not made'})"

    def __del__(self) -> None:
        with LIBNFTABLES:
            self._ctx = None  # nft_ctx_free under the lock, as every call

    def cmd(self, batch: Json) -> None:
        """Run the libnftables JSON ``batch``; raises NftError with libnftables' reason."""
        text = orjson.dumps(batch).decode()
        with LIBNFTABLES:
            if self._ctx is None:
                with self._entered():
                    self._ctx = nftables.Nftables()
                self._ctx.set_json_output(True)
            rc, _, error = self._ctx.cmd(text)
            if rc != 0:
                self._ctx = None  # freed here, under the lock
        if rc != 0:
            raise NftError(refusal(str(error), rc))


class NftDataplane:
    """Our ``inet <table>`` through libnftables, inside network namespace ``netns`` (a name from
    ``ip netns add``; None: this process's own). Only that table is ever named."""

    def __init__(self, table: str, netns_name: str | None = None) -> None:
        self.table, self.netns = table, netns_name
        self._deltas = KeptContext(self._entered)  # the commits that do not replace the table (run)
        self._netlink = nfnetlink.ElementSocket(self._entered)  # element-only commits (_elements_only, add_timed_elements)
        self._kinds: dict[str, str] = {}  # our sets' and maps' kinds, from what we committed

    def __repr__(self) -> str:
        return f"NftDataplane(inet {self.table}{f' in {self.netns}' if self.netns else ''})"

    def _entered(self) -> Any:
        return netns.entered(self.netns) if self.netns else nullcontext()

    def run(self, tx: Transaction) -> None:
        """Commit ``tx`` (printed by :func:`nft.transaction_json`); raises NftError with
        libnftables' reason.

        A transaction that replaces the table runs in a context of its own, dropped with the
        cache libnftables built of the whole table. Every other one (the incremental syncs')
        runs in one context kept for them, made at the first: making a context and its netlink
        socket at each commit cost more CPU than parsing a small commit (bench/churn.py,
        docs/benchmarks.md). A refused commit drops that context too (the next is a fresh one).
        A commit of nothing but set and map elements goes through netlink (:meth:`_elements_only`)."""
        if any(isinstance(op, Replace) for op in tx.operations):
            self._cmd(nft.transaction_json(tx))
        elif (elements := self._elements_only(tx)) is not None:
            self._netlink.commit(self.table, elements)
        else:
            self._deltas.cmd(nft.transaction_json(tx))
        self._remember_kinds(tx)

    def _elements_only(self, tx: Transaction) -> list[tuple[str, str, tuple[Any, ...]]] | None:
        """``tx`` as ``(verb, set, elements)`` when it changes only elements of sets and maps
        whose elements are keys (:data:`nfnetlink.KEYED_KINDS`, as we created them), besides
        ``add`` of our table (a no-op where it is: without the table the elements are refused,
        and the next sync replaces it); else None (libnftables commits it). Such a commit goes
        through netlink: libnftables would first dump the namespace's whole ruleset
        (:mod:`.nfnetlink`)."""
        changes: list[tuple[str, str, tuple[Any, ...]]] = []
        for op in tx.operations:
            if isinstance(op, Replace):
                return None
            if isinstance(op.object, OurTable) and op.verb == "add":
                continue
            if not isinstance(op.object, Elements) or self._kinds.get(op.object.name, "") not in nfnetlink.KEYED_KINDS:
                return None
            changes.append((op.verb, op.object.name, op.object.elements))
        return changes

    def _remember_kinds(self, tx: Transaction) -> None:
        """After ``tx`` was committed: the kinds of the sets and maps it made or removed."""
        for op in tx.operations:
            if isinstance(op, Replace):
                self._kinds = {s.name: s.kind for s in op.table.sets} | {m.name: "map" for m in op.table.maps}
                continue
            if isinstance(op.object, (AddressSet, VerdictMap)) and op.verb == "add":
                self._kinds[op.object.name] = op.object.kind if isinstance(op.object, AddressSet) else "map"
            elif isinstance(op.object, OurTable) and op.verb == "delete":
                self._kinds.clear()
            elif isinstance(op.object, SetName) and op.verb == "delete":
                self._kinds.pop(op.object.name, None)

    def check(self, tx: Transaction) -> None:
        """Have the kernel check ``tx`` and commit nothing (libnftables' dry run: the batch goes
        to the kernel, which validates it and aborts); raises NftError with the reason a commit
        would be refused."""
        self._cmd(nft.transaction_json(tx), dry_run=True)

    def _cmd(self, batch: Json, terse: bool = False, stateless: bool = False, dry_run: bool = False) -> Json:
        text = orjson.dumps(batch).decode()
        with LIBNFTABLES, self._entered():
            ctx = nftables.Nftables()
            try:
                ctx.set_json_output(True)  # JSON in and out (libnftables reads its input as JSON then)
                ctx.set_terse_output(terse)  # lists leave set elements out
                ctx.set_stateless_output(stateless)  # lists leave counter values out
                ctx.set_dry_run(dry_run)
                rc, output, error = ctx.cmd(text)
            finally:
                del ctx  # freed (nft_ctx_free) under the lock, also when a traceback would keep this frame
        if rc != 0:
            raise NftError(refusal(str(error), rc))
        return orjson.loads(output) if output else {}

    def add_timed_elements(self, elements: Sequence[tuple[str, TimedAddress]]) -> None:
        """Put each ``(set, element)`` in its domain set of our table with its timeout, in one
        kernel transaction through netlink (:mod:`.nfnetlink`, never libnftables: a full replace
        that holds libnftables for its render and commit does not stall the DNS hold): ``add``
        (so that it exists), ``delete``, ``add`` with the timeout (an older kernel keeps an
        existing element's timeout on ``add``), each a message for all of a set's elements (one
        acknowledgement each: a message per element would overflow the socket with them);
        raises NetlinkError (nothing added then)."""
        by_set: dict[str, list[TimedAddress]] = {}
        for set_name, element in elements:
            by_set.setdefault(set_name, []).append(element)
        changes: list[tuple[str, str, tuple[Any, ...]]] = []
        for set_name, timed in by_set.items():
            addresses = tuple(element.address for element in timed)
            changes += [("add", set_name, addresses), ("delete", set_name, addresses), ("add", set_name, tuple(timed))]
        if changes:
            self._netlink.commit(self.table, changes)

    def change_elements(self, changes: Sequence[tuple[str, str, tuple[str, ...]]]) -> None:
        """Commit ``(verb, set, addresses)`` changes (verb ``add`` or ``delete``) of address
        sets of our table in one kernel transaction through netlink (:mod:`.nfnetlink`);
        raises NetlinkError (nothing committed then)."""
        self._netlink.commit(self.table, changes)

    def timed_elements(self) -> dict[str, list[TimedAddress]]:
        """The elements of our table's sets with ``flags timeout`` (the domain sets), each with
        the seconds it has left, by set: what an agent before this one learned. Empty when the
        table is absent. Only those sets' elements are read: a terse ``list sets`` names them
        (no element of the table's other sets, which hold every selected pod's address, is
        read; libnftables lists every inet table's sets there, ours are picked out), then one
        ``list set`` each."""
        try:
            listed = self._cmd(nft.list_sets_json(self.table), terse=True)
        except NftError:
            return {}
        timed = [item["set"]["name"] for item in listed.get("nftables", [])
                 if item.get("set", {}).get("table") == self.table and "timeout" in item["set"].get("flags", ())]
        found: dict[str, list[TimedAddress]] = {}
        for name in timed:
            try:
                items = self._cmd(nft.list_set_json(self.table, name)).get("nftables", [])
            except NftError:
                continue  # gone since the first listing (another agent's table replace)
            for body in (item["set"] for item in items if "set" in item):
                found[name] = [TimedAddress(e["elem"]["val"], int(e["elem"].get("expires", 0)))
                               for e in body.get("elem", ()) if isinstance(e, dict) and "elem" in e]
        return found

    def listing(self, terse: bool = False, stateless: bool = True) -> list[Json]:
        """Our table's objects as the kernel lists them (``list table``; empty when absent).

        ``stateless`` (the default) lists counters without their values (``{"counter": null}``,
        as we render them), so a listing compares with a render whatever traffic passed;
        ``terse`` leaves set elements out (the cost is then the rules', not the sets')."""
        try:
            listed = self._cmd(nft.list_json(self.table), terse, stateless)
        except NftError:
            return []
        return [item for item in listed.get("nftables", []) if "metainfo" not in item]

    def counted_rules(self) -> list[Json]:
        """The ``rule`` bodies of our table that hold a counter, with its packets and bytes, as
        the kernel lists them now (a terse list: no set element is read); empty when the table
        is absent."""
        rules = (item["rule"] for item in self.listing(terse=True, stateless=False) if "rule" in item)
        return [r for r in rules if any("counter" in e for e in r.get("expr", ()))]

    def has_table(self) -> bool:
        """True while our table and its FORWARD base chain are there (a cheap look-up)."""
        try:
            self._cmd(nft.list_json(self.table, "KUBE-ROUTER-FORWARD"))
        except (NftError, OSError):
            return False
        return True

    def remove(self) -> bool:
        """Delete ``inet <table>`` if it exists; True if it did. No other table is listed or changed."""
        try:
            self._cmd(nft.list_json(self.table))
        except NftError:
            return False
        self.run(removing(self.table))
        return True

    def missing_features(self) -> list[str]:
        """The features of :data:`FEATURE_PROBES` that this kernel and libnftables refuse, each
        with libnftables' reason. Every probe is a dry run (``nft --check``): nothing is
        committed. All probes go in one batch (one libnftables context, one transaction the
        kernel checks and aborts: about 15 ms, where one context per probe took 0.1-0.7 s); only
        when the kernel refuses it is each probe run alone, to name what is missing."""
        with self._entered():
            if self._refused(list(FEATURE_PROBES.values())) is None:
                return []
            missing = []
            for feature, commands in FEATURE_PROBES.items():
                error = self._refused([commands])
                if error is not None:
                    missing.append(f"{feature}: {error}")
            return missing

    @staticmethod
    def _refused(probes: list[str]) -> str | None:
        """libnftables' first line of refusal of ``probes`` in a dry run in a scratch table (in
        the namespace the caller entered), or None when the kernel accepts them all."""
        batch = "\n".join([f"add table inet {FEATURE_TABLE}", *(p.format(t=FEATURE_TABLE) for p in probes)])
        with LIBNFTABLES:
            ctx = nftables.Nftables()
            try:
                ctx.set_dry_run(True)
                rc, _, error = ctx.cmd(batch)
            finally:
                del ctx
        if rc == 0:
            return None
        return error.strip().splitlines()[0] if error.strip() else str(rc)


class TraceMonitor:
    """libnftables' ``monitor trace`` inside network namespace ``netns_name`` (None: ours), run
    in a child process (context manager) whose output :meth:`lines` reads.

    libnftables 1.0.6 prints trace events as text lines, also with JSON output on:
    ``trace id <id> inet <table> <chain> rule <rule> comment "<comment>" # handle <n> (verdict <verdict>)``
    (handles on),
    ``... policy accept``, ``... packet: <headers>``. The python3-nftables bindings buffer a
    command's output until it ends, which ``monitor`` never does, so the child unbuffers its
    context (libnftables then writes each event to stdout, a pipe to this process, flushed per
    event). The child dies with this process (``PR_SET_PDEATHSIG``) and on :meth:`__exit__`.

    :meth:`__enter__` returns once the child's netfilter netlink socket has joined the trace group
    (``NFNLGRP_NFTRACE``, seen in the ``Groups`` column of ``/proc/<child>/net/netlink``, the
    child's namespace's list): from then on the kernel queues every trace event for it, so a
    packet sent after it is reported whole. Raises NftError when the child ends first or has not
    joined within :data:`MONITOR_START_TIMEOUT` seconds.
    """

    def __init__(self, netns_name: str | None = None) -> None:
        self.netns = netns_name
        self.pid = 0
        self._read = -1
        self._pending = b""

    def __enter__(self) -> "TraceMonitor":
        read, write = os.pipe()
        with LIBNFTABLES:  # no other thread inside libnftables while the child's copy of it is made
            pid = os.fork()
        if pid == 0:  # the child: never returns
            try:
                os.close(read)
                os.dup2(write, 1)
                ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                with netns.entered(self.netns) if self.netns else nullcontext():
                    ctx = nftables.Nftables()
                    ctx.set_handle_output(True)  # every rule event ends in its rule's handle
                    ctypes.CDLL("libnftables.so.1").nft_ctx_unbuffer_output(ctypes.c_void_p(ctx._Nftables__ctx))
                    ctx.cmd("monitor trace")
            finally:
                os._exit(1)
        os.close(write)
        self.pid, self._read = pid, read
        try:
            self._wait_listening()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + MONITOR_START_TIMEOUT
        while not self._listening():
            if os.waitpid(self.pid, os.WNOHANG) != (0, 0):
                self.pid = 0
                os.close(self._read)
                raise NftError("monitor trace ended before it listened")
            if time.monotonic() > deadline:
                raise NftError(f"monitor trace did not listen within {MONITOR_START_TIMEOUT:g} s")
            time.sleep(0.01)

    def _listening(self) -> bool:
        """True once a netfilter netlink socket of the child has joined NFNLGRP_NFTRACE."""
        inodes = set()
        with contextlib.suppress(FileNotFoundError):
            for fd in os.listdir(f"/proc/{self.pid}/fd"):
                with contextlib.suppress(FileNotFoundError):
                    link = os.readlink(f"/proc/{self.pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(int(link[8:-1]))
        try:
            with open(f"/proc/{self.pid}/net/netlink") as table:
                rows = [line.split() for line in table.readlines()[1:]]
        except FileNotFoundError:
            return False
        # columns: sk Eth Pid Groups Rmem Wmem Dump Locks Drops Inode; Groups: bit n-1 is group n
        return any(int(r[1]) == NETLINK_NETFILTER and int(r[3], 16) >> (NFNLGRP_NFTRACE - 1) & 1 and int(r[9]) in inodes
                   for r in rows)

    def lines(self, timeout: float) -> Iterator[str]:
        """The monitor's lines as they come, until ``timeout`` seconds pass without one."""
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                yield line.decode(errors="replace")
            ready, _, _ = select.select([self._read], [], [], timeout)
            chunk = os.read(self._read, 65536) if ready else b""
            if not chunk:
                return
            self._pending += chunk

    def __exit__(self, *exc: object) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            os.close(self._read)
            self.pid = 0
