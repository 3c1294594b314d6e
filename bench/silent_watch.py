"""A watch stream that stays open but stops delivering, with the agent's default settings: how
long until a deny-all NetworkPolicy written after the stall is enforced in the kernel.

    flock /tmp/nftpolicy-heavy.lock .venv/bin/python bench/silent_watch.py [--warm-up 150]

Needs root (network namespaces, nftables) and the test bed's etcd and kube-apiserver (``bash
.ci/install --test``). The agent (``nftpolicy agent``, every watch setting at its default:
``--api-timeout 10 --watch-timeout 300 --watch-idle-timeout 130``) reaches a real kube-apiserver
through a TCP proxy on loopback (``tests/stallproxy.py``) and commits into a sandbox node's
network namespace that this script makes, with pods x/a and x/b. For ``--warm-up`` seconds
nothing is written; meanwhile watches of this script (one per kind, straight to the API server,
as the agent's: from a list's resourceVersion with ``allowWatchBookmarks``) record when
kube-apiserver sends each BOOKMARK, and the agent must not give up any watch (the bookmarks keep
its quiet watches alive). Then, right after a burst of bytes from the API server on the
proxied connections (the watches' bookmarks: the worst moment, when every stream has just been
heard), the proxy stops forwarding on every connection open (they stay open, a stuck load
balancer), a deny-all NetworkPolicy is written to the API server directly, and a real TCP
connection from x/a to x/b is tried every 0.5 s until it is refused. Printed: the bookmark
gaps, the seconds from the policy's acceptance to the refused connection, the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nftpolicy.agent.daemon.sources import BOOKMARK_PERIOD, WATCH_IDLE_TIMEOUT  # noqa: E402
from nftpolicy.agent.testbed.controlplane import ControlPlane, write_token_kubeconfig  # noqa: E402
from tests.agentenv import AgentEnv, RealApi  # noqa: E402
from tests.stallproxy import StallProxy  # noqa: E402

KINDS = ("Namespace", "Pod", "NetworkPolicy", "Node", "ClusterNetworkPolicy")
DEFAULTS = ("--api-timeout", "10", "--watch-timeout", "300", "--min-sync-interval", "0.2", "--log-format", "json")
DENY_ALL = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "x", "name": "deny-all"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}


def observe_bookmarks(cp: ControlPlane, kind: str, seen: list[float]) -> None:
    """Watch ``kind`` as the agent does (its default timeoutSeconds, 300, so no deadline
    bookmark comes within the warm-up) and append the time (monotonic) of its start and of
    each BOOKMARK to ``seen``, until the control plane goes."""
    path = cp.path(kind)
    version = cp.request("GET", f"{path}?limit=500")["metadata"]["resourceVersion"]
    request = urllib.request.Request(f"{cp.url}{path}?watch=true&allowWatchBookmarks=true&timeoutSeconds=300"
                                     f"&resourceVersion={version}", headers={"Authorization": f"Bearer {cp.admin_token}"})
    seen.append(time.monotonic())
    try:
        with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=cp.ca_file), timeout=330) as stream:
            for line in stream:
                if json.loads(line)["type"] == "BOOKMARK":
                    seen.append(time.monotonic())
    except OSError:
        pass  # the control plane stopped


def refused(env: AgentEnv) -> bool:
    return not env.connects("x/a", "10.244.0.11")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm-up", type=int, default=190, help="seconds without writes before the stall, at most 290 "
                    "(default %(default)s: three bookmark periods, more than the idle timeout)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    with ControlPlane() as cp, StallProxy(("127.0.0.1", cp.port)) as proxy, tempfile.TemporaryDirectory() as tmp:
        env = AgentEnv(Path(tmp), {"x/a": "10.244.0.10", "x/b": "10.244.0.11"}, DEFAULTS, api=RealApi(cp)).put_slot_pods()
        env.kubeconfig = str(Path(tmp) / "proxied.kubeconfig")
        write_token_kubeconfig(env.kubeconfig, f"https://127.0.0.1:{proxy.port}", cp.ca_file, cp.admin_token, "nftpolicy-admin")
        try:
            bookmarks: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for kind in KINDS:
                threading.Thread(target=observe_bookmarks, args=(cp, kind, bookmarks[kind]), daemon=True).start()
            env.start_agent()
            assert not refused(env), "x/a must reach x/b before the policy"
            time.sleep(args.warm_up)
            for kind, seen in bookmarks.items():
                gaps = [b - a for a, b in zip(seen[1:], seen[2:])]
                print(f"{kind}: bookmarks at {', '.join(f'{t - seen[0]:.1f}' for t in seen[1:]) or 'none'} s after its watch began"
                      + (f" (then {min(gaps):.1f} to {max(gaps):.1f} s apart)" if gaps else ""))
            silent = sum(env.metric("nftpolicy_api_retries_total", kind=kind, reason="silent") for kind in KINDS)
            print(f"watches the agent gave up as silent in {args.warm_up} s without writes: {silent:.0f}")
            # Stall right after the API server's next burst on the proxied connections: every
            # stream has just been heard, so the agent waits its whole idle timeout.
            heard = max(link.answered for link in proxy.links)
            while max(link.answered for link in proxy.links) == heard:
                time.sleep(0.05)
            time.sleep(2.0)  # the other kinds' bookmarks of this round (the cacher sends them within ~2 s)
            stalled = proxy.stall()
            at = time.monotonic()
            quiet = sorted(at - link.answered for link in stalled)
            cp.apply(DENY_ALL)
            accepted = time.monotonic()
            while not refused(env):
                time.sleep(0.5)
                if time.monotonic() - accepted > 400:
                    raise SystemExit("the deny-all was not enforced within 400 s")
            took = time.monotonic() - accepted
            said = [json.loads(line)["msg"] for line in env.log().splitlines()
                    if line.startswith("{") and "API NetworkPolicy watch silent for " in line]
            print(f"stalled {len(stalled)} connections, heard from {quiet[0]:.1f} to {quiet[-1]:.1f} s before; the deny-all "
                  f"accepted {accepted - at:.2f} s after the stall")
            print(f"agent: {said[-1] if said else 'no silent watch logged'}")
            print(f"a new deny-all enforced within {took:.1f} s, not {300 + 10} s (--watch-idle-timeout {WATCH_IDLE_TIMEOUT:.0f}: "
                  f"two bookmark periods of {BOOKMARK_PERIOD:.0f} s and 10 s); load average "
                  f"{' '.join(f'{x:.2f}' for x in load_before)} before, {' '.join(f'{x:.2f}' for x in os.getloadavg())} after "
                  f"({os.cpu_count()} CPUs)")
        finally:
            env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
