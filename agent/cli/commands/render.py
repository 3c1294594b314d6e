"""``nftpolicy render``: the ruleset for one node's pods, as nft text, libnftables JSON or the iptables variant."""

from __future__ import annotations

import argparse
import sys
import time

from nftpolicy.translators import iptables as iptables_render
from nftpolicy.translators import layout, nft, nfttext
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import RuleModel

from nftpolicy.agent.cli.flags import config_from
from nftpolicy.agent.daemon.memory import gc_paused
from . import Manifests, cluster_warnings, plural, read_manifests, warn


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
            if read.empty and not read.skipped and not args.accept_skipped:  # no table for an input of nothing at all
                return read.finish(args, 0)
            cluster = read.cluster
            warn(cluster_warnings(cluster, [args.node] if args.node else []), args.strict)
            without = without_address_line(read)
            if without:
                print(f"nftpolicy: {without}", file=sys.stderr)
            progress.step(f"rendering {len(cluster.pods):,} pods, {len(cluster.policies):,} policies")
            model = build_rule_model(cluster, args.node, config_from(args), unions=False)  # printed: only what the kernel gets
            progress.step("printing")
            _print_model(args.format, model)
    finally:
        progress.done()
    return read.finish(args, 0)


def without_address_line(read: Manifests) -> str:
    """The line that says which pods render leaves out for want of an address (``status.podIP``;
    hostNetwork and finished pods need none), or ``""``: render does what an agent does, which
    renders a pod once it has its address; it gives none of its own (``sandbox`` and ``explain``
    do, :func:`~nftpolicy.translators.workloads.place_pods`), since a ruleset is applied to real
    addresses. Workloads' stand-in pods never have one."""
    bare = {key for key, pod in read.cluster.pods.items() if not pod.ips and not pod.host_network
            and pod.phase not in ("Succeeded", "Failed")}
    if not bare:
        return ""
    workloads = [s for s in read.stand_ins if bare.intersection(s.pods)]
    of_workloads = sum(len(bare.intersection(s.pods)) for s in workloads)
    among = (f" ({of_workloads} of them {plural(of_workloads, 'stands', 'stand')} in for "
             f"{len(workloads)} {plural(len(workloads), 'workload', 'workloads')})") if workloads else ""
    return (f"{len(bare)} {plural(len(bare), 'pod has', 'pods have')} no address{among}: render leaves "
            f"{plural(len(bare), 'it', 'them')} out (no pod chain, no set entry), as an agent does until a pod has one; "
            f"sandbox and explain give such pods stand-in addresses")


def _print_model(format: str, model: RuleModel) -> None:
    if format == "iptables":
        sys.stdout.write(iptables_render.to_restore(layout.table(model), "ipv4"))
    elif format == "ip6tables":
        sys.stdout.write(iptables_render.to_restore(layout.table(model), "ipv6"))
    elif format == "ipset":
        sys.stdout.write(iptables_render.to_ipset(layout.table(model)))
    else:
        sys.stdout.write(nfttext.to_text(model) if format == "nft" else nft.to_json(model) + "\n")
