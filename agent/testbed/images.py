"""Container images built on this machine with buildah, for the tests: no registry is reachable.

* :func:`project_image`: the agent's image from the repository's ``Containerfile``, on a minimal
  Debian bookworm base that debootstrap makes (:func:`base_image`).
* :func:`files_image`: an image of a few files on ``scratch`` or the Debian base (the pause and
  agnhost images the real node's kubelet and the upstream e2e suite ask for, by their names).
* :func:`cached_archive`: an image as a docker-archive tarball, which containerd imports
  (``ctr images import``), so that a kubelet finds it without pulling.

Everything lives in a storage of its own under ``$NFTPOLICY_CI_CACHE`` (default
``/var/cache/nftpolicy-ci``), apart from the machine's own container storage, and is reused by
later runs (debootstrap's rootfs, the base image, buildah's layer cache). buildah runs with
``--isolation chroot`` (no OCI runtime needed) on the overlay driver; :func:`storage_lock` is
held while building, pruning or removing tags.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "Containerfile"
CACHE = Path(os.environ.get("NFTPOLICY_CI_CACHE", "/var/cache/nftpolicy-ci"))
ROOTFS = CACHE / "bookworm-minbase"
MIRROR = os.environ.get("NFTPOLICY_CI_MIRROR", "http://deb.debian.org/debian")
# buildah's state (locks, mounts) for that storage, one per cache directory.
RUNROOT = f"/run/nftpolicy-ci/{hashlib.sha256(str(CACHE).encode()).hexdigest()[:12]}"
BASE_IMAGE = "localhost/nftpolicy-ci-base:bookworm"
# The host's CA bundle, for pip inside the build (a proxy with its own CA); a build argument and a
# volume, so nothing of it stays in the image.
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_CA = "/run/nftpolicy-build-ca.crt"


class ImageError(RuntimeError):
    """A build step failed; the message holds the command and the end of its output."""


def buildah_command(*args: str) -> list[str]:
    """The argv of ``buildah ARGS`` on this storage."""
    return ["buildah", "--root", str(CACHE / "containers"), "--runroot", RUNROOT, "--storage-driver", "overlay", *args]


def buildah(*args: str, check: bool = True, timeout: float = 600, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run buildah on this storage (text output); raises ImageError when ``check`` and it fails."""
    command = buildah_command(*args)
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise ImageError(f"{' '.join(command)}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result


def storage_lock() -> IO[str]:
    """An exclusive lock on the storage (flock on ``build.lock``), released when the returned file
    is closed: two runs never build, prune or re-tag under each other."""
    CACHE.mkdir(parents=True, exist_ok=True)
    handle = open(CACHE / "build.lock", "a")
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def base_rootfs() -> None:
    """debootstrap bookworm (variant minbase) once; an interrupted run leaves only the .tmp
    directory, made again next time. Raises ImageError."""
    if (ROOTFS / "etc" / "debian_version").exists():
        return
    partial = ROOTFS.with_suffix(".tmp")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(partial), MIRROR],
                            check=False, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise ImageError("debootstrap: " + result.stdout[-3000:] + result.stderr[-3000:])
    for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for path in (partial / leftover).glob("*"):
            if path.is_file():
                path.unlink()
    partial.rename(ROOTFS)


def base_image() -> None:
    """The rootfs as the local image :data:`BASE_IMAGE` (one layer), once."""
    if buildah("inspect", "--type", "image", BASE_IMAGE, check=False).returncode == 0:
        return
    base_rootfs()
    container = buildah("from", "scratch").stdout.strip()
    try:
        mount = buildah("mount", container).stdout.strip()
        subprocess.run(f"tar -C {ROOTFS} -cf - . | tar -C {mount} -xf -", shell=True, check=True)
        buildah("umount", container)
        buildah("config", "--cmd", "/bin/bash", container)
        buildah("commit", "--quiet", container, BASE_IMAGE)
    finally:
        buildah("rm", container, check=False)


def project_image(tag: str, build_stage_tag: str) -> None:
    """Build the Containerfile as ``tag`` (the build stage first, as ``build_stage_tag``, so that
    pruning keeps its cached layers too); earlier builds' untagged images are pruned, the layers
    under tagged images stay as cache. Call with :func:`storage_lock` held. Raises ImageError."""
    base_image()
    ca = ["--volume", f"{HOST_CA}:{BUILD_CA}:ro", "--build-arg", f"PIP_CERT={BUILD_CA}"] if HOST_CA.exists() else []
    build = ["build", "--isolation", "chroot", "--layers", "--pull=never", "--build-arg", f"BASE={BASE_IMAGE}", *ca,
             "--file", str(CONTAINERFILE)]
    buildah(*build, "--target", "build", "--tag", build_stage_tag, str(REPO), timeout=1200)
    buildah(*build, "--tag", tag, str(REPO), timeout=1200)
    buildah("rmi", "--prune", check=False)


def files_image(tag: str, files: Mapping[str, Path], entrypoint: Sequence[str], cmd: Sequence[str] = (),
                base: str = "scratch") -> None:
    """An image tagged ``tag``: ``base`` (``scratch``, or a local image such as
    :data:`BASE_IMAGE` for a binary that needs a C library) plus ``files``, which maps a path in
    the image to a file here (mode kept), and a ``/tmp``. Kept as it is when ``tag`` already holds
    the same files (a digest of them is its label ``nftpolicy.sources``). Call with
    :func:`storage_lock` held."""
    digest = hashlib.sha256(repr((base, list(entrypoint), list(cmd))).encode())
    for inside, source in sorted(files.items()):
        digest.update(inside.encode() + b"\0" + hashlib.sha256(source.read_bytes()).digest())
    sources = digest.hexdigest()
    label = buildah("inspect", "--type", "image", "--format", '{{index .OCIv1.Config.Labels "nftpolicy.sources"}}', tag,
                    check=False).stdout.strip()
    if label == sources:
        return
    if base != "scratch":
        base_image()
    container = buildah("from", "--pull=never", base).stdout.strip()
    try:
        for inside, source in files.items():
            buildah("copy", container, str(source), inside)
        mount = buildah("mount", container).stdout.strip()
        os.makedirs(os.path.join(mount, "tmp"), mode=0o1777, exist_ok=True)
        buildah("umount", container)
        buildah("config", "--entrypoint", _json_list(entrypoint), *(["--cmd", _json_list(cmd)] if cmd else []),
                "--label", f"nftpolicy.sources={sources}", container)
        buildah("commit", "--quiet", "--rm", container, tag)
    except BaseException:
        buildah("rm", container, check=False)
        raise


def cached_archive(tag: str, name: str | None = None) -> Path:
    """Image ``tag`` as a docker-archive (named ``tag`` inside) in ``CACHE/images``, named after
    ``name`` (default: the tag's repository) and the image's id: written once per id; archives
    of the same name with another id are removed. Two tags of one repository that must both be
    imported (each archive holds one name) need a ``name`` each. Call with :func:`storage_lock`
    held; returns the path."""
    image_id = buildah("inspect", "--type", "image", "--format", "{{.FromImageID}}", tag).stdout.strip()
    repository = (name or tag.rsplit(":", 1)[0]).replace("/", "_")
    folder = CACHE / "images"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{repository}@{image_id[:16]}.tar"
    if not path.exists():
        for stale in folder.glob(f"{repository}@*.tar"):
            stale.unlink()
        partial = path.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        buildah("push", "--quiet", tag, f"docker-archive:{partial}:{tag}")
        partial.rename(path)
    return path


def _json_list(items: Sequence[str]) -> str:
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"
