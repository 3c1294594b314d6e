"""A real Kubernetes cluster for the tests: kubelet and containerd run the pods, on this machine.

:class:`RealCluster` starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler,
and on each node containerd (runc, Debian's CNI plugins ``ptp`` and ``host-local``), kube-proxy
(nftables mode) and kubelet, all as ``.ci/install --test`` builds them into ``.tools/bin``. It is
what ``.ci/e2e`` runs the upstream e2e NetworkPolicy suite and the chart's lifecycle checks on.

Where everything lives, so that it all goes with the cluster:

* **Network**: each node is a network namespace of its own (``<id>-n1``, ``<id>-n2``, ...), its
  ``eth0`` a port of a bridge in a LAN namespace (``<id>-lan``), ``10.240.0.N/24``; node N's
  pods get ``10.244.N.0/24`` (ptp: one veth per pod, a /32 route on the node), routed between
  the nodes. The control plane runs in the first node's namespace, its API on ``10.240.0.1:6443``
  and on the Service IP ``10.96.0.1``. Pod network namespaces live under containerd's state
  directory (``netns_mounts_under_state_dir``), never in /run/netns. An IPv6 single-stack
  cluster (``family="ipv6"``) has ``fd00:240::N/64``, pods in ``fd00:244:0:N::/64``, Services
  in ``fd00:96::/112`` (the API's ``fd00:96::1``); a dual-stack one (``"dual"``, IPv4 first)
  has both (:data:`IP_FAMILIES`).
* **Mounts**: each node's processes run in a mount namespace of the node's own (private
  propagation, held by a ``sleep`` process), so kubelet's volume mounts and containerd's rootfs
  mounts never reach the machine's mount table and vanish with the namespace. In it the paths
  kubelet and libcni hard-code (:data:`NODE_PRIVATE_DIRS`: ``/var/lib/kubelet``, whose
  ``device-plugins`` socket ignores ``--root-dir``; ``/var/lib/cni``; ``/var/log`` with
  ``pods`` and ``containers``) are bind mounts of the node's own directories; a mount point
  missing on the machine is made empty and removed at the end.
* **Cgroups**: kubelet runs with the cgroupfs driver and ``cgroupsPerQOS: false`` (this machine
  has cgroup v1; ``failCgroupV1: false``), so it gives containerd no cgroup parent and every
  container's cgroup is containerd's default ``/k8s.io/<container id>``; the ids the run's
  containerd instances know are removed at the end, and, when the run made ``/k8s.io``, every
  child of it without a process and then ``/k8s.io`` itself.
* **Files**: ``/var/lib/nftpolicy-e2e/<id>`` (certificates, etcd, kubelet's root, containerd's
  root, logs) and ``/run/nftpolicy-e2e/<id>`` (sockets, containerd's state).
* **Kernel tunables**: kubelet sets vm.overcommit_memory, vm.panic_on_oom, kernel.panic,
  kernel.panic_on_oops and kernel.keys.root_max{keys,bytes} (pkg/kubelet/cm,
  ``setupKernelTunables``); their values before the start are recorded and written back.

:meth:`RealCluster.close` (also on a failed start, on Ctrl-C and on SIGTERM through the caller's
handler) kills every process in the cluster's namespaces and cgroups by its pid, removes the
cgroups, the network namespaces and the files, and restores the tunables. What a run killed by
SIGKILL leaves behind is recorded in its ``state.json`` and removed by the next start
(:func:`clean_stale`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Iterable, Sequence

import yaml

from nftpolicy.agent.dataplane import netns
from .controlplane import SERVICE_CIDR, ControlPlaneError, die_with_parent, find_binary
from nftpolicy.agent.dataplane.netns import run_tag
from .started import Started

STATE_ROOT = Path("/var/lib/nftpolicy-e2e")
SOCKET_ROOT = Path("/run/nftpolicy-e2e")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Where containerd puts a pod's cgroups when kubelet gives no parent (cgroupsPerQOS: false):
# /k8s.io/<container id>, the CRI namespace's name.
CONTAINERD_CGROUP = "k8s.io"
API_PORT = 6443
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.2"  # the pause image kubelet 1.36 expects (cmd/kubelet)
CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
RUNC = "/usr/sbin/runc"  # Debian's runc
# pkg/kubelet/cm/container_manager_linux.go, setupKernelTunables: what kubelet writes.
KERNEL_TUNABLES = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
                   "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes")
# Paths kubelet, containerd or libcni use whatever they are told; each node gets its own copy.
NODE_PRIVATE_DIRS = ("/var/lib/kubelet", "/var/lib/cni", "/var/log")
TOOLS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy", "kubelet",
         "kubectl", "containerd", "containerd-shim-runc-v2", "ctr")


class RealNodeError(ControlPlaneError):
    """A component did not start or answer; the message names it and holds its log's last lines."""


@dataclass(frozen=True)
class AddressPlan:
    """One IP family's addresses in the test bed: ``lan`` and ``pods`` are formats of a node's
    index (1-based), ``lan_prefix`` the LAN's prefix length; ``cluster`` holds every node's pod
    range, ``services`` is the API server's --service-cluster-ip-range and ``api_service_ip``
    its first address (the ``kubernetes`` Service's); ``default`` the family's default route,
    ``forwarding`` its forwarding sysctl."""

    lan: str
    lan_prefix: int
    pods: str
    cluster: str
    services: str
    api_service_ip: str
    default: str
    forwarding: str

    def node_ip(self, index: int) -> str:
        """Node ``index``'s address on the LAN."""
        return self.lan.format(index)

    def pod_cidr(self, index: int) -> str:
        """Node ``index``'s pod range (host-local IPAM)."""
        return self.pods.format(index)


IPV4 = AddressPlan("10.240.0.{}", 24, "10.244.{}.0/24", "10.244.0.0/16", SERVICE_CIDR, "10.96.0.1", "0.0.0.0/0",
                   "net.ipv4.ip_forward")
IPV6 = AddressPlan("fd00:240::{}", 64, "fd00:244:0:{}::/64", "fd00:244::/48", "fd00:96::/112", "fd00:96::1", "::/0",
                   "net.ipv6.conf.all.forwarding")
# A cluster's families, by name (RealCluster(family=...), .ci/e2e --ip-family): the first is the
# primary one (nodes' first InternalIP, pods' status.podIP, Services' first clusterIP).
IP_FAMILIES = {"ipv4": (IPV4,), "ipv6": (IPV6,), "dual": (IPV4, IPV6)}


def node_ip(index: int, plans: Sequence[AddressPlan] = (IPV4,)) -> str:
    """The primary address of node ``index`` (1-based) on the nodes' LAN (``10.240.0.<index>``
    in IPv4)."""
    return plans[0].node_ip(index)


def url_host(ip: str) -> str:
    """``ip`` as the host of a URL or a ``host:port``: an IPv6 address in brackets (RFC 3986)."""
    return f"[{ip}]" if ":" in ip else ip


@dataclass
class RunState:
    """What a run made, written to ``state.json`` before it is made, so that :func:`clean_stale`
    can remove it after the run was killed. ``tunables``: sysctl name -> value before the start.

    ``tunables``, ``made_dirs`` and ``made_cgroups`` are the machine's, not the run's: a run that
    starts while others live takes them over from those (the values before the first of them
    started), and only the last run to end writes the tunables back and removes the directories
    and cgroups (:func:`_machine_lock`). ``owner_start``: the owner's start time (clock ticks
    after boot, proc(5) stat field 22), so that a reused pid is not taken for the owner."""

    id: str
    owner_pid: int
    owner_start: int = 0
    netns: list[str] = field(default_factory=list)
    mount_ns_inodes: list[int] = field(default_factory=list)
    tunables: dict[str, str] = field(default_factory=dict)
    made_dirs: list[str] = field(default_factory=list)  # mount points made on the machine, removed if empty
    made_cgroups: list[str] = field(default_factory=list)  # top-level cgroups made by the run, removed if empty

    @property
    def files(self) -> Path:
        return STATE_ROOT / self.id

    @property
    def sockets(self) -> Path:
        return SOCKET_ROOT / self.id

    def save(self) -> None:
        self.files.mkdir(parents=True, exist_ok=True)
        (self.files / "state.json").write_text(json.dumps(asdict(self)))


def _start_time(pid: int) -> int:
    """Process ``pid``'s start time (proc(5) stat field 22); 0 when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _owner_alive(state: "RunState") -> bool:
    """Whether the process that made run ``state`` still runs (not another one with its pid)."""
    started = _start_time(state.owner_pid)
    return started != 0 and (state.owner_start == 0 or started == state.owner_start)


def _machine_lock() -> IO[str]:
    """An exclusive lock (flock on ``STATE_ROOT/.lock``, released when the returned file is
    closed) around what runs share: taking over the machine's record at a start, and writing
    the tunables back and removing the directories and cgroups at the end."""
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    handle = open(STATE_ROOT / ".lock", "a")
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


RUN_STATE_FIELDS = frozenset(f.name for f in fields(RunState))


def _recorded_runs() -> list["RunState"]:
    """Every run recorded under :data:`STATE_ROOT` (an unreadable record is passed over)."""
    found = []
    for path in sorted(STATE_ROOT.glob("*/state.json")) if STATE_ROOT.exists() else []:
        try:
            record = json.loads(path.read_text())
            # a record of an older version may hold fields this one dropped (its cgroup): still cleaned
            found.append(RunState(**{k: v for k, v in record.items() if k in RUN_STATE_FIELDS}))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return found


def _live_runs(but: str) -> list["RunState"]:
    """The recorded runs other than ``but`` whose owner still runs."""
    return [state for state in _recorded_runs() if state.id != but and _owner_alive(state)]


def _read_sysctl(name: str) -> str:
    return Path("/proc/sys", name.replace(".", "/")).read_text().strip()


def _write_sysctl(name: str, value: str) -> None:
    Path("/proc/sys", name.replace(".", "/")).write_text(value)


def _inode(path: str) -> int:
    try:
        return os.stat(path).st_ino
    except OSError:
        return 0


def _cgroup_mounts() -> dict[Path, set[str]]:
    """The mounted cgroup hierarchies (v1: one per controller set; v2: the unified one), each with
    its controllers (the mount's super options, proc(5) mountinfo)."""
    found: dict[Path, set[str]] = {}
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            after = fields.index("-")
            if fields[after + 1] in ("cgroup", "cgroup2") and fields[4].startswith(str(CGROUP_ROOT)):
                found[Path(fields[4])] = set(fields[after + 3].split(","))
    return found


def _cgroup_hierarchies() -> list[Path]:
    return list(_cgroup_mounts())


def cgroup_dir(pid: int, controller: str) -> Path:
    """The directory of process ``pid``'s cgroup in the v1 hierarchy of ``controller`` (``memory``,
    ``cpuacct``, ...), from /proc/PID/cgroup; raises RealNodeError when there is none."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            for mount, names in _cgroup_mounts().items():
                if controller in names:
                    return mount / path.lstrip("/")
    raise RealNodeError(f"no {controller} cgroup for pid {pid}")


def _container_ids(state: "RunState") -> set[str]:
    """Every container and sandbox id the run's containerd instances know (their CRI
    directories and task state): with the cgroupfs driver and ``cgroupsPerQOS: false``, each has
    a cgroup ``/k8s.io/<id>`` (containerd's default path) in every hierarchy."""
    ids: set[str] = set()
    for pattern in ("*/containerd/io.containerd.grpc.v1.cri/sandboxes/*", "*/containerd/io.containerd.grpc.v1.cri/containers/*"):
        ids |= {path.name for path in state.files.glob(pattern)}
    ids |= {path.name for path in state.sockets.glob("*/state/io.containerd.runtime.v2.task/k8s.io/*")}
    return ids


def _procs_in(cgroup: Path) -> str:
    """The pids in ``cgroup`` (its cgroup.procs; empty when it is gone)."""
    try:
        return (cgroup / "cgroup.procs").read_text().strip()
    except OSError:
        return ""


def _in_node_mount_ns(pid: int, state: RunState) -> bool:
    """Whether process ``pid`` is in a node mount namespace of run ``state``: in one whose inode
    the run recorded *and* where ``/var/lib/kubelet`` is the bind mount of a node's own directory
    of this run. The inode alone proves nothing once the namespace is gone: the kernel hands its
    number to the next namespace made on the machine (of any process, ``ip netns exec``...)."""
    if _inode(f"/proc/{pid}/ns/mnt") not in state.mount_ns_inodes:
        return False
    own = f"/{state.id}/"
    try:
        with open(f"/proc/{pid}/mountinfo") as mounts:
            for line in mounts:
                fields = line.split()
                if fields[4] == NODE_PRIVATE_DIRS[0] and own in fields[3] and fields[3].endswith("/private/var-lib-kubelet"):
                    return True
    except OSError:
        pass
    return False


def _processes_of(state: RunState) -> list[int]:
    """Pids in the run's network namespaces, its mount namespaces or a container cgroup of its
    containerd (pods in network and mount namespaces of their own, orphaned when
    their shim dies)."""
    netns_inodes = {_inode(f"{netns.NETNS_DIR}/{name}") for name in state.netns} - {0}
    cgroups = {f"/{CONTAINERD_CGROUP}/{ident}" for ident in _container_ids(state)}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            inside = _inode(f"/proc/{pid}/ns/net") in netns_inodes or _in_node_mount_ns(pid, state)
            if not inside and cgroups:
                paths = {line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()}
                inside = any(path == group or path.startswith(group + "/") for path in paths for group in cgroups)
        except (OSError, IndexError):
            continue
        if inside:
            found.append(pid)
    return found


def container_pid(container_id: str) -> int:
    """The pid of a process of container ``container_id`` (runc puts the id in its cgroup
    paths); raises RealNodeError when none runs."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if container_id in Path(f"/proc/{entry}/cgroup").read_text():
                    return int(entry)
            except OSError:
                continue
    raise RealNodeError(f"no process of container {container_id[:12]}")


def tear_down(state: RunState) -> list[str]:
    """Remove everything ``state`` records; returns what could not be removed (empty when all
    went). Order: kill the processes (SIGKILL, by pid, until none is left or 20 s), remove the
    containers' cgroups, delete the network namespaces, write the tunables back, remove the
    files (after checking that nothing is mounted below them)."""
    problems: list[str] = []
    deadline = time.monotonic() + 20
    while (pids := _processes_of(state)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    if pids:
        problems.append(f"processes still running: {pids}")
    containers = _container_ids(state)
    with _machine_lock():
        problems += _remove(state, containers, alone=not _live_runs(state.id))
    return problems


def _remove(state: RunState, containers: set[str], alone: bool) -> list[str]:
    """tear_down's part after the kill, with :func:`_machine_lock` held; the machine's tunables,
    directories and cgroups only when ``alone`` (no other run lives: it has the same record and
    removes them when it ends)."""
    problems: list[str] = []
    for hierarchy in _cgroup_hierarchies():
        doomed = [hierarchy / CONTAINERD_CGROUP / ident for ident in containers]
        if alone and CONTAINERD_CGROUP in state.made_cgroups and (hierarchy / CONTAINERD_CGROUP).is_dir():
            # The run made /k8s.io: every child left without a process is of its containers
            # (containerd loses some while it restarts), then /k8s.io itself.
            doomed += [child for child in (hierarchy / CONTAINERD_CGROUP).iterdir() if child.is_dir() and not _procs_in(child)]
            doomed.append(hierarchy / CONTAINERD_CGROUP)
        for path in doomed:
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if path.name == CONTAINERD_CGROUP and any(p.is_dir() for p in path.iterdir()):
                        break  # another containerd's containers (not ours) live there: it stays
                    time.sleep(0.1)
            else:
                problems.append(f"cgroup {path} not removed")
    netns.delete(state.netns)
    for name, value in state.tunables.items() if alone else ():
        try:
            _write_sysctl(name, value)
        except OSError as exc:
            problems.append(f"sysctl {name}={value}: {exc}")
    for top in (state.files, state.sockets):
        mounted = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                   if line.split()[4].startswith(str(top) + "/")]
        for point in sorted(mounted, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)
    for made in state.made_dirs if alone else ():
        try:
            os.rmdir(made)
        except OSError:
            pass
    return problems


def _claim_machine(state: RunState) -> None:
    """Record the machine's tunables, directories and cgroups in ``state`` (saved) and make the
    directories: taken over from the runs that live (they hold the values from before the first
    of them started, and kubelet may have changed them since), else read now."""
    with _machine_lock():
        others = _live_runs(state.id)
        state.tunables = (dict(others[0].tunables) if others
                          else {name: _read_sysctl(name) for name in KERNEL_TUNABLES})
        state.made_dirs = sorted({made for other in others for made in other.made_dirs})
        state.made_cgroups = sorted({made for other in others for made in other.made_cgroups})
        if not any((hierarchy / CONTAINERD_CGROUP).exists() for hierarchy in _cgroup_hierarchies()):
            state.made_cgroups = sorted({*state.made_cgroups, CONTAINERD_CGROUP})
        state.made_dirs += [made for made in NODE_PRIVATE_DIRS if not os.path.isdir(made) and made not in state.made_dirs]
        state.save()
        for made in state.made_dirs:
            os.makedirs(made, exist_ok=True)


def clean_stale() -> list[str]:
    """Tear down every earlier run whose owner process is gone (killed by SIGKILL); returns the
    ids removed. A run whose owner still lives (another checkout's) is left alone."""
    removed = []
    for state in _recorded_runs():
        if not _owner_alive(state):
            tear_down(state)
            removed.append(state.id)
    return removed


class RealCluster(Started):
    """A cluster of ``nodes`` real nodes on this machine (context manager; see the module doc).

    ``images``: docker-archive tarballs imported into every node's containerd (namespace
    ``k8s.io``) before kubelet starts, so that nothing is ever pulled. ``binaries``: name ->
    path overrides of :data:`TOOLS`.

    ``family`` (a key of :data:`IP_FAMILIES`) chooses the cluster's IP families.
    After :meth:`start`: ``kubeconfig`` (the admin's, ``system:masters``, for the API on
    ``https://10.240.0.1:6443`` in IPv4, reachable from the nodes' namespaces only: run clients with
    :meth:`run`), ``node_names`` (``node1``, ...), ``netns`` (the node namespaces' names).
    Raises :class:`RealNodeError` when a component does not start (after tearing down).
    """

    def __init__(self, nodes: int = 1, images: Sequence[Path] = (), binaries: dict[str, str] | None = None,
                 family: str = "ipv4") -> None:
        if not 1 <= nodes <= 9:
            raise ValueError(f"nodes: 1 to 9, got {nodes}")
        if family not in IP_FAMILIES:
            raise ValueError(f"family: one of {', '.join(IP_FAMILIES)}, got {family!r}")
        self.family, self.plans = family, IP_FAMILIES[family]
        overrides = binaries or {}
        self.binaries = {name: find_binary(name, overrides.get(name)) for name in TOOLS}
        self.images = list(images)
        self.node_count = nodes
        ident = f"nftp-e2e{run_tag()}{os.getpid()}"
        self.state = RunState(id=ident, owner_pid=os.getpid(), owner_start=_start_time(os.getpid()))
        self.node_names = [f"node{i}" for i in range(1, nodes + 1)]
        self.netns = [f"{ident}-n{i}" for i in range(1, nodes + 1)]
        self.lan = f"{ident}-lan"
        self.dir = self.state.files
        self.pki = self.dir / "pki"
        self.kubeconfig = str(self.dir / "admin.kubeconfig")
        self._holders: list[subprocess.Popen[bytes]] = []  # one per node: holds its mount namespace
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        # component name -> (argv, node, environment) it was started with, for restart()
        self._commands: dict[str, tuple[list[str], int, dict[str, str]]] = {}

    def start(self) -> None:
        """Bring the whole cluster up; return once every node is Ready (with its
        ``spec.podCIDRs``: :meth:`AddressPlan.pod_cidr` of each family, which its CNI allocates from) and the ``default``
        ServiceAccount exists (at most about 3 minutes)."""
        clean_stale()
        self.state.netns = [*self.netns, self.lan]
        _claim_machine(self.state)
        self.state.sockets.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        netns.create(self.state.netns)
        _cluster_network(self.netns, self.lan, self.plans)
        for index in range(1, self.node_count + 1):
            self._mount_namespace(index)
        make_certificates(self.pki, self.node_names, self.plans)
        write_kubeconfig(self.kubeconfig, self.pki, "admin", self.plans)
        for name in self.node_names:
            write_kubeconfig(str(self.dir / f"kubelet-{name}.kubeconfig"), self.pki, f"kubelet-{name}", self.plans)
        self._control_plane()
        for index in range(1, self.node_count + 1):
            self._node(index)
        self.wait_ready()
        for index, name in enumerate(self.node_names, 1):  # what the controller manager's node IPAM would write
            cidrs = [plan.pod_cidr(index) for plan in self.plans]
            self.kubectl("patch", "node", name, "-p", json.dumps({"spec": {"podCIDR": cidrs[0], "podCIDRs": cidrs}}))
        self._wait("ServiceAccount default/default", lambda: self.kubectl_ok("get", "serviceaccount", "default"), 60)

    def wait_ready(self, timeout: float = 120) -> None:
        """Return once kube-apiserver answers and every node is Ready; raises RealNodeError."""
        self._wait("kube-apiserver", lambda: self.kubectl_ok("get", "--raw", "/readyz"), timeout, "kube-apiserver")
        self._wait("nodes Ready", self._nodes_ready, timeout)

    def close(self) -> None:
        """Stop every component and remove everything the cluster made (idempotent); raises
        RealNodeError listing what could not be removed. SIGINT and SIGTERM wait until it is done
        (blocked meanwhile, delivered after), so a second Ctrl-C cannot leave half a cluster."""
        blocked = {signal.SIGINT, signal.SIGTERM}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            self._close()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def _close(self) -> None:
        for proc in reversed(list(self._procs.values())):
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
        problems = tear_down(self.state)
        for holder in self._holders:
            holder.wait()
        self._holders.clear()
        if problems:
            raise RealNodeError("the real cluster left: " + "; ".join(problems))

    def enter(self, node: int = 1, mount: bool = False) -> list[str]:
        """The ``nsenter`` prefix that runs a command in node ``node``'s network namespace (and
        its mount namespace when ``mount``)."""
        prefix = ["nsenter", f"--net={netns.NETNS_DIR}/{self.netns[node - 1]}"]
        if mount:
            prefix.append(f"--mount=/proc/{self._holders[node - 1].pid}/ns/mnt")
        return [*prefix, "--"]

    def run(self, argv: Sequence[str], node: int = 1, check: bool = True, timeout: float = 120,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in node ``node``'s network namespace with ``KUBECONFIG`` set to the
        admin's; returns the completed process (text). Raises RealNodeError when ``check`` and it
        fails, with its output."""
        env = {**os.environ, "KUBECONFIG": self.kubeconfig, **kwargs.pop("env", {})}
        if "input" not in kwargs:
            kwargs["stdin"] = subprocess.DEVNULL
        kwargs.setdefault("capture_output", "stdout" not in kwargs)
        result = subprocess.run([*self.enter(node), *argv], text=True, timeout=timeout, env=env, **kwargs)
        if check and result.returncode != 0:
            raise RealNodeError(f"{' '.join(argv)} exited {result.returncode}: {(result.stderr or result.stdout).strip()[-2000:]}")
        return result

    def kubectl(self, *args: str, timeout: float = 120) -> str:
        """``kubectl ARGS`` as the admin; returns its standard output; raises RealNodeError."""
        return self.run([self.binaries["kubectl"], *args], timeout=timeout).stdout

    def kubectl_ok(self, *args: str) -> bool:
        """Whether ``kubectl ARGS`` succeeds."""
        return self.run([self.binaries["kubectl"], *args], check=False, timeout=30).returncode == 0

    def pid(self, name: str) -> int:
        """The pid of component ``name`` (``kube-apiserver``, ``kubelet-node1``, ...)."""
        return self._procs[name].pid

    def log(self, name: str) -> str:
        """The log of component ``name`` (``kube-apiserver``, ``kubelet-node1``, ...) so far."""
        path = self.dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def restart(self, name: str) -> int:
        """Stop component ``name`` (SIGTERM, SIGKILL after 10 s), start it again with the same
        command line and return the new process's pid once the new process serves: containerd
        answers on its socket, kubelet's ``/healthz`` says ok, kube-apiserver's ``/readyz`` too
        (others: once running). Raises RealNodeError when it does not within 60 s."""
        proc = self._procs[name]
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        argv, node, env = self._commands[name]
        self._spawn(name, argv, node, env)
        self._wait(f"{name} after its restart", lambda: self._serves(name, node), 60, name)
        return self._procs[name].pid

    def _serves(self, name: str, node: int) -> bool:
        probe = _serving_probe(name, self.binaries, self.state.sockets / self.node_names[node - 1])
        return probe is None or self.run(probe, node=node, check=False, timeout=10).returncode == 0

    def _mount_namespace(self, index: int) -> None:
        """Node ``index``'s mount namespace: private, with :data:`NODE_PRIVATE_DIRS` bound to the
        node's own directories, held by a ``sleep`` that dies with this process."""
        binds = []
        for path in NODE_PRIVATE_DIRS:
            own = self.dir / self.node_names[index - 1] / "private" / path.strip("/").replace("/", "-")
            own.mkdir(parents=True)
            binds.append(f"mount --bind {own} {path}")
        script = " && ".join([*binds, "exec sleep infinity"])
        holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                  stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        self._holders.append(holder)
        home = _inode("/proc/self/ns/mnt")
        self._wait(f"mount namespace of {self.node_names[index - 1]}",
                   lambda: _inode(f"/proc/{holder.pid}/ns/mnt") not in (0, home)
                   and Path(f"/proc/{holder.pid}/comm").read_text().strip() == "sleep", 10)
        self.state.mount_ns_inodes.append(_inode(f"/proc/{holder.pid}/ns/mnt"))
        self.state.save()

    def _control_plane(self) -> None:
        commands = _control_plane_commands(self.binaries, self.pki, self.dir, self.kubeconfig, self.plans)
        for name in ("etcd", "kube-apiserver"):
            self._spawn(name, commands[name])
        self._wait("kube-apiserver", lambda: self.kubectl_ok("get", "--raw", "/readyz"), 90, "kube-apiserver")
        for name in ("kube-controller-manager", "kube-scheduler"):
            self._spawn(name, commands[name])

    def _node(self, index: int) -> None:
        name, b = self.node_names[index - 1], self.binaries
        files, sockets = self.dir / name, self.state.sockets / name
        sockets.mkdir(parents=True)
        _write_cni_config(files, index, self.plans)
        containerd_config = files / "containerd.toml"
        containerd_config.write_text(_containerd_config(files, sockets))
        socket = sockets / "containerd.sock"
        self._spawn(f"containerd-{name}", [b["containerd"], "--config", str(containerd_config)], node=index,
                    env={"PATH": f"{Path(b['containerd-shim-runc-v2']).parent}:{os.environ.get('PATH', '')}"})
        self._wait(f"containerd-{name}", socket.exists, 30, f"containerd-{name}")
        for image in self.images:
            self._run_in(index, [b["ctr"], "--address", str(socket), "-n", "k8s.io", "images", "import",
                                 str(image)])
        kubelet_config = files / "kubelet.yaml"
        kubelet_config.write_text(yaml.safe_dump(_kubelet_config(name, index, socket, self.pki, self.plans)))
        proxy_config = files / "kube-proxy.yaml"
        proxy_config.write_text(yaml.safe_dump(_kube_proxy_config(name, self.kubeconfig, self.plans)))
        self._spawn(f"kube-proxy-{name}", [b["kube-proxy"], f"--config={proxy_config}", "-v=1"], node=index)
        self._spawn(f"kubelet-{name}", [
            b["kubelet"], f"--config={kubelet_config}", f"--kubeconfig={self.dir / f'kubelet-{name}.kubeconfig'}",
            f"--hostname-override={name}", f"--node-ip={','.join(plan.node_ip(index) for plan in self.plans)}", "-v=1",
        ], node=index)

    def _spawn(self, name: str, argv: Sequence[str], node: int = 1, env: dict[str, str] | None = None) -> None:
        self._commands[name] = (list(argv), node, env or {})
        with open(self.dir / "logs" / f"{name}.log", "ab") as log:
            self._procs[name] = subprocess.Popen([*self.enter(node, mount=True), *argv], stdin=subprocess.DEVNULL,
                                                 stdout=log, stderr=log, preexec_fn=die_with_parent,
                                                 env={**os.environ, **(env or {})})

    def _run_in(self, node: int, argv: Sequence[str]) -> None:
        result = subprocess.run([*self.enter(node, mount=True), *argv], capture_output=True, text=True, timeout=300,
                                stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise RealNodeError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip()[-2000:]}")

    def _nodes_ready(self) -> bool:
        result = self.run([self.binaries["kubectl"], "get", "nodes", "-o", "json"], check=False, timeout=30)
        if result.returncode != 0:
            return False
        ready = {item["metadata"]["name"] for item in json.loads(result.stdout)["items"]
                 if any(c["type"] == "Ready" and c["status"] == "True" for c in item["status"].get("conditions", []))}
        return ready >= set(self.node_names)

    def _wait(self, what: str, ready: Any, timeout: float, log: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RealNodeError(f"{name} exited with code {proc.returncode}:\n{self._tail(name)}")
            if ready():
                return
            time.sleep(0.3)
        raise RealNodeError(f"{what} not ready after {timeout:.0f}s" + (f":\n{self._tail(log)}" if log else ""))

    def _tail(self, name: str) -> str:
        return "\n".join(self.log(name).splitlines()[-20:])


def _openssl(pki: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=pki)


def _issue(pki: Path, name: str, subject: str, sans: Iterable[str] = (), usage: str = "clientAuth") -> None:
    """An EC key and a certificate signed by the cluster's CA: ``pki/<name>.{key,crt}``."""
    _openssl(pki, "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key")
    extensions = [f"extendedKeyUsage={usage}", "keyUsage=critical,digitalSignature,keyEncipherment"]
    if sans:
        extensions.append("subjectAltName=" + ",".join(sans))
    (pki / f"{name}.ext").write_text("\n".join(extensions) + "\n")
    _openssl(pki, "req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr")
    _openssl(pki, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt")


def make_certificates(pki: Path, node_names: Sequence[str], plans: Sequence[AddressPlan] = (IPV4,)) -> None:
    """The cluster's CA in ``pki`` (a new directory) and the certificates signed by it: the API
    server's (serving, for the first node's and the API Service's addresses of every family in
    ``plans``), the admin's (``system:masters``), the API server's kubelet client, each node's
    kubelet client and serving pair; the service-account key pair."""
    pki.mkdir(parents=True)
    _openssl(pki, "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key")
    _openssl(pki, "req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=nftpolicy-e2e-ca", "-days", "2", "-out", "ca.crt")
    _issue(pki, "apiserver", "/CN=kube-apiserver", [
        *(f"IP:{ip}" for plan in plans for ip in (plan.node_ip(1), plan.api_service_ip)), "IP:127.0.0.1", "IP:::1",
        "DNS:kubernetes", "DNS:kubernetes.default",
        "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local"], usage="serverAuth")
    _issue(pki, "admin", "/O=system:masters/CN=nftpolicy-e2e-admin")
    _issue(pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client")
    for index, name in enumerate(node_names, start=1):
        _issue(pki, f"kubelet-{name}", f"/O=system:nodes/CN=system:node:{name}")
        _issue(pki, f"kubelet-serving-{name}", f"/CN={name}", [*(f"IP:{plan.node_ip(index)}" for plan in plans), f"DNS:{name}"],
               usage="serverAuth")
    _openssl(pki, "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key")
    _openssl(pki, "ec", "-in", "sa.key", "-pubout", "-out", "sa.pub")


def write_kubeconfig(path: str, pki: Path, cert: str, plans: Sequence[AddressPlan] = (IPV4,)) -> None:
    """A kubeconfig (mode 0600) for the API server at the first node's primary address, as the
    user of certificate ``pki/<cert>.crt``."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
        "clusters": [{"name": "e2e", "cluster": {"server": f"https://{url_host(node_ip(1, plans))}:{API_PORT}",
                                                  "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": cert, "user": {"client-certificate": str(pki / f"{cert}.crt"),
                                          "client-key": str(pki / f"{cert}.key")}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": cert}}],
    }
    Path(path).write_text(json.dumps(config, indent=1))
    os.chmod(path, 0o600)


def _cluster_network(nodes: Sequence[str], lan: str, plans: Sequence[AddressPlan] = (IPV4,)) -> None:
    """Wire the node namespaces ``nodes`` (made already, with ``lan``): each one's ``eth0`` a
    port of a bridge in ``lan`` at its address of every family in ``plans`` (IPv6 without
    duplicate address detection, usable at once), with a route to every other node's pods."""
    netns.ip_batch(["link set lo up", "link add br0 type bridge", "link set br0 up"], lan)
    for index, name in enumerate(nodes, start=1):
        netns.ip_batch([f"link add eth0 netns {name} type veth peer name p{index} netns {lan}"])
        netns.ip_batch([f"link set p{index} master br0", f"link set p{index} up"], lan)
        commands = ["link set lo up"]
        for plan in plans:
            nodad = " nodad" if plan is IPV6 else ""
            commands.append(f"addr add {plan.node_ip(index)}/{plan.lan_prefix} dev eth0{nodad}")
        commands.append("link set eth0 up")
        for plan in plans:
            commands.append(f"route add {plan.default} dev eth0")
            commands += [f"route add {plan.pod_cidr(other)} via {plan.node_ip(other)}"
                         for other in range(1, len(nodes) + 1) if other != index]
        netns.ip_batch(commands, name)
        for plan in plans:
            netns.write_sysctl(name, plan.forwarding, "1")


def _kubelet_config(name: str, index: int, socket: Path, pki: Path, plans: Sequence[AddressPlan] = (IPV4,)) -> dict[str, Any]:
    """Kubelet's configuration on node ``index`` (``name``; serving on its primary address in
    ``plans``): cgroup v1 with cgroupfs, no QoS cgroups, webhook authentication and
    authorization, no image GC or eviction in practice."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        # This machine has cgroup v1: kubelet 1.35+ refuses it unless told (KEP-5573).
        "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "containerRuntimeEndpoint": f"unix://{socket}",
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(pki / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(pki / f"kubelet-serving-{name}.crt"),
        "tlsPrivateKeyFile": str(pki / f"kubelet-serving-{name}.key"),
        "address": node_ip(index, plans), "port": 10250, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
        "clusterDomain": "cluster.local", "resolvConf": "",
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "failSwapOn": False, "serializeImagePulls": False, "maxPods": 250,
        "nodeStatusReportFrequency": "10s", "syncFrequency": "10s", "fileCheckFrequency": "10s",
    }


def _serving_probe(name: str, binaries: dict[str, str], sockets: Path) -> list[str] | None:
    """The command that succeeds once component ``name`` serves, run in its node (``sockets``:
    the node's socket directory); None for a component that serves once it runs."""
    if name.startswith("containerd-"):
        return [binaries["ctr"], "--address", str(sockets / "containerd.sock"), "version"]
    if name.startswith("kubelet-"):
        return ["curl", "-sf", "--max-time", "2", "http://127.0.0.1:10248/healthz"]
    if name == "kube-apiserver":
        return [binaries["kubectl"], "get", "--raw", "/readyz"]
    return None


def _control_plane_commands(binaries: dict[str, str], pki: Path, files: Path, kubeconfig: str,
                            plans: Sequence[AddressPlan] = (IPV4,)) -> dict[str, list[str]]:
    """The command lines of etcd, kube-apiserver (at the first node's primary address, bound to
    every address of both families, RBAC and Node authorization), kube-controller-manager (no
    node IPAM: the pod ranges are fixed) and kube-scheduler, by name; the Service and cluster
    ranges of every family in ``plans``."""
    b = binaries
    services, cluster = ",".join(plan.services for plan in plans), ",".join(plan.cluster for plan in plans)
    return {
        "etcd": [
            b["etcd"], "--name", "default", "--data-dir", str(files / "etcd"),
            "--listen-client-urls", "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
            "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
            "--initial-cluster", "default=http://127.0.0.1:2380", "--log-level", "warn", "--unsafe-no-fsync",
        ],
        "kube-apiserver": [
            b["kube-apiserver"], "--etcd-servers=http://127.0.0.1:2379",
            f"--advertise-address={node_ip(1, plans)}", f"--bind-address={'0.0.0.0' if plans == (IPV4,) else '::'}",
            f"--secure-port={API_PORT}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",  # never a DNS lookup of the node name
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={services}", "--allow-privileged=true", "--profiling=false", "-v=1",
        ],
        "kube-controller-manager": [
            b["kube-controller-manager"], f"--kubeconfig={kubeconfig}", "--leader-elect=false",
            "--bind-address=127.0.0.1", "-v=1",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            "--use-service-account-credentials=false", f"--cluster-cidr={cluster}",
            f"--service-cluster-ip-range={services}", "--controllers=*,-nodeipam,-cloud-node-lifecycle",
        ],
        "kube-scheduler": [b["kube-scheduler"], f"--kubeconfig={kubeconfig}", "--leader-elect=false",
                           "--bind-address=127.0.0.1", "-v=1"],
    }


def _write_cni_config(files: Path, index: int, plans: Sequence[AddressPlan] = (IPV4,)) -> None:
    """Node ``index``'s CNI configuration under ``files/cni/net.d``: ptp with host-local
    addresses from the node's pod range of every family in ``plans`` (one address each, the
    first family's first), its state under ``files/cni/ipam``."""
    (files / "cni" / "net.d").mkdir(parents=True)
    (files / "cni" / "net.d" / "10-ptp.conflist").write_text(json.dumps({
        "cniVersion": "1.0.0", "name": "nftpolicy-e2e",
        "plugins": [{"type": "ptp", "ipMasq": False, "mtu": 1500, "ipam": {
            "type": "host-local", "ranges": [[{"subnet": plan.pod_cidr(index)}] for plan in plans],
            "routes": [{"dst": plan.default} for plan in plans],
            "dataDir": str(files / "cni" / "ipam")}}],
    }))


def _has_capability(bit: int) -> bool:
    """Whether this process's bounding set holds capability ``bit`` (linux/capability.h)."""
    status = Path("/proc/self/status").read_text()
    return bool(int(next(line.split()[1] for line in status.splitlines() if line.startswith("CapBnd:")), 16) >> bit & 1)


CAP_SYS_RESOURCE = 24


def _containerd_config(files: Path, sockets: Path) -> str:
    """containerd 2.x configuration (version 3) of one node: its own root, state, sockets and CNI
    directories; the pause image pinned; runc with cgroupfs; pod network namespaces under the
    state directory; oom_score_adj restricted where CAP_SYS_RESOURCE is missing."""
    restrict_oom = "false" if _has_capability(CAP_SYS_RESOURCE) else "true"
    return f"""version = 3
root = "{files / 'containerd'}"
state = "{sockets / 'state'}"
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing",
                    "io.containerd.internal.v1.opt"]

[grpc]
  address = "{sockets / 'containerd.sock'}"

[ttrpc]
  address = "{sockets / 'containerd.sock.ttrpc'}"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.shim.v1.manager"]
  socket_dir = "{sockets / 's'}"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins."io.containerd.cri.v1.runtime"]
  netns_mounts_under_state_dir = true
  # kubelet asks for negative oom_score_adj (-998 for every pod sandbox, -997 for critical and
  # Guaranteed pods), which needs CAP_SYS_RESOURCE; where this process lacks it (some sandboxed
  # machines), runc fails. Restricted, containerd never goes below its own score.
  restrict_oom_score_adj = {restrict_oom}
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{CNI_BIN_DIR}"]
    conf_dir = "{files / 'cni' / 'net.d'}"
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        # runc's state (one directory per container), else in the machine's runc root of containerd
        Root = "{sockets / 'runc'}"
        SystemdCgroup = false

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""


def _kube_proxy_config(node: str, kubeconfig: str, plans: Sequence[AddressPlan] = (IPV4,)) -> dict[str, Any]:
    """kube-proxy in nftables mode for ``node``, the cluster ranges of every family in ``plans``;
    conntrack sysctls left as they are (0)."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "nftables", "hostnameOverride": node, "clusterCIDR": ",".join(plan.cluster for plan in plans),
        "clientConnection": {"kubeconfig": kubeconfig},
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
    }
