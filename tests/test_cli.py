"""The ``nftpolicy`` command as a user runs it: exit codes, messages, cleanup on Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from nftpolicy.agent.cli.main import main


from nftpolicy.agent.dataplane import netns

from .conftest import CONFORMANCE, OURS, REPO

NFTPOLICY = str(Path(sys.executable).parent / "nftpolicy")
BAD_POLICY = """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: shop, name: bad-range}
spec:
  podSelector: {}
  ingress: [{ports: [{port: 9000, endPort: 8000}]}]
"""


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([NFTPOLICY, *args], input=stdin, capture_output=True, text=True, timeout=120)


def test_version():
    assert run("--version").stdout.startswith("nftpolicy ")


def test_render_json_is_a_libnftables_batch():
    out = run("render", "--node", "node1", "--format", "json", str(REPO / "examples" / "shop"))
    assert out.returncode == 0, out.stderr
    batch = json.loads(out.stdout)["nftables"]
    assert batch[0] == {"add": {"table": {"family": "inet", "name": "nftpolicy"}}}
    assert batch[1] == {"delete": {"table": {"family": "inet", "name": "nftpolicy"}}}


def test_invalid_object_is_named_skipped_and_the_rest_renders():
    example = (REPO / "examples" / "shop" / "cluster.yaml").read_text()
    out = run("render", "--node", "node1", "-", stdin=example + "\n---\n" + BAD_POLICY)
    assert out.returncode == 3  # something was skipped (tests/test_first_contact.py)
    assert "NetworkPolicy shop/bad-range: spec.ingress[0].ports[0].endPort: must be greater than or equal to port (9000), got 8000" in out.stderr
    assert "shop/api-ingress ingress" in out.stdout and "bad-range" not in out.stdout
    strict = run("render", "--strict", "--node", "node1", "-", stdin=example + "\n---\n" + BAD_POLICY)
    assert strict.returncode == 2 and strict.stdout == ""


def test_missing_path_is_an_error():
    out = run("render", "/no/such/file.yaml")
    assert out.returncode == 2 and "no such file or directory: /no/such/file.yaml" in out.stderr


@pytest.mark.kernel
def test_sandbox_on_the_example_prints_matrices():
    out = run("sandbox", str(REPO / "examples" / "shop"))
    assert out.returncode == 0, out.stderr
    assert "TCP/5432 ipv4" in out.stdout and "TCP/8080 ipv4" in out.stdout


@pytest.mark.kernel
def test_sandbox_reports_a_wrong_expectation_and_exits_nonzero(tmp_path):
    case = (CONFORMANCE / "001-default-deny-ingress.yaml").read_text()
    # Claim that y/a may reach x/b on TCP/80 although the policy denies it.
    lines = case.splitlines()
    row = next(i for i, line in enumerate(lines) if line.strip().startswith("y/a ") and "X" in line)
    lines[row] = lines[row].replace("X", ".", 2)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("\n".join(lines) + "\n")
    out = run("sandbox", str(wrong))
    assert out.returncode == 1
    assert "DIFF default-deny-ingress TCP/80 ipv4 y/a -> x/a: expected allowed, got blocked" in out.stdout


@pytest.mark.kernel
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sandbox_removes_its_namespaces_when_interrupted(sig):
    def sandbox_namespaces() -> set[str]:
        return set(netns.existing(OURS))

    before = sandbox_namespaces()
    proc = subprocess.Popen([NFTPOLICY, "sandbox", "--timeout", "5", *sorted(str(p) for p in CONFORMANCE.glob("0*.yaml"))[:1] * 20],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not sandbox_namespaces() - before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sandbox_namespaces() - before, "the sandbox never created its namespaces"
        time.sleep(0.3)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) in (130, 143)
    finally:
        proc.kill()  # nothing outlives the test, whatever failed
        proc.wait()
    assert sandbox_namespaces() - before == set()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_render_shows_progress_only_on_a_terminal(monkeypatch, capsys, terminal):
    """A status line rewritten in place on a terminal, erased at the end; nothing in a pipe."""
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["render", "--node", "node1", str(REPO / "examples" / "shop")]) == 0
    assert "table inet nftpolicy" in capsys.readouterr().out
    text = err.getvalue()
    if terminal:
        assert "\r\033[Knftpolicy: reading the manifests (" in text and "\r\033[Knftpolicy: rendering 6 pods, 4 policies (" in text
        assert text.endswith("\r\033[K")
    else:
        assert text == ""


@pytest.mark.kernel
def test_sandbox_into_a_closed_pipe_ends_quietly_and_cleans_up():
    """``nftpolicy sandbox ... | head``: no BrokenPipeError traceback, exit 141, no namespace left."""
    before = set(netns.existing(OURS))
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run([NFTPOLICY, "sandbox", str(REPO / "examples" / "shop")], stdout=write, stderr=subprocess.PIPE,
                             text=True, timeout=120)
    finally:
        os.close(write)
    assert (out.returncode, out.stderr) == (141, "")
    assert set(netns.existing(OURS)) == before


def test_the_safety_net_matches_only_this_runs_namespaces(monkeypatch):
    """conftest's safety net deletes leftovers named nftp-<RUN_TAG>...: a sandbox that an operator
    (no tag: its run id is hex only) or another test run (another tag) has open never matches."""
    from nftpolicy.agent.testbed.sandbox import Sandbox

    from .conftest import RUN_TAG

    assert OURS == f"nftp-{RUN_TAG}" and RUN_TAG[0] not in "0123456789abcdef"
    ours = Sandbox([])
    monkeypatch.delenv(netns.RUN_TAG_ENV)
    operators = Sandbox([])
    monkeypatch.setenv(netns.RUN_TAG_ENV, "t" + ("0000" if RUN_TAG != "t0000" else "0001"))
    other_run = Sandbox([])
    for sandbox in (ours, operators, other_run):
        sandbox.prober.close()  # never entered: no namespace was made
    assert ours.prefix.startswith(OURS)
    assert not operators.prefix.startswith(OURS) and not other_run.prefix.startswith(OURS)


@pytest.mark.parametrize("argv", [
    ["render", str(CONFORMANCE / "upstream" / "001-default-deny-ingress.yaml")],
    ["agent", "--manifests", "/nonexistent", "--node", "node1"],
])
def test_the_agent_and_render_load_no_test_bed_and_no_asyncio(argv):
    """The layers of agent/: the daemon and render never load the test bed (sandbox, probes,
    control plane); render never loads asyncio, which besides the test bed only the agent's HTTP
    server uses (agent/daemon/httpserver.py: about 30 ms of the agent's start here)."""
    program = ("import sys\nfrom nftpolicy.agent.cli.main import main\nmain(sys.argv[1:])\n"
               "print(' '.join(sorted(m for m in sys.modules if m == 'asyncio' or m.startswith(('nftpolicy.agent', 'asyncio')))))")
    run = subprocess.run([sys.executable, "-c", program, *argv], capture_output=True, text=True, timeout=60)
    loaded = run.stdout.strip().splitlines()[-1].split()
    assert f"nftpolicy.agent.cli.commands.{argv[0]}" in loaded, run.stderr
    assert [m for m in loaded if m.startswith("nftpolicy.agent.testbed")] == []
    assert ("asyncio" in loaded) == (argv[0] == "agent" and "nftpolicy.agent.daemon.httpserver" in loaded)


def test_a_pipe_among_the_paths_is_read_once_whole(tmp_path):
    """A path that is a pipe (``<(kubectl get pods -A -o json)``, a FIFO) can be read only once:
    it is read whole, as stdin is, and every other path too (a JSON List that the item-by-item
    read hands back to the whole read, here for its NaN, is read again: the pipe could not be)."""
    docs = [d for d in yaml.safe_load_all((REPO / "examples" / "shop" / "cluster.yaml").read_text()) if d]
    listed = tmp_path / "shop.json"
    listed.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    nan = tmp_path / "nan.json"
    nan.write_text('{"apiVersion": "v1", "kind": "List", "items": [{"kind": "ConfigMap", "data": {"x": NaN}}]}')

    def piped(*paths: Path) -> subprocess.CompletedProcess:  # the first path through a pipe
        return subprocess.run(["bash", "-c", 'exec "$0" render --node node1 <(cat "$1") "${@:2}"', NFTPOLICY, *map(str, paths)],
                              capture_output=True, text=True, timeout=120)

    alone = run("render", "--node", "node1", str(listed))
    assert alone.returncode == 0 and "shop/api-ingress" in alone.stdout, alone.stderr
    for source in (listed, REPO / "examples" / "shop" / "cluster.yaml"):  # JSON (item by item from a file), YAML
        out = piped(source)
        assert (out.returncode, out.stdout) == (0, alone.stdout), out.stderr
    out = piped(listed, nan)
    assert (out.returncode, out.stdout) == (0, run("render", "--node", "node1", str(listed), str(nan)).stdout), out.stderr


def test_the_launcher_without_a_python3_says_so_in_one_line(tmp_path):
    """The launcher (agent/cli/nftpolicy) copied where no python3 is beside it and none on PATH:
    one line naming what to do, exit 127 (the shell's 'not found'), never the shell's own error."""
    launcher = tmp_path / "bin" / "nftpolicy"
    launcher.parent.mkdir()
    launcher.write_bytes((REPO / "agent" / "cli" / "nftpolicy").read_bytes())
    launcher.chmod(0o755)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "readlink").symlink_to(shutil.which("readlink"))
    out = subprocess.run([str(launcher), "--help"], capture_output=True, text=True, env={"PATH": str(tools)}, timeout=30)
    assert (out.returncode, out.stderr) == (127, f"nftpolicy: no python3 beside {launcher.parent}/ or on PATH: run it from the "
                                                 "virtual environment it was installed in\n")
