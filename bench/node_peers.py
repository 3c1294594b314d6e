"""What a Node change costs the node renderer with ClusterNetworkPolicy ``nodes`` peers: one
Node relabelled (into and out of a selector) and one Node readdressed, at 100, 1,000 and 5,000
Nodes, side by side in one run. In process, no kernel.

    .venv/bin/python bench/node_peers.py [--sizes 100,1000,5000] [--selectors 20] [--changes 200]

The cluster: 100 pods in 10 namespaces on node0, ``--selectors`` Admin ClusterNetworkPolicies,
each with an egress Accept to the Nodes of one ``zone`` on TCP 10250 and a Deny to every Node
(one shared set for all of them). Node i has ``zone=z<i % selectors>`` and an InternalIP and an
ExternalIP. A change is one Node at a time (its ``take_changes`` included); the figures are the
median and the maximum over ``--changes`` changes, and the ratio of the median to the smallest
size's: near 1 when a Node change costs what it touches (its addresses in the sets whose
selector matches it), not the number of Nodes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from nftpolicy.translators.clusterpolicy import cluster_policy_from
from nftpolicy.translators.model import Cluster, Namespace, Node, Pod
from nftpolicy.translators.noderender import NodeRenderer
from nftpolicy.translators.selectors import labels_of


def cluster(nodes: int, selectors: int) -> Cluster:
    """The cluster described in the module docstring, with ``nodes`` Nodes."""
    namespaces = {f"ns{i}": Namespace(f"ns{i}", labels_of({"kubernetes.io/metadata.name": f"ns{i}"})) for i in range(10)}
    pods = {f"ns{i % 10}/p{i}": Pod(f"ns{i % 10}", f"p{i}", labels_of({"app": f"a{i % 7}"}), "node0", (f"10.244.{i // 250}.{i % 250 + 1}",))
            for i in range(100)}
    policies = {}
    for i in range(selectors):
        policy = cluster_policy_from({
            "apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": f"zone-{i}"},
            "spec": {"tier": "Admin", "priority": i, "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": f"ns{i % 10}"}}},
                     "egress": [{"action": "Accept", "to": [{"nodes": {"matchLabels": {"zone": f"z{i}"}}}],
                                 "protocols": [{"tcp": {"destinationPort": {"number": 10250}}}]},
                                {"action": "Deny", "to": [{"nodes": {}}]}]}})
        policies[policy.name] = policy
    return Cluster(namespaces=namespaces, pods=pods, cluster_policies=policies,
                   nodes={n.name: n for n in (node(i, selectors) for i in range(nodes))})


def node(i: int, selectors: int, zone: int | None = None, last: int = 0) -> Node:
    """Node ``n<i>`` in zone ``zone`` (default ``i % selectors``), addresses ending in ``last``."""
    addresses = (f"172.{16 + i // 65536}.{i // 256 % 256}.{i % 256}", f"198.{18 + last}.{i // 256 % 256}.{i % 256}")
    return Node(f"n{i}", addresses, labels=labels_of({"zone": f"z{i % selectors if zone is None else zone}"}), peer_addresses=addresses)


def timed(renderer: NodeRenderer, changes: list[Node]) -> tuple[float, float]:
    """Median and maximum milliseconds of applying ``changes`` one at a time."""
    times = []
    for changed in changes:
        started = time.perf_counter()
        renderer.set_node(changed.name, changed)
        renderer.take_changes()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000, max(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,5000", help="Node counts, comma-separated")
    parser.add_argument("--selectors", type=int, default=20, help="ClusterNetworkPolicies, one zone selector each")
    parser.add_argument("--changes", type=int, default=200, help="Node changes measured per size and kind")
    args = parser.parse_args()
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; {args.selectors} selectors; "
          f"median / max ms per Node change (take_changes included)")
    baseline: dict[str, float] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        renderer = NodeRenderer("node0").load(cluster(size, args.selectors))
        sets, elements = renderer.sets.counts()
        picked = [i * size // args.changes for i in range(args.changes)] if size >= args.changes else list(range(size))
        relabel = [node(i, args.selectors, zone=(i + 1) % args.selectors) for i in picked]
        readdress = [node(i, args.selectors, zone=(i + 1) % args.selectors, last=1) for i in picked]
        row = []
        for kind, changes in (("relabel", relabel), ("readdress", readdress)):
            median, most = timed(renderer, changes)
            baseline.setdefault(kind, median)
            row.append(f"{kind} {median:.3f} / {most:.3f} ms (x{median / baseline[kind]:.2f})")
        print(f"{size:>6} nodes, {sets} sets, {elements} elements: " + "; ".join(row))
    print("(xN: the median over the smallest size's; 1: a Node change costs the same whatever the number of Nodes)")


if __name__ == "__main__":
    main()
