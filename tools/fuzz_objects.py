"""The long run of the object fuzzer (tests/objectfuzz.py, issue 29): N clusters, half of them
what the API server accepts and half what it would refuse, each through the agent into the real
libnftables, through ``render`` into ``nft -f`` and through the iptables variant (iptables-nft and
iptables-legacy in turn), in network namespaces this script creates and deletes. Prints the
figures: examples, refused batches, tracebacks, seconds, the load average; exits 1 when anything
was refused or raised (its first few are printed, with the objects that did it).

    sudo .venv/bin/python tools/fuzz_objects.py [--examples 2000] [--seed 1]

Run it under ``flock /tmp/nftpolicy-heavy.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import time
import traceback
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nftpolicy.agent.dataplane import netns  # noqa: E402
from tests import objectfuzz  # noqa: E402

SHOWN = 3  # failures printed in full


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000, help="clusters to try (half accepted by the API server, half refused)")
    parser.add_argument("--seed", type=int, default=1, help="hypothesis' seed (equal seeds, equal clusters)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("fuzz_objects.py: needs root (network namespaces)", file=sys.stderr)
        return 2
    logging.disable(logging.CRITICAL)  # the invalid objects' lines: thousands, and expected
    tag = f"nftp-fuzz{secrets.token_hex(3)}"
    names = {"nft": f"{tag}n", "iptables-nft": f"{tag}i", "iptables-legacy": f"{tag}l"}
    figures = {"examples": 0, "accepted by the API": 0, "refused by the API": 0, "refused batches": 0, "tracebacks": 0}
    failures: list[str] = []
    netns.create(list(names.values()))
    started = time.monotonic()
    try:
        @seed(args.seed)
        @settings(max_examples=args.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck), derandomize=False)
        @given(refused=st.booleans(), data=st.data(), loader=st.sampled_from(["nft", "legacy"]))
        def run(refused: bool, data: st.DataObject, loader: str) -> None:
            objects = data.draw(objectfuzz.refused_by_the_api() if refused else objectfuzz.cluster())
            shown = repr(objects)[:4000]
            figures["examples"] += 1
            figures["refused by the API" if refused else "accepted by the API"] += 1
            try:
                outcome = objectfuzz.trial(objects, names["nft"], names[f"iptables-{loader}"], loader)
            except Exception:
                figures["tracebacks"] += 1
                failures.append(f"traceback:\n{traceback.format_exc()}\nobjects: {shown}")
                return
            if outcome.refused:
                figures["refused batches"] += len(outcome.refused)
                failures.append(f"refused: {outcome.refused}\nobjects: {shown}")

        run()
    finally:
        netns.delete(list(names.values()))
    took = time.monotonic() - started
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    for failure in failures[:SHOWN]:
        print(failure, "\n", file=sys.stderr)
    print(", ".join(f"{value} {name}" for name, value in figures.items()) + f"; {took:.0f} s ({took / max(1, figures['examples']) * 1000:.0f} ms "
          f"an example), load average {load}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
