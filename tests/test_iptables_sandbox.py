"""``nftpolicy sandbox --dataplane nft|iptables|nft,iptables``: twin sandboxes, every disagreeing cell
printed, exit code 1 on any."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from nftpolicy.agent.cli.main import main
from nftpolicy.translators import iptables as render
from nftpolicy.translators import layout

from .conftest import CONFORMANCE, REPO

pytestmark = pytest.mark.kernel
NFTPOLICY = str(Path(sys.executable).parent / "nftpolicy")
EXAMPLE = str(REPO / "examples" / "shop")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([NFTPOLICY, *args], capture_output=True, text=True, timeout=120)


def test_both_dataplanes_agree_on_the_example():
    out = run("sandbox", "--dataplane", "nft,iptables", "--node", "node1", "--node", "node2", EXAMPLE)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dataplanes: nft and iptables-nft (twin sandboxes)" in out.stdout
    assert "nft and iptables-nft agree on every cell" in out.stdout and "DISAGREE" not in out.stdout


def test_iptables_dataplane_replays_a_case_with_the_legacy_loader():
    case = str(CONFORMANCE / "027-ingress-egress-together.yaml")
    out = run("sandbox", "--dataplane", "iptables", "--iptables-loader", "legacy", case)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "probed cells match the expected matrices" in out.stdout
    both = run("sandbox", "--dataplane", "nft,iptables", case)
    assert both.returncode == 0 and "nft and iptables-nft agree on every cell" in both.stdout


def test_a_disagreement_is_printed_and_fails(monkeypatch, capsys):
    """Break the iptables variant on purpose (its policy chains never mark): every cell that only a
    policy allows must be reported as a disagreement."""
    original = render.to_restore

    def broken(table, family="ipv4"):
        chains = {c.name for c in table.chains if c.name.startswith("KUBE-NWPLCY-") and c.name not in (layout.COMMON_CHAIN, layout.DEFAULT_CHAIN)}
        return "\n".join(line for line in original(table, family).splitlines()
                         if not (line.split()[1:2] and line.split()[1] in chains)) + "\n"

    monkeypatch.setattr(render, "to_restore", broken)
    rc = main(["sandbox", "--dataplane", "nft,iptables", EXAMPLE])
    out = capsys.readouterr().out
    assert rc == 1
    assert re.search(r"^DISAGREE TCP/8080 ipv4 shop/frontend-7d9c8b6f5-x2k4p -> shop/api-5f6b7c9d4-q8w2n: "
                     r"nft allowed, iptables-nft blocked$", out, re.M), out
    assert re.search(r"^(1 cell differs|\d+ cells differ) between nft and iptables-nft$", out, re.M)
