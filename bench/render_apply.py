#!/usr/bin/env python3
"""Benchmark: render a node's ruleset from a synthetic cluster and apply it with libnftables.

Usage (as root)::

    .venv/bin/python bench/render_apply.py            # table on stdout
    .venv/bin/python bench/render_apply.py --json     # JSON on stdout (the table goes to stderr)
    .venv/bin/python bench/render_apply.py --profile  # + cProfile of one 10k render

For two cluster sizes (1,000 pods / 100 policies in 50 namespaces, 10,000 pods / 1,000 policies
in 100 namespaces; 110 pods on ``node-0``, the node rendered; see ``synthetic.py``) it reports:

* render: ``build_rule_model`` + ``nft.full_transaction``, median of ``--runs`` runs;
* apply: ``agent.nftables.run_json(batch)`` (JSON serialisation + libnftables + kernel commit),
  first into a namespace without our table, then re-applied over the existing table (the batch's
  atomic ``add table; delete table; add ...`` replace), median of ``--runs`` each;
* the ruleset size: chains, rules, sets (+ verdict maps), set (+ map) elements, bytes of compact
  JSON (what libnftables parses) and of ``nft.to_text``;
* a scaling check: rules + elements for the 10k cluster, with 2x pods that are neither local nor
  matched by any policy, with 2x policies, and with 2x local pods, as ratios.

Safety: every nft/libnftables call runs inside a network namespace this script creates
(``ip netns add nftp-bench-<random>``), entered with ``nftpolicy.agent.netns.entered`` and checked
(the thread's netns inode must be the new namespace's before anything is sent). The namespace is
deleted in a ``finally``, also on Ctrl-C and SIGTERM. The machine's own ruleset is never touched.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic  # noqa: E402

from nftpolicy.agent import netns  # noqa: E402
from nftpolicy.translators import nft, rules  # noqa: E402

NODE = synthetic.NODE
TARGET_MS = 1000.0
SIZES = {
    "1k": {"pods": 1000, "policies": 100, "namespaces": 50},
    "10k": {"pods": 10000, "policies": 1000, "namespaces": 100},
}
NETNS_PREFIX = "nftp-bench-"


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


# ---- measurement helpers -------------------------------------------------------------------------

def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return (time.perf_counter() - start) * 1000.0, result


def summary(samples: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(samples), 2), "min": round(min(samples), 2),
            "max": round(max(samples), 2), "runs": [round(s, 2) for s in samples]}


def render(cluster, config: rules.Config) -> tuple[rules.RuleModel, dict]:
    model = rules.build_rule_model(cluster, NODE, config)
    return model, nft.full_transaction(model)


def bench_render(cluster, config: rules.Config, runs: int) -> tuple[dict, rules.RuleModel, dict]:
    model_ms, tx_ms, total_ms = [], [], []
    model = batch = None
    for _ in range(runs):
        gc.collect()
        t0 = time.perf_counter()
        model = rules.build_rule_model(cluster, NODE, config)
        t1 = time.perf_counter()
        batch = nft.full_transaction(model)
        t2 = time.perf_counter()
        model_ms.append((t1 - t0) * 1000)
        tx_ms.append((t2 - t1) * 1000)
        total_ms.append((t2 - t0) * 1000)
    figures = {"total_ms": summary(total_ms), "rule_model_ms": summary(model_ms), "transaction_ms": summary(tx_ms)}
    return figures, model, batch  # type: ignore[return-value]


def ruleset_size(model: rules.RuleModel, batch: dict) -> dict[str, int]:
    counts = {"chains": 0, "rules": 0, "sets": 0, "set_elements": 0, "maps": 0, "map_elements": 0}
    for command in batch["nftables"]:
        if "add" not in command:
            continue  # the leading "delete table" of the replace
        (obj_kind, body), = command["add"].items()
        if obj_kind == "chain":
            counts["chains"] += 1
        elif obj_kind == "rule":
            counts["rules"] += 1
        elif obj_kind == "set":
            counts["sets"] += 1
            counts["set_elements"] += len(body.get("elem", ()))
        elif obj_kind == "map":
            counts["maps"] += 1
            counts["map_elements"] += len(body.get("elem", ()))
    counts["policy_chains"] = len(model.policy_chains)
    counts["pod_chains"] = len(model.pod_chains)
    counts["largest_set"] = max((len(s.elements) for s in model.sets), default=0)
    counts["json_bytes"] = len(json.dumps(batch).encode())  # what python-nftables hands libnftables
    counts["text_bytes"] = len(nft.to_text(model).encode())
    counts["rules_plus_elements"] = counts["rules"] + counts["set_elements"] + counts["map_elements"]
    return counts


# ---- the bench network namespace -----------------------------------------------------------------

def _ns_id(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


class BenchNetns:
    """A throw-away network namespace; every nft call goes through :meth:`inside`."""

    def __init__(self) -> None:
        self.name = NETNS_PREFIX + secrets.token_hex(4)
        self.created = False

    def create(self) -> None:
        self.created = True  # from here on delete() runs, even if interrupted mid-create
        result = subprocess.run(["ip", "netns", "add", self.name], capture_output=True, text=True)
        if result.returncode != 0:
            self.created = False
            raise SystemExit(f"ip netns add {self.name} failed (root needed): {result.stderr.strip()}")
        self.created = True

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Enter the namespace on this thread and prove it before yielding."""
        if not self.created:
            raise RuntimeError("bench netns not created")
        target = _ns_id(f"{netns.NETNS_DIR}/{self.name}")
        home = _ns_id("/proc/thread-self/ns/net")
        if target == home:
            raise RuntimeError("bench netns is the current namespace: refusing to run nft")
        with netns.entered(self.name):
            if _ns_id("/proc/thread-self/ns/net") != target:
                raise RuntimeError(f"setns into {self.name} did not take effect: refusing to run nft")
            yield

    def delete(self) -> None:
        if not self.created and self.name not in netns.existing(NETNS_PREFIX):
            return
        netns.delete([self.name])
        if self.name in netns.existing(NETNS_PREFIX):
            log(f"WARNING: could not delete network namespace {self.name}; remove it with: ip netns del {self.name}")
        else:
            self.created = False


def _table_ref(config: rules.Config) -> dict:
    return {"table": {"family": "inet", "name": config.table}}


def bench_apply(ns: BenchNetns, batch: dict, config: rules.Config, runs: int) -> dict[str, Any]:
    """First apply (no table) and re-apply (replace), median of ``runs`` each, in ``ns``."""
    from nftpolicy.agent.nftables import run_json  # needs python3-nftables; imported only here

    drop = {"nftables": [{"add": _table_ref(config)}, {"delete": _table_ref(config)}]}
    first, again, serialize = [], [], []
    with ns.inside():
        for _ in range(runs):
            run_json(drop)  # start from a namespace without our table
            gc.collect()
            ms, _ = timed(lambda: run_json(batch))
            first.append(ms)
            gc.collect()
            ms, _ = timed(lambda: run_json(batch))
            again.append(ms)
            serialize.append(timed(lambda: json.dumps(batch))[0])
        kernel = kernel_counts(run_json, config)
        run_json(drop)
    return {"first_ms": summary(first), "replace_ms": summary(again), "serialize_ms": summary(serialize), "kernel": kernel}


def kernel_counts(run_json, config: rules.Config) -> dict[str, int]:
    """Objects of our table as the kernel lists them (after an apply)."""
    listing = run_json({"nftables": [{"list": _table_ref(config)}]})
    counts = {"chains": 0, "rules": 0, "sets": 0, "maps": 0}
    for item in listing.get("nftables", []):
        for key in counts:
            if key[:-1] in item:
                counts[key] += 1
    return counts


# ---- report ----------------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    def pkg(name: str) -> str | None:
        r = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", name], capture_output=True, text=True)
        return r.stdout.strip() or None if r.returncode == 0 else None

    return {"revision": _revision(), "cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "libnftables": pkg("libnftables1"), "cpu": _cpu_model()}


def _revision() -> str | None:
    """Commit of the tree benchmarked, ``+dirty`` when translators/ or agent/ have local changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "translators", "agent"],
                               capture_output=True, text=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def print_table(out, report: dict[str, Any]) -> None:
    m = report["machine"]
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"nftpolicy render + apply benchmark: seed {report['seed']}, median of {report['runs']} runs, "
      f"node {NODE}{', dual-stack' if report['dual_stack'] else ''}")
    p(f"tree: {m['revision']}")
    p(f"machine: {m['cpus']} CPUs ({m['cpu']}), kernel {m['kernel']}, Python {m['python']}, libnftables {m['libnftables']}")
    p(f"nft ran only in network namespace {report['netns']} (deleted afterwards)" if report["netns"] else "apply skipped (--no-apply)")
    p()
    sizes = report["sizes"]
    labels = list(sizes)
    header = [f"{sizes[k]['pods']} pods / {sizes[k]['policies']} pol" for k in labels]
    width = max(22, *(len(h) + 2 for h in header))
    rows: list[tuple[str, list[str]]] = []

    def row(name: str, get: Callable[[dict], Any]) -> None:
        values = []
        for k in labels:
            try:
                v = get(sizes[k])
            except (KeyError, TypeError):
                v = "-"
            values.append(f"{v:,.1f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v))
        rows.append((name, values))

    row("namespaces / nodes", lambda s: f"{s['namespaces']} / {s['nodes']}")
    row("local pods (node-0)", lambda s: s["local_pods"])
    row("policies rendered", lambda s: s["ruleset"]["policy_chains"])
    row("isolated local pods", lambda s: s["ruleset"]["pod_chains"])
    row("render: rule model ms", lambda s: s["render"]["rule_model_ms"]["median"])
    row("render: JSON batch ms", lambda s: s["render"]["transaction_ms"]["median"])
    row("render total ms", lambda s: s["render"]["total_ms"]["median"])
    row("  (min..max)", lambda s: f"{s['render']['total_ms']['min']:.1f}..{s['render']['total_ms']['max']:.1f}")
    row("apply: first ms", lambda s: s["apply"]["first_ms"]["median"])
    row("apply: re-apply ms", lambda s: s["apply"]["replace_ms"]["median"])
    row("  of which json.dumps ms", lambda s: s["apply"]["serialize_ms"]["median"])
    row("render + first apply ms", lambda s: s["total_first_ms"])
    row("render + re-apply ms", lambda s: s["total_replace_ms"])
    row("chains", lambda s: s["ruleset"]["chains"])
    row("rules", lambda s: s["ruleset"]["rules"])
    row("sets (+ verdict maps)", lambda s: f"{s['ruleset']['sets']:,} (+{s['ruleset']['maps']})")
    row("set elements (+ map)", lambda s: f"{s['ruleset']['set_elements']:,} (+{s['ruleset']['map_elements']:,})")
    row("largest set", lambda s: s["ruleset"]["largest_set"])
    row("JSON bytes", lambda s: s["ruleset"]["json_bytes"])
    row("nft text bytes", lambda s: s["ruleset"]["text_bytes"])
    row("kernel listing", lambda s: s["apply"]["kernel_check"])
    name_w = max(len(r[0]) for r in rows) + 2
    p("".ljust(name_w) + "".join(h.rjust(width) for h in header))
    for name, values in rows:
        p(name.ljust(name_w) + "".join(v.rjust(width) for v in values))
    p()
    t = report["target"]
    if t:
        p(f"target: render + apply of the {t['size']} cluster within {TARGET_MS:.0f} ms on this {m['cpus']}-CPU machine")
        for what in ("first", "replace"):
            p(f"  render {t['render_ms']:.1f} + {'first apply' if what == 'first' else 're-apply'} "
              f"{t[what + '_apply_ms']:.1f} = {t[what + '_total_ms']:.1f} ms  {t[what + '_verdict']}")
        p()
    sc = report.get("scaling")
    if sc:
        p("scaling check (10k cluster; size = rules + set elements + map elements):")
        base = sc["a"]
        p(f"  {'variant':<52}{'pods':>8}{'local':>7}{'pol':>6}{'rendered':>10}{'chains':>8}{'rules':>8}{'elements':>10}{'size':>9}{'ratio':>7}{'render ms':>11}")
        for key, v in sc.items():
            elements = v["ruleset"]["set_elements"] + v["ruleset"]["map_elements"]
            p(f"  {key + ') ' + v['label']:<52}{v['pods']:>8,}{v['local_pods']:>7}{v['policies']:>6,}"
              f"{v['ruleset']['policy_chains']:>10,}{v['ruleset']['chains']:>8,}{v['ruleset']['rules']:>8,}{elements:>10,}"
              f"{v['size']:>9,}{v['size'] / base['size']:>7.2f}{v['render_ms']:>11.1f}")
        b = sc.get("b", {})
        if "extra_pods_matched" in b:
            p(f"  (b) added pods that some policy matches: {b['extra_pods_matched']} of {b['pods'] - base['pods']:,}")
        p("  a pods x policies ruleset would be 2.00x in (b) and (c). Observed:")
        if "b" in sc:
            p(f"  (b) {sc['b']['ratio']:.2f}x: pods that are neither local nor peers add "
              f"{sc['b']['size'] - base['size']:+,} rules+elements (render time {sc['b']['render_ms'] / base['render_ms']:.2f}x: the index still reads every pod)")
        if "c" in sc:
            c = sc["c"]
            p(f"  (c) {c['ratio']:.2f}x with {c['ruleset']['policy_chains'] / base['ruleset']['policy_chains']:.2f}x rendered policy chains "
              f"(only policies selecting a local pod are rendered; elements {sum_elements(c) / max(sum_elements(base), 1):.2f}x follow their peers)")
        if "d" in sc:
            d = sc["d"]
            p(f"  (d) {d['ratio']:.2f}x with 2x local pods ({d['ruleset']['pod_chains']} vs {base['ruleset']['pod_chains']} pod chains, "
              f"{d['ruleset']['policy_chains']} vs {base['ruleset']['policy_chains']} policy chains)")
        p()


def sum_elements(v: dict[str, Any]) -> int:
    return v["ruleset"]["set_elements"] + v["ruleset"]["map_elements"]


def print_profile(out, cluster, config: rules.Config, top: int, sort: str) -> str:
    profiler = cProfile.Profile()
    gc.collect()
    profiler.enable()
    render(cluster, config)
    profiler.disable()
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf)
    stats.strip_dirs().sort_stats(sort).print_stats(top)
    text = buf.getvalue()
    print(f"cProfile of one 10k render (build_rule_model + full_transaction), top {top} by {sort}:", file=out)
    print(text.strip("\n"), file=out)
    return text


# ---- main --------------------------------------------------------------------------------------------

def _raise_interrupt(signum, frame):  # SIGTERM/SIGHUP: unwind through the finally blocks
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print machine-readable figures on stdout (the table goes to stderr)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per figure (median reported; default 5)")
    ap.add_argument("--seed", type=int, default=1, help="generator seed (default 1)")
    ap.add_argument("--sizes", default="1k,10k", help="comma-separated subset of: " + ",".join(SIZES))
    ap.add_argument("--dual-stack", action="store_true", help="give every pod an IPv6 address too")
    ap.add_argument("--no-apply", action="store_true", help="render only: no network namespace, no nft")
    ap.add_argument("--no-scaling", action="store_true", help="skip the scaling check")
    ap.add_argument("--profile", action="store_true", help="cProfile one 10k render and print the top functions")
    ap.add_argument("--profile-top", type=int, default=15)
    ap.add_argument("--profile-sort", default="cumulative", help="pstats sort key (default cumulative)")
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    out = sys.stderr if args.json else sys.stdout
    config = rules.Config()

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    ns = BenchNetns()
    started = time.perf_counter()
    report: dict[str, Any] = {"machine": machine(), "seed": args.seed, "runs": args.runs, "node": NODE,
                              "dual_stack": args.dual_stack, "netns": None if args.no_apply else ns.name,
                              "target_ms": TARGET_MS, "sizes": {}, "target": None, "scaling": None}
    clusters: dict[str, synthetic.Synthetic] = {}
    try:
        if not args.no_apply:
            ns.create()
            log(f"created network namespace {ns.name}")
        for size in sizes:
            spec = SIZES[size]
            ms, syn = timed(lambda: synthetic.generate(spec["pods"], spec["policies"], spec["namespaces"], 110,
                                                       args.seed, args.dual_stack))
            clusters[size] = syn
            cluster = syn.cluster
            log(f"[{size}] generated {len(cluster.pods)} pods, {len(cluster.policies)} policies in {ms:.0f} ms; rendering")
            render_fig, model, batch = bench_render(cluster, config, args.runs)
            entry: dict[str, Any] = {
                "pods": len(cluster.pods), "policies": len(cluster.policies), "namespaces": len(cluster.namespaces),
                "nodes": len(cluster.nodes), "local_pods": sum(1 for p in cluster.pods.values() if p.node == NODE),
                "render": render_fig, "ruleset": ruleset_size(model, batch),
            }
            if not args.no_apply:
                log(f"[{size}] applying in {ns.name}")
                entry["apply"] = bench_apply(ns, batch, config, args.runs)
                k, r = entry["apply"]["kernel"], entry["ruleset"]
                ok = (k["chains"], k["rules"], k["sets"], k["maps"]) == (r["chains"], r["rules"], r["sets"], r["maps"])
                entry["apply"]["kernel_check"] = "matches" if ok else f"MISMATCH {k}"
                entry["total_first_ms"] = round(render_fig["total_ms"]["median"] + entry["apply"]["first_ms"]["median"], 2)
                entry["total_replace_ms"] = round(render_fig["total_ms"]["median"] + entry["apply"]["replace_ms"]["median"], 2)
            report["sizes"][size] = entry
        if "10k" in report["sizes"] and not args.no_apply:
            e = report["sizes"]["10k"]
            t = {"size": "10,000 pods / 1,000 policies", "render_ms": e["render"]["total_ms"]["median"]}
            for what, key in (("first", "first_ms"), ("replace", "replace_ms")):
                t[f"{what}_apply_ms"] = e["apply"][key]["median"]
                t[f"{what}_total_ms"] = e[f"total_{what}_ms"]
                t[f"{what}_verdict"] = "PASS" if e[f"total_{what}_ms"] <= TARGET_MS else "MISS"
            report["target"] = t
        if not args.no_scaling:
            report["scaling"] = scaling(args, config, clusters.get("10k"))
        print_table(out, report)
        if args.profile:
            syn = clusters.get("10k") or synthetic.generate(**SIZES["10k"], node_pods=110, seed=args.seed, dual_stack=args.dual_stack)
            report["profile"] = print_profile(out, syn.cluster, config, args.profile_top, args.profile_sort)
        report["elapsed_s"] = round(time.perf_counter() - started, 1)
        print(f"\nelapsed {report['elapsed_s']} s", file=out)
        if args.json:
            json.dump(report, sys.stdout, indent=2)
            print()
        return 0
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        ns.delete()
        if ns.created is False and not args.no_apply:
            log(f"deleted network namespace {ns.name}")


def scaling(args, config: rules.Config, base: synthetic.Synthetic | None) -> dict[str, Any]:
    spec = SIZES["10k"]
    base = base or synthetic.generate(spec["pods"], spec["policies"], spec["namespaces"], 110, args.seed, args.dual_stack)
    variants: dict[str, tuple[str, synthetic.Synthetic]] = {"a": ("base 10k cluster", base)}
    log("[scaling] building variants")
    b = synthetic.add_unmatched_pods(base, spec["pods"])
    variants["b"] = ("2x pods: +10k not on node-0, matched by no policy", b)
    variants["c"] = ("2x policies (same pods)", synthetic.with_policies(base, 2 * spec["policies"]))
    variants["d"] = ("2x local pods (220 on node-0, same totals)",
                     synthetic.generate(spec["pods"], spec["policies"], spec["namespaces"], 220, args.seed, args.dual_stack))
    result: dict[str, Any] = {}
    for key, (label, syn) in variants.items():
        cluster = syn.cluster
        samples = []
        model = batch = None
        for _ in range(3):
            gc.collect()
            ms, (model, batch) = timed(lambda: render(cluster, config))
            samples.append(ms)
        size = ruleset_size(model, batch)  # type: ignore[arg-type]
        result[key] = {"label": label, "pods": len(cluster.pods), "policies": len(cluster.policies),
                       "local_pods": sum(1 for p in cluster.pods.values() if p.node == NODE),
                       "render_ms": round(statistics.median(samples), 2), "ruleset": size,
                       "size": size["rules_plus_elements"]}
        log(f"[scaling] {key}: size {size['rules_plus_elements']}")
    extra = set(b.cluster.pods) - set(base.cluster.pods)
    result["b"]["extra_pods_matched"] = synthetic.pods_matched_by_policies(b.cluster, extra)
    for key in result:
        result[key]["ratio"] = round(result[key]["size"] / result["a"]["size"], 3)
    return result


if __name__ == "__main__":
    sys.exit(main())
