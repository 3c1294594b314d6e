"""``nftpolicy cleanup``: delete our table and the hold chains (of DNS answers, of unknown pods'
packets), and nothing else."""

from __future__ import annotations

import argparse

from nftpolicy.agent.cli.flags import check_exists
from nftpolicy.agent.daemon import podhold
from nftpolicy.agent.daemon.dnshold import HOLD_CHAIN, remove_hold_chain
from nftpolicy.agent.dataplane.nftables import NftDataplane


def cmd_cleanup(args: argparse.Namespace) -> int:
    check_exists("--netns", args.netns)
    removed = NftDataplane(args.table, args.netns).remove()
    print(f"removed table inet {args.table}" if removed else f"no table inet {args.table}")
    if remove_hold_chain(args.netns):  # left by an agent's shutdown (docs/domain-names.md); with fail-closed it drops DNS answers
        print(f"removed chain {HOLD_CHAIN} (iptables-nft)")
    if podhold.remove_pod_hold_chain(args.netns):  # left by an agent's shutdown: it queues to nobody, so the kernel drops
        print(f"removed chain {podhold.HOLD_CHAIN} (iptables-nft)")
    return 0
