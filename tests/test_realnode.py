"""The real node's test bed (agent/testbed/realnode.py) removes everything it made: after a failed start,
and, through the next start, after its owner was killed by SIGKILL. (The whole cluster, with
kubelet running pods, is proven by `bash .ci/e2e`.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nftpolicy.agent.dataplane import netns

from nftpolicy.agent.testbed import realnode
from nftpolicy.agent.testbed.realnode import KERNEL_TUNABLES, RealCluster, RealNodeError

from .conftest import REPO

pytestmark = [pytest.mark.kernel, pytest.mark.tools(*realnode.TOOLS)]


def tunables() -> dict[str, str]:
    return {name: Path("/proc/sys", name.replace(".", "/")).read_text().strip() for name in KERNEL_TUNABLES}


def leftovers(ident: str) -> list[str]:
    """Whatever of run ``ident`` is still on the machine."""
    found = [f"netns {name}" for name in netns.existing(ident)]
    found += [str(path) for path in (realnode.STATE_ROOT / ident, realnode.SOCKET_ROOT / ident) if path.exists()]
    found += [f"pid {pid}" for pid in realnode._processes_of(realnode.RunState(id=ident, owner_pid=0))]
    return found


@pytest.fixture
def machine_before():
    made = [path for path in realnode.NODE_PRIVATE_DIRS if not os.path.exists(path)]
    before = tunables()
    yield
    assert tunables() == before
    assert [path for path in made if os.path.exists(path)] == []


@pytest.mark.parametrize("family", ["ipv4", "ipv6", "dual"])
def test_a_failed_start_removes_everything(machine_before, family):
    """kube-controller-manager fails once kube-apiserver is ready on the first node's address of
    the cluster's primary family (so the network and the API of each family come up first)."""
    cluster = RealCluster(nodes=2, binaries={"kube-controller-manager": "/bin/false"}, family=family)
    with pytest.raises(RealNodeError, match="kube-controller-manager exited with code 1"):
        with cluster:
            pass
    assert leftovers(cluster.state.id) == []


def test_a_killed_run_is_removed_by_the_next_start(machine_before, tmp_path):
    """The owner is SIGKILLed once containerd runs on both nodes; its etcd, kube-apiserver and
    containerd die with it (PR_SET_PDEATHSIG), and clean_stale() removes the rest: namespaces,
    files, cgroups, mount points, tunables."""
    idle = tmp_path / "idle"  # stands in for kubelet: runs, whatever its flags
    idle.write_text("#!/bin/sh\nexec sleep 600\n")
    idle.chmod(0o755)
    script = tmp_path / "start.py"
    script.write_text(
        "from nftpolicy.agent.testbed.realnode import RealCluster\n"
        f"c = RealCluster(nodes=2, binaries={{'kubelet': '{idle}'}})\n"
        "print(c.state.id, flush=True)\n"
        "c.start()\n")
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert owner.stdout is not None
    ident = owner.stdout.readline().strip()
    socket = realnode.SOCKET_ROOT / ident / "node2" / "containerd.sock"
    deadline = time.monotonic() + 120
    while not socket.exists() and owner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert socket.exists(), f"containerd of node2 never started (exit {owner.poll()})"
    state = realnode.RunState(**json.loads((realnode.STATE_ROOT / ident / "state.json").read_text()))
    assert len(state.netns) == 3 and len(state.mount_ns_inodes) == 2
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    assert leftovers(ident) != []
    assert ident in realnode.clean_stale()
    assert leftovers(ident) == []


def test_a_recorded_mount_namespace_number_alone_kills_nothing():
    """A node's mount namespace is known by its inode, which the kernel gives to the next
    namespace made once it is gone: tear_down must not kill a process of another namespace that
    got the number (here recorded directly: an unrelated process in a mount namespace of its own)."""
    other = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while realnode._inode(f"/proc/{other.pid}/ns/mnt") == realnode._inode("/proc/self/ns/mnt"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        state = realnode.RunState(id=f"nftp-e2e-absent{os.getpid()}", owner_pid=0,
                                  mount_ns_inodes=[realnode._inode(f"/proc/{other.pid}/ns/mnt")])
        assert realnode._processes_of(state) == []
        assert realnode.tear_down(state) == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_overlapping_runs_leave_the_tunables_and_directories_as_before(monkeypatch, tmp_path):
    """Run B starts while run A lives (whose kubelet changed a tunable and whose nodes use a
    directory A made); A ends first, then B. The machine's record passes from A to B: A writes
    nothing back and removes nothing (B's nodes bind-mount that directory: removing it detaches
    their mounts), B restores the value from before A and removes the directory. (Reading the
    values at B's start recorded kubelet's, which B then wrote back for good.)"""
    name = "kernel.keys.root_maxkeys"  # one of kubelet's, harmless to change for a moment
    made = str(tmp_path / "var-lib-kubelet")
    monkeypatch.setattr(realnode, "KERNEL_TUNABLES", (name,))
    monkeypatch.setattr(realnode, "NODE_PRIVATE_DIRS", (made,))
    # apart from the machine's real runs and cgroups
    monkeypatch.setattr(realnode, "STATE_ROOT", tmp_path / "state")
    monkeypatch.setattr(realnode, "SOCKET_ROOT", tmp_path / "sockets")
    monkeypatch.setattr(realnode, "CONTAINERD_CGROUP", f"nftp-e2e-absent{os.getpid()}")
    original = realnode._read_sysctl(name)
    owner_b = subprocess.Popen(["sleep", "60"])
    a = realnode.RunState(id=f"nftp-e2e-overlapA{os.getpid()}", owner_pid=os.getpid(),
                          owner_start=realnode._start_time(os.getpid()))
    b = realnode.RunState(id=f"nftp-e2e-overlapB{os.getpid()}", owner_pid=owner_b.pid,
                          owner_start=realnode._start_time(owner_b.pid))
    try:
        realnode._claim_machine(a)
        assert a.tunables == {name: original} and a.made_dirs == [made] and os.path.isdir(made)
        realnode._write_sysctl(name, str(int(original) + 1))  # what A's kubelet does
        realnode._claim_machine(b)
        assert b.tunables == {name: original} and b.made_dirs == [made]
        assert realnode.tear_down(a) == []
        assert realnode._read_sysctl(name) == str(int(original) + 1) and os.path.isdir(made)
        owner_b.kill()
        owner_b.wait()
        assert realnode.tear_down(b) == []
        assert realnode._read_sysctl(name) == original and not os.path.exists(made)
    finally:
        realnode._write_sysctl(name, original)
        owner_b.kill()
        owner_b.wait()
        for state in (a, b):
            shutil.rmtree(state.files, ignore_errors=True)


def test_runc_keeps_its_state_under_the_run(tmp_path):
    """The shim's default runc root is the machine's /run/containerd/runc, where every container
    of every run stayed after the teardown."""
    config = realnode._containerd_config(tmp_path / "files", tmp_path / "sockets")
    assert f'Root = "{tmp_path / "sockets" / "runc"}"' in config
    assert "/run/containerd" not in config


def test_a_record_of_an_older_version_is_still_read_for_its_cleanup(monkeypatch, tmp_path):
    """A state.json written by an older version may carry a field this one dropped (``cgroup``):
    the run is still found (clean_stale tears it down), and a broken record is passed over."""
    monkeypatch.setattr(realnode, "STATE_ROOT", tmp_path)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "state.json").write_text(json.dumps({"id": "old", "owner_pid": 1, "netns": ["nftp-e2eold-n1"],
                                                           "cgroup": "nftp-e2eold"}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "state.json").write_text("[1, 2]")
    (run,) = realnode._recorded_runs()
    assert (run.id, run.owner_pid, run.netns) == ("old", 1, ["nftp-e2eold-n1"])
