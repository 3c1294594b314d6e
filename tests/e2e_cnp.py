"""The ClusterNetworkPolicy conformance suite of sigs.k8s.io/network-policy-api on the real
cluster (part of ``.ci/e2e``, after the upstream Netpol suite).

``.tools/bin/cnp-conformance.test`` (``tools/npapi``, built by ``.ci/install --test``) is the
module's suite at v0.3.0 (``policy.networking.k8s.io/v1beta1``): its tests and its
``utils/suite`` unchanged, run as the module's ``TestConformanceProfiles`` runs them for a
report (the profile ``ClusterNetworkPolicy``, the implementation's details, ``--report-output``)
with every feature nftpolicy supports (:data:`FEATURES`: the standard ``ClusterNetworkPolicy``
and the experimental ``ClusterNetworkPolicyNamedPorts`` and
``ClusterNetworkPolicyEgressNodePeers``). This kernel has no SCTP sockets: the SCTP servers are
taken out of the suite's base manifests at build time (``tools/npapi/manifests.py``, or no pod
of the suite would ever become Ready); every test runs, and the sub-tests that probe SCTP fail
here, on those probes only (cause ``sctp``).

:func:`run_cnp_conformance` installs the CRD when the cluster has none (and waits until every
agent has seen it), runs the suite and returns each test's result, for a failed one the suite's
own words about the probe that failed (expected vs observed), and the suite's report.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from nftpolicy.agent.testbed.controlplane import CRD_MODULE, CRD_PATH
from nftpolicy.agent.testbed.realnode import RealCluster, RealNodeError

CRD_NAME = "clusternetworkpolicies.policy.networking.k8s.io"
# conformance/utils/suite/features.go: what this run asks for, every feature nftpolicy supports
# (the profile implies the standard one; --supported-features lists the experimental ones).
PROFILE = "ClusterNetworkPolicy"
FEATURES = "ClusterNetworkPolicyNamedPorts,ClusterNetworkPolicyEgressNodePeers"
# The implementation's details the report records (conformance/utils/flags: all required). The
# project has no public address: they name the repository's own files.
IMPLEMENTATION = {"organization": "nftpolicy", "project": "nftpolicy", "url": "README.md",
                  "contact": "docs/contributing.md",
                  "additional-info": ".ci/e2e (tests/e2e_cnp.py); the run's figures in docs/conformance/README.md"}
REPORT = "cnp-conformance-report.yaml"
RESULT = re.compile(r"^\s*--- (PASS|FAIL|SKIP): (TestConformance(?:/\S+)?) \(([\d.]+)s\)$", re.M)
RUN = re.compile(r"^=== (?:RUN|CONT|PAUSE|NAME)\s+(\S+)$")
# What conformance/utils/kubernetes/helper.go (doPokeServer) logs about a probe that failed.
PROBE = re.compile(r"(Expected connection to .*)$")


def _install_crd(cluster: RealCluster, agent_namespace: str, timeout: float = 90) -> bool:
    """The CRD of :data:`CRD_MODULE` when the cluster has none; then waits until every agent
    pod logged that it watches ClusterNetworkPolicies (agents recheck a missing kind every
    30 s). Returns whether it installed the CRD."""
    if cluster.kubectl_ok("get", "crd", CRD_NAME):
        return False
    cluster.kubectl("create", "-f", str(CRD_PATH))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s", timeout=90)
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        logs = cluster.run([cluster.binaries["kubectl"], "logs", "-n", agent_namespace, "-l", "app.kubernetes.io/name=nftpolicy",
                            "-c", "agent", "--tail=-1", "--prefix"], check=False).stdout
        seen = len({line.split(" ", 1)[0] for line in logs.splitlines() if f"the API has {CRD_NAME} now" in line})
        if seen >= cluster.node_count:
            return True
        time.sleep(2)
    raise RealNodeError(f"{seen} of {cluster.node_count} agents saw the ClusterNetworkPolicy CRD within {timeout:.0f} s")


def parse(log: str) -> list[dict[str, Any]]:
    """Each test and sub-test of a ``-test.v`` log: ``{name, state, seconds, probes}``, where
    ``name`` drops the ``TestConformance/`` prefix, ``state`` is passed, failed or skipped, and
    ``probes`` holds the suite's messages about the probes that failed in it (not in its
    sub-tests), each once, and ``cause`` what the last of them says (:func:`_cause`)."""
    probes: dict[str, list[str]] = {}
    current = ""
    for line in log.splitlines():
        run = RUN.match(line)
        if run:
            current = run.group(1)
            continue
        probe = PROBE.search(line)
        if probe and current:  # the suite retries a probe every 0.5 s for 10 s: each message once
            messages = probes.setdefault(current, [])
            if probe.group(1).strip() not in messages:
                messages.append(probe.group(1).strip())
    found = []
    for state, name, seconds in RESULT.findall(log):
        last = (probes.get(name) or [""])[-1]  # the suite retries for 10 s: the last word decides
        if name == "TestConformance":
            continue
        found.append({"name": name.removeprefix("TestConformance/"), "state": {"PASS": "passed", "FAIL": "failed",
                                                                              "SKIP": "skipped"}[state],
                      "seconds": float(seconds), "probes": probes.get(name, []),
                      "cause": _cause(last) if state == "FAIL" else ""})
    return found


def _cause(message: str) -> str:
    """Why a probe failed, from the suite's last message about it: ``sctp`` (agnhost connect
    could not open an SCTP socket: ``OTHER: protocol not supported``, the kernel has no SCTP
    sockets), ``reject`` (denied, but refused at once where the suite expects a drop, a
    TIMEOUT), ``verdict`` (connected where it should not, or the reverse), or ``other``."""
    if "protocol not supported" in message:
        return "sctp"
    if "REFUSED" in message and "Expected connection to be dropped" in message:
        return "reject"
    if "successfully connected" in message or "miserably failed" in message:
        return "verdict"
    return "other"


def run_cnp_conformance(cluster: RealCluster, binary: Path, out: Path, agent_namespace: str, version: str,
                        timeout: float = 2400) -> dict[str, Any]:
    """Install the CRD if needed, run the suite (its log in ``out/cnp-conformance.log``, its
    report in ``out/`` :data:`REPORT`, ``version`` the implementation's version it records);
    returns ``{"module", "crd_installed", "rc", "seconds", "tests": [...], "subtests": [...],
    "report", "summary"}``: ``tests`` the suite's tests, ``subtests`` their ``t.Run`` steps (see
    :func:`parse`), ``report`` the suite's report (None when it wrote none); ``summary``
    ``"CNP conformance: N passed, N failed, N skipped"``."""
    out.mkdir(parents=True, exist_ok=True)
    installed = _install_crd(cluster, agent_namespace)
    log, report = out / "cnp-conformance.log", out / REPORT
    report.unlink(missing_ok=True)
    argv = [str(binary), "-test.v", "-test.run", "^TestConformance$", f"-test.timeout={int(timeout)}s",
            f"-conformance-profiles={PROFILE}", f"-supported-features={FEATURES}", f"-version={version}",
            *(f"-{flag}={value}" for flag, value in IMPLEMENTATION.items()), f"-report-output={report}"]
    started = time.monotonic()
    with open(log, "w") as stream:
        result = cluster.run(argv, check=False, timeout=timeout + 120, cwd=str(out), stdout=stream,
                             stderr=subprocess.STDOUT)
    seconds = round(time.monotonic() - started, 1)
    found = parse(log.read_text(errors="replace"))
    tests = [t for t in found if "/" not in t["name"]]
    counts = {state: sum(t["state"] == state for t in tests) for state in ("passed", "failed", "skipped")}
    summary = f"CNP conformance: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    return {"module": CRD_MODULE, "crd_installed": installed, "rc": result.returncode, "seconds": seconds,
            "tests": tests, "subtests": [t for t in found if "/" in t["name"]],
            "report": yaml.safe_load(report.read_text()) if report.exists() else None, "summary": summary}
