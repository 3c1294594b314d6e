#!/usr/bin/env python3
"""Benchmark: the agent as a DaemonSet on the real node (``.ci/e2e``), its figures in one table.

Usage (as root, after ``bash .ci/install --test``)::

    .venv/bin/python bench/real_node.py                       # runs bash .ci/e2e, then the table
    .venv/bin/python bench/real_node.py --report build/e2e/e2e-report.json   # the table of a run

One run of ``.ci/e2e`` (two real kubelets with containerd, the chart installed by Helm, the
upstream ``[sig-network] Netpol`` suite, the lifecycle with traffic) measures, side by side:

* ``helm install`` to every DaemonSet pod Ready (its own readiness probe: the first ruleset
  committed), and to the agent's table present on every node;
* the agent containers' CPU (cores, summed over the nodes, from ``cpuacct.usage``) and largest RSS
  (``total_rss`` of ``memory.stat``) at idle (20 s after the install) and during the suite, read
  from their cgroups; the ratios busy / idle and RSS / the chart's memory request and limit;
* the suite's duration and the whole run's wall time, against the 30-minute target.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
TARGET_MINUTES = 30.0


def mebibytes(quantity: str) -> float:
    """A Kubernetes memory quantity (``96Mi``, ``1Gi``) in MiB."""
    units = {"Ki": 1 / 1024, "Mi": 1.0, "Gi": 1024.0}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * factor
    return float(quantity) / 2**20


def table(report: dict) -> str:
    resources = yaml.safe_load((REPO / "charts" / "nftpolicy" / "values.yaml").read_text())["resources"]
    request, limit = mebibytes(resources["requests"]["memory"]), mebibytes(resources["limits"]["memory"])
    idle, busy = report.get("agent_idle", {}), report.get("agent_during_suite", {})
    install, suite = report.get("install", {}), report.get("suite", {})
    specs = [spec for spec in suite.get("specs", []) if spec["name"].startswith("[It]")]
    passed = sum(1 for spec in specs if spec["state"] == "passed")
    failed = sum(1 for spec in specs if spec["state"] == "failed")
    minutes = report.get("seconds", 0) / 60
    rows = [
        ("nodes", f"{report.get('nodes')}", ""),
        ("helm install -> DaemonSet Ready", f"{install.get('ready_seconds', '-')} s", ""),
        ("helm install -> table on every node", f"{install.get('table_seconds', '-')} s", ""),
        ("agent CPU at idle (all nodes)", f"{idle.get('cpu_cores', '-')} cores", ""),
        ("agent CPU during the suite", f"{busy.get('cpu_cores', '-')} cores",
         f"{busy['cpu_cores'] / idle['cpu_cores']:.1f}x idle" if idle.get("cpu_cores") and busy.get("cpu_cores") else ""),
        ("agent RSS at idle (largest pod)", f"{idle.get('max_rss_mib', '-')} MiB",
         f"{idle['max_rss_mib'] / request:.2f}x request {request:.0f}Mi" if idle.get("max_rss_mib") else ""),
        ("agent RSS during the suite", f"{busy.get('max_rss_mib', '-')} MiB",
         f"{busy['max_rss_mib'] / limit:.2f}x limit {limit:.0f}Mi" if busy.get("max_rss_mib") else ""),
        ("upstream Netpol specs", f"{passed} passed, {failed} failed", f"in {suite.get('seconds', 0) / 60:.1f} min"),
        (".ci/e2e wall time", f"{minutes:.1f} min", f"{minutes / TARGET_MINUTES:.2f}x the {TARGET_MINUTES:.0f} min target"),
    ]
    width = max(len(name) for name, _, _ in rows)
    return "\n".join(f"{name:<{width}}  {value:>18}  {ratio}" for name, value, ratio in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, help="print the table of this e2e-report.json instead of running")
    parser.add_argument("--report-dir", type=Path, default=REPO / "build" / "bench-real-node")
    args = parser.parse_args()
    path = args.report
    if path is None:
        result = subprocess.run(["bash", str(REPO / ".ci" / "e2e"), "--report-dir", str(args.report_dir)], check=False)
        path = args.report_dir / "e2e-report.json"
        if not path.exists():
            print(f"bench: .ci/e2e wrote no report (exit {result.returncode})", file=sys.stderr)
            return 1
    print(table(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
