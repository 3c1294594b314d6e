"""The five commands of ``nftpolicy``, one module each; :mod:`nftpolicy.agent.cli` parses the
flags and calls ``cmd_<command>(args)`` of the command's module (imported only when it runs)."""

from __future__ import annotations

import argparse
import sys

from nftpolicy.translators.manifests import ManifestError
from nftpolicy.translators.model import NAMESPACE_NAME_LABEL, Cluster

from ..manifestfiles import load_cluster


def report_skipped(errors: list[ManifestError], strict: bool) -> None:
    """One line per object left out; with ``--strict`` any of them ends the command (exit 2)."""
    for error in errors:
        print(f"nftpolicy: skipped {error}", file=sys.stderr)
    if errors and strict:
        raise SystemExit(2)


def load_manifests(args: argparse.Namespace) -> Cluster:
    """The cluster in ``args.paths``; each object left out is reported (see :func:`report_skipped`),
    and so is what the paths lack (see :func:`cluster_warnings`)."""
    cluster, errors = load_cluster(args.paths)
    report_skipped(errors, args.strict)
    warn(cluster_warnings(cluster, args.paths, [args.node] if args.node else []), args.strict)
    return cluster


def cluster_warnings(cluster: Cluster, paths: list[str], nodes: list[str]) -> list[str]:
    """What a command given these manifests should be told: no object at all in ``paths``, a
    node in ``nodes`` that no pod runs on, pods in namespaces that have no Namespace object
    (their labels are unknown, so a namespaceSelector sees only the automatic name label)."""
    if not (cluster.pods or cluster.policies or cluster.namespaces or cluster.nodes):
        return [f"no Pod, Namespace, NetworkPolicy or Node found in {', '.join(paths)}"]
    warnings = []
    on = {pod.node for pod in cluster.pods.values()}
    for node in nodes:
        if node not in on:
            known = sorted(n for n in on if n)
            warnings.append(f"no pod runs on node {node} (--node); the pods' nodes: {', '.join(known) or 'none'}")
    missing = sorted({pod.namespace for pod in cluster.pods.values()} - cluster.namespaces.keys())
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        warnings.append(f"pods in namespaces without a Namespace object: {shown}; their labels are unknown, so a "
                        f"namespaceSelector sees only {NAMESPACE_NAME_LABEL} (add the Namespace objects to the manifests)")
    return warnings


def warn(warnings: list[str], strict: bool) -> None:
    """One ``nftpolicy: warning: ...`` line each; with ``--strict`` any of them ends the command (exit 2)."""
    for warning in warnings:
        print(f"nftpolicy: warning: {warning}", file=sys.stderr)
    if warnings and strict:
        raise SystemExit(2)
