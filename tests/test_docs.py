"""The documentation holds together: every relative Markdown link in README.md, docs/*.md and
DESIGN.md names a file of the repository and, with ``#anchor``, a heading of that file (GitHub's
heading slugs); every repository path that README.md and docs/*.md write as inline code exists;
the README stays a five-minute read (under 300 lines). Pure: reads files only."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# DESIGN.md's links are checked too, and the examples' READMEs'
LINKED = [*DOCS, REPO / "DESIGN.md", *sorted((REPO / "examples").glob("*/README.md"))]
README_MAX_LINES = 300

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
REPO_PATH = re.compile(r"(?:agent|translators|tests|bench|tools|charts|docs|examples|\.ci)/[\w.*/-]*")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks (links and headings there are not Markdown)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text (inline code and links give
    their text), lower-cased, every character that is not a letter, a digit, a space, ``-`` or
    ``_`` removed (``*`` of emphasis too), spaces turned into ``-``."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    kept = "".join(ch for ch in text.lower()
                   if ch in " -_" or unicodedata.category(ch)[0] in ("L", "N"))
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's ``-1``, ``-2`` ... for repeats."""
    seen: dict[str, int] = {}
    result = set()
    for heading in HEADING.findall(_prose(path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path: Path) -> list[str]:
    """The targets of the Markdown links and images of a file, outside code."""
    prose = INLINE_CODE.sub("", _prose(path.read_text()))
    return LINK.findall(prose)


def test_slug_follows_githubs_rules():
    assert slug("The real node: `.ci/e2e`") == "the-real-node-cie2e"
    assert slug("Packet path: `bench/packet_path.py`") == "packet-path-benchpacket_pathpy"
    assert slug("Bridge-based CNIs: br_netfilter") == "bridge-based-cnis-br_netfilter"
    assert slug("`nftpolicy render [--node NAME] PATH...`") == "nftpolicy-render---node-name-path"


@pytest.mark.parametrize("doc", LINKED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(doc: Path):
    broken = []
    for target in links(doc):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(REPO) if linked.is_relative_to(REPO) else linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_in_inline_code_exists(doc: Path):
    """A path such as `agent/daemon/reconcile.py` written on its own in inline code names a file
    or directory that is there (a glob: at least one match), so a move leaves no stale path."""
    missing = []
    for match in INLINE_CODE.finditer(_prose(doc.read_text())):
        code = match.group(2).strip()
        if not REPO_PATH.fullmatch(code):
            continue
        found = any(REPO.glob(code)) if "*" in code else (REPO / code).exists()
        if not found:
            missing.append(code)
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


def test_readme_is_a_five_minute_read():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_commands_md_lists_every_command_and_flag_and_no_other():
    """docs/commands.md has a "Flags of <command>" table for every subcommand of the parser, and
    each table (with the shared input and ruleset flags it points to) holds exactly that
    command's flags: a flag added, renamed or removed in agent/cli/flags.py shows up here."""
    import argparse

    from nftpolicy.agent.cli.flags import parser

    text = (REPO / "docs" / "commands.md").read_text()
    sections = dict(re.findall(r"^### (.+?)\n(.*?)(?=^#{1,3} |\Z)", text, re.M | re.S))

    def flags_in(section: str) -> set[str]:
        return set(re.findall(r"^\| `(--[a-z0-9-]+)", sections[section], re.M))

    shared = {"input": flags_in("Input flags"), "ruleset": flags_in("Ruleset flags")}
    subparsers = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        section = f"Flags of {name}"
        assert section in sections, f"docs/commands.md has no '### {section}'"
        documented = flags_in(section)
        for group in ("input", "ruleset"):
            if f"(#{group}-flags)" in sections[section]:
                documented |= shared[group]
        actual = {option for action in sub._actions for option in action.option_strings
                  if option.startswith("--") and option != "--help"}
        assert documented == actual, (name, "undocumented:", actual - documented, "no such flag:", documented - actual)


def test_operations_md_names_every_value_of_the_chart():
    """docs/operations.md names every top-level value of charts/nftpolicy/values.yaml and every
    ``agent.*`` value (one per agent flag), so a value added to the chart shows up here."""
    import yaml

    values = yaml.safe_load((REPO / "charts" / "nftpolicy" / "values.yaml").read_text())
    text = (REPO / "docs" / "operations.md").read_text()
    named = {name.rstrip(".") for name in re.findall(r"`([A-Za-z][\w.]*)", text)}  # `rbac.create` names rbac
    keys = {key for key in values if key != "agent"} | {f"agent.{key}" for key in values["agent"]}
    assert sorted(key for key in keys if not any(n == key or n.startswith(f"{key}.") for n in named)) == []
