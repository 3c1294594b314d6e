"""The five commands of ``nftpolicy``, one module each; :mod:`nftpolicy.agent.cli` parses the
flags and calls ``cmd_<command>(args)`` of the command's module (imported only when it runs)."""

from __future__ import annotations

import argparse
import sys

from nftpolicy.translators.manifests import ManifestError
from nftpolicy.translators.model import Cluster

from ..manifests import load_cluster


def report_skipped(errors: list[ManifestError], strict: bool) -> None:
    """One line per object left out; with ``--strict`` any of them ends the command (exit 2)."""
    for error in errors:
        print(f"nftpolicy: skipped {error}", file=sys.stderr)
    if errors and strict:
        raise SystemExit(2)


def load_manifests(args: argparse.Namespace) -> Cluster:
    """The cluster in ``args.paths``; each object left out is reported (see :func:`report_skipped`)."""
    cluster, errors = load_cluster(args.paths)
    report_skipped(errors, args.strict)
    return cluster
