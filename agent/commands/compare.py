"""``nftpolicy compare``: a kube-router node's dump and nftpolicy's ruleset in twin sandboxes, every difference reported."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from nftpolicy.translators.kuberouter import select

from ..cli import config_from
from ..compare import compare, format_report
from . import load_manifests


def cmd_compare(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cluster = load_manifests(args)
    saves = {"ipv4": Path(args.iptables_save).read_text()} if args.iptables_save else {}
    if args.ip6tables_save:
        saves["ipv6"] = Path(args.ip6tables_save).read_text()
    if not saves:
        print("nftpolicy: give --iptables-save and/or --ip6tables-save", file=sys.stderr)
        return 2
    dump = select(saves, Path(args.ipset_save).read_text(), args.ipset_save)
    report = compare(cluster, args.node, dump, config_from(args), args.timeout, args.loader, args.port or (), args.icmp)
    print(format_report(report))
    return 1 if report.differences else 0
