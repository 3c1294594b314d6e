"""What a new user meets in the first hour (issue 22): workloads stand in their pods, a Service can
be ``explain --to``, anything left out of the input ends in a summary line and exit 3, explain
addresses pods as the sandbox does, and the small things of item 7 (the interrupts of item 1:
tests/test_interrupts.py; the variables of item 6: tests/test_flag_errors.py)."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import tomllib

import pytest
import yaml

from nftpolicy.agent.testbed import report
from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.model import Pod
from nftpolicy.translators.workloads import place_pods, services_from, stand_in_pods

from .conftest import REPO
from .test_chart import CHART, helm
from .test_cli import run

SHOP = str(REPO / "examples" / "shop")
DUMP = REPO / "tests" / "fixtures" / "kube-router-v2.1.0" / "shop"
SUMMARY = " (exit 3; --accept-skipped accepts this)"

WORKLOADS = """
apiVersion: v1
kind: Namespace
metadata: {name: demo}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: demo}
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: c, ports: [{containerPort: 8080, name: http}]}]}
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: db, namespace: demo}
spec:
  replicas: 2
  template:
    metadata: {labels: {app: db}}
    spec: {containers: [{name: c, ports: [{containerPort: 5432}]}]}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: agent, namespace: demo}
spec:
  template:
    metadata: {labels: {app: agent}}
    spec: {containers: [{name: c}]}
---
apiVersion: batch/v1
kind: CronJob
metadata: {name: report, namespace: demo}
spec:
  schedule: "0 * * * *"
  jobTemplate:
    spec:
      parallelism: 2
      template:
        metadata: {labels: {app: report}}
        spec: {containers: [{name: c}]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec: {selector: {app: web}, ports: [{port: 80, targetPort: http}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web-from-db, namespace: demo}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress: [{from: [{podSelector: {matchLabels: {app: db}}}], ports: [{port: http}]}]
"""


def _objects(text: str, nodes=("node1", "node2")):
    stood, errors = [], []
    objects = list(stand_in_pods([("w.yaml", o) for o in yaml.safe_load_all(text)], nodes, stood, errors))
    return objects, stood, errors


# ---- item 2: workloads and Services --------------------------------------------------------------

def test_each_workload_stands_in_its_pods_as_its_controller_names_them():
    objects, stood, errors = _objects(WORKLOADS)
    assert errors == []
    assert [str(s) for s in stood] == ["Deployment demo/web (2)", "StatefulSet demo/db (2)", "DaemonSet demo/agent (2)",
                                       "CronJob demo/report (2)"]
    cluster, invalid = build_cluster(objects)
    assert invalid == []
    pods = cluster.pods
    web = sorted(k for k in pods if k.startswith("demo/web-"))
    assert len(web) == 2 and all(re.fullmatch(r"demo/web-[b-z2-9]{10}-[b-z2-9]{5}", k) for k in web)
    assert web[0].rsplit("-", 1)[0] == web[1].rsplit("-", 1)[0]  # one ReplicaSet
    assert pods["demo/db-1"].labels == {"app": "db", "statefulset.kubernetes.io/pod-name": "db-1", "apps.kubernetes.io/pod-index": "1"}
    assert sorted(p.node for k, p in pods.items() if k.startswith("demo/agent-")) == ["node1", "node2"]
    report_pods = [p for k, p in pods.items() if k.startswith("demo/report-")]
    assert len(report_pods) == 2 and report_pods[0].labels["job-name"] == report_pods[1].labels["batch.kubernetes.io/job-name"]
    assert [(p.name, p.port) for p in pods[web[0]].ports] == [("http", 8080)]
    assert _objects(WORKLOADS)[0] == objects  # the same file, the same names


def test_a_workload_without_a_template_or_with_a_bad_count_is_reported():
    bad = ("kind: Deployment\nmetadata: {name: a, namespace: x}\nspec: {replicas: -1, template: {spec: {}}}\n---\n"
           "kind: Job\nmetadata: {name: b}\nspec: {}\n")
    objects, stood, errors = _objects(bad)
    assert (objects, stood) == ([], [])
    assert [str(e) for e in errors] == ["Deployment x/a: spec.replicas: must be a whole number >= 0, got -1 (w.yaml)",
                                        "Job default/b: spec.template: required (an object) (w.yaml)"]


def test_services_are_read_with_their_target_ports():
    services, errors = services_from([("s", o) for o in yaml.safe_load_all(WORKLOADS)])
    assert errors == [] and list(services) == ["demo/web"]
    assert services["demo/web"].ports == (("TCP", 80, "http", ""),)


def test_render_reads_workloads_and_says_so_in_one_line(tmp_path):
    (tmp_path / "w.yaml").write_text(WORKLOADS)
    out = run("render", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines()[0] == ("nftpolicy: 4 workloads stand in 7 pods: Deployment demo/web (2), StatefulSet demo/db (2), "
                                          "DaemonSet demo/agent (1), CronJob demo/report (2)")


def test_explain_answers_for_a_service_and_a_named_port(tmp_path):
    (tmp_path / "w.yaml").write_text(WORKLOADS)
    out = run("explain", "--from", "demo/db-0", "--to", "demo/web", str(tmp_path))
    lines = out.stderr.splitlines()
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"nftpolicy: --to demo/web is a Service: its pods demo/web-\S+, demo/web-\S+; target ports TCP/http", lines[-1])
    verdicts = [line for line in out.stdout.splitlines() if not line.startswith(" ")]
    assert len(verdicts) == 2 and all(v.startswith("ALLOWED  demo/db-0 -> demo/web-") and v.endswith(" TCP/8080") for v in verdicts)
    denied = run("explain", "--from", "demo/agent", "--to", "demo/web", "--port", "80", str(tmp_path))
    assert denied.returncode == 1 and denied.stdout.count("DENIED ") == 2
    wrong = run("explain", "--from", "demo/db-0", "--to", "demo/web", "--port", "81", str(tmp_path))
    assert (wrong.returncode, wrong.stderr.splitlines()[-1]) == (2, "nftpolicy: --port 81: not a port of Service demo/web (its ports: TCP/80)")


def test_explain_to_a_service_cluster_ip_answers_for_the_services_pods(tmp_path):
    """kube-proxy (iptables or nftables mode) sends a connection to a cluster IP on to one of the
    Service's pods before any policy chain sees it: the answer is the pods', never an exemption
    of the cluster IP (a pod under a deny-all egress policy would otherwise be ALLOWED)."""
    (tmp_path / "w.yaml").write_text(WORKLOADS.replace("spec: {selector: {app: web}, ports:",
                                                      "spec: {clusterIP: 10.96.0.20, selector: {app: web}, ports:"))
    allowed = run("explain", "--from", "demo/db-0", "--to", "10.96.0.20", "--port", "80", str(tmp_path))
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stderr.splitlines()[-1].startswith("nftpolicy: --to demo/web is a Service: its pods demo/web-")
    assert [v.split()[0] for v in allowed.stdout.splitlines() if not v.startswith(" ")] == ["ALLOWED", "ALLOWED"]
    denied = run("explain", "--from", "demo/agent", "--to", "10.96.0.20", "--port", "80", str(tmp_path))
    assert denied.returncode == 1 and denied.stdout.count("DENIED ") == 2 and "service cluster IP" not in denied.stdout
    unknown = run("explain", "--from", "demo/db-0", "--to", "10.96.0.1", "--port", "443", str(tmp_path))
    assert (unknown.returncode, unknown.stderr.splitlines()[-1]) == (2, (
        "nftpolicy: --to 10.96.0.1: a service cluster IP (--service-cidr 10.96.0.0/12) of no Service in the input: the connection "
        "goes to one of the Service's pods before policy applies; give the Service as NS/NAME, or one of its pods"))


@pytest.mark.kernel
def test_the_sandbox_probes_workload_pods(tmp_path):
    (tmp_path / "w.yaml").write_text(WORKLOADS)
    out = run("sandbox", "--timeout", "0.3", "--node", "node1", "--node", "node2", "--output", "json", str(tmp_path))
    assert out.returncode == 0, out.stderr
    (section,) = json.loads(out.stdout)["sections"]
    assert len(section["pods"]) == 8  # 2 web, 2 db, 2 agents (one per node), 2 report
    cells = {(c["from"], c["to"]): c["allowed"] for m in section["matrices"] if m["port"] == 8080 for c in m["cells"]}
    web = next(p["pod"] for p in section["pods"] if p["pod"].startswith("demo/web-"))
    assert cells[("demo/db-0", web)] is True and cells[("demo/db-1", web)] is True
    assert [v for (src, dst), v in cells.items() if dst == web and src != dst and not src.startswith("demo/db-")] == [False] * 5


# ---- item 3: anything left out is a summary line and exit 3 ------------------------------------------

TYPO = """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny, namespace: shop}
spec: {podSelecter: {}}
"""


@pytest.mark.parametrize(("name", "content", "line"), [
    ("typo.yaml", TYPO, "1 skipped: NetworkPolicy shop/deny"),
    ("cidr.yaml", TYPO.replace("podSelecter: {}", "podSelector: {}, egress: [{to: [{ipBlock: {cidr: 10.0.0.300/8}}]}]"),
     "1 skipped: NetworkPolicy shop/deny"),
    ("syntax.yaml", "kind: NetworkPolicy\nmetadata: {name: [\n", "1 skipped: document #1"),
    ("binary.yaml", b"\xff\xfe\x00binary", "1 skipped: file "),
    # the second trial: a one-letter typo in kind:, a kind of another apiVersion, documents that are no objects
    ("kind.yaml", TYPO.replace("podSelecter", "podSelector").replace("kind: NetworkPolicy", "kind: NetworkPolcy"),
     "1 skipped: NetworkPolcy deny"),
    ("version.yaml", TYPO.replace("podSelecter", "podSelector").replace("networking.k8s.io/v1", "networking.k8s.io/v2"),
     "1 skipped: NetworkPolicy shop/deny"),
    ("list.yaml", "- a\n- b\n", "2 skipped: document #1 item #1, document #1 item #2"),
])
def test_skipped_input_ends_in_a_summary_and_exit_3(tmp_path, name, content, line):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for command in (["render"], ["explain", "--from", "shop/frontend", "--to", "shop/db"]):
        out = run(*command, SHOP, str(path))
        assert out.returncode == 3, out.stderr
        assert out.stderr.splitlines()[-1].startswith(f"nftpolicy: {line}") and out.stderr.endswith(SUMMARY + "\n")
        assert out.stdout  # the rest is still answered
        assert run(*command, "--accept-skipped", SHOP, str(path)).returncode in (0, 1)
        assert run(*command, "--strict", SHOP, str(path)).returncode == 2


@pytest.mark.parametrize("make", ["empty directory", "comments only"])
def test_empty_input_ends_in_a_summary_and_exit_3(tmp_path, make):
    if make == "comments only":
        (tmp_path / "x.yaml").write_text("# nothing\n")
    out = run("render", str(tmp_path))
    assert (out.returncode, out.stderr) == (3, f"nftpolicy: no Pod, Namespace, NetworkPolicy, ClusterNetworkPolicy, Node or workload found in {tmp_path}{SUMMARY}\n")
    assert out.stdout == ""  # no table for an input of nothing (issue 34: it printed one before exit 3)
    accepted = run("render", "--accept-skipped", str(tmp_path))
    assert accepted.returncode == 0 and "table inet nftpolicy" in accepted.stdout
    for command in ("explain", "trace"):  # before they look for the pods
        out = run(command, "--from", "a/b", "--to", "c/d", str(tmp_path))
        assert (out.returncode, out.stderr, out.stdout) == \
            (3, f"nftpolicy: no Pod, Namespace, NetworkPolicy, ClusterNetworkPolicy, Node or workload found in {tmp_path}{SUMMARY}\n", "")
    out = run("explain", "--accept-skipped", "--from", "a/b", "--to", "c/d", str(tmp_path))
    assert (out.returncode, out.stderr) == (2, "nftpolicy: --from a/b: no running pod with an address of that name\n")


def test_a_kind_typo_is_skipped_and_unrelated_kinds_are_not(tmp_path):
    (tmp_path / "y.yaml").write_text(TYPO.replace("podSelecter", "podSelector").replace("kind: NetworkPolicy", "kind: NetworkPolcy"))
    out = run("render", SHOP, str(tmp_path))
    assert out.returncode == 3 and out.stderr.splitlines()[0] == \
        f"nftpolicy: skipped NetworkPolcy deny: unknown kind 'NetworkPolcy', did you mean NetworkPolicy? ({tmp_path / 'y.yaml'})"
    assert run("render", "--strict", SHOP, str(tmp_path)).returncode == 2
    others = "\n---\n".join(f"apiVersion: v1\nkind: {kind}\nmetadata: {{name: o, namespace: shop}}"
                            for kind in ("ConfigMap", "Secret", "ServiceAccount", "Ingress", "AdminNetworkPolicy"))
    (tmp_path / "y.yaml").write_text(others)
    out = run("render", "--strict", SHOP, str(tmp_path))
    assert (out.returncode, out.stderr) == (0, ""), out.stderr


HOST_NETWORK = """
apiVersion: v1
kind: Node
metadata: {name: node1}
status: {addresses: [{type: InternalIP, address: 192.168.1.10}]}
---
apiVersion: v1
kind: Pod
metadata: {name: kube-proxy-x7k2p, namespace: kube-system}
spec: {nodeName: node1, hostNetwork: true, containers: [{name: c}]}
status: {phase: Running}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: default}
spec: {nodeName: node1, containers: [{name: c}]}
status: {phase: Running, podIP: 10.244.0.5}
"""


def test_explain_says_a_host_network_pod_is_one(tmp_path):
    (tmp_path / "h.yaml").write_text(HOST_NETWORK)
    out = run("explain", "--from", "default/client", "--to", "kube-system/kube-proxy", str(tmp_path))
    assert (out.returncode, out.stderr.splitlines(keepends=True)[-1]) == (2, "nftpolicy: --to kube-system/kube-proxy: kube-system/kube-proxy-x7k2p is a "
                                               "hostNetwork pod: it uses node node1's address (192.168.1.10), and NetworkPolicies "
                                               "do not apply to it; give that address\n")
    out = run("explain", "--from", "default/client", "--to", "192.168.1.10", str(tmp_path))
    assert out.returncode == 0, out.stderr


def test_explain_help_names_services_and_port_names():
    out = run("explain", "--help").stdout
    assert "a Service's NS/NAME" in " ".join(out.split()) and "a container port's name" in " ".join(out.split())


@pytest.mark.kernel
def test_a_sandbox_with_a_dropped_policy_is_not_a_success(tmp_path):
    (tmp_path / "typo.yaml").write_text(TYPO)
    out = run("sandbox", "--timeout", "0.3", SHOP, str(tmp_path))
    assert out.returncode == 3 and "TCP/5432 ipv4" in out.stdout
    assert out.stderr.splitlines()[-1] == f"nftpolicy: 1 skipped: NetworkPolicy shop/deny{SUMMARY}"


# ---- item 4: explain addresses pods as the sandbox and trace do -------------------------------------

BARE = """
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: default, labels: {app: a}}
spec: {containers: [{name: c, ports: [{containerPort: 80}]}]}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: default, labels: {app: b}}
spec: {nodeName: node2, containers: [{name: c, ports: [{containerPort: 80}]}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: b-from-nobody, namespace: default}
spec: {podSelector: {matchLabels: {app: b}}}
"""


def test_place_pods_gives_the_sandbox_addresses():
    pods = [Pod("default", "a", {}, None, ()), Pod("default", "b", {}, "node2", ()), Pod("default", "c", {}, None, ("10.1.2.3",)),
            Pod("default", "h", {}, None, (), host_network=True)]
    placed = place_pods(pods, ("node1",), ("ipv4", "ipv6"))
    assert {k: (p.node, p.ips) for k, p in placed.items()} == {
        "default/a": ("node1", ("10.244.0.10", "fd00:10:244:0::a")), "default/b": ("node2", ("10.244.1.10", "fd00:10:244:1::a")),
        "default/c": ("node1", ("10.1.2.3",))}


def test_place_pods_takes_addresses_from_the_node_s_pod_cidrs():
    """A Node with spec.podCIDRs: its stand-ins get addresses in them, as its IPAM would give (a
    new user's cluster: n1 10.244.1.0/24, n2 10.244.2.0/24; the sandbox's own 10.244.<index>
    ranges put n2's pods in n1's range, and an ipBlock with an except on n2's range allowed them);
    a node without one keeps the sandbox's range."""
    pods = [Pod("web", "a", {}, "n1", ()), Pod("web", "b", {}, "n2", ()), Pod("web", "c", {}, "n3", ())]
    placed = place_pods(pods, ("n1",), ("ipv4", "ipv6"), {"n1": ("10.244.1.0/24", "fd00:1::/64"), "n2": ("10.244.2.0/24",)})
    assert {k: p.ips for k, p in placed.items()} == {
        "web/a": ("10.244.1.10", "fd00:1::a"), "web/b": ("10.244.2.10", "fd00:10:244:1::a"),
        "web/c": ("10.244.2.11", "fd00:10:244:2::b")}  # n3's own range holds b's address: the next one


def test_a_placed_pod_never_gets_an_address_another_pod_has():
    """A Pending pod in a dump beside a running pod on 10.244.0.10 (found by a new user:
    explain answered ALLOWED default/a -> default/a)."""
    pods = [Pod("default", "a", {}, None, ()), Pod("default", "b", {}, "node1", ("10.244.0.10",))]
    placed = place_pods(pods, ("node1",), ("ipv4",))
    assert {k: p.ips for k, p in placed.items()} == {"default/a": ("10.244.0.11",), "default/b": ("10.244.0.10",)}


def test_sandbox_on_a_file_that_is_not_utf8_skips_it(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_bytes(b"kind: Pod\xff\n")
    out = run("sandbox", str(bad))
    assert out.returncode == 3, out.stderr
    assert "Traceback" not in out.stderr and "x.yaml" in out.stderr


def test_an_abbreviated_flag_is_not_taken_for_a_longer_one():
    out = run("explain", "--node-port", "30000-32767", "--from", "default/a", "--to", "default/b", "examples/shop")
    assert out.returncode == 2
    assert "--node-port-range" not in out.stderr and "--node-port" in out.stderr, out.stderr


def test_explain_accepts_a_pod_without_an_address(tmp_path):
    (tmp_path / "bare.yaml").write_text(BARE)
    out = run("explain", "--from", "default/a", "--to", "default/b", str(tmp_path))
    assert out.returncode == 1, out.stderr
    assert out.stdout.splitlines()[0] == "DENIED  default/a -> default/b TCP/80"
    assert "nftpolicy: 2 pods without status.podIP get the sandbox's addresses: default/a 10.244.0.10, default/b 10.244.1.10" in out.stderr


# ---- item 5: the chart's complete example can work; a bad CIDR value is a short line -----------------

@pytest.mark.tools("helm")
def test_the_netns_example_gets_the_capability_setns_needs():
    example = helm("template", "x", str(CHART), "-f", str(CHART / "ci" / "manifests-values.yaml")).stdout
    default = helm("template", "x", str(CHART)).stdout
    caps = [d["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]
            for d in (yaml.safe_load_all(example), yaml.safe_load_all(default)) for d in d if d and d["kind"] == "DaemonSet"]
    assert caps == [["NET_ADMIN", "SYS_ADMIN"], ["NET_ADMIN"]]


@pytest.mark.tools("helm")
def test_a_cidr_value_without_a_prefix_is_a_short_message():
    out = helm("template", "x", str(CHART), "--set-json", 'agent.serviceCidrs=["10.96.0.0"]', check=False)
    assert out.returncode != 0 and "agent.serviceCidrs.0: Does not match pattern '^[0-9A-Fa-f:.]+/[0-9]{1,3}$'" in out.stderr
    assert max(len(line) for line in out.stderr.splitlines()) < 120


# ---- item 7: the small ones --------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["render"], ["sandbox"], ["compare", "--ipset-save", "x"]])
def test_an_empty_node_name_is_refused(command):
    out = run(*command, "--node", "", SHOP)
    assert (out.returncode, out.stderr) == (2, "nftpolicy: --node: invalid node name '' (a lower-case RFC 1123 name, as Node objects have)\n")


def test_explain_takes_a_named_port_and_names_the_pods_ports_when_wrong():
    out = run("explain", "--from", "shop/frontend", "--to", "shop/db", "--port", "pg", SHOP)
    assert out.stdout.splitlines()[0].endswith(" TCP/5432"), out.stderr
    wrong = run("explain", "--from", "shop/frontend", "--to", "shop/db", "--port", "mysql", SHOP)
    assert (wrong.returncode, wrong.stderr) == (2, "nftpolicy: --port mysql: shop/db-0 has no container port of that name "
                                                   "(its named ports: pg (TCP/5432))\n")


def test_a_dump_error_names_the_file(tmp_path):
    dump = tmp_path / "node1.iptables-save"
    dump.write_text("*filter\n:INPUT ACCEPT [0:0]\nbogus line\nCOMMIT\n")
    out = run("compare", "--node", "node1", "--iptables-save", str(dump), "--ipset-save", str(DUMP / "node1.ipset-save"), SHOP)
    assert (out.returncode, out.stderr) == (2, f"nftpolicy: --iptables-save {dump}:3: expected '-A <chain> ...', got 'bogus line'\n")


@pytest.mark.kernel
def test_compare_exits_0_when_every_difference_is_a_documented_one():
    example = REPO / "examples" / "shop"
    out = run("compare", "--node", "node1", "--icmp", "--timeout", "0.3", "--iptables-save", str(example / "node1.iptables-save"),
              "--ipset-save", str(example / "node1.ipset-save"), SHOP)
    summary = out.stdout.splitlines()[-1]
    assert re.fullmatch(r"(\d+) cells differ \(\1 by a documented deliberate difference\)", summary), out.stdout[-500:]
    assert out.returncode == 0


@pytest.mark.kernel
def test_ipv6_on_an_ipv4_cluster_is_refused_before_anything_is_built():
    out = run("sandbox", "--ipv6", SHOP)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == ("nftpolicy: nothing to probe: --ipv6 asks for ipv6 addresses and the manifests give the pods ipv4 ones "
                          "(pods keep the addresses their manifests give; see --dual-stack)\n")


@pytest.mark.kernel
def test_a_sandbox_of_pods_without_container_ports_is_refused_before_anything_is_built():
    example = str(REPO / "examples" / "domain-names")  # its pods declare no port
    out = run("sandbox", example)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == (f"nftpolicy: nothing to probe: no pod in {example} has a container port "
                          "(the sandbox probes the ports of spec.containers[].ports; explain and trace take --port)\n")


def test_help_names_every_exit_code_of_the_documented_table():
    table = (REPO / "docs" / "commands.md").read_text().split("## Mistakes and exit codes")[1].split("## Every flag")[0]
    documented = {code for row in re.findall(r"^\| ([0-9, ]+) \|", table, re.M) for code in row.split(", ")}
    assert documented == {"0", "1", "2", "3", "130", "143", "141"}
    epilog = " ".join(run("--help").stdout.split("exit codes:")[1].split())
    assert {code for code in documented if not re.search(rf"(^|[;,] ){code} ", epilog)} == set(), epilog


def test_help_shows_the_dataplanes_once_and_explain_only_the_flags_it_uses():
    sandbox = run("sandbox", "--help").stdout
    assert "--dataplane nft|iptables|kube-router|both|nft,iptables" in sandbox and "{nft,iptables" not in sandbox
    explain = run("explain", "--help").stdout
    assert "--service-cidr" in explain and not re.search(r"--table|--priority|--policy-mark|--passed-mark", explain)


def test_the_html_report_has_glyphs_a_title_a_source_and_a_time(tmp_path):
    page = tmp_path / "r.html"
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    pods = {"a/x": Pod("a", "x", {}, "node1", ("10.0.0.1",)), "a/y": Pod("a", "y", {}, "node1", ("10.0.0.2",))}
    cluster = build_cluster([])[0]
    with report.SandboxOutput("json", str(page), source="examples/shop", clock=lambda: when) as out:
        out.matrices(pods, {(ProbeSpec(80, "TCP"), "ipv4"): {("a/x", "a/y"): True, ("a/y", "a/x"): False}}, cluster)
    text = page.read_text()
    assert "<title>nftpolicy sandbox report: examples/shop</title>" in text
    assert "source: examples/shop &middot; generated 2026-01-02T03:04:05+00:00" in text
    assert re.findall(r'<td class="cell (\w+)"[^>]*>([^<]*)</td>', text) == [
        ("unprobed", "?"), ("allowed", "&#10003;"), ("blocked", "&#10007;"), ("unprobed", "?")]


# ---- item 9: the operator's guide --------------------------------------------------------------------

@pytest.mark.kernel
def test_the_guides_kube_router_cleanup_leaves_none_of_its_chains_or_sets(make_netns):
    """docs/operations.md, cut-over step 4, run as written on a real kube-router v2.1.0 dump loaded
    into a namespace of the test's: no KUBE-ROUTER-*, KUBE-POD-FW-*, KUBE-NWPLCY-* chain or
    KUBE-SRC/DST set is left, and a chain of another system stays."""
    guide = (REPO / "docs" / "operations.md").read_text()
    step = guide[guide.index("**Remove what kube-router's firewall left.**"):]
    script = re.search(r"```sh\n(.*?)```", step, re.S).group(1)
    ns = make_netns()

    def inside(*argv: str, stdin: str | None = None) -> str:
        return subprocess.run(["ip", "netns", "exec", ns, *argv], input=stdin, capture_output=True, text=True, check=True).stdout

    inside("ipset", "restore", stdin=(DUMP / "node1.ipset-save").read_text())
    dump = (DUMP / "node1.iptables-save").read_text().replace("COMMIT", "-N OTHER\n-A FORWARD -j OTHER\nCOMMIT", 1)
    inside("iptables-nft-restore", stdin=dump)
    assert "KUBE-ROUTER-FORWARD" in inside("iptables-save") and "KUBE-SRC-" in inside("ipset", "list", "-n")
    inside("bash", "-euo", "pipefail", "-c", script)
    saved = inside("iptables-save")
    assert not re.search(r"KUBE-(ROUTER|POD-FW|NWPLCY)", saved), saved
    assert "-A FORWARD -j OTHER" in saved
    assert inside("ipset", "list", "-n") == ""


# ---- item 8: the lock the image installs from ----------------------------------------------------------

def test_the_lock_pins_every_dependency_within_its_range_with_hashes():
    """requirements.lock (bash .ci/lock) holds one version of each dependency of pyproject.toml,
    inside the range pyproject gives, and of the build backend, each with sha256 hashes: a lock
    left stale by a change to pyproject.toml fails here, not in the image build."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    lock = (REPO / "requirements.lock").read_text()
    pins = {canonicalize_name(name): version for name, version in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\$", lock, re.M)}
    entries = re.split(r"\n(?=[A-Za-z0-9_.-]+==)", lock.split("\n", 6)[-1])
    pinned_entries = [entry for entry in entries if "==" in entry]
    assert len(pinned_entries) == len(pins) and all("--hash=sha256:" in entry for entry in pinned_entries)
    for text in project["project"]["dependencies"] + project["build-system"]["requires"]:
        wanted = Requirement(text)
        pinned = pins.get(canonicalize_name(wanted.name))
        assert pinned is not None and wanted.specifier.contains(pinned, prereleases=True), (text, pinned)


# ---- the second trial (issue 22): what was left ----------------------------------------------------

@pytest.mark.parametrize("value", ["300.1.2.0/24", "10.0.0.0/33", "fd00::/129", "10.96.01.0/24"])
def test_a_bad_cidr_value_is_one_short_line_naming_it(value):
    out = helm("template", "x", str(CHART), "--set-json", f'agent.externalCidrs=["10.96.0.0/12", "{value}"]', check=False)
    assert out.returncode != 0
    assert out.stderr.splitlines()[0].endswith(f"agent.externalCidrs[1]: {value} is not a CIDR (IPv4/0-32 or IPv6/0-128)")
    assert max(len(line) for line in out.stderr.splitlines()) < 160


@pytest.mark.parametrize(("replicas", "line"), [
    (0, "nftpolicy: 1 workload stands in 0 pods: Deployment demo/web (0)"),
    (1, "nftpolicy: 1 workload stands in 1 pod: Deployment demo/web (1)"),
    (2, "nftpolicy: 1 workload stands in 2 pods: Deployment demo/web (2)"),
])
def test_the_stand_in_line_counts_pods_in_good_grammar(tmp_path, replicas, line):
    (tmp_path / "w.yaml").write_text(WORKLOADS.split("---\napiVersion: apps/v1\nkind: StatefulSet")[0].replace("replicas: 2", f"replicas: {replicas}"))
    assert line in run("render", "--accept-skipped", str(tmp_path)).stderr.splitlines()


@pytest.mark.parametrize(("workloads", "start"), [
    (1, "nftpolicy: 1 workload stands in 1 pod: "), (2, "nftpolicy: 2 workloads stand in 2 pods: "),
])
def test_the_stand_in_line_counts_workloads_in_good_grammar(tmp_path, workloads, start):
    text = "".join(f"---\nkind: Job\nmetadata: {{name: j{i}}}\nspec: {{template: {{spec: {{containers: [{{name: c}}]}}}}}}\n"
                   for i in range(workloads))
    (tmp_path / "w.yaml").write_text(text)
    assert run("render", str(tmp_path)).stderr.splitlines()[0].startswith(start)


@pytest.mark.parametrize(("bare", "line"), [
    (0, None),
    (1, "nftpolicy: 1 pod without status.podIP gets the sandbox's addresses: default/p0 10.244.0.10"),
    (2, "nftpolicy: 2 pods without status.podIP get the sandbox's addresses: default/p0 10.244.0.10, default/p1 10.244.0.11"),
])
def test_the_explain_line_on_pods_without_addresses_in_good_grammar(tmp_path, bare, line):
    pods = [f"kind: Pod\nmetadata: {{name: p{i}}}\nspec: {{nodeName: node1, containers: [{{name: c}}]}}\n"
            + (f"status: {{podIP: 10.244.0.{100 + i}}}\n" if i >= bare else "") for i in range(3)]
    (tmp_path / "p.yaml").write_text("---\n".join(pods))
    out = run("explain", "--from", "default/p0", "--to", "default/p2", "--port", "80", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert [x for x in out.stderr.splitlines() if "status.podIP" in x] == ([line] if line else [])


@pytest.mark.parametrize(("text", "line"), [
    (WORKLOADS, "nftpolicy: 7 pods have no address (7 of them stand in for 4 workloads): render leaves them out "
                "(no pod chain, no set entry), as an agent does until a pod has one; sandbox and explain give such "
                "pods stand-in addresses"),
    ("kind: Pod\nmetadata: {name: p, namespace: demo}\nspec: {containers: [{name: c}]}\n",
     "nftpolicy: 1 pod has no address: render leaves it out (no pod chain, no set entry), as an agent does until a "
     "pod has one; sandbox and explain give such pods stand-in addresses"),
])
def test_render_says_which_pods_it_leaves_out_for_want_of_an_address(tmp_path, text, line):
    (tmp_path / "w.yaml").write_text(text)
    out = run("render", "--accept-skipped", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines()[-1] == line
    assert "chain KUBE-POD-" not in out.stdout


def test_render_says_nothing_of_addresses_when_every_pod_has_one():
    out = run("render", "--strict", SHOP)
    assert (out.returncode, out.stderr) == (0, "")


SERVICE_WITH_NAMES = """
kind: Pod
metadata: {name: client, namespace: demo}
spec: {nodeName: node1, containers: [{name: c}]}
status: {podIP: 10.244.0.5}
---
kind: Pod
metadata: {name: web, namespace: demo, labels: {app: web}}
spec: {nodeName: node1, containers: [{name: c, ports: [{containerPort: 8080, name: http}, {containerPort: 9090, name: metrics}]}]}
status: {podIP: 10.244.0.6}
---
kind: Service
metadata: {name: front, namespace: demo}
spec:
  selector: {app: web}
  ports: [{name: dns, port: 53, protocol: UDP}, {name: web, port: 80, targetPort: http}, {name: stats, port: 81, targetPort: 9090},
          {name: dns-tcp, port: 53}]
"""


@pytest.mark.parametrize(("to", "port", "answer"), [
    ("demo/web", "http", "TCP/8080"),  # a container port's name on the destination pod
    ("demo/web", "tcp/metrics", "TCP/9090"),
    ("demo/front", "web", "TCP/8080"),  # a Service port's name, as its targetPort
    ("demo/front", "TCP/stats", "TCP/9090"),
    ("demo/front", "81", "TCP/9090"),  # a Service port's number, as before
    ("demo/front", "53", "TCP/53"),  # a number alone is TCP, a name any protocol
    ("demo/front", "dns", "UDP/53"),
])
def test_explain_takes_a_named_port_of_a_pod_or_of_a_service(tmp_path, to, port, answer):
    (tmp_path / "s.yaml").write_text(SERVICE_WITH_NAMES)
    out = run("explain", "--accept-skipped", "--from", "demo/client", "--to", to, "--port", port, str(tmp_path))
    assert (out.returncode, out.stdout.splitlines()[0]) == (0, f"ALLOWED  demo/client -> demo/web {answer}"), out.stderr


FRONT_PORTS = "dns UDP/53, web TCP/80, stats TCP/81, dns-tcp TCP/53"


@pytest.mark.parametrize(("to", "port", "error"), [
    ("demo/front", "http", f"--port http: not a port of Service demo/front (its ports: {FRONT_PORTS})"),
    ("demo/front", "udp/web", f"--port udp/web: not a port of Service demo/front (its ports: {FRONT_PORTS})"),
    ("demo/web", "web", "--port web: demo/web has no container port of that name (its named ports: http (TCP/8080), metrics (TCP/9090))"),
])
def test_explain_refuses_a_port_name_the_destination_does_not_have(tmp_path, to, port, error):
    (tmp_path / "s.yaml").write_text(SERVICE_WITH_NAMES)
    out = run("explain", "--accept-skipped", "--from", "demo/client", "--to", to, "--port", port, str(tmp_path))
    assert (out.returncode, out.stderr.splitlines()[-1]) == (2, f"nftpolicy: {error}")


@pytest.mark.parametrize("args, said", [
    (["--from", "demo/web", "--to", "demo/db-0", "--port", "5432"], "--from demo/web is Deployment demo/web"),
    (["--from", "demo/db-0", "--to", "demo/report", "--port", "8080"], "--to demo/report is CronJob demo/report"),
])
def test_explain_takes_a_workload_s_name_for_one_of_its_pods(tmp_path, args, said):
    """A Deployment's (or any workload's) name where one pod is meant: its first pod answers,
    said with the stand-in's name, which the sandbox legend alone showed (issue 34 item 8)."""
    (tmp_path / "w.yaml").write_text(WORKLOADS)
    out = run("explain", *args, str(tmp_path))
    assert "workloads stand in" not in out.stderr  # render's and sandbox's line, not one per question
    line = next(line for line in out.stderr.splitlines() if said in line)
    pod = re.fullmatch(rf"nftpolicy: {said}: its pod (\S+) answers for its 2 pods \(the same labels\)", line).group(1)
    asked = [pod if a in ("demo/web", "demo/report") else a for a in args]
    same = run("explain", *asked, str(tmp_path))
    assert (out.returncode, out.stdout) == (same.returncode, same.stdout) and out.returncode in (0, 1), out.stderr


TWO_NODES = """
apiVersion: v1
kind: Node
metadata: {name: node-a}
---
apiVersion: v1
kind: Node
metadata: {name: node-b}
"""


@pytest.mark.parametrize("flags, placed", [
    ([], r"demo/web-\S+ 10\.244\.0\.10, demo/web-\S+ 10\.244\.1\.10"),  # one on each Node object, no phantom node1
    (["--node", "node-b"], r"demo/web-\S+ 10\.244\.0\.10, demo/web-\S+ 10\.244\.0\.11"),  # both on the node given
])
def test_explain_places_stand_ins_on_the_manifests_nodes_as_the_sandbox_does(tmp_path, flags, placed):
    """Pods without spec.nodeName go round-robin over --node, else the manifests' Node objects
    (placement_nodes, which sandbox uses too), not a node1 the manifests lack (issue 34 item 2)."""
    (tmp_path / "w.yaml").write_text(WORKLOADS.split("---\napiVersion: apps/v1\nkind: StatefulSet")[0] + "---" + TWO_NODES)
    out = run("explain", "--from", "demo/web", "--to", "10.0.0.1", *flags, str(tmp_path))
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stderr.splitlines() if "without status.podIP" in line)
    assert re.fullmatch(rf"nftpolicy: 2 pods without status.podIP get the sandbox's addresses: {placed}", line), line


@pytest.mark.tools("helm")
def test_a_bad_debug_address_is_one_line_without_the_pattern():
    out = helm("template", "x", str(CHART), "--set", "agent.debugAddress=unix:run/debug.sock", check=False)
    assert out.returncode != 0
    assert out.stderr.splitlines()[0].endswith('agent.debugAddress: "unix:run/debug.sock" is not unix:/run/nftpolicy/NAME '
                                               "(NAME: letters, digits, . _ -; at most 64), 127.x.x.x:PORT or [::1]:PORT "
                                               "(PORT 1-65535), or empty (off)"), out.stderr
    assert "[0-9]" not in out.stderr


@pytest.mark.tools("helm")
def test_a_whole_number_image_tag_is_taken():
    out = helm("template", "x", str(CHART), "--set", "image.tag=2", check=False)
    assert out.returncode == 0, out.stderr
    assert re.search(r"image: \"\S+:2\"$", out.stdout, re.M)


def test_trace_takes_a_workload_s_name_as_explain_does(tmp_path):
    """A new user's second trial: explain took web/frontend for its Deployment's pod, trace said
    'names 2 pods'."""
    (tmp_path / "w.yaml").write_text(WORKLOADS)
    out = run("trace", "--from", "demo/web", "--to", "demo/db-0", "--port", "5432", str(tmp_path))
    assert out.returncode in (0, 1) and out.stdout.startswith("TRACE  demo/web-"), out.stderr
    assert "is Deployment demo/web: its pod demo/web-" in out.stderr
