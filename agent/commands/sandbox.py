"""``nftpolicy sandbox``: the cluster built from network namespaces, enforced, every pod pair probed."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import yaml

from nftpolicy.translators.cases import Case, is_case, parse_case
from nftpolicy.translators.manifests import build_cluster, load_yaml_documents
from nftpolicy.translators.model import Cluster, Family
from nftpolicy.translators.rules import Config

from ..cli import DATAPLANE_CHOICES, UsageError, config_from
from ..compare import cells_differ, explain, verdict
from .. import report
from ..controlplane import ControlPlane, find_binary
from ..manifestfiles import manifest_files, read_objects
from ..probes import ProbeSpec
from ..replay import Disagreement, disagreements, replay_twins, start_daemons
from ..sandbox import Sandbox
from . import cluster_warnings, warn
from . import report_skipped as _report_skipped


def _read_cases(paths: list[str]) -> list[Case] | None:
    """The paths as conformance cases in order, or None when they are manifests."""
    documents = []
    for name in manifest_files(paths):
        if name == "-":
            return None
        try:
            docs = load_yaml_documents(Path(name).read_text())
        except yaml.YAMLError:
            return None
        if len(docs) != 1 or not is_case(docs[0]):
            return None
        documents.append(docs[0])
    return [parse_case(d) for d in documents] if documents else None


def _dataplanes(args: argparse.Namespace) -> tuple[str, ...]:
    iptables = f"iptables-{args.iptables_loader}"
    return tuple(iptables if d == "iptables" else d for d in DATAPLANE_CHOICES[args.dataplane])


def _print_disagreements(label: str, dataplanes: tuple[str, ...], cells: list[Disagreement], cluster: Cluster) -> int:
    """Print each cell where the twins differ; against kube-router, with the documented
    deliberate difference that explains it (:func:`compare.explain`), if one does."""
    for spec, family, src, dst, a, b in cells:
        why = explain(cluster, spec, src, dst, b, a) if dataplanes[1] == "kube-router" else None
        print(f"DISAGREE {label}{spec.protocol}/{spec.port} {family} {src} -> {dst}: "
              f"{dataplanes[0]} {verdict(a)}, {dataplanes[1]} {verdict(b)}" + (f" ({why})" if why else ""))
    return len(cells)


def _sandbox_control_plane(args: argparse.Namespace, dataplanes: tuple[str, ...]) -> bool:
    """True when this sandbox run goes through a real API server (asked for, or kube-router)."""
    live = args.control_plane or "kube-router" in dataplanes
    if live and any(d.startswith("iptables") for d in dataplanes):
        raise UsageError("the iptables variant has no agent: --control-plane and kube-router go with nft only")
    if args.kube_router and "kube-router" not in dataplanes:
        raise UsageError("--kube-router needs --dataplane kube-router or both")
    if "kube-router" in dataplanes:
        find_binary("kube-router", args.kube_router)  # before anything starts
    return live


def _check_report_path(path: str | None) -> None:
    """Refuse a ``--report`` path that cannot be written (a directory, or in no writable
    directory) before anything is built: the page is written only at the end of the run."""
    if path and (os.path.isdir(path) or not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK)):
        raise UsageError(f"--report {path}: cannot write a file there")


def cmd_sandbox(args: argparse.Namespace) -> int:
    cases = _read_cases(args.paths)
    families: tuple[Family, ...] = ("ipv4", "ipv6") if args.dual_stack else ("ipv6",) if args.ipv6 else ("ipv4",)
    nodes = args.node or ["node1"]
    config = config_from(args)
    dataplanes = _dataplanes(args)
    live = _sandbox_control_plane(args, dataplanes)
    _check_report_path(args.report)
    with report.Report(args.output, args.report, config) as out, contextlib.ExitStack() as stack:
        control_plane = stack.enter_context(ControlPlane()) if live else None
        if cases is None:
            code = _sandbox_manifests(args, stack, control_plane, nodes, families, config, dataplanes, out)
        else:
            code = _sandbox_cases(args, cases, control_plane, nodes, families, config, dataplanes, out)
        return code


def _sandbox_manifests(args: argparse.Namespace, stack: contextlib.ExitStack, control_plane: ControlPlane | None,
                       nodes: list[str], families: tuple[Family, ...], config: Config, dataplanes: tuple[str, ...],
                       out: report.Report) -> int:
    objects, unreadable = read_objects(args.paths)
    cluster, invalid = build_cluster(objects)
    _report_skipped(unreadable + ([] if control_plane else invalid), args.strict)
    warn(cluster_warnings(cluster, args.paths, []), args.strict)
    node_addresses = {n.name: n.addresses for n in cluster.nodes.values()}
    sandboxes = [stack.enter_context(Sandbox(cluster.pods.values(), nodes, families, node_addresses, config, args.timeout, d))
                 for d in dataplanes]
    warnings = [f"no pod runs on node {node} (--node): every pod has another spec.nodeName"
                for node in args.node or () if node not in sandboxes[0].nodes]
    warnings += [f"nothing probed over {family}: no pod has an {family} address (pods keep the addresses their manifests give)"
                 for family in families if not any(pod.addresses(family) for pod in sandboxes[0].pods.values())]
    warn(warnings, args.strict)
    if control_plane is None:
        for sandbox in sandboxes:
            sandbox.apply(cluster)
    else:
        _report_skipped(sandboxes[0].publish(control_plane, objects), args.strict)
        for daemon in start_daemons(stack, sandboxes, control_plane, args.kube_router):
            daemon.wait_synced()
    specs = sorted({ProbeSpec(p.port, p.protocol) for pod in sandboxes[0].pods.values() for p in pod.ports},
                   key=lambda s: (s.port, s.protocol))
    results = [sandbox.probe(specs, families) for sandbox in sandboxes]
    if len(dataplanes) > 1:
        print(f"dataplanes: {' and '.join(dataplanes)} (twin sandboxes); matrices of {dataplanes[0]}")
    out.matrices(sandboxes[0].pods, results[0], sandboxes[0].with_sandbox_pods(cluster))
    if len(dataplanes) > 1:
        disagree = _print_disagreements("", dataplanes, disagreements(results[0], results[1]),
                                        sandboxes[0].with_sandbox_pods(cluster))
        print(f"\n{cells_differ(disagree)} between {dataplanes[0]} and {dataplanes[1]}" if disagree
              else f"\n{dataplanes[0]} and {dataplanes[1]} agree on every cell")
        return 1 if disagree else 0
    return 0


def _sandbox_cases(args: argparse.Namespace, cases: list[Case], control_plane: ControlPlane | None, nodes: list[str],
                   families: tuple[Family, ...], config: Config, dataplanes: tuple[str, ...], out: report.Report) -> int:
    failures = disagree = compared = 0
    with contextlib.closing(replay_twins(cases, nodes, families, config, args.timeout, dataplanes,
                                         control_plane, args.kube_router)) as replayed:  # cleaned up on any exception
        for sandboxes, steps, cells in replayed:
            for error in steps[0].errors:
                print(f"nftpolicy: skipped {error}", file=sys.stderr)
            expected = {(ProbeSpec(p.port, p.protocol), f): p.expected for p in steps[0].case.probes for f in families}
            out.matrices(sandboxes[0].pods, steps[0].results, steps[0].cluster, expected, steps[0].case.name)
            compared += sum(1 for matrix in steps[0].results.values() for src, dst in matrix if src != dst)
            for spec, family in steps[0].not_probed:
                print(f"{spec.protocol}/{spec.port} {family}: not probed (the kernel has no {spec.protocol})")
            for dataplane, step in zip(dataplanes, steps):
                for spec, family, src, dst, want, got in step.differences:
                    failures += 1
                    where = f" ({dataplane})" if len(dataplanes) > 1 else ""
                    print(f"DIFF {step.case.name} {spec.protocol}/{spec.port} {family} {src} -> {dst}: "
                          f"expected {'allowed' if want else 'blocked'}, got {'allowed' if got else 'blocked'}{where}")
            for other in cells:
                disagree += _print_disagreements(f"{steps[0].case.name} ", dataplanes, other, steps[0].cluster)
    print(f"\n{cells_differ(failures)} from the expected matrices" if failures
          else f"\nall {compared} probed cells match the expected matrices" if compared else "\nno cell could be probed")
    if len(dataplanes) > 1:
        print(f"{cells_differ(disagree)} between {dataplanes[0]} and {dataplanes[1]}" if disagree
              else f"{dataplanes[0]} and {dataplanes[1]} agree on every cell")
    return 1 if failures or disagree else 0
