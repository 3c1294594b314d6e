"""``bench/packet_path.py``'s cost of a real ruleset (kube-router's, loaded by kube-router): one
connection's packets traced by the kernel (``nft monitor trace``) and counted against the
ruleset's listing. Checked here on tiny rulesets whose walk is known by hand, loaded with the
real ``iptables-nft-restore`` and ``ipset`` (and nft) in a sandbox node's namespace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nftpolicy.agent.testbed.sandbox import Sandbox
from nftpolicy.translators.model import Pod

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import packet_path  # noqa: E402

pytestmark = pytest.mark.kernel

CLIENT, SERVER, PORT = "a/client", "a/server", 8080

# The first packet: FORWARD: 4 rules evaluated (the fourth accepts); POD-IN: 2 of 3 (its second
# returns), the jump into ALLOW-IN falls through it (2 rules, one a set match), into EMPTY (no
# rule); POD-EG: both rules, the second (a set match) marks and the chain ends without a verdict.
# Rules 4+2+2+0+2 = 10, set look-ups 2 (ALLOW-IN's and POD-EG's), jumps 4, rules that matched 7.
# Each later packet: the first rule accepts it.
RULESET = f"""*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POD-IN - [0:0]
:POD-EG - [0:0]
:ALLOW-IN - [0:0]
:EMPTY - [0:0]
-A FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A FORWARD -d {{server}}/32 -j POD-IN
-A FORWARD -s {{client}}/32 -j POD-EG
-A FORWARD -p tcp --dport {PORT} -j ACCEPT
-A FORWARD -j DROP
-A POD-IN -j ALLOW-IN
-A POD-IN -p tcp -j RETURN
-A POD-IN -j DROP
-A ALLOW-IN -p udp -j DROP
-A ALLOW-IN -m set --match-set NOT-THE-CLIENT src -j DROP
-A POD-EG -j EMPTY
-A POD-EG -m set --match-set THE-SERVER dst -j MARK --set-xmark 0x10000/0x10000
COMMIT
"""


@pytest.fixture(scope="module")
def sandbox():
    pods = [Pod("a", "client", {}, "node1", ("10.244.0.10",)), Pod("a", "server", {}, "node1", ("10.244.0.20",))]
    with Sandbox(pods, dataplane="iptables-nft") as built:
        yield built


def in_node(sandbox: Sandbox, *argv: str, stdin: str | None = None) -> None:
    subprocess.run(["ip", "netns", "exec", sandbox.node_netns("node1"), *argv], input=stdin, text=True, check=True)


def test_a_known_iptables_walk_is_counted_rule_by_rule(sandbox):
    client, server = (sandbox.pods[k].addresses("ipv4")[0] for k in (CLIENT, SERVER))
    in_node(sandbox, "ipset", "create", "NOT-THE-CLIENT", "hash:ip", "-exist")
    in_node(sandbox, "ipset", "create", "THE-SERVER", "hash:ip", "-exist")
    in_node(sandbox, "ipset", "add", "THE-SERVER", server, "-exist")
    in_node(sandbox, "iptables-nft-restore", stdin=RULESET.format(server=server, client=client))
    try:
        cost = packet_path.trace_connection(sandbox, "node1", CLIENT, SERVER, PORT)
    finally:
        in_node(sandbox, "iptables-nft", "-F")
    assert cost["first"] == {"rules": 10, "lookups": 2, "jumps": 4, "counters": 7}
    assert len(cost["later"]) >= 2 and set(cost["later"]) == {1}  # the SYN-ACK, the ACK, the reset, ...


def test_an_nft_walk_ends_at_its_accept_and_counts_its_set_lookups(sandbox):
    client, server = (sandbox.pods[k].addresses("ipv4")[0] for k in (CLIENT, SERVER))
    table = f"""table inet cost-test {{
    set servers {{ type ipv4_addr; elements = {{ {server} }} }}
    chain forward {{ type filter hook forward priority 0; policy drop;
        ct state established accept
        ip daddr 10.0.0.2 drop
        ip daddr @servers jump pod
        counter drop
    }}
    chain pod {{
        ip saddr 10.0.0.1 drop
        ip saddr {client} counter accept
        drop
    }}
}}
"""
    in_node(sandbox, "nft", "-f", "-", stdin=table)
    try:
        cost = packet_path.trace_connection(sandbox, "node1", CLIENT, SERVER, PORT)
    finally:
        in_node(sandbox, "nft", "delete", "table", "inet", "cost-test")
    # forward: 3 rules (the third jumps, with the set look-up); pod: 2 (the second accepts)
    assert cost["first"] == {"rules": 5, "lookups": 1, "jumps": 1, "counters": 1}
    assert len(cost["later"]) >= 2 and set(cost["later"]) == {1}


def test_packets_are_told_apart_by_their_marking_and_their_trace_id():
    chains = {("ip", "filter", "FORWARD"): [{"handle": 4, "expr": [{"jump": {"target": "POD"}}]},
                                            {"handle": 5, "expr": [{"counter": None}, {"accept": None}]}],
              ("ip", "filter", "POD"): [{"handle": 6, "expr": [{"return": None}]}]}
    mark = "ip nftpolicy-bench-trace pair packet: iif \"vp0\""
    accept = "ip filter FORWARD rule counter packets 0 bytes 0 accept # handle 5 (verdict accept)"
    lines = [f"trace id aa {mark}", "trace id aa ip filter FORWARD rule jump POD # handle 4 (verdict jump POD)",
             f"trace id bb {mark}",  # a second packet in flight at once
             "trace id aa ip filter POD rule return # handle 6 (verdict return)",
             f"trace id bb {accept}", f"trace id aa {accept}",
             f"trace id aa {mark}", f"trace id aa {accept}",  # a later packet, the same trace id
             f"trace id cc {accept}"]  # not marked by the bench: not counted
    assert packet_path.traced_costs(lines, chains) == [{"rules": 3, "lookups": 0, "jumps": 1, "counters": 1},
                                                       {"rules": 2, "lookups": 0, "jumps": 0, "counters": 1},
                                                       {"rules": 2, "lookups": 0, "jumps": 0, "counters": 1}]
