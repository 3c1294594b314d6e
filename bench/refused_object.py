"""What a policy the kernel refuses costs a fresh node's first sync (issue 29): the full sync of
a synthetic cluster alone, then with ``k`` ClusterNetworkPolicies whose rule names hold a NUL
byte, printed with the text rule of before (so that libnftables really refuses the batch, as
it did), each committed by the reconcile loop into the real kernel in a network namespace this
script creates. Prints, per size and k: the sync's duration, the dry runs the search made and
their time, the policies searched (n), and whether the refused ones were found exactly.

    sudo .venv/bin/python bench/refused_object.py [--sizes 1k,10k] [--bad 1,3]

Run it under ``flock /tmp/nftpolicy-heavy.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import secrets
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import synthetic  # noqa: E402

from nftpolicy.agent.dataplane import netns  # noqa: E402
from nftpolicy.agent.dataplane.nftables import NftDataplane  # noqa: E402
from nftpolicy.agent.daemon.health import Health  # noqa: E402
from nftpolicy.agent.daemon.metrics import Metrics  # noqa: E402
from nftpolicy.agent.daemon.reconcile import Reconciler  # noqa: E402
from nftpolicy.translators import chainbuilders, nft  # noqa: E402
from nftpolicy.translators.clusterpolicy import cluster_policy_from  # noqa: E402
from nftpolicy.translators.model import Cluster  # noqa: E402
from nftpolicy.translators.rules import Config  # noqa: E402

SIZES = {"1k": (1_000, 300, 40), "10k": (10_000, 1_000, 150)}  # pods, policies, namespaces


class Snapshot:
    """The store's side the reconcile loop reads, over a fixed cluster."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster, self.pending_since, self.reported = cluster, None, []

    def take(self) -> tuple[Cluster, None]:
        return self.cluster, None

    def report_refused(self, kind: str, key: str, reason: str) -> None:
        self.reported.append(key)


class Counted(NftDataplane):
    """libnftables, counting and timing the dry runs."""

    checks, check_seconds = 0, 0.0

    def check(self, tx: Any) -> None:
        started = time.monotonic()
        try:
            super().check(tx)
        finally:
            self.checks += 1
            self.check_seconds += time.monotonic() - started


def before(text: str, limit: int = 128) -> str:
    """The text rule of before issue 29: double quotes replaced, control characters kept."""
    return text.replace('"', "'").encode()[:limit].decode(errors="ignore")


def bad_policies(k: int) -> dict[str, Any]:
    """``k`` Admin ClusterNetworkPolicies over every namespace, each with a rule named with a NUL."""
    found = {}
    for i in range(k):
        policy = cluster_policy_from({
            "apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": f"bad-{i}"},
            "spec": {"tier": "Admin", "priority": 10 + i, "subject": {"namespaces": {}},
                     "egress": [{"name": f"no\x00metadata-{i}", "action": "Deny", "to": [{"networks": ["169.254.169.254/32"]}]}]}})
        found[policy.name] = policy
    return found


def one(cluster: Cluster, k: int, ns: str) -> dict[str, Any]:
    dataplane = Counted("nftpolicy", ns)
    dataplane.remove()  # a fresh node
    store = Snapshot(dataclasses.replace(cluster, cluster_policies=bad_policies(k)))
    reconciler = Reconciler(store, Config(), "node-0", Metrics(), Health(30.0), 0.0, 3600.0, dataplane)  # type: ignore[arg-type]
    started = time.monotonic()
    committed = reconciler.sync(full=True)
    took = time.monotonic() - started
    suspects = len({c.policy for c in reconciler.renderer.model().policy_chains} | {c.policy for c in reconciler.renderer.model().tier_chains}) \
        if reconciler.renderer else 0
    return {"committed": committed, "ms": took * 1000, "checks": dataplane.checks, "check_ms": dataplane.check_seconds * 1000,
            "n": suspects, "found": sorted(store.reported) == [f"bad-{i}" for i in range(k)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1k,10k")
    parser.add_argument("--bad", default="1,3", help="numbers of refused policies to try (0 is always run)")
    args = parser.parse_args()
    nft.comment = chainbuilders.comment = before  # type: ignore[assignment]  # the printer of before: a real refusal
    ns = f"nftp-refused{secrets.token_hex(3)}"
    netns.create([ns])
    try:
        for size in args.sizes.split(","):
            pods, policies, namespaces = SIZES[size]
            cluster = synthetic.generate(pods=pods, policies=policies, namespaces=namespaces).cluster
            for k in [0] + [int(b) for b in args.bad.split(",")]:
                r = one(cluster, k, ns)
                bound = 1 + 2 * k * math.ceil(math.log2(max(2, r["n"]))) if k else 0
                print(f"{size} pods, {k} refused: sync {'committed' if r['committed'] else 'FAILED'} in {r['ms']:.0f} ms; "
                      f"{r['checks']} dry runs ({r['check_ms']:.0f} ms, bound {bound}) over n = {r['n']} policies; "
                      f"found exactly the refused ones: {r['found'] if k else '-'}", flush=True)
    finally:
        netns.delete([ns])
    with open("/proc/loadavg") as f:
        print("load average", " ".join(f.read().split()[:3]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
