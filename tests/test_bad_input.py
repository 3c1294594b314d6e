"""Bad input never costs the node its ruleset: each invalid object gets one line naming it, every
other object still renders, and the output loads in the kernel (inputs from adversarial review,
kept in tests/bad_input/)."""

from __future__ import annotations


import pytest
import yaml

from .conftest import REPO, nft
from .test_cli import run

BAD = REPO / "tests" / "bad_input"
EXPECTED = {
    "r1-list-items": "List -: items: must be a list, got int",
    "r2-ns-int": "Pod 5/p: metadata.namespace: invalid namespace 5",
    "r3-latin1": "not UTF-8 text: invalid continuation byte",
    # libyaml (the C loader) stops the nesting itself; the pure-Python loader recurses until Python stops it
    "r3b-deep": "document #1: not valid YAML/JSON" + (" at line 1, column 1003: exceeded maximum nesting depth"
                                                      if yaml.__with_libyaml__ else ": nested too deeply"),
    "r4-zone": "Pod default/p: status.podIPs[0]: invalid IP address 'fd00::5%eth0'",
    "r4b-zone-cidr": "spec.ingress[0].from[0].ipBlock.cidr: invalid CIDR 'fe80::%eth0/64'",
    "r5-dup-ip": None,  # valid objects: two pods share an IP; the Running one owns the dispatch
    "r6-unicode-name": "metadata.name: invalid name",
    "r6b-quote-name": "Pod default/a\"b: metadata.name: invalid name",
    "r6c-dollar-name": "Pod default/a$b: metadata.name: invalid name",
    "r7-hostnetwork-string": "Pod default/p: spec.hostNetwork: must be true or false, got 'false'",
    "r8-multidoc-syntax": "document #3: not valid YAML/JSON at line 16, column 1: did not find expected ',' or '}' "
                          "(while parsing a flow mapping at line 15, column 7)",
}


@pytest.mark.kernel
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_input_is_named_and_the_rest_loads(name, make_netns):
    out = run("render", str(BAD / f"{name}.yaml"))
    assert out.returncode == (0 if EXPECTED[name] is None else 3)  # 3: something was skipped
    assert "Traceback" not in out.stderr
    # what the file lacks (a Namespace object, any valid object) is warned about on lines of its own
    lines = [line for line in out.stderr.splitlines() if not line.startswith("nftpolicy: warning: ")]
    if EXPECTED[name] is None:
        assert lines == []
    else:
        assert len(lines) == 2 and EXPECTED[name] in lines[0], out.stderr
        assert lines[1].startswith("nftpolicy: 1 skipped: ") and lines[1].endswith(" (exit 3; --accept-skipped accepts this)")
        assert run("render", "--strict", str(BAD / f"{name}.yaml")).returncode == 2
        assert run("render", "--accept-skipped", str(BAD / f"{name}.yaml")).returncode == 0
    ns = make_netns()
    nft(ns, "-f", "-", stdin=out.stdout)
    assert "KUBE-ROUTER-FORWARD" in nft(ns, "list", "table", "inet", "nftpolicy")


def test_a_broken_document_keeps_the_policy_beside_it():
    out = run("render", str(BAD / "r8-multidoc-syntax.yaml"))
    assert "KUBE-POD-IN-" in out.stdout  # the deny-all in document 2 still isolates its pod


def test_duplicate_ip_dispatches_to_the_running_pod():
    out = run("render", str(BAD / "r5-dup-ip.yaml"))
    assert out.stdout.count(": jump KUBE-POD-IN-") == 1


@pytest.mark.parametrize(("flags", "message"), [
    (["--service-cidr", "foo"], "nftpolicy: --service-cidr: invalid CIDR 'foo'"),
    (["--external-cidr", "::1/200"], "nftpolicy: --external-cidr: invalid CIDR '::1/200'"),
    (["--table", "a;b"], "nftpolicy: --table: invalid table name 'a;b'"),
    (["--policy-mark", "0x20000"], "--policy-mark and --passed-mark must differ (both 0x20000)"),
    (["--policy-mark", "0x3"], "a mark must be one bit of 32, got 0x3"),
])
def test_bad_flags_are_refused_with_one_line(flags, message):
    out = run("render", *flags, str(REPO / "examples" / "shop"))
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(("text", "line"), [
    # one document: PyYAML's own marks, counted from 1
    ("kind: Pod\nmetadata: {name: \"x}\n", "document #1: not valid YAML/JSON at line 3, column 1: found unexpected end of stream "
                                          "(while scanning a quoted scalar at line 2, column 18) (<stdin>)"),
    # the third document of a file: the file's line, not the document's
    ("kind: Namespace\nmetadata: {name: a}\n---\nkind: Namespace\nmetadata: {name: b}\n--- # c\nkind: Pod\nmetadata:\n"
     "  name: x\n   bad: [\n", "document #3: not valid YAML/JSON at line 10, column 7: mapping values are not allowed in this context (<stdin>)"),
])
def test_a_yaml_error_is_one_line_with_the_files_own_line_and_column(text, line):
    out = run("render", "--accept-skipped", "-", stdin=text)
    errors = [line for line in out.stderr.splitlines() if not line.startswith("nftpolicy: warning: ")]
    assert out.returncode == 0 and errors == [f"nftpolicy: skipped {line}"]


def test_yaml_is_read_with_the_c_loader_when_pyyaml_has_it():
    from nftpolicy.translators.manifests import YAML_LOADER

    assert YAML_LOADER is (yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader)
    assert yaml.__with_libyaml__  # Debian's python3-yaml and PyPI's wheels both have libyaml


def test_a_malformed_item_of_a_json_list_is_named_and_the_file_skipped(tmp_path):
    """A JSON List is read item by item; an item that is not valid JSON is named by its number
    and place (the file is then read whole, as any broken document: it is left out, exit 3)."""
    path = tmp_path / "list.json"
    path.write_text('{"apiVersion": "v1", "kind": "List", "items": [\n'
                    '  {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a"}},\n'
                    '  {"apiVersion": "v1", "kind": "Namespace" "metadata": {"name": "b"}}\n]}\n')
    out = run("render", str(path))
    assert out.returncode == 3
    assert out.stderr.splitlines() == [
        f"nftpolicy: skipped document #1: not valid JSON in item #2: expecting ',' delimiter at line 3, column 44 ({path})",
        "nftpolicy: 1 skipped: document #1 (exit 3; --accept-skipped accepts this)"]


def test_a_json_list_item_nested_too_deeply_is_named_and_the_file_skipped(tmp_path):
    """An item nested deeper than the item-by-item read can follow (Python's stack) ends that
    read like any item it cannot read: the file is read whole, left out, the item named (exit 3)."""
    path = tmp_path / "deep.json"
    path.write_text('{"apiVersion": "v1", "kind": "List", "items": [\n'
                    '  {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a"}},\n'
                    '  {"kind": "ConfigMap", "data": ' + "[" * 5000 + "]" * 5000 + '}\n]}\n')
    out = run("render", str(path))
    assert out.returncode == 3 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == [
        f"nftpolicy: skipped document #1: not valid JSON in item #2: nested too deeply at line 3, column 3 ({path})",
        "nftpolicy: 1 skipped: document #1 (exit 3; --accept-skipped accepts this)"]


@pytest.mark.parametrize(("text", "error"), [
    # a date PyYAML resolves but cannot make (an unquoted annotation value)
    ("apiVersion: v1\nkind: Namespace\nmetadata: {name: a, annotations: {built: 2026-13-45}}\n", "month must be in 1..12"),
    # an integer beyond Python's 4300 digits (int() refuses it): as YAML, and as JSON (orjson refuses it,
    # then YAML; the item-by-item read names the item)
    ('{"apiVersion": "v1", "kind": "List", "items": [{"kind": "ConfigMap", "data": {"x": ' + "9" * 5000 + "}}]}",
     "99999999999999999999... is an integer beyond 64 bits"),
    ("kind: ConfigMap\ndata: {x: " + "9" * 5000 + "}\n", "Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits"),
])
def test_a_value_the_yaml_loader_cannot_make_skips_its_document(tmp_path, text, error):
    """PyYAML raises ValueError (not a YAMLError) for a scalar it resolves but cannot construct:
    the document is left out with one line, the others still render (exit 3), no traceback."""
    path = tmp_path / "odd.yaml"
    path.write_text(text + "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: b}\n")
    out = run("render", str(path))
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr
    what = "not valid JSON in item #1" if text.startswith("{") else "not valid YAML/JSON"
    assert out.stderr.splitlines() == [f"nftpolicy: skipped document #1: {what}: {error} ({path})",
                                       "nftpolicy: 1 skipped: document #1 (exit 3; --accept-skipped accepts this)"]


@pytest.mark.parametrize("whole", [False, True], ids=["item by item", "read whole"])
def test_a_file_the_system_refuses_to_read_is_named_and_the_rest_renders(whole):
    """A manifest the system refuses to read (here ``/proc/self/mem``: a regular file whose first
    read is an I/O error, even for root) is one line with the system's reason and left out like a
    file that does not parse (exit 3); the other paths still render. ``-`` among the paths makes
    every file read whole (stdin can be read only once)."""
    paths = ["/proc/self/mem", str(REPO / "examples" / "shop" / "cluster.yaml")] + (["-"] if whole else [])
    out = run("render", *paths, stdin="")
    assert out.returncode == 3 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == [
        "nftpolicy: skipped file /proc/self/mem: cannot read: Input/output error",
        "nftpolicy: 1 skipped: file /proc/self/mem (exit 3; --accept-skipped accepts this)"]
    assert "KUBE-ROUTER-FORWARD" in out.stdout
