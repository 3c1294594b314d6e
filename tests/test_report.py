"""The sandbox's output (agent/testbed/report.py): the compact table fits 120 columns with its legend and
blocked pairs, ``--output json`` is one JSON object with every cell, ``--report`` writes an
HTML page that a real headless browser (Debian's chromium, from ``.ci/install``) loads without
errors and that shows the expected number of cells, and ``| head`` ends quietly."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.testbed.controlplane import find_binary
from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.agent.testbed.report import (
    SandboxOutput, Section, cluster_denials, compact_text, html_page, section_json, selecting_policies,
)
from nftpolicy.translators.manifests import build_cluster

from .conftest import OURS, REPO, example_cluster
from .test_chart import NFTPOLICY

EXAMPLE = str(REPO / "examples" / "shop")
TCP80 = ProbeSpec(80, "TCP")


def _section(pods: int, namespaces: int = 3, nodes: int = 2, expected: bool = False) -> Section:
    """``pods`` pods spread over namespaces and nodes; pod i may reach pod j unless j % 3 == 0."""
    keys = [f"ns{i % namespaces}/pod-with-a-rather-long-name-{i}" for i in range(pods)]
    node_of = {k: f"node{i % nodes + 1}" for i, k in enumerate(keys)}
    matrix = {(a, b): int(b.rsplit("-", 1)[1]) % 3 != 0 for a in keys for b in keys}
    wanted = {(spec, "ipv4"): {cell: True for cell in matrix} for spec in [TCP80]} if expected else {}
    return Section(None, keys, node_of, {(TCP80, "ipv4"): matrix, (ProbeSpec(53, "UDP"), "ipv4"): matrix}, wanted, {})


@pytest.mark.parametrize("pods", [3, 9, 40, 120])
def test_every_line_fits_120_columns(pods):
    text = compact_text(_section(pods))
    assert max(len(line) for line in text.splitlines()) <= 120
    numbers = re.findall(r"(\d+) pod-with-a-rather-long-name-\d+", text)
    assert sorted(map(int, numbers)) == list(range(1, pods + 1))  # every pod in the legend, once


def test_table_legend_and_blocked_pairs_exactly():
    keys = ["x/a", "x/b", "y/c"]
    matrix = {(s, d): not (s == "x/a" and d != "x/a") for s in keys for d in keys}  # x/a reaches nobody else
    del matrix[("y/c", "x/b")]  # not probed
    expected = {(TCP80, "ipv4"): {(s, d): True for s in keys for d in keys}}
    section = Section("case", keys, {"x/a": "node1", "x/b": "node2", "y/c": "node1"}, {(TCP80, "ipv4"): matrix}, expected, {})
    assert compact_text(section) == "\n".join([
        "== case",
        "node1  x: 1 a",
        "node1  y: 2 c",
        "node2  x: 3 b",
        "rows: from, columns: to; . allowed  X blocked  ? not probed  ! differs from the expected",
        "",
        "TCP/80 ipv4",
        "  1 2 3",
        "1 . ! !",
        "2 . . ?",
        "3 . . .",
        "blocked: 1 -> 2 3",
    ])


def test_json_has_every_cell_and_the_expectation():
    data = section_json(_section(4, expected=True))
    assert [p["number"] for p in data["pods"]] == [1, 2, 3, 4]
    tcp = next(m for m in data["matrices"] if m["protocol"] == "TCP")
    assert len(tcp["cells"]) == 16 and all(c["expected"] is True for c in tcp["cells"])
    blocked = {(c["from"], c["to"]) for c in tcp["cells"] if not c["allowed"]}
    assert blocked == {(a, b) for a in _section(4).pods for b in _section(4).pods if b.endswith(("-0", "-3"))}


def test_the_policies_of_each_end_come_from_the_rule_model():
    selecting = selecting_policies(example_cluster())
    assert selecting["shop/db-0"] == {"ingress": ["shop/db-ingress"]}
    assert selecting["shop/frontend-7d9c8b6f5-x2k4p"] == {"egress": ["shop/frontend-egress"]}
    assert "ops/debug-6c7d8f9b7-m4n5b" not in selecting


def _browser_dom(page, tmp_path) -> tuple[str, str]:
    out = subprocess.run([find_binary("chromium"), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
                          "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, out.stderr


@pytest.mark.tools("chromium")
def test_the_page_loads_in_a_real_browser_with_every_cell(tmp_path):
    section = _section(7, expected=True)
    section.results[(TCP80, "ipv4")] = {k: v for k, v in section.results[(TCP80, "ipv4")].items() if k != (section.pods[0], section.pods[1])}
    section.selecting = {section.pods[2]: {"ingress": ["ns2/only-from-ns1"]}}
    page = tmp_path / "report.html"
    page.write_text(html_page([section]))
    dom, log = _browser_dom(page, tmp_path)
    cells = re.findall(r'<td class="cell (\w+)" title="([^"]*)"', dom)
    assert len(cells) == 2 * 7 * 7
    assert f'data-cells="{2 * 7 * 7}"' in dom  # counted by the page's own script: it ran
    kinds = [k for k, _ in cells]
    assert kinds.count("unprobed") == 1
    assert kinds.count("differs") == 7 * 3 - 3  # TCP/80: blocked columns (-0, -3, -6) off the diagonal, expected allowed
    assert kinds.count("differs") + kinds.count("unprobed") + kinds.count("allowed") + kinds.count("blocked") == len(cells)
    assert any("ingress of ns2/pod-with-a-rather-long-name-2: isolated by ns2/only-from-ns1" in t for _, t in cells)
    assert not re.search(r"CONSOLE|Uncaught|SyntaxError", log), log[-2000:]
    assert "<link" not in dom and "src=" not in dom  # self-contained


def test_a_cell_a_clusternetworkpolicy_deny_refused_names_its_tier_policy_and_rule(tmp_path, capsys):
    """x/db's Admin policy accepts TCP/80 from anywhere (rule 0) and denies y (rule 1); x/web is
    refused by a NetworkPolicy: only y -> db names the Deny rule, in the JSON and the page."""
    def pod(ns, name, ip):
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": ns, "name": name, "labels": {"app": name}},
                "spec": {"nodeName": "n1", "containers": [{"name": "c"}]}, "status": {"phase": "Running", "podIPs": [{"ip": ip}]}}

    guard = {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": "guard"},
             "spec": {"tier": "Admin", "priority": 1, "subject": {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "db"}}}},
                      "ingress": [{"action": "Accept", "from": [{"namespaces": {}}], "protocols": [{"tcp": {"destinationPort": {"number": 80}}}]},
                                  {"action": "Deny", "from": [{"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "y"}}}]}]}}
    web_closed = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "x", "name": "closed"},
                  "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"]}}
    cluster, errors = build_cluster(("t", o) for o in [pod("x", "db", "10.0.0.1"), pod("x", "web", "10.0.0.2"), pod("y", "c", "10.0.1.1"),
                                                       guard, web_closed])
    assert not errors, [str(e) for e in errors]
    pods = cluster.pods
    matrix = {("y/c", "x/db"): False, ("y/c", "x/web"): False, ("x/web", "x/db"): True, ("x/db", "x/web"): False}
    tcp81 = ProbeSpec(81, "TCP")
    results = {(TCP80, "ipv4"): {**matrix, ("y/c", "x/db"): True}, (tcp81, "ipv4"): matrix}
    assert cluster_denials(cluster, pods, results) == {(tcp81, "ipv4", "y/c", "x/db"): "Admin Deny guard ingress rule 1"}
    page = tmp_path / "report.html"
    with SandboxOutput("json", str(page)) as out:
        out.matrices(pods, results, cluster)
    (section,) = json.loads(capsys.readouterr().out)["sections"]
    denied = [(m["port"], c["from"], c["to"], c["denied_by"]) for m in section["matrices"] for c in m["cells"] if "denied_by" in c]
    assert denied == [(81, "y/c", "x/db", "Admin Deny guard ingress rule 1")]
    assert page.read_text().count("denied by Admin Deny guard ingress rule 1") == 1


@pytest.mark.kernel
@pytest.mark.tools("chromium")
def test_sandbox_json_report_and_html_on_the_example(tmp_path):
    page = tmp_path / "shop.html"
    out = subprocess.run([NFTPOLICY, "sandbox", EXAMPLE, "--timeout", "0.5", "--output", "json", "--report", str(page)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (section,) = json.loads(out.stdout)["sections"]
    # the container ports and the policies' own (a range's ends and the port after it: 6000, 6999, 7000; DNS's 53)
    assert [(m["protocol"], m["port"]) for m in section["matrices"]] == [
        ("TCP", 53), ("UDP", 53), ("TCP", 5432), ("TCP", 6000), ("TCP", 6379), ("TCP", 6999), ("TCP", 7000), ("TCP", 8080), ("TCP", 9090)]
    assert len(section["pods"]) == 6
    assert all(len(m["cells"]) == 36 for m in section["matrices"])
    cell = next(c for m in section["matrices"] if m["port"] == 5432 for c in m["cells"]
                if c["from"] == "shop/api-5f6b7c9d4-q8w2n" and c["to"] == "shop/db-0")
    assert cell["allowed"] is True
    dom, _ = _browser_dom(page, tmp_path)
    assert len(re.findall(r'<td class="cell ', dom)) == 9 * 36


@pytest.mark.kernel
def test_the_default_table_fits_and_head_ends_quietly():
    out = subprocess.run([NFTPOLICY, "sandbox", EXAMPLE, "--timeout", "0.5"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert max(len(line) for line in out.stdout.splitlines()) <= 120
    assert "node1  shop: 2 api-5f6b7c9d4-q8w2n  3 frontend-7d9c8b6f5-x2k4p" in out.stdout
    assert "blocked: 1 -> 2 5; 2 -> 5; 3 -> 1 2 4-6; 4 -> 2 5 6; 5 -> 2 6; 6 -> 2 5" in out.stdout  # TCP/5432
    before = set(netns.existing(OURS))
    piped = subprocess.run(f"{NFTPOLICY} sandbox {EXAMPLE} --timeout 0.5 | head -2; echo \"rc=${{PIPESTATUS[0]}}\"",
                           shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=300)
    lines = piped.stdout.splitlines()
    assert lines[:2] == ["node1  ops: 1 prometheus-0", "node1  shop: 2 api-5f6b7c9d4-q8w2n  3 frontend-7d9c8b6f5-x2k4p"]
    assert lines[2] in ("rc=0", "rc=141")  # 0 when the whole output fitted in the pipe before head left
    assert piped.stderr == ""  # no traceback, no "Exception ignored"
    # A reader that is gone before the first line: the write fails for sure.
    gone = subprocess.run(f"{NFTPOLICY} sandbox {EXAMPLE} --timeout 0.5 | true; echo \"rc=${{PIPESTATUS[0]}}\"",
                          shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=300)
    assert (gone.stdout, gone.stderr) == ("rc=141\n", "")
    assert set(netns.existing(OURS)) == before  # each sandbox went


@pytest.mark.parametrize("where", ["a directory", "in no directory"])
def test_a_report_path_that_cannot_be_written_is_one_line_before_the_run(tmp_path, where):
    path = tmp_path if where == "a directory" else tmp_path / "none" / "report.html"
    out = subprocess.run([NFTPOLICY, "sandbox", "--report", str(path), str(REPO / "examples" / "shop")],
                         capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (2, "")  # refused before any sandbox was built
    assert out.stderr == f"nftpolicy: --report {path}: cannot write a file there\n"
