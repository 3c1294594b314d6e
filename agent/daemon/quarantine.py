"""Policies the kernel refused, enforced fail-closed: one object the kernel cannot take never
keeps the others from being enforced (DESIGN.md section 4), and a fresh node still gets its table.

When the kernel refuses a full replace, the reconcile loop
(:meth:`~nftpolicy.agent.daemon.reconcile.Reconciler._isolated`) asks :func:`find_refused`
which of the table's policies are responsible, by dry runs (the kernel checks and commits
nothing) of what the table holds of a group of them
(:func:`~nftpolicy.translators.refusals.only`: their chains and the sets they look up): first
all of them at once (taken: the fault is elsewhere, and the sync fails as before), then each half
of a refused group, down to single policies. For k responsible policies among n that is at most
``1 + 2k * ceil(log2 n)`` checks, never more than :data:`MAX_CHECKS` (past it, every policy of an
unresolved group is held), each costing what those policies print, not the table; a commit the
kernel takes costs none. The policies found are held here (:class:`Quarantine`) and replaced in
the table by their fail-closed stand-ins (:func:`~nftpolicy.translators.refusals.stand_in`) until
the object changes or goes; each is logged, counted (``nftpolicy_refused_objects``) and gets a
``RefusedByKernel`` Event (:meth:`~nftpolicy.agent.daemon.events.EventRecorder.kernel_refused`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

from nftpolicy.translators.model import Cluster
from nftpolicy.translators.refusals import PolicyRef, stand_in

from .metrics import Metrics

log = logging.getLogger("nftpolicy.reconcile")
MAX_CHECKS = 64  # dry runs one refused transaction may cost (k = 4 among 2^8 policies takes at most 65)

# Whether the kernel takes what the table holds of a group of policies: None, or its reason.
Refused = Callable[[Sequence[PolicyRef]], str | None]


def find_refused(suspects: Sequence[PolicyRef], reason: str, refused: Refused, budget: int = MAX_CHECKS) -> dict[PolicyRef, str]:
    """The policies of ``suspects`` responsible for a refusal, each with the kernel's reason for
    the smallest group that held it, given that the kernel refuses ``suspects`` together (for
    ``reason``). Halves each refused group: the first half is checked, and the second only when
    the first was refused too (else it holds the fault). At most ``budget`` calls of ``refused``;
    a group still unresolved then is returned whole."""
    found: dict[PolicyRef, str] = {}
    checks = 0

    def search(group: Sequence[PolicyRef], why: str) -> None:
        nonlocal checks
        if len(group) == 1 or checks >= budget:
            found.update(dict.fromkeys(group, why))
            return
        first, second = group[:len(group) // 2], group[len(group) // 2:]
        checks += 1
        first_why = refused(first)
        if first_why is None:
            search(second, why)
            return
        search(first, first_why)
        if checks >= budget:
            found.update(dict.fromkeys(second, why))
            return
        checks += 1
        second_why = refused(second)
        if second_why is not None:
            search(second, second_why)

    search(suspects, reason)
    return found


@dataclasses.dataclass
class _Held:
    original: Any  # the model object the kernel refused (as the store holds it)
    reason: str


class Quarantine:
    """The policies held fail-closed: ``(kind, key)`` -> the object the kernel refused and why.
    A held policy is enforced as its stand-in while the store holds that same object; a changed
    or deleted one is released (and enforced as it is, or gone). ``metrics``: the
    ``nftpolicy_refused_objects`` gauge follows."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.held: dict[PolicyRef, _Held] = {}

    def hold(self, ref: PolicyRef, original: Any, reason: str) -> None:
        """Hold ``ref`` (whose model object is ``original``) for ``reason``; a policy held
        already keeps the original it had."""
        self.held.setdefault(ref, _Held(original, reason))
        self._count()

    def change(self, kind: str, key: str, obj: Any) -> Any:
        """What the renderer gets for the store's change of ``(kind, key)`` to ``obj`` (None:
        deleted): the stand-in while ``obj`` is the object held, else ``obj`` (released)."""
        held = self.held.get((kind, key))
        if held is None:
            return obj
        if obj is not None and obj == held.original:
            return stand_in(obj, held.reason)
        self._release((kind, key), obj)
        return obj

    def substituted(self, cluster: Cluster) -> Cluster:
        """``cluster`` (a full snapshot) with each held policy that is still the object held as
        its stand-in; the others are released."""
        if not self.held:  # the common case: nothing to do
            return cluster
        kinds: dict[str, dict[str, Any]] = {"NetworkPolicy": dict(cluster.policies), "ClusterNetworkPolicy": dict(cluster.cluster_policies)}
        for (kind, key) in list(self.held):
            objects = kinds[kind]
            objects[key] = self.change(kind, key, objects.get(key))
            if objects[key] is None:
                del objects[key]
        return dataclasses.replace(cluster, policies=kinds["NetworkPolicy"], cluster_policies=kinds["ClusterNetworkPolicy"])

    def _release(self, ref: PolicyRef, obj: Any) -> None:
        del self.held[ref]
        self._count()
        kind, key = ref
        log.info("%s %s %s: enforcing it again (the kernel refused the version before)", kind, key,
                 "was deleted" if obj is None else "changed", extra={"kind": kind, "object": key})

    def _count(self) -> None:
        for kind in ("NetworkPolicy", "ClusterNetworkPolicy"):
            self.metrics.refused_objects.labels(kind).set(sum(1 for k, _ in self.held if k == kind))
