"""The chart's optional observability objects: the ulogd sidecar (drop events as JSON lines), the
Grafana dashboard and the PrometheusRule.

The ulogd sidecar's configuration, exactly as the chart renders it, runs Debian's ulogd2 in a
sandbox node namespace and writes a JSON line for a packet our table rejected (a pod chain's
reject, a ClusterNetworkPolicy Deny rule); every metric the
dashboard and the alerts name is one the real agent exports; ``promtool check rules`` (Debian's
``prometheus``) passes on the rendered rules. ulogd2, ulogd2-json and prometheus come from
``.ci/install``.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
import yaml

from nftpolicy.agent.testbed.controlplane import free_port
from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.agent.testbed.sandbox import Sandbox
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.model import Cluster

from .conftest import REPO, example_cluster, http_get
from .test_chart import KUBE_VERSIONS, KUBERNETES_VALIDATE, NFTPOLICY, one, render, render_text

pytestmark = pytest.mark.tools("helm")
ENABLED = ("--set", "ulogd.enabled=true,grafanaDashboard.enabled=true,prometheusRule.enabled=true")


def _containers(docs: list[dict]) -> dict[str, dict]:
    return {c["name"]: c for c in one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]}


def _config_map(docs: list[dict], suffix: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith(suffix)]
    return found


def _rules(docs: list[dict]) -> list[dict]:
    return [r for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]


def _dashboard(docs: list[dict]) -> dict:
    return json.loads(_config_map(docs, "-dashboard")["data"]["nftpolicy.json"])


def _dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    return exprs + [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def test_all_off_by_default():
    kinds = [(d["kind"], d["metadata"]["name"]) for d in render("default")]
    assert not [k for k in kinds if k[0] in ("ConfigMap", "PrometheusRule")]
    assert list(_containers(render("default"))) == ["agent"]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_enabled_objects_validate(kube_version, tmp_path):
    rendered = tmp_path / "enabled.yaml"
    rendered.write_text(render_text("default", kube_version, *ENABLED))
    out = subprocess.run([str(KUBERNETES_VALIDATE), "--strict", "-k", kube_version, str(rendered)],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(rendered.read_text()) if d]
    passed = [line for line in out.stdout.splitlines() if " passed for resource " in line]
    assert len(passed) == len(kinds) - 1  # all but the PrometheusRule, a CRD (checked by promtool below)


def test_ulogd_sidecar_reads_the_config_map():
    docs = render("default", *ENABLED)
    sidecar = _containers(docs)["ulogd"]
    assert sidecar["image"] == _containers(docs)["agent"]["image"]
    assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    (mount,) = sidecar["volumeMounts"]
    volumes = {v["name"]: v for v in one(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mount["name"]]["configMap"]["name"] == _config_map(docs, "-ulogd")["metadata"]["name"]
    assert sidecar["command"] == ["ulogd", "-c", f"{mount['mountPath']}/ulogd.conf"]


def _ulogd_events(tmp_path, cluster: Cluster, source: str, destination: str, port: int) -> tuple[list[dict], str, str]:
    """Run ulogd as the chart configures it in the sandbox node of ``destination`` (a pod key of
    ``cluster``, on the node of ``source``), send one refused TCP connection ``source`` ->
    ``destination``:``port``: the JSON lines ulogd wrote, and the two pods' addresses."""
    docs = render("default", *ENABLED)
    sidecar = _containers(docs)["ulogd"]
    mount_path = sidecar["volumeMounts"][0]["mountPath"]
    for name, text in _config_map(docs, "-ulogd")["data"].items():
        (tmp_path / name).write_text(text)
    command = [str(tmp_path) + arg[len(mount_path):] if arg.startswith(mount_path) else arg for arg in sidecar["command"]]
    with Sandbox(list(cluster.pods.values()), timeout=0.5) as sandbox:
        placed = sandbox.with_sandbox_pods(cluster)
        sandbox.apply(placed)
        node = placed.pods[destination].node
        assert node == placed.pods[source].node
        events = tmp_path / "events.jsonl"
        with events.open("w") as out, (tmp_path / "ulogd.log").open("w") as err:
            ulogd = subprocess.Popen(["ip", "netns", "exec", sandbox.node_netns(node), *command], stdout=out, stderr=err)
        try:
            time.sleep(1.0)  # ulogd binds its NFLOG group
            assert ulogd.poll() is None, (tmp_path / "ulogd.log").read_text()
            destination_ip = placed.pods[destination].ips[0]
            assert not sandbox.connect(source, destination_ip, ProbeSpec(port, "TCP"))
            deadline = time.monotonic() + 10
            while not events.read_text().strip() and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            ulogd.terminate()
            ulogd.wait(timeout=10)
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert lines, (tmp_path / "ulogd.log").read_text()
    return lines, placed.pods[source].ips[0], destination_ip


@pytest.mark.kernel
@pytest.mark.tools("ulogd")
def test_ulogd_as_the_chart_configures_it_writes_a_json_line_per_rejected_packet(tmp_path):
    # frontend's egress allows the api; the api's ingress refuses 5432
    lines, frontend_ip, api_ip = _ulogd_events(tmp_path, example_cluster(), "shop/frontend-7d9c8b6f5-x2k4p", "shop/api-5f6b7c9d4-q8w2n", 5432)
    event = lines[0]
    assert event["oob.prefix"] == "nftpolicy reject ingress shop/api-5f6b7c9d4-q8w2n: "
    assert (event["src_ip"], event["dest_ip"], event["ip.protocol"], event["dest_port"]) == (frontend_ip, api_ip, 6, 5432)
    assert isinstance(event["src_port"], int) and event["tcp.syn"] == 1


@pytest.mark.kernel
@pytest.mark.tools("ulogd")
def test_ulogd_writes_a_json_line_naming_the_clusternetworkpolicy_rule_that_denied(tmp_path):
    """An Admin Deny rule of a policy with a 253-character name: the prefix holds tier,
    direction and rule index whole, the name cut at the kernel's 127 bytes."""
    name = ("g" * 62 + ".") * 4 + "d"
    pods = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": ns, "name": pod, "labels": {"app": pod}},
             "spec": {"nodeName": "n1", "containers": [{"name": "c"}]}, "status": {"phase": "Running", "podIPs": [{"ip": ip}]}}
            for ns, pod, ip in (("x", "db", "10.0.0.1"), ("y", "client", "10.0.1.1"))]
    guard = {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": name},
             "spec": {"tier": "Admin", "priority": 1, "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "x"}}},
                      "ingress": [{"action": "Accept", "from": [{"namespaces": {}}], "protocols": [{"tcp": {"destinationPort": {"number": 80}}}]},
                                  {"action": "Deny", "from": [{"namespaces": {}}]}]}}
    cluster, errors = build_cluster(("t", o) for o in [*pods, guard])
    assert not errors, [str(e) for e in errors]
    lines, client_ip, db_ip = _ulogd_events(tmp_path, cluster, "y/client", "x/db", 5432)
    event = lines[0]
    assert event["oob.prefix"] == f"nftpolicy deny Admin ingress rule 1 {name}".encode()[:127].decode()
    assert (event["src_ip"], event["dest_ip"], event["dest_port"]) == (client_ip, db_ip, 5432)


def test_dashboard_config_map_for_the_grafana_sidecar():
    docs = render("default", *ENABLED, "--set", "grafanaDashboard.namespace=monitoring")
    config_map = _config_map(docs, "-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "monitoring"
    dashboard = _dashboard(docs)
    assert dashboard["uid"] == "nftpolicy-agent" and len(dashboard["panels"]) >= 10
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_alerts_cover_what_the_issue_asks():
    rules = {r["alert"]: r for r in _rules(render("default", *ENABLED))}
    wanted = {"NftpolicySyncFailing": "nftpolicy_sync_failures_total", "NftpolicySyncStale": "nftpolicy_last_successful_sync_timestamp_seconds",
              "NftpolicySyncSlow": "nftpolicy_sync_duration_seconds_bucket", "NftpolicyInvalidObjects": "nftpolicy_invalid_objects",
              "NftpolicyRefusedObjects": "nftpolicy_refused_objects", "NftpolicyApiErrors": "nftpolicy_api_errors_total",
              "NftpolicyWatchStale": "nftpolicy_watch_seconds_since_success", "NftpolicyApiAccessDenied": "nftpolicy_api_access_denied"}
    assert set(rules) == set(wanted)
    for alert, metric in wanted.items():
        assert metric in rules[alert]["expr"]
    assert "> 900" in rules["NftpolicySyncStale"]["expr"] and "> 120" in rules["NftpolicyWatchStale"]["expr"]


@pytest.mark.tools("promtool")
def test_promtool_accepts_the_rendered_rules(tmp_path):
    docs = render("default", *ENABLED)
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump(one(docs, "PrometheusRule")["spec"]))
    out = subprocess.run(["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_rules(docs))} rules found" in out.stdout


@pytest.mark.tools("promtool")
def test_promtool_fires_access_denied_only_for_a_refusal_that_lasts(tmp_path):
    """``promtool test rules`` on the rendered rules: a kind whose watch the API refuses for
    10 minutes (a ClusterRoleBinding gone) fires NftpolicyApiAccessDenied after its 2 minutes,
    with the kind and the verb; the second of refusals of a restarting kube-apiserver (the gauge
    is 1 for one scrape, then 0), and the other kinds, fire nothing."""
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump(one(render("default", *ENABLED), "PrometheusRule")["spec"]))
    series = {'nftpolicy_api_access_denied{job="nftpolicy",instance="node1",kind="Pod",verb="watch"}': "0 1x10",
              'nftpolicy_api_access_denied{job="nftpolicy",instance="node1",kind="Pod",verb="list"}': "0x10",
              'nftpolicy_api_access_denied{job="nftpolicy",instance="node2",kind="Pod",verb="watch"}': "0 1 0x9"}
    labels = {"job": "nftpolicy", "instance": "node1", "kind": "Pod", "verb": "watch", "severity": "critical"}
    fired = {"exp_labels": labels, "exp_annotations": {
        "summary": "nftpolicy on node1: the Kubernetes API refuses to let it watch Pod objects (401 or 403)",
        "description": "The agent enforces what it last saw and retries; Pod changes are not on this node until it is allowed again. "
                       "The chart's ClusterRole, its ClusterRoleBinding or the ServiceAccount (its token) is missing or was changed; "
                       "the agent's log names the verb and the resource (API ... requests refused for ...)."}}
    tests = {"rule_files": [str(rules_file)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [{"eval_time": "2m", "alertname": "NftpolicyApiAccessDenied", "exp_alerts": []},  # pending
                            {"eval_time": "3m", "alertname": "NftpolicyApiAccessDenied", "exp_alerts": [fired]},
                            {"eval_time": "10m", "alertname": "NftpolicyApiAccessDenied", "exp_alerts": [fired]}]}]}
    tests_file = tmp_path / "tests.yaml"
    tests_file.write_text(yaml.safe_dump(tests))
    out = subprocess.run(["promtool", "test", "rules", str(tests_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def _exported_names(text: str) -> set[str]:
    """Every series name a /metrics page can hold, from its ``# TYPE`` lines."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return names


@pytest.mark.kernel
def test_every_expression_names_a_metric_the_agent_exports(make_netns, tmp_path):
    port = free_port()
    log = tmp_path / "agent.log"
    with log.open("w") as err:
        agent = subprocess.Popen([NFTPOLICY, "agent", "--manifests", str(REPO / "examples" / "shop"), "--node", "node1",
                                  "--netns", make_netns(), "--http-address", f"127.0.0.1:{port}"], stdout=err, stderr=err)
    try:
        deadline = time.monotonic() + 30
        while http_get(f"http://127.0.0.1:{port}/readyz")[0] != 200:
            assert agent.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        exported = _exported_names(http_get(f"http://127.0.0.1:{port}/metrics")[1])
    finally:
        agent.terminate()
        agent.wait(timeout=20)
    assert {"nftpolicy_denied_packets_total", "nftpolicy_allowed_packets_total", "nftpolicy_sync_duration_seconds_bucket"} <= exported
    docs = render("default", *ENABLED)
    exprs = [r["expr"] for r in _rules(docs)] + _dashboard_exprs(_dashboard(docs))
    named = {m for e in exprs for m in re.findall(r"\bnftpolicy_[a-z_]+", e)}
    assert len(named) >= 12
    assert named <= exported, sorted(named - exported)


def test_the_values_prometheus_rule_comment_names_every_alert_the_template_makes():
    """values.yaml's comment above prometheusRule lists the alerts (issue 34 item 9: it lacked
    one): each alert the template renders is named there, and no other."""
    values = (REPO / "charts" / "nftpolicy" / "values.yaml").read_text()
    comment = values[:values.index("\nprometheusRule:")].rsplit("\n\n", 1)[-1]
    named = set(re.findall(r"\bNftpolicy[A-Za-z]+\b", comment))
    assert named == {r["alert"] for r in _rules(render("default", *ENABLED))}, comment
