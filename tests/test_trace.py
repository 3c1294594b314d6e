"""``nftpolicy trace``: a real packet's path through our chains in a sandbox (the policy chain and
rule that allowed it; the reject of a denied one), and on a node (a namespace the test made):
the trace chains go away afterwards, also when the command is stopped with SIGTERM; those of a
trace killed with SIGKILL go at the next trace and at the agent's start; two traces at once have
chains of their own."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.dataplane.nftables import TraceMonitor
from nftpolicy.translators.layout import TRACE_PREFIX

from .conftest import REPO, nft

pytestmark = pytest.mark.kernel
NFTPOLICY = str(Path(sys.executable).parent / "nftpolicy")
SHOP = str(REPO / "examples" / "shop")


def trace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([NFTPOLICY, "trace", *args], capture_output=True, text=True, timeout=120)


def test_an_allowed_packet_shows_the_policy_rules_that_allowed_it():
    result = trace("--from", "ops/prometheus", "--to", "shop/api", "--port", "9090", SHOP)
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stderr
    assert lines[:2] == ["TRACE  ops/prometheus-0 -> shop/api-5f6b7c9d4-q8w2n TCP/9090: connected", "node node1:"]
    assert "  KUBE-NWPLCY-DMGOM57662FD7PZ3: policy shop/api-ingress ingress rule 1 (allows) -> return" in lines
    assert "  KUBE-POD-IN-PAL6TE76LJVQCTZ2: pod shop/api-5f6b7c9d4-q8w2n ingress -> jump KUBE-NWPLCY-DMGOM57662FD7PZ3" in lines
    assert lines[-1] == "  KUBE-ROUTER-FORWARD: end of chain, policy -> accept"


SERVICE = """
apiVersion: v1
kind: Service
metadata: {name: api, namespace: shop}
spec: {selector: {app: api}, ports: [{name: metrics, port: 80, targetPort: 9090}]}
"""


@pytest.mark.parametrize("to", [["--to", "shop/api", "--port", "80"], ["--to", "svc/shop/api:80/TCP"]])
def test_a_packet_to_a_service_goes_to_its_pod_on_the_target_port(tmp_path, to):
    """trace --to a Service (issue 34: refused) sends to its first pod on the target port, as
    kube-proxy would; kubectl nftpolicy's form is read too."""
    (tmp_path / "svc.yaml").write_text(SERVICE)
    result = trace("--from", "ops/prometheus", *to, SHOP, str(tmp_path / "svc.yaml"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "TRACE  ops/prometheus-0 -> shop/api-5f6b7c9d4-q8w2n TCP/9090: connected"


def test_a_denied_packet_shows_the_reject():
    result = trace("--from", "shop/frontend", "--to", "shop/db", "--port", "tcp/5432", SHOP)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stderr
    assert lines[0] == "TRACE  shop/frontend-7d9c8b6f5-x2k4p -> shop/db-0 TCP/5432: refused"
    assert "  KUBE-NWPLCY-VHTYM5YFL6X3MAZN: policy shop/frontend-egress egress: no rule matched -> return" in lines
    reject = lines.index("  KUBE-POD-EG-HI2GIINJHVFH5SJE: pod shop/frontend-7d9c8b6f5-x2k4p reject egress -> reject with tcp reset")
    assert lines[reject + 1:] == ["node node2:", "  (no packet of it in our table here)"]  # refused before it left node1


@pytest.mark.parametrize("port, line", [
    ("udp/5432", "  KUBE-POD-EG-HI2GIINJHVFH5SJE: pod shop/frontend-7d9c8b6f5-x2k4p reject egress -> reject with icmpx port-unreachable"),
    ("tcp/5432", None),
])
def test_the_trace_says_whether_the_kernel_answered_or_dropped(port, line):
    """kube-router's reject answers (a TCP reset, ICMP port unreachable for the rest); with
    --deny-action drop the pod chain drops and the trace says so (the monitor calls both drop)."""
    rejected = trace("--from", "shop/frontend", "--to", "shop/db", "--port", port, SHOP)
    dropped = trace("--deny-action", "drop", "--from", "shop/frontend", "--to", "shop/db", "--port", port, SHOP)
    assert rejected.returncode == dropped.returncode == 1, rejected.stderr + dropped.stderr
    if line is not None:
        assert line in rejected.stdout.splitlines()
    assert "  KUBE-POD-EG-HI2GIINJHVFH5SJE: pod shop/frontend-7d9c8b6f5-x2k4p drop egress -> drop" in dropped.stdout.splitlines()
    assert "reject with" not in dropped.stdout


def test_a_packet_our_table_never_saw_is_never_seen_not_refused():
    """frontend's egress allows UDP/53 anywhere, but the sandbox has no route out: the packet
    never reaches a table, and the trace says so (exit 1, as docs/commands.md says)."""
    result = trace("--from", "shop/frontend", "--to", "8.8.8.8", "--port", "udp/53", SHOP)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines() == ["TRACE  shop/frontend-7d9c8b6f5-x2k4p -> 8.8.8.8 UDP/53: never seen",
                                          "node node1:", "  (no packet of it in our table here)"]


def test_bad_input_gets_one_line_and_exit_2():
    result = trace("--from", "shop/nothing", "--to", "shop/db", SHOP)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "nftpolicy: --from shop/nothing: no running pod with an address of that name"]
    result = trace("--from", "shop/frontend", "--to", "10.0.0.1", "--netns", "none")
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "nftpolicy: --from shop/frontend: on a node, give an address (names need manifests)"]
    result = trace("--from", "shop/frontend", "--to", "shop/db", "--agent", "http://127.0.0.1:1", SHOP)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "nftpolicy: --agent: only on a node; with manifests the sandbox knows its own model"], result.stderr


def test_on_a_node_the_trace_chains_go_away_after_a_timeout_and_after_sigterm(make_netns):
    ns = make_netns()
    rules = subprocess.run([NFTPOLICY, "render", "--node", "node1", SHOP], capture_output=True, text=True, check=True).stdout
    nft(ns, "-f", "-", stdin=rules)
    before = nft(ns, "list", "table", "inet", "nftpolicy")
    result = trace("--from", "10.244.1.10", "--to", "10.244.2.10", "--port", "5432", "--netns", ns, "--timeout", "0.5")
    assert result.returncode == 1 and "(no packet of it in our table here)" in result.stdout
    assert nft(ns, "list", "table", "inet", "nftpolicy") == before
    proc = subprocess.Popen([NFTPOLICY, "trace", "--from", "10.244.1.10", "--to", "10.244.2.10", "--netns", ns, "--timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_trace_chains(ns, proc, 3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 143
    assert nft(ns, "list", "table", "inet", "nftpolicy") == before


def trace_chains(ns: str) -> list[str]:
    """The names of the trace chains in our table in ``ns``."""
    return [line.split()[1] for line in nft(ns, "list", "table", "inet", "nftpolicy").splitlines()
            if line.strip().startswith(f"chain {TRACE_PREFIX}")]


def wait_for_trace_chains(ns: str, proc: subprocess.Popen, count: int) -> list[str]:
    """Wait until ``count`` trace chains are in our table in ``ns`` (``proc`` must not end meanwhile)."""
    deadline = time.monotonic() + 10
    while len(chains := trace_chains(ns)) < count:
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    return chains


def node_trace(ns: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([NFTPOLICY, "trace", "--from", "10.244.1.10", "--to", "10.244.2.10", "--netns", ns, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_traces_at_once_have_their_own_chains_and_a_killed_ones_go_at_the_next(make_netns):
    ns = make_netns()
    rules = subprocess.run([NFTPOLICY, "render", "--node", "node1", SHOP], capture_output=True, text=True, check=True).stdout
    nft(ns, "-f", "-", stdin=rules)
    before = nft(ns, "list", "table", "inet", "nftpolicy")
    first = node_trace(ns, "--timeout", "60")
    try:
        mine = wait_for_trace_chains(ns, first, 3)
        second = node_trace(ns, "--timeout", "60")
        both = wait_for_trace_chains(ns, second, 6)
        assert set(mine) < set(both) and len(set(both)) == 6  # its own chains; the first trace's stay
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=15) == 143 and sorted(trace_chains(ns)) == sorted(mine)
        first.kill()  # SIGKILL: no clean-up
        first.wait(timeout=15)
        assert sorted(trace_chains(ns)) == sorted(mine)
        result = trace("--from", "10.244.1.10", "--to", "10.244.2.10", "--netns", ns, "--timeout", "0.3")
        assert result.returncode == 1 and "removed 3 chains of a trace that ended without cleaning up: " in result.stderr
        assert nft(ns, "list", "table", "inet", "nftpolicy") == before
    finally:
        for proc in [first] + ([second] if "second" in locals() else []):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_agent_removes_a_killed_traces_chains_at_its_start(make_netns, tmp_path):
    ns = make_netns()
    rules = subprocess.run([NFTPOLICY, "render", "--node", "node1", SHOP], capture_output=True, text=True, check=True).stdout
    nft(ns, "-f", "-", stdin=rules)
    killed = node_trace(ns, "--timeout", "60")
    try:
        wait_for_trace_chains(ns, killed, 3)
    finally:
        killed.kill()
        killed.wait()
    agent = subprocess.Popen([NFTPOLICY, "agent", "--node", "node1", "--manifests", SHOP, "--netns", ns,
                              "--http-address", "127.0.0.1:0"], stdout=subprocess.DEVNULL, stderr=(tmp_path / "agent.log").open("w"))
    try:
        deadline = time.monotonic() + 20
        while trace_chains(ns):
            assert time.monotonic() < deadline and agent.poll() is None, "the agent left the trace chains"
            time.sleep(0.1)
        assert "chain KUBE-ROUTER-FORWARD" in nft(ns, "list", "table", "inet", "nftpolicy")
    finally:
        agent.terminate()
        agent.wait(timeout=15)


def test_a_priority_with_no_room_below_is_one_line():
    result = trace("--from", "10.244.1.10", "--to", "10.244.2.10", "--priority", "-2147483648", "--netns", "none")
    assert (result.returncode, result.stderr) == (2, "nftpolicy: --priority -2147483648: trace hooks its chains just below the "
                                                     "base chains (priority - 1), and no priority is lower: give the table's priority\n")


def test_the_monitor_listens_once_entered(make_netns):
    """A packet sent right after TraceMonitor's __enter__ is reported: it returns once its socket
    has joined the kernel's trace group (no retry needed, no packet of the walk missed)."""
    ns = make_netns()
    netns.ip_batch(["link set lo up"], ns)
    nft(ns, "-f", "-", stdin="table inet tracetest {\n chain out {\n type filter hook output priority 0;\n"
                             " udp dport 9 meta nftrace set 1\n }\n}\n")
    for attempt in range(3):
        with TraceMonitor(ns) as monitor:
            with netns.entered(ns), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.sendto(b"x", ("127.0.0.1", 9))
            lines = list(monitor.lines(1.0))
        assert any(" inet tracetest out " in line for line in lines), (attempt, lines)


def test_the_trace_ends_cleanly_when_the_agent_replaced_the_table_meanwhile(make_netns):
    """The agent's full resync replaces the table (trace chains included) while a trace waits:
    the trace's clean-up then finds nothing to delete, and must not fail for it."""
    from nftpolicy.agent.cli.commands.trace import traced
    from nftpolicy.agent.dataplane.nftables import NftDataplane
    from nftpolicy.translators.rules import Config
    from nftpolicy.translators.verdict import Connection

    ns = make_netns()
    rules = subprocess.run([NFTPOLICY, "render", "--node", "node1", SHOP], capture_output=True, text=True, check=True).stdout
    nft(ns, "-f", "-", stdin=rules)
    before = nft(ns, "list", "table", "inet", "nftpolicy")
    with traced(NftDataplane("nftpolicy", ns), Config(), Connection("10.244.1.10", "10.244.2.10", "TCP", 5432)):
        assert len(trace_chains(ns)) == 3
        nft(ns, "-f", "-", stdin=rules)  # a full replace, as the agent's resync commits
    assert nft(ns, "list", "table", "inet", "nftpolicy") == before


def test_sctp_without_kernel_sctp_is_one_line():
    """The sandbox cannot send SCTP on a kernel without it (as in many CI kernels): one line and
    exit 2, not a socket traceback; with SCTP the packet is traced."""
    from nftpolicy.agent.testbed.probes import sctp_supported

    result = trace("--from", "shop/frontend", "--to", "shop/db", "--port", "sctp/5432", SHOP)
    assert "Traceback" not in result.stderr
    if sctp_supported():
        assert result.returncode == 1 and result.stdout.startswith("TRACE  shop/frontend-7d9c8b6f5-x2k4p -> shop/db-0 SCTP/5432: refused")
    else:
        assert (result.returncode, result.stderr) == (2, "nftpolicy: --port sctp/5432: this kernel has no SCTP, so the sandbox cannot send it\n")


def test_a_policy_rule_is_named_from_the_model_by_its_handle_whatever_its_comment():
    # The monitor prints each rule's handle; the listing gives the handle's place in its chain,
    # and the layout rule at that place has the policy, direction and index as data: a comment
    # cut at nft's 128 bytes loses nothing.
    from nftpolicy.translators import layout
    from nftpolicy.translators.noderender import build_rule_model
    from nftpolicy.agent.cli.commands.trace import follow, listed_rules

    from .fakeapi import namespace
    from .test_rules import cluster_of, labels, netpol, pod

    name = "a-very-long-policy-name-" + "x" * 229
    cluster = cluster_of(namespace("x"), pod("x/a", "10.0.0.1", app="a"), pod("x/b", "10.0.0.2", app="b"),
                         netpol(f"x/{name}", labels(app="b"), ingress=[
                             {"from": [{"podSelector": labels(app="nobody")}]}, {"from": [{"podSelector": labels(app="a")}]}]))
    model = build_rule_model(cluster, None)
    listing, handles = [], {}
    for chain in layout.table(model).chains:
        for i, rule in enumerate(chain.rules):
            handles[(chain.name, i)] = handle = len(listing) + 10
            listing.append({"rule": {"chain": chain.name, "handle": handle, "comment": rule.comment[:128]}})
    policy_chain, pod_chain = model.policy_chains[0].name, model.pod_chains[0].name
    trace_chain = layout.trace_chains("c0ffee01", "10.0.0.1", "10.0.0.2", "TCP", 80)[1].name
    lines = [f"trace id 1 inet nftpolicy {trace_chain} rule meta nftrace set 1 # handle 3 (verdict continue)",
             f"trace id 1 inet nftpolicy {pod_chain} rule ip daddr 10.0.0.2 jump {policy_chain} # handle {handles[(pod_chain, 3)]} (verdict jump {policy_chain})",
             f"trace id 1 inet nftpolicy {policy_chain} unknown rule handle {handles[(policy_chain, 1)]} (verdict return)"]
    steps = follow(lines, "nftpolicy", "c0ffee01", listed_rules(listing, model), {})
    assert [s.what for s in steps][1] == f"policy x/{name} ingress rule 1 (allows)"
    assert steps[0].what.startswith("pod x/b")


def test_what_the_plugin_runs_in_the_agent_pods_names_the_policy_while_the_client_retries():
    """``kubectl nftpolicy trace`` of the real-node run (tests/e2e_node.py, its plugin-check pods
    and policy, client on node1 and server on node2) with the cluster as a sandbox: in each node's
    namespace the command the plugin runs in that node's agent pod (:func:`trace_argv`: node mode,
    ``--agent`` at a debug endpoint serving that node's model), both at once, while the client
    opens a new connection every 0.2 s until both end; the joined answers and the first non-zero
    exit code pass the real-node run's check (:func:`tests.e2e_node.trace_problem`)."""
    from concurrent.futures import ThreadPoolExecutor

    from nftpolicy.agent.cli.kubectl.trace import trace_argv
    from nftpolicy.agent.daemon.debughttp import serve_debug
    from nftpolicy.agent.testbed.probes import ProbeSpec
    from nftpolicy.agent.testbed.sandbox import Sandbox
    from nftpolicy.translators.manifests import build_cluster
    from nftpolicy.translators.verdict import enforcement_of, node_json

    from .e2e_node import PLUGIN_NAMESPACE, plugin_objects, trace_problem

    objects: list = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": PLUGIN_NAMESPACE}}, *plugin_objects("node1", "node2")]
    for obj, ip in zip(objects[1:3], ("10.244.1.10", "10.244.2.10")):
        obj["status"] = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}
    cluster, invalid = build_cluster(("e2e_node", obj) for obj in objects)
    assert not invalid
    nodes = ["node1", "node2"]
    with Sandbox(cluster.pods.values(), nodes) as sandbox:
        cluster = sandbox.with_sandbox_pods(cluster)
        sandbox.apply(cluster)
        engine = enforcement_of(cluster, nodes)
        client, server = (next(p for p in cluster.pods.values() if p.name == name) for name in ("client", "server"))
        debug = {node: serve_debug("127.0.0.1:0", lambda node=node: node_json(node, engine.models[node], cluster.pods.values()))
                 for node in nodes}
        try:
            for port in (81, 80):
                procs = []
                for node in nodes:
                    agent = {"spec": {"containers": [{"name": "agent", "env": [
                        {"name": "NFTPOLICY_DEBUG_ADDRESS", "value": f"127.0.0.1:{debug[node].server_address[1]}"}]}]}}
                    argv = trace_argv(agent, client.ips[0], server.ips[0], f"TCP/{port}", 20)
                    procs.append(subprocess.Popen([NFTPOLICY, *argv[1:], "--netns", sandbox.node_netns(node)],
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
                with ThreadPoolExecutor(len(procs)) as pool:
                    outputs = pool.map(lambda proc: proc.communicate(timeout=60), procs)
                    connections = 0
                    while any(proc.poll() is None for proc in procs) and connections < 100:
                        sandbox.connect(client.key, server.ips[0], ProbeSpec(port, "TCP"))
                        connections += 1
                        time.sleep(0.2)
                    results = [(proc.returncode, *output) for proc, output in zip(procs, outputs)]
                out = "".join(o for _, o, _ in results)
                code = next((c for c, _, _ in results if c), 0)
                assert all(c in (0, 1) for c, _, _ in results), results
                assert trace_problem(port, code, out) is None, (trace_problem(port, code, out), out, [e for _, _, e in results])
        finally:
            for server_ in debug.values():
                server_.shutdown()
                server_.server_close()


def test_a_rule_that_matched_a_learned_address_names_the_dns_name_that_taught_it():
    """trace --agent: the agent's debug model carries what it learned from DNS answers; the
    domainNames rule that matched the traced destination says which name's answer put it there."""
    from nftpolicy.translators import layout
    from nftpolicy.translators.manifests import build_cluster
    from nftpolicy.translators.noderender import build_rule_model
    from nftpolicy.agent.cli.commands.trace import listed_rules, rule_text
    from nftpolicy.translators.verdict import Connection

    from .test_domain_names import NAMESPACE, POD, POLICY

    cluster, errors = build_cluster(("test", obj) for obj in (NAMESPACE, POD, POLICY))
    assert not errors
    model = build_rule_model(cluster, "node-1")
    [domain_set] = [s.name for s in model.sets if s.kind == "domain" and s.family == "ipv4"]
    listing = [{"rule": {"chain": chain.name, "handle": 10 + i * 100 + j, "comment": rule.comment}}
               for i, chain in enumerate(layout.table(model).chains) for j, rule in enumerate(chain.rules)]
    learned = {domain_set: {"203.0.113.7": "edge.cdnhost.net (www.partner.example)"}}
    source = POD["status"]["podIP"]
    found = listed_rules(listing, model, learned, Connection(source, "203.0.113.7", "TCP", 443))
    taught = [rule_text(listed) for listed in found.values() if listed.taught]
    assert len(taught) == 1 and taught[0].endswith("; 203.0.113.7 learned from the DNS answer for edge.cdnhost.net (www.partner.example)")
    assert "partner" in taught[0]
    other = listed_rules(listing, model, learned, Connection(source, "203.0.113.8", "TCP", 443))
    assert not any(listed.taught for listed in other.values())  # an address nobody's answer taught


def test_a_peer_chain_rule_names_its_rule_and_the_peer_that_matched():
    """A rule of several peers and ports: its port match says it goes on to the peers, and the
    peer chain's rule names the policy rule and, of its union set's peers, the one that gives
    the traced source (from the model); without the connection, what the union set selects."""
    from nftpolicy.translators import layout
    from nftpolicy.translators.verdict import Connection
    from nftpolicy.agent.cli.commands.trace import listed_rules, rule_text

    from .test_rules import _peers_by_ports

    model = _peers_by_ports(3, 3)
    listing = [{"rule": {"chain": chain.name, "handle": 10 + i * 100 + j, "comment": rule.comment}}
               for i, chain in enumerate(layout.table(model).chains) for j, rule in enumerate(chain.rules)]
    words = {rule_text(listed) for listed in listed_rules(listing, model, None, Connection("10.0.1.1", "10.0.0.1", "TCP", 1001)).values()}
    assert "policy x/p ingress rule 0: a port of it, to its peers" in words
    assert "policy x/p ingress rule 0 (allows pods in x: app=p1)" in words
    unknown = {rule_text(listed) for listed in listed_rules(listing, model).values()}
    assert "policy x/p ingress rule 0 (allows 3 peers: pods in x: app=p0; pods in x: app=p1; pods in x: app=p2)" in unknown


def test_a_union_set_rule_of_a_policy_chain_names_the_peer_that_gave_the_address():
    """Several peers and one port: one rule with the union set in the policy chain itself; trace
    names the peer of the union that holds the traced source."""
    from nftpolicy.translators import layout
    from nftpolicy.translators.verdict import Connection
    from nftpolicy.agent.cli.commands.trace import listed_rules, rule_text

    from .test_rules import _peers_by_ports

    model = _peers_by_ports(3, 1)
    listing = [{"rule": {"chain": chain.name, "handle": 10 + i * 100 + j, "comment": rule.comment}}
               for i, chain in enumerate(layout.table(model).chains) for j, rule in enumerate(chain.rules)]
    words = {rule_text(listed) for listed in listed_rules(listing, model, None, Connection("10.0.1.2", "10.0.0.1", "TCP", 1000)).values()}
    assert "policy x/p ingress rule 0 (allows pods in x: app=p2)" in words
