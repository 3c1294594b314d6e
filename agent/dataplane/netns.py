"""Network namespaces: create, delete, run ``ip`` batches in them, and enter one from this thread.

Entering uses setns(2) on the calling thread only (``CLONE_NEWNET``), so a socket or a
libnftables context created inside :func:`entered` belongs to that namespace for its whole life,
while the rest of the process stays where it was.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from contextlib import contextmanager
from typing import Iterator

from nftpolicy.translators.errors import OneLineError
from nftpolicy.agent import interrupts

CLONE_NEWNET = 0x40000000
# Set by a caller that runs many sandboxes (the test suite): every namespace and control-plane
# directory they make carries this tag, so that caller finds and removes exactly its own.
RUN_TAG_ENV = "NFTPOLICY_RUN_TAG"
NETNS_DIR = "/run/netns"
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(OneLineError, RuntimeError):
    """An ``ip`` command or setns(2) failed; the message holds the command and its output."""


def run_tag() -> str:
    """``$NFTPOLICY_RUN_TAG`` (empty when unset): the start of every run id this process makes."""
    return os.environ.get(RUN_TAG_ENV, "")


def enter_thread(fd: int) -> None:
    """Move the calling thread into the network namespace open at ``fd`` (a file of
    ``/run/netns`` or ``/proc/PID/ns/net``) for good; raises NetnsError."""
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsError(f"setns: {os.strerror(err)}")


@contextmanager
def entered(name: str) -> Iterator[None]:
    """Run the body with this thread inside network namespace ``name`` (from ``ip netns add``)."""
    with open(f"{NETNS_DIR}/{name}") as target, open("/proc/thread-self/ns/net") as home:
        enter_thread(target.fileno())
        try:
            yield
        finally:
            enter_thread(home.fileno())


def create(names: list[str]) -> None:
    """Create these network namespaces (``ip netns add``, one batch); raises NetnsError.

    Callers name them with their run's tag (:func:`run_tag`) and delete exactly these. Each is
    registered as a leftover (:func:`~nftpolicy.agent.interrupts.remember`) until :func:`delete`
    removes it, so an interrupted command still removes it."""
    for name in names:
        interrupts.remember(("netns", name), functools.partial(_delete, name))
    ip_batch([f"netns add {name}" for name in names])


def ip_batch(commands: list[str], netns: str | None = None) -> None:
    """Run ``ip -batch`` with ``commands`` (one ``ip`` command line each), inside ``netns`` if given.

    Raises NetnsError with ip's message when any line fails.
    """
    if not commands:
        return
    argv = ["ip"] + (["-n", netns] if netns else []) + ["-batch", "-"]
    result = subprocess.run(argv, input="\n".join(commands) + "\n", capture_output=True, text=True)
    if result.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed: {result.stderr.strip() or result.stdout.strip()}")


def existing(prefix: str = "") -> list[str]:
    """Names of the network namespaces in /run/netns that start with ``prefix``."""
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def delete(names: list[str]) -> None:
    """Delete these namespaces (missing ones are ignored); never raises for a namespace in use."""
    for name in names:
        _delete(name)
        interrupts.forget(("netns", name))


def _delete(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def write_sysctl(netns: str, key: str, value: str) -> None:
    """Write ``/proc/sys/<key with dots as slashes>`` as seen from inside ``netns``."""
    with entered(netns), open("/proc/sys/" + key.replace(".", "/"), "w") as f:
        f.write(value)
