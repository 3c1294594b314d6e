#!/usr/bin/env python3
"""What one hostile object costs (issue 30): rules, set elements, render time and peak memory,
and the agent's sync time and memory on a 10k-pod cluster, against the object's size in bytes.

Usage (as root; ``--base`` a checkout of another tree, e.g. main, to print beside this one)::

    flock /tmp/nftpolicy-heavy.lock .venv/bin/python bench/hostile_shapes.py [--base DIR] [--shapes a,b] [--no-agent]

The shapes, each at two sizes (the second about twice or three times the first, so that a ratio
per byte shows whether a figure grows linearly with the input):

* ``peers x ports``: one NetworkPolicy whose ingress rule names P podSelector peers (pods of the
  cluster where there are that many workloads) and P ports: 300 x 300 and 1000 x 1000;
* ``ipBlocks x ports``: its twin with P ipBlock peers;
* ``ipBlocks+except``: one rule of N ipBlock peers, each a /16 with two excepts (2,500 and 5,000);
* ``policies on a pod``: N NetworkPolicies that all select one pod, one peer and one port each
  (250 and 500);
* ``CNP at limits``: one Admin ClusterNetworkPolicy of R ingress rules of R peers and R ports
  (12 and 25: the CRD's limits);
* ``label maps``: a policy whose peer's podSelector is a label map of K bytes, and a pod with
  those labels (32 KiB and 64 KiB);
* ``all-selecting peers``: one NetworkPolicy of N ingress rules, each of one peer, the peers
  with distinct selectors that all match every pod (``namespaceSelector: {}``, ``podSelector`` with
  ``matchExpressions: [{key: hostile-xI, operator: DoesNotExist}]``): N shared sets of every
  pod's address, N x 10,000 elements on the cluster (150 and 5,000: the second exhausts main's
  memory: ``--base-skip "all-selecting peers:5000"``).

For each (shape, size) and tree it prints:

* ``render``: ``nftpolicy render --format json`` of the object with one namespace and its target
  pod (a subprocess, address space limited to 4 GiB: a tree that needs more shows
  ``MemoryError``): the rules and set elements it writes, wall seconds and peak RSS (VmHWM);
* ``agent``: a subprocess of this script under that tree (its store's default caps): the reconcile loop over a synthetic
  10k-pod cluster (``synthetic.py``, 1,000 policies, this node ``node-0``), committing through
  libnftables into a network namespace made here; a full sync, then three rounds of: the object
  added to the store and the incremental sync that commits it (ms), the process's peak RSS
  during that sync over its RSS before (``peak +MiB``: VmHWM, reset through ``clear_refs``) and
  its RSS growth after it (``RSS +MiB``, both after ``malloc_trim``), the set elements it added
  to the table (``elem +``), a full sync with the object (ms), the object deleted and synced
  away; the median of each.

Targets (issue 30): the 300 x 300 object and its ipBlock twin write at most 2,000 rules and
render under 150 MiB; on the 10k-pod cluster the sync that adds it takes < 100 ms and RSS grows
< 20 MiB; 1000 x 1000 the same within 2x.

Safety: every nft command runs inside the ``nftp-hs<tag>`` network namespace this script
creates, deleted in a ``finally``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

NODE = "node-0"
SHAPES = {"peers x ports": (300, 1000), "ipBlocks x ports": (300, 1000), "ipBlocks+except": (2500, 5000),
          "policies on a pod": (250, 500), "CNP at limits": (12, 25), "label maps": (32 << 10, 64 << 10),
          "all-selecting peers": (150, 5000)}
TARGETS = {"rules": 2000, "render_rss_mib": 150.0, "sync_ms": 100.0, "peak_growth_mib": 20.0, "rss_growth_mib": 20.0}
RENDER_LIMIT = 4 << 30  # bytes of address space for a render
ROUNDS = 3  # the object added, synced, fully synced and deleted again: the median of each figure


def _netpol(ns: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": ns, "name": name}, "spec": spec}


def hostile(shape: str, size: int, ns: str, target: dict[str, str], workloads: list[tuple[str, dict[str, str]]]) -> list[dict[str, Any]]:
    """The objects of ``shape`` at ``size``, aimed at the pods of ``ns`` labelled ``target``;
    ``workloads``: (namespace, labels) of pods a podSelector peer may select (cycled, then
    selectors of no pod)."""
    selects = {"matchLabels": target}

    def pods_peer(i: int) -> dict[str, Any]:
        if i < len(workloads):
            where, labels = workloads[i]
            return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": where}}, "podSelector": {"matchLabels": labels}}
        return {"podSelector": {"matchLabels": {"hostile": f"absent-{i}"}}}

    ports = [{"port": 1000 + i} for i in range(size)]
    if shape == "peers x ports":
        return [_netpol(ns, "hostile", {"podSelector": selects, "ingress": [{"from": [pods_peer(i) for i in range(size)], "ports": ports}]})]
    if shape == "ipBlocks x ports":
        peers = [{"ipBlock": {"cidr": f"172.{16 + i // 256}.{i % 256}.0/24"}} for i in range(size)]
        return [_netpol(ns, "hostile", {"podSelector": selects, "ingress": [{"from": peers, "ports": ports}]})]
    if shape == "ipBlocks+except":
        peers = [{"ipBlock": {"cidr": f"{100 + i // 256}.{i % 256}.0.0/16", "except": [f"{100 + i // 256}.{i % 256}.{j}.0/24" for j in (1, 7)]}}
                 for i in range(size)]
        return [_netpol(ns, "hostile", {"podSelector": selects, "ingress": [{"from": peers, "ports": [{"port": 443}]}]})]
    if shape == "policies on a pod":
        return [_netpol(ns, f"hostile-{i}", {"podSelector": selects, "ingress": [{"from": [pods_peer(i)], "ports": [ports[i]]}]})
                for i in range(size)]
    if shape == "CNP at limits":
        rules = [{"name": f"r{r}", "action": "Accept" if r % 2 else "Deny",
                  "from": [{"namespaces": {"matchLabels": {"hostile": f"r{r}-p{p}"}}} for p in range(size)],
                  "protocols": [{"tcp": {"destinationPort": {"number": 2000 + q}}} for q in range(size)]} for r in range(size)]
        return [{"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": "hostile"},
                 "spec": {"tier": "Admin", "priority": 5, "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": ns}}},
                          "ingress": rules}}]
    if shape == "all-selecting peers":
        peers = [{"namespaceSelector": {}, "podSelector": {"matchExpressions": [{"key": f"hostile-x{i}", "operator": "DoesNotExist"}]}}
                 for i in range(size)]
        return [_netpol(ns, "hostile", {"podSelector": selects, "ingress": [{"from": [peer]} for peer in peers]})]
    assert shape == "label maps"
    labels = {f"hostile.example/k{i:05d}": f"v{i:0>54}" for i in range(size // 80)}  # 80 bytes a label in JSON
    return [_netpol(ns, "hostile", {"podSelector": selects, "ingress": [{"from": [{"podSelector": {"matchLabels": labels}}], "ports": [{"port": 80}]}]}),
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": ns, "name": "hostile-labels", "labels": labels},
             "spec": {"nodeName": "node-9", "containers": [{"name": "c"}]}, "status": {"phase": "Running", "podIPs": [{"ip": "10.99.0.9"}]}}]


def size_of(objects: list[dict[str, Any]]) -> int:
    """The objects' size in bytes, as JSON."""
    return sum(len(json.dumps(o, separators=(",", ":"))) for o in objects)


# ---- render -------------------------------------------------------------------------------------

def render_figures(tree: Path | None, shape: str, size: int, workdir: Path) -> dict[str, Any]:
    """``nftpolicy render --format json`` of the shape with its namespace and target pod."""
    ns, target = "x", {"app": "db"}
    items = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {"kubernetes.io/metadata.name": ns}}},
             {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": ns, "name": "db", "labels": target},
              "spec": {"nodeName": NODE, "containers": [{"name": "c"}]}, "status": {"phase": "Running", "podIPs": [{"ip": "10.0.0.1"}]}}]
    items += hostile(shape, size, ns, target, [])
    dump = workdir / "render.json"
    dump.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    out = workdir / "render.out"
    env = {**os.environ, **({"PYTHONPATH": str(tree)} if tree is not None else {})}
    started = time.monotonic()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (RENDER_LIMIT, RENDER_LIMIT))

    with out.open("w") as sink:
        proc = subprocess.Popen([str(ROOT / ".venv" / "bin" / "nftpolicy"), "render", "--node", NODE, "--format", "json", str(dump)],
                                stdout=sink, stderr=subprocess.PIPE, env=env, preexec_fn=limit)
        peak_kib = 0
        while proc.poll() is None:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                peak_kib = max(peak_kib, int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))))
            except (OSError, StopIteration):
                pass
            time.sleep(0.01)
        stderr = proc.stderr.read().decode() if proc.stderr else ""
    figures: dict[str, Any] = {"render_s": time.monotonic() - started, "render_rss_mib": peak_kib / 1024}
    if proc.returncode != 0:
        figures["render_error"] = "MemoryError" if "MemoryError" in stderr else (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return figures
    added = [o["add"] for o in json.loads(out.read_text())["nftables"] if "add" in o]
    figures["rules"] = sum(1 for o in added if "rule" in o)
    figures["elements"] = sum(len(o["set"].get("elem", ())) for o in added if "set" in o) + sum(len(o["element"]["elem"]) for o in added if "element" in o)
    out.unlink()
    return figures


# ---- agent (run as a subprocess under the tree measured) ----------------------------------------

def _rss_mib(field: str = "VmRSS") -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field))) / 1024


def agent_figures(shape: str, size: int, ns_name: str) -> dict[str, Any]:
    """The reconcile loop over the 10k-pod cluster with the object added (this process)."""
    import synthetic
    from nftpolicy.agent.daemon.health import Health
    from nftpolicy.agent.daemon.metrics import Metrics
    from nftpolicy.agent.daemon.reconcile import Reconciler
    from nftpolicy.agent.daemon.store import KINDS, Store
    from nftpolicy.agent.dataplane.nftables import NftDataplane, release_memory
    from nftpolicy.translators.rules import Config

    cluster = synthetic.generate(pods=10_000, policies=1_000, namespaces=100).cluster
    metrics = Metrics()
    store = Store(metrics)
    objects: dict[str, list[Any]] = {kind: [] for kind in KINDS}
    for obj in synthetic.api_objects(cluster):
        objects[obj["kind"]].append(obj)
    objects["Node"].append({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}, "spec": {}, "status": {}})
    for kind, items in objects.items():
        store.replace(kind, items)
    local = [p for p in cluster.pods.values() if p.node == NODE and p.enforceable and "app" in p.labels]
    ns, target = local[0].namespace, {"app": local[0].labels["app"]}
    workloads = sorted({(p.namespace, tuple(sorted((k, v) for k, v in p.labels.items() if k in ("app", "tier")))) for p in cluster.pods.values()
                        if p.enforceable and "app" in p.labels})
    reconciler = Reconciler(store, Config(), NODE, metrics, Health(window=60), 0.0, 3600.0, NftDataplane(Config().table, ns_name))
    assert reconciler.sync(full=True)
    assert reconciler.sync(full=False) or True  # the store's journal starts after the first take
    objects_in = hostile(shape, size, ns, target, [(n, dict(labels)) for n, labels in workloads])
    rounds: dict[str, list[float]] = {"sync_ms": [], "rss_growth_mib": [], "peak_growth_mib": [], "elements_added": [], "full_sync_ms": []}
    elements = reconciler.renderer.counts()["elements"] if reconciler.renderer is not None else 0
    committed = True
    for _ in range(ROUNDS):
        gc.collect()
        release_memory()
        before = _rss_mib()
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current RSS
        for obj in objects_in:
            store.apply(obj["kind"], "ADDED", obj)
        started = time.monotonic()
        committed &= reconciler.sync(full=False)
        rounds["sync_ms"].append((time.monotonic() - started) * 1000)
        rounds["peak_growth_mib"].append(_rss_mib("VmHWM") - before)
        rounds["elements_added"].append(reconciler.renderer.counts()["elements"] - elements if reconciler.renderer is not None else -1)
        gc.collect()
        release_memory()
        rounds["rss_growth_mib"].append(_rss_mib() - before)
        started = time.monotonic()
        committed &= reconciler.sync(full=True)
        rounds["full_sync_ms"].append((time.monotonic() - started) * 1000)
        for obj in objects_in:
            store.apply(obj["kind"], "DELETED", obj)
        committed &= reconciler.sync(full=False)
    return {**{key: statistics.median(values) for key, values in rounds.items()}, "committed": committed}


def run_agent(tree: Path | None, shape: str, size: int, ns_name: str) -> dict[str, Any]:
    env = {**os.environ, **({"PYTHONPATH": str(tree)} if tree is not None else {})}
    proc = subprocess.run([sys.executable, __file__, "--agent-run", shape, str(size), ns_name], env=env, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"agent_error": "MemoryError" if "MemoryError" in proc.stderr else last[:80]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- report -------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="another tree to measure beside this one (a checkout: its agent/ and translators/)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of: " + ",".join(SHAPES))
    parser.add_argument("--no-agent", action="store_true", help="render figures only (no root, no kernel)")
    parser.add_argument("--base-skip", default="", help="shape:size pairs not to run on --base (known to exhaust memory), e.g. 'peers x ports:1000'")
    parser.add_argument("--agent-run", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent_run:
        shape, size, ns_name = args.agent_run
        print(json.dumps(agent_figures(shape, int(size), ns_name)))
        return 0
    import tempfile
    from nftpolicy.agent.dataplane import netns
    trees: dict[str, Path | None] = {"branch": None}
    if args.base is not None:
        link = Path(tempfile.mkdtemp(prefix="nftp-hs-base-")) / "nftpolicy"
        link.mkdir()
        for part in ("agent", "translators"):
            (link / part).symlink_to(args.base.resolve() / part)
        trees = {"base": link.parent, "branch": None}
    skip = {tuple(item.rsplit(":", 1)) for item in args.base_skip.split(",") if item}
    ns_name = f"nftp-hs{secrets.token_hex(3)}"
    if not args.no_agent:
        netns.create([ns_name])
    workdir = Path(tempfile.mkdtemp(prefix="nftp-hs-"))
    print(f"{'shape':<18} {'size':>6} {'bytes':>8} {'tree':<6} {'rules':>7} {'elements':>8} {'render s':>8} {'render MiB':>10} "
          f"{'sync ms':>8} {'peak +MiB':>9} {'RSS +MiB':>8} {'elem +':>8} {'full ms':>8}", flush=True)
    results = []
    try:
        for shape in args.shapes.split(","):
            for size in SHAPES[shape]:
                nbytes = size_of(hostile(shape, size, "x", {"app": "db"}, []))
                for name, tree in trees.items():
                    if name == "base" and (shape, str(size)) in skip:
                        print(f"{shape:<18} {size:>6} {nbytes:>8} {name:<6} skipped (--base-skip)", flush=True)
                        continue
                    figures = render_figures(tree, shape, size, workdir)
                    if not args.no_agent:
                        figures.update(run_agent(tree, shape, size, ns_name))
                    results.append({"shape": shape, "size": size, "bytes": nbytes, "tree": name, **figures})
                    err = figures.get("render_error")
                    rules = f"{figures['rules']:>7} {figures['elements']:>8}" if err is None else f"{str(err)[:16]:>16}"
                    agent = (f"{figures['sync_ms']:>8.1f} {figures['peak_growth_mib']:>9.1f} {figures['rss_growth_mib']:>8.1f} "
                             f"{figures['elements_added']:>8.0f} {figures['full_sync_ms']:>8.0f}"
                             + ("" if figures["committed"] else "  NOT COMMITTED") if "sync_ms" in figures else f"{str(figures.get('agent_error', '-'))[:26]:>26}")
                    print(f"{shape:<18} {size:>6} {nbytes:>8} {name:<6} {rules} {figures['render_s']:>8.2f} {figures['render_rss_mib']:>10.1f} {agent}",
                          flush=True)
    finally:
        if not args.no_agent:
            netns.delete([ns_name])
    print("\ngrowth per byte, second size over first (1.0: linear), this tree:")
    for shape in args.shapes.split(","):
        small, big = ([r for r in results if r["shape"] == shape and r["tree"] == "branch" and r["size"] == s] for s in SHAPES[shape])
        if small and big:
            a, b = small[0], big[0]
            ratio = b["bytes"] / a["bytes"]
            parts = [f"{key} {b[key] / a[key] / ratio:.2f}" for key in ("rules", "elements", "render_s", "render_rss_mib", "sync_ms", "peak_growth_mib")
                     if a.get(key) and key in b]
            print(f"  {shape:<18} bytes x{ratio:.1f}: " + ", ".join(parts))
    print("targets: " + ", ".join(f"{k} {v}" for k, v in TARGETS.items()))
    with open("/proc/loadavg") as f:
        print("load average", " ".join(f.read().split()[:3]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
