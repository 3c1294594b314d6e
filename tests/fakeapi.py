"""An in-repo fake Kubernetes API server: the real list/watch HTTP protocol, with fault injection.

Serves what the agent reads, to the official ``kubernetes`` client, over plain HTTP on 127.0.0.1:

* ``GET /api/v1/namespaces``, ``/api/v1/pods``, ``/api/v1/nodes`` (``fieldSelector=metadata.name=X``),
  ``/apis/networking.k8s.io/v1/networkpolicies``: a list with ``metadata.resourceVersion``, in
  pages of ``limit`` objects with a ``continue`` token when asked, as the real API server pages
  (the token is the last key served; the pages are not one snapshot, as the real ones are);
* the same with ``watch=true``: a chunked stream of ``{"type", "object"}`` lines from
  ``resourceVersion``, ``BOOKMARK`` events when ``allowWatchBookmarks``, closed after
  ``timeoutSeconds``; a resourceVersion older than the history gives an ``ERROR`` event with a
  410 Status (the API concepts page, "Efficient detection of changes").

* ``POST /api/v1/namespaces/{ns}/events`` and merge ``PATCH .../events/{name}``: Events the
  agent writes, kept in :attr:`FakeApiServer.events`.

Faults: :meth:`fail` (the next N requests answer a status, e.g. 500, or 429 with Retry-After),
:meth:`hang` (the next N requests are accepted and never answered), :meth:`cut_watches` (open
watch streams are cut mid-stream), :meth:`outage` (the port refuses connections; events made
meanwhile are lost from the history, so watchers must relist), :meth:`fail_events` (the next N
Event writes answer a status).
"""

from __future__ import annotations

import bisect
import copy
import json
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator
from urllib.parse import parse_qs, urlsplit

PATHS = {
    "/api/v1/namespaces": "Namespace",
    "/api/v1/pods": "Pod",
    "/api/v1/nodes": "Node",
    "/apis/networking.k8s.io/v1/networkpolicies": "NetworkPolicy",
    "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies": "ClusterNetworkPolicy",  # with cluster_network_policies
}
DISCOVERY = "/apis/policy.networking.k8s.io/"  # + a version: its APIResourceList (v1alpha2 only, as network-policy-api v0.2.0)
API_VERSION = {"Namespace": "v1", "Pod": "v1", "Node": "v1", "NetworkPolicy": "networking.k8s.io/v1",
               "ClusterNetworkPolicy": "policy.networking.k8s.io/v1alpha2"}


class FakeApiServer:
    """Start with :meth:`start`; change the cluster with :meth:`put` and :meth:`delete`."""

    def __init__(self, bookmark_interval: float = 1.0, cluster_network_policies: bool = False) -> None:
        """``cluster_network_policies``: serve ClusterNetworkPolicies (their CRD is installed);
        else their path is a 404, as on a cluster without the CRD."""
        self.cluster_network_policies = cluster_network_policies
        self.lock = threading.Condition()
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.history: list[tuple[int, str, str, dict]] = []  # (resourceVersion, type, kind, object)
        self.version = 1
        self.oldest = 1  # events at or below this version are forgotten
        self.bookmark_interval = bookmark_interval
        self.requests: list[tuple[float, str, int]] = []  # (time, path with query, status)
        self._faults: list[tuple[int, dict | None]] = []  # per coming request: (status, headers) or "hang"
        self._hangs = 0
        self._watch_errors = 0
        self._watch_error_code = 500
        self._cuts = 0
        self.events: dict[tuple[str, str], dict] = {}  # (namespace, name) -> Event
        self._event_faults: list[int] = []  # per coming Event write: its status
        self._listing: tuple[tuple | None, list[tuple[str, str, str]]] = (None, [])  # (kind, selector, version), keys
        self._released = threading.Event()
        self.server: ThreadingHTTPServer | None = None
        self.port = 0

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> str:
        """Listen on 127.0.0.1 (a free port the first time, the same port after an outage)."""
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), type("Handler", (_ApiHandler,), {"fake": self}))
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        # stop() waits up to one poll interval (0.5 s by default) for the loop to notice
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stop listening and cut every open stream."""
        if self.server:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        self.cut_watches()
        self._released.set()

    def kubeconfig(self, path: str, server: str | None = None) -> str:
        """Write a kubeconfig for this server (reached at ``server``, a proxy's URL, if given)
        to ``path`` and return the path."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": server or self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }
        with open(path, "w") as f:
            json.dump(config, f)
        return path

    # ---- the cluster --------------------------------------------------------------------------

    def put(self, obj: dict) -> dict:
        """Create or replace an object (ADDED or MODIFIED); returns the stored copy."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        key = (obj["kind"], meta.get("namespace", "") if obj["kind"] in ("Pod", "NetworkPolicy") else "", meta["name"])
        with self.lock:
            self.version += 1
            meta["resourceVersion"] = str(self.version)
            event = "MODIFIED" if key in self.objects else "ADDED"
            self.objects[key] = obj
            self.history.append((self.version, event, obj["kind"], obj))
            self.lock.notify_all()
        return obj

    def delete(self, kind: str, name: str, namespace: str = "") -> None:
        """Delete an object (DELETED event with its last state)."""
        with self.lock:
            obj = self.objects.pop((kind, namespace, name))
            self.version += 1
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
            self.history.append((self.version, "DELETED", kind, obj))
            self.lock.notify_all()

    # ---- faults -------------------------------------------------------------------------------

    def fail(self, status: int, count: int = 1, retry_after: int | None = None) -> None:
        """The next ``count`` requests answer ``status`` (with ``Retry-After`` if given)."""
        with self.lock:
            self._faults.extend([(status, {"Retry-After": str(retry_after)} if retry_after is not None else None)] * count)

    def fail_watches(self, count: int, code: int = 500) -> None:
        """The next ``count`` watches answer a single ``ERROR`` event with ``code`` and end."""
        with self.lock:
            self._watch_errors += count
            self._watch_error_code = code

    def fail_events(self, status: int, count: int = 1) -> None:
        """The next ``count`` Event writes (POST, PATCH) answer ``status``."""
        with self.lock:
            self._event_faults.extend([status] * count)

    def heal(self) -> None:
        """Drop every fault still queued by :meth:`fail`."""
        with self.lock:
            self._faults.clear()

    def hang(self, count: int = 1) -> None:
        """The next ``count`` requests are read and never answered (until :meth:`stop`)."""
        with self.lock:
            self._hangs += count

    def cut_watches(self) -> None:
        """Close every open watch stream abruptly, without the final chunk."""
        with self.lock:
            self._cuts += 1
            self.lock.notify_all()

    def compact(self) -> None:
        """Forget the history: a watch from an older resourceVersion gets 410 Gone."""
        with self.lock:
            self.oldest = self.version
            self.history.clear()

    @contextmanager
    def outage(self) -> Iterator[None]:
        """The server is unreachable inside the block; changes made meanwhile reach clients only
        through a relist (the history is compacted when it comes back)."""
        self.stop()
        try:
            yield
        finally:
            self.compact()
            self._released.clear()
            self.start()



class _ApiHandler(BaseHTTPRequestHandler):
    """The fake's HTTP side: lists, watches and Event writes, with the faults it was told to inject."""

    fake: "FakeApiServer"  # set by FakeApiServer.start, on a subclass of its own
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as Go's net/http (kube-apiserver) sets: else a watch event written
    # while the previous one is unacknowledged waits for the client's delayed ACK (40 ms).
    disable_nagle_algorithm = True

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path.startswith(DISCOVERY) and "/" not in url.path.removeprefix(DISCOVERY):  # discovery: never faulted
            served = self.fake.cluster_network_policies and url.path == DISCOVERY + "v1alpha2"
            return self._json(200, {"kind": "APIResourceList", "groupVersion": url.path.removeprefix("/apis/"), "resources": [
                {"name": "clusternetworkpolicies", "kind": "ClusterNetworkPolicy", "namespaced": False}]}) if served else self._status(404)
        with self.fake.lock:
            fault = self.fake._faults.pop(0) if self.fake._faults else None
            hang = self.fake._hangs > 0
            self.fake._hangs -= 1 if hang else 0
        if hang:
            self.fake.requests.append((time.monotonic(), self.path, 0))
            self.fake._released.wait()
            self.close_connection = True
            return
        if fault:
            return self._status(fault[0], fault[1])
        kind = PATHS.get(url.path)
        if kind is None or (kind == "ClusterNetworkPolicy" and not self.fake.cluster_network_policies):
            return self._status(404)
        if query.get("watch") in ("true", "1"):
            return self._watch(kind, query)
        with self.fake.lock:
            listing = (kind, query.get("fieldSelector"), self.fake.version)
            if self.fake._listing[0] != listing:  # the pages of one list share the sorted keys
                self.fake._listing = (listing, sorted(k for k in self.fake.objects if k[0] == kind and _selected(self.fake.objects[k], query)))
            keys = self.fake._listing[1]
            start = bisect.bisect_right(keys, tuple(json.loads(query["continue"]))) if query.get("continue") else 0
            limit = int(query["limit"]) if query.get("limit", "").isdigit() and int(query["limit"]) > 0 else len(keys)
            page = keys[start:start + limit]
            meta = {"resourceVersion": str(self.fake.version)}
            if start + limit < len(keys):  # more to come: continue after this page's last key
                meta["continue"] = json.dumps(page[-1])
            body = {"kind": f"{kind}List", "apiVersion": API_VERSION[kind], "metadata": meta,
                    "items": [self.fake.objects[k] for k in page]}
        self._json(200, body)

    def _event_write(self) -> tuple[list[str], dict] | None:
        """The path's parts and the body of an Event write, or None when it has
        answered (an injected fault, a path that is not an Event)."""
        parts = urlsplit(self.path).path.strip("/").split("/")
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        with self.fake.lock:
            fault = self.fake._event_faults.pop(0) if self.fake._event_faults else None
        if fault:
            self._status(fault)
            return None
        if parts[:3] != ["api", "v1", "namespaces"] or len(parts) < 5 or parts[4] != "events":
            self._status(404)
            return None
        return parts, body

    def do_POST(self) -> None:  # noqa: N802
        answer = self._event_write()
        if answer is None:
            return
        parts, body = answer
        key = (parts[3], body["metadata"]["name"])
        with self.fake.lock:
            if key in self.fake.events:
                return self._status(409)
            self.fake.events[key] = body
        self._json(201, body)

    def do_PATCH(self) -> None:  # noqa: N802
        answer = self._event_write()
        if answer is None:
            return
        parts, patch = answer
        with self.fake.lock:
            event = self.fake.events.get((parts[3], parts[5])) if len(parts) == 6 else None
            if event is None:
                return self._status(404)
            event.update(patch)
        self._json(200, event)

    def _status(self, code: int, headers: dict | None = None) -> None:
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "message": f"injected {code}"}
        self._json(code, body, headers)

    def _json(self, code: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.fake.requests.append((time.monotonic(), self.path, code))
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, event: dict) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _watch(self, kind: str, query: dict[str, str]) -> None:
        self.fake.requests.append((time.monotonic(), self.path, 200))
        since = int(query.get("resourceVersion") or 0)
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with self.fake.lock:
            cuts = self.fake._cuts
            injected = self.fake._watch_errors > 0
            self.fake._watch_errors -= 1 if injected else 0
            if injected or since < self.fake.oldest:
                code = self.fake._watch_error_code if injected else 410
                gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired" if code == 410 else "InternalError",
                        "code": code, "message": f"too old resource version: {since} ({self.fake.oldest})" if code == 410 else f"injected {code}"}
                self._chunk({"type": "ERROR", "object": gone})
                self.wfile.write(b"0\r\n\r\n")
                return
        next_bookmark = time.monotonic() + self.fake.bookmark_interval
        try:
            while time.monotonic() < deadline:
                with self.fake.lock:
                    if self.fake._cuts != cuts:
                        break
                    events = [(v, t, o) for v, t, k, o in self.fake.history if k == kind and v > since and _selected(o, query)]
                    if not events:
                        self.fake.lock.wait(min(0.2, max(0.0, deadline - time.monotonic())))
                        events = [(v, t, o) for v, t, k, o in self.fake.history if k == kind and v > since and _selected(o, query)]
                    if self.fake._cuts != cuts:
                        break
                    current = self.fake.version
                for version, event_type, obj in events:
                    self._chunk({"type": event_type, "object": obj})
                    since = version
                if bookmarks and time.monotonic() >= next_bookmark:
                    since = max(since, current) if not events else since
                    self._chunk({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": API_VERSION[kind],
                                                                 "metadata": {"resourceVersion": str(since)}}})
                    next_bookmark = time.monotonic() + self.fake.bookmark_interval
            else:
                self.wfile.write(b"0\r\n\r\n")  # timeoutSeconds reached: a clean end
                return
            self.connection.shutdown(socket.SHUT_RDWR)  # cut mid-stream
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
        self.close_connection = True


def _selected(obj: dict, query: dict[str, str]) -> bool:
    selector = query.get("fieldSelector")
    if not selector:
        return True
    field, _, value = selector.partition("=")
    return field != "metadata.name" or obj["metadata"]["name"] == value


def namespace(name: str, **labels: str) -> dict[str, Any]:
    """A Namespace object."""
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name, **labels}}}


def pod(namespace: str, name: str, ip: str | None, node: str = "node1", phase: str = "Running",
        ports: tuple[int | tuple[str, int, str], ...] = (80,), **labels: str) -> dict[str, Any]:
    """A Pod object with ``status.podIPs`` (None: no IP yet, phase Pending unless given);
    ``ports``: container port numbers, or ``(name, number, protocol)`` for a named port."""
    status: dict[str, Any] = {"phase": phase if ip else ("Pending" if phase == "Running" else phase)}
    if ip:
        status.update(podIP=ip, podIPs=[{"ip": ip}])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": namespace, "name": name, "labels": labels},
            "spec": {"nodeName": node, "containers": [{"name": "c", "ports": [_container_port(p) for p in ports]}]},
            "status": status}


def _container_port(port: int | tuple[str, int, str]) -> dict[str, Any]:
    if isinstance(port, int):
        return {"containerPort": port}
    name, number, protocol = port
    return {"name": name, "containerPort": number, "protocol": protocol}


def node(name: str, *addresses: tuple[str, str], **labels: str) -> dict[str, Any]:
    """A Node object with ``labels`` and ``status.addresses`` given as ``(type, address)``
    (``("InternalIP", "172.18.0.2")``)."""
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": {},
            "status": {"addresses": [{"type": kind, "address": address} for kind, address in addresses]}}
