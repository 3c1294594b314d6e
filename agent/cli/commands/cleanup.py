"""``nftpolicy cleanup``: delete our table, and nothing else."""

from __future__ import annotations

import argparse

from nftpolicy.agent.cli.flags import check_exists
from nftpolicy.agent.dataplane.nftables import NftDataplane


def cmd_cleanup(args: argparse.Namespace) -> int:
    check_exists("--netns", args.netns)
    removed = NftDataplane(args.table, args.netns).remove()
    print(f"removed table inet {args.table}" if removed else f"no table inet {args.table}")
    return 0
