"""One agent's status as ``nftpolicy status`` and ``kubectl nftpolicy status`` show it
(:class:`AgentStatus`), read from its ``/readyz`` and ``/metrics`` (:func:`read_agent`), however
they are reached (the debug endpoint in its container, the API server's pod proxy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families


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


def read_agent(get: Callable[[str], tuple[int, str]], status: AgentStatus, now: float, metrics: bool = True) -> None:
    """Fill ``status`` from the agent's ``/readyz`` and (with ``metrics``) ``/metrics``, as
    ``get(path)`` (``readyz``, ``metrics``) answers them: (HTTP status, body text)."""
    code, body = get("readyz")
    status.ready = code == 200
    if not status.ready:
        status.reasons = [line.strip() for line in body.splitlines() if line.strip()] or [f"/readyz answered {code}"]
    if not metrics:
        return
    code, body = get("metrics")
    if code == 200:
        try:
            read_metrics(body, status, now)
        except (ValueError, OverflowError) as exc:  # not Prometheus text, or NaN/Inf where a count belongs
            status.reasons.append(f"/metrics unreadable: {' '.join(str(exc).split())[:200]}")
    elif status.ready or code not in (502, 503):
        status.reasons.append(f"/metrics answered {code}: {' '.join(body.split())[:200]}")


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
