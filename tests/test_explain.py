"""``nftpolicy explain``: golden text for the shop example, JSON output, bad input (one line,
exit 2), and the same answers from a running agent's debug endpoint (which the metrics port
never serves)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nftpolicy.agent.cli.main import main
from nftpolicy.agent.testbed.controlplane import free_port

from .conftest import REPO, http_get

SHOP = str(REPO / "examples" / "shop")
GOLDEN = REPO / "tests" / "golden" / "explain-shop.txt"
NFTPOLICY = str(Path(sys.executable).parent / "nftpolicy")
# Every kind of answer: denied both ways, allowed by a rule of each peer kind, a port outside a
# rule, a container port default, not isolated, an address at either end, ICMP echo.
COMMANDS = [
    "--from shop/frontend --to shop/db --port tcp/5432",
    "--from shop/api --to shop/db --port 5432",
    "--from shop/frontend --to shop/api",
    "--from ops/prometheus --to shop/api --port 9090",
    "--from ops/debug --to shop/cache --port 6379",
    "--from shop/api --to shop/cache --port 6500 --port icmp",
    "--from shop/frontend --to 8.8.8.8 --port udp/53",
    "--from shop/frontend --to 8.8.8.8 --port 443",
    "--from 203.0.113.0/24 --to shop/db --port 5432",
]


def explain_text(capsys, args: str, *paths: str) -> tuple[int, str]:
    code = main(["explain", *args.split(), *paths])
    return code, capsys.readouterr().out


def test_golden_text_for_the_shop_example(capsys):
    text = ""
    for args in COMMANDS:
        code, out = explain_text(capsys, args, SHOP)
        text += f"$ nftpolicy explain {args} examples/shop  # exit {code}\n{out}"
    assert text == GOLDEN.read_text()


def test_exit_codes_and_the_issue_s_lines(capsys):
    code, out = explain_text(capsys, "--from shop/frontend --to shop/db --port tcp/5432", SHOP)
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == "DENIED  shop/frontend-7d9c8b6f5-x2k4p -> shop/db-0 TCP/5432"
    assert lines[1].startswith("  egress of shop/frontend-7d9c8b6f5-x2k4p: isolated by shop/frontend-egress; "
                               "no rule allows shop/db-0 on TCP/5432 (rule 0 allows to pods in shop: app=api on any port")
    assert explain_text(capsys, "--from ops/prometheus --to shop/api --port 9090", SHOP)[0] == 0


def test_json_output(capsys):
    code, out = explain_text(capsys, "--from ops/prometheus --to shop/api --port 9090 --port 8080 --output json", SHOP)
    verdicts = json.loads(out)
    assert code == 1 and [v["allowed"] for v in verdicts] == [True, False]
    assert verdicts[0]["connection"] == {"source": "10.244.1.12", "destination": "10.244.1.11", "protocol": "TCP", "port": 9090,
                                         "established": False}  # no icmp_type on TCP (issue 34 item 10)
    assert verdicts[0]["ingress"]["allowed_by"]["policy"] == "shop/api-ingress" and verdicts[0]["ingress"]["allowed_by"]["rule"] == 1
    assert verdicts[1]["ingress"]["policies"] == ["shop/api-ingress"] and [r["rule"] for r in verdicts[1]["ingress"]["rules"]] == [0, 1]


@pytest.mark.parametrize("kubectl_form", [
    "--from ops/prometheus --to shop/api:9090/TCP",
    "--from ops/prometheus --to shop/api --port 9090/tcp",
    "--from ops/prometheus --to shop/api --port metrics/TCP",
])
def test_explain_takes_the_kubectl_plugin_s_syntax_too(capsys, kubectl_form):
    """kubectl nftpolicy's DST:PORT/PROTO and PORT/PROTO mean what --to and --port [PROTO/]PORT
    mean here (issue 34 item 3: one syntax accepted by both)."""
    assert explain_text(capsys, kubectl_form, SHOP) == explain_text(capsys, "--from ops/prometheus --to shop/api --port tcp/9090", SHOP)


@pytest.mark.parametrize("args, message", [
    ("--from shop/frontend --to svc/shop", "nftpolicy: --to svc/shop: expected svc/NAMESPACE/NAME"),
    ("--from shop/nothing --to shop/db", "nftpolicy: --from shop/nothing: no running pod with an address of that name"),
    ("--from shop/frontend --to 10.0.0.300/8", "nftpolicy: --to 10.0.0.300/8: not NS/POD, an address or a CIDR"),
    ("--from shop/frontend --to shop/db --port tcp/70000", "nftpolicy: --port tcp/70000: a port number is 1-65535"),
    ("--from shop/frontend --to shop/db --port 0", "nftpolicy: --port 0: a port number is 1-65535"),
    ("--from shop/frontend --to shop/db --port gre/1",
     "nftpolicy: --port gre/1: expected [TCP|UDP|SCTP/]PORT, a container port's name or icmp"),
    ("--from shop/ --to shop/db", "nftpolicy: --from shop/: not NS/POD, an address or a CIDR"),
    ("--from shop/frontend --to fd00::1", "nftpolicy: shop/frontend and fd00::1 have no address family in common"),
])
def test_bad_input_gets_one_line_and_exit_2(capsys, args, message):
    assert main(["explain", *args.split(), SHOP]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [message] and captured.out == ""


def test_an_agent_address_without_the_debug_endpoint_says_where_it_is(capsys):
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b"not found")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = explain_at_agent(server)
    assert capsys.readouterr().err == (f"nftpolicy: agent {url}: 404 not found: nothing serves /debug/model there (the agent "
                                       "serves it on its --debug-address, default unix:/run/nftpolicy/debug.sock, not on its --http-address)\n")


def explain_at_agent(server: http.server.HTTPServer) -> str:
    """Run explain with ``--agent`` at ``server`` (serving), which must exit 2; the server is shut
    down after. Returns the agent's URL."""
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["explain", "--from", "shop/frontend", "--to", "shop/db", "--agent", url]) == 2
    finally:
        server.shutdown()
        server.server_close()
    return url


def test_an_unreachable_agent_gets_one_line_and_exit_2(capsys):
    port = free_port()
    assert main(["explain", "--from", "shop/frontend", "--to", "shop/db", "--agent", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"nftpolicy: cannot reach the agent at http://127.0.0.1:{port}: ")


def test_an_agent_of_another_version_gets_one_line_naming_both_versions(capsys):
    """The debug model's dataclasses change between versions: explain says so instead of
    misreading (or failing on) another version's JSON."""
    from importlib.metadata import version

    from nftpolicy.agent.daemon.debughttp import serve_debug
    from nftpolicy.translators.verdict import MODEL_SHAPE
    url = explain_at_agent(serve_debug("127.0.0.1:0", lambda: {"shape": "0123456789ab", "version": "0.1.0", "models": [],
                                                                "pods": []}))
    assert capsys.readouterr().err.splitlines() == [
        f"nftpolicy: agent {url} runs nftpolicy 0.1.0 and this explain is {version('nftpolicy')} (its model has shape "
        f"0123456789ab, this nftpolicy reads shape {MODEL_SHAPE}): run explain of the agent's version, "
        "or kubectl nftpolicy explain, which reads the API server"]


BROKEN_FRONTEND_INGRESS = """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: broken, namespace: shop}
spec:
  podSelector: {matchLabels: {app: frontend}}
  ingress: [{ports: [{port: 70000}]}]
"""


@pytest.mark.kernel
def test_explain_against_a_running_agent(make_netns, tmp_path):
    netns = make_netns()
    http, debug = free_port(), free_port()
    log = (tmp_path / "agent.log").open("w")
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "cluster.yaml").write_text((REPO / "examples" / "shop" / "cluster.yaml").read_text())
    (manifests / "broken.yaml").write_text(BROKEN_FRONTEND_INGRESS)
    agent = subprocess.Popen([NFTPOLICY, "agent", "--manifests", str(manifests), "--node", "node1", "--netns", netns,
                              "--http-address", f"127.0.0.1:{http}", "--debug-address", f"127.0.0.1:{debug}"],
                             stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while http_get(f"http://127.0.0.1:{http}/readyz")[0] != 200:
            assert time.monotonic() < deadline and agent.poll() is None, (tmp_path / "agent.log").read_text()
            time.sleep(0.1)
        assert http_get(f"http://127.0.0.1:{http}/debug/model")[0] == 404  # never on the metrics port
        status, body = http_get(f"http://127.0.0.1:{debug}/debug/model")
        assert status == 200 and [m["node"] for m in json.loads(body)["models"]] == ["node1"]

        def ask(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([NFTPOLICY, "explain", "--agent", f"http://127.0.0.1:{debug}", *args], capture_output=True, text=True)

        allowed = ask("--from", "ops/prometheus", "--to", "shop/api", "--port", "9090")
        assert allowed.returncode == 0 and allowed.stdout.splitlines()[2] == (
            "  ingress of shop/api-5f6b7c9d4-q8w2n: isolated by shop/api-ingress; allowed by shop/api-ingress rule 1 "
            "(from pods in namespaces team=ops: app=prometheus on port metrics/TCP of local pods in shop: app=api)")
        # shop/db runs on node2: this agent enforces only the frontend's egress, which denies it
        denied = ask("--from", "shop/frontend", "--to", "shop/db", "--port", "5432")
        assert denied.returncode == 1 and denied.stdout.splitlines()[0] == "DENIED  shop/frontend-7d9c8b6f5-x2k4p -> shop/db-0 TCP/5432"
        assert denied.stdout.splitlines()[2] == "  ingress of shop/db-0: enforced on node node2, whose rules are not known here"
        unknown = ask("--from", "shop/api", "--to", "shop/db", "--port", "5432")
        assert unknown.returncode == 1 and unknown.stdout.startswith("UNKNOWN  shop/api-5f6b7c9d4-q8w2n -> shop/db-0 TCP/5432")
        # an invalid policy is enforced fail-closed, and explain names it and why (issue 34 item 7)
        closed = ask("--from", "ops/prometheus", "--to", "shop/frontend", "--port", "8080")
        assert closed.returncode == 1 and closed.stdout.splitlines()[2] == (
            "  ingress of shop/frontend-7d9c8b6f5-x2k4p: isolated by shop/broken; no rule allows "
            "ops/prometheus-0 on TCP/8080; shop/broken is enforced fail-closed: "
            "spec.ingress[0].ports[0].port: must be between 1 and 65535, got 70000; the kernel rejects it with a TCP reset")
        # the node itself (kubelet probes) always reaches its pods: the agent knows its node's addresses
        kubelet = ask("--from", "172.18.0.2", "--to", "shop/api", "--port", "8080")
        assert kubelet.returncode == 0 and kubelet.stdout.splitlines()[2] == (
            "  ingress of shop/api-5f6b7c9d4-q8w2n: allowed: from an address of its own node (the node may always reach its pods)")
    finally:
        agent.terminate()
        agent.wait(timeout=15)


def test_the_debug_endpoint_holds_the_sync_lock_only_to_take_the_model(monkeypatch):
    """Turning the model and every pod into JSON takes 0.1 s at 10,000 pods and 0.8 s at 50,000:
    done under the reconciler's lock, each GET would hold up the syncs that long."""
    from nftpolicy.agent.daemon.debughttp import start_debug
    from nftpolicy.translators import verdict

    from .test_reconcile import _objects, _reconciler, _store
    from nftpolicy.agent.dataplane.fake import FakeNftDataplane

    reconciler = _reconciler(_store(_objects()), FakeNftDataplane())
    assert reconciler.sync(full=True)
    held = []
    endpoint_of = verdict.Endpoint.of
    monkeypatch.setattr(verdict.Endpoint, "of", staticmethod(lambda pod: held.append(reconciler.lock.locked()) or endpoint_of(pod)))
    server = start_debug("127.0.0.1:0", reconciler)
    try:
        status, body = http_get(f"http://127.0.0.1:{server.server_address[1]}/debug/model")
    finally:
        server.shutdown()
    assert status == 200 and len(json.loads(body)["pods"]) == 6
    assert held and not any(held)


def test_json_names_an_icmp_type_only_for_icmp(capsys):
    _, out = explain_text(capsys, "--from ops/prometheus --to shop/api --port icmp --port udp/53 --output json", SHOP)
    assert [(v["connection"]["protocol"], v["connection"].get("icmp_type")) for v in json.loads(out)] == [
        ("ICMP", "echo-request"), ("UDP", None)]


DUAL = """
apiVersion: v1
kind: List
items:
  - {apiVersion: v1, kind: Namespace, metadata: {name: x}}
  - {apiVersion: v1, kind: Pod, metadata: {namespace: x, name: a}, spec: {nodeName: node1, containers: [{name: c}]},
     status: {phase: Running, podIPs: [{ip: 10.244.1.5}, {ip: "fd00:10:244:1::5"}]}}
  - {apiVersion: v1, kind: Pod, metadata: {namespace: x, name: b}, spec: {nodeName: node1, containers: [{name: c}]},
     status: {phase: Running, podIPs: [{ip: 10.244.1.6}, {ip: "fd00:10:244:1::6"}]}}
"""


@pytest.mark.parametrize("flags", [[], ["--ipv6"]])
def test_explain_asks_over_ipv6_when_told(tmp_path, flags):
    """Both ends dual-stack: IPv4 by default, IPv6 with --ipv6 (issue 34: explain had no --ipv6)."""
    (tmp_path / "d.yaml").write_text(DUAL)
    out = subprocess.run([NFTPOLICY, "explain", "--from", "x/a", "--to", "x/b", "--port", "80", "--output", "json", *flags,
                          str(tmp_path / "d.yaml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (verdict,) = json.loads(out.stdout)
    assert verdict["connection"]["destination"] == ("fd00:10:244:1::6" if flags else "10.244.1.6")
