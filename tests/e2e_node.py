"""The real node's checks, run by ``bash .ci/e2e`` (``python -m tests.e2e_node``).

On a :class:`~nftpolicy.agent.testbed.realnode.RealCluster` of real kubelets and containerd:

1. **Vacuity**: before nftpolicy is installed, one deny spec of the upstream suite must fail
   (nothing else on the node enforces NetworkPolicy).
2. **Install**: ``helm install`` of ``charts/nftpolicy`` as shipped, with the image built from the
   ``Containerfile``; the DaemonSet's pods become Ready through their own readiness probe.
3. **kubectl nftpolicy** (:func:`plugin_checks`): ``kubectl nftpolicy status`` reports every
   node's agent ready, with its numbers (read in its container: the chart's secure metrics);
   ``kubectl nftpolicy explain`` answers as ``nftpolicy explain`` does on
   ``kubectl get -o yaml`` of the same objects; ``kubectl nftpolicy trace`` of a denied and an
   allowed connection, sent while it waits, shows the policy that decided in the agents' chains.
4. **The upstream suite**: ``e2e-netpol.test --ginkgo.focus='\\[sig-network\\] Netpol'
   --ginkgo.skip='SCTPConnectivity' --provider=local``; every spec that runs must pass.
5. **The ClusterNetworkPolicy conformance suite** of sigs.k8s.io/network-policy-api v0.3.0
   (:mod:`tests.e2e_cnp`): ``cnp-conformance.test`` with every feature nftpolicy supports;
   each test's result and the suite's own report in the report. Every sub-test must pass but
   those whose probe failed on SCTP (this kernel has no SCTP sockets).
6. **Lifecycle with traffic** (:mod:`tests.e2e_lifecycle`): a denied and an allowed pod pair
   probed every 100 ms while the agent's pod is deleted, the chart upgraded, containerd,
   kubelet and kube-apiserver restarted and the chart uninstalled.

``--ip-family ipv6`` (or ``dual``) runs it all on an IPv6 single-stack (dual-stack) cluster.
Prints one line per step and a table of the specs, writes ``e2e-report.json`` (figures for
``bench/real_node.py`` and docs/contributing.md) in ``--report-dir``, and ends with ginkgo's summary line.
Exit 0 only when every step passed; 2 when a tool is missing; 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import signal
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from nftpolicy.agent.testbed import images
from nftpolicy.agent.testbed.controlplane import find_binary
from nftpolicy.agent.testbed.realnode import (IP_FAMILIES, PAUSE_IMAGE, RealCluster, RealNodeError, cgroup_dir,
                                              container_pid, url_host)

from .e2e_cnp import REPORT, run_cnp_conformance
from .e2e_lifecycle import lifecycle

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / ".tools"
CHART = REPO / "charts" / "nftpolicy"
# test/utils/image/manifest.go of the pinned Kubernetes: the name the e2e framework asks for.
AGNHOST_IMAGE = "registry.k8s.io/e2e-test-images/agnhost:2.63.0"
# conformance/base/manifests.yaml of sigs.k8s.io/network-policy-api v0.3.0: the same agnhost
# (its commands run through /bin/bash, which the Debian base of ours has), a second tag.
CNP_AGNHOST_IMAGE = "registry.k8s.io/e2e-test-images/agnhost:2.45"
AGENT_REPOSITORY = "localhost/nftpolicy"
AGENT_NAMESPACE = "nftpolicy"
FOCUS = r"\[sig-network\] Netpol"
# Why ClusterNetworkPolicy conformance sub-tests may fail here, known and documented
# (tests/e2e_cnp.py _cause): "sctp", a probe that could not open an SCTP socket (this kernel has none).
KNOWN_CNP_CAUSES = ("sctp",)
SKIP = "SCTPConnectivity"  # this kernel has no SCTP
# The vacuity check: a deny spec that must fail while nothing enforces NetworkPolicy.
VACUITY_FOCUS = r"\[sig-network\] Netpol NetworkPolicy between server and client should support a 'default-deny-ingress' policy"
SUMMARY = re.compile(r"^(SUCCESS!|FAIL!|Ran \d+ of \d+ Specs).*$", re.M)


class Step:
    """Prints ``<name> ... ok (12.3 s)`` or ``... FAILED: <why>`` for one step; records it."""

    results: list[dict[str, Any]] = []

    def __init__(self, name: str) -> None:
        self.name, self.started = name, time.monotonic()

    def __enter__(self) -> "Step":
        print(f"{self.name} ...", flush=True)
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> bool:
        seconds = time.monotonic() - self.started
        ok = error is None
        why = "" if ok else (str(error).splitlines() or [type(error).__name__])[0]
        print(f"{self.name}: {'ok' if ok else 'FAILED: ' + why} ({seconds:.1f} s)", flush=True)
        Step.results.append({"step": self.name, "ok": ok, "seconds": round(seconds, 1), "why": why})
        return False


def build_images(run: str) -> list[Path]:
    """pause, agnhost and the agent's image, built here as docker-archives for containerd to
    import; returns their paths. Each archive is kept in ``$NFTPOLICY_CI_CACHE/images`` under
    its image's id, so an unchanged image is not written again (the agent's image is rebuilt
    from the layer cache each run, and gets a new id only when its sources changed). Call with
    :func:`images.storage_lock` held until the archives are imported: another run's build
    removes archives of an older id."""
    bin_dir = TOOLS / "bin"
    agent_tag = f"{AGENT_REPOSITORY}:e2e-{run}"
    build_stage = f"localhost/nftpolicy-build:e2e-{run}"
    images.files_image(PAUSE_IMAGE, {"/pause": bin_dir / "pause"}, ["/pause"])
    images.files_image(AGNHOST_IMAGE, {"/agnhost": bin_dir / "agnhost",
                                       "/localhost.crt": TOOLS / "agnhost-files" / "localhost.crt",
                                       "/localhost.key": TOOLS / "agnhost-files" / "localhost.key"},
                       ["/agnhost"], ["pause"], base=images.BASE_IMAGE)
    images.buildah("tag", AGNHOST_IMAGE, CNP_AGNHOST_IMAGE)
    images.project_image(agent_tag, build_stage)
    try:
        return [*(images.cached_archive(tag) for tag in (PAUSE_IMAGE, AGNHOST_IMAGE, agent_tag)),
                images.cached_archive(CNP_AGNHOST_IMAGE, name=CNP_AGNHOST_IMAGE.replace(":", "-"))]
    finally:
        images.buildah("rmi", agent_tag, build_stage, check=False)


def implementation_version() -> str:
    """nftpolicy's version and the commit under test (``0.1.0+g<commit>``, ``.dirty`` when the
    work tree has changes), as the ClusterNetworkPolicy suite's report records it."""
    project = importlib.metadata.version("nftpolicy")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
    return f"{project}+g{commit}{'.dirty' if dirty else ''}"


def helm(cluster: RealCluster, *args: str, timeout: float = 300) -> str:
    """``helm ARGS`` against the cluster (from the first node's namespace)."""
    return cluster.run([find_binary("helm"), *args], timeout=timeout).stdout


def install_chart(cluster: RealCluster, run: str, *values: str) -> dict[str, float]:
    """The chart as shipped, in namespace ``nftpolicy`` (Pod Security level ``privileged``:
    hostNetwork and NET_ADMIN, as docs/ says); returns seconds from ``helm install`` to every
    DaemonSet pod Ready and to the first committed table on every node."""
    cluster.kubectl("create", "namespace", AGENT_NAMESPACE)
    cluster.kubectl("label", "namespace", AGENT_NAMESPACE, "pod-security.kubernetes.io/enforce=privileged")
    started = time.monotonic()
    tables: dict[int, float] = {}

    def watch_tables() -> None:
        while len(tables) < cluster.node_count and time.monotonic() - started < 300:
            for node in range(1, cluster.node_count + 1):
                if node not in tables and cluster.run(["nft", "list", "table", "inet", "nftpolicy"], node=node,
                                                      check=False).returncode == 0:
                    tables[node] = time.monotonic() - started
            time.sleep(0.1)

    watcher = threading.Thread(target=watch_tables, daemon=True)
    watcher.start()
    helm(cluster, "install", "nftpolicy", str(CHART), "--namespace", AGENT_NAMESPACE,
         "--set", f"image.repository={AGENT_REPOSITORY}", "--set", f"image.tag=e2e-{run}",
         "--set", "image.pullPolicy=Never", *values)
    cluster.kubectl("rollout", "status", "daemonset/nftpolicy", "-n", AGENT_NAMESPACE, "--timeout=180s", timeout=200)
    ready = time.monotonic() - started
    watcher.join(timeout=60)
    if len(tables) < cluster.node_count:
        raise RealNodeError(f"no table on nodes {sorted(set(range(1, cluster.node_count + 1)) - set(tables))}")
    return {"ready_seconds": round(ready, 2), "table_seconds": round(max(tables.values()), 2)}


class AgentUsage(threading.Thread):
    """Samples the agent containers' cgroups (v1 ``memory`` and ``cpuacct``) every ``period``
    seconds until :meth:`finish`: the largest RSS (``total_rss`` of memory.stat, MiB) and the CPU
    used over the window (cores, summed over the nodes' agents)."""

    def __init__(self, cluster: RealCluster, period: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.cluster, self.period = cluster, period
        self.stop = threading.Event()
        self.max_rss_mib = 0.0
        self.paths = self._cgroups()
        self.cpu_start = self._cpu()
        self.started = time.monotonic()

    def _cgroups(self) -> list[tuple[Path, Path]]:
        pods = json.loads(self.cluster.kubectl("get", "pods", "-n", AGENT_NAMESPACE, "-o", "json",
                                               "-l", "app.kubernetes.io/name=nftpolicy"))["items"]
        found = []
        for pod in pods:
            container_id = next(c for c in pod["status"]["containerStatuses"] if c["name"] == "agent")["containerID"]
            pid = container_pid(container_id.split("://", 1)[1])
            found.append((cgroup_dir(pid, "memory"), cgroup_dir(pid, "cpuacct")))
        return found

    def _cpu(self) -> int:
        return sum(int((cpu / "cpuacct.usage").read_text()) for _, cpu in self.paths)

    def run(self) -> None:
        while not self.stop.is_set():
            rss = 0
            for memory, _ in self.paths:
                stat = dict(line.split() for line in (memory / "memory.stat").read_text().splitlines())
                rss = max(rss, int(stat["total_rss"]))
            self.max_rss_mib = max(self.max_rss_mib, rss / 2**20)
            self.stop.wait(self.period)

    def finish(self) -> dict[str, float]:
        """Stop sampling; returns ``{"seconds", "cpu_cores", "max_rss_mib"}``."""
        self.stop.set()
        self.join()
        seconds = time.monotonic() - self.started
        return {"seconds": round(seconds, 1), "cpu_cores": round((self._cpu() - self.cpu_start) / 1e9 / seconds, 4),
                "max_rss_mib": round(self.max_rss_mib, 1)}


def run_suite(cluster: RealCluster, out: Path, focus: str, skip: str, timeout: float, procs: int = 1) -> dict[str, Any]:
    """The upstream specs, run by the ginkgo CLI on ``procs`` parallel processes; returns
    ``{"rc", "summary", "specs": [{name, state, seconds}], "seconds"}`` from its junit report and
    its output (``out/e2e.log``)."""
    out.mkdir(parents=True, exist_ok=True)
    junit = out / "junit.xml"
    argv = [str(TOOLS / "bin" / "ginkgo"), f"--procs={procs}", f"--focus={focus}", f"--skip={skip}", "--no-color", "-v",
            f"--output-dir={out}", "--junit-report=junit.xml", f"--timeout={int(timeout)}s",
            str(TOOLS / "bin" / "e2e-netpol.test"), "--",
            f"--kubeconfig={cluster.kubeconfig}", "--provider=local", f"--report-dir={out}"]
    started = time.monotonic()
    log = out / "e2e.log"
    with open(log, "w") as stream:
        result = cluster.run(argv, check=False, timeout=timeout + 120, cwd=str(out), stdout=stream, stderr=subprocess.STDOUT,
                             env={"PATH": f"{TOOLS / 'bin'}:{os.environ.get('PATH', '')}"})
    summary = [m.group(0) for m in SUMMARY.finditer(log.read_text(errors="replace"))]
    specs = []
    if junit.exists():
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            state = "passed"
            if case.find("skipped") is not None:
                state = "skipped"
            elif case.find("failure") is not None or case.find("error") is not None:
                state = "failed"
            name = case.get("name", "")
            if state != "skipped" or "Netpol" in name:  # not the specs out of focus that the binary links
                specs.append({"name": name, "state": state, "seconds": float(case.get("time", 0))})
    return {"rc": result.returncode, "summary": summary, "specs": specs, "seconds": round(time.monotonic() - started, 1)}


PLUGIN_NAMESPACE = "plugin-check"
PLUGIN_POLICY = "server-80-from-client"
TRACE_TIMEOUT = 30  # seconds each agent's `nftpolicy trace` waits for the packet (the plugin's --timeout)
TRACE_FIRST_CONNECT = 3.0  # seconds from starting the plugin to the first connection: its exec and monitor start
TRACE_CONNECT_PERIOD = 1.0  # seconds between the client's connections while the trace waits


def plugin_objects(client_node: str, server_node: str) -> list[dict[str, Any]]:
    """The plugin checks' objects in namespace ``plugin-check``: agnhost pods ``client`` and
    ``server`` (HTTP on 80; nothing on 81) on the given nodes, and the NetworkPolicy
    ``server-80-from-client`` that isolates the server's ingress and allows TCP/80 from the client."""
    pods = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": PLUGIN_NAMESPACE, "name": name, "labels": {"app": name}},
             "spec": {"nodeName": node, "containers": [{"name": "agnhost", "image": AGNHOST_IMAGE, "imagePullPolicy": "Never",
                                                          "args": ["netexec", "--http-port=80"], "ports": [{"containerPort": 80}]}]}}
            for name, node in (("client", client_node), ("server", server_node))]
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": PLUGIN_NAMESPACE, "name": PLUGIN_POLICY},
              "spec": {"podSelector": {"matchLabels": {"app": "server"}}, "policyTypes": ["Ingress"],
                       "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}], "ports": [{"port": 80, "protocol": "TCP"}]}]}}
    return [*pods, policy]


def trace_problem(port: int, code: int, out: str) -> str | None:
    """What is wrong with ``kubectl nftpolicy trace``'s exit ``code`` and standard output ``out``
    for a connection from the plugin checks' client to their server on TCP/``port`` (80, allowed:
    exit 0, the policy's rule 0 allowed it and nothing dropped it; any other, denied: exit 1,
    the policy matched nothing and the server's pod chain rejected it with a TCP reset, which the
    kernel's trace reports as ``drop`` and nftpolicy's as the reject it is: docs/commands.md,
    trace); None when nothing is. Each step is a line
    ``  CHAIN: WHAT -> VERDICT``."""
    steps = [line.strip().split(": ", 1)[1] for line in out.splitlines() if line.startswith("  ") and ": " in line]
    policy, pod = f"policy {PLUGIN_NAMESPACE}/{PLUGIN_POLICY} ingress", f"pod {PLUGIN_NAMESPACE}/server"
    if port == 80:
        want_code, wanted = 0, [f"{policy} rule 0 (allows) -> return", f"{pod} ingress allowed -> return"]
    else:
        want_code, wanted = 1, [f"{policy}: no rule matched -> return", f"{pod} reject ingress -> reject with tcp reset"]
    problems = [f"exit {code}, expected {want_code}"] if code != want_code else []
    problems += [f"no step {w!r}" for w in wanted if w not in steps]
    if port == 80 and any(step.endswith("-> drop") for step in steps):
        problems.append("a step dropped it")
    return "; ".join(problems) or None


def trace_while_connecting(cluster: RealCluster, plugin: Callable[..., subprocess.CompletedProcess[str]], port: int) -> dict[str, Any]:
    """``kubectl nftpolicy trace`` from the plugin checks' client to their server on TCP/``port``
    while the client connects (``kubectl exec client -- /agnhost connect``, a new connection every
    :data:`TRACE_CONNECT_PERIOD` seconds from :data:`TRACE_FIRST_CONNECT` on, until the trace
    ends: each agent traces the first packet it sees after its monitor joined). Returns the trace's
    exit code, output and the connections' outcomes; raises RealNodeError (with the trace's output)
    when :func:`trace_problem` finds one."""
    kubectl = cluster.binaries["kubectl"]
    server_ip = cluster.kubectl("get", "pod", "server", "-n", PLUGIN_NAMESPACE, "-o", "jsonpath={.status.podIP}").strip()
    connects: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        trace = pool.submit(plugin, "trace", f"{PLUGIN_NAMESPACE}/client", f"{PLUGIN_NAMESPACE}/server:{port}/TCP",
                            "-n", AGENT_NAMESPACE, "--timeout", str(TRACE_TIMEOUT))
        deadline = time.monotonic() + TRACE_TIMEOUT
        time.sleep(TRACE_FIRST_CONNECT)
        while not trace.done() and time.monotonic() < deadline:
            started = time.monotonic()
            connect = cluster.run([kubectl, "exec", "-n", PLUGIN_NAMESPACE, "client", "--", "/agnhost", "connect",
                                   f"{url_host(server_ip)}:{port}", "--timeout", "1s"], check=False, timeout=30)
            connects.append("connected" if connect.returncode == 0 else (connect.stderr or connect.stdout).strip()[-200:] or f"exit {connect.returncode}")
            time.sleep(max(0.0, TRACE_CONNECT_PERIOD - (time.monotonic() - started)))
        result = trace.result()
    problem = trace_problem(port, result.returncode, result.stdout)
    if problem:
        raise RealNodeError(f"kubectl nftpolicy trace TCP/{port}: {problem}; connections: {connects}; "
                            f"output:\n{result.stdout}{result.stderr}")
    return {"exit": result.returncode, "output": result.stdout, "connections": connects}


def plugin_checks(cluster: RealCluster) -> dict[str, Any]:
    """``kubectl nftpolicy`` run by kubectl itself (the console script on its PATH) as the admin:
    ``status`` must report every node's agent ready; ``explain`` between two agnhost pods on the
    first and last node (:func:`plugin_objects`), one port a policy allows and one it does not,
    must print what ``nftpolicy explain`` prints on ``kubectl get
    pods,namespaces,networkpolicies,nodes -A -o yaml`` and exit alike; ``trace`` of each port
    while the client connects must show the policy's decision in the agents' chains
    (:func:`trace_while_connecting`). Returns the answers; raises RealNodeError."""
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    kubectl = cluster.binaries["kubectl"]

    def plugin(*args: str) -> subprocess.CompletedProcess[str]:
        return cluster.run([kubectl, "nftpolicy", *args], check=False, timeout=120, env=env)

    status = plugin("status", "-n", AGENT_NAMESPACE, "-o", "json")
    if status.returncode != 0:
        raise RealNodeError(f"kubectl nftpolicy status exited {status.returncode}: {(status.stderr or status.stdout).strip()[-1000:]}")
    statuses = json.loads(status.stdout)
    ready = sorted(s["node"] for s in statuses if s["ready"])
    if ready != sorted(cluster.node_names):
        raise RealNodeError(f"kubectl nftpolicy status: ready agents on {ready}, nodes {cluster.node_names}")
    # the chart's secure metrics: the numbers come from `nftpolicy status` in each agent's container (pods/exec)
    unread = [(s["node"], s["reasons"]) for s in statuses if s["generation"] is None]
    if unread:
        raise RealNodeError(f"kubectl nftpolicy status: no numbers for {unread}")
    cluster.kubectl("create", "namespace", PLUGIN_NAMESPACE)
    try:
        objects = plugin_objects(cluster.node_names[0], cluster.node_names[-1])
        cluster.run([kubectl, "apply", "-f", "-"], input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
        cluster.kubectl("wait", "--for=condition=Ready", "pod", "--all", "-n", PLUGIN_NAMESPACE, "--timeout=120s", timeout=150)
        dump = Path(cluster.dir) / "plugin-check.yaml"
        dump.write_text(cluster.kubectl("get", "pods,namespaces,networkpolicies,nodes", "-A", "-o", "yaml"))
        answers: dict[str, Any] = {}
        for port, code in (("80", 0), ("81", 1)):
            got = plugin("explain", f"{PLUGIN_NAMESPACE}/client", f"{PLUGIN_NAMESPACE}/server:{port}/TCP")
            want = subprocess.run([str(Path(sys.executable).parent / "nftpolicy"), "explain", str(dump), "--from", f"{PLUGIN_NAMESPACE}/client",
                                   "--to", f"{PLUGIN_NAMESPACE}/server", "--port", f"TCP/{port}"], capture_output=True, text=True, timeout=120)
            if (got.returncode, got.stdout) != (want.returncode, want.stdout) or got.returncode != code:
                raise RealNodeError(f"kubectl nftpolicy explain TCP/{port}: exit {got.returncode} {got.stdout!r} {got.stderr.strip()!r}; "
                                    f"nftpolicy explain on the dump: exit {want.returncode} {want.stdout!r} {want.stderr.strip()!r}")
            answers[f"TCP/{port}"] = got.stdout.splitlines()[0]
            print(f"  {answers[f'TCP/{port}']}", flush=True)
        traces = {}
        for trace_port in (81, 80):
            traces[f"TCP/{trace_port}"] = traced = trace_while_connecting(cluster, plugin, trace_port)
            print(f"  trace TCP/{trace_port}: exit {traced['exit']} after {len(traced['connections'])} connections", flush=True)
            print("\n".join(f"    {line}" for line in traced["output"].splitlines()), flush=True)
        return {"ready": ready, "explain": answers, "trace": traces}
    finally:
        cluster.run([kubectl, "delete", "namespace", PLUGIN_NAMESPACE, "--wait=true", "--timeout=120s"], check=False, timeout=150)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e_node", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2, help="kubelets (each with its containerd), 1 to 9")
    parser.add_argument("--report-dir", type=Path, default=REPO / "build" / "e2e")
    parser.add_argument("--focus", default=FOCUS, help="ginkgo focus of the upstream run")
    parser.add_argument("--procs", type=int, default=3, help="parallel ginkgo processes of the upstream run")
    parser.add_argument("--skip-netpol", action="store_true", help="leave out the upstream Netpol suite")
    parser.add_argument("--skip-cnp", action="store_true", help="leave out the ClusterNetworkPolicy conformance suite")
    parser.add_argument("--skip-lifecycle", action="store_true")
    parser.add_argument("--skip-vacuity", action="store_true")
    parser.add_argument("--ip-family", choices=list(IP_FAMILIES), default="ipv4",
                        help="the cluster's IP families: ipv4, ipv6 (single-stack) or dual (dual-stack, IPv4 first)")
    args = parser.parse_args(argv)
    args.report_dir = args.report_dir.resolve()  # ginkgo and the suites run with cwd in it
    missing = [tool for tool in ("helm", "ginkgo", "e2e-netpol.test", "cnp-conformance.test", "pause", "agnhost")
               if not (TOOLS / "bin" / tool).exists()]
    if missing:
        print(f"e2e: missing tool {missing[0]} in .tools/bin: run `bash .ci/install --test`", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    run = f"{int(time.time())}"
    report: dict[str, Any] = {"nodes": args.nodes, "ip_family": args.ip_family}
    args.report_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    summary_line = "e2e: the upstream suite did not run"
    ok = True
    try:
        with images.storage_lock():  # until the archives are in containerd
            with Step("build images (pause, agnhost, nftpolicy)"):
                tars = build_images(run)
            cluster = RealCluster(nodes=args.nodes, images=tars, family=args.ip_family)
            try:
                with Step(f"start the real cluster ({args.nodes} nodes, {args.ip_family})"):
                    cluster.start()
            except BaseException:
                cluster.close()
                raise
        try:
            if not args.skip_vacuity:
                with Step("vacuity: a deny spec fails without nftpolicy"):
                    vacuity = run_suite(cluster, args.report_dir / "vacuity", VACUITY_FOCUS, SKIP, 600)
                    report["vacuity"] = vacuity
                    log = (args.report_dir / "vacuity" / "e2e.log").read_text(errors="replace")
                    if vacuity["rc"] == 0 or "wrong results in reachability matrix" not in log:
                        raise RealNodeError(f"the deny spec did not fail on its matrix without nftpolicy: "
                                            f"{vacuity['summary']}")
            with Step("helm install charts/nftpolicy"):
                # the Service ranges of the cluster's families, as values.yaml asks of operators, and
                # with IPv6 the HTTP server on [::] (the probes go to the node's primary address:
                # on 0.0.0.0 an IPv6 single-stack node's agent is never Ready)
                services = json.dumps([plan.services for plan in cluster.plans])
                address = [] if cluster.family == "ipv4" else ["--set-json", 'agent.httpAddress="[::]:9476"']
                report["install"] = install_chart(cluster, run, "--set-json", f"agent.serviceCidrs={services}", *address)
                print(f"  DaemonSet Ready {report['install']['ready_seconds']} s, tables committed "
                      f"{report['install']['table_seconds']} s after helm install", flush=True)
            with Step("agent at idle (20 s)"):
                idle = AgentUsage(cluster)
                idle.start()
                time.sleep(20)
                report["agent_idle"] = idle.finish()
                print(f"  agent at idle: {report['agent_idle']}", flush=True)
            with Step("kubectl nftpolicy status, explain and trace"):
                report["plugin"] = plugin_checks(cluster)
            if not args.skip_netpol:
                with Step("upstream e2e: [sig-network] Netpol"):
                    busy = AgentUsage(cluster)
                    busy.start()
                    suite = run_suite(cluster, args.report_dir / "netpol", args.focus, SKIP, 2400, args.procs)
                    report["agent_during_suite"] = busy.finish()
                    print(f"  agent during the suite: {report['agent_during_suite']}", flush=True)
                    report["suite"] = suite
                    for spec in suite["specs"]:
                        if spec["name"].startswith("[It]"):
                            print(f"  {spec['state'].upper():7} {spec['seconds']:6.1f} s  {spec['name']}")
                    if suite["summary"]:
                        summary_line = suite["summary"][-1]
                    failed = [s for s in suite["specs"] if s["state"] == "failed"]
                    if suite["rc"] != 0 or failed or not any(s["state"] == "passed" for s in suite["specs"]):
                        raise RealNodeError(f"{len(failed)} specs failed (ginkgo exit {suite['rc']})")
            if not args.skip_cnp:
                with Step("ClusterNetworkPolicy conformance (sigs.k8s.io/network-policy-api)"):
                    cnp = run_cnp_conformance(cluster, TOOLS / "bin" / "cnp-conformance.test", args.report_dir / "cnp",
                                              AGENT_NAMESPACE, implementation_version())
                    report["cnp_conformance"] = cnp
                    for test in cnp["tests"]:
                        print(f"  {test['state'].upper():7} {test['seconds']:6.1f} s  {test['name']}")
                        for probe in test["probes"]:
                            print(f"          {probe}")
                        for sub in cnp["subtests"]:
                            if sub["name"].startswith(test["name"] + "/") and sub["state"] == "failed":
                                print(f"          FAILED ({sub['cause']}) {sub['name'].split('/', 1)[1]}: "
                                      f"{'; '.join(sub['probes'][-1:])}")
                    print(f"  {cnp['summary']} in {cnp['seconds']:.1f} s; the suite's report "
                          f"{args.report_dir / 'cnp' / REPORT}", flush=True)
                    # The run's exact result is reported above and in docs/conformance/. It fails on
                    # a wrong verdict or anything unexplained, and on a failed test none of whose
                    # sub-tests failed (Setup, a manifest); one cause is known and documented: SCTP
                    # probes (no SCTP sockets in this kernel).
                    unexplained = [sub["name"] for sub in cnp["subtests"]
                                   if sub["state"] == "failed" and sub["cause"] not in KNOWN_CNP_CAUSES]
                    unexplained += [test["name"] for test in cnp["tests"] if test["state"] == "failed"
                                    and not any(sub["name"].startswith(test["name"] + "/") and sub["state"] == "failed"
                                                for sub in cnp["subtests"])]
                    if cnp["report"] is None:
                        unexplained.append(f"no report in {REPORT}")
                    if unexplained or not any(sub["state"] == "passed" for sub in cnp["subtests"]):
                        raise RealNodeError(f"ClusterNetworkPolicy conformance: {len(unexplained)} failed for a "
                                            f"reason other than SCTP: {', '.join(unexplained)}")
            if not args.skip_lifecycle:
                with Step("lifecycle with traffic"):
                    report["lifecycle"] = lifecycle(cluster, helm, CHART, AGNHOST_IMAGE)
        finally:
            with Step("tear the real cluster down"):
                cluster.close()
    except Exception as exc:  # any failure: one line, and the report and summary below
        ok = False
        print(f"e2e: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
    except KeyboardInterrupt:
        print("e2e: interrupted", file=sys.stderr)
        return 130
    report["steps"] = Step.results
    report["seconds"] = round(time.monotonic() - started, 1)
    (args.report_dir / "e2e-report.json").write_text(json.dumps(report, indent=1))
    ok = ok and all(step["ok"] for step in Step.results)
    print(f"e2e: {'passed' if ok else 'FAILED'} in {report['seconds'] / 60:.1f} min; report {args.report_dir / 'e2e-report.json'}")
    print(summary_line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
