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


REASON_MAX_BYTES = 1024  # of a dataplane error's message: what logs, Events and health repeat


def bounded_reason(text: str) -> str:
    """``text`` on one line (runs of whitespace, newlines included, as one space), cut to
    :data:`REASON_MAX_BYTES` bytes of UTF-8 after a whole character (`` ...`` marks a cut)."""
    line = " ".join(text.split())
    if len(line.encode()) <= REASON_MAX_BYTES:
        return line
    return line.encode()[:REASON_MAX_BYTES - 4].decode(errors="ignore") + " ..."


class DataplaneError(OneLineError, RuntimeError):
    """The kernel (or the fake) refused a transaction; it keeps the rules it had before. The
    message is :func:`bounded_reason` of ``reason``: a refused batch's text never travels with it
    (the logs, the Events and the health endpoints repeat the message)."""

    def __init__(self, reason: str) -> None:
        super().__init__(bounded_reason(reason))


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


class CheckedDataplane(Dataplane, Protocol):
    """A dataplane that can also check a transaction without committing it (the reconcile
    loop's, which singles out the objects of a refused transaction:
    :mod:`nftpolicy.agent.daemon.quarantine`)."""

    def check(self, tx: Transaction) -> None:
        """Have the kernel check ``tx`` as it would commit it, and commit nothing (libnftables'
        dry run); raises DataplaneError with the reason it would be refused."""
        ...
