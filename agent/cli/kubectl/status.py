"""``kubectl nftpolicy status``: every node's agent, read through the API server.

The agents are the pods of the chart's DaemonSet (``--selector``; by default the chart's labels,
:data:`~nftpolicy.agent.cli.kubectl.AGENT_SELECTOR`); each is asked for ``/readyz`` and
``/metrics`` on its HTTP port (the container port named ``http``) through the API server's pod
proxy (``pods/proxy``), never by reaching a node's address. What the agent serves is :mod:`nftpolicy.agent.daemon.health` and :mod:`nftpolicy.agent.daemon.metrics`.

An agent with ``--metrics-secure`` (``NFTPOLICY_METRICS_SECURE=true`` in its pod, as the chart
sets it) serves HTTPS, and ``/metrics`` to a bearer token only, which the pod proxy never passes
on (the API server takes the caller's ``Authorization`` header off once it has authenticated
it): ``/readyz`` comes through the proxy (``https:``), the numbers from ``nftpolicy status`` run
in the agent's container (``pods/exec``), which reads them from the agent's debug endpoint.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, Mapping

from nftpolicy.agent.cli.agentstatus import AgentStatus, read_agent, table
from nftpolicy.agent.cli.flags import env_name
from . import api as kube
from .api import Api, Forbidden, PluginError
from .podexec import agent_debug_url, agent_env, run_in

HTTP_PORT_NAME = "http"
DEFAULT_HTTP_PORT = 9476  # the agent's --http-address default
WORKERS = 8  # agents asked at once
IN_POD_TIMEOUT = 10.0  # seconds for nftpolicy status in an agent's container
# The numbers of an AgentStatus, which ``nftpolicy status -o json`` in the agent's container gives.
NUMBERS = ("last_sync_seconds_ago", "generation", "chains", "sets", "elements", "drops", "version")


def http_port(pod: Mapping[str, Any]) -> int:
    """The agent container's port named ``http`` (the chart's), else :data:`DEFAULT_HTTP_PORT`."""
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == HTTP_PORT_NAME:
                return int(port["containerPort"])
    return DEFAULT_HTTP_PORT


def pod_problem(pod: Mapping[str, Any]) -> str | None:
    """Why the agent pod cannot answer (not running, no address, a container waiting), or None."""
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or ():
        waiting = (container.get("state") or {}).get("waiting")
        if waiting:
            return f"container {container.get('name')} waiting: {waiting.get('reason')}" + (f" ({waiting['message']})" if waiting.get("message") else "")
    if status.get("phase") != "Running":
        return f"pod {status.get('phase') or 'Pending'}" + (f": {status['reason']}" if status.get("reason") else "")
    if not status.get("podIP"):
        return "pod has no address yet"
    return None


def agent_status(api: Api, node: str, pod: Mapping[str, Any] | None, selector: str) -> AgentStatus:
    """Ask ``pod`` (the agent on ``node``, None: no pod matched ``selector`` there) through the
    pod proxy. Raises PluginError (refused)."""
    if pod is None:
        return AgentStatus(node, reasons=[f"no agent pod on this node (pods labelled {selector})"])
    meta = pod.get("metadata") or {}
    status = AgentStatus(node, pod=f"{meta.get('namespace')}/{meta.get('name')}")
    problem = pod_problem(pod)
    if problem:
        status.reasons = [problem]
        return status
    namespace, name, port = str(meta.get("namespace")), str(meta.get("name")), http_port(pod)
    secure = agent_env(pod).get(env_name("--metrics-secure"), "").lower() == "true"
    read_agent(lambda path: api.proxy_get(namespace, name, port, path, https=secure), status, time.time(), metrics=not secure)
    if secure:
        read_in_pod(api, pod, status)
    return status


def in_pod_argv(pod: Mapping[str, Any]) -> list[str] | None:
    """The ``nftpolicy status`` command line that reads the numbers in ``pod``'s agent
    container (from its debug endpoint), None when the agent has no debug endpoint."""
    url = agent_debug_url(pod)
    return ["nftpolicy", "status", "--agent", url, "--output", "json"] if url else None


def read_in_pod(api: Api, pod: Mapping[str, Any], status: AgentStatus) -> None:
    """Fill ``status``'s numbers from :func:`in_pod_argv` run in ``pod`` (``pods/exec``); what
    keeps them unknown is a reason."""
    argv = in_pod_argv(pod)
    if argv is None:
        status.reasons.append("/metrics is for bearer tokens only (--metrics-secure) and the agent has no --debug-address to read it in the pod")
        return
    try:
        code, out, err = run_in(api, pod, argv, IN_POD_TIMEOUT)
    except Forbidden as exc:
        status.reasons.append(f"/metrics is for bearer tokens only (--metrics-secure); to read it in the pod: {exc}")
        return
    except PluginError as exc:
        status.reasons.append(str(exc))
        return
    try:
        found = json.loads(out)
        for number in NUMBERS:
            setattr(status, number, found[number])
    except (ValueError, KeyError, TypeError):
        status.reasons.append(f"nftpolicy status in the pod (exit {code}): {' '.join((err or out).split())[:200]}")


def collect(api: Api, namespace: str | None, selector: str) -> list[AgentStatus]:
    """Every node's agent status, by node name (a node without an agent pod included)."""
    nodes = sorted(str((n.get("metadata") or {}).get("name")) for n in api.list_all(kube.NODES, "Node", "v1", api.core.list_node))
    agents: dict[str, dict[str, Any]] = {}
    for pod in api.pods(namespace, selector):
        node = (pod.get("spec") or {}).get("nodeName")
        if node and (node not in agents or pod_problem(agents[node]) is not None):  # a running one wins
            agents[node] = pod
    nodes += sorted(set(agents) - set(nodes))
    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(lambda node: agent_status(api, node, agents.get(node), selector), nodes))


def cmd_status(api: Api, args: argparse.Namespace) -> int:
    """Print every node's agent status; exit 0 when every one is ready, else 1. Raises PluginError."""
    statuses = collect(api, args.namespace, args.selector)
    if args.output == "json":
        print(json.dumps([asdict(s) for s in statuses], indent=2))
    else:
        print(table(statuses) if statuses else "no nodes")
    return 0 if statuses and all(s.ready for s in statuses) else 1
