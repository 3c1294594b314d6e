#!/usr/bin/env python3
"""Concurrent ``/metrics`` scrapes: does a real ``nftpolicy agent`` survive its own users?

Usage (as root; heavy: under ``flock /tmp/nftpolicy-heavy.lock``)::

    .venv/bin/python bench/scrapes.py --baseline /work/main          # burst: 8 scrapers for 30 s at 1k pods
    .venv/bin/python bench/scrapes.py --soak                           # 16 scrapers + status + trace, 10 min at 10k pods
    .venv/bin/python bench/scrapes.py --size 10k --scrapers 16 --duration 60

The synthetic cluster (``synthetic.py``, ``--size`` as ``scale.py``'s sizes; ``--policies``
overrides the count) is served by the in-repo fake API server in this process; each agent is a
real ``nftpolicy agent`` process of its tree (``.venv/bin/nftpolicy``; ``--baseline``: another
tree's first, side by side) listing and watching it and committing through libnftables into a
network namespace made here (``--netns``).

**Burst** (the default). Once the agent is ready, ``--scrapers`` threads of this process each
GET ``/metrics`` back to back (a new connection each, as Prometheus' scrape) for
``--duration`` seconds. Printed per agent: alive at the end (or when it died, and how: SIGABRT
is libnftables' ``set_dtype_json`` assertion when two listings run at once), scrapes answered
200 with a whole exposition (``nftpolicy_build_info`` and the ``# EOF``-less text's last family,
the rule counters', there), failed ones, scrape latency p50 and p99, the agent's resident
memory before, at its peak and at the end (growth: the end's less the start's; target < 64 MiB),
its CPU seconds. Then SIGTERM with the scrapers still running: seconds until the process is
gone (the agent's own bound is 5 s: ``agent/interrupts.py`` GRACE) and its exit code (143).
How long a SIGTERM takes depends on which thread the kernel gives it to, so
``--sigterm-runs N`` then starts N fresh agents per tree, each SIGTERMed after 3 s of the
scrapers, and prints the median and the longest.

**Soak** (``--soak``: 10k pods, 16 scrapers, 600 s unless given). As the burst, and each
every second (back to back when a run takes longer; the runs are counted):
``kubectl nftpolicy status``, the real plugin against the test bed's real kube-apiserver
(``agent/testbed/controlplane.py``), which holds the Node and an agent Pod object at this host's
address, so the plugin reads ``/readyz`` and ``/metrics`` through the API server's pod proxy as
on a cluster; and the part of ``kubectl nftpolicy trace`` that runs in the agent pod: the
``nftpolicy trace`` command line the plugin would exec there
(:func:`nftpolicy.agent.cli.kubectl.trace.trace_argv` of that Pod object), run here beside the
agent (its namespace, its ``/debug/model`` on the agent's Unix socket as the chart's default,
its table: the trace adds and removes its chains;
no packet comes, so each exits 1 after its 1 s). The exec through a kubelet is left out: the
test bed's control plane has none, and it costs the agent nothing. The agent's cluster comes
from the fake API server, as in the burst: loading 10k pods into etcd tests nothing here. RSS is
printed every 30 s.

The load average is printed with the figures (the machine may be shared), and an agent that
grows past ``--rss-limit`` (4 GiB) is killed and reported so (main's grew past 9 GB in issue 29).

Safety: the agents commit only inside the ``nftp-b<tag>-*`` network namespaces made here, and
those go in a ``finally``, as do the control plane's processes (also on Ctrl-C and SIGTERM); each
agent is ended by its own pid, never by name.
"""

from __future__ import annotations

import argparse
import http.client
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import synthetic  # noqa: E402
from churn import cpu_seconds, machine, percentile, rss_mib, run_namespaces, side_by_side, wait_ready  # noqa: E402
from scale import SIZES, serve  # noqa: E402

from nftpolicy.agent.dataplane import netns  # noqa: E402

RSS_TARGET_MIB = 64.0  # the bound on the burst's RSS growth
WHOLE = (b"nftpolicy_build_info", b"nftpolicy_cluster_denied_packets")  # a whole exposition holds both


def host_address() -> str:
    """An IPv4 address of this host that is not loopback (kube-apiserver refuses to proxy to
    loopback), else 127.0.0.1 (the soak then cannot run status)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    found = [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]
    return found[0] if found else "127.0.0.1"


class Agent:
    """A real ``nftpolicy agent`` of ``tree`` against ``kubeconfig``, committing in ``ns``."""

    def __init__(self, tree: Path, kubeconfig: str, ns: str, host: str, extra: list[str]) -> None:
        self.host, self.port = host, 19300 + secrets.randbelow(300)
        self.log = Path(tempfile.mktemp(suffix=".log"))
        self.run_dir = Path(tempfile.mkdtemp(prefix="nftpolicy-scrapes-"))
        self.debug_address = f"unix:{self.run_dir / 'debug.sock'}"  # as the chart's default: a Unix socket
        argv = [str(tree / ".venv" / "bin" / "nftpolicy"), "agent", "--kubeconfig", kubeconfig, "--node", synthetic.NODE,
                "--netns", ns, "--http-address", f"{host}:{self.port}", "--debug-address", self.debug_address,
                "--api-timeout", "60", *extra]
        self.proc = subprocess.Popen(argv, stderr=self.log.open("wb"))

    def wait_ready(self) -> None:
        try:
            wait_ready(f"http://{self.host}:{self.port}", self.proc, "the agent")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {self.log.read_text()[-2000:]}") from None

    def died(self) -> str | None:
        """How the process ended (None: it runs)."""
        code = self.proc.poll()
        if code is None:
            return None
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.unlink(missing_ok=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)


class Scrapers:
    """``count`` threads that GET ``/metrics`` of ``agent`` back to back until :meth:`stop`."""

    def __init__(self, agent: Agent, count: int) -> None:
        self.agent, self.stopping = agent, threading.Event()
        self.latencies: list[float] = []
        self.failed = 0
        self.first_failure = ""
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                conn = http.client.HTTPConnection(self.agent.host, self.agent.port, timeout=30)
                conn.request("GET", "/metrics")
                response = conn.getresponse()
                body = response.read()
                conn.close()
                if response.status != 200 or not all(part in body for part in WHOLE):
                    raise ValueError(f"status {response.status}, {len(body)} bytes")
                self.latencies.append(time.monotonic() - started)
            except (OSError, ValueError, http.client.HTTPException) as exc:
                self.failed += 1
                self.first_failure = self.first_failure or f"{type(exc).__name__}: {exc}"
                if self.agent.died() is not None:
                    return
                time.sleep(0.05)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=60)


class RssSampler:
    """The agent's RSS every ``period`` seconds (MiB), and its peak."""

    def __init__(self, agent: Agent, period: float = 0.2) -> None:
        self.agent, self.period, self.samples = agent, period, [(0.0, rss_mib(agent.proc.pid))]
        self.started, self.stopping = time.monotonic(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(self.period) and self.agent.died() is None:
            try:
                self.samples.append((time.monotonic() - self.started, rss_mib(self.agent.proc.pid)))
            except (OSError, StopIteration):
                return

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


def sigterm(agent: Agent) -> tuple[float, str]:
    """SIGTERM ``agent`` and wait: (seconds until it is gone, how it ended); SIGKILL after 30 s."""
    started = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    try:
        agent.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        agent.proc.kill()
        agent.proc.wait()
        return time.monotonic() - started, "still running after 30 s: SIGKILL"
    return time.monotonic() - started, agent.died() or ""


class Soak:
    """``kubectl nftpolicy status`` and the in-pod ``nftpolicy trace``, each every second (module docstring)."""

    def __init__(self, tree: Path, agent: Agent, cp: Any, ns: str) -> None:
        from nftpolicy.agent.cli.kubectl.trace import trace_argv

        self.tree, self.cp = tree, cp
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"namespace": "nftpolicy-system", "name": f"nftpolicy-agent-{synthetic.NODE}",
                            "labels": {"app.kubernetes.io/name": "nftpolicy", "app.kubernetes.io/component": "agent"}},
               "spec": {"nodeName": synthetic.NODE, "hostNetwork": True,
                        "containers": [{"name": "agent", "ports": [{"name": "http", "containerPort": agent.port}],
                                        "env": [{"name": "NFTPOLICY_NETNS", "value": ns},
                                                {"name": "NFTPOLICY_DEBUG_ADDRESS", "value": agent.debug_address}]}]},
               "status": {"phase": "Running", "podIP": agent.host, "podIPs": [{"ip": agent.host}]}}
        cp.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "nftpolicy-system"}})
        cp.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": synthetic.NODE}})
        cp.delete("Pod", pod["metadata"]["name"], "nftpolicy-system")  # the previous tree's (its port)
        cp.apply(pod)
        self.trace = [str(tree / ".venv" / "bin" / "nftpolicy"), *trace_argv(pod, "10.0.0.1", "10.0.0.2", "TCP/80", 1.0)[1:]]
        self.runs = {"status": [0, 0], "trace": [0, 0]}  # [ran, exited as expected]
        self.stopping = threading.Event()
        plugin = [str(self.tree / ".venv" / "bin" / "kubectl-nftpolicy"), "status", "--kubeconfig", self.cp.kubeconfig]
        self.threads = [threading.Thread(target=self._run, args=(what, argv, expected), daemon=True)
                        for what, argv, expected in (("status", plugin, 0), ("trace", self.trace, 1))]  # trace: no such packet comes
        for thread in self.threads:
            thread.start()

    def _run(self, what: str, argv: list[str], expected: int) -> None:
        """``argv`` once a second (back to back when a run takes longer), each run counted."""
        while not self.stopping.is_set():
            started = time.monotonic()
            code = subprocess.run(argv, capture_output=True).returncode
            self.runs[what][0] += 1
            self.runs[what][1] += code == expected
            self.stopping.wait(max(0.0, started + 1.0 - time.monotonic()))

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join()


def measure(tree: Path, cluster: Any, ns: str, args: argparse.Namespace, cp: Any) -> dict[str, Any]:
    """One agent of ``tree`` through the load (module docstring)."""
    api = serve(cluster)
    kubeconfig = api.kubeconfig(tempfile.mktemp(suffix=".json"))
    agent = Agent(tree, kubeconfig, ns, host_address() if cp is not None else "127.0.0.1", args.agent_arg)
    try:
        agent.wait_ready()
        time.sleep(2)
        figures: dict[str, Any] = {"cpu0": cpu_seconds(agent.proc.pid)}
        rss = RssSampler(agent)
        scrapers = Scrapers(agent, args.scrapers)
        soak = Soak(tree, agent, cp, ns) if cp is not None else None
        started, report_at = time.monotonic(), time.monotonic() + 30
        while time.monotonic() < started + args.duration and agent.died() is None:
            time.sleep(0.2)
            if rss.samples[-1][1] > args.rss_limit:  # a shared machine: no agent may take it all
                agent.proc.kill()
                agent.proc.wait()
                figures["killed"] = f"RSS over {args.rss_limit:g} MiB"
            if cp is not None and time.monotonic() >= report_at:
                report_at += 30
                print(f"  [{Path(tree).name}] {time.monotonic() - started:4.0f} s: RSS {rss.samples[-1][1]:.0f} MiB, "
                      f"{len(scrapers.latencies)} scrapes, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        lasted = time.monotonic() - started
        died = agent.died()
        figures.update(alive="yes" if died is None else f"no: {figures.get('killed') or died} at {lasted:.1f} s", seconds=lasted,
                       cpu_s=(cpu_seconds(agent.proc.pid) - figures["cpu0"]) if died is None else float("nan"))
        if soak is not None:
            soak.stop()
            figures.update(status=f"{soak.runs['status'][1]}/{soak.runs['status'][0]}", trace=f"{soak.runs['trace'][1]}/{soak.runs['trace'][0]}")
        rss.stop()
        values = [mib for _, mib in rss.samples]
        figures.update(rss_start=values[0], rss_peak=max(values), rss_end=values[-1], rss_growth=values[-1] - values[0],
                       rss_series=[(round(t), round(mib)) for t, mib in rss.samples[::max(1, int(30 / rss.period))]])
        latencies = list(scrapers.latencies)  # before the SIGTERM: what the agent answered while it ran
        if died is None:
            figures["cpu_per_scrape_ms"] = figures["cpu_s"] / max(1, len(latencies)) * 1000
        figures.update(scrapes=len(latencies), failed=scrapers.failed, first_failure=scrapers.first_failure,
                       p50_ms=percentile(latencies, 0.5) * 1000, p99_ms=percentile(latencies, 0.99) * 1000)
        if died is None:
            figures["term_s"], figures["term"] = sigterm(agent)  # the scrapers still at it
        scrapers.stop()
        if died is not None:
            figures["log_tail"] = agent.log.read_text(errors="replace").strip().splitlines()[-1:]
        return figures
    finally:
        agent.close()
        api.stop()
        Path(kubeconfig).unlink(missing_ok=True)


def sigterm_runs(tree: Path, cluster: Any, ns: str, args: argparse.Namespace) -> list[float]:
    """``--sigterm-runs`` fresh agents of ``tree``, each SIGTERMed after 3 s of the scrapers:
    the seconds each took to be gone (a run that died before is left out)."""
    api = serve(cluster)
    kubeconfig = api.kubeconfig(tempfile.mktemp(suffix=".json"))
    took = []
    try:
        for _ in range(args.sigterm_runs):
            agent = Agent(tree, kubeconfig, ns, "127.0.0.1", args.agent_arg)
            try:
                agent.wait_ready()
                scrapers = Scrapers(agent, args.scrapers)
                time.sleep(3)
                if agent.died() is None:
                    took.append(sigterm(agent)[0])
                scrapers.stop()
            finally:
                agent.close()
    finally:
        api.stop()
        Path(kubeconfig).unlink(missing_ok=True)
    return took


ROWS = [
    ("agent alive at the end", "alive", "{}"),
    ("load (s)", "seconds", "{:.1f}"),
    ("scrapes answered whole", "scrapes", "{:,}"),
    ("scrapes failed", "failed", "{:,}"),
    ("scrape latency p50 / p99 (ms)", ("p50_ms", "p99_ms"), "{:.1f} / {:.1f}"),
    ("scrapes per second, ratio to the first tree", "scrape_ratio", "{:.2f}"),
    ("status runs exit 0 / runs", "status", "{}"),
    ("trace runs exit 1 (no packet) / runs", "trace", "{}"),
    ("agent CPU over the load (s)", "cpu_s", "{:.1f}"),
    ("agent CPU per answered scrape (ms)", "cpu_per_scrape_ms", "{:.2f}"),
    ("RSS at the start (MiB)", "rss_start", "{:.0f}"),
    ("RSS peak (MiB)", "rss_peak", "{:.0f}"),
    ("RSS at the end (MiB)", "rss_end", "{:.0f}"),
    (f"RSS growth, end - start (MiB; target < {RSS_TARGET_MIB:g})", "rss_growth", "{:.0f}"),
    ("SIGTERM under load: gone after (s; bound 5)", "term_s", "{:.2f}"),
    ("  how it ended", "term", "{}"),
    ("more SIGTERMs under load (--sigterm-runs): runs", "term_runs", "{}"),
    ("  gone after p50 / max (s)", ("term_p50", "term_max"), "{:.2f} / {:.2f}"),
    ("  runs that took over 1 s", "term_over", "{}"),
]


def cell(figures: dict[str, Any], key: Any, fmt: str) -> str:
    if isinstance(key, tuple):
        return fmt.format(*(figures[k] for k in key)) if all(k in figures for k in key) and figures.get("scrapes") else "-"
    return fmt.format(figures[key]) if key in figures else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--soak", action="store_true", help="status and trace every second too; defaults 10k pods, 16 scrapers, 600 s")
    parser.add_argument("--size", choices=list(SIZES), help="cluster size (default 1k; --soak: 10k)")
    parser.add_argument("--policies", type=int, help="NetworkPolicies (default: the size's; 1k: 300, as the issue measured)")
    parser.add_argument("--scrapers", type=int, help="concurrent scrapers (default 8; --soak: 16)")
    parser.add_argument("--duration", type=float, help="seconds of load (default 30; --soak: 600)")
    parser.add_argument("--rss-limit", type=float, default=4096, help="MiB: an agent that grows beyond is killed (default %(default)s)")
    parser.add_argument("--sigterm-runs", type=int, default=0,
                        help="then this many fresh agents per tree, each SIGTERMed after 3 s of the scrapers (default %(default)s)")
    parser.add_argument("--baseline", type=Path, action="append", default=[], help="another tree whose agent runs first (repeatable)")
    parser.add_argument("--agent-arg", action="append", default=[], help="one more argument for every agent (repeatable)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    args.size = args.size or ("10k" if args.soak else "1k")
    args.scrapers = args.scrapers or (16 if args.soak else 8)
    args.duration = args.duration or (600.0 if args.soak else 30.0)
    trees = [*args.baseline, ROOT]
    names = run_namespaces("scrape", len(trees))
    pods, policies, namespaces = SIZES[args.size]
    policies = args.policies or (300 if args.size == "1k" else policies)
    cluster = synthetic.generate(pods=pods, policies=policies, namespaces=namespaces, seed=args.seed).cluster
    results = {}
    cp = None
    try:
        netns.create(names)
        if args.soak:
            from nftpolicy.agent.testbed.controlplane import ControlPlane
            cp = ControlPlane().__enter__()
        for tree, ns in zip(trees, names):
            print(f"[{tree}] {args.scrapers} scrapers for {args.duration:g} s ...", file=sys.stderr, flush=True)
            results[str(tree)] = measure(tree, cluster, ns, args, cp)
            if args.sigterm_runs:
                print(f"[{tree}] {args.sigterm_runs} SIGTERMs under load ...", file=sys.stderr, flush=True)
                took = sigterm_runs(tree, cluster, ns, args)
                results[str(tree)].update(term_runs=f"{len(took)}", term_p50=percentile(took, 0.5), term_max=max(took, default=float("nan")),
                                          term_over=f"{sum(t > 1.0 for t in took)}")
    finally:
        if cp is not None:
            cp.__exit__(None, None, None)
        netns.delete(names)
    first = next(iter(results.values()))
    for r in list(results.values())[1:]:
        if first.get("scrapes") and r.get("scrapes"):
            r["scrape_ratio"] = r["scrapes"] / r["seconds"] / (first["scrapes"] / first["seconds"])
    print(f"{'soak' if args.soak else 'burst'} at {pods:,} pods / {policies:,} policies: {args.scrapers} concurrent /metrics scrapers"
          f"{', status and trace every second' if args.soak else ''} for {args.duration:g} s ({machine()})")
    side_by_side(results, ROWS, cell, 58, 30)
    for tree, r in results.items():
        if r.get("first_failure"):
            print(f"{Path(tree).name}: first failed scrape: {r['first_failure']}")
        if r.get("log_tail"):
            print(f"{Path(tree).name}: the agent's last log line: {r['log_tail'][0][:300]}")
        if args.soak:
            print(f"{Path(tree).name}: RSS over time (s, MiB): " + ", ".join(f"{t} {m}" for t, m in r["rss_series"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
