"""``nftpolicy render``: the ruleset for one node's pods, as nft text, libnftables JSON or the iptables variant."""

from __future__ import annotations

import argparse
import sys
import time

from nftpolicy.translators import iptables as iptables_render
from nftpolicy.translators import nft, nfttext
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import RuleModel

from nftpolicy.agent.cli.flags import config_from
from nftpolicy.agent.daemon.memory import gc_paused
from . import cluster_warnings, read_manifests, warn


class Progress:
    """One status line on stderr, rewritten in place, for steps that take a while; only when
    stderr is a terminal (never in logs or pipes). :meth:`done` erases it."""

    def __init__(self) -> None:
        self.shown = sys.stderr.isatty()
        self.started = time.monotonic()

    def step(self, text: str) -> None:
        if self.shown:
            sys.stderr.write(f"\r\033[Knftpolicy: {text} ({time.monotonic() - self.started:.1f} s)")
            sys.stderr.flush()

    def done(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def cmd_render(args: argparse.Namespace) -> int:
    progress = Progress()
    try:
        with gc_paused():  # one bulk load whose objects all live to the end
            progress.step("reading the manifests")
            read = read_manifests(args, [args.node] if args.node else [])
            cluster = read.cluster
            warn(cluster_warnings(cluster, [args.node] if args.node else []), args.strict)
            progress.step(f"rendering {len(cluster.pods):,} pods, {len(cluster.policies):,} policies")
            model = build_rule_model(cluster, args.node, config_from(args))
            progress.step("printing")
            _print_model(args.format, model)
    finally:
        progress.done()
    return read.finish(args, 0)


def _print_model(format: str, model: RuleModel) -> None:
    if format == "iptables":
        sys.stdout.write(iptables_render.to_restore(model, "ipv4"))
    elif format == "ip6tables":
        sys.stdout.write(iptables_render.to_restore(model, "ipv6"))
    elif format == "ipset":
        sys.stdout.write(iptables_render.to_ipset(model))
    else:
        sys.stdout.write(nfttext.to_text(model) if format == "nft" else nft.to_json(model) + "\n")
