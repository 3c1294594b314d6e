"""A new pod is policed from its first packet (issue 31): an address of the node's pod CIDRs that
no programmed pod has is unknown, and its packets are held until the pod is programmed (then
they walk its rules), dropped after the hold, or dropped at once (``--unknown-pods drop``).
Real packets between namespaces this test made, through our table and the hold queue
(agent/daemon/podhold.py); the rules themselves as the layout decides them."""

from __future__ import annotations

import re
import subprocess
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from nftpolicy.agent.daemon.dnshold import NF_ACCEPT
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.podhold import HOLD_CHAIN, PodHold, remove_pod_hold_chain
from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.dataplane.nftables import NftDataplane
from nftpolicy.translators import layout, transaction
from nftpolicy.translators.delta import delta_transaction
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.model import Cluster, Namespace, NetworkPolicy, Node, Pod
from nftpolicy.translators.noderender import NodeRenderer
from nftpolicy.translators.rules import Config
from nftpolicy.translators.tablewalk import Connection, TableWalker

from .conftest import eventually, netns_factory, nft, tcp_connects

pytestmark = [pytest.mark.kernel, pytest.mark.tools("iptables-nft")]

NEW, OLD, GATEWAY = "10.0.1.5", "10.0.1.6", "10.0.1.1"
SERVER, PORT = "10.0.2.10", 8080
NODE = Node(name="node-1", addresses=("192.0.2.1",), pod_cidrs=("10.0.1.0/24", "fd00:1::/64"))
SERVE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(128)
while True:
    c, _ = s.accept(); c.close()
"""


def pod(name: str, ip: str, app: str) -> Pod:
    return Pod("shop", name, {"app": app}, "node-1", (ip,))


def policy(name: str, spec: dict) -> NetworkPolicy:
    """NetworkPolicy ``shop/name`` of ``spec``, as the agent reads it."""
    cluster, errors = build_cluster([("test", {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                                               "metadata": {"name": name, "namespace": "shop"}, "spec": spec})])
    assert not errors
    return cluster.policies[f"shop/{name}"]


def egress_policy(allow: bool) -> NetworkPolicy:
    """Egress of every pod of ``shop``: to the server (``allow``) or to nothing."""
    return policy("egress", {"podSelector": {}, "policyTypes": ["Egress"],
                             "egress": [{"to": [{"ipBlock": {"cidr": f"{SERVER}/32"}}]}] if allow else []})


class Bed:
    """node (routes, our table, the hold), a pod namespace on 10.0.1.0/24 whose addresses are
    the pods', and a server at 10.0.2.10:8080."""

    def __init__(self, make_netns, config: Config) -> None:
        self.node, self.pod, self.out = make_netns(), make_netns(), make_netns()
        netns.ip_batch([f"link add vpod netns {self.node} type veth peer name eth0 netns {self.pod}",
                        f"link add vout netns {self.node} type veth peer name eth0 netns {self.out}"])
        netns.ip_batch(["link set lo up", "link set vpod up", "link set vout up", f"addr add {GATEWAY}/24 dev vpod",
                        "addr add 10.0.2.1/24 dev vout"], self.node)
        netns.ip_batch(["link set lo up", "link set eth0 up", f"addr add {NEW}/24 dev eth0", f"addr add {OLD}/24 dev eth0",
                        f"route add default via {GATEWAY}"], self.pod)
        netns.ip_batch(["link set lo up", "link set eth0 up", f"addr add {SERVER}/24 dev eth0", "route add default via 10.0.2.1"], self.out)
        netns.write_sysctl(self.node, "net.ipv4.ip_forward", "1")
        self.server = subprocess_in(self.out, [sys.executable, "-c", SERVE, str(PORT)])
        self.config = config
        self.dataplane = NftDataplane(config.table, self.node)
        self.renderer = NodeRenderer("node-1", config).load(Cluster(
            namespaces={"shop": Namespace("shop", {"kubernetes.io/metadata.name": "shop"})},
            pods={"shop/old": pod("old", OLD, "old")}, nodes={"node-1": NODE}))
        self.renderer.take_changes()
        self.dataplane.run(transaction.replacing(layout.table(self.renderer.model())))
        self.metrics = Metrics()
        self.hold: PodHold | None = None
        eventually(lambda: tcp_connects(self.node, SERVER, PORT, 1), timeout=10)

    def start_hold(self, seconds: float = 8.0) -> PodHold:
        self.hold = PodHold(self.config, 5310, seconds, self.metrics, netns_name=self.node)
        self.hold.start()
        self.hold.programmed(self.renderer.known_addresses())
        return self.hold

    def apply(self, kind: str, key: str, obj: object) -> None:
        """One object change, committed as the agent's delta, then told to the hold."""
        self.renderer.apply(kind, key, obj)
        self.dataplane.run(delta_transaction(self.config, self.renderer.take_changes()))
        if self.hold is not None:
            self.hold.programmed(self.renderer.known_addresses())

    def connects_from(self, source: str, timeout: float = 10.0) -> tuple[bool, float]:
        """A TCP connection from the pod namespace's ``source`` to the server: (connected, seconds)."""
        with netns.entered(self.pod):
            sock = socket.socket()
        sock.settimeout(timeout)
        started = time.monotonic()
        try:
            sock.bind((source, 0))
            sock.connect((SERVER, PORT))
            return True, time.monotonic() - started
        except OSError:
            return False, time.monotonic() - started
        finally:
            sock.close()

    def count(self, direction: str, result: str) -> float:
        return self.metrics.unknown_pod_packets.labels(direction, result)._value.get()

    def close(self) -> None:
        if self.hold is not None:
            self.hold.close()
        self.server.terminate()
        self.server.wait(timeout=10)


def subprocess_in(ns: str, argv: list[str]):
    import subprocess
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def bed(make_netns):
    made = Bed(make_netns, Config(unknown_pods="hold"))
    try:
        yield made
    finally:
        made.close()


def connect_while(bed: Bed, source: str, change, after: float = 0.3) -> tuple[bool, float]:
    """Connect from ``source`` and make ``change`` ``after`` seconds later, while it is held."""
    timer = threading.Timer(after, change)
    timer.start()
    try:
        return bed.connects_from(source)
    finally:
        timer.join()


def test_a_new_pods_first_packet_is_held_until_programmed_then_its_deny_all_egress_refuses_it(bed):
    bed.start_hold()
    bed.apply("NetworkPolicy", "shop/egress", egress_policy(allow=False))
    connected, took = connect_while(bed, NEW, lambda: bed.apply("Pod", "shop/new", pod("new", NEW, "new")))
    assert not connected and 0.25 < took < 5  # refused by its policy once programmed, not let through, not timed out
    assert bed.count("egress", "held") >= 1 and bed.count("egress", "released") >= 1 and bed.count("egress", "dropped") == 0
    assert bed.connects_from(OLD)[0] is False  # the known pod: its policy as always


def test_an_allowed_new_pods_first_connection_succeeds_after_the_hold(bed):
    bed.start_hold()
    bed.apply("NetworkPolicy", "shop/egress", egress_policy(allow=True))
    connected, took = connect_while(bed, NEW, lambda: bed.apply("Pod", "shop/new", pod("new", NEW, "new")))
    assert connected and 0.25 < took < 5, took  # held for the reaction time, then its rules allowed it
    assert bed.count("egress", "released") >= 1
    assert bed.connects_from(NEW)[0]  # programmed: nothing held any more
    held = bed.count("egress", "held")
    assert bed.connects_from(NEW)[0] and bed.count("egress", "held") == held


def test_ingress_to_a_new_pod_is_held_and_walks_its_ingress_rules(bed):
    bed.start_hold()
    bed.apply("NetworkPolicy", "shop/ingress", policy("ingress", {"podSelector": {}, "policyTypes": ["Ingress"]}))
    server = subprocess_in(bed.pod, [sys.executable, "-c", SERVE.replace('"0.0.0.0"', f'"{NEW}"'), str(PORT)])
    try:
        time.sleep(0.3)
        timer = threading.Timer(0.3, lambda: bed.apply("Pod", "shop/new", pod("new", NEW, "new")))
        timer.start()
        started = time.monotonic()
        connected = tcp_connects(bed.out, NEW, PORT, 10)
        took = time.monotonic() - started
        timer.join()
        assert not connected and took < 4  # deny-all ingress, from the first packet: refused, not timed out
        assert bed.count("ingress", "released") >= 1
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_an_address_never_programmed_is_dropped_after_the_hold_and_logged(bed, caplog):
    bed.start_hold(seconds=0.5)
    connected, took = bed.connects_from(NEW, timeout=3)
    assert not connected
    eventually(lambda: bed.count("egress", "dropped") >= 1, timeout=5)
    assert any(f"egress of {NEW} is no pod programmed" in r.getMessage() for r in caplog.records)


def test_the_nodes_own_address_in_the_pod_cidr_is_never_held(bed):
    bed.start_hold()
    bed.apply("Pod", "shop/new", pod("new", NEW, "new"))
    assert tcp_connects(bed.node, SERVER, PORT, 2)  # from the gateway's side, untouched
    assert bed.count("egress", "held") == bed.count("ingress", "held") == 0


def test_without_a_hold_chain_a_marked_packet_is_dropped_by_the_released_chain(bed):
    connected, _ = bed.connects_from(NEW, timeout=1.5)  # no hold started: the base chain marks it, nothing queues it
    assert not connected
    listing = nft(bed.node, "list", "chain", "inet", "nftpolicy", "NFTPOLICY-RELEASED-FORWARD")
    [dropped] = re.findall(r"counter packets (\d+) bytes \d+ drop comment \"drop an unknown pod's egress", listing)
    assert int(dropped) >= 1


def test_a_stopped_hold_leaves_its_chain_and_the_kernel_drops_what_it_would_queue(bed):
    hold = bed.start_hold()
    hold.close(remove_chain=False)
    bed.hold = None
    assert HOLD_CHAIN in netns_save(bed.node)
    assert not bed.connects_from(NEW, timeout=1.5)[0]
    assert remove_pod_hold_chain(bed.node) and HOLD_CHAIN not in netns_save(bed.node)


def netns_save(ns: str) -> str:
    import subprocess
    return subprocess.run(["ip", "netns", "exec", ns, "iptables-nft-save", "-t", "security"], capture_output=True, text=True).stdout


def test_drop_mode_drops_an_unknown_pods_packets_at_once(make_netns):
    made = Bed(make_netns, Config(unknown_pods="drop"))
    try:
        assert made.connects_from(NEW, timeout=1.5)[0] is False
        made.apply("Pod", "shop/new", pod("new", NEW, "new"))
        assert made.connects_from(NEW)[0]  # programmed, and no policy selects it
        assert "NFTPOLICY-RELEASED" not in nft(made.node, "list", "table", "inet", "nftpolicy")
    finally:
        made.close()


def test_the_walk_says_an_unknown_address_is_held_and_a_known_one_is_decided():
    renderer = NodeRenderer("node-1", Config(unknown_pods="hold")).load(Cluster(pods={"shop/old": pod("old", OLD, "old")},
                                                                             nodes={"node-1": NODE}))
    walker = TableWalker(layout.table(renderer.model()), local=[GATEWAY])
    held = walker.walk(Connection(NEW, SERVER, "TCP", PORT))
    assert held.outcome == "accept" and held.ended_by is not None and "to the hold" in held.ended_by.rule.comment
    assert walker.walk(Connection(OLD, SERVER, "TCP", PORT)).outcome == "through"
    assert walker.walk(Connection(GATEWAY, NEW, "TCP", PORT), chain="KUBE-ROUTER-OUTPUT").ended_by.rule.comment.startswith("to the hold")
    assert walker.walk(Connection(SERVER, "10.0.3.4", "TCP", PORT)).outcome == "through"  # outside the pod CIDRs


NFTPOLICY = str(Path(sys.executable).parent / "nftpolicy")


def manifests(pods: list[tuple[str, str]], allow: bool) -> str:
    """The agent's manifests: namespace ``shop``, its egress policy, node-1 with the pod CIDRs,
    and ``pods`` ((name, address), Running on node-1)."""
    import yaml
    objects: list[dict] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop", "labels": {"kubernetes.io/metadata.name": "shop"}}},
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}, "spec": {"podCIDRs": list(NODE.pod_cidrs)},
         "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.1"}]}},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "egress", "namespace": "shop"},
         "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": [{"to": [{"ipBlock": {"cidr": f"{SERVER}/32"}}]}] if allow else []}}]
    objects += [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "shop", "labels": {"app": name}},
                 "spec": {"nodeName": "node-1"}, "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}} for name, ip in pods]
    return yaml.safe_dump_all(objects)


def test_the_agent_holds_a_new_pod_until_its_rules_and_a_restart_keeps_the_guarantee(make_netns, tmp_path):
    """The real agent (--manifests, re-read every second): a new pod's first connection, made
    before the agent has the pod, succeeds once its rules allow it; while the agent is stopped
    a new pod's packets are dropped (its chain stays, nobody reads the queue) and a known pod is
    decided by its rules; the next agent releases what it holds."""
    from nftpolicy.agent.testbed.controlplane import free_port
    from .conftest import http_get
    made = Bed(make_netns, Config(unknown_pods="hold"))
    folder = tmp_path / "manifests"
    folder.mkdir()
    (folder / "cluster.yaml").write_text(manifests([("old", OLD)], allow=True))
    http = f"127.0.0.1:{free_port()}"
    argv = [NFTPOLICY, "agent", "--netns", made.node, "--manifests", str(folder), "--node", "node-1", "--http-address", http,
            "--debug-address", "", "--unknown-pod-hold", "5"]
    import subprocess
    agent = subprocess.Popen(argv, stdout=open(tmp_path / "agent.log", "wb"), stderr=subprocess.STDOUT)
    try:
        eventually(lambda: http_get(f"http://{http}/readyz")[0], 200, timeout=30)
        assert made.connects_from(OLD)[0]
        timer = threading.Timer(0.2, lambda: (folder / "cluster.yaml").write_text(manifests([("old", OLD), ("new", NEW)], allow=True)))
        timer.start()
        connected, took = made.connects_from(NEW, timeout=8)
        timer.join()
        assert connected and took > 0.2, took  # held until the agent read and committed the pod, then allowed
        status, body = http_get(f"http://{http}/metrics")
        [released] = re.findall(r'nftpolicy_unknown_pod_packets_total\{direction="egress",result="released"\} (\S+)', body)
        assert float(released) >= 1, re.findall(r"^nftpolicy_unknown_pod.*", body, re.M)  # the SYN; its retransmission a second later too when the agent read the pod later (load)
        agent.terminate()
        agent.wait(timeout=20)
        assert HOLD_CHAIN in netns_save(made.node)
        assert made.connects_from(OLD)[0] and made.connects_from(NEW)[0]  # known pods: their rules, no agent needed
        (folder / "cluster.yaml").write_text(manifests([("old", OLD)], allow=True))
        netns.ip_batch(["addr add 10.0.1.7/24 dev eth0"], made.pod)
        assert not made.connects_from("10.0.1.7", timeout=1.5)[0]  # unknown while no agent runs: dropped
        agent = subprocess.Popen(argv, stdout=open(tmp_path / "agent2.log", "wb"), stderr=subprocess.STDOUT)
        eventually(lambda: http_get(f"http://{http}/readyz")[0], 200, timeout=30)
        assert made.connects_from(OLD)[0]
        timer = threading.Timer(0.2, lambda: (folder / "cluster.yaml").write_text(manifests([("old", OLD), ("third", "10.0.1.7")], allow=True)))
        timer.start()
        assert made.connects_from("10.0.1.7", timeout=8)[0]
        timer.join()
    finally:
        agent.terminate()
        agent.wait(timeout=20)
        remove_pod_hold_chain(made.node)
        made.close()


@pytest.mark.parametrize(("mode", "word", "says"), [("hold", "HELD", "held until the agent programs its pod"),
                                                     ("drop", "DENIED", "dropped until the agent programs its pod")])
def test_explain_says_what_an_unknown_pods_address_gets(tmp_path, mode, word, says):
    import subprocess
    (tmp_path / "cluster.yaml").write_text(manifests([("old", OLD)], allow=True))
    out = subprocess.run([NFTPOLICY, "explain", str(tmp_path), "--from", "10.0.1.77", "--to", SERVER, "--port", "tcp/8080",
                          "--unknown-pods", mode], capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert out.returncode == 1 and lines[0] == f"{word}  10.0.1.77 -> {SERVER} TCP/8080", out
    assert lines[1] == (f"  egress of 10.0.1.77: an unknown pod (in node node-1's pod CIDRs, no pod programmed there): {says}"
                        + (", then its rules decide (dropped if that takes longer than the hold)" if mode == "hold" else "")), out
    known = subprocess.run([NFTPOLICY, "explain", str(tmp_path), "--from", "shop/old", "--to", SERVER, "--port", "tcp/8080"],
                           capture_output=True, text=True, timeout=60)
    assert known.returncode == 0 and known.stdout.startswith("ALLOWED"), known



def trace_while(bed: Bed, source: str, change=None, *flags: str, before=None) -> tuple[subprocess.CompletedProcess, bool]:
    """``nftpolicy trace`` of ``source`` -> the server in the node's namespace while a real
    connection from ``source`` is made (``before`` it: ``before()``; 0.3 s into it: ``change()``):
    the trace's result, and whether the connection connected."""
    proc = subprocess.Popen([NFTPOLICY, "trace", "--from", source, "--to", SERVER, "--port", f"tcp/{PORT}", "--netns", bed.node,
                             "--timeout", "2", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None and proc.stderr.readline().startswith("waiting up to")  # its monitor listens
        if before is not None:
            before()
        connected, _ = connect_while(bed, source, change) if change is not None else bed.connects_from(source, timeout=1.5)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), connected


HEAD = [f"TRACE  {NEW} -> {SERVER} TCP/{PORT}"]
HELD_NEW = [f"  KUBE-ROUTER-FORWARD: egress of {NEW}: an unknown pod (in the node's pod CIDRs, no pod programmed there): "
            "held until the agent programs its pod, then its rules decide (dropped if that takes longer than the hold) -> continue",
            "  KUBE-ROUTER-FORWARD: to the hold, within its source's budget: an unknown pod's egress -> jump NFTPOLICY-TO-HOLD"]
QUEUED = "  NFTPOLICY-TO-HOLD: to the hold: within its source's budget (ipv4) -> queued to the hold"


def test_trace_of_a_held_packet_names_the_address_and_the_hold_then_walks_the_rules_it_was_released_to(bed):
    """issue 31: trace says the packet of the unknown address is held, then follows the same
    packet after its release through the pod's chains as the agent committed them meanwhile."""
    bed.start_hold()
    bed.apply("NetworkPolicy", "shop/egress", egress_policy(allow=True))
    result, connected = trace_while(bed, NEW, lambda: bed.apply("Pod", "shop/new", pod("new", NEW, "new")))
    assert connected and result.returncode == 0, result.stdout + result.stderr
    model = bed.renderer.model()
    pod_chain = next(c.name for c in model.pod_chains if c.pod == "shop/new" and c.direction == "egress")
    policy_chain = next(c.name for c in model.policy_chains if c.policy == "shop/egress")
    assert result.stdout.splitlines() == [*HEAD, f"node {bed.node}:", *HELD_NEW, QUEUED,
        "  NFTPOLICY-RELEASED-FORWARD: released by the hold: the pod is programmed -> continue",
        f"  NFTPOLICY-RELEASED-FORWARD: traffic from local isolated pods (ipv4) -> jump {pod_chain}",
        f"  {pod_chain}: pod shop/new common -> jump KUBE-NWPLCY-COMMON",
        "  KUBE-NWPLCY-COMMON: common: not invalid, no essential ICMP -> return",
        f"  {pod_chain}: pod shop/new start unmarked -> continue",
        f"  {pod_chain}: pod shop/new egress -> jump {policy_chain}",
        f"  {policy_chain}: shop/egress egress rule 0 -> return",
        f"  {pod_chain}: pod shop/new egress allowed -> return",
        "  NFTPOLICY-RELEASED-FORWARD: end of chain, policy -> accept"], result.stdout


def test_trace_of_a_packet_still_held_at_its_end_says_so_and_exits_1(bed):
    bed.start_hold()
    result, connected = trace_while(bed, NEW)
    assert not connected and result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines() == [*HEAD, f"node {bed.node}:", *HELD_NEW, QUEUED,
        "  (still held when the trace ended: released to its rules once its pod is programmed, dropped after the agent's "
        "--unknown-pod-hold)"], result.stdout


def test_trace_of_a_packet_over_its_sources_budget_says_it_was_dropped_not_held(make_netns):
    """A source that sent its budget towards the hold (here 1 a second, a burst of 1 more):
    its next packet is dropped by our table, and trace names the source."""
    made = Bed(make_netns, Config(unknown_pods="hold", unknown_pod_rate=1, unknown_pod_burst=1))
    try:
        made.start_hold()
        result, connected = trace_while(made, NEW, None, "--unknown-pod-rate", "1", "--unknown-pod-burst", "1",
                                        before=lambda: send_udp(made.pod, NEW, [(SERVER, 9)] * 5))
        assert not connected and result.returncode == 1, result.stdout + result.stderr
        assert result.stdout.splitlines() == [*HEAD, f"node {made.node}:", *HELD_NEW,
            f"  NFTPOLICY-TO-HOLD: {NEW} sent more than its budget towards the hold (--unknown-pod-rate, --unknown-pod-burst): "
            "dropped, not held -> drop"], result.stdout
    finally:
        made.close()


def test_trace_in_drop_mode_says_the_unknown_pods_packet_is_dropped(make_netns):
    made = Bed(make_netns, Config(unknown_pods="drop"))
    try:
        result, connected = trace_while(made, NEW, None, "--unknown-pods", "drop")
        assert not connected and result.returncode == 1, result.stdout + result.stderr
        assert result.stdout.splitlines() == [*HEAD, f"node {made.node}:",
            f"  KUBE-ROUTER-FORWARD: egress of {NEW}: an unknown pod (in the node's pod CIDRs, no pod programmed there): "
            "dropped until the agent programs its pod -> drop"], result.stdout
    finally:
        made.close()


def send_udp(ns: str, source: str, targets: list[tuple[str, int]]) -> None:
    """One UDP datagram from ``source`` in namespace ``ns`` to each of ``targets``."""
    with netns.entered(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind((source, 0))
        for target in targets:
            sock.sendto(b"x", target)
    finally:
        sock.close()


def ipv4_packet(source: str, destination: str) -> bytes:
    """The 20-byte IPv4 header of a packet ``source`` -> ``destination`` (what the hold reads)."""
    return bytes([0x45]) + bytes(11) + socket.inet_aton(source) + socket.inet_aton(destination)


def test_the_hold_keeps_at_most_max_held_packets_for_one_address_and_direction_and_drops_more_at_once():
    from nftpolicy.agent.daemon.dnshold import QueuedPacket
    now = [0.0]
    metrics = Metrics()
    hold = PodHold(Config(unknown_pods="hold"), 5310, 2.0, metrics, netns_name=None, clock=lambda: now[0], max_held=3)
    egress, ingress = Config().unknown_egress_mark, Config().unknown_ingress_mark
    for i in range(5):
        hold.take(QueuedPacket(i, ipv4_packet(NEW, SERVER), egress))
    hold.take(QueuedPacket(5, ipv4_packet(SERVER, OLD), ingress))  # another address: still held
    hold.take(QueuedPacket(7, ipv4_packet(SERVER, NEW), ingress))  # to the full address, the other direction: still held
    assert [h.queued.id for h in hold.waiting] == [0, 1, 2, 5, 7]
    assert dict(hold.waiting_for) == {("egress", NEW): 3, ("ingress", OLD): 1, ("ingress", NEW): 1}
    over = metrics.unknown_pod_packets.labels("egress", "over_limit")._value.get()
    assert over == 2 and metrics.unknown_pod_packets.labels("ingress", "over_limit")._value.get() == 0
    hold.programmed(frozenset({NEW}))
    assert [h.queued.id for h in hold.waiting] == [5] and dict(hold.waiting_for) == {("ingress", OLD): 1}
    hold.take(QueuedPacket(6, ipv4_packet(NEW, SERVER), egress))  # programmed: released at once, never counted as waiting
    assert dict(hold.waiting_for) == {("ingress", OLD): 1} and metrics.unknown_pod_packets.labels("egress", "released")._value.get() == 4
    now[0] = 2.0
    hold.expire()
    assert hold.waiting == [] and dict(hold.waiting_for) == {}


FLOOD = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 0))
end, sent = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < end:
    for last in range(128, 250):  # unused addresses of the pod CIDR, routed through the node
        s.sendto(b"x", (f"10.0.1.{last}", 9))
    sent += 122
print(sent, flush=True)
"""


@pytest.mark.parametrize("allow", [True, False], ids=["allowed", "deny-all"])
def test_a_flooding_pod_cannot_fill_the_hold_for_another_new_pods_first_packet(make_netns, allow):
    """The known pod ``old`` sends UDP as fast as it can to unused addresses of the pod CIDR (each
    an unknown pod's: held) while the new pod connects before it is programmed. Our table lets
    ``old`` send its budget towards the hold and drops the rest (counted), so the kernel's queue
    (1,024 packets, each held up to 2 s: full at 512 packets a second) keeps room: the new pod's
    first SYN is held and released to its rules 0.3 s in (without the budget it found the queue
    full, was dropped, and only its retransmission a second later went through)."""
    from nftpolicy.agent.daemon.rulecounters import tally
    made = Bed(make_netns, Config(unknown_pods="hold"))
    flood = None
    try:
        netns.ip_batch([f"route add 10.0.1.128/25 via {GATEWAY}"], made.pod)
        made.start_hold(seconds=2.0)
        made.apply("NetworkPolicy", "shop/egress", egress_policy(allow=allow))
        flood = subprocess.Popen(["ip", "netns", "exec", made.pod, sys.executable, "-c", FLOOD, OLD, "4"], stdout=subprocess.PIPE, text=True)
        time.sleep(1.5)  # the flood has filled what it could
        connected, took = connect_while(made, NEW, lambda: made.apply("Pod", "shop/new", pod("new", NEW, "new")))
        sent = int(flood.communicate(timeout=30)[0])
        over = tally(made.dataplane.counted_rules(), {}).over_budget
        held = made.count("ingress", "held")
        print(f"flood: {sent} sent, {over[('ingress',)]:.0f} over budget, {held:.0f} held; new pod: connected {connected} in {took:.3f} s")
        assert connected is allow and 0.25 < took < 0.9, took  # its first SYN: held, released, decided by its rules
        assert sent > 5000 and over[("ingress",)] > sent * 0.9 and over[("egress",)] == 0
        assert held <= (20 + 40) + 20 * 6 + 10  # the budget's burst, then 20 a second for the flood's time (a margin)
        assert made.count("egress", "released") >= 1
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
            flood.wait()
        made.close()


PROBES = """
import socket, sys, time
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:  # 200 probes a second, spread (200 containers' probes at periodSeconds 1) to unused addresses
    for last in range(200, 250):
        time.sleep(0.005)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 0))
        try:
            s.sendto(b"x", (f"10.0.1.{last}", 9))
        except OSError:  # EPERM: dropped in OUTPUT (over its budget)
            pass
        s.close()
"""


def test_probes_to_unused_addresses_do_not_delay_the_probe_of_another_new_pod(make_netns):
    """The node (kubelet) probes a new pod before it is programmed: its SYN is held and released
    0.3 s in, also while the node sends 200 probes a second to unused addresses (a tenant's pods
    may point their probes anywhere): the node's own packets have no budget (a hostile review:
    keyed by the node's address, they shared one, and the SYN was dropped over it, its
    retransmission a second later reaching the pod)."""
    made = Bed(make_netns, Config(unknown_pods="hold"))
    probes = server = None
    try:
        made.start_hold(seconds=2.0)
        made.apply("NetworkPolicy", "shop/ingress", policy("ingress", {"podSelector": {}, "policyTypes": ["Ingress"],
                                                                       "ingress": [{}]}))
        server = subprocess_in(made.pod, [sys.executable, "-c", SERVE.replace('"0.0.0.0"', f'"{NEW}"'), str(PORT)])
        probes = subprocess.Popen(["ip", "netns", "exec", made.node, sys.executable, "-c", PROBES, GATEWAY, "6"])
        time.sleep(2.5)  # the burst is spent
        timer = threading.Timer(0.3, lambda: made.apply("Pod", "shop/new", pod("new", NEW, "new")))
        timer.start()
        started = time.monotonic()
        connected = tcp_connects(made.node, NEW, PORT, 10)  # kubelet's probe of the new pod
        took = time.monotonic() - started
        timer.join()
        assert connected and took < 0.9, took
    finally:
        for process in (probes, server):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=10)
        made.close()
