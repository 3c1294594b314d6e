"""Nothing passes in silence: a --node without pods and pods in namespaces that were not given
are each a warning line, and with --strict exit 2 (paths without objects and a sandbox that
would probe nothing: tests/test_first_contact.py)."""

from __future__ import annotations

import pytest

from .conftest import REPO
from .test_cli import run

SHOP = REPO / "examples" / "shop"
POD_IN_OPS = """
apiVersion: v1
kind: Pod
metadata: {namespace: ops, name: p, labels: {app: p}}
spec: {nodeName: node1, containers: [{name: c}]}
status: {phase: Running, podIP: 10.244.1.50}
"""
POD_ON_A_NODE_TYPO = """
apiVersion: v1
kind: List
items:
  - {apiVersion: v1, kind: Node, metadata: {name: node1}}
  - {apiVersion: v1, kind: Namespace, metadata: {name: ops}}
  - apiVersion: v1
    kind: Pod
    metadata: {namespace: ops, name: p, labels: {app: p}}
    spec: {nodeName: nodee1, containers: [{name: c}]}
    status: {phase: Running, podIP: 10.244.1.50}
"""
NAMESPACE_NOTE = ("their labels are unknown, so a namespaceSelector sees only kubernetes.io/metadata.name "
                  "(add the Namespace objects to the manifests)")


@pytest.mark.parametrize(("args", "stdin", "warning"), [
    (["--node", "node7", str(SHOP)], None, "no pod runs on node node7 (--node) and no Node object has that name; the nodes named: node1, node2"),
    (["-"], POD_IN_OPS, f"pods in namespaces without a Namespace object: ops; {NAMESPACE_NOTE}"),
    (["-"], POD_ON_A_NODE_TYPO, "pods run on nodes that no Node object names: nodee1 (spec.nodeName); the Node objects: "
                                "node1; such a node has no labels or addresses for a nodes peer"),
])
def test_render_warns_and_strict_refuses(args, stdin, warning):
    out = run("render", *args, stdin=stdin)
    assert (out.returncode, out.stderr) == (0, f"nftpolicy: warning: {warning}\n")
    assert "table inet nftpolicy" in out.stdout
    strict = run("render", "--strict", *args, stdin=stdin)
    assert (strict.returncode, strict.stderr, strict.stdout) == (2, f"nftpolicy: warning: {warning}\n", "")


def test_the_example_gets_no_warning():
    out = run("render", "--strict", "--node", "node1", str(SHOP))
    assert (out.returncode, out.stderr) == (0, "")


def test_compare_warns_about_a_node_without_pods():
    dumps = REPO / "tests" / "fixtures" / "kube-router-v2.1.0" / "shop"
    out = run("compare", "--strict", "--node", "node7", "--iptables-save", str(dumps / "node1.iptables-save"),
              "--ipset-save", str(dumps / "node1.ipset-save"), str(SHOP))
    assert (out.returncode, out.stderr) == (2, "nftpolicy: warning: no pod runs on node node7 (--node) and no Node object has that name; the nodes named: node1, node2\n")


@pytest.mark.kernel
@pytest.mark.parametrize(("args", "warning"), [
    (["--node", "node1", "--node", "node3"], "no pod runs on node node3 (--node): every pod has another spec.nodeName"),
])
def test_sandbox_warns_and_strict_refuses(args, warning):
    out = run("sandbox", *args, str(SHOP))
    assert out.returncode == 0 and out.stderr == f"nftpolicy: warning: {warning}\n", out.stderr
    strict = run("sandbox", "--strict", *args, str(SHOP))
    assert (strict.returncode, strict.stderr, strict.stdout) == (2, f"nftpolicy: warning: {warning}\n", "")


def test_strict_renders_a_fresh_node_that_runs_no_pod_yet(tmp_path):
    """A Node object that runs no pod is a fresh node, no mistake (issue 18 item 10: the
    ClusterNetworkPolicy cases' empty second node); a node nothing names is still refused."""
    fresh = tmp_path / "fresh.yaml"
    fresh.write_text("apiVersion: v1\nkind: Node\nmetadata: {name: node3}\n")
    out = run("render", "--strict", "--node", "node3", str(SHOP), str(fresh))
    assert (out.returncode, out.stderr) == (0, "")
    assert "table inet nftpolicy" in out.stdout and "chain KUBE-POD-" not in out.stdout
    unnamed = run("render", "--strict", "--node", "node4", str(SHOP), str(fresh))
    assert (unnamed.returncode, unnamed.stderr) == (
        2, "nftpolicy: warning: no pod runs on node node4 (--node) and no Node object has that name; "
           "the nodes named: node1, node2, node3\n")
