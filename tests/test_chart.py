"""The Helm chart (charts/nftpolicy): ``helm lint --strict``, renders with the default values and
the two files in ``charts/nftpolicy/ci`` validated against the Kubernetes schemas of two
versions, the rendered objects (RBAC, security, probes, env, volumes), and the chart against the
agent's real flags: every flag has a value, the agent parses the chart's environment into the
values, and the real agent, started with the chart's environment, serves the probes' paths on
the probes' port.

Helm comes from ``.ci/install`` (``.tools/bin/helm``); kubernetes-validate from the ``test``
extra. Nothing here needs a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from nftpolicy.agent.cli import flags


from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.testbed.controlplane import find_binary

from .conftest import REPO, nft
from .conftest import http_get as conftest_http_get

CHART = REPO / "charts" / "nftpolicy"
KUBERNETES_VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
NFTPOLICY = str(Path(sys.executable).parent / "nftpolicy")
# The oldest version Chart.yaml's kubeVersion admits and the newest kubernetes-validate knows.
KUBE_VERSIONS = ("1.30.0", "1.37.0")
RELEASE, NAMESPACE = "nftpolicy", "kube-system"
pytestmark = pytest.mark.tools("helm")
VALUES = {"default": None, "full": CHART / "ci" / "full-values.yaml", "manifests": CHART / "ci" / "manifests-values.yaml"}


# --- helpers ---------------------------------------------------------------------------------

def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run helm (the callers' tests are marked ``tools("helm")``)."""
    result = subprocess.run([find_binary("helm"), *args], check=False, capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}{result.stderr}"
    return result


def values_args(name: str) -> list[str]:
    return ["--values", str(VALUES[name])] if VALUES[name] else []


_rendered: dict[tuple, str] = {}


def render_text(name: str, kube_version: str = KUBE_VERSIONS[-1], *extra: str) -> str:
    key = (name, kube_version, extra)
    if key not in _rendered:
        _rendered[key] = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                              "--kube-version", kube_version, *values_args(name), *extra).stdout
    return _rendered[key]


def render(name: str, *extra: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(render_text(name, KUBE_VERSIONS[-1], *extra)) if d]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def agent_role(docs: list[dict]) -> dict:
    """The agent's ClusterRole (the release's full name; the other is the scrapers' metrics-reader)."""
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and not d["metadata"]["name"].endswith("-metrics-reader")]
    return role


def agent_rbac(docs: list[dict]) -> tuple[dict, dict, dict]:
    """The agent's ClusterRole, the ClusterRoleBinding of that role and the ServiceAccount."""
    role = agent_role(docs)
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] == role["metadata"]["name"]]
    return role, binding, one(docs, "ServiceAccount")


def granted(role: dict) -> set[tuple[str, str, str]]:
    """A ClusterRole's resource rules as (resource as RBAC names it: plural.group, verb) pairs."""
    return {(f"{resource}.{group}" if group else resource, verb) for rule in role["rules"] for group in rule.get("apiGroups", ())
            for resource in rule.get("resources", ()) for verb in rule["verbs"]}


def agent_container(docs: list[dict]) -> dict:
    containers = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["agent"]
    return containers[0]


def chart_values(name: str) -> dict:
    """The values a file gives, merged over values.yaml as Helm does (maps merge, the rest replaces)."""
    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for key, value in over.items():
            out[key] = merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
        return out

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return merge(values, yaml.safe_load(VALUES[name].read_text())) if VALUES[name] else values


def agent_flags() -> list[argparse.Action]:
    """The options of ``nftpolicy agent``, from the agent's own parser."""
    sub = next(a for a in flags.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices["agent"]._actions if a.option_strings and a.dest != "help"]


def flag_name(action: argparse.Action) -> str:
    return next(o for o in action.option_strings if o.startswith("--"))


def value_key(action: argparse.Action) -> str:
    """The chart's value for a flag: camelCase of the flag, plural for a repeatable flag."""
    first, *rest = flag_name(action)[2:].split("-")
    return first + "".join(w.capitalize() for w in rest) + ("s" if isinstance(action, argparse._AppendAction) else "")


def env_of(container: dict) -> dict[str, str]:
    """The container's environment, with NODE_NAME (from the downward API) as node1."""
    env = {}
    for var in container["env"]:
        if "valueFrom" in var:
            assert var["name"] == "NODE_NAME" and var["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}, var
            env["NODE_NAME"] = "node1"
        else:
            env[var["name"]] = var["value"]
    return env


def parse_agent(monkeypatch, env: dict[str, str], argv: list[str] = (), command: str | None = "agent") -> dict:
    """What ``nftpolicy agent`` makes of ``env`` and ``argv``, as the flags it runs with: parsed by
    the agent's own parser, the ruleset flags as the Config it builds (``command=None``: ``argv``
    names its own command)."""
    for name in list(os.environ):
        if name.startswith(flags.ENV_PREFIX) or name == "NODE_NAME":
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = flags.parser().parse_args([command, *argv] if command else list(argv))
    result = vars(args) | {"config": flags.config_from(args)}
    result.pop("service_cidr")  # its default (None) only means Config's default: compare the Config
    return result


def argv_of(values: dict) -> list[str]:
    """The agent's command line for the chart's agent values (empty ones left out)."""
    by_key = {value_key(a): flag_name(a) for a in agent_flags()}
    argv = []
    for key, value in values["agent"].items():
        for item in value if isinstance(value, list) else [value]:
            if item != "":
                argv.append(f"{by_key[key]}={item}")
    return argv


def http_port(address: str) -> int:
    return int(address.rpartition(":")[2])


# --- lint, schemas ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", VALUES)
def test_helm_lint_strict(name):
    out = helm("lint", "--strict", str(CHART), *values_args(name))
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", VALUES)
def test_render_validates_against_kubernetes_schemas(name, kube_version, tmp_path):
    rendered = tmp_path / f"{name}.yaml"
    rendered.write_text(render_text(name, kube_version))
    kinds = [d["kind"] for d in yaml.safe_load_all(rendered.read_text()) if d]
    out = subprocess.run([str(KUBERNETES_VALIDATE), "--strict", "-k", kube_version, str(rendered)],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = (out.stdout + out.stderr).splitlines()
    passed = [line for line in lines if line.startswith("INFO") and " passed for resource " in line]
    # Every object but the ServiceMonitor (a CRD: see test_service_monitor) passed a schema.
    assert len(passed) == len([k for k in kinds if k != "ServiceMonitor"]), lines
    assert all("ServiceMonitor" in line for line in lines if not line.startswith("INFO")), lines


@pytest.mark.parametrize("setting, message", [
    ("agent.tabel=x", "tabel"),
    ("agent.logLevel=verbose", "logLevel"),
    ("agent.httpAddress=9476", "httpAddress"),
    ("agent.policyMark=0xzz", "policyMark"),
    ("agent.serviceCidrs={10.96.0.0}", "serviceCidrs"),
    ("updateStrategy.maxUnavailable=0", "maxUnavailable"),
])
def test_schema_rejects_bad_values(setting, message):
    out = helm("template", RELEASE, str(CHART), "--set", setting, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_kubeconfig_and_manifests_exclude_each_other():
    out = helm("template", RELEASE, str(CHART), "--set", "agent.kubeconfig=/k", "--set", "agent.manifests=/m", check=False)
    assert out.returncode != 0 and "exclude each other" in out.stderr


def test_notes_render(tmp_path):
    """NOTES.txt is left out of ``helm template`` and ``helm install --dry-run`` needs a cluster:
    render it as a YAML string in a copy of the chart."""
    copy = tmp_path / "chart"
    subprocess.run(["cp", "-r", str(CHART), str(copy)], check=True)
    text = (copy / "templates" / "NOTES.txt").read_text()
    (copy / "templates" / "notes.yaml").write_text('{{- define "notes" }}' + text + '{{ end }}\nnotes: {{ include "notes" . | toJson }}\n')
    out = helm("template", RELEASE, str(copy), "--namespace", NAMESPACE, "--show-only", "templates/notes.yaml").stdout
    notes = yaml.safe_load(out)["notes"]
    assert "kubectl -n kube-system rollout status daemonset/nftpolicy" in notes
    assert "each node's port 9476 (/healthz, /readyz, /metrics)" in notes
    assert "--clusterrole=nftpolicy-metrics-reader" in notes and "port https-metrics" in notes
    assert "nftpolicy cleanup --table nftpolicy" in notes and "br_netfilter" in notes


def test_chart_version_follows_the_project():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    assert agent_container(render("default"))["image"] == f"localhost/nftpolicy:{project['version']}"


# --- the rendered objects --------------------------------------------------------------------

READS = {(resource, verb) for resource in ("pods", "namespaces", "nodes", "networkpolicies.networking.k8s.io",
                                          "clusternetworkpolicies.policy.networking.k8s.io") for verb in ("get", "list", "watch")}
EVENTS = {("events", "create"), ("events", "patch")}
REVIEWS = {("tokenreviews.authentication.k8s.io", "create"), ("subjectaccessreviews.authorization.k8s.io", "create")}


@pytest.mark.parametrize(("name", "extra", "reviews"), [("default", (), True), ("full", (), True),
                                                         ("default", ("--set", "agent.metricsSecure=false"), False)])
def test_rbac_reads_what_the_agent_watches_and_writes_events_and_reviews_only(name, extra, reviews):
    """Reads, Events, and with --metrics-secure the token and access reviews: nothing else."""
    docs = render(name, *extra)
    role, binding, account = agent_rbac(docs)
    assert granted(role) == READS | EVENTS | (REVIEWS if reviews else set())
    assert not any(d["kind"] in ("Role", "RoleBinding") for d in docs)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}]
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def rbac_comment() -> dict[str, set[tuple[str, str]]]:
    """What values.yaml's comment above ``rbac:`` says the agent's ClusterRole grants: its list
    of ``VERBS[, with CONDITION]: RESOURCES (why)`` lines, as (resource, verb) pairs under
    "always" or the condition."""
    lines = (CHART / "values.yaml").read_text().split("\nrbac:\n")[0].splitlines()
    start = next(i for i, line in enumerate(lines) if "grant exactly this" in line)
    entries: list[str] = []
    for line in lines[start + 3:]:
        text = line.removeprefix("#")
        if not text.startswith("  "):
            assert text.startswith(" Nothing else"), line
            break
        if text.startswith("    "):
            entries[-1] += " " + text.strip()
        else:
            entries.append(text.strip())
    said: dict[str, set[tuple[str, str]]] = {}
    for entry in entries:
        head, _, resources = entry.partition(": ")
        verbs = [v for v in head.split(", ") if not v.startswith("with ")]
        condition = next((v.removeprefix("with ") for v in head.split(", ") if v.startswith("with ")), "always")
        resources = re.sub(r"\([^)]*\)", "", resources)
        said.setdefault(condition, set()).update((r.strip(), v) for r in resources.split(",") if r.strip() for v in verbs)
    return said


def test_the_values_rbac_comment_says_what_the_clusterrole_grants():
    """Each verb on each resource the comment names is granted, and nothing more, with and
    without the option it names."""
    said = rbac_comment()
    assert set(said) == {"always", "agent.metricsSecure"}
    assert granted(agent_role(render("default", "--set", "agent.metricsSecure=false"))) == said["always"]
    assert granted(agent_role(render("default", "--set", "agent.metricsSecure=true"))) == said["always"] | said["agent.metricsSecure"]


def test_the_metrics_reader_grants_get_on_metrics_and_binds_the_subjects_given():
    """As kube-rbac-proxy's charts do: a ClusterRole for scrapers, bound only to what the values name."""
    default = [d for d in render("default") if d["metadata"]["name"].endswith("-metrics-reader")]
    assert [(d["kind"], d["rules"]) for d in default] == [("ClusterRole", [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}])]
    full = {d["kind"]: d for d in render("full") if d["metadata"]["name"].endswith("-metrics-reader")}
    assert full["ClusterRoleBinding"]["roleRef"]["name"] == full["ClusterRole"]["metadata"]["name"]
    assert full["ClusterRoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": "prometheus-k8s", "namespace": "monitoring"}]
    assert not [d for d in render("default", "--set", "agent.metricsSecure=false") if d["metadata"]["name"].endswith("-metrics-reader")]


def test_rbac_and_service_can_be_left_out():
    kinds = sorted(d["kind"] for d in render("manifests"))
    assert kinds == ["DaemonSet"]
    assert one(render("manifests"), "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"] == "default"


@pytest.mark.parametrize("name", VALUES)
def test_daemonset_runs_on_the_host_network_with_net_admin_only(name):
    """NET_ADMIN only; the netns example (``agent.netns``, testing) also SYS_ADMIN, which setns(2) needs."""
    daemonset = one(render(name), "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "hostPID" not in pod and "hostIPC" not in pod
    security = agent_container(render(name))["securityContext"]
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "SYS_ADMIN"] if name == "manifests" else ["NET_ADMIN"]}
    assert security["runAsUser"] == 0  # added capabilities are effective for root only
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()


def test_defaults_schedule_on_every_node_first():
    docs = render("default")
    daemonset = one(docs, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert daemonset["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    resources = agent_container(docs)["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"} and "memory" in resources["limits"]


def test_values_reach_the_pod():
    docs, values = render("full"), chart_values("full")
    daemonset = one(docs, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert daemonset["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "25%"
    assert pod["tolerations"] == values["tolerations"] and "priorityClassName" not in pod
    assert pod["affinity"] == values["affinity"] and pod["imagePullSecrets"] == values["imagePullSecrets"]
    assert pod["terminationGracePeriodSeconds"] == 60
    container = agent_container(docs)
    assert container["image"] == f"{values['image']['repository']}@{values['image']['digest']}"
    assert container["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
    assert {"name": "KUBERNETES_SERVICE_HOST", "value": "api.cluster.internal"} in container["env"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert labels["example.com/tier"] == "node"
    assert daemonset["spec"]["template"]["metadata"]["annotations"] == values["podAnnotations"]


@pytest.mark.parametrize("name", VALUES)
def test_standard_labels_on_every_object(name):
    for doc in render(name):
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "nftpolicy" and labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["helm.sh/chart"] == "nftpolicy-0.1.0"
        assert labels["app.kubernetes.io/version"] == "0.1.0"


@pytest.mark.parametrize("name", VALUES)
def test_every_mount_has_a_volume_and_tmp_is_writable(name):
    docs = render(name)
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in agent_container(docs)["volumeMounts"]}
    assert set(mounts.values()) == set(volumes), "every volume mounted, every mount backed"
    assert "emptyDir" in volumes[mounts["/tmp"]]  # the root filesystem is read-only
    if name == "manifests":
        manifests = chart_values(name)["agent"]["manifests"]
        assert mounts[manifests] in volumes and "hostPath" in volumes[mounts[manifests]]


# --- probes, port, service, ServiceMonitor ---------------------------------------------------

def test_the_agent_serves_health_and_metrics_on_http_address():
    """The paths the chart probes are the ones the agent's --http-address serves (its help says
    which; test_agent_serves_the_chart_probes checks the running agent)."""
    http = next(a for a in agent_flags() if flag_name(a) == "--http-address")
    for path in ("/healthz", "/readyz", "/metrics"):
        assert path in http.help


@pytest.mark.parametrize("name", VALUES)
def test_probes_point_at_the_health_paths_on_the_agent_port(name):
    docs = render(name)
    container = agent_container(docs)
    address = chart_values(name)["agent"]["httpAddress"]
    if name == "default":
        http = next(a for a in agent_flags() if flag_name(a) == "--http-address")
        assert address == http.default
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": http_port(address)}
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path and ports[get["port"]] == http_port(address)
        assert get.get("scheme", "HTTP") == ("HTTPS" if chart_values(name)["agent"]["metricsSecure"] else "HTTP")
        # Listening on one address only: the probes go there (the pod's address is the node's).
        host = address.rpartition(":")[0].strip("[]")
        assert get.get("host") == (None if host in ("0.0.0.0", "::") else host)


@pytest.mark.parametrize("name", ["default", "full"])
def test_metrics_service_selects_the_agent_port(name):
    docs = render(name)
    service, daemonset = one(docs, "Service"), one(docs, "DaemonSet")
    assert service["spec"]["selector"] == daemonset["spec"]["selector"]["matchLabels"]
    [port] = service["spec"]["ports"]
    assert port["name"] == "https-metrics" and port["targetPort"] == "http"  # both renders serve secure metrics
    assert port["port"] == http_port(chart_values(name)["agent"]["httpAddress"])
    assert (service["spec"].get("clusterIP") == "None") == (name == "default")


# The parts of prometheus-operator's ServiceMonitor CRD (monitoring.coreos.com/v1) the chart
# uses; unknown fields are errors, as with --strict.
DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
RELABEL = {"type": "object", "additionalProperties": False, "properties": {
    "sourceLabels": {"type": "array", "items": {"type": "string"}}, "separator": {"type": "string"},
    "targetLabel": {"type": "string"}, "regex": {"type": "string"}, "modulus": {"type": "integer"},
    "replacement": {"type": "string"},
    "action": {"enum": ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep",
                        "lowercase", "uppercase", "keepequal", "dropequal"]}}}
SERVICE_MONITOR = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object"},
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "endpoints"], "properties": {
            "jobLabel": {"type": "string"},
            "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "selector": {"type": "object", "additionalProperties": False, "properties": {
                "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                    "bearerTokenFile": {"type": "string"},
                    "tlsConfig": {"type": "object", "additionalProperties": False, "properties": {
                        "insecureSkipVerify": {"type": "boolean"}, "serverName": {"type": "string"},
                        "ca": {"type": "object", "additionalProperties": False, "properties": {
                            "secret": {"type": "object", "additionalProperties": False, "required": ["name", "key"],
                                       "properties": {"name": {"type": "string"}, "key": {"type": "string"}}}}}}},
                    "interval": DURATION, "scrapeTimeout": DURATION,
                    "relabelings": {"type": "array", "items": RELABEL},
                    "metricRelabelings": {"type": "array", "items": RELABEL}}}}}}}}


@pytest.mark.parametrize(("secure", "scheme", "tls"), [("true", "https", {"insecureSkipVerify": True}), ("false", "http", None)])
def test_service_monitor_follows_secure_metrics(secure, scheme, tls):
    """A self-signed certificate (no tls.secretName, no tlsConfig given) is not verified: the
    token decides; without secure metrics, plain HTTP and no token."""
    docs = render("default", "--set", f"serviceMonitor.enabled=true,agent.metricsSecure={secure}")
    [endpoint] = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    jsonschema.validate(one(docs, "ServiceMonitor"), SERVICE_MONITOR)
    assert (endpoint["scheme"], endpoint.get("tlsConfig"), "bearerTokenFile" in endpoint) == (scheme, tls, secure == "true")
    assert endpoint["port"] == one(docs, "Service")["spec"]["ports"][0]["name"] == f"{scheme}-metrics"


def test_secure_metrics_mounts_the_tls_secret_and_refuses_what_cannot_work():
    container = agent_container(render("default", "--set", "tls.secretName=agent-tls"))
    env = env_of(container)
    assert (env["NFTPOLICY_TLS_CERT_FILE"], env["NFTPOLICY_TLS_PRIVATE_KEY_FILE"]) == ("/etc/nftpolicy/tls/tls.crt", "/etc/nftpolicy/tls/tls.key")
    assert {"name": "tls", "mountPath": "/etc/nftpolicy/tls", "readOnly": True} in container["volumeMounts"]
    assert "NFTPOLICY_TLS_CERT_FILE" not in env_of(agent_container(render("default")))  # self-signed
    for setting, message in (("agent.manifests=/m", "agent.metricsSecure checks tokens with the Kubernetes API"),
                             ("tls.secretName=x,agent.metricsSecure=false", "tls.secretName is served with agent.metricsSecure=true only"),
                             ("agent.tlsCertFile=/c", "agent.tlsCertFile and agent.tlsPrivateKeyFile go together")):
        out = helm("template", RELEASE, str(CHART), "--set", setting, check=False)
        assert out.returncode != 0 and message in out.stderr, out.stderr


def test_service_monitor_only_when_enabled():
    assert not any(d["kind"] == "ServiceMonitor" for d in render("default"))
    out = helm("template", RELEASE, str(CHART), "--set", "serviceMonitor.enabled=true", "--set", "service.enabled=false", check=False)
    assert out.returncode != 0 and "serviceMonitor.enabled needs service.enabled" in out.stderr


def test_service_monitor():
    docs = render("full")
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    jsonschema.validate(monitor, SERVICE_MONITOR)
    assert monitor["metadata"]["namespace"] == "monitoring" and monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"] and endpoint["path"] == "/metrics"
    # secure metrics: HTTPS with Prometheus' own token, the CA of the values
    assert endpoint["scheme"] == "https" and endpoint["bearerTokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert endpoint["tlsConfig"] == chart_values("full")["serviceMonitor"]["tlsConfig"]
    assert endpoint["relabelings"][0] == {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node", "action": "replace"}
    assert endpoint["relabelings"][1:] == chart_values("full")["serviceMonitor"]["relabelings"]


# --- the chart against the agent's flags -----------------------------------------------------

def test_every_agent_flag_has_a_value_and_a_schema_entry():
    keys = {value_key(a) for a in agent_flags() if flag_name(a) != "--node"}
    assert set(yaml.safe_load((CHART / "values.yaml").read_text())["agent"]) == keys
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["agent"]["properties"]) == keys


def test_every_agent_flag_reaches_the_agent_as_its_environment_variable():
    """--node through NODE_NAME from spec.nodeName; every other flag through NFTPOLICY_<FLAG>
    in one of the renders (flags with an empty default only when set)."""
    seen = {var["name"] for name in VALUES for var in agent_container(render(name))["env"]}
    for action in agent_flags():
        flag = flag_name(action)
        assert (flags.env_name(flag) if flag != "--node" else "NODE_NAME") in seen, flag
    assert {n for n in seen if n.startswith(flags.ENV_PREFIX)} <= {flags.env_name(flag_name(a)) for a in agent_flags()}


def test_default_values_are_the_agent_defaults(monkeypatch):
    """But one: the chart serves secure metrics by default; the agent, which runs off a cluster
    too (manifests: no API server to check tokens with), does not."""
    env = env_of(agent_container(render("default")))
    assert parse_agent(monkeypatch, env) == parse_agent(monkeypatch, {"NODE_NAME": "node1"}) | {"metrics_secure": True}


@pytest.mark.parametrize("name", ["full", "manifests"])
def test_the_agent_reads_the_chart_environment_as_the_values(name, monkeypatch):
    """The agent's parse of the rendered environment equals its parse of the same values given as
    command-line flags."""
    env = env_of(agent_container(render(name)))
    assert parse_agent(monkeypatch, env) == parse_agent(monkeypatch, {"NODE_NAME": "node1"}, argv_of(chart_values(name)))


def test_the_ci_values_set_every_flag_away_from_its_default(monkeypatch):
    """So that a flag the chart passes wrongly cannot hide behind its default."""
    defaults = parse_agent(monkeypatch, {})
    parsed = [parse_agent(monkeypatch, {}, argv_of(chart_values(name))) for name in ("full", "manifests")]
    for action in agent_flags():
        if flag_name(action) == "--service-cidr":
            assert any(p["config"].service_cidrs != defaults["config"].service_cidrs for p in parsed)
        elif flag_name(action) != "--node":
            assert any(p[action.dest] != defaults[action.dest] for p in parsed), flag_name(action)


@pytest.mark.parametrize("name", list(VALUES))
def test_kubectl_nftpolicy_trace_runs_in_the_agent_pod_with_its_table_and_debug_endpoint(name, monkeypatch):
    """The ``nftpolicy trace`` command line ``kubectl nftpolicy trace`` runs in a rendered agent
    pod parses (nftpolicy's own parser, no NFTPOLICY_* variable set: only the agent reads them)
    to the table settings, network namespace and debug endpoint the agent has there."""
    from nftpolicy.agent.cli.kubectl.podexec import debug_url
    from nftpolicy.agent.cli.kubectl.trace import trace_argv

    pod = one(render(name), "DaemonSet")["spec"]["template"]
    agent = parse_agent(monkeypatch, env_of(agent_container(render(name))))
    argv = trace_argv(pod, "10.0.0.1", "10.0.0.2", "TCP/80", 20)
    assert argv[0] == "nftpolicy"
    traced = parse_agent(monkeypatch, {}, argv[1:], command=None)
    assert traced["config"] == agent["config"] and traced["netns"] == agent["netns"]
    assert traced["agent"] == debug_url(agent["debug_address"])
    assert (traced["source"], traced["destination"], traced["port"], traced["timeout"]) == ("10.0.0.1", "10.0.0.2", "TCP/80", 20)


# --- the real agent, started with the chart's environment ------------------------------------

def http_get(ns: str, port: int, path: str) -> tuple[int, str]:
    """GET http://127.0.0.1:PORT/PATH inside namespace ``ns``: (status, body), (0, "") when refused."""
    with netns.entered(ns):  # the socket is made in the test's namespace
        return conftest_http_get(f"http://127.0.0.1:{port}{path}")


@pytest.mark.kernel
def test_agent_serves_the_chart_probes(make_netns, tmp_path):
    """``nftpolicy agent`` with the default render's environment (plus --manifests for the
    example, as there is no API server), run inside a namespace the test made: the probes' port
    answers the probes' paths, /readyz once the ruleset is in, and the table is the chart's."""
    docs = render("default")
    container = agent_container(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # --manifests: no API server, so no secure metrics (tests/test_rbac.py runs the secure default against one)
    env = env_of(container) | {flags.env_name("--manifests"): str(REPO / "examples" / "shop"), flags.env_name("--metrics-secure"): "false"}
    ns = make_netns()
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
    log = tmp_path / "agent.log"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(flags.ENV_PREFIX) and k != "NODE_NAME"}
    with log.open("w") as stderr:
        command = ["ip", "netns", "exec", ns, NFTPOLICY, "agent"]
        agent = subprocess.Popen(command, env=clean | env, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr)
    try:
        probes = {container[p]["httpGet"]["path"]: ports[container[p]["httpGet"]["port"]] for p in ("livenessProbe", "readinessProbe")}
        deadline = time.monotonic() + 30
        while http_get(ns, probes["/readyz"], "/readyz")[0] != 200:
            assert agent.poll() is None, f"agent exited {agent.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"/readyz never 200:\n{log.read_text()}"
            time.sleep(0.2)
        assert http_get(ns, probes["/healthz"], "/healthz")[0] == 200
        status, metrics = http_get(ns, ports["http"], "/metrics")
        assert status == 200 and "nftpolicy_" in metrics
        table = env[flags.env_name("--table")]
        assert f"table inet {table}" in nft(ns, "list", "tables")
    finally:
        agent.terminate()
        agent.wait(timeout=20)
    assert agent.returncode == 143, log.read_text()  # SIGTERM's code (agent/interrupts.py)


# --- the schema refuses what the agent refuses -------------------------------------------------

BAD_AGENT_VALUES = [
    {"serviceCidrs": ["10.96.0.0"]}, {"serviceCidrs": ["300.1.2.0/24"]}, {"externalCidrs": ["10.0.0.0/33"]},
    {"externalCidrs": ["fd00::/129"]}, {"externalCidrs": ["fe80::%eth0/64"]}, {"serviceCidrs": ["cluster"]},
    {"nodePortRange": "32767-30000"}, {"nodePortRange": "0-100"}, {"nodePortRange": "30000-70000"},
    {"policyMark": "0x3"}, {"policyMark": "0x100000000"}, {"passedMark": 3}, {"passedMark": 4294967296},
    {"policyMark": "0x20000"}, {"policyMark": "131072"}, {"passedMark": 65536},  # the same bit as the other mark
    {"policyMark": "0x00040000"}, {"passedMark": 262144},  # the ClusterNetworkPolicy pass mark
    {"passMark": "0x10000"}, {"passMark": 131072}, {"passMark": "0x3"}, {"passMark": 0},
    {"httpAddress": "0.0.0.0:99999"}, {"httpAddress": "garbage"}, {"httpAddress": "300.0.0.1:9476"},
    {"httpAddress": "[zz::1]:9476"}, {"httpAddress": "a b:9476"},
    {"table": "a.b"}, {"table": "1table"}, {"priority": 2147483648},
    {"minSyncInterval": -1}, {"resyncInterval": 0}, {"apiTimeout": 0}, {"watchTimeout": 0}, {"watchTimeout": 1.5}, {"watchIdleTimeout": 0},
    {"countersInterval": 0.5}, {"countersInterval": -1},
    {"logFormat": "xml"}, {"logLevel": "trace"}, {"denyAction": "REJECT"}, {"denyAction": "deny"}, {"denyAction": True},
    {"metricsSecure": "yes"}, {"debugAddress": "unix:run/debug.sock"}, {"debugAddress": "[::1]:99999"},
    {"dnsHoldMark": "0x1000000"}, {"passMark": "0x4000000"},  # the marks of unknownPods (hold by default)
]
GOOD_AGENT_VALUES = [
    {"serviceCidrs": ["10.96.0.0/12", "fd00:10:96::/108"]}, {"externalCidrs": ["0.0.0.0/0", "::/0", "::ffff:10.0.0.0/104"]},
    {"nodePortRange": "30000-30000"}, {"nodePortRange": "1-65535"}, {"policyMark": "0x00080000"},
    {"policyMark": "0x80000000", "passedMark": 1}, {"passedMark": "0x200000"}, {"minSyncInterval": 0},
    {"passMark": "0x80000"}, {"passMark": 1}, {"policyMark": "0x40000", "passMark": "0x100000"},
    {"httpAddress": "[::]:9476"}, {"httpAddress": "127.0.0.1:1"}, {"httpAddress": "localhost:9476"},
    {"httpAddress": ":9476"}, {"table": "my_table-2"}, {"priority": -2147483648}, {"denyAction": "drop"}, {"denyAction": "reject"},
    {"countersInterval": 1},
    {"metricsSecure": False}, {"debugAddress": "unix:/run/nftpolicy/agent-1.sock"}, {"debugAddress": "127.0.0.1:9479"}, {"debugAddress": ""},
]


def agent_refuses(monkeypatch, overrides: dict) -> bool:
    """True when the agent's own parser refuses the environment the chart makes of ``overrides``
    (over the defaults of values.yaml), as it would in the pod."""
    values = chart_values("default")["agent"] | overrides
    by_key = {value_key(a): flag_name(a) for a in agent_flags()}
    env = {"NODE_NAME": "node1"}
    for key, value in values.items():
        if value in ("", [], None):
            continue
        env[flags.env_name(by_key[key])] = ",".join(value) if isinstance(value, list) else \
            (str(int(value)) if isinstance(value, float) and key == "watchTimeout" and value.is_integer() else str(value))
    try:
        parse_agent(monkeypatch, env)
    except (SystemExit, flags.UsageError):
        return True
    return False


def helm_refuses(values: dict) -> str:
    """Helm's error for ``values`` (nested, as in values.yaml), or "" when it renders."""
    args = [a for key, value in values.items() for a in ("--set-json", f"{key}={json.dumps(value)}")]
    result = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args, check=False)
    return result.stderr.strip() if result.returncode else ""


@pytest.mark.parametrize("overrides", BAD_AGENT_VALUES, ids=lambda o: json.dumps(o))
def test_the_schema_and_the_agent_both_refuse_a_bad_value(monkeypatch, overrides):
    assert agent_refuses(monkeypatch, overrides), f"the agent takes {overrides}"
    assert helm_refuses({f"agent.{k}": v for k, v in overrides.items()}), f"helm takes {overrides}"


@pytest.mark.parametrize("overrides", GOOD_AGENT_VALUES, ids=lambda o: json.dumps(o))
def test_the_schema_and_the_agent_both_take_a_good_value(monkeypatch, overrides):
    assert not agent_refuses(monkeypatch, overrides), f"the agent refuses {overrides}"
    assert helm_refuses({f"agent.{k}": v for k, v in overrides.items()}) == ""


@pytest.mark.parametrize(("quantity", "good"), [
    ("100m", True), ("128Mi", True), ("1.5", True), ("2e3", True), (2, True), ("0.5Gi", True),
    ("lots", False), ("128MB", False), ("-1", False), (-1, False), ("1 Gi", False),
])
def test_resource_quantities_are_checked(quantity, good):
    error = helm_refuses({"resources.requests.cpu": quantity, "resources.limits.memory": quantity})
    assert (error == "") is good, error
