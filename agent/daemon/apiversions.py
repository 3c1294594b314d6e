"""Which version of a resource the API serves, asked of its discovery: the agent's
ClusterNetworkPolicy source and the kubectl plugin list and watch the one it prefers.

network-policy-api v0.3.0's CRD serves ClusterNetworkPolicy at ``v1beta1`` (stored) and
``v1alpha2``, one schema (no conversion webhook); v0.2.0's at ``v1alpha2`` only. Discovery says
what is served now: ``GET /apis/<group>/<version>`` is the version's APIResourceList (404 when
the group does not serve that version), which kube-apiserver answers from memory and which every
authenticated user may read (the ``system:discovery`` ClusterRole of its default RBAC policy),
so the chart's ClusterRole needs nothing more. The resource list is read rather than the group's
``preferredVersion``, which speaks for the whole group (another CRD of the group may serve a
version that ClusterNetworkPolicy does not).
"""

from __future__ import annotations

from typing import Any

import orjson

from nftpolicy.translators.clusterpolicy import API_VERSIONS

from .kubeclient import client as k8s
from .kubeclient import request

CLUSTER_POLICY_GROUP = "policy.networking.k8s.io"
CLUSTER_POLICY_PLURAL = "clusternetworkpolicies"
# The versions of ClusterNetworkPolicy nftpolicy reads, the preferred first (v1beta1, v1alpha2).
CLUSTER_POLICY_VERSIONS = tuple(v.removeprefix(f"{CLUSTER_POLICY_GROUP}/") for v in API_VERSIONS)


def served_version(api: k8s.ApiClient, timeout: Any, group: str = CLUSTER_POLICY_GROUP, plural: str = CLUSTER_POLICY_PLURAL,
                   versions: tuple[str, ...] = CLUSTER_POLICY_VERSIONS) -> str | None:
    """The first of ``versions`` at which the API serves ``plural`` of ``group`` (its discovery
    document lists it), or None when it serves none of them (the CRD is not installed). One
    request per version tried, each with ``timeout`` (seconds, or a (connect, read) pair).
    Raises ``ApiException`` for an answer other than 2xx and 404, urllib3's errors when there is
    none, as :func:`~nftpolicy.agent.daemon.kubeclient.request` does."""
    for version in versions:
        try:
            response = request(api, "GET", f"/apis/{group}/{version}", timeout)
        except k8s.ApiException as exc:
            if exc.status == 404:
                continue
            raise
        body = orjson.loads(response.data)
        if any(isinstance(r, dict) and r.get("name") == plural for r in body.get("resources") or ()):
            return version
    return None
