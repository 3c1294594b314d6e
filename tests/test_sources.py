"""The Kubernetes API source against the fake API server: the list/watch protocol and its faults,
through the official client. No kernel needed: these check the in-memory store."""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import time

import pytest
from kubernetes.client import ApiException

from nftpolicy.agent.daemon.clock import REAL_TIME, Clock
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.sources import KubeSource, ManifestsSource
from nftpolicy.agent.daemon.store import Store

from .conftest import eventually
from .fakeapi import DISCOVERY, FakeApiServer, namespace, node, pod
from .fakeclock import FakeClock, InstantClock
from .stallproxy import StallProxy


@pytest.fixture
def api(tmp_path):
    server = FakeApiServer(bookmark_interval=0.2)
    server.start()
    server.put(namespace("x"))
    server.put(node("node1"))
    server.put(node("node2"))
    server.put(pod("x", "a", "10.0.0.1", app="a"))
    yield server
    server.stop()


@pytest.fixture
def source(api, tmp_path):
    """Start a KubeSource on the fake server; returns (store, metrics, start). Tests about delays
    give ``start`` a :class:`FakeClock` and move it on with :func:`eventually`."""
    stop = threading.Event()
    metrics = Metrics()
    store = Store(metrics)

    def start(watch_timeout: int = 30, api_timeout: float = 2.0, clock: Clock = REAL_TIME) -> KubeSource:
        src = KubeSource(store, metrics, api.kubeconfig(str(tmp_path / "kc.json")), api_timeout, watch_timeout, stop, clock)
        src.start()
        eventually(store.listed)
        return src

    yield store, metrics, start
    stop.set()


def pods(store: Store) -> dict:
    return store.take()[0].pods


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_list_then_watch_and_every_node(api, source):
    store, _, start = source
    start()
    cluster = store.take()[0]
    assert set(cluster.pods) == {"x/a"} and set(cluster.nodes) == {"node1", "node2"}  # nodes peers select any Node
    api.put(pod("x", "b", "10.0.0.2", app="b"))
    eventually(lambda: "x/b" in pods(store))
    api.put(pod("x", "b", "10.0.0.3", app="b"))
    eventually(lambda: pods(store)["x/b"].ips == ("10.0.0.3",))
    api.delete("Pod", "b", "x")
    eventually(lambda: "x/b" not in pods(store))
    watches = [p for _, p, _ in api.requests if "watch=true" in p]
    assert watches and all("allowWatchBookmarks=true" in p and "resourceVersion=" in p for p in watches)
    assert not any("fieldSelector" in p for _, p, _ in api.requests if "/nodes" in p)
    api.put(node("node3", ("InternalIP", "172.18.0.3"), role="infra"))
    eventually(lambda: store.take()[0].nodes.get("node3") is not None and store.take()[0].nodes["node3"].peer_addresses == ("172.18.0.3",))


def test_watch_timeout_reconnects_from_the_last_version(api, source):
    store, _, start = source
    start(watch_timeout=1)

    def pod_watches() -> list[str]:
        return [p for _, p, _ in api.requests if "/pods" in p and "watch=true" in p]

    eventually(lambda: len(pod_watches()) >= 3)  # the server ended two watches after their 1 s
    api.put(pod("x", "late", "10.0.0.9"))
    eventually(lambda: "x/late" in pods(store))
    assert all("timeoutSeconds=1" in p for p in pod_watches())
    lists = [p for _, p, _ in api.requests if "/pods" in p and "watch=true" not in p]
    assert len(lists) == 1  # reconnecting a watch never relists


def test_bookmarks_advance_the_resource_version(api, source):
    store, _, start = source
    src = start(watch_timeout=1)
    listed_at = int(src.versions["Pod"])
    api.put(namespace("other"))  # bumps the version; no Pod event follows
    eventually(lambda: int(src.versions["Pod"]) > listed_at)


def test_a_watch_that_stops_delivering_is_watched_again_from_its_resource_version(api, tmp_path, caplog):
    """Behind a proxy that stops forwarding (both connections stay open, keepalive sees live
    peers), each watch is given up after the idle timeout (0.6 s here; 130 s by default) and
    watched again from the resourceVersion of its last bookmark, without a relist: a change made
    after the stall arrives within the idle timeout plus the first retry's 0.2 to 1.2 s. Before,
    bookmarks (every 0.2 s here) keep the quiet watches alive. Real time: the idle timeout is a
    socket's read timeout."""
    metrics, stop = Metrics(), threading.Event()
    store = Store(metrics)
    kinds = ("Namespace", "Pod", "NetworkPolicy", "Node")
    with StallProxy(("127.0.0.1", api.port)) as proxy, caplog.at_level(logging.INFO, logger="nftpolicy.sources"):
        kubeconfig = api.kubeconfig(str(tmp_path / "kc.json"), f"http://127.0.0.1:{proxy.port}")
        src = KubeSource(store, metrics, kubeconfig, 2.0, 300, stop, idle_timeout=0.6)
        assert src.read_timeout == 0.6
        try:
            src.start()
            eventually(store.listed)
            listed = {kind: int(src.versions[kind]) for kind in kinds}
            api.put(namespace("other"))  # the quiet kinds' bookmarks move past their lists' versions
            eventually(lambda: all(int(src.versions[kind]) > listed[kind] for kind in kinds))
            time.sleep(1.5)  # two and a half idle timeouts of bookmarks
            assert sum(sample(metrics, "nftpolicy_api_retries_total", kind=k, reason="silent") for k in kinds) == 0
            stalled = proxy.stall()
            assert len(stalled) >= len(kinds)
            before = dict(src.versions)
            watches = len(api.requests)
            since = time.monotonic()
            api.put(pod("x", "b", "10.0.0.2"))
            eventually(lambda: "x/b" in pods(store), timeout=10)
            took = time.monotonic() - since
        finally:
            stop.set()
    assert 0.6 <= took <= 0.6 + 1.2 + 0.5, took
    assert all(sample(metrics, "nftpolicy_api_retries_total", kind=k, reason="silent") >= 1 for k in kinds)
    said = [r.getMessage() for r in caplog.records if "silent" in r.getMessage()]
    for kind in kinds:
        line = next(m for m in said if m.startswith(f"API {kind} watch silent for "))
        assert re.fullmatch(rf"API {kind} watch silent for 1s \(no event or bookmark; kube-apiserver sends a bookmark about every "
                            rf"60s\): watching again from resourceVersion {before[kind]} in \d\.\ds", line), line
    again = [p for _, p, _ in api.requests[watches:] if "/pods" in p]
    assert again and all("watch=true" in p for p in again), again  # no relist
    assert f"resourceVersion={before['Pod']}" in again[0]


@pytest.mark.parametrize("api_timeout, watch_timeout, idle_timeout, read_timeout", [
    (10.0, 300, None, 130.0),  # the defaults: the idle timeout, not 310 s
    (2.0, 20, None, 22.0),  # a watch that ends before it: its end plus the API timeout, as before
    (10.0, 300, 5.0, 5.0), (10.0, 300, 400.0, 310.0)])
def test_a_watch_reads_with_the_idle_timeout_unless_it_ends_sooner(tmp_path, api_timeout, watch_timeout, idle_timeout, read_timeout):
    """The read timeout of a watch (seconds without a byte) is --watch-idle-timeout, whose
    default is WATCH_IDLE_TIMEOUT (two bookmark periods and 10 s), or the watch's timeout plus the
    API timeout when that is shorter (the server has ended the stream by then)."""
    from nftpolicy.agent.cli import flags
    from nftpolicy.agent.daemon.sources import BOOKMARK_PERIOD, WATCH_IDLE_TIMEOUT

    default = flags.parser().parse_args(["agent", "--node", "n1"]).watch_idle_timeout
    assert default == WATCH_IDLE_TIMEOUT == 2 * BOOKMARK_PERIOD + 10
    kubeconfig = FakeApiServer().kubeconfig(str(tmp_path / "kc.json"))
    src = KubeSource(Store(Metrics()), Metrics(), kubeconfig, api_timeout, watch_timeout, threading.Event(),
                     idle_timeout=default if idle_timeout is None else idle_timeout)
    assert src.read_timeout == read_timeout


def test_cut_watch_is_retried_without_losing_events(api, source):
    store, metrics, start = source
    clock = FakeClock()
    start(clock=clock)
    api.cut_watches()
    api.put(pod("x", "b", "10.0.0.2"))
    eventually(lambda: "x/b" in pods(store), clock=clock)
    assert sample(metrics, "nftpolicy_api_retries_total", kind="Pod", reason="connection") >= 1


def test_410_gone_relists_and_catches_up_deletes(api, source):
    store, _, start = source
    clock = FakeClock()
    start(clock=clock)
    with api.outage():
        api.delete("Pod", "a", "x")
        api.put(pod("x", "b", "10.0.0.2"))
    eventually(lambda: set(pods(store)) == {"x/b"}, clock=clock)
    pod_lists = [p for _, p, code in api.requests if "/pods" in p and "watch=true" not in p and code == 200]
    assert len(pod_lists) >= 2


def test_429_honours_retry_after(api, source):
    store, metrics, start = source
    clock = FakeClock()
    start(clock=clock)
    api.cut_watches()
    api.fail(429, count=1, retry_after=2)
    eventually(lambda: 2.0 in clock.waited, clock=clock)  # the retry waits what Retry-After says
    (failed,) = [i for i, (_, _, code) in enumerate(api.requests) if code == 429]
    kind_path = api.requests[failed][1].split("?")[0]
    eventually(lambda: any(p.split("?")[0] == kind_path for _, p, _ in api.requests[failed + 1:]), clock=clock)
    assert sum(sample(metrics, "nftpolicy_api_retries_total", kind=k, reason="429")
               for k in ("Pod", "Namespace", "NetworkPolicy", "Node")) == 1


@pytest.mark.parametrize("asked, waited", [("2", 2.0), ("3600", 30.0), ("1e9", 30.0),
                                           ("-5", None), ("nan", None), ("inf", None), ("soon", None)])
def test_retry_after_is_capped_and_a_bad_one_waits_the_backoff(api, tmp_path, asked, waited):
    """A 429 whose Retry-After asks for an hour waits MAX_BACKOFF (30 s), like every other
    long pause of the source (the source's clock is the test's: the delay is read). One that is
    negative, not finite or not a number (``None`` here) would be no wait at all for Event.wait:
    the backoff's pause is taken instead, so that no node retries in a tight loop."""
    metrics, clock = Metrics(), InstantClock()
    src = KubeSource(Store(metrics), metrics, api.kubeconfig(str(tmp_path / "kc.json")), 2.0, 30, threading.Event(), clock)
    answers = [ApiException(status=429, reason="Too Many Requests")]
    answers[0].headers = {"Retry-After": asked}

    def request() -> str:
        if answers:
            raise answers.pop(0)
        return "listed"

    assert src._retrying("Pod", "list")(request) == "listed"
    if waited is None:
        assert len(clock.waited) == 1 and 0 < clock.waited[0] <= 30
    else:
        assert clock.waited == [waited]


def test_hanging_request_times_out_and_is_retried(api, source):
    """A request that is never answered ends after the client-side timeout (a watch's read
    timeout is watch_timeout + api_timeout) and is retried."""
    store, metrics, start = source
    start(watch_timeout=1, api_timeout=1.0)
    api.hang(count=1)
    api.cut_watches()
    api.put(pod("x", "b", "10.0.0.2"))
    eventually(lambda: "x/b" in pods(store), timeout=15)
    eventually(lambda: sum(sample(metrics, "nftpolicy_api_retries_total", kind=k, reason="timeout")
                           for k in ("Pod", "Namespace", "NetworkPolicy", "Node")) >= 1, timeout=10)
    hung = next(t for t, _, code in api.requests if code == 0)
    api.put(pod("x", "c", "10.0.0.3"))  # every kind watches again after its timeout
    eventually(lambda: "x/c" in pods(store))
    assert time.monotonic() - hung < 15


def test_other_4xx_is_reported_not_retried(api, source):
    store, metrics, start = source
    clock = FakeClock()
    start(clock=clock)
    api.cut_watches()
    api.fail(400, count=4)
    eventually(lambda: sum(sample(metrics, "nftpolicy_api_errors_total", kind=k, reason="400")
                           for k in ("Pod", "Namespace", "NetworkPolicy", "Node")) >= 1, clock=clock)
    failed = clock.now()
    eventually(lambda: clock.now() - failed >= 5.0, clock=clock)  # longer than any retry's delay
    assert sum(sample(metrics, "nftpolicy_api_retries_total", kind=k, reason="400")
               for k in ("Pod", "Namespace", "NetworkPolicy", "Node")) == 0


FORBIDDEN = 'pods is forbidden: User "system:serviceaccount:kube-system:nftpolicy" cannot watch resource "pods" in API group "" at the cluster scope'


def refused(status: int) -> ApiException:
    """A 401 or 403 as the client raises it, with the API server's Status message."""
    exc = ApiException(status=status, reason="Forbidden" if status == 403 else "Unauthorized")
    exc.body = json.dumps({"kind": "Status", "code": status, "message": FORBIDDEN if status == 403 else "Unauthorized"})
    return exc


def test_401_and_403_are_retried_with_the_common_backoff_reported_once(api, tmp_path, caplog):
    """A restarting API server refuses requests (403) until its RBAC authorizer has loaded: the
    refusal is retried like a 5xx (0.2 s doubling, plus up to 1 s of jitter, capped at 3 s); its
    first is a warning, and once the refusals of a kind have lasted 10 s one error says the
    API's message (the verb and the resource), nothing more until a request of that kind
    succeeds; nftpolicy_api_access_denied{kind,verb} is 1 meanwhile. The source's clock is
    the test's, and every wait lasts its whole time at once: the delays are read, not waited out."""
    metrics = Metrics()
    clock = InstantClock()
    slept = clock.waited
    src = KubeSource(Store(metrics), metrics, api.kubeconfig(str(tmp_path / "kc.json")), 2.0, 30, threading.Event(), clock)
    answers = [refused(403)] * 7 + [refused(401)]
    denied_meanwhile = []

    def request() -> str:
        denied_meanwhile.append(sample(metrics, "nftpolicy_api_access_denied", kind="Pod", verb="watch"))
        if answers:
            raise answers.pop(0)
        src._success("Pod")
        return "streamed"

    with caplog.at_level(logging.DEBUG, logger="nftpolicy.sources"):
        assert src._retrying("Pod", "watch")(request) == "streamed"
    assert len(slept) == 8
    for delay, base in zip(slept, (0.2, 0.4, 0.8, 1.6, 3.0, 3.0, 3.0, 3.0)):
        assert base <= delay <= base + 1.0, slept
    assert denied_meanwhile == [0] + [1] * 8
    assert sample(metrics, "nftpolicy_api_access_denied", kind="Pod", verb="watch") == 0
    assert sample(metrics, "nftpolicy_api_retries_total", kind="Pod", reason="403") == 7
    assert sample(metrics, "nftpolicy_api_retries_total", kind="Pod", reason="401") == 1
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]
    assert said[0] == ("WARNING", f"API Pod request refused (403 Forbidden: {FORBIDDEN}), retry in {slept[0]:.1f}s: an API server "
                                  "that has just started refuses requests until its authenticator and authorizer are ready")
    # the error comes at the first refusal 10 s or more after the first one
    at = next(i for i in range(len(slept)) if sum(slept[:i]) >= 10.0)
    status = f"403 Forbidden: {FORBIDDEN}" if at < 7 else "401 Unauthorized: Unauthorized"
    assert said[1] == ("ERROR", f"API Pod requests refused for {sum(slept[:at]):.0f}s: {status}; retrying at most 4s apart, "
                                "said once until they are allowed")
    assert said[2] == ("INFO", f"API Pod requests are allowed again, after {sum(slept):.1f}s of refusals") and len(said) == 3
    # after a success the delay starts again from 0.2 s, and a new refusal is said again
    slept.clear()
    answers.append(refused(403))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nftpolicy.sources"):
        src._retrying("Pod", "list")(request)
    assert len(slept) == 1 and 0.2 <= slept[0] <= 1.2
    assert [r.levelname for r in caplog.records if r.levelno >= logging.INFO] == ["WARNING", "INFO"]


def test_a_403_from_the_api_is_retried_not_held_for_30s(api, source):
    """Through the client and HTTP: watches refused with 403 come back at the next retry, not
    after the 30 s of a non-retryable error."""
    store, metrics, start = source
    clock = FakeClock()
    start(clock=clock)
    api.fail(403, count=4)
    api.cut_watches()
    cut = clock.now()
    api.put(pod("x", "b", "10.0.0.2"))
    eventually(lambda: "x/b" in pods(store), clock=clock)
    assert clock.now() - cut < 5.0
    eventually(lambda: sum(sample(metrics, "nftpolicy_api_retries_total", kind=k, reason="403")
                           for k in ("Pod", "Namespace", "NetworkPolicy", "Node")), 4, clock=clock)
    eventually(lambda: all(sample(metrics, "nftpolicy_api_access_denied", kind=k, verb=v) == 0
                           for k in ("Pod", "Namespace", "NetworkPolicy", "Node") for v in ("list", "watch")), clock=clock)


def test_invalid_objects_are_counted_and_policies_fail_closed(api, source):
    store, metrics, start = source
    api.put({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "x", "name": "bad"},
             "spec": {"podSelector": {"matchLabels": {"app": "a"}}, "ingress": [{"ports": [{"port": 70000}]}]}})
    start()
    policy = store.take()[0].policies["x/bad"]
    assert policy.policy_types == {"ingress"} and policy.ingress == ()
    assert sample(metrics, "nftpolicy_invalid_objects", kind="NetworkPolicy") == 1
    api.delete("NetworkPolicy", "bad", "x")
    eventually(lambda: sample(metrics, "nftpolicy_invalid_objects", kind="NetworkPolicy") == 0)


def test_failing_watches_back_off_instead_of_relisting_in_a_loop(api, source):
    store, metrics, start = source
    clock = FakeClock()
    start(clock=clock)
    api.fail_watches(1000)
    api.cut_watches()
    cut = clock.now()
    eventually(lambda: clock.now() - cut >= 3.0, clock=clock)
    pod_lists = [p for _, p, _ in api.requests if "/pods" in p and "watch=true" not in p]
    assert 2 <= len(pod_lists) <= 8, len(pod_lists)  # 0.2 + 0.4 + 0.8 + 1.6 s of backoff, not ~60 lists
    assert sample(metrics, "nftpolicy_api_errors_total", kind="Pod", reason="5xx") >= 2
    api._watch_errors = 0
    api.put(pod("x", "b", "10.0.0.2"))
    eventually(lambda: "x/b" in pods(store), clock=clock, step=0.5)  # after a pause of up to 30 s


def test_lists_are_paginated_and_consistent(api, source):
    """Pages of 500 (bounded memory at any cluster size) and no resourceVersion: the API server
    ignores limit for resourceVersion=0 (tests/test_real_api.py shows the pages on the real one)."""
    start = source[2]
    start()
    lists = [p for _, p, _ in api.requests if "watch=true" not in p and not p.startswith(DISCOVERY)]
    assert lists and all("limit=500" in p and "resourceVersion" not in p for p in lists)


def polled(clock: FakeClock, times: int = 3) -> None:
    """Move ``clock`` on until a manifests poll has waited ``times`` more times: it has looked
    at the directory since the last write."""
    seen = len(clock.waited)
    eventually(lambda: len(clock.waited) >= seen + times, clock=clock, step=0.05)


def test_a_manifest_that_does_not_parse_keeps_the_last_good_state(tmp_path):
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n")
    stop, clock = threading.Event(), FakeClock()
    store = Store(Metrics())
    ManifestsSource(store, str(tmp_path), stop, interval=0.05, clock=clock).start()
    try:
        (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: [unclosed\n")
        polled(clock)
        assert set(store.take()[0].namespaces) == {"x"}
        (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: y}\n")
        eventually(lambda: set(store.take()[0].namespaces) == {"y"}, clock=clock)
    finally:
        stop.set()


def test_manifests_directory_is_reread_on_change(tmp_path):
    (tmp_path / "a.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n")
    stop = threading.Event()
    store = Store(Metrics())
    ManifestsSource(store, str(tmp_path), stop, interval=0.05).start()
    try:
        assert store.listed() and set(store.take()[0].namespaces) == {"x"}
        (tmp_path / "b.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: y}\n")
        eventually(lambda: set(store.take()[0].namespaces) == {"x", "y"})
        (tmp_path / "a.yaml").unlink()
        eventually(lambda: set(store.take()[0].namespaces) == {"y"})
    finally:
        stop.set()


@pytest.mark.parametrize("address", ["127.0.0.1:0", "[::1]:0"])
def test_health_server_on_ipv4_and_ipv6(address):
    import urllib.request

    from nftpolicy.agent.daemon.health import Health, serve_http

    health = Health(window=60)
    server = serve_http(address, Metrics(), health)
    try:
        host = "[::1]" if address.startswith("[") else "127.0.0.1"
        url = f"http://{host}:{server.server_address[1]}"
        assert urllib.request.urlopen(url + "/healthz").status == 200
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "/readyz")
        assert err.value.code == 503
        health.ready = True
        assert urllib.request.urlopen(url + "/readyz").status == 200
        metrics = urllib.request.urlopen(url + "/metrics").read()
        # both modes at 0 before any failure, so that an alert's increase() sees the first one
        assert b'nftpolicy_sync_failures_total{mode="full"} 0.0' in metrics
        assert b'nftpolicy_sync_failures_total{mode="incremental"} 0.0' in metrics
    finally:
        server.shutdown()


def test_a_file_that_is_not_utf8_keeps_the_directory_polled(tmp_path):
    (tmp_path / "a.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n")
    stop, clock = threading.Event(), FakeClock()
    store = Store(Metrics())
    ManifestsSource(store, str(tmp_path), stop, interval=0.05, clock=clock).start()
    try:
        (tmp_path / "b.yaml").write_bytes(b"kind: Namespace\nmetadata: {name: caf\xe9}\n")
        polled(clock)
        assert set(store.take()[0].namespaces) == {"x"}  # the last readable state is kept
        (tmp_path / "b.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: y}\n")
        eventually(lambda: set(store.take()[0].namespaces) == {"x", "y"}, clock=clock)  # and polling goes on
    finally:
        stop.set()


def test_an_expired_continue_token_relists_at_once(tmp_path):
    """A 410 on a page after the first (the continue token expired) relists without the 30 s
    pause of other client errors (review finding)."""
    from kubernetes.client import ApiException

    from nftpolicy.agent.daemon import sources

    calls = []

    def list_pods(**kwargs):
        calls.append(kwargs.get("_continue"))
        if kwargs.get("_continue"):
            raise ApiException(status=410, reason="Expired")

        class Page:
            data = b'{"metadata": {"resourceVersion": "7", "continue": "t1"}, "items": []}'
            headers = {"Content-Type": "application/json"}
        return Page()

    api = FakeApiServer()
    api.start()
    try:
        source = KubeSource(Store(Metrics()), Metrics(), api.kubeconfig(str(tmp_path / "kc.json")), 2.0, 30, threading.Event())
        source.calls["Pod"] = (list_pods, {})
        with pytest.raises(sources.RelistNeeded, match="continue token expired"):
            source._list("Pod")
        assert calls == [None, "t1"]
    finally:
        api.stop()


def test_objects_with_only_generate_name_keep_apart(tmp_path):
    """Two pods of one generateName in a manifests directory are two pods, not one (their keys
    are the names that render generates for them; review finding)."""
    for i, ip in enumerate(["10.244.1.5", "10.244.1.6"]):
        obj = pod("shop", "x", ip, app="web")
        del obj["metadata"]["name"]
        obj["metadata"]["generateName"] = "web-"
        obj["spec"]["containers"][0]["name"] = f"c{i}"  # the generated name follows the content
        (tmp_path / f"p{i}.json").write_text(__import__("json").dumps(obj))
    store = Store(Metrics())
    stop = threading.Event()
    ManifestsSource(store, str(tmp_path), stop).start()
    stop.set()
    cluster = store.take()[0]
    assert len(cluster.pods) == 2 and sorted(p.ips[0] for p in cluster.pods.values()) == ["10.244.1.5", "10.244.1.6"]


def test_a_port_name_that_is_not_a_string_is_refused_and_the_poll_lives_on(tmp_path):
    bad = pod("x", "p", "10.0.0.1")
    bad["spec"]["containers"][0]["ports"][0]["name"] = ["http"]
    (tmp_path / "p.json").write_text(__import__("json").dumps(bad))
    store, stop = Store(Metrics()), threading.Event()
    ManifestsSource(store, str(tmp_path), stop, interval=0.05).start()
    try:
        assert store.take()[0].pods == {}
        (tmp_path / "p.json").write_text(__import__("json").dumps(pod("x", "q", "10.0.0.2")))
        eventually(lambda: set(store.take()[0].pods) == {"x/q"})
    finally:
        stop.set()


def test_the_api_back_after_an_outage_is_noticed_within_the_retry_cap(api, source):
    """During an outage each kind's retry delay grows only to RETRY_CAP + RETRY_JITTER (4 s), so
    a change made once the API is back reaches the store within 5 s however long the outage
    lasted. (With the old delays, 0.2 s doubling to 30 s plus up to 1 s of jitter, the 7th retry
    of this 20 s outage comes at 12.6-18.6 s and the 8th at 25.4 s or later: at least 5.4 s after
    the API is back.) And
    nftpolicy_watch_seconds_since_success says how long each kind has been without an answer."""
    from nftpolicy.agent.daemon.sources import RETRY_CAP, RETRY_JITTER

    store, metrics, start = source
    clock = FakeClock()
    start(clock=clock)
    eventually(lambda: sample(metrics, "nftpolicy_watch_seconds_since_success", kind="Pod"), 0.0)
    with api.outage():
        began = clock.now()
        eventually(lambda: clock.now() - began >= 20.0, clock=clock)
        failing = sample(metrics, "nftpolicy_watch_seconds_since_success", kind="Pod")
        assert 19.0 <= failing <= 21.0, failing
        assert sample(metrics, "nftpolicy_watch_seconds_since_success", kind="Namespace") >= 19.0
    back = clock.now()
    api.put(pod("x", "after", "10.0.0.9"))
    # a slow step: the clock moves on while the relist runs in real time too
    eventually(lambda: "x/after" in pods(store), clock=clock, step=0.02)
    took = clock.now() - back
    assert took <= RETRY_CAP + RETRY_JITTER + 1.0 <= 5.0, f"the change after the outage took {took:.1f} s"
    eventually(lambda: sample(metrics, "nftpolicy_watch_seconds_since_success", kind="Pod"), 0.0)
    # the server still gets no tight loop: at most one request per kind per 0.2 s early on, and
    # one per RETRY_CAP..RETRY_CAP + RETRY_JITTER once the delay has grown
    retries = sample(metrics, "nftpolicy_api_retries_total", kind="Pod", reason="connection")
    assert 6 <= retries <= 14, retries


def test_an_unreadable_manifest_at_start_holds_the_first_sync_until_it_parses(tmp_path):
    """A restart while a file is half written must not sync a partial cluster (its full replace
    would drop the isolation of every pod the unreadable file's policies select)."""
    (tmp_path / "ns.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n")
    (tmp_path / "policy.yaml").write_bytes(b"\xff\xfe not text")
    stop, clock = threading.Event(), FakeClock()
    store = Store(Metrics())
    ManifestsSource(store, str(tmp_path), stop, interval=0.05, clock=clock).start()
    try:
        polled(clock)
        assert not store.listed()
        (tmp_path / "policy.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: y}\n")
        eventually(store.listed, clock=clock)
        assert set(store.take()[0].namespaces) == {"x", "y"}
    finally:
        stop.set()


class _Recorded(Exception):
    """Raised by :func:`_recording`'s ``call_api`` once it has recorded a request."""


def _recording(api, seen: list) -> None:
    def call_api(method, url, header_params=None, body=None, post_params=None, _request_timeout=None):
        seen.append((method, url, header_params, body, _request_timeout))
        raise _Recorded

    api.call_api = call_api


GENERATED = [  # (generated client's API class and method, keywords, our path)
    ("CoreV1Api", "list_pod_for_all_namespaces", {"limit": 500, "_continue": "t1"}, "/api/v1/pods"),
    ("CoreV1Api", "list_namespace", {"watch": True, "resource_version": "7", "allow_watch_bookmarks": True, "timeout_seconds": 300},
     "/api/v1/namespaces"),
    ("CoreV1Api", "list_node", {"limit": 500}, "/api/v1/nodes"),
    ("NetworkingV1Api", "list_network_policy_for_all_namespaces", {"limit": 500, "resource_version": "0", "resource_version_match": "NotOlderThan"},
     "/apis/networking.k8s.io/v1/networkpolicies"),
    ("CustomObjectsApi", "list_cluster_custom_object", {"watch": True, "resource_version": "9", "allow_watch_bookmarks": True},
     "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies"),
]


@pytest.mark.parametrize("api_class, method, keywords, path", GENERATED, ids=[g[1] for g in GENERATED])
def test_requests_are_the_ones_the_generated_client_makes(tmp_path, api_class, method, keywords, path):
    """kubeclient.Collection (which spares the agent importing the generated API classes) sends
    the generated methods' request: method, URL with its query, headers (Accept, credentials)."""
    from kubernetes import client

    from nftpolicy.agent.daemon.kubeclient import Collection

    server = FakeApiServer()
    source = KubeSource(Store(Metrics()), Metrics(), server.kubeconfig(str(tmp_path / "kc.json")), 2.0, 30, threading.Event())
    ours: list = []
    theirs: list = []
    _recording(source.api, ours)
    with pytest.raises(_Recorded):
        Collection(source.api, path)(_request_timeout=(2.0, 32.0), **keywords)
    generated = client.ApiClient(source.api.configuration)
    _recording(generated, theirs)
    extra = {"group": "policy.networking.k8s.io", "version": "v1alpha2", "plural": "clusternetworkpolicies"} if api_class == "CustomObjectsApi" else {}
    with pytest.raises(_Recorded):
        getattr(getattr(client, api_class)(generated), method)(_preload_content=False, _request_timeout=(2.0, 32.0), **extra, **keywords)
    assert ours == theirs


def test_event_requests_are_the_ones_the_generated_client_makes(tmp_path):
    from kubernetes import client

    from nftpolicy.agent.daemon.events import KubeEventWriter

    server = FakeApiServer()
    source = KubeSource(Store(Metrics()), Metrics(), server.kubeconfig(str(tmp_path / "kc.json")), 2.0, 30, threading.Event())
    body = {"metadata": {"name": "e1", "namespace": "x"}, "involvedObject": {"kind": "NetworkPolicy", "namespace": "x", "name": "p"},
            "reason": "Invalid", "message": "m", "type": "Warning", "count": 2}
    ours: list = []
    theirs: list = []
    _recording(source.api, ours)
    writer = KubeEventWriter(source.api, 5.0)
    for write in (lambda: writer.create("x", body), lambda: writer.patch("x", "e1", body)):
        with pytest.raises(_Recorded):
            write()
    generated = client.ApiClient(source.api.configuration)
    _recording(generated, theirs)
    core = client.CoreV1Api(generated)
    with pytest.raises(_Recorded):
        core.create_namespaced_event("x", body, _request_timeout=5.0)
    with pytest.raises(_Recorded):
        core.patch_namespaced_event("e1", "x", body, _request_timeout=5.0, _content_type="application/merge-patch+json")
    assert ours == theirs


def test_read_ahead_takes_one_item_ahead_and_hands_errors_over_where_they_happened():
    from nftpolicy.agent.daemon.sources import read_ahead

    taken: list[int] = []

    def source():
        for i in range(3):
            taken.append(i)
            yield i
        raise ApiException(status=500)

    items = read_ahead(source(), "test")
    assert next(items) == 0
    eventually(lambda: taken, [0, 1])  # the next one is fetched meanwhile, and no more
    time.sleep(0.05)
    assert taken == [0, 1]
    assert list(itertools.islice(items, 2)) == [1, 2]
    with pytest.raises(ApiException):
        next(items)

    stopped = read_ahead(iter(range(10)), "test")
    assert next(stopped) == 0
    stopped.close()  # the caller gives up: the thread ends instead of waiting to hand over the next
    eventually(lambda: any(t.name == "test" for t in threading.enumerate()), False)
