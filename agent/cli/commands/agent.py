"""``nftpolicy agent``: the node agent (the flags checked here; the wiring is :mod:`nftpolicy.agent.daemon.main`)."""

from __future__ import annotations

import argparse
import sys

from nftpolicy.agent import interrupts
from nftpolicy.agent.cli.flags import check_exists, config_from
from nftpolicy.agent.daemon.memory import gc_paused


def cmd_agent(args: argparse.Namespace) -> int:
    # Imports the Kubernetes client only for this command; without the cyclic garbage collector:
    # the imports make objects that all stay alive, and collections over them took a fifth of the
    # imports' CPU (0.15-0.2 s of every start here).
    with interrupts.deferred(), gc_paused():
        from nftpolicy.agent.daemon.main import run_agent
        from nftpolicy.agent.daemon.sources import SourceError

    if not args.node:
        print("nftpolicy: --node (or $NODE_NAME) is required", file=sys.stderr)
        return 2
    if args.kubeconfig and args.manifests:
        print("nftpolicy: --kubeconfig and --manifests exclude each other", file=sys.stderr)
        return 2
    if args.metrics_secure and args.manifests:
        print("nftpolicy: --metrics-secure checks tokens with the Kubernetes API: not with --manifests", file=sys.stderr)
        return 2
    if bool(args.tls_cert_file) != bool(args.tls_private_key_file):
        print("nftpolicy: --tls-cert-file and --tls-private-key-file go together", file=sys.stderr)
        return 2
    if args.tls_cert_file and not args.metrics_secure:
        print("nftpolicy: --tls-cert-file is for --metrics-secure true, which is off", file=sys.stderr)
        return 2
    for flag in ("--kubeconfig", "--manifests", "--netns", "--tls-cert-file", "--tls-private-key-file"):
        check_exists(flag, getattr(args, flag[2:].replace("-", "_")))
    try:
        return run_agent(args, config_from(args))
    except SourceError as exc:
        print(f"nftpolicy: {exc}", file=sys.stderr)
        return 2
