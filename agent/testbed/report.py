"""The sandbox's reachability output: a compact table with a legend (the default), JSON for CI,
and a self-contained HTML page.

* **Text** (``--output text``): a legend that numbers the pods grouped by node and namespace,
  then one grid per probed port and family whose columns are those numbers (split into blocks
  of columns so that no line is wider than :data:`WIDTH`), then the blocked pairs.
* **JSON** (``--output json``): one object on stdout at the end: the pods, and every cell of
  every matrix (``allowed``; ``expected`` when a case gives it; ``denied_by`` for a blocked cell
  that a ClusterNetworkPolicy ``Deny`` rule refused). The command's other lines go to
  stderr meanwhile, so stdout is only the JSON.
* **HTML** (``--report FILE.html``): the matrices as coloured grids (allowed, blocked, differs
  from the expected, not probed), each cell's hover text naming the policies that select each
  end (from the rule model: the policy chains each pod chain jumps to) and, for a blocked one, the
  ClusterNetworkPolicy ``Deny`` rule that refused it (:func:`cluster_denials`), and the policies
  involved. No external file, script or font.

:class:`SandboxOutput` collects the sections of one sandbox run; the sandbox command makes one, calls
:meth:`SandboxOutput.matrices` where it printed matrices, and leaves the ``with`` block.
"""

from __future__ import annotations

import contextlib
import datetime
import html
import json
import sys
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Callable, Literal, Mapping, Sequence, TextIO, cast

from nftpolicy.translators.cases import NODE_TARGET, Matrix, target_address
from nftpolicy.translators.model import Cluster, Family, Pod, family_of
from nftpolicy.translators.noderender import build_rule_model
from nftpolicy.translators.rules import Config
from nftpolicy.translators.verdict import Connection, ConnectionProtocol, enforcement_of

from .probes import ProbeSpec

WIDTH = 120
Output = Literal["text", "json"]
Results = Mapping[tuple[ProbeSpec, Family], Matrix]
Selecting = dict[str, dict[str, list[str]]]  # pod key -> direction -> policy keys
Denials = dict[tuple[ProbeSpec, Family, str, str], str]  # (spec, family, from, to) of a blocked cell -> the Deny rule in words


@dataclass
class Section:
    """One set of matrices: a manifests run, or one case (``title``) with its expected matrices.
    ``targets``: the Nodes probed as destinations (``node:<name>`` columns after the pods', no rows)."""

    title: str | None
    pods: list[str]
    nodes: dict[str, str]
    results: dict[tuple[ProbeSpec, Family], Matrix]
    expected: dict[tuple[ProbeSpec, Family], Matrix]
    selecting: Selecting = field(default_factory=dict)
    denials: Denials = field(default_factory=dict)
    targets: list[str] = field(default_factory=list)


def selecting_policies(cluster: Cluster, config: Config = Config()) -> Selecting:
    """Pod key -> ``ingress``/``egress`` -> the policies that isolate it for that direction, from
    the rule model rendered with every pod local (its pod chains and the policy chains they
    jump to). A pod that no policy selects is absent."""
    model = build_rule_model(cluster, None, config)
    policy_of = {c.name: c.policy for c in model.policy_chains}
    selecting: Selecting = {}
    for chain in model.pod_chains:
        if chain.policies is not None:
            selecting.setdefault(chain.pod, {})[chain.direction] = sorted(policy_of[c] for c in chain.policies)
    return selecting


def cluster_denials(cluster: Cluster, pods: Mapping[str, Pod], results: Results, config: Config = Config()) -> Denials:
    """The blocked cells of ``results`` that a ClusterNetworkPolicy ``Deny`` rule refused, each
    with that rule in words, ``Admin Deny guard ingress rule 1`` (tier, action, policy,
    direction, rule index: what ``nftpolicy_cluster_denied_packets_total`` and the NFLOG prefix
    name), from the verdict engine on ``cluster`` (with the sandbox's addresses, which ``pods``
    hold); none without a ClusterNetworkPolicy."""
    if not cluster.cluster_policies:
        return {}
    enforcement = enforcement_of(cluster, config=config)
    denials: Denials = {}
    for (spec, family), matrix in results.items():
        for (src, dst), allowed in matrix.items():
            source = next((ip for ip in pods[src].ips if family_of(ip) == family), None)
            destination = next((ip for ip in pods[dst].ips if family_of(ip) == family), None) if dst in pods else \
                target_address(cluster, dst, family)
            if allowed or source is None or destination is None:
                continue
            protocol = cast(ConnectionProtocol, spec.protocol)  # a probe's protocol is one of the engine's
            verdict = enforcement.verdict(Connection(source, destination, protocol, None if protocol == "ICMP" else spec.port))
            for side in (verdict.egress, verdict.ingress):
                rule = side.cluster_rule
                if side.allowed is False and rule is not None:
                    denials[(spec, family, src, dst)] = f"{side.cluster_action} {rule.policy} {rule.direction} rule {rule.rule}"
                    break
    return denials


def pod_numbers(pods: Sequence[str], nodes: Mapping[str, str], targets: Sequence[str] = ()) -> dict[str, int]:
    """Pod key -> its number (1..n), in order of node, then namespace, then name; then each
    Node target (``node:<name>``) in the order given."""
    ordered = sorted(pods, key=lambda p: (nodes.get(p, ""), *p.split("/", 1))) + list(targets)
    return {pod: i for i, pod in enumerate(ordered, 1)}


def _sorted_results(results: Mapping[tuple[ProbeSpec, Family], Matrix]) -> list[tuple[tuple[ProbeSpec, Family], Matrix]]:
    return sorted(results.items(), key=lambda kv: (kv[0][0].port, kv[0][0].protocol, kv[0][1]))


def _cell(matrix: Matrix, expected: Matrix | None, src: str, dst: str) -> str:
    """``.`` allowed, ``X`` blocked, ``?`` not probed, ``!`` differs from the expected."""
    if (src, dst) not in matrix:
        return "?"
    got = matrix[(src, dst)]
    if expected is not None and src != dst and (src, dst) in expected and expected[(src, dst)] != got:
        return "!"
    return "." if got else "X"


def _wrapped(head: str, items: list[str], indent: int) -> list[str]:
    lines, line = [], head
    for item in items:
        if len(line) + 1 + len(item) > WIDTH and line.strip():
            lines.append(line)
            line = " " * indent + item
        else:
            line = f"{line} {item}" if line else item
    return lines + [line]


def legend(section: Section, numbers: Mapping[str, int]) -> list[str]:
    """``node1  shop: 1 api-0  2 frontend-1`` lines (wrapped), then what the cell symbols mean."""
    lines: list[str] = []
    groups: dict[tuple[str, str], list[str]] = {}
    for pod in sorted(numbers, key=numbers.__getitem__):
        if pod in section.targets:
            continue
        namespace, _, name = pod.partition("/")
        groups.setdefault((section.nodes.get(pod, "?"), namespace), []).append(f"{numbers[pod]} {name}")
    for (node, namespace), names in groups.items():
        lines += _wrapped(f"{node}  {namespace}:", [n + " " for n in names], len(node) + len(namespace) + 4)
    if section.targets:
        lines += _wrapped("node addresses (columns only):", [f"{numbers[t]} {t[len(NODE_TARGET):]} " for t in section.targets], 4)
    lines.append("rows: from, columns: to; . allowed  X blocked  ? not probed" + ("  ! differs from the expected" if section.expected else ""))
    return [line.rstrip() for line in lines]


def grid(section: Section, numbers: Mapping[str, int], matrix: Matrix, expected: Matrix | None) -> list[str]:
    """The matrix with numbered rows and columns, in blocks of columns at most :data:`WIDTH` wide."""
    order = sorted(numbers, key=numbers.__getitem__)
    width = len(str(len(order)))
    per_block = max(1, (WIDTH - width - 1) // (width + 1))
    lines: list[str] = []
    for start in range(0, len(order), per_block):
        columns = order[start:start + per_block]
        lines.append(" " * width + " " + " ".join(str(numbers[c]).rjust(width) for c in columns))
        for src in order[:len(order) - len(section.targets)]:  # a Node target is a column only
            cells = " ".join(_cell(matrix, expected, src, dst).rjust(width) for dst in columns)
            lines.append(f"{str(numbers[src]).rjust(width)} {cells}")
    return lines


def _ranges(numbers: list[int]) -> list[str]:
    """``[1, 2, 3, 5]`` -> ``["1-3", "5"]``."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return [f"{r[0]}-{r[-1]}" if len(r) > 2 else " ".join(map(str, r)) for r in runs]


def blocked_pairs(numbers: Mapping[str, int], matrix: Matrix) -> list[str]:
    """The words of ``3 -> 1 2 5-9; 4 -> 1``: for every source with a blocked destination (the
    diagonal left out), its destinations, runs of three or more as ranges."""
    by_source: dict[str, list[int]] = {}
    for (src, dst), allowed in matrix.items():
        if not allowed and src != dst:
            by_source.setdefault(src, []).append(numbers[dst])
    items = [f"{numbers[src]} -> {' '.join(_ranges(dsts))}" for src, dsts in sorted(by_source.items(), key=lambda kv: numbers[kv[0]])]
    return "; ".join(items).split(" ") if items else []


def compact_text(section: Section) -> str:
    """The text output of one section (module docstring); every line at most :data:`WIDTH`."""
    numbers = pod_numbers(section.pods, section.nodes, section.targets)
    lines = ([f"== {section.title}"] if section.title else []) + legend(section, numbers)
    for (spec, family), matrix in _sorted_results(section.results):
        lines += ["", f"{spec.protocol}/{spec.port} {family}"]
        lines += grid(section, numbers, matrix, section.expected.get((spec, family)))
        pairs = blocked_pairs(numbers, matrix)
        lines += _wrapped("blocked:", pairs, 9) if pairs else ["blocked: none"]
    return "\n".join(lines)


def why(section: Section, src: str, dst: str, denied_by: str | None = None) -> str:
    """The hover text of a cell: the policies that select the source for egress and the
    destination for ingress (none: that direction is open), and the ClusterNetworkPolicy rule
    that denied it (``denied_by``, of :attr:`Section.denials`)."""
    def side(pod: str, direction: str) -> str:
        policies = section.selecting.get(pod, {}).get(direction)
        return f"{direction} of {pod}: " + (f"isolated by {', '.join(policies)}" if policies else "no policy selects it (open)")
    to = f"{dst}: a Node's address (no ingress policy)" if dst in section.targets else side(dst, 'ingress')
    return f"{side(src, 'egress')}\n{to}" + (f"\ndenied by {denied_by}" if denied_by else "")


def section_json(section: Section) -> dict[str, Any]:
    """A section as JSON data: pods (number, key, node; a Node target ``node:<name>`` too),
    policies per pod, and every cell."""
    numbers = pod_numbers(section.pods, section.nodes, section.targets)
    matrices = []
    for (spec, family), matrix in _sorted_results(section.results):
        expected = section.expected.get((spec, family), {})
        cells = []
        for (src, dst), allowed in sorted(matrix.items()):
            cell: dict[str, Any] = {"from": src, "to": dst, "allowed": allowed}
            if (src, dst) in expected:
                cell["expected"] = expected[(src, dst)]
            if (spec, family, src, dst) in section.denials:
                cell["denied_by"] = section.denials[(spec, family, src, dst)]
            cells.append(cell)
        matrices.append({"protocol": spec.protocol, "port": spec.port, "family": family, "cells": cells})
    pods = [{"number": n, "pod": p, "node": section.nodes.get(p), "policies": section.selecting.get(p, {})}
            for p, n in sorted(numbers.items(), key=lambda kv: kv[1])]
    return {"title": section.title, "pods": pods, "matrices": matrices}


STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.5em; } h3 { font-size: 1em; }
div.matrices { display: flex; flex-wrap: wrap; gap: 0 2.5em; align-items: flex-end; }
table.grid { border-collapse: collapse; margin: .5em 0 1em; }
table.grid th { font-weight: normal; font-size: 12px; padding: 0 4px; color: #555; }
table.grid th.to { padding: 0; text-align: center; }
table.grid th.from { text-align: right; white-space: nowrap; }
td.cell, .key span.cell { width: 18px; height: 18px; border: 1px solid #fff; text-align: center; font-size: 11px; color: #fff; }
td.allowed { background: #3a9d5d; } td.blocked { background: #d64545; }
td.differs { background: #f2a93b; outline: 2px solid #7a4b00; outline-offset: -3px; } td.unprobed { background: #ccc; }
.key span { display: inline-block; vertical-align: middle; margin: 0 4px 0 12px; } .key span.allowed { background: #3a9d5d; }
.key span.blocked { background: #d64545; } .key span.differs { background: #f2a93b; } .key span.unprobed { background: #ccc; }
table.policies { border-collapse: collapse; } table.policies td, table.policies th { border: 1px solid #ddd; padding: 2px 8px; text-align: left; }
"""
GLYPHS = {"allowed": "&#10003;", "blocked": "&#10007;", "differs": "!", "unprobed": "?"}  # check mark, ballot x
COUNT_SCRIPT = "document.body.dataset.cells = document.querySelectorAll('td.cell').length;"


def _html_grid(section: Section, spec: ProbeSpec, family: Family, matrix: Matrix, expected: Matrix | None) -> str:
    numbers = pod_numbers(section.pods, section.nodes, section.targets)
    order = sorted(numbers, key=numbers.__getitem__)
    esc = html.escape
    rows = ["<tr><th></th>" + "".join(f'<th class="to" title="{esc(p)}">{numbers[p]}</th>' for p in order) + "</tr>"]
    for src in order[:len(order) - len(section.targets)]:  # a Node target is a column only
        cells = []
        for dst in order:
            symbol = _cell(matrix, expected, src, dst)
            kind = {"?": "unprobed", "!": "differs", ".": "allowed", "X": "blocked"}[symbol]
            verdict = {"unprobed": "not probed", "differs": f"{'allowed' if matrix[(src, dst)] else 'blocked'}, expected "
                       f"{'blocked' if matrix[(src, dst)] else 'allowed'}" if symbol == "!" else "", "allowed": "allowed",
                       "blocked": "blocked"}[kind]
            title = f"{src} -> {dst}: {verdict}\n{why(section, src, dst, section.denials.get((spec, family, src, dst)))}"
            cells.append(f'<td class="cell {kind}" title="{esc(title)}">{GLYPHS[kind]}</td>')
        rows.append(f'<tr><th class="from">{numbers[src]} {esc(src)}</th>' + "".join(cells) + "</tr>")
    return '<table class="grid">' + "".join(rows) + "</table>"


def _html_policies(section: Section) -> str:
    by_policy: dict[tuple[str, str], list[str]] = {}
    for pod, directions in section.selecting.items():
        for direction, policies in directions.items():
            for policy in policies:
                by_policy.setdefault((policy, direction), []).append(pod)
    if not by_policy:
        return "<p>No policy selects any pod: every direction is open.</p>"
    rows = "".join(f"<tr><td>{html.escape(p)}</td><td>{d}</td><td>{html.escape(', '.join(sorted(pods)))}</td></tr>"
                   for (p, d), pods in sorted(by_policy.items()))
    return f'<table class="policies"><tr><th>policy</th><th>direction</th><th>isolates</th></tr>{rows}</table>'


def html_page(sections: Sequence[Section], source: str = "", generated: str = "") -> str:
    """The whole report as one HTML document (module docstring): titled with ``source`` (what
    the sandbox read) and ``generated`` (when; both shown under the heading). Each cell carries
    a glyph besides its colour (:data:`GLYPHS`), so that it reads without colour too."""
    key = ('<p class="key">' + "".join(f'<span class="cell {kind}">{GLYPHS[kind]}</span>{words}' for kind, words in
                                       (("allowed", "allowed"), ("blocked", "blocked"), ("differs", "differs from the expected"),
                                        ("unprobed", "not probed")))
           + ' &nbsp; (rows: from, columns: to, by number; hover a cell for the policies)</p>')
    title = "nftpolicy sandbox report" + (f": {source}" if source else "")
    about = " &middot; ".join(html.escape(x) for x in (f"source: {source}" if source else "", f"generated {generated}" if generated else "") if x)
    parts = ["<!DOCTYPE html>", f'<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>',
             f"<style>{STYLE}</style></head><body>", f"<h1>{html.escape(title)}</h1>", f'<p class="about">{about}</p>' if about else "", key]
    for section in sections:
        if section.title:
            parts.append(f"<h2>{html.escape(section.title)}</h2>")
        parts.append('<div class="matrices">')
        for (spec, family), matrix in _sorted_results(section.results):
            parts.append(f"<div><h3>{spec.protocol}/{spec.port} {family}</h3>"
                         f"{_html_grid(section, spec, family, matrix, section.expected.get((spec, family)))}</div>")
        parts += ["</div>", "<h3>Policies involved</h3>", _html_policies(section)]
    parts += [f"<script>{COUNT_SCRIPT}</script>", "</body></html>", ""]
    return "\n".join(parts)


class SandboxOutput:
    """The output of one sandbox run: ``output`` ``text`` prints each section as it comes;
    ``json`` sends the command's other lines to stderr and prints one JSON object at the end;
    ``html_path`` also writes the HTML page there at the end, titled with ``source`` and the
    time ``clock`` gives then. Use it as a context manager: the
    outputs are written when the block ends without an exception."""

    def __init__(self, output: Output = "text", html_path: str | None = None, config: Config = Config(), source: str = "",
                 clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.timezone.utc)) -> None:
        self.output, self.html_path, self.config, self.source, self.clock = output, html_path, config, source, clock
        self.sections: list[Section] = []
        self._stdout: TextIO = sys.stdout
        self._redirect: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()

    def __enter__(self) -> "SandboxOutput":
        self._stdout = sys.stdout
        if self.output == "json":
            self._redirect = contextlib.redirect_stdout(sys.stderr)
            self._redirect.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._redirect.__exit__(kind, exc, tb)
        if kind is not None:
            return
        if self.output == "json":
            json.dump({"sections": [section_json(s) for s in self.sections]}, self._stdout, indent=1)
            self._stdout.write("\n")
        if self.html_path:
            with open(self.html_path, "w", encoding="utf-8") as f:
                f.write(html_page(self.sections, self.source, self.clock().isoformat(timespec="seconds")))

    def matrices(self, pods: Mapping[str, Pod], results: Results, cluster: Cluster,
                 expected: Mapping[tuple[ProbeSpec, Family], Matrix] | None = None, title: str | None = None) -> None:
        """Add one section: the sandbox's pods, the measured matrices, the cluster with the
        sandbox's addresses (for the policies) and, for a case, its expected matrices."""
        targets = sorted({dst for matrix in results.values() for _, dst in matrix if dst.startswith(NODE_TARGET)})
        section = Section(title, list(pods), {key: pod.node or "" for key, pod in pods.items()}, dict(results), dict(expected or {}),
                          selecting_policies(cluster, self.config), cluster_denials(cluster, pods, results, self.config), targets)
        self.sections.append(section)
        if self.output == "text":
            print(("\n" if len(self.sections) > 1 else "") + compact_text(section), file=self._stdout)
