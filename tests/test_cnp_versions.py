"""Both ClusterNetworkPolicy versions against the real kube-apiserver: the agent asks discovery
which versions are served and watches the one it prefers, v1beta1 where network-policy-api
v0.3.0's CRD serves it, v1alpha2 where only v0.2.0's is installed, and it switches when the CRD
is upgraded while it runs, without losing an object or a rule (real packets through ``nftpolicy
agent`` all along)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from nftpolicy.agent.daemon import sources
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.sources import KubeSource
from nftpolicy.agent.daemon.store import Store
from nftpolicy.agent.testbed.controlplane import CRD_MODULE, V1ALPHA2_CRD_MODULE, ApiError, ControlPlane

from .agentenv import AgentEnv, RealApi
from .conftest import clear_api, eventually
from .test_cnp_agent import SLOTS, A, cnp

pytestmark = pytest.mark.tools("etcd", "kube-apiserver")

GROUP = "policy.networking.k8s.io"


def at(version: str, obj: dict) -> dict:
    """``obj`` (a ClusterNetworkPolicy) under apiVersion ``policy.networking.k8s.io/<version>``."""
    return {**obj, "apiVersion": f"{GROUP}/{version}"}


@pytest.fixture
def collections(monkeypatch):
    """The paths of every list and watch the API source makes (``watch`` or ``list``, path)."""
    made: list[tuple[str, str]] = []
    real = sources.Collection

    class Recorded(real):  # type: ignore[misc, valid-type]
        def __call__(self, _request_timeout=None, **query):
            made.append(("watch" if query.get("watch") else "list", self.path))
            return super().__call__(_request_timeout, **query)

    monkeypatch.setattr(sources, "Collection", Recorded)
    return made


def watched(made: list[tuple[str, str]]) -> set[str]:
    return {path for verb, path in made if verb == "watch" and "/clusternetworkpolicies" in path}


def assert_watched_at(cp: ControlPlane, collections: list[tuple[str, str]], obj: dict, version: str) -> None:
    """An API source on ``cp`` gets ``obj`` (written now) through its watch, which is of
    ``version`` and no other."""
    stop = threading.Event()
    store = Store(Metrics())
    source = KubeSource(store, store.metrics, cp.kubeconfig, 5.0, 30, stop)
    source.start()
    try:
        eventually(store.listed)
        cp.apply(obj)
        eventually(lambda: obj["metadata"]["name"] in store.take()[0].cluster_policies)
        assert source.calls["ClusterNetworkPolicy"][0].version == version
        assert watched(collections) == {f"/apis/{GROUP}/{version}/clusternetworkpolicies"}
    finally:
        stop.set()
        clear_api(cp)


@pytest.mark.parametrize("written_at", ["v1beta1", "v1alpha2"])
def test_where_v1beta1_is_served_it_is_watched(control_plane, collections, written_at):
    """v0.3.0's CRD (the test bed's): v1beta1, whichever version an object is written at."""
    assert_watched_at(control_plane, collections, at(written_at, cnp("deny-y", "Deny")), "v1beta1")


@pytest.fixture(scope="module")
def old_control_plane():
    """kube-apiserver with network-policy-api v0.2.0's CRD: v1alpha2 only."""
    with ControlPlane(crd=V1ALPHA2_CRD_MODULE) as cp:
        yield cp


def test_where_only_v1alpha2_is_served_it_is_watched(old_control_plane, collections):
    with pytest.raises(ApiError, match="404"):
        old_control_plane.apply(at("v1beta1", cnp("not-served", "Deny")))
    assert_watched_at(old_control_plane, collections, cnp("deny-y", "Deny"), "v1alpha2")


def said(env: AgentEnv) -> list[str]:
    return [event["msg"] for event in map(json.loads, filter(lambda line: line.startswith("{"), env.log().splitlines()))]


@pytest.mark.kernel
def test_a_crd_upgrade_while_the_agent_runs_switches_without_losing_objects_or_rules(tmp_path, record_property):
    """v0.2.0's CRD, an Admin Deny of y into x/a and an Accept of x/c into x/a enforced by the
    agent; the CRD becomes v0.3.0's while y/d and x/c keep connecting: every probe meanwhile gets
    the same verdict, the agent's ClusterNetworkPolicy count never drops, it relists at v1beta1,
    and a change written at v1beta1 is enforced."""
    with ControlPlane(crd=V1ALPHA2_CRD_MODULE) as cp:
        env = AgentEnv(tmp_path, SLOTS, api=RealApi(cp)).put_slot_pods()
        try:
            cp.apply(cnp("deny-y", "Deny"))
            cp.apply(cnp("accept-c", "Accept", priority=0, from_ns="x"))
            env.start_agent()
            eventually(lambda: env.connects("y/d", A), False)
            assert env.connects("x/c", A)
            assert "ClusterNetworkPolicy: the API serves policy.networking.k8s.io/v1alpha2: listing and watching it" in said(env)
            counts, verdicts = [], []
            upgraded = time.monotonic()
            cp.install_crd(CRD_MODULE)
            switched = "ClusterNetworkPolicy: the API serves policy.networking.k8s.io/v1beta1: listing and watching it (was v1alpha2)"
            deadline = time.monotonic() + 30
            while switched not in said(env) and time.monotonic() < deadline:
                counts.append(env.metric("nftpolicy_watched_objects", kind="ClusterNetworkPolicy"))
                verdicts.append((env.connects("y/d", A), env.connects("x/c", A)))
            assert switched in said(env), said(env)[-5:]
            record_property("switched_within_s", round(time.monotonic() - upgraded, 1))  # polled between probes
            for _ in range(3):  # after the relist too
                counts.append(env.metric("nftpolicy_watched_objects", kind="ClusterNetworkPolicy"))
                verdicts.append((env.connects("y/d", A), env.connects("x/c", A)))
            assert set(counts) == {2.0} and set(verdicts) == {(False, True)}, (counts, verdicts)
            cp.apply(at("v1beta1", cnp("deny-y", "Accept")))
            eventually(lambda: env.connects("y/d", A))
        finally:
            env.close()
