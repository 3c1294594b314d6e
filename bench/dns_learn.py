"""What domainNames learning costs: DNS answer -> committed set element latency at a steady rate of
answers, the added round trip on the DNS path (held vs not held, side by side in one run), and the
agent's memory per learned address.

    .venv/bin/python bench/dns_learn.py [--rate 100] [--seconds 5] [--elements 20000]

Needs root (network namespaces, nftables, iptables-nft) and dnsmasq (``bash .ci/install --test``).
It builds the bed of ``tests/test_domain_names.py`` (a node namespace with our table rendered from
a ClusterNetworkPolicy with a domainNames peer, a pod namespace, dnsmasq outside) and asks names
of the peer from the pod at ``--rate`` answers per second with dnspython's stub resolver: first
with the hold (every answer waits in the nfqueue until its element is committed), then with the
hold removed (answers pass at once, nothing learned). The latency is the hold's: from the
agent reading the answer to the commit returning (learn plus one libnftables transaction).
Memory per element: ``--elements`` distinct addresses learned in process (tracemalloc).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dns.message  # noqa: E402
import dns.rrset  # noqa: E402

from nftpolicy.agent.daemon.dnshold import DnsSegment  # noqa: E402
from nftpolicy.agent.daemon.dnslearn import DomainLearner  # noqa: E402
from nftpolicy.agent.dataplane import netns  # noqa: E402
from nftpolicy.translators.domainnames import DomainSet  # noqa: E402
from tests.test_domain_names import Bed  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ask(bed: Bed, rate: float, seconds: float) -> list[float]:
    """Round trips (seconds) of ``rate * seconds`` questions, paced at ``rate`` per second."""
    trips, interval, start = [], 1.0 / rate, time.monotonic()
    for i in range(int(rate * seconds)):
        due = start + i * interval
        if (wait := due - time.monotonic()) > 0:
            time.sleep(wait)
        began = time.monotonic()
        bed.resolve(f"n{i % 20}.cdn.example")
        trips.append(time.monotonic() - began)
    return trips


def memory_per_element(count: int) -> float:
    """Bytes the learner holds per learned address, over ``count`` distinct addresses."""
    learner = DomainLearner(ttl_floor=5, ttl_cap=3600, max_per_set=count, max_per_pod=count)
    learner.update([DomainSet("KUBE-DNS-X", "ipv4", ("*.example",), frozenset({"10.0.0.1"}), ("p",))])
    answers = []
    for i in range(count):
        response = dns.message.make_response(dns.message.make_query(f"h{i}.example", "A"))
        response.answer.append(dns.rrset.from_text(f"h{i}.example.", 300, "IN", "A", f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"))
        answers.append(response.to_wire())
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for wire in answers:
        learner.learn("10.0.0.1", wire, now=0)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert learner.size() == count
    return (after - before) / count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=100.0, help="answers per second (default %(default)s)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds of answers per variant (default %(default)s)")
    ap.add_argument("--elements", type=int, default=20000, help="addresses for the memory figure (default %(default)s)")
    args = ap.parse_args()
    made: list[str] = []

    def make() -> str:
        name = f"nftp-bench{secrets.token_hex(3)}"
        made.append(name)
        netns.create([name])
        return name

    holds: list[float] = []
    bed = None
    try:
        bed = Bed(make, Path(tempfile.mkdtemp()))
        bed.wait_until_served()
        commit = bed._commit

        def timed(segment: DnsSegment) -> None:
            began = time.monotonic()
            commit(segment)
            holds.append(time.monotonic() - began)

        assert bed.hold is not None
        bed.hold.commit = timed
        load = os.getloadavg()
        held = ask(bed, args.rate, args.seconds)
        bed.hold.close()
        bed.hold = None
        unheld = ask(bed, args.rate, args.seconds)
    finally:
        if bed is not None:
            bed.close()
        netns.delete(made)
    per_element = memory_per_element(args.elements)
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (2 cores shared: figures are noisy)")
    print(f"answer -> committed element at {args.rate:g}/s: {len(holds)} answers, "
          f"p50 {percentile(holds, 0.5) * 1000:.2f} ms, p99 {percentile(holds, 0.99) * 1000:.2f} ms")
    p50h, p99h, p50u, p99u = (percentile(v, q) * 1000 for v in (held, unheld) for q in (0.5, 0.99))
    print(f"DNS round trip held:   p50 {p50h:.2f} ms, p99 {p99h:.2f} ms")
    print(f"DNS round trip unheld: p50 {p50u:.2f} ms, p99 {p99u:.2f} ms")
    print(f"added by the hold: p50 {p50h - p50u:+.2f} ms ({p50h / p50u:.2f}x), p99 {p99h - p99u:+.2f} ms ({p99h / p99u:.2f}x)")
    print(f"agent memory per learned address: {per_element:.0f} bytes ({args.elements} addresses)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
