"""What ClusterNetworkPolicies cost the node renderer: full render and one pod change, with 0, 50
and 200 ClusterNetworkPolicies over the 10,000-pod / 1,000-policy synthetic cluster (110 pods on
the rendered node). In process, no kernel.

    .venv/bin/python bench/cluster_policies.py [--counts 0,50,200] [--changes 100]

Each ClusterNetworkPolicy (half Admin, half Baseline, priorities 0-6) selects the namespaces of
one ``env`` (a third of them) and has one ingress rule (Accept, Deny or Pass from one team's
namespaces on TCP 8080) and one egress rule (Deny to the metadata address). A pod change adds a
label to one pod (local: its pod chain is refreshed; remote: set elements only); figures are the
median and the maximum over ``--changes`` changes, each including ``take_changes``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from synthetic import generate  # noqa: E402

from nftpolicy.translators.clusterpolicy import cluster_policy_from  # noqa: E402
from nftpolicy.translators.model import ClusterNetworkPolicy, Pod  # noqa: E402
from nftpolicy.translators.noderender import NodeRenderer  # noqa: E402


def cluster_policies(count: int) -> dict[str, ClusterNetworkPolicy]:
    """``count`` ClusterNetworkPolicies of the shape above, by name."""
    found = {}
    for i in range(count):
        policy = cluster_policy_from({
            "apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": f"cnp-{i}"},
            "spec": {"tier": "Admin" if i % 2 else "Baseline", "priority": i % 7,
                     "subject": {"namespaces": {"matchLabels": {"env": ["prod", "dev", "staging"][i % 3]}}},
                     "ingress": [{"action": ["Accept", "Deny", "Pass"][i % 3],
                                  "from": [{"namespaces": {"matchLabels": {"team": f"team{i % 5}"}}}],
                                  "protocols": [{"tcp": {"destinationPort": {"number": 8080}}}]}],
                     "egress": [{"action": "Deny", "to": [{"networks": ["169.254.169.254/32"]}]}]}})
        found[policy.name] = policy
    return found


def changes(renderer: NodeRenderer, pods: list[Pod], count: int) -> tuple[float, float]:
    """Median and maximum milliseconds of ``count`` label changes of ``pods``."""
    times = []
    for i, pod in enumerate(pods[:count]):
        started = time.perf_counter()
        renderer.set_pod(pod.key, dataclasses.replace(pod, labels={**pod.labels, "bench": str(i)}))
        renderer.take_changes()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000, max(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="0,50,200", help="numbers of ClusterNetworkPolicies, comma-separated")
    parser.add_argument("--changes", type=int, default=100)
    args = parser.parse_args()
    base = generate(pods=10000, policies=1000, namespaces=100).cluster
    print("| ClusterNetworkPolicies | full render | tier chains | local pod change p50 / max | remote pod change p50 / max |")
    print("|---|---|---|---|---|")
    for count in (int(c) for c in args.counts.split(",")):
        cluster = dataclasses.replace(base, cluster_policies=cluster_policies(count))
        started = time.perf_counter()
        renderer = NodeRenderer("node-0").load(cluster)
        model = renderer.model()
        renderer.take_changes()
        full = time.perf_counter() - started
        local = [p for p in cluster.pods.values() if p.node == "node-0" and p.enforceable]
        remote = [p for p in cluster.pods.values() if p.node != "node-0" and p.enforceable]
        lp50, lmax = changes(renderer, local, args.changes)
        rp50, rmax = changes(renderer, remote, args.changes)
        print(f"| {count} | {full:.2f} s | {len(model.tier_chains)} | {lp50:.2f} / {lmax:.1f} ms | {rp50:.2f} / {rmax:.2f} ms |")


if __name__ == "__main__":
    main()
