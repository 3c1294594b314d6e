"""Lay the manifests of the ClusterNetworkPolicy conformance suite for tools/npapi/cnp-conformance
(run by ``.ci/install --test`` before ``go test -c``; never committed).

Usage: ``python tools/npapi/manifests.py MODULE_DIR DEST``: copies ``MODULE_DIR/conformance/base``
(the module of sigs.k8s.io/network-policy-api in Go's module cache) to ``DEST/base`` and takes out
of ``base/manifests.yaml`` every container that serves SCTP (``agnhost porter`` with a
``SERVE_SCTP_PORT_*`` variable): this test bed's kernel has no SCTP, porter exits when it cannot
listen, and the suite's StatefulSets would never become Ready. Prints what it took out.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

ITEM = re.compile(r"^(\s*)- name: (.*)$")


def without_sctp_servers(text: str) -> tuple[str, list[str]]:
    """``text`` (a Go template of YAML, so read as lines) without the list items ``- name: X``
    whose lines mention ``SERVE_SCTP_PORT_``; returns it and the names taken out. An item ends
    at the next line indented as much as its dash or less."""
    lines, kept, removed, i = text.splitlines(keepends=True), [], [], 0
    while i < len(lines):
        item = ITEM.match(lines[i])
        if not item:
            kept.append(lines[i])
            i += 1
            continue
        indent, end = len(item.group(1)), i + 1
        while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
            end += 1
        block = lines[i:end]
        if any("SERVE_SCTP_PORT_" in line for line in block):
            removed.append(item.group(2).strip())
        else:
            kept.extend(block)
        i = end
    return "".join(kept), removed


def main(module: str, dest: str) -> int:
    source, target = Path(module) / "conformance" / "base", Path(dest) / "base"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    for path in target.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    base = target / "manifests.yaml"
    text, removed = without_sctp_servers(base.read_text())
    if not removed or "SCTP" in text:
        print(f"manifests.py: {base}: SCTP servers not found where expected", file=sys.stderr)
        return 2
    base.write_text(text)
    print(f"{len(removed)} SCTP server containers taken out: {', '.join(removed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
