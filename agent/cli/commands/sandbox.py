"""``nftpolicy sandbox``: the cluster built from network namespaces, enforced, every pod pair probed."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from typing import Mapping

import yaml

from nftpolicy.translators.cases import Case, is_case, parse_case
from nftpolicy.translators.manifests import ManifestError, load_yaml_documents
from nftpolicy.translators.model import Cluster, Family, family_of
from nftpolicy.translators.rules import Config

from nftpolicy.agent.cli.flags import DATAPLANE_CHOICES, UsageError, config_from
from nftpolicy.agent.testbed.compare import cells_differ, explain, probe_specs, verdict
from nftpolicy.agent import interrupts
from nftpolicy.agent.testbed import report
from nftpolicy.agent.testbed.controlplane import ControlPlane, find_binary
from nftpolicy.agent.daemon.manifestfiles import manifest_files
from nftpolicy.agent.testbed.probes import ProbeSpec
from nftpolicy.agent.testbed.replay import Disagreement, disagreements, replay_twins, start_daemons
from nftpolicy.agent.testbed.sandbox import Sandbox
from . import cluster_warnings, finish, note, placement_nodes, read_manifests, report_skipped, warn


def _read_cases(paths: list[str]) -> list[Case] | None:
    """The paths as conformance cases in order, or None when they are manifests."""
    documents = []
    for name in manifest_files(paths):
        if name == "-":
            return None
        try:
            docs = load_yaml_documents(Path(name).read_text())
        except (yaml.YAMLError, UnicodeDecodeError, OSError):
            return None  # not a case file: the manifests' reader says what is wrong with it
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
    with report.SandboxOutput(args.output, args.report, config, " ".join(args.paths)) as out, contextlib.ExitStack() as stack:
        control_plane = stack.enter_context(ControlPlane()) if live else None
        if cases is None:
            code = _sandbox_manifests(args, stack, control_plane, nodes, families, config, dataplanes, out)
        else:
            code = _sandbox_cases(args, cases, control_plane, nodes, families, config, dataplanes, out)
        return code


def _sandbox_manifests(args: argparse.Namespace, stack: contextlib.ExitStack, control_plane: ControlPlane | None,
                       nodes: list[str], families: tuple[Family, ...], config: Config, dataplanes: tuple[str, ...],
                       out: report.SandboxOutput) -> int:
    read = read_manifests(args, args.node or [], report_invalid=control_plane is None, keep_objects=True)
    cluster = read.cluster
    nodes = placement_nodes(cluster, args.node or [])
    note(read.dump_notes())
    warn(cluster_warnings(cluster, []), args.strict)
    if read.empty:
        return read.finish(args, 0)
    node_addresses = {n.name: n.addresses for n in cluster.nodes.values()}
    # Nodes a ClusterNetworkPolicy nodes peer could select are probed as destinations too
    served = sorted(cluster.nodes) if any(peer.nodes is not None for policy in cluster.cluster_policies.values()
                                          for rule in policy.egress for peer in rule.peers) else []
    pod_cidrs = {n.name: n.pod_cidrs for n in cluster.nodes.values()}
    made = [Sandbox(cluster.pods.values(), nodes, families, node_addresses, config, args.timeout, d, served, pod_cidrs)
            for d in dataplanes]
    _check_probed(made[0], families, read.paths)
    warnings = [f"no pod runs on node {node} (--node): every pod has another spec.nodeName"
                for node in args.node or () if node not in made[0].nodes]
    warnings += [f"nothing probed over {family}: no pod has an {family} address (pods keep the addresses their manifests give)"
                 for family in families if not any(pod.addresses(family) for pod in made[0].pods.values())]
    for family in families:
        lacking = sorted(key for key, pod in made[0].pods.items() if not pod.addresses(family))
        if lacking and len(lacking) < len(made[0].pods):
            warnings.append(f"{len(lacking)} {'pod has' if len(lacking) == 1 else 'pods have'} no {family} address, so no "
                            f"{family} probe from or to {'it (its' if len(lacking) == 1 else 'them (their'} cells show ?): "
                            f"{', '.join(lacking[:5])}{f' and {len(lacking) - 5} more' if len(lacking) > 5 else ''}")
    warn(warnings, args.strict)
    sandboxes = [stack.enter_context(sandbox) for sandbox in made]
    refused: list[ManifestError] = []
    if control_plane is None:
        for sandbox in sandboxes:
            sandbox.apply(cluster)
    else:
        refused = sandboxes[0].publish(control_plane, read.objects)
        report_skipped(refused, args.strict)
        for daemon in start_daemons(stack, sandboxes, control_plane, args.kube_router):
            daemon.wait_synced()
    specs = probe_specs(sandboxes[0].with_sandbox_pods(cluster))  # the policies' ports too: a range's ends and the port after
    results = [sandbox.probe(specs, families) for sandbox in sandboxes]
    _check_self_probes(results[0], args.timeout)
    if len(dataplanes) > 1:
        print(f"dataplanes: {' and '.join(dataplanes)} (twin sandboxes); matrices of {dataplanes[0]}")
    out.matrices(sandboxes[0].pods, results[0], sandboxes[0].with_sandbox_pods(cluster))
    if len(dataplanes) > 1:
        disagree = _print_disagreements("", dataplanes, disagreements(results[0], results[1]),
                                        sandboxes[0].with_sandbox_pods(cluster))
        print(f"\n{cells_differ(disagree)} between {dataplanes[0]} and {dataplanes[1]}" if disagree
              else f"\n{dataplanes[0]} and {dataplanes[1]} agree on every cell")
        return read.finish(args, 1 if disagree else 0, refused)
    return read.finish(args, 0, refused)


def _check_self_probes(result: Mapping[tuple[ProbeSpec, Family], Mapping[tuple[str, str], bool]], timeout: float) -> None:
    """Refuse results that cannot be trusted (UsageError): a pod's probe of its own address is
    always allowed (a pod's traffic to itself never leaves it; our chains exempt it), so one that
    failed means the probes fail for another reason, most likely a ``--timeout`` too short for
    this machine (0.005 s showed every cell blocked)."""
    failed = sorted(f"{src} ({spec.protocol}/{spec.port})" for (spec, _), cells in result.items()
                    for (src, dst), ok in cells.items() if src == dst and not ok)
    if failed:
        raise UsageError(f"{len(failed)} {'probe' if len(failed) == 1 else 'probes'} of a pod to its own address failed (always "
                         f"allowed), e.g. {failed[0]}: --timeout {timeout:g} is too short for this machine (try 1, the default, "
                         "or more on a loaded machine), or the sandbox's servers did not answer; no cell can be trusted")


def _check_probed(sandbox: Sandbox, families: tuple[Family, ...], paths: list[str]) -> None:
    """Refuse a run that would probe nothing at all (UsageError): no pod to build, no pod with a
    container port (the ports probed), or no pod with an address of the families asked for."""
    if not sandbox.pods:
        raise UsageError(f"nothing to probe: no pod in {', '.join(paths)} (hostNetwork and finished pods are left out)")
    if not any(pod.ports for pod in sandbox.pods.values()):
        raise UsageError(f"nothing to probe: no pod in {', '.join(paths)} has a container port "
                         "(the sandbox probes the ports of spec.containers[].ports; explain and trace take --port)")
    if not any(pod.addresses(family) for family in families for pod in sandbox.pods.values()):
        flag = "--ipv6" if families == ("ipv6",) else "the default, IPv4,"
        have = sorted({family_of(ip) for pod in sandbox.pods.values() for ip in pod.ips})
        raise UsageError(f"nothing to probe: {flag} asks for {'/'.join(families)} addresses and the manifests give the pods "
                         f"{'/'.join(have)} ones (pods keep the addresses their manifests give; see --dual-stack)")


def _sandbox_cases(args: argparse.Namespace, cases: list[Case], control_plane: ControlPlane | None, nodes: list[str],
                   families: tuple[Family, ...], config: Config, dataplanes: tuple[str, ...], out: report.SandboxOutput) -> int:
    failures = disagree = compared = 0
    skipped: list[ManifestError] = []
    with contextlib.closing(replay_twins(cases, nodes, families, config, args.timeout, dataplanes,
                                         control_plane, args.kube_router)) as replayed:  # cleaned up on any exception
        for sandboxes, steps, cells in replayed:
            interrupts.raise_pending()  # a signal whose exception a __del__ swallowed stops the next step
            report_skipped(steps[0].errors, args.strict)
            skipped += steps[0].errors
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
    return finish(args, 1 if failures or disagree else 0, skipped)
