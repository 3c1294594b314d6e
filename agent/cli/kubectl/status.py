"""``kubectl nftpolicy status``: every node's agent, read through the API server.

The agents are the pods of the chart's DaemonSet (``--selector``; by default the chart's labels,
:data:`~nftpolicy.agent.cli.kubectl.AGENT_SELECTOR`); each is asked for ``/readyz`` and
``/metrics`` on its HTTP port (the container port named ``http``) through the API server's pod
proxy (``pods/proxy``), never by reaching a node's address. What the agent serves is :mod:`nftpolicy.agent.daemon.health` and :mod:`nftpolicy.agent.daemon.metrics`.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from prometheus_client.parser import text_string_to_metric_families

from . import api as kube
from .api import Api

AGENT_CONTAINER = "agent"
HTTP_PORT_NAME = "http"
DEFAULT_HTTP_PORT = 9476  # the agent's --http-address default
WORKERS = 8  # agents asked at once


@dataclass
class AgentStatus:
    """One node's agent: its pod (``ns/name``, None: no agent pod on the node), whether it is
    ready and why not, and from its metrics: seconds since the last committed sync, the table
    generation (transactions committed since it started), chains, sets and set elements in its
    table, packets dropped (rejected because no policy allowed them, since the counters were
    last reset: each full resync rewrites the chains) and its version. A number the agent did
    not serve is None."""

    node: str
    pod: str | None = None
    ready: bool = False
    reasons: list[str] = field(default_factory=list)
    last_sync_seconds_ago: float | None = None
    generation: int | None = None
    chains: int | None = None
    sets: int | None = None
    elements: int | None = None
    drops: int | None = None
    version: str | None = None


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


def read_metrics(text: str, status: AgentStatus, now: float) -> None:
    """Fill ``status``'s numbers from the agent's ``/metrics`` text."""
    drops = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "nftpolicy_last_successful_sync_timestamp_seconds" and value > 0:
                status.last_sync_seconds_ago = round(max(0.0, now - value), 1)
            elif name == "nftpolicy_table_generation":
                status.generation = int(value)
            elif name == "nftpolicy_table_objects":
                kind = labels.get("type", "")
                if kind.endswith("chains"):
                    status.chains = (status.chains or 0) + int(value)
                elif kind == "sets":
                    status.sets = int(value)
                elif kind == "elements":
                    status.elements = int(value)
            elif name in ("nftpolicy_denied_packets_total", "nftpolicy_cluster_denied_packets_total"):
                drops += value
            elif name == "nftpolicy_build_info":
                status.version = labels.get("version")
    status.drops = int(drops)


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
    code, body = api.proxy_get(namespace, name, port, "readyz")
    status.ready = code == 200
    if not status.ready:
        status.reasons = [line.strip() for line in body.splitlines() if line.strip()] or [f"/readyz answered {code}"]
    code, body = api.proxy_get(namespace, name, port, "metrics")
    if code == 200:
        try:
            read_metrics(body, status, time.time())
        except (ValueError, OverflowError) as exc:  # not Prometheus text, or NaN/Inf where a count belongs
            status.reasons.append(f"/metrics unreadable: {' '.join(str(exc).split())[:200]}")
    elif status.ready or code not in (502, 503):
        status.reasons.append(f"/metrics answered {code}: {' '.join(body.split())[:200]}")
    return status


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


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def _number(value: int | None) -> str:
    return "-" if value is None else str(value)


def table(statuses: list[AgentStatus]) -> str:
    """The statuses as a table, then one line per reason of an agent that is not ready."""
    header = ("NODE", "AGENT", "READY", "LAST SYNC", "GENERATION", "CHAINS", "SETS", "DROPS", "VERSION")
    rows = [header] + [(s.node, s.pod or "-", "yes" if s.ready else "no", _ago(s.last_sync_seconds_ago), _number(s.generation),
                        _number(s.chains), _number(s.sets), _number(s.drops), s.version or "-") for s in statuses]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines += [f"{s.node}: {reason}" for s in statuses for reason in s.reasons]
    return "\n".join(lines)


def cmd_status(api: Api, args: argparse.Namespace) -> int:
    """Print every node's agent status; exit 0 when every one is ready, else 1. Raises PluginError."""
    statuses = collect(api, args.namespace, args.selector)
    if args.output == "json":
        print(json.dumps([asdict(s) for s in statuses], indent=2))
    else:
        print(table(statuses) if statuses else "no nodes")
    return 0 if statuses and all(s.ready for s in statuses) else 1
