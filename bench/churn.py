#!/usr/bin/env python3
"""Churn at 150,000 pods: does a real ``nftpolicy agent`` keep up with pods coming and going?

Usage (as root)::

    .venv/bin/python bench/churn.py                              # this tree's agent, 150k pods, 60 s
    .venv/bin/python bench/churn.py --baseline /work/main        # and another tree's agent, side by side
    .venv/bin/python bench/churn.py --size 10k --duration 20

The synthetic cluster (``synthetic.py``, as ``scale.py`` builds it) is served by the in-repo fake
API server in this process; each agent is a real ``nftpolicy agent`` process (the tree's own
``.venv/bin/nftpolicy``) listing and watching it and committing through libnftables into a
network namespace made here. Once it is ready, this script writes, for ``--duration`` seconds,
``--rate`` pod creates and as many deletes per second (a new pod copies a random pod's namespace,
labels, node and ports, with a fresh address; a delete takes a random pod of the original
cluster) and ``--label-rate`` pod label changes per second (a pod's ``app`` label takes another
app of its namespace, as in ``scale.py``). It prints, per agent, side by side:

* event to kernel, as the agent measures it: one figure per sync, from the oldest change it
  carries reaching the agent's store to the end of the commit (so the worst event of each sync),
  read exactly from each sync's JSON log line (``event_to_kernel_ms``): p50 and p99 overall and
  per 10 s window (a growing backlog shows as a growing window p99). An agent whose log lines
  lack the field (a tree before it) is read from its ``nftpolicy_event_to_kernel_seconds``
  histogram instead, as bucket bounds (``<=``);
* where that time goes, p50 and p99 over the syncs: waiting (the minimum sync interval, a sync
  under way), render (the renderer and the transaction) and commit (libnftables and the kernel),
  and the sync thread's CPU per sync;
* syncs, the agent's CPU seconds over the churn and the catch-up and its CPU per event
  (milliseconds), and the catch-up: from the last write to the end of the last sync that
  carried a write (watched in the log, not by polling ``/metrics``, whose every scrape lists
  the whole table: the bench reads ``/metrics`` once per window, a Prometheus' pace);
* resident memory after the first sync and after the churn and the catch-up.

The load average is printed with the figures: the machine may be shared.

Safety: every nft command runs in the ``nftp-b<tag>-*`` network namespaces this script creates,
deleted in a ``finally`` (also on Ctrl-C and SIGTERM); each agent is stopped by its pid.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import synthetic  # noqa: E402
from scale import SIZES, pod_changes, serve  # noqa: E402

from nftpolicy.agent.dataplane import netns  # noqa: E402
from nftpolicy.translators.model import Cluster  # noqa: E402

WINDOW = 10.0  # seconds per latency window
TICKS = 100  # writes are spread over this many ticks a second
FRESH = ipaddress.IPv4Network("100.64.0.0/10")  # addresses of the created pods: no synthetic pod has one


def metrics(port: int) -> dict[str, float]:
    """The agent's Prometheus samples (name with labels -> value)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))}


def histogram(samples: dict[str, float], name: str) -> dict[float, float]:
    """A histogram's cumulative buckets, upper bound (seconds) -> count."""
    prefix = f'{name}_bucket{{le="'
    return {float(k[len(prefix):-2]): v for k, v in samples.items() if k.startswith(prefix)}


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` of the observations between two
    readings of a histogram (inf: beyond the last bound; nan: no observation)."""
    counts = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = counts.get(float("inf"), 0.0)
    if not total:
        return float("nan")
    return next(le for le, n in counts.items() if n >= q * total)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, one of them (nearest rank; nan when there is none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


def sync_lines(log: Path, start: int, end: int | None = None) -> list[dict[str, Any]]:
    """The incremental syncs' JSON log lines the agent wrote between byte offsets ``start`` and
    ``end`` (None: the end) of its log ``log``."""
    with log.open("rb") as f:
        f.seek(start)
        text = f.read(-1 if end is None else end - start)
    lines = (json.loads(line) for line in text.splitlines() if line.startswith(b"{"))
    return [line for line in lines if line.get("mode") == "incremental" and "duration_ms" in line]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) / 1024


def wait_ready(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 600) -> None:
    """Until the agent process ``proc`` answers 200 on ``url``/readyz; RuntimeError naming
    ``what`` when it ends first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if urllib.request.urlopen(f"{url}/readyz", timeout=5).status == 200:
                return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{what} did not become ready") from None
            time.sleep(0.2)


def churn(cluster: Cluster, tree: Path, ns: str, args: argparse.Namespace) -> dict[str, Any]:
    """One agent of ``tree`` against a fresh fake API server holding ``cluster``, through the churn."""
    api = serve(cluster)
    port = 19600 + secrets.randbelow(300)
    kubeconfig = api.kubeconfig(tempfile.mktemp(suffix=".json"))
    log = Path(tempfile.mktemp(suffix=".log"))
    proc = subprocess.Popen([str(tree / ".venv" / "bin" / "nftpolicy"), "agent", "--kubeconfig", kubeconfig, "--node", synthetic.NODE,
                             "--netns", ns, "--http-address", f"127.0.0.1:{port}", "--api-timeout", "60", "--log-format", "json",
                             "--min-sync-interval", str(args.min_sync_interval)], stderr=log.open("wb"))
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, f"the agent of {tree}")
        time.sleep(2)
        figures: dict[str, Any] = {"rss_ready_mib": rss_mib(proc.pid)}
        rng = random.Random(args.seed)
        originals = list(cluster.pods)
        rng.shuffle(originals)
        deleted: set[str] = set()
        templates = [p for p in cluster.pods.values() if p.enforceable and not p.host_network]
        labels = pod_changes(cluster, int(args.label_rate * args.duration) + 1, rng)
        addresses = FRESH.hosts()
        per_tick = args.rate / TICKS, args.label_rate / TICKS
        owed = [0.0, 0.0]
        events = 0
        windows: list[tuple[float, dict[float, float], int]] = []  # (seconds since the start, histogram, log offset) at each window's end
        name = "nftpolicy_event_to_kernel_seconds"
        start_hist, start_cpu = histogram(metrics(port), name), cpu_seconds(proc.pid)
        start_offset = log.stat().st_size
        started = time.monotonic()
        next_window, next_compact, tick = started + WINDOW, started + 2.0, 0
        while (now := time.monotonic()) < started + args.duration:
            owed[0] += per_tick[0]
            owed[1] += per_tick[1]
            while owed[0] >= 1:
                owed[0] -= 1
                template = rng.choice(templates)
                new = dataclasses.replace(template, name=f"churn-{events}", ips=(str(next(addresses)),))
                api.put(synthetic.pod_object(new))
                gone = cluster.pods[originals.pop()]
                deleted.add(gone.key)
                api.delete("Pod", gone.name, gone.namespace)
                events += 2
            while owed[1] >= 1 and labels:
                owed[1] -= 1
                key, new_labels = labels.pop()
                pod = cluster.pods[key]
                if key not in deleted:
                    api.put(synthetic.pod_object(dataclasses.replace(pod, labels=new_labels)))
                    events += 1
            if now >= next_compact:  # the watches are past it: keep the fake server's history short
                api.compact()
                next_compact = now + 2.0
            if now >= next_window:
                windows.append((now - started, histogram(metrics(port), name), log.stat().st_size))
                next_window += WINDOW
            tick += 1
            time.sleep(max(0.0, started + tick / TICKS - time.monotonic()))
        ended = time.monotonic()
        # caught up: the last sync that carried a write (no sync line for a second after it),
        # watched in the agent's log: a /metrics scrape lists the whole table, which costs the
        # agent CPU and memory (the windows' six scrapes are a Prometheus' pace; a poll is not)
        size, changed_at = log.stat().st_size, time.monotonic()
        while time.monotonic() < changed_at + 1.0 and time.monotonic() < ended + 60:
            time.sleep(0.02)
            if (now_size := log.stat().st_size) != size:
                size, changed_at = now_size, time.monotonic()
        caught_up = max(0.0, changed_at - ended)
        cpu, rss_after = cpu_seconds(proc.pid) - start_cpu, rss_mib(proc.pid)
        hist = histogram(metrics(port), name)
        syncs = sync_lines(log, start_offset)
        figures.update(events=events, seconds=ended - started, syncs=len(syncs), cpu_s=cpu, cpu_per_event_ms=cpu / max(1, events) * 1000,
                       caught_up_s=caught_up, rss_after_mib=rss_after)
        if syncs and "event_to_kernel_ms" in syncs[0]:  # exact, from each sync's log line
            figures["exact"] = True
            for field in ("event_to_kernel_ms", "waited_ms", "render_ms", "commit_ms", "cpu_ms"):
                values = [line[field] for line in syncs if field in line]
                figures[f"{field}_p50"], figures[f"{field}_p99"] = percentile(values, 0.5), percentile(values, 0.99)
            bounds = [start_offset, *(offset for _, _, offset in windows)]
            figures["windows"] = [(round(t), percentile([line["event_to_kernel_ms"] for line in sync_lines(log, a, b)
                                                         if "event_to_kernel_ms" in line], 0.99))
                                  for (t, _, _), a, b in zip(windows, bounds, bounds[1:])]
        else:  # an agent before the log line's fields: the histogram's bucket bounds
            figures["exact"] = False
            figures["event_to_kernel_ms_p50"] = quantile(start_hist, hist, 0.5) * 1000
            figures["event_to_kernel_ms_p99"] = quantile(start_hist, hist, 0.99) * 1000
            hists = [start_hist, *(h for _, h, _ in windows)]
            figures["windows"] = [(round(t), quantile(a, b, 0.99) * 1000) for (t, _, _), a, b in zip(windows, hists, hists[1:])]
        return figures
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        api.stop()
        log.unlink(missing_ok=True)


ROWS = [
    ("agent RSS after the first sync (MiB)", "rss_ready_mib", "{:.0f}"),
    ("events written (creates + deletes + label changes)", "events", "{:,}"),
    ("  over (s)", "seconds", "{:.1f}"),
    ("incremental syncs (their log lines)", "syncs", "{:,.0f}"),
    ("event to kernel p50 (ms, per sync: its oldest event)", "event_to_kernel_ms_p50", "{:.1f}"),
    ("event to kernel p99 (ms; target 100)", "event_to_kernel_ms_p99", "{:.1f}"),
    ("  of which waiting p50 / p99 (ms)", "waited_ms", "{:.1f} / {:.1f}"),
    ("  render p50 / p99 (ms)", "render_ms", "{:.1f} / {:.1f}"),
    ("  commit (libnftables) p50 / p99 (ms)", "commit_ms", "{:.1f} / {:.1f}"),
    ("sync thread CPU per sync p50 / p99 (ms)", "cpu_ms", "{:.1f} / {:.1f}"),
    ("agent CPU over the churn (s)", "cpu_s", "{:.1f}"),
    ("agent CPU per event (ms)", "cpu_per_event_ms", "{:.2f}"),
    ("last sync carrying a write, after the last write (s)", "caught_up_s", "{:.2f}"),
    ("agent RSS after the churn (MiB)", "rss_after_mib", "{:.0f}"),
]


def cell(figures: dict[str, Any], key: str, fmt: str) -> str:
    """One tree's figure of a row: ``key``'s value, or its p50 and p99 (``fmt`` with two
    fields); ``-`` where the agent did not log it; a histogram's bucket bound as ``<= x``."""
    if fmt.count("{") == 2:
        return fmt.format(figures[f"{key}_p50"], figures[f"{key}_p99"]) if f"{key}_p50" in figures else "-"
    text = fmt.format(figures[key])
    return text if figures.get("exact", True) or not key.startswith("event_to_kernel") else f"<= {figures[key]:g}"


def run_namespaces(kind: str, count: int) -> list[str]:
    """The names of ``count`` network namespaces for this run (``nftp-b<tag>-<kind><i>``, the
    tag set as this process's run tag, :data:`netns.RUN_TAG_ENV`), which the caller creates and
    deletes in a ``finally``; SIGTERM from now on exits through those (exit 143)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tag = f"b{secrets.token_hex(2)}"
    os.environ[netns.RUN_TAG_ENV] = tag
    return [f"nftp-{tag}-{kind}{i}" for i in range(count)]


def machine() -> str:
    """``2 CPUs, load average 1.2 0.8 0.5``: what the figures beside it were measured on."""
    return f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"


def side_by_side(results: dict[str, dict[str, Any]], rows: list[tuple[str, Any, str]], cell: Callable[[dict[str, Any], Any, str], str],
                 width: int, column: int) -> None:
    """Print a header of the trees' names (``results``' keys), then each of ``rows`` (label, key,
    format) whose ``cell`` is not ``-`` for every tree: its label in ``width`` characters, each
    tree's cell right-aligned in ``column``."""
    print("".ljust(width) + "".join(f"{Path(t).name:>{column}}" for t in results))
    for label, key, fmt in rows:
        cells = [cell(r, key, fmt) for r in results.values()]
        if any(c != "-" for c in cells):
            print(label.ljust(width) + "".join(f"{c:>{column}}" for c in cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="150k", choices=list(SIZES))
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of churn (default %(default)s)")
    parser.add_argument("--rate", type=float, default=100.0, help="pod creates per second, and as many deletes (default %(default)s)")
    parser.add_argument("--label-rate", type=float, default=20.0, help="pod label changes per second (default %(default)s)")
    parser.add_argument("--min-sync-interval", type=float, default=0.05, help="the agents' --min-sync-interval (default %(default)s)")
    parser.add_argument("--baseline", type=Path, action="append", default=[], help="another tree whose agent runs first (repeatable)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    trees = [*args.baseline, ROOT]
    names = run_namespaces("churn", len(trees))
    pods, policies, namespaces = SIZES[args.size]
    cluster = synthetic.generate(pods=pods, policies=policies, namespaces=namespaces, seed=args.seed).cluster
    results = {}
    try:
        netns.create(names)
        for tree, ns in zip(trees, names):
            print(f"[{tree}] churn ...", file=sys.stderr, flush=True)
            results[str(tree)] = churn(cluster, tree, ns, args)
    finally:
        netns.delete(names)
    width = 54
    print(f"churn at {args.size} pods: {args.rate:g} creates + {args.rate:g} deletes + {args.label_rate:g} label changes per second "
          f"for {args.duration:g} s, --min-sync-interval {args.min_sync_interval:g} ({machine()})")
    side_by_side(results, ROWS, cell, width, 18)
    if len(results) > 1:
        first, last = list(results.values())[0], list(results.values())[-1]
        for label, key in (("CPU per event, ratio to the first", "cpu_per_event_ms"), ("RSS after the first sync, ratio", "rss_ready_mib")):
            print(label.ljust(width) + f"{last[key] / first[key]:>18.2f}")
    for tree, r in results.items():
        bound = "" if r["exact"] else "<= "
        print(f"{Path(tree).name}: event to kernel p99 per {WINDOW:g} s window (ms): "
              + ", ".join(f"{t}s {bound}{p:.1f}" for t, p in r["windows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
