"""The container image (Containerfile): hadolint, a real build with buildah, and the built image
run.

No image registry is reachable, so the base is a minimal Debian bookworm made with debootstrap
(variant minbase) and imported as a local image, then given as ``--build-arg BASE``. The rootfs,
the base image and buildah's layer cache live in a storage of their own under
``$NFTPOLICY_CI_CACHE`` (default ``/var/cache/nftpolicy-ci``), outside the repository and apart
from the machine's own container storage, and are reused by later runs. buildah runs with
``--isolation chroot`` (no OCI runtime needed) on the overlay driver.

Everything the image runs that touches networking runs inside a network namespace the test
creates, and the test checks that it is there before anything is loaded.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from nftpolicy.agent.cli import flags

from nftpolicy.agent.testbed import images
from nftpolicy.agent.testbed.images import CONTAINERFILE, buildah, buildah_command

from .conftest import REPO, nft
from .test_chart import agent_container, env_of, http_get, render

# Tags of this run's own (other runs, e.g. of another checkout, share the storage and its cache).
RUN = os.environ.get("NFTPOLICY_RUN_TAG") or secrets.token_hex(3)
IMAGE = f"localhost/nftpolicy:test-{RUN}"
BUILD_STAGE = f"localhost/nftpolicy-build:test-{RUN}"


# What a test of the built image needs (the `image` fixture): root, buildah and debootstrap.
BUILDS_THE_IMAGE = pytest.mark.tools("buildah", "debootstrap")


@pytest.fixture(scope="module")
def image():
    with images.storage_lock():
        started = time.monotonic()
        images.project_image(IMAGE, BUILD_STAGE)
        build_seconds = time.monotonic() - started
        container = f"nftpolicy-test-{RUN}-{secrets.token_hex(3)}"
        buildah("from", "--pull=never", "--name", container, IMAGE)
    try:
        yield Image(container, build_seconds)
    finally:
        buildah("rm", container, check=False)
        with images.storage_lock():
            buildah("rmi", IMAGE, BUILD_STAGE, check=False)  # this run's tags; the layers stay as cache


# Capability bits 0-31 (linux/capability.h), to read /proc/PID/status.
CAPABILITIES = ("CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE "
                "NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO "
                "SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME "
                "SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP").split()


def capabilities(status: str, field: str = "CapEff") -> set[str]:
    """The capability names of one line of /proc/PID/status."""
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith(field + ":")), 16)
    return {name for bit, name in enumerate(CAPABILITIES) if mask >> bit & 1} | ({"bit>31"} if mask >> 32 else set())


class Image:
    def __init__(self, container: str, build_seconds: float) -> None:
        self.container = container
        self.build_seconds = build_seconds
        self._default_caps: set[str] | None = None

    def cap_args(self, caps: list[str]) -> list[str]:
        """buildah's run options for exactly ``caps`` (a pod's ``drop: [ALL]`` plus ``add``):
        buildah applies ``--cap-drop ALL`` after ``--cap-add``, so its defaults are dropped one
        by one instead."""
        if self._default_caps is None:
            self._default_caps = capabilities(buildah(*self.run_args("cat", "/proc/self/status")).stdout, "CapBnd")
        args = [a for cap in caps for a in ("--cap-add", f"CAP_{cap}")]
        drop = sorted(self._default_caps - set(caps))
        return args + (["--cap-drop", ",".join(f"CAP_{cap}" for cap in drop)] if drop else [])

    def run_args(self, *command: str, volumes: dict[str, str] | None = None, env: dict[str, str] | None = None,
                 caps: list[str] | None = None) -> list[str]:
        mounts = [a for host, inside in (volumes or {}).items() for a in ("--volume", f"{host}:{inside}")]
        envs = [a for name, value in (env or {}).items() for a in ("--env", f"{name}={value}")]
        cap_args = self.cap_args(caps) if caps is not None else []
        return ["run", "--isolation", "chroot", *mounts, *envs, *cap_args, self.container, "--", *command]

    def run(self, *command: str, check: bool = True, volumes: dict[str, str] | None = None, env: dict[str, str] | None = None,
            caps: list[str] | None = None, netns_name: str | None = None) -> subprocess.CompletedProcess:
        """``command`` in the image, with only ``caps`` when given; inside ``netns_name`` when given
        (chroot isolation keeps the caller's network namespace)."""
        args = self.run_args(*command, volumes=volumes, env=env, caps=caps)
        if netns_name is None:
            return buildah(*args, check=check)
        result = subprocess.run(["ip", "netns", "exec", netns_name, *buildah_command(*args)],
                                check=False, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        if check:
            assert result.returncode == 0, f"{command} in {netns_name}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        return result

    def config(self, field: str) -> str:
        return buildah("inspect", "--type", "image", "--format", f"{{{{.OCIv1.Config.{field}}}}}", IMAGE).stdout.strip()




def in_test_namespace(image: Image, ns: str) -> None:
    """The image's processes run in ``ns``, not in the machine's namespace: checked first."""
    inside = image.run("readlink", "/proc/self/ns/net", netns_name=ns).stdout.strip()
    assert inside == f"net:[{os.stat(f'/run/netns/{ns}').st_ino}]", inside
    assert inside != os.readlink("/proc/self/ns/net")


# --- the Containerfile -----------------------------------------------------------------------

def test_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"
    out = subprocess.run([str(hadolint), str(CONTAINERFILE)], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_base_is_an_argument_of_both_stages():
    lines = [line.split() for line in CONTAINERFILE.read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0][:1] == ["ARG"] and lines[0][1].startswith("BASE=") and "debian" in lines[0][1]
    assert [line[1] for line in lines if line[0] == "FROM"] == ["${BASE}", "${BASE}", "${BASE}"]  # protos, build, final


def test_the_wheel_holds_every_package_and_the_launcher(tmp_path):
    """What the Containerfile installs (a wheel, not the editable install of .ci/install): every
    package under agent/ and translators/, and the command and the kubectl plugin as the launcher
    script (agent/cli/nftpolicy, and its symlink agent/cli/kubectl-nftpolicy as a copy of it)."""
    src = tmp_path / "src"  # what the Containerfile copies, so that the build leaves nothing in the repository
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "agent", "translators", "tools/k8s/go.mod", "tools/k8s/go.sum"):
        if (REPO / name).is_dir():  # COPY keeps symlinks: so does this
            shutil.copytree(REPO / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("k8s_pb2.py*"))
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(tmp_path), str(src)],
                   check=True, capture_output=True, timeout=300, cwd=tmp_path)
    (wheel,) = tmp_path.glob("nftpolicy-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # the protobuf decoder's messages, generated by the build from the pinned modules' .proto files
    assert {"nftpolicy/agent/daemon/k8s_pb2.py", "nftpolicy/agent/daemon/k8s_pb2.pyi"} <= names
    packages = sorted(str(p.parent.relative_to(REPO)) for top in ("agent", "translators") for p in (REPO / top).rglob("__init__.py"))
    assert [p for p in packages if f"nftpolicy/{p}/__init__.py" not in names] == []
    scripts = sorted(n for n in names if ".data/scripts/" in n or n.endswith(("/cli/nftpolicy", "/cli/kubectl-nftpolicy")))
    assert scripts == [f"nftpolicy-{version('nftpolicy')}.data/scripts/{name}" for name in ("kubectl-nftpolicy", "nftpolicy")]
    assert not [n for n in names if n.endswith("entry_points.txt") and b"console_scripts" in zipfile.ZipFile(wheel).read(n)]
    for script in scripts:
        assert zipfile.ZipFile(wheel).read(script) == (REPO / "agent" / "cli" / "nftpolicy").read_bytes()


def test_a_build_without_the_proto_files_goes_on_without_the_decoder(tmp_path):
    """No tools/k8s pins and no $NFTPOLICY_K8S_PROTO: the wheel is built, without k8s_pb2, and
    the build says in one line that the agent will use JSON."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "agent", "translators"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("k8s_pb2.py*"))
        else:
            shutil.copy(REPO / name, src / name)
    env = {k: v for k, v in os.environ.items() if k != "NFTPOLICY_K8S_PROTO"}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                            "--disable-pip-version-check", "-w", str(tmp_path), str(src)],
                           check=True, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    (wheel,) = tmp_path.glob("nftpolicy-*.whl")
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if "k8s_pb2" in n]
    assert "nftpolicy: not generating the protobuf decoder (no k8s.io/api generated.proto" in built.stdout + built.stderr


# --- the built image -------------------------------------------------------------------------

@pytest.mark.root
@BUILDS_THE_IMAGE
def test_version(image):
    assert image.run("nftpolicy", "--version").stdout.strip() == f"nftpolicy {version('nftpolicy')}"


@pytest.mark.root
@BUILDS_THE_IMAGE
def test_render_in_the_image_is_the_golden_ruleset(image):
    out = image.run("nftpolicy", "render", "/examples/shop", "--node", "node1", volumes={str(REPO / "examples"): "/examples:ro"})
    assert out.stdout == (REPO / "tests" / "golden" / "shop-node1.nft").read_text()


@pytest.mark.root
@BUILDS_THE_IMAGE
def test_entrypoint_is_the_agent_as_root(image):
    assert image.config("Entrypoint") == "[/opt/nftpolicy/bin/nftpolicy agent]"
    assert image.config("User") == "0:0"
    assert "PATH=/opt/nftpolicy/bin:" in image.config("Env")


@pytest.mark.root
@BUILDS_THE_IMAGE
def test_the_venv_sees_the_distribution_nftables(image):
    out = image.run("python3", "-c", "import sys, nftables; print(sys.prefix, nftables.__file__)").stdout.split()
    assert out == ["/opt/nftpolicy", "/usr/lib/python3/dist-packages/nftables/__init__.py"]
    versions = image.run("dpkg-query", "-W", "-f", "${Package} ${Version}\n", "nftables", "python3-nftables", "libnftables1").stdout
    assert len({line.split()[1] for line in versions.splitlines()}) == 1, versions  # one nftables release


@pytest.mark.root
@BUILDS_THE_IMAGE
def test_no_build_tools_in_the_image(image):
    assert image.run("sh", "-c", "command -v gcc cc make pip pip3 dpkg-dev; true").stdout == ""
    assert image.run("/opt/nftpolicy/bin/python", "-c", "import pip", check=False).returncode != 0
    assert image.run("find", "/var/lib/apt/lists", "/var/cache/apt", "-type", "f", "!", "-name", "lock").stdout == ""
    packages = set(image.run("dpkg-query", "-W", "-f", "${Package}\n").stdout.split())
    assert "python3-nftables" in packages
    assert not packages & {"python3-pip", "python3-venv", "python3-setuptools", "build-essential", "gcc", "make", "dpkg-dev"}


@pytest.mark.root
@BUILDS_THE_IMAGE
def test_build_time(image):
    # A cold build (no cached layers) takes about a minute here; keep the suite well under ten.
    assert image.build_seconds < 300, image.build_seconds


# --- the image against the kernel, in a test namespace ---------------------------------------

def pod_capabilities() -> list[str]:
    """The capabilities the chart gives the agent (after dropping ALL)."""
    security = agent_container(render("default"))["securityContext"]
    assert security["capabilities"]["drop"] == ["ALL"]
    return security["capabilities"]["add"]


@pytest.mark.kernel
@BUILDS_THE_IMAGE
@pytest.mark.tools("helm")  # the chart's capabilities and environment
def test_image_loads_the_ruleset_and_cleanup_removes_it(image, make_netns):
    """With the chart's capabilities only, the image's nft loads the image's render, and the
    image's ``nftpolicy cleanup`` removes the table (what the uninstall step of docs/operations.md runs)."""
    ns = make_netns()
    in_test_namespace(image, ns)
    caps = pod_capabilities()
    assert capabilities(image.run("cat", "/proc/self/status", caps=caps).stdout) == set(caps)
    volumes = {str(REPO / "examples"): "/examples:ro"}
    image.run("sh", "-c", "nftpolicy render /examples/shop --node node1 | nft -f -", volumes=volumes, caps=caps, netns_name=ns)
    assert "table inet nftpolicy" in nft(ns, "list", "tables")
    assert image.run("nftpolicy", "cleanup", caps=caps, netns_name=ns).stdout.strip() == "removed table inet nftpolicy"
    assert "nftpolicy" not in nft(ns, "list", "tables")


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _is_agent(argv: list[bytes]) -> bool:
    """The agent's interpreter (not buildah's exec wrapper, whose argv holds the same command)."""
    return b"python" in argv[0] and argv[1:3] == [b"/opt/nftpolicy/bin/nftpolicy", b"agent"]


def _written(root: Path, since: float) -> list[str]:
    """Files under ``root`` changed since ``since``, outside the mounts a pod has (/tmp and the
    kernel's file systems)."""
    changed = []
    for top in root.iterdir():
        if top.name in ("tmp", "proc", "sys", "dev", "run"):
            continue
        for path in [top] if not top.is_dir() or top.is_symlink() else top.rglob("*"):
            if path.is_file() and not path.is_symlink() and path.stat().st_mtime >= since:
                changed.append(str(path.relative_to(root)))
    return changed


@pytest.mark.kernel
@BUILDS_THE_IMAGE
@pytest.mark.tools("helm")  # the chart's capabilities and environment
def test_agent_in_the_image_with_the_chart_environment(image, make_netns, tmp_path):
    """The image's agent, with the default chart's environment and capabilities and the example
    as manifests, inside a test namespace: passes its nft feature check, loads the ruleset,
    answers the chart's probes, and writes nothing outside /tmp (the chart's root filesystem is
    read-only)."""
    ns = make_netns()
    in_test_namespace(image, ns)
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
    container = agent_container(render("default"))
    port = container["ports"][0]["containerPort"]
    root = Path(buildah("mount", image.container).stdout.strip())
    started = time.time() - 1
    log = tmp_path / "agent.log"
    # --manifests: no API server to check tokens with, so no secure metrics (test_the_image_serves_tls_...)
    env = env_of(container) | {flags.env_name("--manifests"): "/examples/shop", flags.env_name("--metrics-secure"): "false"}
    run = tmp_path / "run"  # the chart's in-memory volume of the debug socket
    run.mkdir()
    args = image.run_args("nftpolicy", "agent", env=env, volumes={str(REPO / "examples"): "/examples:ro", str(run): "/run/nftpolicy"},
                          caps=pod_capabilities())
    with log.open("w") as output:
        agent = subprocess.Popen(["ip", "netns", "exec", ns, *buildah_command(*args)],
                                 stdin=subprocess.DEVNULL, stdout=output, stderr=output)
    try:
        deadline = time.monotonic() + 60
        while http_get(ns, port, container["readinessProbe"]["httpGet"]["path"])[0] != 200:
            assert agent.poll() is None, f"agent exited {agent.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"/readyz never 200:\n{log.read_text()}"
            time.sleep(0.3)
        assert http_get(ns, port, container["livenessProbe"]["httpGet"]["path"])[0] == 200
        assert http_get(ns, port, "/metrics")[0] == 200
        assert (run / "debug.sock").is_socket()
        assert f"table inet {env_of(container)[flags.env_name('--table')]}" in nft(ns, "list", "tables")
        # SIGTERM to the agent itself, as the kubelet sends it (buildah would SIGKILL it).
        [pid] = [p for p in _descendants(agent.pid) if _is_agent(Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0"))]
        os.kill(pid, signal.SIGTERM)
        assert agent.wait(timeout=30) == 143, log.read_text()  # SIGTERM's code (agent/interrupts.py)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert "nftables feature missing" not in log.read_text()
    assert _written(root, started) == []


def test_the_image_serves_tls_with_a_certificate_it_makes(image):
    """--metrics-secure's self-signed certificate needs the cryptography wheel's compiled parts
    in the image: made, loaded into a TLS context and served, in the image's Python."""
    out = image.run("/opt/nftpolicy/bin/python", "-c",
                    "from nftpolicy.agent.daemon.serving import ServingCertificate; "
                    "print(ServingCertificate(None, None, ['node1'])().protocol.name)")
    assert out.stdout.strip() == "PROTOCOL_TLS_SERVER"
