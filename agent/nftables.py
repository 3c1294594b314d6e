"""libnftables: the one place that talks to the kernel's nftables (through Debian's python3-nftables).

Every call takes a JSON batch (libnftables-json(5)) that the kernel commits as one transaction:
it lands whole or not at all.
"""

from __future__ import annotations

import json
from typing import Any

import nftables


class NftError(RuntimeError):
    """libnftables refused a batch; the kernel still holds the ruleset it had before."""


def run_json(batch: dict[str, Any]) -> dict[str, Any]:
    """Commit ``batch`` (``{"nftables": [...]}``) in the current network namespace.

    Returns libnftables' JSON answer (empty dict when it printed nothing). Raises NftError with
    libnftables' error text.
    """
    nft = nftables.Nftables()
    nft.set_json_output(True)
    rc, output, error = nft.json_cmd(batch)
    if rc != 0:
        raise NftError(str(error).strip() or f"libnftables returned {rc}")
    return output if isinstance(output, dict) else (json.loads(output) if output else {})


def run_text(command: str) -> str:
    """Run one nft command in text syntax (``list table inet nftpolicy``) and return its output.

    Raises NftError with libnftables' error text.
    """
    nft = nftables.Nftables()
    rc, output, error = nft.cmd(command)
    if rc != 0:
        raise NftError(error.strip() or f"libnftables returned {rc}")
    return output
