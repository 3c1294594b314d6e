"""The commands of ``nftpolicy``, one module each; :mod:`nftpolicy.agent.cli.main` parses the flags and
calls ``cmd_<command>(args)`` of the command's module (imported only when it runs).

The commands that read manifests (``render``, ``sandbox``, ``explain``, ``trace``, ``compare``)
read them through :func:`read_manifests`: workloads stand in their Pods, and every object,
document or file left out is one line; :func:`finish` then turns anything left out, or an input
with no object at all, into a last summary line and exit :data:`INCOMPLETE`, unless
``--accept-skipped`` was given.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Iterable, Sequence

from nftpolicy.translators.manifests import KINDS, ManifestError, NotStreamable, build_cluster, is_stored
from nftpolicy.translators.model import NAMESPACE_NAME_LABEL, Cluster, NetworkPolicy, Peer, Pod
from nftpolicy.translators.workloads import StandIn, stand_in_pods

from nftpolicy.agent.daemon.manifestfiles import read_objects, read_once, stream_objects

INCOMPLETE = 3  # exit code: part of the input was left out (see finish())
# What a dump for the commands must hold: every kind the agent reads (docs/operations.md).
DUMP_COMMAND = "kubectl get pods,namespaces,networkpolicies,nodes,clusternetworkpolicies -A -o yaml"


@dataclass
class Manifests:
    """What a command read from its paths: the ``cluster``, the ``objects`` it was built from
    (workloads already replaced by their Pods; empty unless :func:`read_manifests` was asked to
    keep them), what was ``skipped`` (one error each), the workloads that stand in Pods, how
    many objects were ``stored`` ones (a dump's, :func:`~nftpolicy.translators.manifests.is_stored`)
    and the objects given twice (``duplicates``, warnings)."""

    paths: list[str]
    cluster: Cluster
    objects: list[tuple[str, Any]]
    skipped: list[ManifestError] = field(default_factory=list)
    stand_ins: list[StandIn] = field(default_factory=list)
    stored: int = 0
    duplicates: list[str] = field(default_factory=list)  # one warning per object given twice

    def dump_notes(self) -> list[str]:
        """What a dump of a live cluster may lack, for the commands that give verdicts: a dump
        (stored objects) without a ClusterNetworkPolicy was most likely taken with the kinds of
        before ClusterNetworkPolicy (``kubectl get pods,namespaces,networkpolicies,nodes``),
        and a verdict made without the cluster's Admin tier can allow what the cluster denies.
        A note, not a warning: a cluster with none dumps the same (``--strict`` does not stop)."""
        if not self.stored or self.cluster.cluster_policies:
            return []
        return [f"these manifests are a dump of a cluster (objects with metadata.resourceVersion) without a "
                f"ClusterNetworkPolicy; if the cluster has any, the verdicts here lack them: {DUMP_COMMAND}"]

    @property
    def empty(self) -> list[str]:
        """The paths when they held no object that counts, else ``[]`` (for :func:`finish`)."""
        c = self.cluster
        return [] if c.pods or c.policies or c.namespaces or c.nodes or c.cluster_policies else self.paths

    def stop_when_empty(self, args: argparse.Namespace) -> int | None:
        """When the paths held no object that counts and ``--accept-skipped`` was not given,
        :func:`finish`'s summary line and its exit code (:data:`INCOMPLETE`), for a command that
        names pods (``explain``, ``trace``) to stop before it looks for them; else None."""
        return self.finish(args, INCOMPLETE) if self.empty and not args.accept_skipped else None

    def finish(self, args: argparse.Namespace, code: int, skipped: Sequence[ManifestError] = ()) -> int:
        """:func:`finish` with what was skipped here and ``skipped`` (found later)."""
        return finish(args, code, [*self.skipped, *skipped], self.empty)


def read_manifests(args: argparse.Namespace, nodes: Sequence[str] = (), report_invalid: bool = True,
                   keep_objects: bool = False, say_stand_ins: bool = True) -> Manifests:
    """The manifests in ``args.paths``: workloads stand in their Pods (``nodes``: where a
    DaemonSet runs, besides the nodes the manifests name), said in one line; each object,
    document or file left out is one ``nftpolicy: skipped ...`` line (``report_invalid=False``:
    objects that fail validation are kept for an API server to judge, only unreadable input is
    reported). With ``--strict`` anything left out ends the command (exit 2). ``say_stand_ins``
    False: no line for the workloads (explain and trace name a workload's pod when asked for it,
    and list the pods they give addresses; the line on every question was noise).

    The objects are read one at a time (a JSON List item by item) and dropped once in the
    cluster, unless ``keep_objects`` (:attr:`Manifests.objects`, else empty): a 150,000-pod
    dump parsed whole is about 800 MB, its cluster a fraction of that."""
    try:  # stdin or a pipe cannot be read twice: with one among the paths, every file is read whole
        read = _read_manifests(args, nodes, report_invalid, keep_objects, _whole_objects if read_once(args.paths) else stream_objects)
    except NotStreamable as refused:  # a file read item by item that reads otherwise whole: read again, whole
        read = _read_manifests(args, nodes, report_invalid, keep_objects, _whole_objects)
        if refused.error is not None:  # the item that is not valid JSON, rather than the whole read's line and column
            origin = refused.error.origin
            read.skipped = [refused.error if (e.kind, e.ref, e.origin) == ("document", "#1", origin)
                            and e.message.startswith("not valid YAML/JSON") else e for e in read.skipped]
    report_skipped(read.skipped, args.strict)
    warn(read.duplicates, args.strict)
    if read.stand_ins and say_stand_ins:
        print(f"nftpolicy: {stand_in_line(read.stand_ins)}", file=sys.stderr)
    if read.empty and args.strict:
        print(f"nftpolicy: {_empty_line(read.paths)}", file=sys.stderr)
        raise SystemExit(2)
    return read


def _read_manifests(args: argparse.Namespace, nodes: Sequence[str], report_invalid: bool, keep_objects: bool,
                    reader: Callable[[Iterable[str], list[ManifestError]], Iterable[tuple[str, Any]]]) -> Manifests:
    """:func:`read_manifests`' reading, with ``reader`` (:func:`stream_objects` or :func:`_whole_objects`)."""
    unreadable: list[ManifestError] = []
    stand_ins: list[StandIn] = []
    bad: list[ManifestError] = []
    duplicates: list[str] = []
    stored = [0]
    first_seen: dict[tuple[str, str, str], str] = {}  # (kind, namespace, name) -> where it was given

    def counted(objects: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for origin, obj in objects:
            if isinstance(obj, Mapping):
                stored[0] += is_stored(obj)
                twice = _given_again(obj, origin, first_seen)
                if twice is not None:
                    duplicates.append(twice)
            yield origin, obj

    objects = stand_in_pods(counted(reader(args.paths, unreadable)), nodes, stand_ins, bad)
    kept = list(objects) if keep_objects else []
    cluster, invalid = build_cluster(kept if keep_objects else objects)
    return Manifests(list(args.paths), cluster, kept, unreadable + bad + (invalid if report_invalid else []), stand_ins,
                     stored[0], duplicates)


def _given_again(obj: Mapping[str, Any], origin: str, first_seen: dict[tuple[str, str, str], str]) -> str | None:
    """A warning when ``obj`` (of a kind the commands read, with a ``metadata.name``) was given
    before, in ``first_seen`` (which it joins otherwise): the last one given is the one used, as
    an API server keeps the last write, and a copy left in another file is most likely a mistake."""
    kind, meta = obj.get("kind"), obj.get("metadata")
    if kind not in KINDS or not isinstance(meta, Mapping) or not isinstance(meta.get("name"), str):
        return None
    namespace = str(meta.get("namespace") or "default") if kind in ("Pod", "NetworkPolicy") else ""
    key = (str(kind), namespace, meta["name"])
    if key not in first_seen:
        first_seen[key] = origin
        return None
    ref = f"{namespace}/{meta['name']}" if namespace else meta["name"]
    return f"{kind} {ref} is given twice ({first_seen[key]}, then {origin}): the last one is used"


def _whole_objects(paths: Iterable[str], errors: list[ManifestError]) -> list[tuple[str, Any]]:
    """:func:`read_objects` with :func:`stream_objects`' signature."""
    objects, unreadable = read_objects(paths)
    errors.extend(unreadable)
    return objects


def plural(count: int, one: str, many: str) -> str:
    """``one`` when ``count`` is 1, else ``many`` (0 takes the plural: "0 pods")."""
    return one if count == 1 else many


def stand_in_line(stand_ins: Sequence[StandIn]) -> str:
    """``3 workloads stand in 4 pods: Deployment demo/web (2), ...`` (the first four named)."""
    pods = sum(len(s.pods) for s in stand_ins)
    shown = ", ".join(map(str, stand_ins[:4])) + (f" and {len(stand_ins) - 4} more" if len(stand_ins) > 4 else "")
    return (f"{len(stand_ins)} {plural(len(stand_ins), 'workload stands', 'workloads stand')} in "
            f"{pods} {plural(pods, 'pod', 'pods')}: {shown}")


def report_skipped(errors: list[ManifestError], strict: bool) -> None:
    """One line per object left out; with ``--strict`` any of them ends the command (exit 2)."""
    for error in errors:
        print(f"nftpolicy: skipped {error}", file=sys.stderr)
    if errors and strict:
        raise SystemExit(2)


def _empty_line(paths: Sequence[str]) -> str:
    return f"no Pod, Namespace, NetworkPolicy, ClusterNetworkPolicy, Node or workload found in {', '.join(paths)}"


def finish(args: argparse.Namespace, code: int, skipped: Sequence[ManifestError], empty: Sequence[str] = ()) -> int:
    """The command's exit code once its output is printed: ``code``, or, when anything was left
    out (``skipped``) or the paths ``empty`` held no object, one summary line
    (``nftpolicy: 2 skipped: NetworkPolicy shop/bad, document #3 (exit 3; ...)``) and
    :data:`INCOMPLETE` (3), unless ``--accept-skipped`` was given."""
    if skipped:
        names = [f"{e.kind} {e.ref}" for e in skipped]
        line = f"{len(skipped)} skipped: " + ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    elif empty:
        line = _empty_line(empty)
    else:
        return code
    if args.accept_skipped:
        return code
    print(f"nftpolicy: {line} (exit {INCOMPLETE}; --accept-skipped accepts this)", file=sys.stderr)
    return INCOMPLETE


def cluster_warnings(cluster: Cluster, nodes: list[str]) -> list[str]:
    """What a command given these manifests should be told: a node in ``nodes`` that nothing
    names (no Node object, no pod runs on it: a typo, most likely; a Node object that runs no pod
    yet is a fresh node, no mistake), pods whose ``spec.nodeName`` no Node object names when the
    manifests hold Node objects (a typo, most likely: such a node has no labels or addresses, so
    no ``nodes`` peer selects it), pods in namespaces that have no Namespace object (their labels
    are unknown, so a namespaceSelector sees only the automatic name label)."""
    warnings = []
    on = {pod.node for pod in cluster.pods.values()}
    for node in nodes:
        if node not in on and node not in cluster.nodes:
            known = sorted({*(n for n in on if n), *cluster.nodes})
            warnings.append(f"no pod runs on node {node} (--node) and no Node object has that name; "
                            f"the nodes named: {', '.join(known) or 'none'}")
    unnamed = sorted(n for n in on if n and n not in cluster.nodes) if cluster.nodes else []
    if unnamed:
        warnings.append(f"pods run on nodes that no Node object names: {', '.join(unnamed)} (spec.nodeName); the Node "
                        f"objects: {', '.join(sorted(cluster.nodes))}; such a node has no labels or addresses for a nodes peer")
    missing = sorted({pod.namespace for pod in cluster.pods.values()} - cluster.namespaces.keys())
    if missing:
        warnings.append(f"pods in namespaces without a Namespace object: {_first(missing)}; their labels are unknown, so a "
                        f"namespaceSelector sees only {NAMESPACE_NAME_LABEL} (add the Namespace objects to the manifests)")
    homeless = sorted(p.key for p in cluster.policies.values()
                      if p.namespace not in cluster.namespaces and p.namespace not in missing)
    if homeless:
        warnings.append(f"NetworkPolicies in namespaces that no Namespace object or pod names: {_first(homeless)}; "
                        f"the API server refuses a policy in a namespace that does not exist (a typo, most likely)")
    warnings.extend(unmatched_port_names(cluster))
    return warnings


def _first(names: Sequence[str], shown: int = 5) -> str:
    """The first ``shown`` of ``names``, then ``and N more``."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def unmatched_port_names(cluster: Cluster) -> list[str]:
    """A warning for each NetworkPolicy rule port given by name that no pod it could reach has:
    the pods the policy selects for an ingress rule, the pods its peers select (every pod when
    the rule has no peer or an ipBlock peer) for an egress rule. Such a port matches nothing
    (NetworkPolicyPort API reference: a named port is the container port of that name and
    protocol on the destination pod), most likely a typo. A policy that selects no pod is
    left alone (nothing to reach yet)."""
    warnings = []
    by_namespace: dict[str, list[Pod]] = {}
    for pod in cluster.pods.values():
        by_namespace.setdefault(pod.namespace, []).append(pod)
    for policy in sorted(cluster.policies.values(), key=lambda p: p.key):
        subjects = [p for p in by_namespace.get(policy.namespace, ()) if policy.pod_selector.matches(p.labels)]
        if not subjects:
            continue
        for direction in ("ingress", "egress"):
            for index, rule in enumerate(policy.rules(direction)):  # 0-based, as explain, trace and the field paths
                named = sorted({(p.port, p.protocol) for p in rule.ports if isinstance(p.port, str)})
                if not named:
                    continue
                reached = subjects if direction == "ingress" else _peer_pods(cluster, policy, rule.peers, by_namespace)
                for name, protocol in named:
                    if any(pod.resolve_port(name, protocol) is not None for pod in reached):
                        continue
                    names = sorted({f"{p.name}/{p.protocol}" for pod in reached for p in pod.ports if p.name})
                    whose = "the pods it selects" if direction == "ingress" else "the pods its peers select"
                    warnings.append(f"NetworkPolicy {policy.key}: {direction} rule {index} names port {name!r} ({protocol}), "
                                    f"which none of {whose} has; their port names: {_first(names) or 'none'}")
    return warnings


def _peer_pods(cluster: Cluster, policy: NetworkPolicy, peers: Sequence[Peer], by_namespace: Mapping[str, list[Pod]]) -> list[Pod]:
    """The pods that an egress rule's ``peers`` select (NetworkPolicyPeer API reference: a
    namespaceSelector picks namespaces by their labels, else the policy's own; a podSelector
    picks pods in them, else all); every pod when there is no peer or an ipBlock peer."""
    if not peers or any(peer.ip_block is not None for peer in peers):
        return list(cluster.pods.values())
    reached: list[Pod] = []
    for peer in peers:
        if peer.namespace_selector is None:
            namespaces = [policy.namespace]
        else:
            namespaces = [ns for ns in by_namespace if peer.namespace_selector.matches(cluster.namespace_labels(ns))]
        for ns in namespaces:
            reached.extend(p for p in by_namespace.get(ns, ()) if peer.pod_selector is None or peer.pod_selector.matches(p.labels))
    return reached


def placement_nodes(cluster: Cluster, given: Sequence[str]) -> list[str]:
    """The nodes that pods without ``spec.nodeName`` (workloads' stand-ins, bare pods) are spread
    over, round-robin: ``given`` (``--node``), else the manifests' Node objects, else ``node1``
    (the sandbox's default node), so that sandbox and explain place them alike and never on a
    node the manifests do not have."""
    return list(given) or sorted(cluster.nodes) or ["node1"]


def note(notes: list[str]) -> None:
    """One ``nftpolicy: note: ...`` line each (never an exit: see :meth:`Manifests.dump_notes`)."""
    for line in notes:
        print(f"nftpolicy: note: {line}", file=sys.stderr)


def warn(warnings: list[str], strict: bool) -> None:
    """One ``nftpolicy: warning: ...`` line each; with ``--strict`` any of them ends the command
    (exit 2) after a last line that says so."""
    for warning in warnings:
        print(f"nftpolicy: warning: {warning}", file=sys.stderr)
    if warnings and strict:
        print(f"nftpolicy: --strict: stopped on {len(warnings)} {plural(len(warnings), 'warning', 'warnings')} (exit 2)",
              file=sys.stderr)
        raise SystemExit(2)
