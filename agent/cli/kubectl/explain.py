"""``kubectl nftpolicy explain SRC DST[:PORT/PROTO]``: ``nftpolicy explain`` on the live cluster.

The objects come from the API (one list each of pods, namespaces, nodes, NetworkPolicies and
ClusterNetworkPolicies, the latter at the version the API prefers, as the agent watches them:
:func:`~nftpolicy.agent.daemon.apiversions.served_version`; a cluster without the
ClusterNetworkPolicy CRD has none), and the
answer is :func:`nftpolicy.agent.cli.commands.explain.explain_objects`'s, the code path of
``nftpolicy explain`` on manifests: the same lines, JSON and exit codes.
"""

from __future__ import annotations

import argparse
from typing import Any

from kubernetes import client as k8s

from nftpolicy.translators.manifests import build_cluster

from nftpolicy.agent.daemon.apiversions import served_version
from nftpolicy.agent.cli.commands import Manifests, report_skipped
from nftpolicy.agent.cli.commands.explain import SERVICE_PREFIX, explain_objects, split_port
from . import api as kube
from .api import Api, PluginError

def cluster_objects(api: Api, service: str | None) -> list[tuple[str, Any]]:
    """Every Pod, Namespace, Node, NetworkPolicy and ClusterNetworkPolicy, and the Service
    ``service`` (``ns/name``) when given, as ``(origin, object)`` pairs. Raises PluginError
    (a Service that does not exist included)."""
    core, networking = api.core, k8s.NetworkingV1Api(api.client)
    objects = [
        *api.list_all(kube.PODS, "Pod", "v1", core.list_pod_for_all_namespaces),
        *api.list_all(kube.NAMESPACES, "Namespace", "v1", core.list_namespace),
        *api.list_all(kube.NODES, "Node", "v1", core.list_node),
        *api.list_all(kube.NETWORK_POLICIES, "NetworkPolicy", "networking.k8s.io/v1", networking.list_network_policy_for_all_namespaces),
    ]
    version = api.call("list", kube.CLUSTER_NETWORK_POLICIES, lambda _request_timeout: served_version(api.client, _request_timeout))
    if version is not None:  # None: no CRD, none
        objects += api.list_all(kube.CLUSTER_NETWORK_POLICIES, "ClusterNetworkPolicy", f"{kube.CLUSTER_NETWORK_POLICIES.group}/{version}",
                                k8s.CustomObjectsApi(api.client).list_cluster_custom_object, missing_ok=True,  # removed meanwhile: none
                                group=kube.CLUSTER_NETWORK_POLICIES.group, version=version, plural=kube.CLUSTER_NETWORK_POLICIES.plural)
    if service is not None:
        namespace, _, name = service.partition("/")
        found = api.get(kube.in_namespace(kube.SERVICES, namespace), "Service", "v1", core.read_namespaced_service, name, namespace)
        if found is None:
            raise PluginError(f"no Service {service}")
        objects.append(found)
    origin = f"the API server {api.server}"
    return [(origin, obj) for obj in objects]


def cmd_explain(api: Api, args: argparse.Namespace) -> int:
    """List the cluster, answer as ``nftpolicy explain`` (exit 0 allowed, 1 denied, 3 objects
    left out unless ``--accept-skipped``). Raises PluginError, UsageError."""
    if args.source.startswith(SERVICE_PREFIX):
        raise PluginError(f"{args.source}: a Service can only be the destination")
    destination, _ = split_port(args.destination)
    service = destination.removeprefix(SERVICE_PREFIX) if destination.startswith(SERVICE_PREFIX) else None
    if service is not None and (service.count("/") != 1 or not all(service.split("/"))):
        raise PluginError(f"{destination}: expected svc/NAMESPACE/NAME")
    objects = cluster_objects(api, service)
    cluster, invalid = build_cluster(objects)
    read = Manifests([api.server], cluster, objects, list(invalid))
    report_skipped(read.skipped, args.strict)
    return explain_objects(args, read)  # which reads DST[:PORT/PROTO] and svc/ as nftpolicy explain does
