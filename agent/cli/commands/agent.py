"""``nftpolicy agent``: the node agent (the flags checked here; the wiring is :mod:`nftpolicy.agent.daemon.main`)."""

from __future__ import annotations

import argparse
import sys

from nftpolicy.agent import interrupts
from nftpolicy.agent.cli.flags import check_exists, config_from


def cmd_agent(args: argparse.Namespace) -> int:
    with interrupts.deferred():  # imports the Kubernetes client only for this command
        from nftpolicy.agent.daemon.main import run_agent
        from nftpolicy.agent.daemon.sources import SourceError

    if not args.node:
        print("nftpolicy: --node (or $NODE_NAME) is required", file=sys.stderr)
        return 2
    if args.kubeconfig and args.manifests:
        print("nftpolicy: --kubeconfig and --manifests exclude each other", file=sys.stderr)
        return 2
    for flag in ("--kubeconfig", "--manifests", "--netns"):
        check_exists(flag, getattr(args, flag[2:]))
    try:
        return run_agent(args, config_from(args))
    except SourceError as exc:
        print(f"nftpolicy: {exc}", file=sys.stderr)
        return 2
