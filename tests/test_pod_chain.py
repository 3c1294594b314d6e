"""The pod chains' walk (translators/layout.py ``pod_chain``: one chain per pod and isolated
direction), packet by packet through the decided table (the table walk, translators/tablewalk.py):
the verdicts, and what a new connection costs. "The first allow ends the walk": once a
direction's policies set the mark the packet leaves that pod chain, so it never walks another
policy chain, the node check or the rejects; a policy chain without rules (a deny-all policy's) is
never jumped to. A pod reaching itself through a Service (hairpin: after DNAT its address is both
source and destination) walks its ingress chain and then its egress chain: both directions decide.
"""

from __future__ import annotations

import pytest

from nftpolicy.translators import layout
from nftpolicy.translators.chainbuilders import POD_CHAIN_PREFIX
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.tablewalk import Connection, TableWalker, Walk

from .conftest import cluster_from_yaml

PODS = """
apiVersion: v1
kind: Namespace
metadata: {name: x}
---
apiVersion: v1
kind: Pod
metadata: {namespace: x, name: client, labels: {app: client}}
spec: {nodeName: node1, containers: [{name: c}]}
status: {phase: Running, podIP: 10.0.0.1, podIPs: [{ip: 10.0.0.1}]}
---
apiVersion: v1
kind: Pod
metadata: {namespace: x, name: server, labels: {app: server}}
spec: {nodeName: node1, containers: [{name: c}]}
status: {phase: Running, podIP: 10.0.0.2, podIPs: [{ip: 10.0.0.2}]}
"""

DENY_ALL = """
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: x, name: deny-all}
spec: {podSelector: {}, policyTypes: [Ingress, Egress]}
"""


def allow(name: str, direction: str = "ingress", port: int = 80) -> str:
    """A policy that allows client -> server on TCP ``port`` (``ingress`` on the server, or
    ``egress`` on the client)."""
    selected, peer, peers = ("server", "client", "from") if direction == "ingress" else ("client", "server", "to")
    return f"""
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{namespace: x, name: {name}}}
spec:
  podSelector: {{matchLabels: {{app: {selected}}}}}
  policyTypes: [{direction.capitalize()}]
  {direction}: [{{{peers}: [{{podSelector: {{matchLabels: {{app: {peer}}}}}}}], ports: [{{port: {port}}}]}}]
"""


def walk(manifests: str, port: int = 80) -> tuple[bool, Walk]:
    """client -> server TCP ``port`` through node1's table: (allowed, the walk)."""
    table = layout.table(build_rule_model(cluster_from_yaml(PODS + manifests), "node1"))
    walked = TableWalker(table).walk(Connection("10.0.0.1", "10.0.0.2", "TCP", port))
    return walked.allowed, walked


def pod_chain_walks(walked: Walk) -> list[tuple[list[str], int, set[str]]]:
    """Each pod chain the packet entered, in order, as (its rules walked other than the jumps to
    policy chains, by kind: the pod's name cut off the comment; how many jump rules it walked;
    the policies whose chains it walked a rule of). The jumps' order follows the chain names'
    hashes, so it is left out."""
    walks: list[tuple[list[str], int, set[str]]] = []
    for chain, comment in ((step.chain, step.rule.comment) for step in walked.steps):
        if chain.startswith(tuple(POD_CHAIN_PREFIX.values())):
            kind = comment.split(" ", 1)[1]
            if kind == "common":
                walks.append(([], 0, set()))
            rules, jumps, policies = walks[-1]
            if kind in ("ingress", "egress"):
                walks[-1] = (rules, jumps + 1, policies)
            else:
                rules.append(kind)
        elif chain.startswith("KUBE-NWPLCY-") and chain not in (layout.COMMON_CHAIN, layout.DEFAULT_CHAIN):
            walks[-1][2].add(comment.split(" ")[0])
    return walks


CASES = {  # manifests -> (allowed, the server's pod chain walk, then the client's)
    "allowed both ways": (DENY_ALL + allow("in") + allow("out", "egress"), True, [
        (["common", "start unmarked", "ingress allowed"], 1, {"x/in"}),  # x/in (deny-all's chain is empty: not jumped)
        (["common", "start unmarked", "egress allowed"], 1, {"x/out"})]),  # no ingress jump, so no "allowed" test; x/out out
    "no policy isolates the client": (allow("in"), True, [
        (["common", "start unmarked", "ingress allowed"], 1, {"x/in"})]),
    "refused": (DENY_ALL + allow("in", port=81), False, [
        (["common", "start unmarked", "ingress allowed", "from the local node",
          "log rejected ingress", "reject ingress"], 1, {"x/in"})]),  # x/in's rule walked, not matched; egress: deny-all only
}


@pytest.mark.parametrize("case", CASES)
def test_walk(case):
    manifests, allowed, expected = CASES[case]
    verdict, walked = walk(manifests)
    assert (verdict, pod_chain_walks(walked)) == (allowed, expected)


def test_fifty_allowing_policies_cost_one_policy_chain():
    """50 policies that each allow the connection: the first one jumped sets the mark, the other
    49 jump rules are each one mark test, and the walk leaves at "ingress allowed"."""
    verdict, walked = walk("".join(allow(f"p{i:02d}") for i in range(50)))
    ((rules, jumps, policies),) = pod_chain_walks(walked)
    assert (verdict, rules, jumps, len(policies)) == (True, ["common", "start unmarked", "ingress allowed"], 50, 1)


def test_the_walk_counts_what_a_new_connection_costs():
    """The walk's cost counters: a policy-isolated server, an unisolated client. Dispatch on the
    destination (a map look-up and a jump), the pod chain's jump to COMMON and to the policy
    chain, whose one rule looks the client up in a set and counts the packet; the source's
    dispatch finds no pod chain (a look-up, no jump)."""
    verdict, walked = walk(allow("in"))
    assert verdict
    assert (walked.lookups, walked.jumps, walked.counters) == (3, 3, 1)


def test_hairpin_walks_the_ingress_chain_then_the_egress_chain():
    """The server reaching itself through a Service (after the DNAT its address is both source and
    destination): its ingress chain allows and returns, then its egress chain refuses. With one
    chain for both directions the ingress "allowed" return ended the walk (tests/test_hairpin.py
    has it with real packets)."""
    table = layout.table(build_rule_model(cluster_from_yaml(PODS + """
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: x, name: in-all-egress-dns}
spec:
  podSelector: {matchLabels: {app: server}}
  policyTypes: [Ingress, Egress]
  ingress: [{}]
  egress: [{ports: [{port: 53, protocol: UDP}]}]
"""), "node1"))
    walked = TableWalker(table).walk(Connection("10.0.0.2", "10.0.0.2", "TCP", 80))
    entered = [step.chain for step in walked.steps if step.rule.comment.endswith(" common")]
    assert [c[:len("KUBE-POD-IN-")] for c in entered] == ["KUBE-POD-IN-", "KUBE-POD-EG-"]
    assert not walked.allowed and walked.ended_by.rule.comment == "x/server reject egress"
