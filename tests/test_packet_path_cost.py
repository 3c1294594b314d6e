"""``bench/packet_path.py``'s cost of a real ruleset (kube-router's, loaded by kube-router): one
new connection's first packet traced by the kernel (``nft monitor trace``) and counted against
the ruleset's listing. Checked here on tiny rulesets whose walk is known by hand, loaded with the
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

# FORWARD: 3 rules evaluated (the third accepts); POD-IN: 2 of 3 (its second returns), the jump
# into ALLOW-IN falls through it (2 rules, one a set match), into EMPTY (no rule); POD-EG: both
# rules, the second (a set match) marks and the chain ends without a verdict. Rules 3+2+2+0+2 = 9,
# set look-ups 2 (ALLOW-IN's and POD-EG's), jumps 4, rules that matched 7.
RULESET = f"""*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POD-IN - [0:0]
:POD-EG - [0:0]
:ALLOW-IN - [0:0]
:EMPTY - [0:0]
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
        cost = packet_path.trace_new_connection(sandbox, "node1", CLIENT, SERVER, PORT)
    finally:
        in_node(sandbox, "iptables-nft", "-F")
    assert cost == {"rules": 9, "lookups": 2, "jumps": 4, "counters": 7}


def test_an_nft_walk_ends_at_its_accept_and_counts_its_set_lookups(sandbox):
    client, server = (sandbox.pods[k].addresses("ipv4")[0] for k in (CLIENT, SERVER))
    table = f"""table inet cost-test {{
    set servers {{ type ipv4_addr; elements = {{ {server} }} }}
    chain forward {{ type filter hook forward priority 0; policy drop;
        ct state established accept
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
        cost = packet_path.trace_new_connection(sandbox, "node1", CLIENT, SERVER, PORT)
    finally:
        in_node(sandbox, "nft", "delete", "table", "inet", "cost-test")
    # forward: 2 rules (the second jumps, with the set look-up); pod: 2 (the second accepts)
    assert cost == {"rules": 4, "lookups": 1, "jumps": 1, "counters": 1}


def test_the_trace_events_of_another_packet_are_not_counted():
    chains = {("ip", "filter", "FORWARD"): [{"handle": 5, "expr": [{"counter": None}, {"accept": None}]}]}
    lines = ["trace id aa ip nftpolicy-bench-trace syn packet: iif \"vp0\"",
             "trace id aa ip filter FORWARD rule counter packets 0 bytes 0 accept # handle 5 (verdict accept)",
             "trace id bb ip filter FORWARD rule counter packets 0 bytes 0 accept # handle 5 (verdict accept)"]
    assert packet_path.traced_cost(lines, chains) == {"rules": 1, "lookups": 0, "jumps": 0, "counters": 1}
