"""What domainNames learning costs: DNS answer -> committed set element latency at a steady rate of
answers, the added round trip on the DNS path (held vs not held, side by side in one run), the
agent's memory per learned address, and what one pod's flood of large answers does to another
pod's answers.

    .venv/bin/python bench/dns_learn.py [--rate 100] [--seconds 5] [--elements 20000]
                                        [--flood-seconds 10] [--records 250] [--against DIR]

Needs root (network namespaces, nftables, iptables-nft) and dnsmasq (``bash .ci/install --test``).
It builds the bed of ``tests/test_domain_names.py`` (a node namespace with our table rendered from
a ClusterNetworkPolicy with a domainNames peer, a pod namespace, dnsmasq outside) and asks names
of the peer from the pod at ``--rate`` answers per second with dnspython's stub resolver: first
with the hold (every answer waits in the nfqueue until its element is committed), then with the
hold removed (answers pass at once, nothing learned). The latency is the hold's: from the
agent reading the answer to the commit returning (learn plus one libnftables transaction).
Memory per element: ``--elements`` distinct addresses learned in process (tracemalloc).

The flood: a second pod namespace (the flooder) asks a DNS server of its own (outside, a Python
one answering every question with ``--records`` A records) as fast as it can, over UDP from
four sockets, while the pod (the victim) asks a name of the peer every 100 ms for
``--flood-seconds``; once with a flooder that no policy selects (no subject: its answers teach
nothing) and once with a flooder that is a subject asking names the peer matches (each answer
read). In process, the flooder's answer repeated at the meter's 200 a second for 10 s: the
learner's CPU per answer and the elements it gives to commit again. Printed for each: the victim's hold (from the agent reading its answer to releasing it,
p50/p99) and DNS round trip, how many of its answers were held until what they teach was
committed (the others passed unheld: the kernel's queue was full) and how many of its names
the learner knew right after the answer (also from earlier answers), the flooder's answers
answered and read by the agent, and the DNS messages of a non-subject decoded
(``dns.message.from_wire`` called for them). With ``--against DIR`` (a checkout of another
commit, e.g. ``git worktree add /tmp/main main``) the flood runs also with that tree's agent
code and test bed (``PYTHONPATH``, ``DNS_LEARN_TREE``), in its own process, and both are
printed side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import secrets
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

# the checkout whose tests' bed is used (DNS_LEARN_TREE: the --against run's, with its agent code)
sys.path.insert(0, os.environ.get("DNS_LEARN_TREE", str(Path(__file__).resolve().parents[1])))

import dns.message  # noqa: E402
import dns.rrset  # noqa: E402

from nftpolicy.agent.daemon import dnshold, dnslearn  # noqa: E402
from nftpolicy.agent.daemon.dnshold import DnsSegment  # noqa: E402
from nftpolicy.agent.daemon.dnslearn import DomainLearner  # noqa: E402
from nftpolicy.agent.dataplane import netns  # noqa: E402
from nftpolicy.translators.domainnames import DomainSet, domain_sets  # noqa: E402
from nftpolicy.translators.manifests import build_cluster  # noqa: E402
from tests.test_domain_names import NAMESPACE, POD, POD4, POLICY, Bed  # noqa: E402
from checkouts import git_head, shadow  # noqa: E402  (this bench's folder: the script's own)

FLOODER4, FLOOD_SERVER4 = "10.0.3.2", "10.0.2.54"
# The flooder's DNS server: every question answered with the records of argv[2] (hex: flood_records).
FLOOD_SERVER = r"""
import socket, struct, sys
address, answers = sys.argv[1], bytes.fromhex(sys.argv[2])
records = len(answers) // 16
server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
server.bind((address, 53))
while True:
    query, peer = server.recvfrom(4096)
    end = 12
    while query[end]:
        end += query[end] + 1
    server.sendto(query[:2] + b"\x81\x80\x00\x01" + struct.pack(">HHH", records, 0, 0) + query[12:end + 5] + answers, peer)
"""
# The flooder: questions for one name as fast as it can from four sockets, the answers drained.
FLOODER = r"""
import os, socket, sys, threading
import dns.message
server, name = sys.argv[1], sys.argv[2]
query = dns.message.make_query(name, "A").to_wire()
sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(4)]
answered = [0]
def drain(sock):
    while True:
        sock.recv(65535)
        answered[0] += 1
for sock in sockets:
    sock.connect((server, 53))
    threading.Thread(target=drain, args=(sock,), daemon=True).start()
def report():
    sys.stdin.read()
    print(answered[0], flush=True)
    os._exit(0)
threading.Thread(target=report, daemon=True).start()
while True:
    for sock in sockets:
        try:
            sock.send(query)
        except OSError:
            pass
"""


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


def repeated_answer_cost(records: int, seconds: float = 10.0, rate: int = 200) -> dict[str, float]:
    """In process: the flooder's answer (``records`` A records for a name of the peer, the
    learner reading ``--dns-max-records`` of them) repeated ``rate`` times a second for
    ``seconds`` (the rate the kernel's meter lets one pod queue), as a flooder that is a
    subject sends it: the learner's CPU per answer (median) and the elements it gives to commit
    after the first answer (each costs the hold a netlink commit)."""
    wire = flood_answer("flood.cdn.example", records)
    learner = DomainLearner(ttl_floor=5, ttl_cap=3600, max_per_set=10000, max_per_pod=1000)
    learner.update([DomainSet("KUBE-DNS-X", "ipv4", ("*.cdn.example",), frozenset({FLOODER4}), ("p",))])
    learner.learn(FLOODER4, wire, now=0.0)
    spent, again = [], 0
    for i in range(1, int(seconds * rate) + 1):
        began = time.process_time()
        again += len(learner.learn(FLOODER4, wire, now=i / rate))
        spent.append(time.process_time() - began)
    return {"cpu_p50": percentile(spent, 0.5), "again": again, "answers": len(spent)}


def flood_answer(name: str, records: int) -> bytes:
    """The flood server's answer (:data:`FLOOD_SERVER`) to a question for ``name``."""
    query = dns.message.make_query(name, "A").to_wire()
    end = 12
    while query[end]:
        end += query[end] + 1
    return query[:2] + b"\x81\x80\x00\x01" + struct.pack(">HHH", records, 0, 0) + query[12:end + 5] + flood_records(records)


def flood_records(records: int) -> bytes:
    """The flood server's answer section: ``records`` A records (16 bytes each: a pointer to the
    question's name, TTL 300, 10.9.x.y)."""
    return b"".join(b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x01\x2c\x00\x04" + bytes([10, 9, i >> 8 & 255, i & 255]) for i in range(records))


class Watched:
    """Per pod address: how long the hold held each answer (from its read to its verdict, on
    :class:`~nftpolicy.agent.daemon.dnshold.NfQueue` itself, so that any version of the hold is
    measured alike), the hold thread's CPU time over the same span (its own work, other pods'
    answers included: the rest of the span it waited, for a core or the GIL), and how many of its
    answers were read beyond the header (a call of ``dns.message.from_wire`` or
    ``dns.name.from_wire`` inside ``DomainLearner.learn``, or records read by the learner's own
    code: its ``decoded`` count grew)."""

    def __init__(self) -> None:
        self.held: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}
        self.decoded: dict[str, int] = {}
        self._read: dict[int, tuple[str, float, float]] = {}
        self._client = threading.local()

    def install(self) -> None:
        packets, accept, learn = dnshold.NfQueue.packets, dnshold.NfQueue.accept, DomainLearner.learn
        message_from_wire, name_from_wire = dnslearn.dns.message.from_wire, dnslearn.dns.name.from_wire

        def read(queue: Any, *args: Any, **kwargs: Any) -> Any:
            found = packets(queue, *args, **kwargs)
            now, cpu = time.monotonic(), time.thread_time()
            for queued in found:
                segment = dnshold.dns_segment(queued.packet)
                self._read[queued.id] = (segment.client if segment else "", now, cpu)
            return found

        def released(queue: Any, packet_id: int) -> None:
            accept(queue, packet_id)
            client, at, cpu = self._read.pop(packet_id, ("", 0.0, 0.0))
            self.held.setdefault(client, []).append(time.monotonic() - at)
            self.cpu.setdefault(client, []).append(time.thread_time() - cpu)

        def learning(learner: Any, client: str, *args: Any, **kwargs: Any) -> Any:
            self._client.read = False
            before = getattr(learner, "decoded", 0)
            try:
                return learn(learner, client, *args, **kwargs)
            finally:
                if self._client.read or getattr(learner, "decoded", 0) > before:
                    self.decoded[client] = self.decoded.get(client, 0) + 1

        def reading(decode: Callable[..., Any]) -> Callable[..., Any]:
            def read(*args: Any, **kwargs: Any) -> Any:
                self._client.read = True
                return decode(*args, **kwargs)
            return read

        dnshold.NfQueue.packets, dnshold.NfQueue.accept = read, released  # type: ignore[method-assign]
        DomainLearner.learn = learning  # type: ignore[method-assign]
        dnslearn.dns.message.from_wire = reading(message_from_wire)
        dnslearn.dns.name.from_wire = reading(name_from_wire)


def add_flooder(bed: Bed, make: Callable[[], str], records: int, nice: int) -> str:
    """The flooder's namespace (10.0.3.2, routed by the node) and its DNS server (outside, at
    10.0.2.54); the flooder's namespace name."""
    flood = make()
    netns.ip_batch([f"link add vflood netns {bed.node} type veth peer name eth0 netns {flood}"])
    netns.ip_batch(["link set vflood up", "addr add 10.0.3.1/24 dev vflood"], bed.node)
    netns.ip_batch(["link set lo up", "link set eth0 up", f"addr add {FLOODER4}/24 dev eth0", "route add default via 10.0.3.1"], flood)
    netns.ip_batch([f"addr add {FLOOD_SERVER4}/24 dev eth0"], bed.out)
    bed._spawn(bed.out, ["nice", "-n", str(nice), sys.executable, "-c", FLOOD_SERVER, FLOOD_SERVER4, flood_records(records).hex()])
    return flood


def flood_run(bed: Bed, flood: str, watched: Watched, name: str, seconds: float, nice: int) -> dict[str, Any]:
    """The victim asks a name of the peer every 100 ms for ``seconds`` while the flooder asks
    ``name`` of its own server as fast as it can."""
    for values in (watched.held, watched.cpu, watched.decoded):
        values.clear()
    flooder = subprocess.Popen(["ip", "netns", "exec", flood, "nice", "-n", str(nice), sys.executable, "-c", FLOODER, FLOOD_SERVER4, name],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    trips, learned, asked = [], 0, 0
    try:
        time.sleep(1.0)  # the flood under way
        start = time.monotonic()
        while (now := time.monotonic()) < start + seconds:
            asked += 1
            question = f"n{asked % 20}.cdn.example"
            try:
                began = time.monotonic()
                [address] = bed.resolve(question)
                trips.append(time.monotonic() - began)
                learned += bool(bed.learner.why(address, time.monotonic()))
            except Exception:  # noqa: BLE001 - a lost answer counts as not learned
                trips.append(3.0)
            time.sleep(max(0.0, start + asked * 0.1 - time.monotonic()))
        out, _ = flooder.communicate("\n", timeout=10)
    finally:
        if flooder.poll() is None:
            flooder.kill()
            flooder.wait()
    answered = int(out.strip() or 0)
    held, cpu = watched.held.get(POD4, []), watched.cpu.get(POD4, [])
    return {"asked": asked, "learned": learned, "held": len(held), "trip_p50": percentile(trips, 0.5), "trip_p99": percentile(trips, 0.99),
            "hold_p50": percentile(held, 0.5) if held else None, "hold_p99": percentile(held, 0.99) if held else None,
            "cpu_p99": percentile(cpu, 0.99) if cpu else None, "hold_max": max(held) if held else None,
            "flood_answered": answered, "flood_rate": answered / (seconds + 1.0), "flood_read": len(watched.held.get(FLOODER4, [])),
            "flood_decoded": watched.decoded.get(FLOODER4, 0)}


def new_netns(made: list[str]) -> str:
    """A new network namespace of this bench's (``nftp-bench<random>``), appended to ``made``
    (each run deletes what it made, whatever happened)."""
    name = f"nftp-bench{secrets.token_hex(3)}"
    made.append(name)
    netns.create([name])
    return name


def busy(stop: threading.Event) -> None:
    """Python work until ``stop`` (another thread of the agent computing, as a full resync's
    render does: it holds the GIL whenever the hold's thread gives it up)."""
    while not stop.is_set():
        sum(i * i for i in range(1000))


def flood(seconds: float, records: int, nice: int, busy_thread: bool = False) -> dict[str, Any]:
    """The flood part in this process (with whichever agent code it imports); ``busy_thread``:
    with :func:`busy` running meanwhile."""
    made: list[str] = []
    stop = threading.Event()
    make = functools.partial(new_netns, made)

    watched = Watched()
    watched.install()
    found: dict[str, Any] = {}
    bed = None
    try:
        bed = Bed(make, Path(tempfile.mkdtemp()))
        flooder = add_flooder(bed, make, records, nice)
        bed.wait_until_served()
        found["load"] = os.getloadavg()
        if busy_thread:
            threading.Thread(target=busy, args=(stop,), daemon=True).start()
        found["non-subject"] = flood_run(bed, flooder, watched, "flood.example.org", seconds, nice)
        cluster, _ = build_cluster(("bench", obj) for obj in (NAMESPACE, POD, POLICY))  # the bed's
        bed.learner.update([dataclasses.replace(s, clients=s.clients | {FLOODER4}) for s in domain_sets(cluster, ("ipv4", "ipv6"))])
        if hasattr(bed.dataplane, "change_elements"):  # and in the hold's set of subjects, as the agent's sync puts it
            bed.dataplane.change_elements([("add", "KUBE-DNS-SUBJECTS4", (FLOODER4,))])
        found["subject"] = flood_run(bed, flooder, watched, "flood.cdn.example", seconds, nice)
        found["load_after"] = os.getloadavg()
        found["repeat"] = repeated_answer_cost(records)
    finally:
        stop.set()
        if bed is not None:
            bed.close()
        netns.delete(made)
    return found


def print_flood(results: dict[str, dict[str, Any]], seconds: float, records: int, nice: int, busy_thread: bool) -> None:
    """The flood's figures, one column per tree."""
    trees = list(results)
    print(f"flood: {records}-record UDP answers to a flooder at its maximum rate (nice {nice}), the victim asking every 100 ms "
          f"for {seconds:g} s{', a thread of Python work beside the hold' if busy_thread else ''}")
    for tree in trees:
        load = results[tree]["load"]
        print(f"  {tree}: load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at its start")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.2f} ms"

    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("victim hold p50", lambda r: ms(r["hold_p50"])), ("victim hold p99", lambda r: ms(r["hold_p99"])),
        ("victim hold max", lambda r: ms(r["hold_max"])), ("hold thread CPU in it, p99", lambda r: ms(r["cpu_p99"])),
        ("victim DNS round trip p50", lambda r: ms(r["trip_p50"])), ("victim DNS round trip p99", lambda r: ms(r["trip_p99"])),
        ("victim answers held till committed", lambda r: f"{r['held']}/{r['asked']}"),
        ("victim names known after", lambda r: f"{r['learned']}/{r['asked']}"),
        ("flooder answers answered", lambda r: f"{r['flood_answered']} ({r['flood_rate']:.0f}/s)"),
        ("flooder answers read by the agent", lambda r: str(r["flood_read"])),
        ("flooder answers decoded (beyond header)", lambda r: str(r["flood_decoded"]))]
    print("the flooder's answer repeated at 200/s for 10 s, in process (learn only, no commit):")
    print("  " + " " * 36 + "".join(f"{tree:>22}" for tree in trees))
    print(f"  {'learner CPU per answer, p50':<36}" + "".join(f"{results[t]['repeat']['cpu_p50'] * 1000:>19.3f} ms" for t in trees))
    print(f"  {'elements committed again':<36}" + "".join(f"{results[t]['repeat']['again']:>22}" for t in trees))
    for variant in ("non-subject", "subject"):
        print(f"flooder {'that no policy selects' if variant == 'non-subject' else 'that is a subject, asking a name of the peer'}:")
        print("  " + " " * 36 + "".join(f"{tree:>22}" for tree in trees))
        for label, value in rows:
            print(f"  {label:<36}" + "".join(f"{value(results[tree][variant]):>22}" for tree in trees))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=100.0, help="answers per second (default %(default)s)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds of answers per variant (default %(default)s)")
    ap.add_argument("--elements", type=int, default=20000, help="addresses for the memory figure (default %(default)s)")
    ap.add_argument("--flood-seconds", type=float, default=10.0, help="seconds of each flood (0: none; default %(default)s)")
    ap.add_argument("--records", type=int, default=250, help="A records of each flood answer (default %(default)s)")
    ap.add_argument("--nice", type=int, default=0, help="niceness of the flooder and its server (a pod's CPU share; default %(default)s)")
    ap.add_argument("--busy", action="store_true", help="a thread of Python work in the hold's process during the floods")
    ap.add_argument("--against", metavar="DIR", help="also flood with the agent code of the checkout DIR (side by side)")
    ap.add_argument("--flood-only-json", action="store_true", help=argparse.SUPPRESS)  # one tree's flood, for --against
    args = ap.parse_args()
    if args.flood_only_json:
        print(json.dumps(flood(args.flood_seconds, args.records, args.nice, args.busy)))
        return 0
    made: list[str] = []
    make = functools.partial(new_netns, made)

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
    if args.flood_seconds > 0:
        results = {}
        trees = ([("other", args.against)] if args.against else []) + [("this", None)]
        for label, tree in trees:
            env = dict(os.environ, PYTHONPATH=str(shadow(tree)), DNS_LEARN_TREE=str(Path(tree).resolve())) if tree else None
            proc = subprocess.run([sys.executable, __file__, "--flood-only-json", "--flood-seconds", str(args.flood_seconds),
                                   "--records", str(args.records), "--nice", str(args.nice), *(["--busy"] if args.busy else [])],
                                  capture_output=True, text=True, env=env,
                                  timeout=600)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            results[f"{label} ({git_head(tree)})"] = json.loads(proc.stdout.splitlines()[-1])
        print_flood(results, args.flood_seconds, args.records, args.nice, args.busy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
