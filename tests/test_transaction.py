"""The typed transaction prints the libnftables JSON the agent sent before it existed.

``tests/golden/transactions.txt`` holds the JSON batches that the reconciler's hand-built JSON
(``nft.replace_transaction`` for the full sync, ``nftchanges.changes_transaction`` for the
delta) gave for the syncs of :func:`scenarios`, recorded once from that code: a full sync, then
deltas of random changes on three nodes. The order of a delta's commands follows the renderer's
dicts and sets of strings, so both the recording and the check run with ``PYTHONHASHSEED=0``
(in a child process).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from typing import Iterator

from nftpolicy.translators import delta, layout, nft, nfttext, transaction
from nftpolicy.translators.noderender import NodeRenderer
from nftpolicy.translators.transaction import ChainRule, Elements, OurTable, SetName, Transaction

from .conftest import REPO
from .test_incremental import CONFIG, START, _apply, _mutate

GOLDEN = REPO / "tests" / "golden" / "transactions.txt"


def scenarios() -> Iterator[tuple[str, list[Transaction]]]:
    """(name, transactions) for a few nodes and seeds: a full sync as the reconciler makes it
    (only the first scenario's), then the deltas of random changes, two per sync."""
    for node, seed in (("node1", 1), ("node2", 7), (None, 3)):
        rng = random.Random(seed)
        cluster = START
        renderer = NodeRenderer(node, CONFIG).load(cluster)
        renderer.take_changes()
        steps = [transaction.full(renderer.model(ordered=False))] if seed == 1 else []
        for _ in range(6):
            for _ in range(2):
                kind, key, obj = _mutate(cluster, rng)
                cluster = _apply(cluster, kind, key, obj)
                renderer.apply(kind, key, obj)
            steps.append(delta.delta_transaction(CONFIG, renderer.take_changes()))
        yield f"{node}-seed{seed}", steps


def golden_text() -> str:
    """``# <scenario> sync <i> (full|delta)``, then one compact JSON command per line, per sync."""
    lines = []
    for name, steps in scenarios():
        for i, tx in enumerate(steps):
            full = any(isinstance(op, transaction.Replace) for op in tx.operations)
            lines.append(f"# {name} sync {i} ({'full' if full else 'delta'})")
            lines += [json.dumps(c, separators=(",", ":")) for c in nft.transaction_json(tx)["nftables"]]
    return "\n".join(lines) + "\n"


def test_full_and_delta_print_the_recorded_json():
    printed = subprocess.run([sys.executable, "-m", "tests.test_transaction"], cwd=REPO, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": "0"}).stdout
    assert printed == GOLDEN.read_text()


def test_summary_counts_the_printed_commands():
    for _, steps in scenarios():
        for tx in steps:
            commands = nft.transaction_json(tx)["nftables"]
            assert tx.commands() == len(commands)
            assert sorted(tx.summary().elements()) == sorted(f"{verb} {next(iter(body))}" for c in commands for verb, body in c.items())


def test_every_operation_prints_as_nft_text():
    tx = Transaction("t", 0)
    chain = layout.Chain("c", (), "forward")
    rule = layout.Rule((layout.AddressInSet("ipv4", "saddr", "s"), layout.VerdictStatement("accept")), "why")
    s = transaction.AddressSet("s", "ipv4", "interval", ("10.0.0.0/8",), "nets")
    for op in (OurTable(), s, chain, ChainRule("c", rule), Elements("s", ("10.1.0.0/16",))):
        tx.add(op)
    tx.flush(chain)
    tx.delete(chain)
    tx.delete(SetName("s"))
    assert nfttext.transaction_text(tx).splitlines() == [
        "add table inet t",
        'add set inet t s { type ipv4_addr; flags interval; comment "nets"; elements = { 10.0.0.0/8 }; }',
        "add chain inet t c { type filter hook forward priority 0; policy accept; }",
        'add rule inet t c ip saddr @s accept comment "why"',
        "add element inet t s { 10.1.0.0/16 }",
        "flush chain inet t c",
        "delete chain inet t c",
        "delete set inet t s",
    ]


if __name__ == "__main__":
    sys.stdout.write(golden_text())
