"""Text from the API (a ClusterNetworkPolicy rule name, a destinationNamedPort, any name) never
makes a printer's output refused: :func:`~nftpolicy.translators.rules.safe_text` and each
output's rule (nft comment and log prefix, iptables comment and NFLOG prefix, ipset comment line),
checked as pure functions and against the real tools, each in a network namespace of the test's.

What the tools refuse in the raw text (the finding these functions answer, reproduced here so
that a new libnftables or iptables that refuses more shows up): libnftables 1.0.6 JSON a NUL;
nft syntax a NUL and ``"`` (and ``$`` in a log prefix); iptables-restore 1.8.9 a newline and
``"`` (and a NUL cuts the rule: it loses its target); ipset restore 7.17 a newline in a comment
line (and a line of 1024 bytes or more).
"""

from __future__ import annotations

import json
import subprocess
import unicodedata

import nftables
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nftpolicy.agent.dataplane import netns
from nftpolicy.agent.dataplane.nftables import NftDataplane
from nftpolicy.translators import iptables, layout, nfttext, transaction
from nftpolicy.translators.rules import (
    COMMENT_MAX_BYTES,
    ESCAPED_CATEGORIES,
    LOG_PREFIX_MAX_BYTES,
    AddressSet,
    comment,
    log_prefix_text,
    safe_text,
)

from .conftest import nft

# Every code point below 0x100, then characters of every escaped category and some that stay
SPECIALS = [0x00AD, 0x061C, 0x200B, 0x200E, 0x202E, 0x2066, 0x2028, 0x2029, 0xFEFF, 0xFFFE, 0xFFFF, 0xD800, 0xDFFF,
            0xE000, 0x1F600, 0xE0001, 0x10FFFF, 0x00A0, 0x3000]
CODE_POINTS = list(range(0x100)) + SPECIALS
TEXTS = [f"a{chr(c)}b" for c in CODE_POINTS] + ["\x00" * 200, "é" * 200, '"' * 300, "$" * 200, "\\" * 300, "😀" * 100,
                                                "a\u202e" * 70, "{};#\n" * 60]
OUTPUTS = {  # each output's rule and its byte limit
    "nft comment": (comment, COMMENT_MAX_BYTES),
    "nft log prefix": (log_prefix_text, LOG_PREFIX_MAX_BYTES),
    "iptables comment": (lambda t: safe_text(t, iptables.COMMENT_MAX), iptables.COMMENT_MAX),
    "iptables NFLOG prefix": (lambda t: safe_text(t, iptables.NFLOG_PREFIX_MAX), iptables.NFLOG_PREFIX_MAX),
    "ipset comment line": (lambda t: iptables.ipset_comment_line(t).removeprefix("# "), iptables.IPSET_LINE_MAX - 2),
}
RAW = [c for c in range(0x21)] + [0x22, 0x24, 0x5C, 0x7F, 0x85, 0x9F, 0x2028, 0x202E]  # probed raw (unescaped)


def _safe(text: str, also: str = "") -> bool:
    return '"' not in text and not any(c in also or unicodedata.category(c) in ESCAPED_CATEGORIES for c in text)


# ---- the pure rules ---------------------------------------------------------------------------

@given(st.text(st.characters(exclude_categories=()), max_size=400))  # surrogates included
@settings(max_examples=400, deadline=None)
def test_every_output_is_safe_within_its_limit_idempotent_and_as_long_as_fits(text):
    for name, (rule, limit) in OUTPUTS.items():
        out = rule(text)
        assert len(out.encode()) <= limit, name  # encodes: no surrogate left
        assert _safe(out, "$" if rule is log_prefix_text else ""), (name, out)
        assert rule(out) == out, name
    pieces = [safe_text(c, 16) for c in text]  # what each character becomes
    for limit in (0, 1, 5, 63, 127, 128, 255):
        taken, size = 0, 0
        while taken < len(pieces) and size + len(pieces[taken].encode()) <= limit:
            size += len(pieces[taken].encode())
            taken += 1
        assert safe_text(text, limit) == "".join(pieces[:taken])  # whole pieces, as many as fit


@pytest.mark.parametrize("text, limit, expected", [
    ("x/p ingress", 128, "x/p ingress"),  # the common case: unchanged
    ('say "hi"', 128, "say 'hi'"),
    ("a\x00b", 128, "a\\x00b"),
    ("a\nb\tc\x7f\x85", 128, "a\\x0ab\\x09c\\x7f\\x85"),
    ("rtl\u202eevil", 128, "rtl\\u202eevil"),
    ("tag\U000e0001", 128, "tag\\U000e0001"),
    ("half\ud800", 128, "half\\ud800"),  # a lone surrogate (PyYAML makes one of "\ud800")
    ("ab\x00", 5, "ab"),  # the escape (4 bytes) does not fit: left out whole
    ("é" * 70, 128, "é" * 64),
    ("a\\x00b", 128, "a\\x00b"),  # a backslash stays
    ("$HOME", 128, "$HOME"),
])
def test_safe_text(text, limit, expected):
    assert safe_text(text, limit) == expected


def test_a_log_prefix_escapes_the_dollar_sign_too():
    assert log_prefix_text("cost $5 deny: ") == "cost \\x245 deny: "
    assert len(log_prefix_text("$" * 200).encode()) == 124  # 31 escapes of 4 bytes


def test_iptables_words_double_a_backslash_and_keep_within_the_kernel_limits():
    assert iptables.comment_word("a\\b\x00") == '"a\\\\b\\\\x00"'
    assert iptables.nflog_prefix("é" * 40) == '"' + "é" * 31 + '"'


# ---- the real tools ---------------------------------------------------------------------------

def _libnftables(ns: str, batch: str) -> tuple[int, str]:
    """Run ``batch`` (libnftables JSON when it starts with ``{``, else nft syntax) in ``ns``."""
    with netns.entered(ns):
        ctx = nftables.Nftables()
    ctx.set_json_output(batch.startswith("{"))  # JSON output: libnftables reads its input as JSON (as the agent's)
    rc, _, error = ctx.cmd(batch)
    return rc, error


def _raw_json(text: str) -> str:
    """A table whose one rule logs and comments ``text`` as it is (only ``"`` replaced, as before)."""
    text = text.replace('"', "'")
    t = {"family": "inet", "table": "raw"}
    return orjson.dumps({"nftables": [{"add": {"table": {"family": "inet", "name": "raw"}}}, {"add": {"chain": {**t, "name": "c"}}},
                                      {"add": {"rule": {**t, "chain": "c", "expr": [{"log": {"prefix": text, "group": 1}}], "comment": text}}}]}).decode()


@pytest.mark.kernel
def test_libnftables_refuses_these_raw_characters(make_netns):
    """The finding: of the code points in :data:`RAW`, libnftables' JSON parser refuses a NUL
    only (the issue's ``syntax error, unexpected '{'``); nft syntax also ``"`` in a comment and
    ``$`` in a log prefix."""
    ns = make_netns()
    json_refused = [c for c in RAW if _libnftables(ns, _raw_json(f"a{chr(c)}b"))[0] != 0]
    assert json_refused == [0x00]
    assert "syntax error, unexpected '{'" in _libnftables(ns, _raw_json("a\x00b"))[1]
    _libnftables(ns, "add table inet raw\nadd chain inet raw c")
    comment_refused = [c for c in RAW if _libnftables(ns, f'add rule inet raw c accept comment "a{chr(c)}b"')[0] != 0]
    prefix_refused = [c for c in RAW if _libnftables(ns, f'add rule inet raw c log prefix "a{chr(c)}b" group 1')[0] != 0]
    assert comment_refused == [0x00, 0x22] and prefix_refused == [0x00, 0x22, 0x24]


def _table(texts: list[str]) -> layout.Table:
    """A table whose one chain has a rule per text (logged with it as prefix, commented with it)
    and a set per text (commented with it)."""
    rules = tuple(layout.Rule((layout.Log(t, 100),), t) for t in texts)
    sets = tuple(AddressSet(f"S{i}", "ipv4", "addr", (), comment(t)) for i, t in enumerate(texts))
    return layout.Table("nftpolicy", 0, sets, (layout.Chain("C", rules),), ())


@pytest.mark.kernel
def test_every_text_loads_as_libnftables_json_and_as_nft_syntax_and_lists_back_as_printed(make_netns):
    json_ns, text_ns = make_netns(), make_netns()
    tx = transaction.replacing(_table(TEXTS))
    NftDataplane("nftpolicy", json_ns).run(tx)
    nft(text_ns, "-f", "-", stdin=nfttext.transaction_text(tx))
    for ns in (json_ns, text_ns):
        listed = json.loads(nft(ns, "-j", "list", "chain", "inet", "nftpolicy", "C"))["nftables"]
        rules = [o["rule"] for o in listed if "rule" in o]
        assert [r["comment"] for r in rules] == [comment(t) for t in TEXTS]
        assert [r["expr"][0]["log"]["prefix"] for r in rules] == [log_prefix_text(t) for t in TEXTS]
    sets = json.loads(nft(text_ns, "-j", "list", "sets", "inet"))["nftables"]
    assert sorted(s["set"]["comment"] for s in sets if "set" in s) == sorted(comment(t) for t in TEXTS)


def _restore(ns: str, loader: str, rules: list[str]) -> subprocess.CompletedProcess:
    text = "\n".join(["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]", ":X - [0:0]", *rules, "COMMIT", ""])
    return subprocess.run(["ip", "netns", "exec", ns, f"iptables-{loader}-restore"], input=text, capture_output=True, text=True)


def _saved(ns: str, loader: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "exec", ns, f"iptables-{loader}-save", "-t", "filter"], capture_output=True, text=True).stdout
    return [line for line in out.split("\n") if line.startswith("-A X ")]


@pytest.mark.kernel
@pytest.mark.parametrize("loader", ["nft", "legacy"])
def test_iptables_restore_refuses_or_cuts_these_raw_characters_and_takes_every_safe_text(make_netns, loader):
    ns = make_netns()
    raw = [c for c in RAW if _restore(ns, loader, [f'-A X -m comment --comment "a{chr(c)}b" -j NFLOG --nflog-prefix "a{chr(c)}b"'])
           .returncode != 0]
    assert raw == [0x0A, 0x22]
    _restore(ns, loader, ['-A X -m comment --comment "a\x00b" -j REJECT'])
    assert _saved(ns, loader) == ["-A X -m comment --comment a"]  # the NUL ended the line: no REJECT
    rules = [f"-A X -m comment --comment {iptables.comment_word(t)} -j NFLOG --nflog-prefix {iptables.nflog_prefix(t)}" for t in TEXTS]
    result = _restore(ns, loader, rules)
    assert result.returncode == 0, result.stderr
    saved = _saved(ns, loader)
    assert len(saved) == len(TEXTS) and all(" -j NFLOG " in line for line in saved)
    assert '-m comment --comment "a\\\\x00b"' in saved[0]  # iptables-save doubles the backslash it holds


@pytest.mark.kernel
def test_ipset_restore_takes_every_comment_line(make_netns):
    ns = make_netns()
    lines = ["create S hash:ip family inet hashsize 1024 maxelem 1048576"]
    for i, t in enumerate(TEXTS + ["x" * 5000]):
        lines += [iptables.ipset_comment_line(t), f"add S 10.0.{i // 250}.{i % 250 + 1}"]
    result = subprocess.run(["ip", "netns", "exec", ns, "ipset", "restore"], input="\n".join(lines) + "\n", capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    listed = subprocess.run(["ip", "netns", "exec", ns, "ipset", "list", "S"], capture_output=True, text=True).stdout
    assert f"Number of entries: {len(TEXTS) + 1}" in listed
    raw = subprocess.run(["ip", "netns", "exec", ns, "ipset", "restore"], input="# a\nb\n", capture_output=True, text=True)
    assert raw.returncode != 0  # the raw newline: "b" is read as a command
