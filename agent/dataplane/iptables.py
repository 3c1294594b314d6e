"""The iptables variant in the kernel: ``ipset restore`` and ``iptables-restore`` inside a network
namespace that this process created.

Every command runs as ``ip netns exec <name> ...`` with a namespace from ``ip netns add`` (the
sandbox's, a test's or a benchmark's), never in the machine's own namespace: :func:`run` refuses
a name that is not in ``/run/netns`` or that is the caller's own namespace. ipset sets, like the
iptables tables (legacy and nft), belong to one network namespace (the kernel's ``ip_set``
module keeps them per netns since Linux 3.13; ``tests/test_iptables_load.py`` checks it).

Loaders: ``nft`` (``iptables-nft-restore``: the rules become nft ``ip filter`` / ``ip6 filter``
tables with xt compat matches) and ``legacy`` (``iptables-legacy-restore``: x_tables).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal, Sequence

from nftpolicy.translators import iptables as render
from nftpolicy.translators.model import Family
from nftpolicy.translators.transaction import Transaction

from . import netns, DataplaneError

Loader = Literal["nft", "legacy"]
LOADERS: tuple[Loader, ...] = ("nft", "legacy")
OUR_SET_PREFIXES = ("KUBE-PODS-", "KUBE-NET-", "KUBE-PORT-", render.TMP_PREFIX + "KUBE-")


class IptablesError(DataplaneError):
    """ipset or iptables-restore failed; the message holds the command and its output."""


def restore_command(family: Family, loader: Loader) -> str:
    """``iptables-nft-restore``, ``ip6tables-legacy-restore``, ..."""
    return f"{'iptables' if family == 'ipv4' else 'ip6tables'}-{loader}-restore"


def _check_namespace(name: str) -> None:
    path = f"{netns.NETNS_DIR}/{name}"
    if name not in netns.existing(name):
        raise IptablesError(f"no network namespace {name!r} (ip netns add it first)")
    here, there = os.stat("/proc/thread-self/ns/net"), os.stat(path)
    if (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino):
        raise IptablesError(f"namespace {name!r} is this process's own: refusing to change its firewall")


def run(netns_name: str, argv: Sequence[str], stdin: str | None = None) -> str:
    """Run ``argv`` inside ``netns_name`` and return its stdout; raises IptablesError."""
    _check_namespace(netns_name)
    full = ["ip", "netns", "exec", netns_name, *argv]
    result = subprocess.run(full, input=stdin, capture_output=True, text=True)
    if result.returncode != 0:
        raise IptablesError(f"{' '.join(argv)} in {netns_name} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def set_list(netns_name: str) -> list[str]:
    """Names of every ipset set in the namespace."""
    return run(netns_name, ["ipset", "list", "-n"]).split()


def _load_text(netns_name: str, ipset_text: str, restore: dict[Family, str], loader: Loader) -> None:
    """Load ``ipset restore`` input, then each family's ``iptables-restore`` input (sets first:
    rules refer to them)."""
    if ipset_text.strip():
        run(netns_name, ["ipset", "restore"], ipset_text)
    for family, text in restore.items():
        run(netns_name, [restore_command(family, loader)], text)


@dataclass(frozen=True)
class IptablesBatch:
    """One load of the iptables variant: ``ipset restore`` input, each family's
    ``iptables-restore`` input, and the names of the sets it keeps (ours that are not here are
    destroyed once the new rules stop naming them)."""

    ipset: str
    restore: dict[Family, str]
    sets: frozenset[str]


class IptablesDataplane:
    """The iptables variant in network namespace ``netns_name`` (one this process created:
    :func:`run` refuses any other), loaded with ``iptables-<loader>-restore`` for ``families``."""

    def __init__(self, netns_name: str, loader: Loader = "nft", families: Sequence[Family] = ("ipv4", "ipv6")) -> None:
        self.netns, self.loader, self.families = netns_name, loader, tuple(families)

    def __repr__(self) -> str:
        return f"IptablesDataplane(iptables-{self.loader} in {self.netns})"

    def missing_features(self) -> list[str]:
        """The commands this dataplane runs that are not installed."""
        commands = ["ipset"] + [restore_command(f, self.loader) for f in self.families]
        return [f"{c}: not installed" for c in commands if shutil.which(c) is None]

    def batch(self, tx: Transaction) -> IptablesBatch:
        """``tx`` printed for this dataplane: the sets and each family's filter table of the
        table it replaces ours by (:func:`render.replaced_table`: raises
        :class:`~nftpolicy.translators.iptables.Unsupported` for any other transaction)."""
        table = render.replaced_table(tx)
        return IptablesBatch(render.to_ipset(table, self.families), {f: render.to_restore(table, f) for f in self.families},
                             frozenset(render.set_names(table, self.families)))

    def run(self, tx: Transaction) -> None:
        """Commit ``tx``, a whole-table replace (:meth:`batch`, :meth:`load`)."""
        self.load(self.batch(tx))

    def load(self, batch: IptablesBatch) -> None:
        """Sets first (each swapped in atomically), then each family's filter table (one atomic
        table replace each), then destroy our sets that the new rules no longer name."""
        _load_text(self.netns, batch.ipset, batch.restore, self.loader)
        for name in set_list(self.netns):
            if name.startswith(OUR_SET_PREFIXES) and name not in batch.sets:
                run(self.netns, ["ipset", "destroy", name])

    def has_table(self) -> bool:
        """True while ``KUBE-ROUTER-FORWARD`` is in every family's filter table."""
        save = {"ipv4": "iptables", "ipv6": "ip6tables"}
        return all(":KUBE-ROUTER-FORWARD " in run(self.netns, [f"{save[f]}-{self.loader}-save", "-t", "filter"])
                   for f in self.families)

    def remove(self) -> bool:
        """Empty each family's filter table (policies ACCEPT, no chains) and destroy our sets;
        True if our chains were there."""
        present = self.has_table()
        empty = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n"
        for family in self.families:
            run(self.netns, [restore_command(family, self.loader)], empty)
        for name in set_list(self.netns):
            if name.startswith(OUR_SET_PREFIXES):
                run(self.netns, ["ipset", "destroy", name])
        return present
