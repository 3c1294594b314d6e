"""A local Kubernetes control plane: the real etcd and kube-apiserver on loopback.

Used by ``nftpolicy sandbox --control-plane`` and the tests, so that the agent and kube-router
talk to the API server that operators run, not to one this repository wrote. There is no
scheduler, controller manager or kubelet: objects are created through the API with
``spec.nodeName`` already set, and Pod and Node status is written through the ``status``
subresource (the Kubernetes API concepts page: "status is written by a different actor").

Binaries (:func:`find_binary`): ``etcd`` and ``kube-apiserver`` as ``.ci/install`` builds them
into ``.tools/bin`` from the Go modules pinned in ``tools/k8s``, else from ``$PATH``. The
ClusterNetworkPolicy CRD (:func:`cluster_network_policy_crd`, the experimental channel of
sigs.k8s.io/network-policy-api v0.3.0, which serves ``v1beta1`` and ``v1alpha2``, or of v0.2.0,
``v1alpha2`` only; ``.ci/install --test`` fetches both) is installed at start, as on a cluster
that runs a ClusterNetworkPolicy implementation.

Files live in one temporary directory: etcd's data, the service-account signing key, the static
token file, kube-apiserver's self-signed serving certificate (``--cert-dir``) and the admin
kubeconfig. :meth:`ControlPlane.close` stops both processes and removes that directory; it runs
on any error and on Ctrl-C (both processes are also killed when this process dies).
"""

from __future__ import annotations

import base64
import ctypes
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any, Iterable, Mapping

import yaml

from nftpolicy.translators.errors import OneLineError
from nftpolicy.agent import interrupts
from nftpolicy.agent.dataplane.netns import run_tag
from .started import Started

REPO_TOOLS = Path(__file__).resolve().parents[2] / ".tools" / "bin"
SERVICE_CIDR = "10.96.0.0/12"
ADMIN_GROUP = "system:masters"
# The image of sandbox pods: no kubelet ever pulls it, but the API requires one.
SANDBOX_IMAGE = "registry.invalid/nftpolicy/sandbox-pod:0"

# Where each kind lives in the API (core group or networking.k8s.io; namespaced or not).
RESOURCES: dict[str, tuple[str, str, bool]] = {
    "Namespace": ("/api/v1", "namespaces", False),
    "Node": ("/api/v1", "nodes", False),
    "Pod": ("/api/v1", "pods", True),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "CustomResourceDefinition": ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    "ClusterNetworkPolicy": ("/apis/policy.networking.k8s.io/v1alpha2", "clusternetworkpolicies", False),  # served by both CRDs
}
# Kinds whose objects may name another served version of their group: written at that version.
OTHER_VERSIONS = {"ClusterNetworkPolicy": ("policy.networking.k8s.io/v1beta1",)}
CRD_DIR = Path(__file__).resolve().parents[2] / ".tools" / "crd"
CRD_MODULE = "sigs.k8s.io/network-policy-api@v0.3.0"  # the default: v1beta1 stored and preferred, v1alpha2 served
CRD_PATH = CRD_DIR / "clusternetworkpolicies.yaml"
V1ALPHA2_CRD_MODULE = "sigs.k8s.io/network-policy-api@v0.2.0"  # v1alpha2 only
CRD_FILES = {CRD_MODULE: CRD_PATH, V1ALPHA2_CRD_MODULE: CRD_DIR / "clusternetworkpolicies-v0.2.0.yaml"}
WITH_STATUS = ("Pod", "Node")


class ControlPlaneError(OneLineError, RuntimeError):
    """A binary is missing, a process did not start or the API refused a request; the message
    names the binary or the object, and the API's own reason."""


class ApiError(ControlPlaneError):
    """The API server answered ``status`` (an HTTP code) with ``reason`` (its Status message)."""

    def __init__(self, what: str, status: int, reason: str) -> None:
        super().__init__(f"{what}: {status} {reason}")
        self.status, self.reason = status, reason


def find_binary(name: str, given: str | None = None) -> str:
    """The path of tool ``name``: ``given`` when set, else ``.tools/bin/<name>``, else ``$PATH``.

    Raises ControlPlaneError naming the binary and where it was looked for.
    """
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise ControlPlaneError(f"{name}: {given} is not an executable file")
        return given
    built = REPO_TOOLS / name
    if built.is_file() and os.access(built, os.X_OK):
        return str(built)
    found = shutil.which(name)
    if not found:
        raise ControlPlaneError(f"{name} not found in {REPO_TOOLS} or $PATH (bash .ci/install --test installs it)")
    return found


def cluster_network_policy_crd(module: str = CRD_MODULE) -> dict[str, Any]:
    """The ClusterNetworkPolicy CRD of ``module`` (a key of :data:`CRD_FILES`) that ``.ci/install
    --test`` put in its file. Raises ControlPlaneError when it is not there."""
    try:
        crd: dict[str, Any] = yaml.safe_load(CRD_FILES[module].read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ControlPlaneError(f"cannot read the ClusterNetworkPolicy CRD of {module} ({exc}): bash .ci/install --test puts it there") from None
    return crd


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """preexec_fn: the child is killed when this process dies (prctl PR_SET_PDEATHSIG, SIGKILL:
    kube-apiserver and kube-router can hang in a graceful shutdown once etcd is gone), so no
    test-bed process outlives a sandbox that was killed. The kernel ties it to the spawning
    thread: spawn from a thread that lives as long as the child (the main thread)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def spawn(argv: list[str], log: IO[bytes], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a test-bed process (stdin empty, stdout and stderr to ``log``) that dies with this
    process (:func:`die_with_parent`) and is killed by an interrupted command's last-resort
    cleanup (:mod:`nftpolicy.agent.interrupts`) until :func:`stop` ends it."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, preexec_fn=die_with_parent)
    interrupts.remember(("process", proc.pid), proc.kill)
    return proc


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM ``proc`` (started by :func:`spawn`), SIGKILL after ``timeout`` seconds, and reap
    it; nothing when it has ended already."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    interrupts.forget(("process", proc.pid))


def write_token_kubeconfig(path: str, server: str, ca_file: str, token: str, user: str) -> None:
    """A kubeconfig (mode 0600) for the API server at ``server`` (its CA from ``ca_file``,
    embedded) that authenticates with the bearer ``token`` as ``user``."""
    ca = base64.b64encode(Path(ca_file).read_bytes()).decode()
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "sandbox",
        "clusters": [{"name": "sandbox", "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "sandbox", "context": {"cluster": "sandbox", "user": user}}],
    }
    Path(path).write_text(json.dumps(config, indent=1))
    os.chmod(path, 0o600)


class ControlPlane(Started):
    """etcd + kube-apiserver on 127.0.0.1 (context manager).

    ``authorization``: kube-apiserver's ``--authorization-mode`` (RBAC by default, so that a
    token bound to the chart's ClusterRole gets exactly what the chart grants). The admin token
    is in group ``system:masters``. ``extra_args``: more kube-apiserver flags (tests use
    ``--min-request-timeout`` to make the server end watches early). ``crd``: the
    network-policy-api module whose ClusterNetworkPolicy CRD is installed at start (a key of
    :data:`CRD_FILES`; :meth:`install_crd` changes it later).

    Attributes after :meth:`start`: ``url`` (``https://127.0.0.1:PORT``), ``kubeconfig`` (the
    admin's), ``ca_file`` (the serving certificate, self-signed by kube-apiserver).
    """

    def __init__(self, authorization: str = "RBAC", extra_args: Iterable[str] = (),
                 etcd: str | None = None, apiserver: str | None = None, crd: str = CRD_MODULE) -> None:
        self.crd = crd
        self.versions: dict[str, str] = {}  # kind -> the apiVersion read and written when an object names none: its CRD's stored one
        self.etcd_binary = find_binary("etcd", etcd)
        self.apiserver_binary = find_binary("kube-apiserver", apiserver)
        self.authorization, self.extra_args = authorization, list(extra_args)
        self.dir = Path(tempfile.mkdtemp(prefix=f"nftpolicy-controlplane-{run_tag()}"))
        interrupts.remember(("directory", str(self.dir)), functools.partial(shutil.rmtree, self.dir, ignore_errors=True))
        self.admin_token = secrets.token_hex(16)
        self.etcd_port, self.peer_port, self.port = free_port(), free_port(), free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.ca_file = str(self.dir / "certs" / "apiserver.crt")
        self.kubeconfig = str(self.dir / "admin.kubeconfig")
        self._etcd: subprocess.Popen[bytes] | None = None
        self._apiserver: subprocess.Popen[bytes] | None = None
        self._ssl: ssl.SSLContext | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Write the keys and tokens, start etcd, then kube-apiserver; return once ``/readyz``
        answers ok (at most 90 s). Raises ControlPlaneError with the log's last lines."""
        (self.dir / "certs").mkdir()
        subprocess.run(["openssl", "genrsa", "-out", str(self.dir / "sa.key"), "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(self.dir / "sa.key"), "-pubout", "-out", str(self.dir / "sa.pub")],
                       check=True, capture_output=True)
        (self.dir / "tokens.csv").write_text(f'{self.admin_token},nftpolicy-admin,nftpolicy-admin,"{ADMIN_GROUP}"\n')
        self._etcd = self._spawn("etcd", [
            self.etcd_binary, "--name", "default", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{self.peer_port}",
            "--log-level", "warn", "--unsafe-no-fsync", "--quota-backend-bytes", str(4 << 30),
        ])
        self._wait("etcd", self._etcd, lambda: self._etcd_healthy(), 30)
        self.start_apiserver()
        self.install_crd(self.crd)

    def install_crd(self, module: str) -> None:
        """Install (or replace: a CRD upgrade) the ClusterNetworkPolicy CRD of ``module`` (a key
        of :data:`CRD_FILES`); return once the API serves every version it serves."""
        crd = cluster_network_policy_crd(module)
        self.apply(crd)
        self.crd = module
        stored = next(v["name"] for v in crd["spec"]["versions"] if v["storage"])
        self.versions["ClusterNetworkPolicy"] = f"{crd['spec']['group']}/{stored}"
        served = [f"/apis/{crd['spec']['group']}/{v['name']}/{crd['spec']['names']['plural']}" for v in crd["spec"]["versions"] if v["served"]]
        assert self._apiserver is not None
        self._wait("kube-apiserver", self._apiserver, lambda: all(self._answers(path) for path in served), 30)

    def start_apiserver(self) -> None:
        """Start kube-apiserver (again, after :meth:`stop_apiserver`; etcd keeps the data)."""
        self._apiserver = self._spawn("kube-apiserver", [
            self.apiserver_binary,
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
            f"--cert-dir={self.dir / 'certs'}",
            f"--token-auth-file={self.dir / 'tokens.csv'}",
            f"--authorization-mode={self.authorization}",
            f"--service-account-key-file={self.dir / 'sa.pub'}",
            f"--service-account-signing-key-file={self.dir / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # No controller manager creates each namespace's "default" ServiceAccount.
            "--disable-admission-plugins=ServiceAccount",
            "--profiling=false", "-v=1",
            *self.extra_args,
        ])
        self._wait("kube-apiserver", self._apiserver, self._apiserver_ready, 90)
        write_token_kubeconfig(self.kubeconfig, self.url, self.ca_file, self.admin_token, "nftpolicy-admin")

    def stop_apiserver(self) -> None:
        """Stop kube-apiserver (SIGTERM, then SIGKILL after 10 s); etcd and its data stay."""
        self._stop(self._apiserver)
        self._apiserver = None

    def close(self) -> None:
        """Stop kube-apiserver and etcd and remove every file of this control plane (idempotent)."""
        try:
            self._stop(self._apiserver)
            self._stop(self._etcd)
        finally:
            self._apiserver = self._etcd = None
            shutil.rmtree(self.dir, ignore_errors=True)
            interrupts.forget(("directory", str(self.dir)))

    def log(self, name: str) -> str:
        """The log of ``etcd`` or ``kube-apiserver`` so far."""
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(self.dir / f"{name}.log", "ab") as log:
            return spawn(argv, log)

    def _wait(self, name: str, proc: subprocess.Popen[bytes], ready: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = "\n".join(self.log(name).splitlines()[-15:])
                raise ControlPlaneError(f"{name} exited with code {proc.returncode}:\n{tail}")
            if ready():
                return
            time.sleep(0.2)
        tail = "\n".join(self.log(name).splitlines()[-15:])
        raise ControlPlaneError(f"{name} not ready after {timeout:.0f}s:\n{tail}")

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None:
            stop(proc)

    def _etcd_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.etcd_port}/health", timeout=1) as reply:
                return bool(json.loads(reply.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def _apiserver_ready(self) -> bool:
        if not os.path.exists(self.ca_file):
            return False
        try:
            return bool(self.request("GET", "/readyz", raw=True) == "ok")
        except (ControlPlaneError, OSError, ssl.SSLError):
            return False

    def _answers(self, path: str) -> bool:
        try:
            self.request("GET", path)
            return True
        except ApiError:
            return False

    def kubeconfig_for(self, token: str, name: str) -> str:
        """Write a kubeconfig that authenticates with ``token`` as ``name``; returns its path."""
        path = str(self.dir / f"{name}.kubeconfig")
        write_token_kubeconfig(path, self.url, self.ca_file, token, name)
        return path

    # ---- the API -------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, token: str | None = None,
                content_type: str = "application/json", raw: bool = False) -> Any:
        """One HTTPS request as the admin (or with ``token``); returns the decoded JSON (text
        when ``raw``). Raises ApiError with the Status message on an HTTP error."""
        if self._ssl is None:
            self._ssl = ssl.create_default_context(cafile=self.ca_file)
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {token or self.admin_token}", "Content-Type": content_type, "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self._ssl, timeout=30) as reply:
                text = reply.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            try:
                message = json.loads(detail).get("message") or detail
            except ValueError:
                message = detail
            raise ApiError(f"{method} {path}", error.code, message.strip()) from None
        return text if raw else json.loads(text) if text else None

    @staticmethod
    def path(kind: str, namespace: str | None = None, name: str | None = None, sub: str | None = None,
             api_version: str | None = None) -> str:
        """The API path of a collection or object of ``kind`` (one of :data:`RESOURCES`); a
        namespaced kind without namespace and name: its collection across all namespaces.
        ``api_version``: at that version when it is one of :data:`OTHER_VERSIONS` for ``kind``."""
        if kind not in RESOURCES:
            raise ControlPlaneError(f"kind {kind} is not handled by the sandbox control plane")
        prefix, plural, namespaced = RESOURCES[kind]
        if api_version in OTHER_VERSIONS.get(kind, ()):
            prefix = f"/apis/{api_version}"
        where = f"/namespaces/{namespace or 'default'}" if namespaced and (namespace or name) else ""
        return prefix + where + f"/{plural}" + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    def items(self, kind: str) -> list[dict[str, Any]]:
        """Every object of ``kind``, in all namespaces (a custom resource at its CRD's stored version)."""
        return list(self.request("GET", self.path(kind, api_version=self.versions.get(kind)))["items"])

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            result: dict[str, Any] = self.request("GET", self.path(kind, namespace, name, api_version=self.versions.get(kind)))
            return result
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create ``obj`` or bring the existing object to it; returns the stored object.

        Pods and Nodes: their ``status`` is written through the status subresource. An
        existing Pod, Namespace or Node gets its labels replaced (a Pod's spec is immutable);
        an existing NetworkPolicy is replaced whole. Pods without an image get
        :data:`SANDBOX_IMAGE` (no kubelet pulls it). An object of another served version
        (:data:`OTHER_VERSIONS`) is written at its version. Raises ApiError with the API's reason.
        """
        kind, meta = str(obj.get("kind")), dict(obj.get("metadata") or {})
        version = obj.get("apiVersion") if isinstance(obj.get("apiVersion"), str) else self.versions.get(kind)
        name: str = meta.get("name", "")
        namespace: str | None = (meta.get("namespace") or "default") if RESOURCES.get(kind, ("", "", False))[2] else None
        body = {k: v for k, v in obj.items() if k != "status"}
        if kind == "Pod":
            body = _with_images(body)
        existing = self.get(kind, name, namespace)
        if existing is None:
            stored: dict[str, Any] = self.request("POST", self.path(kind, namespace, api_version=version), body)
        elif kind in ("Pod", "Namespace", "Node"):
            old = (existing.get("metadata") or {}).get("labels") or {}
            new = meta.get("labels") or {}
            patch = {"metadata": {"labels": {**{k: None for k in old if k not in new}, **new}}}
            stored = self.request("PATCH", self.path(kind, namespace, name), patch, content_type="application/merge-patch+json")
        else:
            body["metadata"] = {**meta, "resourceVersion": existing["metadata"]["resourceVersion"]}
            stored = self.request("PUT", self.path(kind, namespace, name, api_version=version), body)
        if kind in WITH_STATUS and obj.get("status"):
            stored["status"] = dict(obj["status"])  # the object's state as given, not merged
            stored = self.request("PUT", self.path(kind, namespace, name, "status"), stored)
        return stored

    def delete(self, kind: str, name: str, namespace: str | None = None) -> None:
        """Delete at once (grace period 0: no kubelet confirms a pod's end); absent is fine."""
        try:
            self.request("DELETE", self.path(kind, namespace, name, api_version=self.versions.get(kind)),
                         {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0})
        except ApiError as error:
            if error.status != 404:
                raise

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A bound token of ServiceAccount ``namespace/name`` (TokenRequest API), creating the
        namespace and the ServiceAccount when they do not exist."""
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        if self.get("ServiceAccount", name, namespace) is None:
            self.request("POST", self.path("ServiceAccount", namespace), {"metadata": {"name": name}})
        review = self.request("POST", self.path("ServiceAccount", namespace, name, "token"),
                              {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": seconds}})
        return str(review["status"]["token"])


def _with_images(pod: dict[str, Any]) -> dict[str, Any]:
    spec = dict(pod.get("spec") or {})
    spec["containers"] = [{"image": SANDBOX_IMAGE, **c} for c in spec.get("containers") or [{"name": "server"}]]
    return {**pod, "spec": spec}
