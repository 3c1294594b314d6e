"""libnftables: the one place that talks to the kernel's nftables (through Debian's python3-nftables).

Every call takes a JSON batch (libnftables-json(5)) that the kernel commits as one transaction:
it lands whole or not at all.
"""

from __future__ import annotations

import ctypes
from contextlib import nullcontext as _nothing
from typing import Any

import nftables
import orjson


class NftError(RuntimeError):
    """libnftables refused a batch; the kernel still holds the ruleset it had before."""


def run_json(batch: dict[str, Any]) -> dict[str, Any]:
    """Commit ``batch`` (``{"nftables": [...]}``) in the current network namespace.

    Returns libnftables' JSON answer (empty dict when it printed nothing). Raises NftError with
    libnftables' error text.
    """
    nft = nftables.Nftables()
    nft.set_json_output(True)  # JSON in and out (libnftables reads its input as JSON then)
    rc, output, error = nft.cmd(orjson.dumps(batch).decode())
    if rc != 0:
        raise NftError(str(error).strip() or f"libnftables returned {rc}")
    return orjson.loads(output) if output else {}


def release_memory() -> None:
    """Give the memory that a big commit freed back to the system (glibc ``malloc_trim(0)``):
    libnftables' JSON parsing and netlink buffers otherwise keep the process at about twice its
    model's size. A no-op where the C library has no malloc_trim."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def remove_table(table: str, netns_name: str | None = None) -> bool:
    """Delete ``inet <table>`` if it exists (inside ``netns_name`` if given); True if it did.

    Only that table is named; no other table is listed or changed.
    """
    from . import netns

    batch = {"nftables": [{"delete": {"table": {"family": "inet", "name": table}}}]}
    probe = {"nftables": [{"list": {"table": {"family": "inet", "name": table}}}]}
    with netns.entered(netns_name) if netns_name else _nothing():
        try:
            run_json(probe)
        except NftError:
            return False
        run_json(batch)
        return True


# Each nft feature the ruleset needs, as a batch the kernel must accept (DESIGN.md section 2).
FEATURE_PROBES = {
    "inet family table with filter base chains (nf_tables, nf_tables_inet)":
        "add chain inet {t} probe_0 {{ type filter hook forward priority 0; policy accept; }}",
    "verdict maps (nft_lookup, nft_immediate)":
        "add map inet {t} m {{ type ipv4_addr : verdict; }}\nadd chain inet {t} probe_1\nadd rule inet {t} probe_1 ip daddr vmap @m",
    "interval sets (nft_set_rbtree)":
        "add set inet {t} s {{ type ipv4_addr; flags interval; elements = {{ 10.0.0.0/8 }}; }}",
    "concatenated sets (nft_set_hash)":
        "add set inet {t} n {{ type ipv4_addr . inet_proto . inet_service; elements = {{ 10.0.0.1 . tcp . 80 }}; }}",
    "fib expression (nft_fib_inet)": "add chain inet {t} probe_2\nadd rule inet {t} probe_2 fib saddr type local accept",
    "conntrack state (nft_ct)": "add chain inet {t} probe_3\nadd rule inet {t} probe_3 ct state established,related accept",
    "meta mark (nft_meta)": "add chain inet {t} probe_4\nadd rule inet {t} probe_4 meta mark set meta mark | 0x10000",
    "reject (nft_reject_inet)": "add chain inet {t} probe_5\nadd rule inet {t} probe_5 meta l4proto tcp reject with tcp reset\nadd rule inet {t} probe_5 reject",
    "rate limit and NFLOG (nft_limit, nft_log, nfnetlink_log)":
        "add chain inet {t} probe_6\nadd rule inet {t} probe_6 limit rate 10/minute burst 10 packets log group 100",
}


def missing_features(table: str = "nftpolicy-feature-check") -> list[str]:
    """The nft features from :data:`FEATURE_PROBES` that this kernel and libnftables refuse,
    each with libnftables' reason; empty when all work.

    Every probe is a dry run (``nft --check``): the kernel validates the batch and commits
    nothing.
    """
    missing = []
    for feature, commands in FEATURE_PROBES.items():
        nft = nftables.Nftables()
        nft.set_dry_run(True)
        rc, _, error = nft.cmd(f"add table inet {table}\n" + commands.format(t=table))
        if rc != 0:
            missing.append(f"{feature}: {error.strip().splitlines()[0] if error.strip() else rc}")
    return missing
