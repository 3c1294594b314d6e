"""``nftpolicy sandbox --control-plane`` and ``--dataplane kube-router|both``: the cluster goes
through a real kube-apiserver to real node daemons; output and exit codes are those of the
direct sandbox, bad flags get one line, and an interrupted run leaves no process, file or
namespace behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.testbed import controlplane

from .conftest import CONFORMANCE, OURS, OWN_CASES, REPO, RUN_TAG

NFTPOLICY = str(Path(sys.executable).parent / "nftpolicy")
EXAMPLE = str(REPO / "examples" / "shop")
# --dataplane kube-router|both runs kube-router against a control plane
KUBE_ROUTER = pytest.mark.tools("etcd", "kube-apiserver", "kube-router")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([NFTPOLICY, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.kernel
@pytest.mark.tools("etcd", "kube-apiserver")
def test_control_plane_gives_the_direct_sandbox_output():
    direct, live = run("sandbox", EXAMPLE), run("sandbox", "--control-plane", EXAMPLE)
    assert direct.returncode == live.returncode == 0, live.stderr
    assert live.stdout == direct.stdout


@pytest.mark.kernel
@KUBE_ROUTER
def test_both_prints_each_kube_router_difference_with_its_reason():
    out = run("sandbox", "--dataplane", "both", str(OWN_CASES / "102-ipblock-except-cancels-other-peer.yaml"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(r"^DISAGREE ipblock-except-cancels-other-peer TCP/80 ipv4 y/a -> x/a: nft allowed, kube-router blocked "
                     r"\(deliberate: kube-router keeps every ipBlock peer of a rule in one hash:net set.*\(x/two-ipblock-peers\)\)$",
                     out.stdout, re.M), out.stdout
    assert "1 cell differs between nft and kube-router" in out.stdout
    assert "DIFF ipblock-except-cancels-other-peer TCP/80 ipv4 y/a -> x/a: expected allowed, got blocked (kube-router)" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--control-plane", "--dataplane", "iptables"], "the iptables variant has no agent: --control-plane and kube-router go with nft only"),
    (["--dataplane", "nft,iptables", "--kube-router", "/bin/true"], "--kube-router needs --dataplane kube-router or both"),
    (["--dataplane", "kube-router", "--kube-router", "/nonexistent/kube-router"], "kube-router: /nonexistent/kube-router is not an executable file"),
])
def test_bad_flags_get_one_line(args, message):
    out = run("sandbox", *args, str(CONFORMANCE / "001-default-deny-ingress.yaml"))
    assert out.returncode == 2
    assert out.stderr.strip() == f"nftpolicy: {message}", out.stderr
    assert out.stdout == ""


def test_a_missing_tool_names_the_install_that_builds_it(tmp_path, monkeypatch):
    """etcd, kube-apiserver and kube-router come only from `bash .ci/install --test`."""
    monkeypatch.setattr(controlplane, "REPO_TOOLS", tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    for tool in ("etcd", "kube-router"):
        with pytest.raises(controlplane.ControlPlaneError) as error:
            controlplane.find_binary(tool)
        assert str(error.value) == f"{tool} not found in {tmp_path} or $PATH (bash .ci/install --test installs it)"


def _ours() -> tuple[set[str], set[str]]:
    """Control-plane directories in the temp dir, and sandbox namespaces."""
    dirs = {str(p) for p in Path(tempfile.gettempdir()).glob(f"nftpolicy-controlplane-{RUN_TAG}*")}
    return dirs, set(netns.existing(OURS))


def _processes_under(directory: str) -> list[int]:
    """PIDs whose command line names ``directory`` (etcd, kube-apiserver, agents, kube-router)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if directory.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.kernel
@KUBE_ROUTER
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_leaves_nothing(sig):
    dirs_before, netns_before = _ours()
    cases = [str(p) for p in sorted(CONFORMANCE.glob("00*.yaml"))] * 5
    proc = subprocess.Popen([NFTPOLICY, "sandbox", "--dataplane", "both", *cases], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        started = ""
        while not started and time.monotonic() < deadline:  # wait until the first case printed: everything runs
            line = proc.stdout.readline() if proc.stdout else ""
            started = line if line.startswith("== ") else ""
        assert started, "the sandbox never finished its first step"
        (directory,) = _ours()[0] - dirs_before
        assert _processes_under(directory), "no daemon runs under the control plane's directory"
        proc.send_signal(sig)
        assert proc.wait(timeout=60) in (130, 143)
    finally:
        proc.kill()  # nothing outlives the test, whatever failed
        proc.wait()
    dirs_after, netns_after = _ours()
    assert dirs_after - dirs_before == set()
    assert netns_after - netns_before == set()
    assert _processes_under(directory) == []


@pytest.mark.kernel
@KUBE_ROUTER
def test_a_killed_sandbox_takes_its_daemons_along():
    """SIGKILL leaves no time to clean up, but no daemon outlives the sandbox process (the test
    removes the files and namespaces that are left)."""
    dirs_before, netns_before = _ours()
    proc = subprocess.Popen([NFTPOLICY, "sandbox", "--dataplane", "both", *[str(CONFORMANCE / "002-default-deny-all.yaml")] * 6],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    directory = ""
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (proc.stdout and proc.stdout.readline().startswith("== ")):
            pass
        (directory,) = _ours()[0] - dirs_before
        assert _processes_under(directory)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while _processes_under(directory) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_under(directory) == []
    finally:
        proc.kill()
        proc.wait()
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
        netns.delete(sorted(_ours()[1] - netns_before))


@pytest.mark.kernel
def test_probes_that_fail_even_to_a_pod_s_own_address_are_refused():
    """A timeout too short for the machine failed every probe and the sandbox said 'blocked'
    everywhere with exit 0 (issue 34's earlier findings): a pod to itself is always allowed, so
    such a run is refused in one line, exit 2."""
    out = subprocess.run([NFTPOLICY, "sandbox", "--timeout", "0.0001", str(REPO / "examples" / "shop")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert re.fullmatch(r"nftpolicy: \d+ probes of a pod to its own address failed \(always allowed\), e\.g\. \S+ \(\w+/\d+\): "
                        r"--timeout 0\.0001 is too short for this machine \(try 1, the default, or more on a loaded machine\), or the sandbox's "
                        r"servers did not answer; no cell can "
                        r"be trusted\n", out.stderr), out.stderr
