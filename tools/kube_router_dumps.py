"""Capture real kube-router dumps (``iptables-save``, ``ipset save``) of a node, as test fixtures.

Usage (as root, from the repository)::

    .venv/bin/python tools/kube_router_dumps.py --out tests/fixtures/kube-router-v2.1.0 \\
        shop=examples/shop/cluster.yaml [NAME=MANIFEST[,MANIFEST...]]... [--node node1]

For each ``NAME=MANIFESTS`` cluster: a sandbox (agent/testbed/sandbox.py, dataplane ``kube-router``)
with every pod on its ``spec.nodeName`` at its ``status.podIPs`` and every node at the
``InternalIP`` of its Node object, a real control plane (etcd + kube-apiserver,
agent/testbed/controlplane.py) holding the cluster, and the real kube-router (agent/testbed/nodedaemons.py)
running on every node. Once kube-router has synced, ``OUT/NAME/`` gets ``<node>.iptables-save``,
``<node>.ip6tables-save`` (only when a pod has an IPv6 address), ``<node>.ipset-save``, the
manifests as ``cluster.yaml`` and a README.md naming the kube-router version, the commands that
produced them and kube-router's sync version (which its chain names hash). Every namespace,
process and temporary file it creates is removed at the end, also on Ctrl-C and SIGTERM.

Exit codes: 0 written; 2 a manifest is unreadable or invalid, a pod has no node or address, the
API server refused an object, or kube-router did not sync.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from nftpolicy.agent.testbed.controlplane import ControlPlane, ControlPlaneError, find_binary
from nftpolicy.agent.daemon.manifestfiles import manifest_files, read_objects
from nftpolicy.agent.testbed.nodedaemons import KUBE_ROUTER_SYNC_END, KubeRouters
from nftpolicy.agent.testbed.sandbox import Sandbox, SandboxError
from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.model import Cluster, Family

KUBE_ROUTER_MODULE = b"github.com/cloudnativelabs/kube-router/v2"
# kube-router's log line at the start of every sync (pkg/controllers/netpol, fullPolicySync).
SYNC_START = "Starting sync of iptables with version:"


class DumpsError(RuntimeError):
    """A cluster cannot be dumped; the message says which object and why."""


class DualStackKubeRouters(KubeRouters):
    """:class:`KubeRouters` with ``--enable-ipv6=true`` (kube-router's default is IPv4 only), for
    clusters whose pods have IPv6 addresses."""

    def _spawn(self, node: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        super()._spawn(node, argv + ["--enable-ipv6=true"], env)


def kube_router_version(binary: str) -> str:
    """The kube-router module version built into ``binary`` (Go build info, ``dep`` or ``mod``
    line, e.g. ``v2.1.0``); ``unknown`` when the binary carries none. The release binaries also
    print it with ``--version``, but the module build in ``.ci/install`` sets no ldflags."""
    data = Path(binary).read_bytes()
    found = re.search(rb"(?:dep|mod)\t" + re.escape(KUBE_ROUTER_MODULE) + rb"\t(v[0-9][^\t\n]*)", data)
    return found.group(1).decode() if found else "unknown"


def _tool_version(argv: list[str]) -> str:
    out = subprocess.run(argv, capture_output=True, text=True)
    return (out.stdout or out.stderr).strip().splitlines()[0] if out.returncode == 0 else "unknown"


def check_placed(cluster: Cluster) -> list[Family]:
    """The address families the cluster's pods use. Raises DumpsError naming the first pod
    without ``spec.nodeName`` or ``status.podIPs``: a fixture's pods must be where ``compare``
    rebuilds them."""
    families: set[Family] = set()
    for key, pod in sorted(cluster.pods.items()):
        if pod.host_network or pod.phase in ("Succeeded", "Failed"):
            continue
        if not pod.node or not pod.ips:
            raise DumpsError(f"pod {key}: needs spec.nodeName and status.podIPs (the fixture must say where it runs)")
        families.update(f for f in ("ipv4", "ipv6") if pod.addresses(f))  # type: ignore[misc]
    return sorted(families)  # type: ignore[return-value]


def last_sync(log: str) -> str:
    """The version of kube-router's last finished sync in its log (``Starting sync of iptables
    with version: N`` followed by ``sync iptables took``). Raises DumpsError when there is none."""
    starts = list(re.finditer(rf"{SYNC_START} (\d+)", log))
    if not starts or KUBE_ROUTER_SYNC_END not in log[starts[-1].end():]:
        raise DumpsError("no finished sync in kube-router's log")
    return starts[-1].group(1)


def manifests_text(paths: list[str]) -> str:
    """The manifests as one YAML text: a single file verbatim, several joined with ``---``."""
    files = manifest_files(paths)
    texts = [Path(f).read_text() for f in files]
    return texts[0] if len(texts) == 1 else "\n---\n".join(t.strip("\n") for t in texts) + "\n"


def capture(objects: list[tuple[str, Any]], cluster: Cluster, node: str, families: list[Family],
            kube_router: str | None, timeout: float) -> tuple[dict[str, str], list[str], str]:
    """Run the real kube-router on the cluster and save ``node``'s rules.

    Returns ({file name: text}, kube-router's argv on ``node``, the sync version of its last
    finished sync, which its chain names hash). Raises DumpsError (API refusal, unknown node, no
    finished sync in the log), ControlPlaneError (a process did not start or sync), SandboxError.
    """
    node_addresses = {n.name: n.addresses for n in cluster.nodes.values()}
    with contextlib.ExitStack() as stack:
        sandbox = stack.enter_context(Sandbox(cluster.pods.values(), (node,), families, node_addresses,
                                              dataplane="kube-router"))
        if node not in sandbox.nodes:
            raise DumpsError(f"node {node} runs no pod of the cluster (nodes: {', '.join(sandbox.nodes)})")
        control_plane = stack.enter_context(ControlPlane())
        refused = sandbox.publish(control_plane, objects)
        if refused:
            raise DumpsError("; ".join(str(e) for e in refused))
        routers = (DualStackKubeRouters if "ipv6" in families else KubeRouters)(sandbox, control_plane, kube_router)
        stack.callback(routers.close)
        routers.start()
        routers.wait_synced(timeout)
        sync_version = last_sync(routers.log(node))
        files = {f"{node}.iptables-save": routers.iptables_save(node)}
        if "ipv6" in families:
            files[f"{node}.ip6tables-save"] = routers.iptables_save(node, "ip6tables-save")
        files[f"{node}.ipset-save"] = routers.ipset_save(node)
        if last_sync(routers.log(node)) != sync_version:
            raise DumpsError(f"kube-router on {node} synced again while its rules were saved; run again")
        argv = [str(a) for a in routers.procs[node].args]  # type: ignore[union-attr]
        argv = [a.replace(control_plane.kubeconfig, "<admin kubeconfig>").replace(sandbox.node_netns(node), "<node netns>")
                for a in argv]
        return files, argv, sync_version


def _relative(text: str) -> str:
    """``text`` with this directory's absolute path taken off (paths in READMEs stay portable)."""
    return text.replace(f"{Path.cwd()}/", "")


def description(text: str) -> str:
    """The comment lines that open a manifest (``# ...`` before anything else), joined."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def readme(name: str, node: str, version: str, binary: str, argv: list[str], command: str, origin: str,
           about: str, files: list[str], sync_version: str) -> str:
    """The fixture's README.md: what the cluster is (``about``, from its opening comments), the
    kube-router version and command line that produced each file, the command of this script,
    the sync version and the saving tools' versions."""
    tools = ", ".join(_tool_version(tool) for tool in (["iptables", "--version"], ["ipset", "--version"]))
    replay = f"--iptables-save {node}.iptables-save" + (f" --ip6tables-save {node}.ip6tables-save" if f"{node}.ip6tables-save" in files else "")
    return "\n".join([
        f"# kube-router {version} dump of {node}: {name}",
        "",
        *([about, ""] if about else []),
        f"Produced by the real kube-router {version} (`{binary}`, module {KUBE_ROUTER_MODULE.decode()} {version}) "
        f"with `NODE_NAME={node} {' '.join(argv)}`, run by `{command}` in a sandbox node namespace against a real "
        f"kube-apiserver holding `cluster.yaml`; saved with {tools}.",
        "",
        f"The dump holds kube-router's sync version {sync_version}: its `KUBE-POD-FW-` and `KUBE-NWPLCY-` chain "
        "names hash it (a later sync renames them); set names do not.",
        "",
        "| file | content |",
        "|---|---|",
        f"| `cluster.yaml` | the cluster ({origin}) |",
        *(f"| `{f}` | `{'ipset save' if f.endswith('ipset-save') else f.split('.', 1)[1]}` of {node}'s namespace, as saved |"
          for f in files),
        "",
        f"Replay: `.venv/bin/nftpolicy compare --node {node} {replay} --ipset-save {node}.ipset-save cluster.yaml` "
        "(tests/test_real_dumps.py asserts its differences).",
        "",
    ])


def dump_cluster(name: str, sources: list[str], out: Path, node: str, kube_router: str | None, timeout: float) -> Path:
    """Capture one cluster into ``out/name``; returns that directory. Raises DumpsError,
    ControlPlaneError, SandboxError."""
    objects, unreadable = read_objects(sources)
    cluster, invalid = build_cluster(objects)
    if unreadable or invalid:
        raise DumpsError("; ".join(str(e) for e in unreadable + invalid))
    families = check_placed(cluster)
    binary = find_binary("kube-router", kube_router)
    files, argv, sync_version = capture(objects, cluster, node, families, binary, timeout)
    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    text = manifests_text(sources)
    cluster_file = target / "cluster.yaml"
    if not (cluster_file.exists() and cluster_file.read_text() == text):
        cluster_file.write_text(text)
    for file_name, content in files.items():
        (target / file_name).write_text(content)
    command = _relative(f".venv/bin/python tools/kube_router_dumps.py --out {out} --node {node} {name}={','.join(sources)}"
                        + (f" --kube-router {kube_router}" if kube_router else ""))
    written_here = len(sources) == 1 and Path(sources[0]).resolve() == cluster_file.resolve()
    origin = "written for this fixture" if written_here else "copied from " + ", ".join(f"`{_relative(s)}`" for s in sources)
    (target / "README.md").write_text(readme(name, node, kube_router_version(binary), _relative(binary),
                                             [_relative(a) for a in argv], command, origin, description(text),
                                             list(files), sync_version))
    return target


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(description="Capture the real kube-router's iptables-save / ipset save of a node "
                                                 "for each cluster (as root; everything runs in throwaway namespaces).")
    parser.add_argument("clusters", nargs="+", metavar="NAME=MANIFEST[,MANIFEST...]")
    parser.add_argument("--out", required=True, type=Path, help="output root: each cluster goes to OUT/NAME/")
    parser.add_argument("--node", default="node1", help="the node whose rules are saved (default node1)")
    parser.add_argument("--kube-router", help="kube-router binary (default .tools/bin/kube-router, then $PATH)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for kube-router's sync")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the sandbox, control plane and kube-routers always go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    jobs = []
    for item in args.clusters:
        name, sep, paths = item.partition("=")
        if not sep or not name or not paths or "/" in name:
            parser.error(f"{item!r}: expected NAME=MANIFEST[,MANIFEST...]")
        jobs.append((name, paths.split(",")))
    for name, sources in jobs:
        try:
            target = dump_cluster(name, sources, args.out, args.node, args.kube_router, args.timeout)
        except (DumpsError, ControlPlaneError, SandboxError, FileNotFoundError, subprocess.CalledProcessError) as exc:
            print(f"kube_router_dumps: {name}: {exc}", file=sys.stderr)
            return 2
        print(f"{name}: wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
