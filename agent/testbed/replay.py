"""Replaying conformance cases as live steps in sandboxes, also on twin sandboxes with two
dataplanes side by side, and comparing every probed cell with the case's expected matrix
(``tests/conformance`` format: :mod:`nftpolicy.translators.cases`)."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Generator, Sequence

from nftpolicy.translators.cases import Case, Matrix, case_manifests, differences
from nftpolicy.translators.manifests import ManifestError, build_cluster
from nftpolicy.translators.model import Cluster, Family
from nftpolicy.translators.rules import Config

from .controlplane import ControlPlane
from .nodedaemons import NodeDaemons, daemons_for
from .probes import ProbeSpec
from .sandbox import Sandbox, SandboxError


@dataclass
class StepResult:
    """One replayed case (or step): the measured matrices and every cell that differs.

    ``cluster`` is the step's cluster with the sandbox's pod addresses; ``differences`` rows are ``(spec, family, from, to, expected, actual)``; ``not_probed`` lists
    the (spec, family) pairs the kernel could not probe (SCTP without kernel support).
    """

    case: Case
    cluster: Cluster
    results: dict[tuple[ProbeSpec, Family], Matrix]
    differences: list[tuple[ProbeSpec, Family, str, str, bool, bool | None]]
    not_probed: list[tuple[ProbeSpec, Family]]
    errors: list[ManifestError]


def replay(cases: Sequence[Case], nodes: Sequence[str] = ("node1",), families: Sequence[Family] = ("ipv4",),
           config: Config = Config(), timeout: float = 1.0, dataplane: str = "nft",
           control_plane: ControlPlane | None = None, kube_router: str | None = None) -> Generator[tuple[Sandbox, StepResult], None, None]:
    """Replay conformance cases in one sandbox, in order, as a live sequence of steps.

    The pods of the first case are built once; each case's namespaces, labels and policies are
    applied over the previous ones (one transaction per node; with ``control_plane``, as API
    writes that the node daemons pick up), then its probes are run and compared with the
    expected matrices (diagonal ignored). Yields after every step, while the sandbox still exists.
    """
    with contextlib.closing(replay_twins(cases, nodes, families, config, timeout, (dataplane,), control_plane, kube_router)) as twins:
        for sandboxes, steps, _ in twins:
            yield sandboxes[0], steps[0]


# (spec, family, from, to, verdict of the first dataplane, verdict of the other)
Disagreement = tuple[ProbeSpec, Family, str, str, bool | None, bool | None]


def disagreements(first: dict[tuple[ProbeSpec, Family], Matrix], other: dict[tuple[ProbeSpec, Family], Matrix]) -> list[Disagreement]:
    """Every cell (diagonal included) where two probe results differ, or that only one has."""
    found = []
    for key in sorted(set(first) | set(other), key=lambda k: (k[0].port, k[0].protocol, k[1])):
        a, b = first.get(key, {}), other.get(key, {})
        for cell in sorted(set(a) | set(b)):
            if a.get(cell) != b.get(cell):
                found.append((key[0], key[1], cell[0], cell[1], a.get(cell), b.get(cell)))
    return found


def replay_twins(cases: Sequence[Case], nodes: Sequence[str] = ("node1",), families: Sequence[Family] = ("ipv4",),
                 config: Config = Config(), timeout: float = 1.0, dataplanes: Sequence[str] = ("nft", "iptables-nft"),
                 control_plane: ControlPlane | None = None, kube_router: str | None = None,
                 ) -> Generator[tuple[list[Sandbox], list[StepResult], list[list[Disagreement]]], None, None]:
    """:func:`replay` on twin sandboxes, one per dataplane (same pods, same addresses).

    With ``control_plane``, every step is written to that API server once, and each twin's
    node daemons (:func:`~.nodedaemons.daemons_for`: nftpolicy agents for ``nft``, the real
    kube-router, from ``kube_router`` or the default binary) enforce it; probes start when every
    daemon has synced. Yields after every step: the sandboxes, one :class:`StepResult` per
    dataplane, and for each dataplane after the first the cells where it disagrees with the first.
    """
    pods_only = dataclasses.replace(cases[0], policies=(), cluster_policies=())
    skeleton, _ = build_cluster(("case", o) for o in case_manifests(pods_only, {}))
    served = sorted({name for case in cases for name in case.nodes})  # the cases' Nodes: probe targets too
    with contextlib.ExitStack() as stack:
        sandboxes = [stack.enter_context(Sandbox(skeleton.pods.values(), nodes, families, None, config, timeout, d, served))
                     for d in dataplanes]
        for other in sandboxes[1:]:
            if {k: p.ips for k, p in other.pods.items()} != {k: p.ips for k, p in sandboxes[0].pods.items()}:
                raise SandboxError("twin sandboxes got different pod addresses")
        daemons: list[NodeDaemons] = []
        for case in cases:
            ips = {key: list(pod.ips) for key, pod in sandboxes[0].pods.items()}
            objects = [(f"case {case.name}", o) for o in case_manifests(case, ips)]
            if control_plane is None:
                steps = [_step(sandbox, case, families, objects) for sandbox in sandboxes]
            else:
                errors = sandboxes[0].publish(control_plane, objects)
                daemons = daemons or start_daemons(stack, sandboxes, control_plane, kube_router)
                for daemon in daemons:
                    daemon.wait_synced()
                steps = [_step(sandbox, case, families, objects, errors) for sandbox in sandboxes]
            yield sandboxes, steps, [disagreements(steps[0].results, s.results) for s in steps[1:]]


def start_daemons(stack: contextlib.ExitStack, sandboxes: Sequence[Sandbox], control_plane: ControlPlane,
                  kube_router: str | None = None) -> list[NodeDaemons]:
    """Start each sandbox's node daemons against ``control_plane`` (nftpolicy agents for an
    ``nft`` sandbox, kube-router for a ``kube-router`` one); ``stack`` stops them before the
    sandboxes go."""
    daemons: list[NodeDaemons] = []
    for sandbox in sandboxes:
        daemon = daemons_for(sandbox.dataplane, sandbox, control_plane, kube_router)
        stack.callback(daemon.close)
        daemon.start()
        daemons.append(daemon)
    return daemons


def _step(sandbox: Sandbox, case: Case, families: Sequence[Family], objects: list[tuple[str, Any]],
          api_errors: list[ManifestError] | None = None) -> StepResult:
    """Apply one case over the sandbox's current state (unless node daemons enforce what the API
    server took: ``api_errors`` then lists what it refused), probe it and compare with the case."""
    cluster, errors = build_cluster(objects)
    cluster = sandbox.with_sandbox_pods(cluster)
    if api_errors is None:
        sandbox.apply(cluster)
    else:
        errors = api_errors
    results = sandbox.probe([ProbeSpec(p.port, p.protocol) for p in case.probes], families)
    diffs: list[tuple[ProbeSpec, Family, str, str, bool, bool | None]] = []
    not_probed: list[tuple[ProbeSpec, Family]] = []
    for probe in case.probes:
        spec = ProbeSpec(probe.port, probe.protocol)
        for family in families:
            actual = results.get((spec, family))
            if actual is None:
                not_probed.append((spec, family))
            else:
                diffs.extend((spec, family, *d) for d in differences(probe.expected, actual))
    return StepResult(case, cluster, results, diffs, not_probed, errors)
