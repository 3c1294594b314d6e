#!/usr/bin/env python3
"""Benchmark at Kubernetes' size limits: render, commit, sizes, memory and event-to-kernel latency.

Usage (as root)::

    .venv/bin/python bench/scale.py                       # 1k, 10k, 50k and 150k pods, then growth
    .venv/bin/python bench/scale.py --sizes 1k,10k --no-growth

For each size (synthetic clusters, ``synthetic.py``: realistic selector mix, many policies sharing
namespace selectors, broad ipBlocks; 110 pods on ``node-0``, the node rendered) it prints, side
by side in one run:

* ``render``: the ``nftpolicy render --format json`` command on a JSON dump of the cluster (a
  subprocess: reading, validating, rendering, printing), wall and CPU time and peak RSS, beside
  the stdlib's ``json.load`` of the same file (a subprocess too) and their ratio (best of 2
  alternating rounds each; ``--render-only``: only these);
* the agent, fed by the in-repo fake API server through the real API source (official client,
  list in pages of 500 + watch, as against kube-apiserver) and committing through libnftables
  in a network namespace made here: a full sync
  (render + one transaction, median of 3) and its commit alone; event-to-kernel latency, from
  the API write to the end of the sync that committed it, of pod label changes and of namespace
  label changes (p50 / p99), and the agent's own part (from the change reaching its store to the
  end of the commit: the fake API server runs in this process, so its watch delivery competes
  with the agent for the interpreter); the resident memory of a real ``nftpolicy agent`` process
  after its first sync;
* set elements against the elements of the distinct peers (sets with the same contents counted
  once), and their ratio;
* the iptables variant: render (``iptables-restore`` and ``ipset restore`` text) and load
  (``ipset restore`` + ``iptables-nft-restore`` in a namespace made here); it has no incremental
  path, so each change costs this much.

Then the growth check: from 10,000 pods / 1,000 policies / 110 local pods, double each in turn
and print the ratio of each figure (render from scratch, set elements, the incremental cost of a
pod label change): none may grow with pods x policies.

Targets (issues "React to a change in O(change)" and 19: namespace label change p99 <= 15 ms, agent
RSS <= 160 MiB at 150k, render within 1.0x json.load and its peak RSS <= 400 MiB) are printed
beside their figures.

Safety: every nft, iptables and ipset command runs inside the ``nftp-b<tag>-*`` network
namespaces this script creates, deleted in a ``finally`` (also on Ctrl-C and SIGTERM).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import synthetic  # noqa: E402

from nftpolicy.agent.dataplane import iptables  # noqa: E402

from nftpolicy.agent.dataplane import netns  # noqa: E402
from nftpolicy.agent.daemon.health import Health  # noqa: E402
from nftpolicy.agent.daemon.memory import gc_paused  # noqa: E402
from nftpolicy.agent.daemon.metrics import Metrics  # noqa: E402
from nftpolicy.agent.dataplane.nftables import NftDataplane  # noqa: E402
from nftpolicy.agent.daemon.reconcile import Reconciler  # noqa: E402
from nftpolicy.agent.daemon.sources import KubeSource  # noqa: E402
from nftpolicy.agent.daemon.store import Store  # noqa: E402
from nftpolicy.translators import iptables as iptables_render  # noqa: E402
from nftpolicy.translators import nft, transaction  # noqa: E402
from nftpolicy.translators.delta import delta_transaction  # noqa: E402
from nftpolicy.translators.model import Cluster, Namespace  # noqa: E402
from nftpolicy.translators.noderender import NodeRenderer  # noqa: E402
from nftpolicy.translators.rules import Config, RuleModel  # noqa: E402
from nftpolicy.translators.transaction import Transaction  # noqa: E402
from tests.fakeapi import FakeApiServer  # noqa: E402

NODE = synthetic.NODE
NFTPOLICY = str(ROOT / ".venv" / "bin" / "nftpolicy")
SIZES = {  # name: pods, policies, namespaces
    "1k": (1000, 100, 50),
    "10k": (10000, 1000, 100),
    "50k": (50000, 5000, 500),
    "150k": (150000, 10000, 1500),
}
TARGETS = {"pod_p99_ms": {"10k": 30.0, "150k": 50.0}, "ns_p99_ms": {"150k": 15.0}, "full_sync_s": {"150k": 2.0},
           "rss_mib": {"150k": 160.0}, "render_s": {"150k": 4.0}, "element_ratio": 1.2,
           "render_rss_mib": {"150k": 400.0}, "render_load_ratio": {"150k": 1.0}}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# ---- the cluster as API objects ------------------------------------------------------------------

def serve(cluster: Cluster) -> FakeApiServer:
    """The fake API server holding ``cluster`` (and this node)."""
    api = FakeApiServer(bookmark_interval=30)
    api.start()
    for obj in synthetic.api_objects(cluster):
        api.put(obj)
    api.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}, "spec": {}, "status": {}})
    api.compact()
    return api


def pod_changes(cluster: Cluster, count: int, rng: random.Random) -> list[tuple[str, dict[str, str]]]:
    """``count`` (pod, new labels) edits: the ``app`` label of a running pod takes the value of
    another app of its namespace, so the pod moves between selector sets."""
    running = [p for p in cluster.pods.values() if p.enforceable and "app" in p.labels]
    apps: dict[str, set[str]] = {}
    for p in running:
        apps.setdefault(p.namespace, set()).add(p.labels["app"])
    edits = []
    while len(edits) < count:
        pod = rng.choice(running)
        choices = sorted(apps[pod.namespace] - {pod.labels["app"]})
        if choices:
            edits.append((pod.key, {**pod.labels, "app": rng.choice(choices)}))
    return edits


def namespace_changes(cluster: Cluster, count: int, rng: random.Random) -> list[tuple[str, dict[str, str]]]:
    """``count`` (namespace, new labels) edits: an application namespace moves to another team,
    so namespaceSelectors on ``team`` start or stop matching it."""
    teams = sorted({ns.labels.get("team") for ns in cluster.namespaces.values() if ns.labels.get("team") not in (None, "platform")})
    names = sorted(n for n, ns in cluster.namespaces.items() if ns.labels.get("team") in teams)
    edits = []
    for _ in range(count):
        name = rng.choice(names)
        edits.append((name, {**cluster.namespaces[name].labels, "team": rng.choice(teams)}))
    return edits


# ---- figures ------------------------------------------------------------------------------------

def render_command(cluster: Cluster, workdir: Path, rounds: int = 2) -> dict[str, float]:
    """``nftpolicy render --format json`` on a JSON dump: wall and CPU seconds and peak RSS (MiB),
    beside the stdlib's ``json.load`` of the same file in a Python process (its own, garbage
    collector running: what reading the dump costs any Python tool). The two alternate for
    ``rounds`` rounds; each figure is its best round (the machine is shared)."""
    dump = workdir / "cluster.json"
    with dump.open("w") as out:
        out.write(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(synthetic.api_objects(cluster))}))
        out.flush()
        os.fsync(out.fileno())  # the dump's writeback is this bench's setup, not the render's time
    commands = {"render": [NFTPOLICY, "render", "--node", NODE, "--format", "json", str(dump)],
                "json_load": [sys.executable, "-c", "import json, sys; json.load(open(sys.argv[1]))", str(dump)]}
    figures: dict[str, float] = {}
    for _ in range(rounds):
        for name, command in commands.items():
            started = time.monotonic()
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            peak_kib = 0
            while True:  # the child's own high-water mark: its ru_maxrss counts this big process, forked
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                try:
                    status_text = Path(f"/proc/{proc.pid}/status").read_text()
                    peak_kib = max(peak_kib, int(next(line.split()[1] for line in status_text.splitlines() if line.startswith("VmHWM"))))
                except (OSError, StopIteration):  # exiting
                    pass
                time.sleep(0.02)
            if os.waitstatus_to_exitcode(status) != 0:
                raise RuntimeError(f"{command[:2]} exited {os.waitstatus_to_exitcode(status)}")
            for key, value in ((f"{name}_s", time.monotonic() - started), (f"{name}_cpu_s", usage.ru_utime + usage.ru_stime),
                               (f"{name}_rss_mib", peak_kib / 1024)):
                figures[key] = min(figures.get(key, value), value)
    figures["render_load_ratio"] = figures["render_s"] / figures["json_load_s"]
    figures["render_load_cpu_ratio"] = figures["render_cpu_s"] / figures["json_load_cpu_s"]
    return figures


def sizes_of(model: RuleModel) -> dict[str, int]:
    """Set elements, and the elements of the distinct peers (sets of equal contents once)."""
    distinct = {(s.family, s.kind, s.elements) for s in model.sets}
    return {"elements": sum(len(s.elements) for s in model.sets), "distinct_elements": sum(len(e) for _, _, e in distinct),
            "sets": len(model.sets), "policy_chains": len(model.policy_chains), "pod_chains": len(model.pod_chains)}


def agent(api: FakeApiServer, cluster: Cluster, ns: str, pod_edits: int, ns_edits: int, seed: int) -> dict[str, Any]:
    """The real API source and reconcile loop, in this process, committing in ``ns``."""
    stop = threading.Event()
    metrics, health = Metrics(), Health(window=60)
    store = Store(metrics)
    kubeconfig = api.kubeconfig(tempfile.mktemp(suffix=".json"))
    KubeSource(store, metrics, kubeconfig, 30.0, 3600, stop).start()
    commits: list[float] = []

    class TimedDataplane(NftDataplane):
        def run(self, tx: Transaction) -> None:
            started = time.monotonic()
            super().run(tx)
            commits.append(time.monotonic() - started)

    reconciler = Reconciler(store, Config(), NODE, metrics, health, 0.0, 3600.0, TimedDataplane(Config().table, ns))
    try:
        while not store.listed():
            time.sleep(0.01)
        full = []
        for _ in range(3):
            started = time.monotonic()
            assert reconciler.sync(full=True)
            full.append(time.monotonic() - started)
        figures: dict[str, Any] = {"full_sync_s": statistics.median(full), "commit_s": statistics.median(commits[-3:])}
        assert reconciler.renderer is not None
        figures.update(sizes_of(reconciler.renderer.model()))
        rng = random.Random(seed)
        pods, namespaces = dict(cluster.pods), dict(cluster.namespaces)

        syncs: list[float] = []

        def timed(write: Callable[[], None], arrived: Callable[[], bool]) -> float:
            started = time.monotonic()
            write()
            while not arrived():
                time.sleep(0.0002)
            received = time.monotonic()
            assert reconciler.sync(full=False)
            syncs.append((time.monotonic() - received) * 1000)
            return (time.monotonic() - started) * 1000

        pod_ms = []
        for key, labels in pod_changes(cluster, pod_edits, rng):
            pods[key] = dataclasses.replace(pods[key], labels=labels)
            obj = synthetic.pod_object(pods[key])
            pod_ms.append(timed(lambda: api.put(obj), lambda: dict(store.get("Pod", key).labels) == labels))  # noqa: B023
        ns_ms = []
        for name, labels in namespace_changes(cluster, ns_edits, rng):
            namespaces[name] = Namespace(name, labels)
            obj = synthetic.namespace_object(namespaces[name])
            ns_ms.append(timed(lambda: api.put(obj), lambda: dict(store.get("Namespace", name).labels) == labels))  # noqa: B023
        pod_syncs = syncs[:len(pod_ms)]
        figures.update(pod_p50_ms=percentile(pod_ms, 0.5), pod_p99_ms=percentile(pod_ms, 0.99),
                       pod_sync_p99_ms=percentile(pod_syncs, 0.99),
                       ns_p50_ms=percentile(ns_ms, 0.5), ns_p99_ms=percentile(ns_ms, 0.99),
                       ns_sync_p99_ms=percentile(syncs[len(pod_ms):], 0.99))
        return figures
    finally:
        stop.set()


def agent_rss(api: FakeApiServer, ns: str) -> float:
    """Resident memory (MiB) of a real ``nftpolicy agent`` after its first sync."""
    port = 19600 + secrets.randbelow(300)
    kubeconfig = api.kubeconfig(tempfile.mktemp(suffix=".json"))
    proc = subprocess.Popen([NFTPOLICY, "agent", "--kubeconfig", kubeconfig, "--node", NODE, "--netns", ns,
                             "--http-address", f"127.0.0.1:{port}", "--api-timeout", "60"], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        else:
            raise RuntimeError("the agent did not become ready within 300 s")
        time.sleep(1)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) / 1024
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def iptables_variant(cluster: Cluster, ns: str) -> dict[str, Any]:
    """Render and load of the iptables variant (the whole table, as each change costs)."""
    started = time.monotonic()
    model = NodeRenderer(NODE).load(cluster).model()
    dataplane = iptables.IptablesDataplane(ns, "nft", ("ipv4",))
    batch = dataplane.batch(transaction.full(model))
    rendered = time.monotonic() - started
    started = time.monotonic()
    dataplane.load(batch)
    return {"ipt_render_s": rendered, "ipt_load_s": time.monotonic() - started,
            "ipt_elements": sum(len(iptables_render.ipset_elements(s)) for s in model.sets if s.family == "ipv4")}


def measure(name: str, args: argparse.Namespace, namespaces: list[str], workdir: Path) -> dict[str, Any]:
    pods, policies, nss = SIZES[name]
    started = time.monotonic()
    cluster = synthetic.generate(pods=pods, policies=policies, namespaces=nss, seed=args.seed).cluster
    print(f"[{name}] generated in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    figures: dict[str, Any] = render_command(cluster, workdir)
    print(f"[{name}] render command {figures['render_s']:.1f} s", file=sys.stderr, flush=True)
    if args.render_only:
        return figures
    api = serve(cluster)
    try:
        figures.update(agent(api, cluster, namespaces[0], args.pod_changes, args.ns_changes, args.seed))
        print(f"[{name}] agent: full sync {figures['full_sync_s']:.2f} s", file=sys.stderr, flush=True)
        figures["rss_mib"] = agent_rss(api, namespaces[1])
    finally:
        api.stop()
    figures.update(iptables_variant(cluster, namespaces[2]))
    return figures


# ---- growth -------------------------------------------------------------------------------------

def growth_figures(cluster: Cluster, rng: random.Random, changes: int) -> dict[str, float]:
    """In-process: render from scratch (best of 2, the garbage collector paused as the agent
    pauses it for a full render: this process holds the bigger clusters too), set elements, and
    the cost of one pod label change (renderer update + transaction batch, median), for one cluster."""
    renders = []
    for _ in range(2):
        with gc_paused():
            started = time.monotonic()
            renderer = NodeRenderer(NODE).load(cluster)
            model = renderer.model()
            renders.append(time.monotonic() - started)
    render_s = min(renders)
    renderer.take_changes()
    costs = []
    pods = dict(cluster.pods)
    for key, labels in pod_changes(cluster, changes, rng):
        pods[key] = dataclasses.replace(pods[key], labels=labels)
        started = time.monotonic()
        renderer.set_pod(key, pods[key])
        nft.transaction_json(delta_transaction(Config(), renderer.take_changes()))  # as the agent prints it
        costs.append((time.monotonic() - started) * 1000)
    return {"render_s": render_s, "elements": sum(len(s.elements) for s in model.sets), "change_ms": statistics.median(costs)}


def growth(seed: int) -> dict[str, dict[str, float]]:
    base = dict(pods=10000, policies=1000, namespaces=100, node_pods=110)
    variants = {"base 10k/1k/110": base, "pods x2": {**base, "pods": 20000, "namespaces": 200},
                "policies x2": {**base, "policies": 2000}, "local pods x2": {**base, "node_pods": 220}}
    return {name: growth_figures(synthetic.generate(seed=seed, **v).cluster, random.Random(seed), 200) for name, v in variants.items()}


# ---- report -------------------------------------------------------------------------------------

ROWS = [
    ("render command from a JSON dump (s)", "render_s", "{:.2f}", "render_s"),
    ("  its CPU (s)", "render_cpu_s", "{:.2f}", None),
    ("  its peak RSS (MiB)", "render_rss_mib", "{:.0f}", "render_rss_mib"),
    ("stdlib json.load of the same dump (s)", "json_load_s", "{:.2f}", None),
    ("  its CPU (s)", "json_load_cpu_s", "{:.2f}", None),
    ("  its peak RSS (MiB)", "json_load_rss_mib", "{:.0f}", None),
    ("render / json.load: wall", "render_load_ratio", "{:.2f}x", "render_load_ratio"),
    ("render / json.load: CPU", "render_load_cpu_ratio", "{:.2f}x", None),
    ("agent full sync: render + commit (s)", "full_sync_s", "{:.2f}", "full_sync_s"),
    ("  of which the commit (s)", "commit_s", "{:.2f}", None),
    ("agent RSS after the first sync (MiB)", "rss_mib", "{:.0f}", "rss_mib"),
    ("pod label change, event to kernel p50 (ms)", "pod_p50_ms", "{:.1f}", None),
    ("pod label change, event to kernel p99 (ms)", "pod_p99_ms", "{:.1f}", "pod_p99_ms"),
    ("  of which the agent's sync, p99 (ms)", "pod_sync_p99_ms", "{:.1f}", None),
    ("namespace label change, p50 (ms)", "ns_p50_ms", "{:.1f}", None),
    ("namespace label change, p99 (ms)", "ns_p99_ms", "{:.1f}", "ns_p99_ms"),
    ("  of which the agent's sync, p99 (ms)", "ns_sync_p99_ms", "{:.1f}", None),
    ("sets / policy chains / pod chains", None, "", None),
    ("set elements", "elements", "{:,}", None),
    ("elements of the distinct peers", "distinct_elements", "{:,}", None),
    ("  ratio (target <= 1.2)", "ratio", "{:.2f}", "element_ratio"),
    ("iptables variant: render (s)", "ipt_render_s", "{:.2f}", None),
    ("iptables variant: load (s)", "ipt_load_s", "{:.2f}", None),
    ("iptables variant: ipset elements", "ipt_elements", "{:,}", None),
]


def target_note(key: str | None, size: str, value: float) -> str:
    if key is None or key not in TARGETS:
        return ""
    goal = TARGETS[key]
    limit = goal if isinstance(goal, float) else goal.get(size)
    if limit is None:
        return ""
    return f" {'ok' if value <= limit else 'MISS'}<={limit:g}"


def print_report(results: dict[str, dict[str, Any]], grown: dict[str, dict[str, float]] | None) -> None:
    names = list(results)
    width = 44
    print("nftpolicy at Kubernetes' size limits (110 pods on the node; "
          f"{os.cpu_count()} CPUs, {os.uname().release}; load average at the end {os.getloadavg()[0]:.1f})")
    print("".ljust(width) + "".join(f"{n + ' (' + '/'.join(f'{x:,}' for x in SIZES[n][:2]) + ')':>24}" for n in names))
    for label, key, fmt, target in ROWS:
        needs = "sets" if key is None else "elements" if key == "ratio" else key
        if any(needs not in results[n] for n in names):
            continue  # not measured (--render-only)
        cells = []
        for n in names:
            r = results[n]
            if key is None:
                cell = f"{r['sets']:,} / {r['policy_chains']:,} / {r['pod_chains']:,}"
            else:
                value = r["elements"] / max(1, r["distinct_elements"]) if key == "ratio" else r[key]
                cell = fmt.format(value) + target_note(target, n, value)
            cells.append(f"{cell:>24}")
        print(label.ljust(width) + "".join(cells))
    if grown:
        base = grown["base 10k/1k/110"]
        print("\ngrowth from 10,000 pods / 1,000 policies / 110 local pods (ratio to the base):")
        print("".ljust(width) + "".join(f"{k:>18}" for k in ("render", "set elements", "pod change")))
        for name, figures in grown.items():
            print(name.ljust(width) + "".join(f"{figures[k] / base[k]:>17.2f}x" for k in ("render_s", "elements", "change_ms")))
        print("".ljust(width) + f"(base: render {base['render_s']:.2f} s, {base['elements']:,.0f} elements, "
              f"pod change {base['change_ms']:.2f} ms without the kernel)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated subset of: " + ",".join(SIZES))
    parser.add_argument("--pod-changes", type=int, default=100, help="pod label changes timed per size (default %(default)s)")
    parser.add_argument("--ns-changes", type=int, default=30, help="namespace label changes timed per size (default %(default)s)")
    parser.add_argument("--no-growth", action="store_true", help="skip the growth check")
    parser.add_argument("--render-only", action="store_true",
                        help="only the render command beside json.load (no agent, no iptables variant, no growth)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size {unknown[0]!r} (one of {', '.join(SIZES)})")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tag = f"b{secrets.token_hex(2)}"
    os.environ[netns.RUN_TAG_ENV] = tag
    names = [f"nftp-{tag}-scale{i}" for i in range(3)]
    results: dict[str, dict[str, Any]] = {}
    try:
        netns.create(names)
        with tempfile.TemporaryDirectory(prefix="nftpolicy-scale-") as workdir:
            for size in sizes:
                results[size] = measure(size, args, names, Path(workdir))
        grown = None if args.no_growth or args.render_only else growth(args.seed)
    finally:
        netns.delete(names)
    if args.json:
        print(json.dumps({"sizes": results, "growth": grown}, indent=1))
    else:
        print_report(results, grown)
    print(f"(peak RSS of this benchmark process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
