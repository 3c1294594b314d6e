#!/usr/bin/env python3
"""The hold of unknown pods under a flood (issue 31): a new pod's first connection while another
pod floods unused addresses of the node's pod CIDR, side by side with another checkout.

    .venv/bin/python bench/hold_flood.py [--rounds 10] [--against /tmp/main-src]

Needs root (network namespaces, nftables, iptables-nft). It builds the bed of
``tests/test_unknown_pods.py`` (a node namespace with our table and the hold of unknown pods,
held 2 s; a pod namespace on 10.0.1.0/24 whose addresses are the pods'; a server outside) with
an egress policy that allows the server, then ``--rounds`` times: a new address in the pod
namespace connects to the server, and its pod is committed 0.3 s later (the agent's reaction
time); once quiet and once while the known pod ``old`` sends UDP as fast as one Python process
can to 122 unused addresses of the pod CIDR (each an unknown pod's: held), from 1.5 s before the
first round to the last (the flood program is the test's, ``tests/test_unknown_pods.py``).
Printed for each: the new pods' first connections that connected, how long they took (p50,
max: held 0.3 s and released; a SYN that found the kernel's queue full is dropped and its
retransmission goes through a second later), the flood's packets sent, held by the agent and
dropped by our table over the flooder's budget. With ``--against DIR`` the same runs with that
checkout's code and test bed too, in its own process (``PYTHONPATH``, ``HOLD_FLOOD_TREE``).

Safety: nft and iptables run only in the namespaces the bed makes (deleted afterwards); the
flooder is stopped by its pid.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# the checkout whose code and test bed run (HOLD_FLOOD_TREE: the --against run's)
sys.path.insert(0, os.environ.get("HOLD_FLOOD_TREE", str(Path(__file__).resolve().parents[1])))

from checkouts import git_head, shadow  # noqa: E402  (this bench's folder: the script's own)


def rounds(bed: Any, first: int, count: int) -> list[tuple[bool, float]]:
    """``count`` new pods (addresses 10.0.1.<first>...), each connecting before it is committed."""
    from nftpolicy.agent.dataplane import netns
    from tests.test_unknown_pods import connect_while, pod
    found = []
    for i in range(first, first + count):
        address = f"10.0.1.{i}"
        netns.ip_batch([f"addr add {address}/24 dev eth0"], bed.pod)
        found.append(connect_while(bed, address, lambda: bed.apply("Pod", f"shop/new{i}", pod(f"new{i}", address, "new"))))
    return found


def one_tree(count: int, flood_program: str) -> dict[str, Any]:
    """The quiet and the flooded runs with this process's tree: their figures."""
    from nftpolicy.agent.daemon import rulecounters
    from nftpolicy.agent.dataplane import netns
    from nftpolicy.translators.rules import Config
    from tests.conftest import netns_factory
    from tests.test_unknown_pods import GATEWAY, OLD, Bed, egress_policy
    found: dict[str, Any] = {"load": os.getloadavg()}
    with netns_factory("bench") as make:
        bed = Bed(make, Config(unknown_pods="hold"))
        try:
            netns.ip_batch([f"route add 10.0.1.128/25 via {GATEWAY}"], bed.pod)
            bed.start_hold(seconds=2.0)
            bed.apply("NetworkPolicy", "shop/egress", egress_policy(allow=True))
            found["quiet"] = {"rounds": rounds(bed, 10, count)}
            held_before = bed.count("ingress", "held")
            flood = subprocess.Popen(["ip", "netns", "exec", bed.pod, sys.executable, "-c", flood_program, OLD, str(count * 1.2 + 2)],
                                     stdout=subprocess.PIPE, text=True)
            try:
                time.sleep(1.5)
                flooded = rounds(bed, 10 + count, count)
                sent = int(flood.communicate(timeout=60)[0])
            finally:
                if flood.poll() is None:
                    flood.kill()
                    flood.wait()
            sums = rulecounters.tally(bed.dataplane.counted_rules(), {})
            over = getattr(sums, "over_budget", None)  # absent where the hold has no budget
            found["flood"] = {"rounds": flooded, "sent": sent, "held": bed.count("ingress", "held") - held_before,
                              "over": None if over is None else over[("ingress",)]}
        finally:
            bed.close()
    return found


def figures(run: dict[str, Any]) -> list[str]:
    """One column's cells: connected, p50 and max of the first connections, flood figures."""
    took = sorted(t for _, t in run["rounds"])
    cells = [f"{sum(c for c, _ in run['rounds'])}/{len(run['rounds'])}", f"{took[len(took) // 2] * 1000:.0f} ms",
             f"{took[-1] * 1000:.0f} ms", str(sum(t > 0.9 for t in took))]
    if "sent" in run:
        cells += [str(run["sent"]), f"{run['held']:.0f}", "-" if run["over"] is None else f"{run['over']:.0f}"]
    return cells + ["-"] * (7 - len(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10, help="new pods per run (default %(default)s)")
    ap.add_argument("--against", metavar="DIR", help="also run with the code of the checkout DIR (side by side)")
    ap.add_argument("--one-json", action="store_true", help=argparse.SUPPRESS)  # one tree's runs (the flood program on stdin)
    args = ap.parse_args()
    if args.one_json:
        print(json.dumps(one_tree(args.rounds, sys.stdin.read())))
        return 0
    from tests.test_unknown_pods import FLOOD
    results = {}
    for tree in ([args.against] if args.against else []) + [None]:
        env = dict(os.environ, PYTHONPATH=str(shadow(tree)), HOLD_FLOOD_TREE=str(Path(tree).resolve())) if tree else None
        proc = subprocess.run([sys.executable, __file__, "--one-json", "--rounds", str(args.rounds)], input=FLOOD, capture_output=True,
                              text=True, env=env, timeout=600)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        results[git_head(tree)] = json.loads(proc.stdout.splitlines()[-1])
    print(f"a new pod's first connection (held until committed 0.3 s in, allowed), {args.rounds} pods per run; "
          "flood: the known pod 'old' sending UDP to unused pod-CIDR addresses as fast as one Python process can")
    for tree, found in results.items():
        print(f"  {tree}: load average {' '.join(f'{x:.2f}' for x in found['load'])} at its start ({os.cpu_count()} CPUs)")
    labels = ["first connections connected", "first connection p50", "first connection max", "retransmitted (> 0.9 s)",
              "flood packets sent", "flood packets held", "flood dropped over budget"]
    columns = {f"{tree} {variant}": figures(found[variant]) for tree, found in results.items() for variant in ("quiet", "flood")}
    print(" " * 30 + "".join(f"{name:>17}" for name in columns))
    for i, label in enumerate(labels):
        print(f"{label:<30}" + "".join(f"{cells[i]:>17}" for cells in columns.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
