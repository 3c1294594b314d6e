"""The dataplane seam: every write of our rules into a kernel goes through a :class:`Dataplane`.

A dataplane is bound, when it is made, to one network namespace (None: this process's own) and
to our table (nft) or our chains and sets (the iptables variant). It checks the kernel's
features, commits one typed transaction (:class:`~nftpolicy.translators.transaction.Transaction`,
which each dataplane prints in its own syntax) as one kernel transaction, says whether our table
is there, and removes it.
The implementations: :class:`~nftpolicy.agent.dataplane.nftables.NftDataplane` (libnftables),
:class:`~nftpolicy.agent.dataplane.iptables.IptablesDataplane` (``ipset restore`` and
``iptables-restore``) and :class:`~nftpolicy.agent.dataplane.fake.FakeNftDataplane` (an in-memory
table for fast tests, as knftables' ``Fake``). The reconcile loop, the sandbox, the daemon's
start-up check and ``nftpolicy cleanup`` take a dataplane; nothing else writes rules.
"""

from __future__ import annotations

from typing import Protocol

from nftpolicy.translators.errors import OneLineError
from nftpolicy.translators.transaction import Transaction


class DataplaneError(OneLineError, RuntimeError):
    """The kernel (or the fake) refused a transaction; it keeps the rules it had before."""


class Dataplane(Protocol):
    """Our rules in one network namespace."""

    def missing_features(self) -> list[str]:
        """The kernel features the ruleset needs that this kernel refuses, each with the reason
        (empty: all work). Changes nothing."""
        ...

    def run(self, tx: Transaction) -> None:
        """Commit ``tx`` as one kernel transaction; raises DataplaneError (nothing changed then).
        A first load, and any reload, is a transaction that replaces the table
        (:func:`~nftpolicy.translators.transaction.full`)."""
        ...

    def has_table(self) -> bool:
        """True while our table and its base chains are in the kernel."""
        ...

    def remove(self) -> bool:
        """Delete our table (and nothing else); True if there was one."""
        ...
