"""``kubectl nftpolicy`` (agent/cli/kubectl) against the real kube-apiserver of :class:`ControlPlane`
(RBAC enforced): ``explain`` answers as the manifest-based ``nftpolicy explain`` on every
conformance case loaded into the API; a user whose RBAC lacks a verb gets one line naming it;
``status`` reads real agent HTTP servers (agent/daemon/health.py) through the API server's pod
proxy. ``trace`` needs a kubelet for ``pods/exec``: its command line is tested here, the whole
of it on the real node (tests/e2e_node.py)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from nftpolicy.agent.cli.kubectl import main as plugin
from nftpolicy.agent.cli.commands.explain import explain_port, split_port
from nftpolicy.agent.cli.kubectl.status import agent_status
from nftpolicy.agent.cli.kubectl.podexec import debug_url, exec_status
from nftpolicy.agent.cli.kubectl.trace import trace_argv
from nftpolicy.agent.cli.main import main as nftpolicy
from nftpolicy.agent.daemon.health import Health, serve_http
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.serving import ServingCertificate
from nftpolicy.agent.testbed.controlplane import free_port
from nftpolicy.translators.cases import case_manifests, load_case

from .conftest import clear_api

REPO = Path(__file__).resolve().parent.parent
ROOT = Path(__file__).parent / "conformance"
CASES = sorted((ROOT / "upstream").glob("*.yaml")) + sorted((ROOT / "cnp-upstream").glob("*.yaml"))
ORDER = {"Namespace": 0, "Node": 1, "Pod": 2, "NetworkPolicy": 3, "ClusterNetworkPolicy": 4}
CONTROL_PLANE = pytest.mark.tools("etcd", "kube-apiserver")  # what the control_plane fixture starts


def run(capsys, command, argv: list[str]) -> tuple[int, str, str]:
    code = command(argv)
    out, err = capsys.readouterr()
    return code, out, err


def addresses(case) -> dict[str, list[str]]:
    """Pod i of the case at 10.0.<i // 250>.<i % 250 + 1> (as translators/cases.py's evaluated_matrix)."""
    return {pod.key: [f"10.0.{i // 250}.{i % 250 + 1}"] for i, pod in enumerate(case.pods)}


def load(cp, objects) -> None:
    """Bring the control plane to ``objects``: every Pod, NetworkPolicy and ClusterNetworkPolicy
    replaced (namespaces stay, with the case's labels)."""
    clear_api(cp)
    for obj in sorted(objects, key=lambda o: ORDER[o["kind"]]):
        cp.apply({**obj, "spec": {k: v for k, v in obj["spec"].items() if v is not None}} if obj["kind"] == "Pod" else obj)


def test_a_kubeconfig_that_is_not_there_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "nope")
    assert run(capsys, plugin, ["status", "--kubeconfig", missing]) == \
        (2, "", f"kubectl nftpolicy: cannot use the kubeconfig {missing}: no such file\n")
    monkeypatch.setenv("KUBECONFIG", missing)  # kubectl's own variable names the file when the flag does not
    assert run(capsys, plugin, ["explain", "x/a", "x/b"]) == (2, "", f"kubectl nftpolicy: cannot use the kubeconfig {missing}: "
                                                                    "no such file (--kubeconfig, $KUBECONFIG, else ~/.kube/config)\n")


def test_port_syntax():
    assert split_port("x/a:80/TCP") == ("x/a", "80/TCP")
    assert split_port("svc/x/web") == ("svc/x/web", None)
    assert split_port("fd00::1") == ("fd00::1", None)
    assert split_port("[fd00::1]:53/UDP") == ("fd00::1", "53/UDP")
    assert split_port("10.0.0.0/8") == ("10.0.0.0/8", None)
    assert [explain_port(p) for p in ("5432/TCP", "53/udp", "8080", "http", "TCP/80")] == ["TCP/5432", "UDP/53", "8080", "http", "TCP/80"]


@CONTROL_PLANE
def test_explain_equals_the_manifest_explain_on_every_conformance_case(control_plane, tmp_path, capsys):
    """Each case loaded into the API; every pod asks, on every probe's port at once, the next pod
    (even positions: mostly within its namespace) or the fourth next (odd: across namespaces),
    and one pair as JSON: the plugin's exit code and output equal ``nftpolicy explain``
    on the same objects as manifests, and its verdicts the case's expected matrix."""
    cp = control_plane
    kubeconfig = ["--kubeconfig", cp.kubeconfig]
    asked = 0
    for path in CASES:
        case = load_case(path.read_text())
        objects = case_manifests(case, addresses(case))
        manifests = tmp_path / f"{path.stem}.yaml"
        manifests.write_text(yaml.safe_dump_all(objects))
        load(cp, objects)
        keys = [p.key for p in case.pods]
        explain_ports = [arg for probe in case.probes for arg in ("--port", f"{probe.protocol}/{probe.port}")]
        kubectl_ports = [arg for probe in case.probes for arg in ("--port", f"{probe.port}/{probe.protocol}")]  # kubectl's order
        for i, src in enumerate(keys):
            for dst in {keys[(i + (4 if i % 2 else 1)) % len(keys)]} - {src}:
                want = run(capsys, nftpolicy, ["explain", str(manifests), "--from", src, "--to", dst, *explain_ports])
                got = run(capsys, plugin, ["explain", *kubeconfig, src, dst, *kubectl_ports])
                assert got[:2] == want[:2], f"{path.stem} {src} -> {dst}: {got[2]} / {want[2]}"
                answers = [line.split()[0] == "ALLOWED" for line in got[1].splitlines() if line.split()[0] in ("ALLOWED", "DENIED")]
                assert answers == [probe.expected[(src, dst)] for probe in case.probes], f"{path.stem} {src} -> {dst}"
                asked += 1
        want = run(capsys, nftpolicy, ["explain", str(manifests), "--from", keys[0], "--to", keys[-1], "--output", "json"])
        got = run(capsys, plugin, ["explain", *kubeconfig, keys[0], keys[-1], "-o", "json"])
        assert got[:2] == want[:2], path.stem
    assert asked > 500
    clear_api(cp)


@CONTROL_PLANE
def test_explain_reads_nodes_from_the_api_for_a_nodes_peer(control_plane, tmp_path, capsys):
    """The Nodes' labels and addresses come from the API: a connection to a Node's address is
    decided by the nodes peer that selects it, as ``nftpolicy explain`` decides it on the same
    objects as manifests."""
    cp = control_plane
    case = load_case((ROOT / "cnp-own" / "305-nodes-peer.yaml").read_text())
    node_ips = {name: [f"172.31.0.{i + 2}"] for i, name in enumerate(case.nodes)}
    objects = case_manifests(case, addresses(case), node_ips)
    manifests = tmp_path / "nodes.yaml"
    manifests.write_text(yaml.safe_dump_all(objects))
    load(cp, objects)
    try:
        for src, node, port in (("x/b", "node1", "TCP/80"), ("x/a", "node2", "TCP/80"), ("y/a", "node2", "UDP/81")):
            address = node_ips[node][0]
            want = run(capsys, nftpolicy, ["explain", str(manifests), "--from", src, "--to", address, "--port", port])
            number, protocol = port.split("/")[1], port.split("/")[0]
            got = run(capsys, plugin, ["explain", "--kubeconfig", cp.kubeconfig, src, f"{address}:{number}/{protocol}"])
            assert got[:2] == want[:2], (got, want)
            assert f"is an address of node {node}" in got[1]
            assert (got[0] == 0) is case.probes[[(p.protocol, p.port) for p in case.probes].index((protocol, int(number)))].expected[
                (src, f"node:{node}")]
    finally:
        clear_api(cp)
        for name in case.nodes:
            cp.delete("Node", name, None)


@CONTROL_PLANE
def test_explain_a_service_and_an_address(control_plane, capsys):
    cp = control_plane
    case = load_case((ROOT / "upstream" / "001-default-deny-ingress.yaml").read_text())
    load(cp, case_manifests(case, addresses(case)))
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": "x", "name": "web"},
               "spec": {"selector": {"pod": "a"}, "ports": [{"port": 8080, "targetPort": 80, "protocol": "TCP"}]}}
    cp.request("POST", "/api/v1/namespaces/x/services", service)
    try:
        code, out, err = run(capsys, plugin, ["explain", "--kubeconfig", cp.kubeconfig, "y/b", "svc/x/web:8080/TCP"])
        assert code == 1 and out.startswith("DENIED  y/b -> x/a TCP/80"), (out, err)
        assert "--to x/web is a Service: its pods x/a; target ports TCP/80" in err
        code, out, _ = run(capsys, plugin, ["explain", "--kubeconfig", cp.kubeconfig, "10.1.2.3", "x/b:80/TCP"])
        assert code == 1 and out.startswith("DENIED  10.1.2.3 -> x/b TCP/80")
        code, _, err = run(capsys, plugin, ["explain", "--kubeconfig", cp.kubeconfig, "y/b", "svc/x/nothing"])
        assert (code, err) == (2, "kubectl nftpolicy: no Service x/nothing\n")
    finally:
        cp.request("DELETE", "/api/v1/namespaces/x/services/web")
        clear_api(cp)


def restricted_user(cp, name: str, rules: list[dict]) -> str:
    """A kubeconfig of ServiceAccount ``plugin-test/name`` bound to a ClusterRole of ``rules``."""
    cp.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name}, "rules": rules})
    cp.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
              "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
              "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": "plugin-test"}]})
    return cp.kubeconfig_for(cp.service_account_token("plugin-test", name), name)


READ_CLUSTER = [{"apiGroups": [""], "resources": ["pods", "namespaces", "nodes"], "verbs": ["list"]},
                {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["list"]}]


@CONTROL_PLANE
def test_a_missing_verb_is_one_line_naming_it(control_plane, capsys):
    cp = control_plane
    without_cnp = restricted_user(cp, "no-cnp", READ_CLUSTER)
    code, out, err = run(capsys, plugin, ["explain", "--kubeconfig", without_cnp, "x/a", "x/b:80/TCP"])
    assert (code, out, err) == (2, "", "kubectl nftpolicy: cannot list clusternetworkpolicies (forbidden): ask for list on "
                                       "clusternetworkpolicies.policy.networking.k8s.io cluster-wide\n")
    without_proxy = restricted_user(cp, "no-proxy", [{"apiGroups": [""], "resources": ["pods", "nodes"], "verbs": ["list"]}])
    cp.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1"}})
    put_agent(cp, "node1", "192.0.2.2", 9476)
    try:
        code, out, err = run(capsys, plugin, ["status", "--kubeconfig", without_proxy])
        assert (code, out, err) == (2, "", "kubectl nftpolicy: cannot get pods/proxy (forbidden): ask for get on pods/proxy "
                                           "in namespace nftpolicy-system\n")
        nothing = restricted_user(cp, "nothing", [])
        code, _, err = run(capsys, plugin, ["status", "--kubeconfig", nothing])
        assert (code, err) == (2, "kubectl nftpolicy: cannot list nodes (forbidden): ask for list on nodes cluster-wide\n")
    finally:
        cp.delete("Pod", "nftpolicy-agent-node1", "nftpolicy-system")
        cp.delete("Node", "node1")


@CONTROL_PLANE
def test_an_unreachable_api_server_is_one_line(control_plane, tmp_path, capsys):
    config = yaml.safe_load(Path(control_plane.kubeconfig).read_text())
    port = free_port()
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{port}"
    path = tmp_path / "gone.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    code, out, err = run(capsys, plugin, ["status", "--kubeconfig", str(path), "--request-timeout", "2"])
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"kubectl nftpolicy: cannot reach the API server at https://127.0.0.1:{port}: "), err


def host_address() -> str | None:
    """An IPv4 address of this host that is not loopback: the API server refuses to proxy to
    loopback and link-local addresses."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    found = [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]
    return found[0] if found else None


def agent_pod(namespace: str, node: str, ip: str, port: int) -> dict:
    """An agent pod as the chart's DaemonSet makes it (its labels, the http port), running at ``ip``."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": namespace, "name": f"nftpolicy-agent-{node}",
                         "labels": {"app.kubernetes.io/name": "nftpolicy", "app.kubernetes.io/component": "agent"}},
            "spec": {"nodeName": node, "hostNetwork": True,
                     "containers": [{"name": "agent", "ports": [{"name": "http", "containerPort": port}],
                                     "env": [{"name": "NFTPOLICY_TABLE", "value": "ours"},
                                             {"name": "NFTPOLICY_SERVICE_CIDR", "value": "10.96.0.0/12,fd00:96::/108"},
                                             {"name": "NFTPOLICY_PASS_MARK", "value": "0x80000"},
                                             {"name": "NFTPOLICY_DENY_ACTION", "value": "drop"},
                                             {"name": "NFTPOLICY_LOG_LEVEL", "value": "info"}]}]},
            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}


def put_agent(cp, node: str, ip: str, port: int) -> None:
    cp.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "nftpolicy-system"}})
    cp.apply(agent_pod("nftpolicy-system", node, ip, port))


@CONTROL_PLANE
def test_status_reads_every_agent_through_the_pod_proxy(control_plane, capsys):
    """Two real agent HTTP servers (one ready with synced metrics, one not listed yet) behind the
    API server's pod proxy, and a node without an agent pod."""
    ip = host_address()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address to serve the agents on")
    cp = control_plane
    servers = []
    ready_metrics, ready_health = Metrics(), Health(window=60)
    ready_health.ready = True
    ready_metrics.last_success.set(time.time() - 5)
    for _ in range(7):
        ready_metrics.table_generation.inc()
    for kind, value in {"sets": 4, "elements": 9, "policy chains": 2, "pod chains": 3}.items():
        ready_metrics.table_objects.labels(kind).set(value)
    waiting_metrics, waiting_health = Metrics(), Health(window=60)
    waiting_health.unlisted = lambda: ["Pod", "NetworkPolicy"]
    try:
        for node, metrics, health in (("node1", ready_metrics, ready_health), ("node2", waiting_metrics, waiting_health)):
            server = serve_http(f"{ip}:0", metrics, health)
            servers.append(server)
            put_agent(cp, node, ip, server.server_address[1])
        for node in ("node1", "node2", "node3"):
            cp.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        code, out, err = run(capsys, plugin, ["status", "--kubeconfig", cp.kubeconfig])
        assert code == 1, (out, err)
        lines = out.splitlines()
        assert lines[0].split() == ["NODE", "AGENT", "READY", "LAST", "SYNC", "GENERATION", "CHAINS", "SETS", "DROPS", "VERSION"]
        version = lines[1].split()[-1]
        node1 = lines[1].split()
        # the last sync was 5 s before the set-up, which takes a few seconds more on a busy machine
        assert node1[3].endswith("s") and 5 <= int(node1[3][:-1]) <= 60, node1
        assert node1[:3] + node1[4:] == ["node1", "nftpolicy-system/nftpolicy-agent-node1", "yes", "ago", "7", "5", "4", "0", version]
        assert lines[2].split() == ["node2", "nftpolicy-system/nftpolicy-agent-node2", "no", "-", "0", "-", "-", "0", version]
        assert lines[3].split() == ["node3", "-", "no", "-", "-", "-", "-", "-", "-"]
        assert lines[4:] == ["node2: not ready: not listed yet: Pod, NetworkPolicy", "node2: not ready: no sync committed yet",
                             "node3: no agent pod on this node (pods labelled app.kubernetes.io/name=nftpolicy,app.kubernetes.io/component=agent)"]
        code, out, _ = run(capsys, plugin, ["status", "--kubeconfig", cp.kubeconfig, "-n", "nftpolicy-system", "-o", "json"])
        statuses = json.loads(out)
        assert [s["ready"] for s in statuses] == [True, False, False] and statuses[0]["generation"] == 7
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        for node in ("node1", "node2"):
            cp.delete("Pod", f"nftpolicy-agent-{node}", "nftpolicy-system")
        for node in ("node1", "node2", "node3"):
            cp.delete("Node", node)


@CONTROL_PLANE
def test_status_of_a_secure_agent_reads_readyz_over_https_and_says_why_no_numbers(control_plane, capsys):
    """An agent with --metrics-secure (the chart's default): the pod proxy reaches its /readyz
    over HTTPS (the API server does not check the self-signed certificate), but passes no
    bearer token, so the numbers are read by ``nftpolicy status`` in the pod (pods/exec), which
    needs a kubelet: here the exec fails, and the row says so."""
    ip = host_address()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address to serve the agent on")
    cp = control_plane
    health = Health(window=60)
    health.ready = True
    server = serve_http(f"{ip}:0", Metrics(), health, tls=ServingCertificate(None, None, ["node1"]), guard=lambda request: (401, b"no\n", "text/plain"))
    pod = agent_pod("nftpolicy-system", "node1", ip, server.server_address[1])
    pod["spec"]["containers"][0]["env"].append({"name": "NFTPOLICY_METRICS_SECURE", "value": "true"})
    try:
        cp.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "nftpolicy-system"}})
        cp.apply(pod)
        cp.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1"}})
        code, out, err = run(capsys, plugin, ["status", "--kubeconfig", cp.kubeconfig, "-o", "json"])
        [status] = json.loads(out)
        assert status["ready"] is True and status["generation"] is None, (status, err)
        [reason] = status["reasons"]
        assert reason.startswith("cannot exec in nftpolicy-system/nftpolicy-agent-node1: "), reason
    finally:
        server.shutdown()
        cp.delete("Pod", "nftpolicy-agent-node1", "nftpolicy-system")
        cp.delete("Node", "node1")


def test_nftpolicy_status_in_the_agent_pod_gives_the_numbers_from_the_debug_socket(tmp_path, capsys, monkeypatch):
    """What the plugin runs in a secure agent's pod (status.in_pod_argv): ``nftpolicy status``
    against the agent's debug socket, which serves /readyz and /metrics without a token; its
    JSON fills the plugin's row."""
    from nftpolicy.agent.cli.kubectl import status as plugin_status
    from nftpolicy.agent.daemon.debughttp import serve_debug
    from nftpolicy.agent.daemon.health import health_routes

    metrics, health = Metrics(), Health(window=60)
    health.ready = True
    for _ in range(3):
        metrics.table_generation.inc()
    metrics.table_objects.labels("sets").set(4)
    socket_path = tmp_path / "debug.sock"
    server = serve_debug(f"unix:{socket_path}", lambda: None, health_routes(metrics, health))
    pod = agent_pod("nftpolicy-system", "node1", "192.0.2.2", 9476)
    pod["spec"]["containers"][0]["env"].append({"name": "NFTPOLICY_DEBUG_ADDRESS", "value": f"unix:{socket_path}"})
    try:
        argv = plugin_status.in_pod_argv(pod)
        assert argv == ["nftpolicy", "status", "--agent", f"unix:{socket_path}", "--output", "json"]
        code, out, err = run(capsys, nftpolicy, argv[1:])
        assert (code, err) == (0, "") and json.loads(out)["generation"] == 3
        monkeypatch.setattr(plugin_status, "run_in", lambda api, agent, command, timeout: (code, out, err))
        row = plugin_status.AgentStatus("node1", ready=True)
        plugin_status.read_in_pod(None, pod, row)  # type: ignore[arg-type]
        assert (row.generation, row.sets, row.reasons) == (3, 4, [])
    finally:
        server.shutdown()
    code, out, err = run(capsys, nftpolicy, argv[1:])
    assert code == 2 and err.startswith(f"nftpolicy: cannot reach the agent at unix:{socket_path}: ")


class _Proxy:
    """An API whose pod proxy answers /readyz with ok and /metrics with ``metrics``."""

    def __init__(self, metrics: str) -> None:
        self.metrics = metrics

    def proxy_get(self, namespace: str, name: str, port: int, path: str, https: bool = False) -> tuple[int, str]:
        return (200, "ok") if path == "readyz" else (200, self.metrics)


@pytest.mark.parametrize("metrics", ["<html>a proxy's page</html>", "nftpolicy_table_generation NaN\n"])
def test_an_agent_whose_metrics_cannot_be_read_is_one_row_with_the_reason(metrics):
    """One bad /metrics answer (not Prometheus text, NaN where a count belongs) is a reason on
    that node's row, never a traceback that loses every other node's."""
    pod = {"metadata": {"namespace": "nftpolicy", "name": "agent-x"}, "status": {"phase": "Running", "podIP": "10.240.0.1",
           "conditions": [{"type": "Ready", "status": "True"}]},
           "spec": {"containers": [{"name": "agent", "ports": [{"name": "http", "containerPort": 9476}]}]}}
    status = agent_status(_Proxy(metrics), "node1", pod, "app=nftpolicy")  # type: ignore[arg-type]
    assert status.ready is True and status.generation is None
    assert len(status.reasons) == 1 and status.reasons[0].startswith("/metrics unreadable: ")


def test_trace_runs_nftpolicy_trace_with_the_agents_table_settings():
    pod = agent_pod("nftpolicy-system", "node1", "192.0.2.2", 9476)
    assert trace_argv(pod, "10.0.0.1", "10.0.0.2", "TCP/80", 20) == [
        "nftpolicy", "trace", "--from", "10.0.0.1", "--to", "10.0.0.2", "--timeout", "20", "--port", "TCP/80",
        "--agent", "unix:/run/nftpolicy/debug.sock", "--table", "ours", "--pass-mark", "0x80000", "--deny-action", "drop", "--service-cidr", "10.96.0.0/12", "--service-cidr", "fd00:96::/108"]
    assert "--port" not in trace_argv(pod, "10.0.0.1", "10.0.0.2", None, 20)
    env = pod["spec"]["containers"][0]["env"]
    env.append({"name": "NFTPOLICY_DEBUG_ADDRESS"})  # "": no endpoint (the API leaves the empty value out)
    assert "--agent" not in trace_argv(pod, "10.0.0.1", "10.0.0.2", None, 20)
    env[-1]["value"] = "[::]:9999"
    assert trace_argv(pod, "10.0.0.1", "10.0.0.2", None, 20)[8:10] == ["--agent", "http://[::1]:9999"]


def test_an_execs_exit_code_comes_from_the_status_on_its_error_channel():
    # What kubelet sends (k8s.io/apimachinery remotecommand: NonZeroExitCode with an ExitCode cause).
    failed = {"metadata": {}, "status": "Failure", "message": "command terminated with non-zero exit code: exit status 1",
              "reason": "NonZeroExitCode", "details": {"causes": [{"reason": "ExitCode", "message": "1"}]}}
    assert exec_status(json.dumps({"metadata": {}, "status": "Success"})) == (0, None)
    assert exec_status(json.dumps(failed)) == (1, None)
    not_found = {"status": "Failure", "message": 'exec: "nftpolicy": executable file not found in $PATH', "reason": "InternalError"}
    assert exec_status(json.dumps(not_found)) == (2, 'exec: "nftpolicy": executable file not found in $PATH')
    assert exec_status("") == (2, "no exit status")  # the exec did not end (or ended without one)


def test_the_debug_url_is_where_a_process_beside_the_agent_reaches_it():
    assert [debug_url(a) for a in ("unix:/run/nftpolicy/debug.sock", "127.0.0.1:9479", ":9479", "0.0.0.0:1", "[::]:2", "[fd00::1]:3",
                                   "node.local:4", "")] == [
        "unix:/run/nftpolicy/debug.sock", "http://127.0.0.1:9479", "http://127.0.0.1:9479", "http://127.0.0.1:1", "http://[::1]:2", "http://[fd00::1]:3",
        "http://node.local:4", None]


def test_the_krew_manifest_follows_krews_rules():
    """plugins/krew/nftpolicy.yaml against the rules krew checks before it installs a manifest
    (sigs.k8s.io/krew internal/index/validation/validate.go, ValidatePlugin), and against the
    package: the version and the script that the archive holds."""
    import re
    import tomllib

    path = REPO / "plugins" / "krew" / "nftpolicy.yaml"
    manifest = yaml.safe_load(path.read_text())
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    project, script_files = pyproject["project"], pyproject["tool"]["setuptools"]["script-files"]
    assert manifest["apiVersion"] == "krew.googlecontainertools.github.com/v1alpha2" and manifest["kind"] == "Plugin"
    assert manifest["metadata"]["name"] == path.stem and re.fullmatch(r"[\w-]+", path.stem)
    spec = manifest["spec"]
    assert spec["shortDescription"] and not set(spec["shortDescription"]) & {"\r", "\n"}
    assert spec["version"] == f"v{project['version']}"  # krew's semver wants the v
    assert re.fullmatch(r"v\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?", spec["version"])
    assert spec["platforms"]
    for platform in spec["platforms"]:
        assert platform["uri"] and re.fullmatch(r"[a-f0-9]{64}", platform["sha256"])
        assert platform["bin"] == "kubectl-nftpolicy" and f"agent/cli/{platform['bin']}" in script_files
        assert platform.get("files") is None or all(f["from"] and f["to"] for f in platform["files"])
        selector = platform["selector"]
        keys = [*selector.get("matchLabels", {}), *(e["key"] for e in selector.get("matchExpressions", []))]
        assert keys and set(keys) <= {"os", "arch"}
