"""``nftpolicy compare``: a kube-router node's dump and nftpolicy's ruleset in twin sandboxes, every difference reported."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Collection

from nftpolicy.translators.kuberouter import DumpError, select
from nftpolicy.translators.model import Cluster

from nftpolicy.agent.cli.flags import config_from
from nftpolicy.agent.testbed.compare import compare, format_report
from nftpolicy.agent.testbed.probes import ProbeSpec
from . import cluster_warnings, read_manifests, warn


def read_dump(flag: str, path: str) -> str:
    """The text of the dump file given to ``flag``. Raises DumpError, naming the flag, when it
    cannot be read (missing, a directory, no permission) or is not text (a binary file, a
    compressed dump)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise DumpError(f"{flag} {path}: {exc.strerror.lower() if exc.strerror else exc}") from None
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise DumpError(f"{flag} {path}: not a text dump (not UTF-8 at byte {exc.start}); "
                        f"give the output of {flag[2:].replace('ipset-save', 'ipset save')}") from None
    if "\0" in text:
        raise DumpError(f"{flag} {path}: not a text dump (a NUL byte at byte {text.index(chr(0))})")
    return text


def dump_of_another_node(cluster: Cluster, node: str, addresses: Collection[str]) -> str:
    """Why the dump, whose pod chains are for ``addresses``, was not taken on ``node``, or ``""``:
    none of those addresses is a pod of ``node`` in the manifests and some are another node's
    pods (comparing it would report every one of their cells as a difference)."""
    owner = {ip: pod.node for pod in cluster.pods.values() if pod.node and not pod.host_network for ip in pod.ips}
    nodes = Counter(owner[ip] for ip in addresses if ip in owner)
    if not nodes or node in nodes:
        return ""
    named = ", ".join(f"{n} ({count} of {len(addresses)})" for n, count in nodes.most_common())
    return (f"its pod chains are for pods of node {named}, none of --node {node}'s: "
            f"give --node {nodes.most_common(1)[0][0]}, or {node}'s dump")


def cmd_compare(args: argparse.Namespace) -> int:
    read = read_manifests(args, [args.node])
    cluster = read.cluster
    warn(cluster_warnings(cluster, [args.node]), args.strict)
    saves = {"ipv4": read_dump("--iptables-save", args.iptables_save)} if args.iptables_save else {}
    if args.ip6tables_save:
        saves["ipv6"] = read_dump("--ip6tables-save", args.ip6tables_save)
    if not saves:
        print("nftpolicy: give --iptables-save and/or --ip6tables-save", file=sys.stderr)
        return 2
    dump = select(saves, read_dump("--ipset-save", args.ipset_save), f"--ipset-save {args.ipset_save}",  # errors name the flag
                  {"ipv4": f"--iptables-save {args.iptables_save}", "ipv6": f"--ip6tables-save {args.ip6tables_save}"})
    other = dump_of_another_node(cluster, args.node, dump.pod_addresses)
    if other:
        raise DumpError(f"--iptables-save {args.iptables_save or args.ip6tables_save}: {other}")
    report = compare(cluster, args.node, dump, config_from(args), args.timeout, args.loader,
                     [ProbeSpec(port, protocol) for port, protocol in args.port or ()], args.icmp)
    print(format_report(report))
    # Exit 1 for a difference that no documented deliberate one accounts for (docs/migration.md, "Deliberate differences").
    return read.finish(args, 1 if any(not d.note for d in report.differences) else 0)
