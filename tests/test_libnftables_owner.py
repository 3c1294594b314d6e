"""One owner for libnftables (agent/dataplane/nftables.py, LIBNFTABLES): libnftables 1.0.6 is
not thread-safe (``strtok()`` in ``set_dtype_json``: concurrent listings abort the process), so
every call of the process holds one lock. Checked with a recording stand-in for the bindings on
every path of the dataplane, and with the real libnftables in a namespace this test made: every
kind of call the agent makes, from several threads at once (``bench/libnftables_threads.py``,
whose longer run is in docs/benchmarks.md), every answer whole and the process alive."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nftpolicy.agent.dataplane import nftables as dataplane_module
from nftpolicy.agent.dataplane.nftables import LIBNFTABLES, NftDataplane
from nftpolicy.translators.rules import AddressSet, TimedAddress
from nftpolicy.translators.transaction import Elements, Transaction, replacing
from nftpolicy.translators import layout

from .conftest import nft

BENCH = Path(__file__).resolve().parent.parent / "bench" / "libnftables_threads.py"


def _held() -> bool:
    """True while some thread holds the owner's lock (tried from a thread of its own)."""
    found: list[bool] = []

    def probe() -> None:
        got = LIBNFTABLES.acquire(blocking=False)
        if got:
            LIBNFTABLES.release()
        found.append(not got)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return found[0]


class _Recording:
    """A stand-in for ``nftables.Nftables`` that records whether the owner's lock was held at
    each step of a context's life (made, set up, command, freed) and answers as libnftables does."""

    held: list[tuple[str, bool]] = []

    def __init__(self) -> None:
        self.held.append(("make", _held()))

    def __getattr__(self, name: str):
        if not name.startswith("set_"):
            raise AttributeError(name)
        return lambda value: self.held.append((name, _held()))

    def cmd(self, text: str) -> tuple[int, str, str]:
        self.held.append(("cmd", _held()))
        return 0, '{"nftables": [{"metainfo": {}}, {"chain": {"family": "inet", "table": "t", "name": "KUBE-ROUTER-FORWARD"}}]}', ""

    def __del__(self) -> None:
        self.held.append(("free", _held()))


@pytest.mark.parametrize("call", ["replace", "delta", "dry run", "listing", "counted rules", "has table",
                                  "timed sets", "remove", "feature probe"])
def test_every_call_holds_the_owner_lock_from_making_its_context_to_freeing_it(monkeypatch, call):
    monkeypatch.setattr(dataplane_module.nftables, "Nftables", _Recording)
    monkeypatch.setattr(_Recording, "held", [])
    dataplane = NftDataplane("t")
    delta = Transaction("t", 0)
    delta.add(Elements("KUBE-PODS-X", ("10.0.0.1",)))
    {"replace": lambda: dataplane.run(replacing(layout.Table("t", 0, (), (), ()))),
     "delta": lambda: dataplane.run(delta),
     "dry run": lambda: dataplane.check(replacing(layout.Table("t", 0, (), (), ()))),
     "listing": dataplane.listing, "counted rules": dataplane.counted_rules, "has table": dataplane.has_table,
     "timed sets": dataplane.timed_elements, "remove": dataplane.remove, "feature probe": dataplane.missing_features}[call]()
    del dataplane, delta
    gc.collect()  # the kept contexts go with their dataplane (a cycle: its bound method)
    steps = _Recording.held
    assert [s for s, _ in steps].count("make") == [s for s, _ in steps].count("free") >= 1 and "cmd" in [s for s, _ in steps]
    assert [s for s, held in steps if not held] == [], steps
    assert not _held()  # and nothing kept it


@pytest.mark.kernel
def test_an_element_only_commit_needs_neither_libnftables_nor_its_lock(make_netns, monkeypatch):
    """An incremental sync's element-only commit, and the DNS hold's timed elements, go through
    nf_tables netlink (agent/dataplane/nfnetlink.py): they commit while another thread holds the
    owner's lock (a counters' listing, a full replace), and make no libnftables context. The
    kernel orders them with libnftables' transactions (one commit mutex per namespace)."""
    ns = make_netns()
    dataplane = NftDataplane("t", ns)
    pods = AddressSet("KUBE-PODS-X", "ipv4", "addr", ("10.0.0.1",), "pods")
    learned = AddressSet("KUBE-DNS-X", "ipv4", "domain", (), "DNS")
    dataplane.run(replacing(layout.Table("t", 0, (pods, learned), (), ())))
    monkeypatch.setattr(dataplane_module.nftables, "Nftables", _Recording)
    monkeypatch.setattr(_Recording, "held", [])
    holding, release = threading.Event(), threading.Event()

    def listing() -> None:
        with LIBNFTABLES:
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=listing)
    holder.start()
    try:
        holding.wait(5)
        delta = Transaction("t", 0)
        delta.add(Elements("KUBE-PODS-X", ("10.0.0.2",)))
        dataplane.run(delta)  # returns while the lock is held elsewhere
        dataplane.add_timed_elements([("KUBE-DNS-X", TimedAddress("192.0.2.1", 50))])
        dataplane.add_timed_elements([("KUBE-DNS-X", TimedAddress("192.0.2.1", 300))])  # a later answer moves it later
        assert _Recording.held == []  # no libnftables context was made
    finally:
        release.set()
        holder.join()
    assert "10.0.0.2" in nft(ns, "list", "set", "inet", "t", "KUBE-PODS-X")
    assert "192.0.2.1 timeout 5m" in nft(ns, "list", "set", "inet", "t", "KUBE-DNS-X")


@pytest.mark.kernel
def test_every_kind_of_call_from_many_threads_at_once_answers_whole(make_netns):
    """Commits (full replace, incremental, the DNS hold's), whole and terse listings, rule
    counter reads, look-ups and the feature probe, three threads each for 12 s: the process
    lives (without the owner libnftables 1.0.6 aborted it within seconds) and every answer
    parsed and held the table."""
    ns = make_netns()
    proc = subprocess.run([sys.executable, str(BENCH), "--netns", ns, "--seconds", "12", "--threads", "3", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kinds = json.loads(proc.stdout)
    assert set(kinds) == {"replace", "check", "elements", "delta", "timed", "listing", "terse", "counters", "has_table", "timed_elements",
                          "probe"}
    assert {kind: (f["bad"], f["first_bad"]) for kind, f in kinds.items() if f["bad"]} == {}
    assert all(f["good"] >= 10 for f in kinds.values()), kinds
