"""Shared fixtures. Tests that touch the kernel need root and run every nft command inside a
network namespace the test created (and always deletes)."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.dataplane.netns import RUN_TAG_ENV
from nftpolicy.agent.daemon.manifestfiles import load_cluster
from nftpolicy.agent.testbed.controlplane import REPO_TOOLS, ControlPlaneError, find_binary
from nftpolicy.translators.manifests import build_cluster, parse_documents
from nftpolicy.translators.model import family_of

from .fakeclock import FakeClock

REPO = Path(__file__).resolve().parent.parent
# Every network namespace this test run makes (sandboxes, also in subprocesses, and make_netns)
# starts with nftp-<RUN_TAG>; the safety net below removes only those, never another run's.
RUN_TAG = f"t{secrets.token_hex(2)}"
os.environ[RUN_TAG_ENV] = RUN_TAG
OURS = f"nftp-{RUN_TAG}"
CONFORMANCE = REPO / "tests" / "conformance" / "upstream"
OWN_CASES = REPO / "tests" / "conformance" / "own"  # our cases, in the same format


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test marked ``kernel`` or ``root`` without root, or ``tools(...)`` without one of those
    tools, fails at once with one line saying what is missing and how to get it, before any of
    its fixtures starts (the markers are in pyproject.toml). Never a skip: a tool missing in CI
    must turn the run red."""
    if os.geteuid() != 0 and (item.get_closest_marker("kernel") or item.get_closest_marker("root")):
        pytest.fail("needs root (network namespaces, nftables, buildah): run the tests as root", pytrace=False)
    missing = [name for marker in item.iter_markers("tools") for name in marker.args if not _found(name)]
    if missing:
        pytest.fail(f"needs {', '.join(dict.fromkeys(missing))} (not in {REPO_TOOLS} or $PATH): run `bash .ci/install --test`",
                    pytrace=False)


def _found(tool: str) -> bool:
    """True when ``tool`` is where the test bed looks for it (``.tools/bin``, then ``$PATH``)."""
    try:
        find_binary(tool)
    except ControlPlaneError:
        return False
    return True


@contextlib.contextmanager
def netns_factory(tag: str) -> Iterator[Callable[[], str]]:
    """``make()`` creates an empty namespace (``<OURS><tag><random>``) and returns its name; all
    are deleted when the context ends, whatever happened."""
    created: list[str] = []

    def make() -> str:
        name = f"{OURS}{tag}{secrets.token_hex(3)}"
        created.append(name)
        netns.create([name])
        return name

    try:
        yield make
    finally:
        netns.delete(created)


@pytest.fixture
def make_netns():
    """Factory: ``make_netns()`` creates an empty namespace and returns its name; all are deleted
    after the test, whatever happened."""
    with netns_factory("test") as make:
        yield make


@pytest.fixture(scope="module")
def control_plane():
    """A real etcd and kube-apiserver (agent/testbed/controlplane.py) shared by one test module; tests
    that use it end with :func:`clear_api`."""
    from nftpolicy.agent.testbed.controlplane import ControlPlane

    with ControlPlane() as cp:
        yield cp


def clear_api(cp) -> None:
    """Delete every Pod, NetworkPolicy and ClusterNetworkPolicy of a control plane (namespaces
    stay: no controller would finalize their deletion), so the next test starts from namespaces only."""
    for kind in ("ClusterNetworkPolicy", "NetworkPolicy", "Pod"):
        for item in cp.items(kind):
            cp.delete(kind, item["metadata"]["name"], item["metadata"].get("namespace"))


def nft(ns: str, *args: str, stdin: str | None = None) -> str:
    """Run the nft binary inside namespace ``ns``; raises AssertionError with nft's message."""
    result = subprocess.run(["ip", "netns", "exec", ns, "nft", *args], input=stdin, capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"nft {' '.join(args)} failed in {ns}: {result.stderr.strip()}")
    return result.stdout


def tcp_connects(ns: str, address: str, port: int, timeout: float) -> bool:
    """One TCP connection from namespace ``ns`` to ``address``:``port``; True when it connected
    within ``timeout`` seconds."""
    family = socket.AF_INET if family_of(address) == "ipv4" else socket.AF_INET6
    with netns.entered(ns):
        sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect((address, port))
        return True
    except OSError:
        return False
    finally:
        sock.close()


def connect_from_node(sandbox, node: str, address: str, port: int) -> bool:
    """One TCP connection from sandbox node ``node``'s own namespace (so from its own address) to
    ``address``:``port``; True when it connected within the sandbox's probe timeout."""
    return tcp_connects(sandbox.node_netns(node), address, port, sandbox.timeout)


def http_get(url: str) -> tuple[int, str]:
    """GET ``url``: (status, body), including error statuses; (0, "") when nothing answers."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


def eventually(check: Callable[[], object], expected: object = True, timeout: float = 10.0, *,
               clock: FakeClock | None = None, step: float = 0.1) -> None:
    """Poll ``check`` every 10 ms until it returns ``expected`` (``==``); fail with the last value
    after ``timeout`` seconds of real time. With ``clock``, each poll also moves it ``step``
    seconds on, so the code under test lives through its delays at that pace."""
    deadline = time.monotonic() + timeout
    value = check()
    while value != expected and time.monotonic() < deadline:
        if clock is not None:
            clock.advance(step)
        time.sleep(0.01)
        value = check()
    assert value == expected, f"still {value!r} after {timeout}s (expected {expected!r})"


def cluster_from_yaml(text: str):
    """A Cluster from YAML text; fails the test on any invalid object."""
    objects, errors = parse_documents(text)
    cluster, invalid = build_cluster(objects)
    assert not errors + invalid, [str(e) for e in errors + invalid]
    return cluster


def example_cluster():
    """The shop example shipped in examples/shop."""
    cluster, errors = load_cluster([str(REPO / "examples" / "shop")])
    assert not errors
    return cluster


@pytest.fixture(autouse=True)
def no_leaked_namespaces(request):
    """Every namespace a test creates is gone when it ends; one left behind (of this run: named
    nftp-<RUN_TAG>) is deleted and the test is named in a warning (a safety net: the code under test must clean up itself)."""
    before = set(netns.existing(OURS))
    yield
    leaked = sorted(set(netns.existing(OURS)) - before)
    if leaked:
        netns.delete(leaked)
        import warnings

        warnings.warn(f"{request.node.nodeid} left network namespaces {leaked[:3]}{'...' if len(leaked) > 3 else ''}")
