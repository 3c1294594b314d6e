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
POLICY_IN_A_NAMESPACE_TYPO = """
apiVersion: v1
kind: List
items:
  - {apiVersion: v1, kind: Namespace, metadata: {name: ops}}
  - apiVersion: networking.k8s.io/v1
    kind: NetworkPolicy
    metadata: {namespace: opps, name: deny}
    spec: {podSelector: {}}
"""
# A pod with container ports web/TCP and metrics/TCP, a server policy naming 'http' (a typo), and a
# client policy whose egress names 'web' over UDP (the wrong protocol) toward the server pods.
PORT_NAME_TYPOS = """
apiVersion: v1
kind: List
items:
  - {apiVersion: v1, kind: Namespace, metadata: {name: ops}}
  - apiVersion: v1
    kind: Pod
    metadata: {namespace: ops, name: server, labels: {app: server}}
    spec: {nodeName: node1, containers: [{name: c, ports: [{name: web, containerPort: 80}, {name: metrics, containerPort: 9100}]}]}
    status: {phase: Running, podIP: 10.244.1.50}
  - apiVersion: v1
    kind: Pod
    metadata: {namespace: ops, name: client, labels: {app: client}}
    spec: {nodeName: node1, containers: [{name: c}]}
    status: {phase: Running, podIP: 10.244.1.51}
  - apiVersion: networking.k8s.io/v1
    kind: NetworkPolicy
    metadata: {namespace: ops, name: server}
    spec:
      podSelector: {matchLabels: {app: server}}
      ingress: [{ports: [{port: web}, {port: http}]}]
  - apiVersion: networking.k8s.io/v1
    kind: NetworkPolicy
    metadata: {namespace: ops, name: client}
    spec:
      podSelector: {matchLabels: {app: client}}
      policyTypes: [Egress]
      egress: [{to: [{podSelector: {matchLabels: {app: server}}}], ports: [{port: web, protocol: UDP}]}]
"""
def stopped(warnings: str) -> str:
    """--strict's last line after ``warnings`` (one or more warning lines, the first unprefixed)."""
    count = warnings.count("\nnftpolicy: warning: ") + 1
    return f"nftpolicy: --strict: stopped on {count} {'warning' if count == 1 else 'warnings'} (exit 2)\n"


NAMESPACE_NOTE = ("their labels are unknown, so a namespaceSelector sees only kubernetes.io/metadata.name "
                  "(add the Namespace objects to the manifests)")


@pytest.mark.parametrize(("args", "stdin", "warning"), [
    (["--node", "node7", str(SHOP)], None, "no pod runs on node node7 (--node) and no Node object has that name; the nodes named: node1, node2"),
    (["-"], POD_IN_OPS, f"pods in namespaces without a Namespace object: ops; {NAMESPACE_NOTE}"),
    (["-"], POD_ON_A_NODE_TYPO, "pods run on nodes that no Node object names: nodee1 (spec.nodeName); the Node objects: "
                                "node1; such a node has no labels or addresses for a nodes peer"),
    (["-"], POLICY_IN_A_NAMESPACE_TYPO, "NetworkPolicies in namespaces that no Namespace object or pod names: opps/deny; "
                                        "the API server refuses a policy in a namespace that does not exist (a typo, most likely)"),
    (["-"], PORT_NAME_TYPOS, "NetworkPolicy ops/client: egress rule 0 names port 'web' (UDP), which none of the pods its peers "
                             "select has; their port names: metrics/TCP, web/TCP\n"
                             "nftpolicy: warning: NetworkPolicy ops/server: ingress rule 0 names port 'http' (TCP), which none "
                             "of the pods it selects has; their port names: metrics/TCP, web/TCP"),
])
def test_render_warns_and_strict_refuses(args, stdin, warning):
    out = run("render", *args, stdin=stdin)
    assert (out.returncode, out.stderr) == (0, f"nftpolicy: warning: {warning}\n")
    assert "table inet nftpolicy" in out.stdout
    strict = run("render", "--strict", *args, stdin=stdin)
    assert (strict.returncode, strict.stderr, strict.stdout) == (2, f"nftpolicy: warning: {warning}\n{stopped(warning)}", "")


def test_the_example_gets_no_warning():
    out = run("render", "--strict", "--node", "node1", str(SHOP))
    assert (out.returncode, out.stderr) == (0, "")


def test_compare_warns_about_a_node_without_pods():
    dumps = REPO / "tests" / "fixtures" / "kube-router-v2.1.0" / "shop"
    out = run("compare", "--strict", "--node", "node7", "--iptables-save", str(dumps / "node1.iptables-save"),
              "--ipset-save", str(dumps / "node1.ipset-save"), str(SHOP))
    warning = "no pod runs on node node7 (--node) and no Node object has that name; the nodes named: node1, node2"
    assert (out.returncode, out.stderr) == (2, f"nftpolicy: warning: {warning}\n{stopped(warning)}")


@pytest.mark.kernel
@pytest.mark.parametrize(("args", "warning"), [
    (["--node", "node1", "--node", "node3"], "no pod runs on node node3 (--node): every pod has another spec.nodeName"),
])
def test_sandbox_warns_and_strict_refuses(args, warning):
    out = run("sandbox", *args, str(SHOP))
    assert out.returncode == 0 and out.stderr == f"nftpolicy: warning: {warning}\n", out.stderr
    strict = run("sandbox", "--strict", *args, str(SHOP))
    assert (strict.returncode, strict.stderr, strict.stdout) == (2, f"nftpolicy: warning: {warning}\n{stopped(warning)}", "")


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
           "the nodes named: node1, node2, node3\nnftpolicy: --strict: stopped on 1 warning (exit 2)\n")


@pytest.mark.parametrize("stdin", [POLICY_IN_A_NAMESPACE_TYPO, PORT_NAME_TYPOS])
def test_explain_warns_as_render_does(stdin):
    """explain reads the same manifests, so it warns of the same mistakes (issue 34 items 4, 6)."""
    rendered = run("render", "-", stdin=stdin)
    out = run("explain", "--from", "ops/client" if "client" in stdin else "10.0.0.1", "--to", "10.0.0.2", "-", stdin=stdin)
    assert rendered.stderr and out.stderr.startswith(rendered.stderr), out.stderr
    strict = run("explain", "--strict", "--from", "10.0.0.1", "--to", "10.0.0.2", "-", stdin=stdin)
    assert (strict.returncode, strict.stderr) == (2, rendered.stderr + stopped(rendered.stderr.strip()))


DUMPED_POD = """
apiVersion: v1
kind: List
items:
  - {apiVersion: v1, kind: Namespace, metadata: {name: ops, resourceVersion: "17"}}
  - apiVersion: v1
    kind: Pod
    metadata: {namespace: ops, name: p, resourceVersion: "18", labels: {app: p}}
    spec: {nodeName: node1, containers: [{name: c}]}
    status: {phase: Running, podIP: 10.244.1.50}
"""
ADMIN_DENY = """
---
apiVersion: policy.networking.k8s.io/v1beta1
kind: ClusterNetworkPolicy
metadata: {name: deny-ops, resourceVersion: "19"}
spec:
  tier: Admin
  priority: 10
  subject: {namespaces: {}}
  egress: [{name: no-out, action: Deny, to: [{networks: [0.0.0.0/0]}]}]
"""


@pytest.mark.parametrize(("stdin", "noted"), [(DUMPED_POD, True), (DUMPED_POD + ADMIN_DENY, False),
                                              (DUMPED_POD.replace('resourceVersion: "17"', "").replace('resourceVersion: "18", ', ""), False)])
def test_a_dump_without_cluster_network_policies_is_noted(stdin, noted):
    """A dump (objects the API server served) without a ClusterNetworkPolicy was most likely
    taken with the kinds of before them: explain says so and how to dump, even with --strict (a
    cluster without any dumps alike); manifests to be created are not a dump (issue 34 item 1)."""
    out = run("explain", "--strict", "--from", "ops/p", "--to", "10.0.0.1", "-", stdin=stdin)
    line = ("nftpolicy: note: these manifests are a dump of a cluster (objects with metadata.resourceVersion) without a "
            "ClusterNetworkPolicy; if the cluster has any, the verdicts here lack them: "
            "kubectl get pods,namespaces,networkpolicies,nodes,clusternetworkpolicies -A -o yaml\n")
    assert (line in out.stderr) == noted, out.stderr
    assert out.returncode == (1 if "Deny" in stdin else 0), out.stderr + out.stdout


def test_an_object_given_twice_is_a_warning_and_the_last_one_is_used(tmp_path):
    """Duplicate objects were last-wins in silence (issue 34's earlier findings)."""
    policy = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{namespace: ops, name: p}}\nspec: {{podSelector: {{}}, policyTypes: [{}]}}\n"
    (tmp_path / "a.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: ops}\n---\n" + POD_IN_OPS + "---\n"
                                     + policy.format("Ingress"))
    (tmp_path / "b.yaml").write_text(policy.format("Egress"))
    out = run("render", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"))
    assert (out.returncode, out.stderr) == (0, f"nftpolicy: warning: NetworkPolicy ops/p is given twice ({tmp_path / 'a.yaml'}, then "
                                               f"{tmp_path / 'b.yaml'}): the last one is used\n")
    assert "reject egress ops/p" in out.stdout and "reject ingress ops/p" not in out.stdout  # b.yaml's
    assert run("render", "--strict", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml")).returncode == 2


MIXED_FAMILIES = """
apiVersion: v1
kind: List
items:
  - {apiVersion: v1, kind: Namespace, metadata: {name: ops}}
  - apiVersion: v1
    kind: Pod
    metadata: {namespace: ops, name: dual, labels: {app: dual}}
    spec: {nodeName: node1, containers: [{name: c, ports: [{containerPort: 80}]}]}
    status: {phase: Running, podIPs: [{ip: 10.244.1.50}, {ip: "fd00:10:244:1::50"}]}
  - apiVersion: v1
    kind: Pod
    metadata: {namespace: ops, name: four, labels: {app: four}}
    spec: {nodeName: node1, containers: [{name: c, ports: [{containerPort: 80}]}]}
    status: {phase: Running, podIP: 10.244.1.51}
"""


@pytest.mark.kernel
def test_sandbox_warns_of_pods_without_an_address_of_the_family_asked(tmp_path):
    """--ipv6 on manifests where some pods have no IPv6 address: their cells showed ? in silence."""
    (tmp_path / "m.yaml").write_text(MIXED_FAMILIES)
    out = run("sandbox", "--ipv6", "--timeout", "0.5", str(tmp_path / "m.yaml"))
    assert out.returncode == 0 and out.stderr == ("nftpolicy: warning: 1 pod has no ipv6 address, so no ipv6 probe from or to it "
                                                  "(its cells show ?): ops/four\n"), out.stderr
    assert run("sandbox", "--strict", "--ipv6", "--timeout", "0.5", str(tmp_path / "m.yaml")).returncode == 2


def test_explain_places_pods_on_the_nodes_given_before_it_checks_them(tmp_path):
    """Pods without spec.nodeName and no Node objects: ``explain --node n1 --node n2`` puts them
    on n1 and n2 (as sandbox and trace do), so those nodes are no typo: no warning, and
    ``--strict`` answers (a new user's trial: explain warned of both nodes and --strict exited 2)."""
    pods = tmp_path / "pods.yaml"
    pods.write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n---\n"
                    "apiVersion: v1\nkind: Pod\nmetadata: {name: one, namespace: a}\n---\n"
                    "apiVersion: v1\nkind: Pod\nmetadata: {name: two, namespace: a}\n")
    out = run("explain", "--strict", "--node", "n1", "--node", "n2", "--from", "a/one", "--to", "a/two", "--port", "80", str(pods))
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr
    assert out.stdout.startswith("ALLOWED  a/one -> a/two TCP/80"), out.stdout
    typo = run("explain", "--strict", "--node", "n1", "--node", "n2", "--node", "n3", "--from", "a/one", "--to", "a/two",
               "--port", "80", str(pods))
    assert typo.returncode == 2 and "no pod runs on node n3 (--node) and no Node object has that name; the nodes named: n1, n2" \
        in typo.stderr, typo.stderr
