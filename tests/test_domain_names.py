"""domainNames with real parts: a real DNS server (dnsmasq) in a namespace outside the node, the
node's namespace with our table (rendered from a ClusterNetworkPolicy) and the hold of DNS
answers (agent/daemon/dnshold.py: xt NFQUEUE through iptables-nft, this kernel has no nft
queue), a pod namespace that resolves with a real resolver client (dnspython's stub resolver,
over the wire) and connects for real.

Each test takes a few seconds: TTLs are short, waits are polls."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml
import dns.exception
import dns.message
import dns.rrset
import dns.resolver
import pytest
from nftpolicy.agent.daemon.dnshold import HOLD_CHAIN, SWITCH_INTERVAL, DnsHold, DnsSegment, hold_rules
from nftpolicy.agent.daemon.dnslearn import DomainLearner
from nftpolicy.agent.daemon.domainlearning import DomainLearning
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.rulecounters import tally
from nftpolicy.agent.dataplane import iptables as xt
from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.dataplane.nftables import NftDataplane
from nftpolicy.translators import layout, transaction
from nftpolicy.translators.domainnames import domain_sets, hold_subjects, with_hold_marks
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import TimedAddress

from nftpolicy.agent.testbed.controlplane import free_port

from .conftest import eventually, http_get, netns_factory, nft, tcp_connects

pytestmark = [pytest.mark.kernel, pytest.mark.tools("dnsmasq", "iptables-nft")]

POD4, POD6 = "10.0.1.5", "fd00:1::5"
HOLD_MARK = 0x800000  # the agent's default --dns-hold-mark
DNS4, DNS6 = "10.0.2.53", "fd00:2::53"
PORT = 8080
HOSTS = {  # name -> (IPv4, IPv6 or None, TTL seconds)
    "api.partner.example": ("10.0.2.10", "fd00:2::10", 60),
    "other.example": ("10.0.2.11", None, 60),
    "a.b.cdn.example": ("10.0.2.20", None, 60),
    "cdn.example": ("10.0.2.21", None, 60),
    "edge.cdnhost.net": ("10.0.2.30", None, 60),
    "brief.partner.example": ("10.0.2.40", None, 2),
    "first.cdn.example": ("10.0.2.50", None, 60),
    "moving.cdn.example": ("10.0.2.60", None, 2),
    "zero.cdn.example": ("10.0.2.90", None, 0),
    **{f"n{i}.cdn.example": (f"10.0.2.{100 + i}", None, 60) for i in range(20)},
    "far.cdn.example": ("10.0.2.130", None, 60),  # asked by a pod no policy selects
    "near.cdn.example": ("10.0.2.131", None, 60),
    "burst.cdn.example": ("10.0.2.132", None, 60),
    "tcp.cdn.example": ("10.0.2.133", None, 60),
    "poison.cdn.example": ("10.0.2.134", None, 60),  # a rogue server (ROGUE) answers 10.0.2.80
    "service.cdn.example": ("10.0.2.135", None, 60),
}
ROGUE = "10.0.1.1"  # a DNS server of the pod's choosing that its policy lets it ask (the node's address, as a node-local cache)
SERVICE_IP = "10.96.0.10"  # the cluster DNS Service's address: DNAT to DNS4 in the node
TRUSTED = (f"{DNS4}/32", f"{DNS6}/128", f"{SERVICE_IP}/32")  # --dns-learn-from
CNAMES = {"www.partner.example": "edge.cdnhost.net"}
NFTPOLICY = str(Path(sys.executable).parent / "nftpolicy")
OUTSIDE = [v4 for v4, _, _ in HOSTS.values()] + [v6 for _, v6, _ in HOSTS.values() if v6] + ["10.0.2.61", "10.0.2.70", "10.0.2.80"]  # where moving.cdn.example moves; local.cdn.example; a forged answer's

NAMESPACE = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop", "labels": {"kubernetes.io/metadata.name": "shop"}}}
POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "client", "namespace": "shop", "labels": {"app": "client"}},
       "spec": {"nodeName": "node-1"}, "status": {"phase": "Running", "podIP": POD4, "podIPs": [{"ip": POD4}, {"ip": POD6}]}}
POLICY = {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": "partner"},
          "spec": {"tier": "Admin", "priority": 1, "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "shop"}}},
                   "egress": [
                       {"name": "partner", "action": "Accept",
                        "to": [{"domainNames": ["api.partner.example", "www.partner.example", "brief.partner.example", "*.cdn.example"]}],
                        "protocols": [{"tcp": {"destinationPort": {"number": PORT}}}]},
                       {"name": "dns", "action": "Accept", "to": [{"networks": [f"{DNS4}/32", f"{DNS6}/128", "10.0.1.1/32"]}]},
                       {"name": "rest", "action": "Deny", "to": [{"networks": ["0.0.0.0/0", "::/0"]}]}]}}

SERVER = """
import socket, sys, threading
def serve(family, address):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((address, int(sys.argv[1]))); s.listen(128)
    while True:
        c, _ = s.accept(); c.close()
threading.Thread(target=serve, args=(socket.AF_INET6, "::"), daemon=True).start()
serve(socket.AF_INET, "0.0.0.0")
"""


class Bed:
    """The three namespaces, dnsmasq, the listeners, our table, the learner and the hold."""

    def __init__(self, make_netns, tmp_path: Path, agent: bool = False, learn_from: tuple[str, ...] | None = None) -> None:
        self.node, self.pod, self.out = make_netns(), make_netns(), make_netns()
        self.learn_from = learn_from
        self.procs: list[subprocess.Popen[bytes]] = []
        netns.ip_batch([f"link add vpod netns {self.node} type veth peer name eth0 netns {self.pod}",
                        f"link add vout netns {self.node} type veth peer name eth0 netns {self.out}"])
        netns.ip_batch(["link set lo up", "link set vpod up", "link set vout up",
                        "addr add 10.0.1.1/24 dev vpod", "addr add fd00:1::1/64 dev vpod nodad",
                        "addr add 10.0.2.1/24 dev vout", "addr add fd00:2::1/64 dev vout nodad"], self.node)
        netns.ip_batch(["link set lo up", "link set eth0 up", f"addr add {POD4}/24 dev eth0", f"addr add {POD6}/64 dev eth0 nodad",
                        "route add default via 10.0.1.1", "route add default via fd00:1::1"], self.pod)
        netns.ip_batch(["link set lo up", "link set eth0 up", f"addr add {DNS4}/24 dev eth0", f"addr add {DNS6}/64 dev eth0 nodad",
                        "route add default via 10.0.2.1", "route add default via fd00:2::1"]
                       + [f"addr add {a}/{'64' if ':' in a else '24'} dev eth0{' nodad' if ':' in a else ''}" for a in OUTSIDE], self.out)
        netns.write_sysctl(self.node, "net.ipv4.ip_forward", "1")
        netns.write_sysctl(self.node, "net.ipv6.conf.all.forwarding", "1")
        self.dns_pid_file = tmp_path / "dnsmasq.pid"
        self.start_dns(HOSTS)
        self._spawn(self.out, [sys.executable, "-c", SERVER, str(PORT)])
        self.hold: DnsHold | None = None
        if agent:  # the agent itself, from a manifests directory, resyncing the whole table every second
            (tmp_path / "manifests").mkdir()
            (tmp_path / "manifests" / "cluster.yaml").write_text(yaml.safe_dump_all([NAMESPACE, POD, POLICY]))
            self.http, self.debug = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            self.tmp = tmp_path
            self.start_agent()
        else:  # the parts, in this process
            cluster, errors = build_cluster(("test", obj) for obj in (NAMESPACE, POD, POLICY))
            assert not errors
            self.dataplane = NftDataplane("nftpolicy", self.node)
            sets = domain_sets(cluster, ("ipv4", "ipv6"))
            table = layout.table(build_rule_model(cluster, "node-1"))
            self.dataplane.run(transaction.replacing(with_hold_marks(table, hold_subjects(sets), HOLD_MARK, 200, 32, learn_from)))
            self.learner = DomainLearner(ttl_floor=1, ttl_cap=3600, max_per_set=1000, max_per_pod=1000)
            self.learner.update(sets)
            self.hold = DnsHold(self._commit, netns_name=self.node, mark=HOLD_MARK)
            self.hold.start()
        self.resolver = dns.resolver.Resolver(configure=False)
        self.resolver.nameservers, self.resolver.lifetime, self.resolver.cache = [DNS4], 3.0, None

    def start_dns(self, hosts: dict[str, tuple[str, str | None, int]]) -> None:
        """dnsmasq serving ``hosts`` (and :data:`CNAMES`); :attr:`dns` is its process."""
        records = [f"--host-record={name},{v4}{',' + v6 if v6 else ''},{ttl}" for name, (v4, v6, ttl) in hosts.items()]
        records += [f"--cname={alias},{target},60" for alias, target in CNAMES.items()]
        self._spawn(self.out, ["dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts", "--user=root", "--bind-interfaces",
                               f"--listen-address={DNS4},{DNS6}", "--except-interface=lo", f"--pid-file={self.dns_pid_file}",
                               "--cache-size=0", *records])
        self.dns = self.procs[-1]

    def restart_dns(self, hosts: dict[str, tuple[str, str | None, int]]) -> None:
        """dnsmasq again, serving ``hosts``."""
        self.dns.terminate()
        self.dns.wait(timeout=10)
        self.procs.remove(self.dns)
        self.start_dns(hosts)
        self.wait_until_served()

    def start_agent(self) -> None:
        """Start the agent and wait until its hold is in place (it says so once all of its rules
        are: a restarted agent removes the chain of the one before and makes it anew)."""
        runs = len(list(self.tmp.glob("agent*.log")))
        self._spawn(None, [NFTPOLICY, "agent", "--netns", self.node, "--manifests", str(self.tmp / "manifests"), "--node", "node-1",
                           "--http-address", self.http, "--debug-address", self.debug, "--resync-interval", "1", "--dns-ttl-floor", "1",
                           f"--dns-learn-from={','.join(self.learn_from or ('any',))}"],
                    log=self.tmp / f"agent{runs}.log")
        self.agent = self.procs[-1]
        eventually(lambda: "holding DNS answers" in (self.tmp / f"agent{runs}.log").read_text(), timeout=30)  # logged once in place

    def _spawn(self, ns: str | None, argv: list[str], log: Path | None = None) -> None:
        out = open(log, "wb") if log else subprocess.DEVNULL
        self.procs.append(subprocess.Popen((["ip", "netns", "exec", ns] if ns else []) + argv, stdout=out, stderr=out))

    def _commit(self, segment: DnsSegment) -> None:
        learned = self.learner.learn(segment.client, segment.payload, time.monotonic(), segment.tcp)
        self.dataplane.add_timed_elements([(x.set_name, TimedAddress(x.address, x.timeout)) for x in learned])

    def resolve(self, name: str, rtype: str = "A", tcp: bool = False) -> list[str]:
        """``name``'s addresses, asked from the pod's namespace."""
        with netns.entered(self.pod):
            answer = self.resolver.resolve(name, rtype, tcp=tcp, raise_on_no_answer=False)
        return [r.address for r in answer.rrset] if answer.rrset is not None else []

    def connects(self, address: str) -> bool:
        """True when a TCP connection from the pod to ``address``:8080 is accepted."""
        return tcp_connects(self.pod, address, PORT, 2)

    def wait_until_served(self) -> None:
        """Until dnsmasq answers the pod and the listeners accept (from the node)."""
        deadline = time.monotonic() + 10
        while True:
            try:
                self.resolve("other.example")
                with netns.entered(self.node):
                    for address in ("10.0.2.11", "fd00:2::10"):
                        socket.create_connection((address, PORT), timeout=1).close()
                return
            except (dns.exception.DNSException, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        if self.hold is not None:
            self.hold.close()
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def module_netns():
    """:func:`conftest.make_netns` for a module: the namespaces go after its last test."""
    with netns_factory("dns") as make:
        yield make


@pytest.fixture(scope="module")
def bed(module_netns, tmp_path_factory):
    """One bed for the module's tests (each asks names no other test asks, but for the one
    whose TTL it lets expire)."""
    made = Bed(module_netns, tmp_path_factory.mktemp("dns"))
    try:
        made.wait_until_served()
        yield made
    finally:
        made.close()


def test_a_resolved_name_is_reachable_at_once_and_others_and_raw_addresses_are_not(bed):
    assert not bed.connects("10.0.2.50")  # not asked yet: only an address
    [address] = bed.resolve("first.cdn.example")
    assert bed.connects(address)
    [other] = bed.resolve("other.example")
    assert not bed.connects(other)
    assert not bed.connects("10.0.2.21")  # raw address never answered for a policy name
    assert bed.learner.why(address, time.monotonic()) and bed.learner.counts["ignored"] >= 1


def test_the_first_connection_after_each_answer_is_accepted(bed):
    assert sys.getswitchinterval() <= SWITCH_INTERVAL  # the hold's thread gets the GIL back soon after each system call
    for i in range(20):  # every name a new address: each connection right after its answer
        [address] = bed.resolve(f"n{i}.cdn.example")
        assert bed.connects(address), f"n{i}.cdn.example ({address}) refused right after its answer"


def test_wildcard_depth_cname_ipv6_and_tcp(bed):
    [deep] = bed.resolve("a.b.cdn.example")
    assert bed.connects(deep)
    [apex] = bed.resolve("cdn.example")  # '*.cdn.example' matches subdomains only
    assert not bed.connects(apex)
    [edge] = bed.resolve("www.partner.example")  # CNAME to edge.cdnhost.net
    assert bed.connects(edge)
    [v6] = bed.resolve("api.partner.example", "AAAA")
    assert bed.connects(v6)
    [v4] = bed.resolve("api.partner.example", tcp=True)
    assert bed.connects(v4)


def test_the_hold_skips_no_rule_of_the_nodes_own_iptables_filter_chains(bed):
    """An operator's (or a CNI's, kube-proxy's) iptables-nft rule in filter FORWARD still sees the
    DNS answers: the queue's verdict ends the chain it is queued from, so it must not be one
    of theirs."""
    rule = ["FORWARD", "-p", "udp", "--sport", "53", "-d", f"{POD4}/32", "-m", "comment", "--comment", "operator"]
    xt.run(bed.node, ["iptables-nft", "-w", "-t", "filter", "-A", *rule])
    try:
        bed.resolve("n8.cdn.example")
        counted = [line.split()[0] for line in xt.run(bed.node, ["iptables-nft", "-w", "-t", "filter", "-L", "FORWARD", "-v", "-x", "-n"]).splitlines()
                   if "operator" in line]
        assert counted == ["1"]
    finally:
        xt.run(bed.node, ["iptables-nft", "-w", "-t", "filter", "-D", *rule])


def test_an_answer_with_ttl_0_is_learned_for_the_floor(bed):
    """TTL 0 (do not cache): the pod connects right after its answer; the element lives for
    --dns-ttl-floor (1 s here)."""
    [address] = bed.resolve("zero.cdn.example")
    assert bed.connects(address)
    time.sleep(1.2)
    assert not bed.connects(address)


def test_answers_over_ipv6_are_held_and_learned(bed):
    """The DNS server asked over IPv6 (ip6tables-nft's hold chain, the reply of the pod's flow)."""
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers, resolver.lifetime, resolver.cache = [DNS6], 3.0, None
    with netns.entered(bed.pod):
        [address] = [r.address for r in resolver.resolve("n6.cdn.example", "A").rrset]
        [v6] = [r.address for r in resolver.resolve("api.partner.example", "AAAA", tcp=True).rrset]
    assert bed.connects(address) and bed.connects(v6)


def test_a_lookup_over_tcp_counts_no_malformed_message(bed):
    """The server's SYN-ACK, ACKs and FIN are held too (TCP from port 53): they carry no message."""
    before = bed.learner.counts["malformed"]
    [address] = bed.resolve("n4.cdn.example", tcp=True)
    assert bed.connects(address)
    assert bed.learner.counts["malformed"] == before


def test_a_record_that_changes_address(bed):
    [old] = bed.resolve("moving.cdn.example")  # TTL 2 s
    assert bed.connects(old)
    bed.restart_dns({**HOSTS, "moving.cdn.example": ("10.0.2.61", None, 2)})
    [new] = bed.resolve("moving.cdn.example")
    assert new != old and bed.connects(new)
    time.sleep(2.5)
    assert not bed.connects(old) and not bed.connects(new)  # both records expired; nobody asked again


def test_answers_from_a_dns_server_on_the_node_itself_are_held(bed, tmp_path):
    """A DNS server on the node's own network (a node-local cache): its answers leave through
    OUTPUT, not FORWARD."""
    bed._spawn(bed.node, ["dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts", "--user=root", "--bind-interfaces",
                          "--listen-address=10.0.1.1", "--except-interface=lo", f"--pid-file={tmp_path}/node-dnsmasq.pid",
                          "--cache-size=0", "--host-record=local.cdn.example,10.0.2.70,60"])
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers, resolver.lifetime, resolver.cache = ["10.0.1.1"], 1.0, None
    deadline = time.monotonic() + 10
    while True:
        try:
            with netns.entered(bed.pod):
                [address] = [r.address for r in resolver.resolve("local.cdn.example", "A").rrset]
            break
        except dns.exception.DNSException:
            assert time.monotonic() < deadline, "the node's dnsmasq does not answer"
    assert bed.connects(address)


def test_an_address_expires_with_its_record(bed):
    [address] = bed.resolve("brief.partner.example")  # TTL 2 s
    assert bed.connects(address)
    time.sleep(2.5)
    assert not bed.connects(address)
    bed.resolve("brief.partner.example")
    assert bed.connects(address)


def test_an_answer_the_pod_did_not_ask_for_teaches_nothing(bed):
    """A DNS response sent from port 53 of any host to a subject pod, not as the reply to a query
    the pod sent (no conntrack flow from the pod): learning it would let anyone who can send the
    pod a packet open its egress to any address."""
    forged = dns.message.make_response(dns.message.make_query("n19.cdn.example", "A"))
    forged.answer.append(dns.rrset.from_text("n19.cdn.example.", 60, "IN", "A", "10.0.2.80"))
    with netns.entered(bed.out):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind(("10.0.2.11", 53))
        for port in (33333, 53):
            s.sendto(forged.to_wire(), (POD4, port))
    finally:
        s.close()
    [address] = bed.resolve("n1.cdn.example")  # a real answer after the forged ones: they were read by now
    assert bed.connects(address)
    assert not bed.learner.why("10.0.2.80", time.monotonic())
    assert not bed.connects("10.0.2.80")


def test_a_burst_of_answers_while_the_agent_is_slow_neither_stops_the_hold_nor_drops_answers(bed):
    """More answers at once than the queue's socket holds (its buffer cut to what a node with
    the kernel's default net.core.rmem_max gives, the reader busy in a slow commit): in bypass
    mode the overflow passes unheld, and the hold goes on reading (ENOBUFS is no stop)."""
    hold = bed.hold
    assert hold is not None and hold._queue is not None
    hold._queue.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 15)
    with netns.entered(bed.pod):
        pod = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    pod.settimeout(3)
    pod.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)  # the pod's own buffer holds the whole burst
    query = dns.message.make_query("other.example", "A")
    pod.sendto(query.to_wire(), (DNS4, 53))  # the flow the burst replies in
    pod.recv(4096)
    port = pod.getsockname()[1]
    answer = dns.message.make_response(query).to_wire()
    udp = (53).to_bytes(2, "big") + port.to_bytes(2, "big") + (8 + len(answer)).to_bytes(2, "big") + b"\0\0" + answer
    commit = hold.commit

    def slow(segment: DnsSegment) -> None:
        hold.commit = commit
        time.sleep(0.5)
        commit(segment)

    hold.commit = slow
    with netns.entered(bed.out):
        raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
    try:
        raw.bind((DNS4, 0))
        sent = 2000
        for _ in range(sent):
            raw.sendto(udp, (POD4, 0))
        received = 0
        with contextlib.suppress(TimeoutError):
            while received < sent:
                pod.recv(4096)
                received += 1
    finally:
        raw.close()
        pod.close()
        hold.commit = commit
    assert received == sent
    [address] = bed.resolve("n2.cdn.example")
    assert bed.connects(address)


def test_cleanup_removes_the_hold_chain_a_stopped_agent_left_and_makes_nothing_where_there_was_none(make_netns):
    """An agent's shutdown leaves the chain (its mode applies while it is away): after an
    uninstall with fail-closed, a chain left would drop every DNS answer the node forwards."""
    left, clean = make_netns(), make_netns()
    hold = DnsHold(lambda segment: None, bypass=False, netns_name=left)
    hold.start()
    hold.close(remove_chain=False)
    for argv in hold_rules(5300, bypass=False):  # where an agent before the move to 'security' left it
        xt.run(left, ["iptables-nft", "-w", "-t", "filter", *argv])
    assert nft(left, "list", "ruleset").count(f"chain {HOLD_CHAIN}") == 3  # ip security, ip6 security, ip filter
    out = subprocess.run([NFTPOLICY, "cleanup", "--netns", left], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.splitlines() == ["no table inet nftpolicy", f"removed chain {HOLD_CHAIN} (iptables-nft)"], out
    assert HOLD_CHAIN not in nft(left, "list", "ruleset")
    out = subprocess.run([NFTPOLICY, "cleanup", "--netns", clean], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.splitlines() == ["no table inet nftpolicy"], out
    assert nft(clean, "list", "ruleset").strip() == ""


@pytest.mark.parametrize("mode, sets", [("off", True), ("fail-closed", False), ("bypass", False)])
def test_an_agent_that_will_not_hold_removes_the_chain_an_earlier_one_left(make_netns, mode, sets):
    """An earlier agent (fail-closed) stopped and left its chain; the next one runs with
    ``--dns-hold off``, or no domainNames peer is left: nobody will read the queue, so the
    chain must go (with fail-closed it drops every DNS answer the node forwards)."""
    ns = make_netns()
    earlier = DnsHold(lambda segment: None, bypass=False, netns_name=ns)
    earlier.start()
    earlier.close(remove_chain=False)
    cluster, errors = build_cluster(("test", obj) for obj in (NAMESPACE, POD, POLICY))
    assert not errors
    learning = DomainLearning(DomainLearner(1, 3600, 1000, 1000), lambda elements: None, Metrics(), mode, 5300, ns)
    try:
        learning.sets_changed(domain_sets(cluster, ("ipv4",)) if sets else ())
        assert HOLD_CHAIN not in nft(ns, "list", "ruleset")
    finally:
        learning.close()


def test_a_hold_that_cannot_start_leaves_the_other_agents_chain_and_is_tried_again_later(make_netns, caplog):
    """The queue is still bound by an agent that is stopping (a rolling update): the new agent's
    hold fails without touching that agent's chain, and starts at the first sync
    HOLD_RETRY_SECONDS later, not before and not only at a restart."""
    from nftpolicy.agent.daemon.domainlearning import HOLD_RETRY_SECONDS

    from .fakeclock import FakeClock
    ns = make_netns()
    earlier = DnsHold(lambda segment: None, bypass=False, netns_name=ns)
    earlier.start()
    cluster, errors = build_cluster(("test", obj) for obj in (NAMESPACE, POD, POLICY))
    assert not errors
    sets = domain_sets(cluster, ("ipv4",))
    clock = FakeClock()
    learning = DomainLearning(DomainLearner(1, 3600, 1000, 1000), lambda elements: None, Metrics(), "fail-closed", 5300, ns, clock)
    try:
        learning.sets_changed(sets)
        assert learning.failure is not None and "nfqueue 5300" in learning.failure
        assert HOLD_CHAIN in nft(ns, "list", "ruleset")  # the earlier agent's chain, left as it was
        assert [r.getMessage() for r in caplog.records if "cannot hold" in r.getMessage()][0].startswith(
            "cannot hold DNS answers, domainNames peers learn nothing until it can (tried again at the first sync 30 s from now)")
        earlier.close(remove_chain=False)  # it stops; its chain stays, fail-closed, until someone reads the queue
        clock.advance(HOLD_RETRY_SECONDS - 1)
        learning.sets_changed(sets)
        assert learning._hold is None and learning.failure is not None
        clock.advance(1)
        learning.sets_changed(sets)
        assert learning._hold is not None and learning.failure is None
        assert HOLD_CHAIN in nft(ns, "list", "ruleset")
    finally:
        learning.close()
        earlier.close()


def test_failing_commits_log_one_line_a_minute_with_their_count(caplog):
    """A dataplane that fails every commit must not log a traceback per DNS answer."""
    hold = DnsHold(lambda segment: None, netns_name=None)
    for _ in range(100):
        hold._failed(RuntimeError("nft:\n  no such table"))
    hold._logged_at -= 61
    hold._failed(RuntimeError("still"))
    lines = [r.getMessage() for r in caplog.records if r.name == "nftpolicy.dnshold"]
    assert hold.failed == 101 and all(r.exc_info is None for r in caplog.records)
    assert lines == ["could not commit what 1 DNS answer taught, let through unlearned: RuntimeError: nft: no such table",
                     "could not commit what 100 DNS answers taught, let through unlearned: RuntimeError: still"]


def _other_pod(bed: Bed, make_netns) -> str:
    """A second pod's namespace on the node (10.0.4.5), which no policy selects."""
    other = make_netns()
    netns.ip_batch([f"link add vother netns {bed.node} type veth peer name eth0 netns {other}"])
    netns.ip_batch(["link set vother up", "addr add 10.0.4.1/24 dev vother"], bed.node)
    netns.ip_batch(["link set lo up", "link set eth0 up", "addr add 10.0.4.5/24 dev eth0", "route add default via 10.0.4.1"], other)
    return other


def test_answers_to_a_pod_no_policy_selects_never_reach_the_agent(bed, make_netns):
    """Our table marks answers to subject pods only; the queue rule takes only marked ones: the
    other pod's answers for a policy name pass in the kernel (held counts none), the subject's
    are held as ever."""
    other = _other_pod(bed, make_netns)
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers, resolver.lifetime, resolver.cache = [DNS4], 3.0, None
    assert bed.hold is not None
    before = bed.hold.held
    with netns.entered(other):
        for tcp in (False, True):
            assert [r.address for r in resolver.resolve("far.cdn.example", "A", tcp=tcp).rrset] == ["10.0.2.130"]
    assert bed.hold.held == before
    assert not bed.learner.why("10.0.2.130", time.monotonic())
    [address] = bed.resolve("near.cdn.example")
    assert bed.hold.held > before and bed.connects(address)


def test_the_kernel_queues_a_burst_of_one_pods_answers_up_to_its_budget(bed):
    """1,000 answers to the subject at once: the meter of the hold's rule marks a burst of 232
    (nft's limit: a second's rate, 200, plus the burst, 32) and then 200 a second; the others
    pass unheld, so one pod's flood cannot fill the kernel's queue. Every answer arrives."""
    assert bed.hold is not None
    query = dns.message.make_query("burst.cdn.example", "A").to_wire()
    before = bed.hold.held
    with netns.entered(bed.pod):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with sock:
        sock.settimeout(3)
        sock.connect((DNS4, 53))
        started = time.monotonic()
        for _ in range(1000):
            sock.send(query)
            sock.recv(4096)  # one at a time: the pod's socket drops none
        took = time.monotonic() - started
    held = bed.hold.held - before
    assert 32 <= held <= 232 + 200 * took + 5, (held, took)


def test_each_pods_answers_are_released_in_turn_and_a_pod_over_its_budget_passes_unheld():
    """One read brings 40 answers of pod A, then one of pod B: B's is released first (a round
    takes the pods with fewest waiting first), not 41st; A's beyond the budget (32) are let
    through at once, unread."""
    from nftpolicy.agent.daemon.dnshold import DEFAULT_BUDGET, QueuedPacket

    def packet(client: str, n: int) -> bytes:  # an IPv4 UDP packet to client, its payload n
        return bytes([0x45]) + bytes(8) + bytes([17]) + bytes(6) + socket.inet_aton(client) + bytes(8) + n.to_bytes(2, "big")

    class Queue:
        def __init__(self, hold: DnsHold) -> None:
            self.hold, self.accepted, self.reads = hold, [], 0

        def packets(self, wait: bool = True) -> list[QueuedPacket]:
            self.reads += 1
            if self.reads == 1:
                return [QueuedPacket(i, packet("10.0.1.7", i), 0) for i in range(40)] + [QueuedPacket(40, packet("10.0.1.8", 40), 0)]
            if wait:  # the reader waits only when nothing of its own waits: all released
                self.hold._stopping.set()
            return []

        def accept(self, packet_id: int) -> None:
            self.accepted.append(packet_id)

    committed: list[tuple[str, int]] = []
    hold = DnsHold(lambda segment: committed.append((segment.client, int.from_bytes(segment.payload, "big"))), netns_name=None)
    queue = Queue(hold)
    hold._queue = queue  # type: ignore[assignment]
    hold._run()
    assert queue.accepted[:8] == list(range(DEFAULT_BUDGET, 40))  # over the budget: at once, uncommitted
    assert committed[:2] == [("10.0.1.8", 40), ("10.0.1.7", 0)]
    assert [n for _, n in committed] == [40, *range(DEFAULT_BUDGET)]
    assert hold.over_budget == 40 - DEFAULT_BUDGET and sorted(queue.accepted) == list(range(41))


def test_with_a_mark_the_hold_starts_once_a_full_replace_brought_its_subjects_and_follows_them(make_netns, caplog):
    """The first domain set comes by an incremental sync: no hold yet, a full replace is asked
    for; the replace carries the subjects' set and the marking chains, then the hold starts
    (warning that any DNS server teaches: no --dns-learn-from); later syncs change the set's
    elements only (netlink)."""
    ns = make_netns()
    cluster, errors = build_cluster(("test", obj) for obj in (NAMESPACE, POD, POLICY))
    assert not errors
    sets = domain_sets(cluster, ("ipv4", "ipv6"))
    dataplane = NftDataplane("nftpolicy", ns)
    learning = DomainLearning(DomainLearner(1, 3600, 1000, 1000), dataplane.add_timed_elements, Metrics(), "bypass", 5300, ns,
                              mark=HOLD_MARK, change_elements=dataplane.change_elements)
    try:
        dataplane.run(transaction.full(build_rule_model(cluster, "node-1")))  # as an earlier full replace left it
        assert learning.sets_changed(sets) is True and learning._hold is None
        table = learning.carry(layout.table(build_rule_model(cluster, "node-1")), sets)
        dataplane.run(transaction.replacing(table))
        assert learning.sets_changed(sets, replaced=True) is False and learning._hold is not None
        assert [r.levelname for r in caplog.records if "learning from the DNS answers of any server" in r.message] == ["WARNING"]
        assert "mark match 0x800000/0x800000" in xt.run(ns, ["iptables-nft-save", "-t", "security"]).replace(
            "-m mark --mark", "mark match")
        assert POD4 in nft(ns, "list", "set", "inet", "nftpolicy", "KUBE-DNS-SUBJECTS4")
        assert POD6 in nft(ns, "list", "set", "inet", "nftpolicy", "KUBE-DNS-SUBJECTS6")
        more = [dataclasses.replace(s, clients=s.clients | {"10.0.1.9"}) for s in sets]
        assert learning.sets_changed(more) is False
        assert "10.0.1.9" in nft(ns, "list", "set", "inet", "nftpolicy", "KUBE-DNS-SUBJECTS4")
        learning.sets_changed(sets)
        assert "10.0.1.9" not in nft(ns, "list", "set", "inet", "nftpolicy", "KUBE-DNS-SUBJECTS4")
    finally:
        learning.close()


def test_what_answers_teach_during_a_full_replace_is_committed_again_after_it():
    """A full replace renders and commits without the learning's lock: an answer meanwhile is
    committed at once (to the old table) and again once the replace is done (the new table may
    lack it); one for a set that the replace removed is not."""
    cluster, errors = build_cluster(("test", obj) for obj in (NAMESPACE, POD, POLICY))
    assert not errors
    [v4] = [s for s in domain_sets(cluster, ("ipv4", "ipv6")) if s.family == "ipv4"]
    committed: list[list[tuple[str, TimedAddress]]] = []
    learning = DomainLearning(DomainLearner(1, 3600, 1000, 1000), lambda elements: committed.append(list(elements)), Metrics(),
                              "off", 5300, None)
    learning.sets_changed([v4])
    response = dns.message.make_response(dns.message.make_query("n1.cdn.example", "A"))
    response.answer.append(dns.rrset.from_text("n1.cdn.example.", 60, "IN", "A", "10.0.2.101"))
    with learning.replacing():
        assert learning.learned() == {}  # the snapshot the replace carries
        learning.commit(DnsSegment(POD4, response.to_wire(), False))
        assert committed == [[(v4.name, TimedAddress("10.0.2.101", 60))]]
    assert committed[1] == committed[0]
    with learning.replacing():
        learning.commit(DnsSegment(POD4, response.to_wire().replace(b"\x00\x00\x00\x3c", b"\x00\x00\x00\x78"), False))
        learning.sets_changed([])  # the replace's model has no domain set any more
    assert len(committed) == 3


def test_a_tcp_stream_that_repeats_an_answer_commits_its_address_once(bed):
    """Three answers for one name on one TCP connection, milliseconds apart (a segment each):
    the first commits the address, the others would only move its expiry later by those
    milliseconds and commit nothing."""
    committed: list[list[str]] = []
    commit = bed.dataplane.add_timed_elements

    def recording(elements):
        committed.append([element.address for _, element in elements])
        commit(elements)

    query = dns.message.make_query("tcp.cdn.example", "A").to_wire()
    bed.dataplane.add_timed_elements = recording
    try:
        with netns.entered(bed.pod):
            sock = socket.create_connection((DNS4, 53), timeout=3)
        with sock:
            for _ in range(3):
                sock.sendall(len(query).to_bytes(2, "big") + query)
                reply = b""
                while len(reply) < 2 or len(reply) < 2 + int.from_bytes(reply[:2], "big"):
                    reply += sock.recv(4096)
                assert dns.message.from_wire(reply[2:]).answer[0][0].address == "10.0.2.133"
    finally:
        del bed.dataplane.add_timed_elements  # the class's method again
    assert [c for c in committed if c] == [["10.0.2.133"]]
    assert bed.connects("10.0.2.133")


@pytest.fixture(scope="module")
def trusted_bed(module_netns, tmp_path_factory):
    """The bed with the hold trusting only :data:`TRUSTED` (--dns-learn-from), and the cluster DNS
    Service's address DNATed to dnsmasq in the node (as kube-proxy does)."""
    made = Bed(module_netns, tmp_path_factory.mktemp("trusted"), learn_from=TRUSTED)
    try:
        nft(made.node, "-f", "-", stdin=f"table ip service-nat {{\n chain prerouting {{\n type nat hook prerouting priority dstnat;\n"
                                        f" ip daddr {SERVICE_IP} meta l4proto {{ udp, tcp }} th dport 53 dnat to {DNS4}\n }}\n}}\n")
        made.wait_until_served()
        yield made
    finally:
        made.close()


def rogue_resolver(bed: Bed, tmp_path: Path) -> dns.resolver.Resolver:
    """dnsmasq at :data:`ROGUE` on the node (the pod's policy lets it ask there) answering
    poison.cdn.example with 10.0.2.80; a resolver that asks it, once it answers."""
    bed._spawn(bed.node, ["dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts", "--user=root", "--bind-interfaces",
                          f"--listen-address={ROGUE}", "--except-interface=lo", f"--pid-file={tmp_path}/rogue.pid", "--cache-size=0",
                          "--host-record=poison.cdn.example,10.0.2.80,60", "--host-record=ready.example,10.0.2.81,60"])
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers, resolver.lifetime, resolver.cache = [ROGUE], 1.0, None
    deadline = time.monotonic() + 10
    while True:
        try:
            with netns.entered(bed.pod):
                resolver.resolve("ready.example", "A")
            return resolver
        except dns.exception.DNSException:
            assert time.monotonic() < deadline, "the rogue dnsmasq does not answer"


def untrusted_packets(bed: Bed) -> int:
    """The kernel's count of answers to subjects from resolvers not trusted (the hold chains' counters)."""
    return tally(bed.dataplane.counted_rules(), {}).dns_untrusted or 0


def test_an_answer_from_a_resolver_not_trusted_is_not_learned_and_its_connection_is_refused(trusted_bed, tmp_path):
    """A pod that can ask a DNS server of its own: the server's answers (UDP and TCP) reach the
    pod unheld and teach nothing, so they open no address to it (nor to any other subject of
    the same names); the kernel counts them. The trusted resolver's answer for the same name
    is held, learned and allowed."""
    bed = trusted_bed
    rogue = rogue_resolver(bed, tmp_path)
    assert bed.hold is not None
    held, before = bed.hold.held, untrusted_packets(bed)
    for tcp in (False, True):
        with netns.entered(bed.pod):
            assert [r.address for r in rogue.resolve("poison.cdn.example", "A", tcp=tcp).rrset] == ["10.0.2.80"]
    assert bed.hold.held == held  # none of them was queued
    assert untrusted_packets(bed) >= before + 2
    assert not bed.learner.why("10.0.2.80", time.monotonic())
    assert not bed.connects("10.0.2.80")
    [address] = bed.resolve("poison.cdn.example")  # from dnsmasq at DNS4, trusted
    assert address == "10.0.2.134" and bed.learner.why(address, time.monotonic())  # learned before its release
    assert bed.connects(address)
    assert not bed.connects("10.0.2.80")


def test_an_answer_from_the_trusted_service_address_is_learned_through_its_dnat(trusted_bed):
    """The pod asks the cluster DNS Service's address; the node DNATs it to the server, whose
    reply the hold sees from the server's own address: trusted because the pod asked the
    Service's (conntrack's original destination)."""
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers, resolver.lifetime, resolver.cache = [SERVICE_IP], 3.0, None
    with netns.entered(trusted_bed.pod):
        [address] = [r.address for r in resolver.resolve("service.cdn.example", "A").rrset]
    assert address == "10.0.2.135"
    assert trusted_bed.learner.why(address, time.monotonic())
    assert trusted_bed.connects(address)


@pytest.fixture(scope="module")
def agent_bed(module_netns, tmp_path_factory):
    """The same bed, with the agent enforcing and learning, trusting the answers of :data:`TRUSTED`."""
    made = Bed(module_netns, tmp_path_factory.mktemp("agent"), agent=True, learn_from=TRUSTED)
    try:
        made.wait_until_served()
        yield made
    finally:
        made.close()


def metric(bed: Bed, line_start: str) -> float:
    status, body = http_get(f"http://{bed.http}/metrics")
    assert status == 200
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(line_start))


def test_the_agent_learns_keeps_what_it_learned_across_full_resyncs_and_counts(agent_bed):
    [address] = agent_bed.resolve("api.partner.example")
    assert agent_bed.connects(address)
    [other] = agent_bed.resolve("other.example")
    assert not agent_bed.connects(other)
    time.sleep(2.5)  # at least two full replaces of the table (--resync-interval 1)
    assert agent_bed.connects(address)
    [later] = agent_bed.resolve("n7.cdn.example")  # learned into the replaced table
    assert agent_bed.connects(later)
    assert metric(agent_bed, 'nftpolicy_dns_answers_total{result="learned"}') >= 1
    assert metric(agent_bed, 'nftpolicy_dns_answers_total{result="ignored"}') >= 1
    assert metric(agent_bed, "nftpolicy_dns_learned_elements") >= 1
    assert metric(agent_bed, "nftpolicy_dns_hold_seconds_count") >= 2


def test_explain_agent_names_the_dns_name_that_allowed_an_address(agent_bed):
    [address] = agent_bed.resolve("a.b.cdn.example")

    def explain(to: str) -> str:  # exit 0 allowed, 1 denied
        return subprocess.run([NFTPOLICY, "explain", "--agent", f"http://{agent_bed.debug}", "--from", "shop/client", "--to", to,
                               "--port", f"tcp/{PORT}"], capture_output=True, text=True, timeout=60).stdout

    allowed = explain(address)
    assert allowed.startswith("ALLOWED"), allowed
    assert f"{address} learned from the DNS answer for a.b.cdn.example (*.cdn.example)" in allowed, allowed
    assert explain("10.0.2.21").startswith("DENIED")  # never answered for a policy name


def test_answers_to_many_questions_at_once_are_each_held_until_committed(agent_bed):
    def ask(i: int) -> bool:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers, resolver.lifetime, resolver.cache = [DNS4], 5.0, None
        with netns.entered(agent_bed.pod):
            [address] = [r.address for r in resolver.resolve(f"n{i}.cdn.example", "A").rrset]
        return agent_bed.connects(address)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(10, 18))) == [True] * 8


def test_the_agent_learns_only_from_trusted_resolvers_and_counts_the_others(agent_bed, tmp_path):
    rogue = rogue_resolver(agent_bed, tmp_path)

    def asked_rogue() -> float:  # the counters start again at each full replace (every second here): ask until a read saw one
        with netns.entered(agent_bed.pod):
            assert [r.address for r in rogue.resolve("poison.cdn.example", "A").rrset] == ["10.0.2.80"]
        return metric(agent_bed, "nftpolicy_dns_untrusted_packets_total") > 0

    eventually(asked_rogue, timeout=20)
    assert "learning from the DNS answers of any server" not in "".join(p.read_text() for p in agent_bed.tmp.glob("agent*.log"))
    assert not agent_bed.connects("10.0.2.80")
    [address] = agent_bed.resolve("poison.cdn.example")
    assert address == "10.0.2.134" and agent_bed.connects(address)


def test_a_stopped_agent_leaves_the_hold_and_bypass_lets_dns_work(agent_bed):
    agent_bed.agent.terminate()
    agent_bed.agent.wait(timeout=20)
    assert HOLD_CHAIN in nft(agent_bed.node, "list", "ruleset")
    assert agent_bed.resolve("n3.cdn.example") == ["10.0.2.103"]  # unheld: answered, not learned
    assert not agent_bed.connects("10.0.2.103")


def test_a_restarted_agent_keeps_what_the_one_before_learned(agent_bed):
    """After the test above stopped it: 10.0.2.10 (api.partner.example, TTL 60) was learned by
    the first agent; the new one's full replaces keep it, and it learns anew."""
    agent_bed.start_agent()
    eventually(lambda: http_get(f"http://{agent_bed.http}/readyz")[0], 200, timeout=30)
    time.sleep(1.5)  # a full replace at start and at least one resync
    assert agent_bed.connects("10.0.2.10")
    [address] = agent_bed.resolve("n5.cdn.example")
    assert agent_bed.connects(address)
