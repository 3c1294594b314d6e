"""Every mistake in a flag gets one line naming the flag (and the NFTPOLICY_* variable when it
came from the environment, as the Helm chart gives every setting) and exit 2: never a
traceback, never argparse's usage block."""

from __future__ import annotations

import argparse
import os
import subprocess

import pytest

from nftpolicy.agent.cli import flags

from .conftest import REPO
from .test_cli import NFTPOLICY, run

SHOP = str(REPO / "examples" / "shop")
DUMPS = REPO / "tests" / "fixtures" / "kube-router-v2.1.0" / "shop"
# What each command needs besides the flag under test, so that only that flag is wrong.
REST = {"render": [SHOP], "sandbox": [SHOP], "agent": ["--node", "node1"], "cleanup": [],
        "compare": ["--node", "node1", "--ipset-save", str(DUMPS / "node1.ipset-save"), SHOP],
        "explain": ["--from", "shop/frontend", "--to", "shop/db", SHOP], "trace": ["--from", "shop/frontend", "--to", "shop/db", SHOP]}

BAD = [
    ("agent", "--min-sync-interval", "-1", "must be >= 0 seconds, got -1"),
    ("agent", "--min-sync-interval", "soon", "invalid number of seconds 'soon'"),
    ("agent", "--resync-interval", "0", "must be > 0 seconds, got 0"),
    ("agent", "--counters-interval", "0.5", "must be >= 1 seconds, got 0.5"),
    ("agent", "--api-timeout", "nan", "must be > 0 seconds, got nan"),
    ("agent", "--watch-timeout", "1.5", "must be a whole number of seconds, got 1.5"),
    ("agent", "--watch-timeout", "0", "must be >= 1 seconds, got 0"),
    ("agent", "--watch-idle-timeout", "0", "must be > 0 seconds, got 0"),
    ("agent", "--watch-idle-timeout", "inf", "must be > 0 seconds, got inf"),
    ("agent", "--http-address", "127.0.0.1:99999", "invalid port 99999 in '127.0.0.1:99999' (0 to 65535)"),
    ("agent", "--http-address", "garbage",
     "invalid address 'garbage' (expected HOST:PORT, HOST an IPv4 address, [IPv6 address], a name or empty)"),
    ("agent", "--http-address", "300.1.2.3:80", "invalid IPv4 address '300.1.2.3' in '300.1.2.3:80'"),
    ("agent", "--http-address", "[10.0.0.1]:80",
     "invalid IPv6 address [10.0.0.1] in '[10.0.0.1]:80' (expected HOST:PORT, HOST an IPv4 address, [IPv6 address], a name or empty)"),
    ("agent", "--log-format", "xml", "invalid choice: 'xml' (choose from 'text', 'json')"),
    ("agent", "--deny-action", "REJECT", "invalid choice: 'REJECT' (choose from 'reject', 'drop')"),
    ("render", "--deny-action", "deny", "invalid choice: 'deny' (choose from 'reject', 'drop')"),
    ("explain", "--deny-action", "", "invalid choice: '' (choose from 'reject', 'drop')"),
    ("agent", "--priority", "filter", "invalid priority 'filter' (expected an integer)"),
    ("agent", "--priority", "0x80000000", "must be a signed 32-bit integer, got 0x80000000"),
    ("agent", "--policy-mark", "0x3", "a mark must be one bit of 32, got 0x3"),
    ("agent", "--passed-mark", "0x100000000", "a mark must be one bit of 32, got 0x100000000"),
    ("agent", "--policy-mark", "high", "invalid mark 'high' (expected one bit, as 0x... or a decimal number)"),
    ("agent", "--node-port-range", "32767-30000",
     "invalid port range '32767-30000' (expected LOW-HIGH, 1 <= LOW <= HIGH <= 65535)"),
    ("agent", "--service-cidr", "10.0.0.0", "invalid CIDR '10.0.0.0' (expected ADDRESS/PREFIX)"),
    ("agent", "--external-cidr", "::1/200", "invalid CIDR '::1/200' (expected ADDRESS/PREFIX)"),
    ("agent", "--table", "a;b", "invalid table name 'a;b' (a letter, then letters, digits, '-' or '_')"),
    ("agent", "--metrics-secure", "yes", "must be true or false, got 'yes'"),
    ("agent", "--debug-address", "unix:run/debug.sock", "invalid Unix socket 'unix:run/debug.sock' (expected unix:/ABSOLUTE/PATH, at most 107 bytes)"),
    ("render", "--format", "yaml", "invalid choice: 'yaml' (choose from 'nft', 'json', 'iptables', 'ip6tables', 'ipset')"),
    ("sandbox", "--timeout", "-2", "must be > 0 seconds, got -2"),
    ("sandbox", "--dataplane", "ebpf",
     "invalid choice: 'ebpf' (choose from 'nft', 'iptables', 'kube-router', 'both', 'nft,iptables')"),
    ("compare", "--port", "http", "invalid port 'http' (expected [TCP|UDP|SCTP/]PORT)"),
    ("compare", "--timeout", "x", "invalid number of seconds 'x'"),
    ("cleanup", "--table", "1table", "invalid table name '1table' (a letter, then letters, digits, '-' or '_')"),
    ("agent", "--unknown-pod-rate", "0", "must be a whole number 1-1000000, got 0"),
    ("agent", "--unknown-pod-burst", "many", "must be a whole number 1-1000000, got many"),
    ("agent", "--unknown-pod-max-held", "2000", "must be a whole number 1-1024, got 2000"),
    ("trace", "--unknown-pod-rate", "-5", "must be a whole number 1-1000000, got -5"),
    ("agent", "--dns-learn-from", "kube-dns", "invalid resolver 'kube-dns' (expected an address, a CIDR or 'any')"),
    ("agent", "--dns-learn-from", "10.96.0.10,10.96.0.10/33", "invalid resolver '10.96.0.10/33' (expected an address, a CIDR or 'any')"),
    ("agent", "--dns-learn-from", "any,10.96.0.10", "'any' with resolvers (10.96.0.10): give one or the other"),
    ("agent", "--dns-learn-from", ",", "no resolver (expected addresses or CIDRs, comma-separated, or 'any')"),
]


def exit_of(argv: list[str], capsys) -> tuple[int, list[str]]:
    """Parse ``argv`` with the real parser: the exit code and the lines on stderr."""
    with pytest.raises(SystemExit) as exited:
        flags.parser().parse_args(argv)
    return exited.value.code, capsys.readouterr().err.splitlines()


@pytest.fixture
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith(flags.ENV_PREFIX)]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize(("command", "flag", "value", "message"), BAD, ids=[f"{c}{f}={v}" for c, f, v, _ in BAD])
def test_a_bad_flag_is_one_line_from_the_command_line_and_from_the_environment(clean_env, capsys, command, flag, value, message):
    """From the command line for every command; from NFTPOLICY_<FLAG> for the agent only, the
    one command that reads the environment (the others leave the variable alone)."""
    assert exit_of([command, f"{flag}={value}", *REST[command]], capsys) == (2, [f"nftpolicy: {flag}: {message}"])
    clean_env.setenv(flags.env_name(flag), value)
    if command == "agent":
        assert exit_of([command, *REST[command]], capsys) == (2, [f"nftpolicy: {flag}: {message} (from {flags.env_name(flag)})"])
    else:
        args = flags.parser().parse_args([command, *REST[command]])
        assert getattr(args, flag[2:].replace("-", "_")) != value


def test_a_repeatable_flag_names_the_bad_item_of_its_variable(clean_env, capsys):
    clean_env.setenv("NFTPOLICY_SERVICE_CIDR", "10.96.0.0/12, fd00::/108,bad")
    assert exit_of(["agent"], capsys) == (2, ["nftpolicy: --service-cidr: invalid CIDR 'bad' (expected ADDRESS/PREFIX) (from NFTPOLICY_SERVICE_CIDR)"])
    clean_env.setenv("NFTPOLICY_SERVICE_CIDR", "10.96.0.0/12, fd00::/108")
    assert flags.parser().parse_args(["agent"]).service_cidr == ["10.96.0.0/12", "fd00::/108"]


def test_only_the_agent_reads_the_environment(clean_env):
    """NFTPOLICY_NODE=node2 once made render render node2 alone, and NFTPOLICY_TIMEOUT was a probe
    time in sandbox and a wait in trace: variables are the agent's (the chart's) settings."""
    clean_env.setenv("NFTPOLICY_NODE", "node2")
    assert flags.parser().parse_args(["agent"]).node == "node2"
    clean_env.setenv("NFTPOLICY_TIMEOUT", "9")
    clean_env.setenv("NFTPOLICY_STRICT", "true")
    render = flags.parser().parse_args(["render", SHOP])
    assert (render.node, render.strict) == (None, False)
    assert flags.parser().parse_args(["sandbox", SHOP]).timeout == 1.0
    assert flags.parser().parse_args(["trace", *REST["trace"]]).timeout == 30.0
    out = subprocess.run([NFTPOLICY, "render", SHOP], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "NFTPOLICY_NODE": "node2"})
    every, node2 = (run("render", *flags, SHOP).stdout.count(": jump KUBE-POD-") for flags in ([], ["--node", "node2"]))
    assert out.returncode == 0 and out.stdout.count(": jump KUBE-POD-") == every > node2


@pytest.mark.parametrize(("name", "line"), [
    ("NFTPOLICY_LOG_FORMT", "nftpolicy: NFTPOLICY_LOG_FORMT: no such setting of nftpolicy agent (did you mean NFTPOLICY_LOG_FORMAT?) "
                            "(see 'nftpolicy agent --help')"),
    ("NFTPOLICY_FORMAT", "nftpolicy: NFTPOLICY_FORMAT: no such setting of nftpolicy agent (did you mean NFTPOLICY_LOG_FORMAT?) "
                         "(see 'nftpolicy agent --help')"),
    ("NFTPOLICY_QQ", "nftpolicy: NFTPOLICY_QQ: no such setting of nftpolicy agent (see 'nftpolicy agent --help')"),
])
def test_the_agent_refuses_a_variable_that_names_no_flag(clean_env, capsys, name, line):
    clean_env.setenv(name, "json")
    assert exit_of(["agent"], capsys) == (2, [line])
    clean_env.delenv(name)
    clean_env.setenv("NFTPOLICY_RUN_TAG", "t1")  # the project's own, not flags
    clean_env.setenv("NFTPOLICY_CI_CACHE", "/tmp")
    assert flags.parser().parse_args(["agent"]).min_sync_interval == 0.2


def test_the_command_line_wins_over_the_environment(clean_env):
    clean_env.setenv("NFTPOLICY_MIN_SYNC_INTERVAL", "3")
    assert flags.parser().parse_args(["agent"]).min_sync_interval == 3.0
    assert flags.parser().parse_args(["agent", "--min-sync-interval", "0.5"]).min_sync_interval == 0.5
    clean_env.setenv("NFTPOLICY_MIN_SYNC_INTERVAL", "-1")  # a bad variable is not read when the flag is given
    assert flags.parser().parse_args(["agent", "--min-sync-interval=0.5"]).min_sync_interval == 0.5
    clean_env.delenv("NFTPOLICY_MIN_SYNC_INTERVAL")
    clean_env.setenv("NFTPOLICY_SERVICE_CIDR", "bad")
    assert flags.parser().parse_args(["agent", "--service-cidr", "10.0.0.0/8"]).service_cidr == ["10.0.0.0/8"]


def test_no_type_is_reported_by_its_python_name(clean_env, capsys):
    """argparse says ``invalid <lambda> value`` or ``invalid float value`` for a type that raises
    ValueError: every typed flag of every command says what it expected instead."""
    sub = next(a for a in flags.parser()._actions if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for command, command_parser in sub.choices.items():
        for action in command_parser._actions:
            if action.type is None or not action.option_strings:
                continue
            flag = next(o for o in action.option_strings if o.startswith("--"))
            code, lines = exit_of([command, f"{flag}=%%", *REST[command]], capsys)
            assert code == 2 and len(lines) == 1 and lines[0].startswith(f"nftpolicy: {flag}: "), lines
            assert " value: " not in lines[0] and "<" not in lines[0], lines
            checked += 1
    assert checked >= 25


@pytest.mark.parametrize(("argv", "line"), [
    (["render", "--nope", SHOP], "nftpolicy: unrecognized arguments: --nope (see 'nftpolicy render --help')"),
    (["render"], "nftpolicy: the following arguments are required: PATH (see 'nftpolicy render --help')"),
    (["compare", SHOP], "nftpolicy: the following arguments are required: --node, --ipset-save (see 'nftpolicy compare --help')"),
    (["sandbox", "--ipv6", "--dual-stack", SHOP], "nftpolicy: --dual-stack: not allowed with argument --ipv6"),
    (["renderr", SHOP], "nftpolicy: command: invalid choice: 'renderr' (choose from 'render', 'sandbox', 'compare', "
                        "'agent', 'cleanup', 'explain', 'status', 'trace') (see 'nftpolicy --help')"),
    ([], "nftpolicy: the following arguments are required: command (see 'nftpolicy --help')"),
    (["explain", "--from", "shop/frontend", SHOP], "nftpolicy: the following arguments are required: --to "
                                                   "(see 'nftpolicy explain --help')"),
    (["trace"], "nftpolicy: the following arguments are required: --from, --to (see 'nftpolicy trace --help')"),
    (["trace", *REST["trace"], "--priority"], "nftpolicy: --priority: expected one argument"),
    (["render", "--format", "xml", SHOP], "nftpolicy: --format: invalid choice: 'xml' (choose from 'nft', 'json', 'iptables', "
                                          "'ip6tables', 'ipset')"),
    (["--nope", "render", SHOP], "nftpolicy: unrecognized arguments: --nope (see 'nftpolicy render --help')"),
])
def test_argparse_errors_are_one_line_without_the_usage_block(clean_env, capsys, argv, line):
    assert exit_of(argv, capsys) == (2, [line])


def test_a_bad_environment_value_ends_the_real_command_with_one_line():
    """The console script as the chart runs it (the variable, no flags): today's traceback was 36 lines."""
    out = subprocess.run([NFTPOLICY, "agent", "--node", "node1", "--manifests", SHOP], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "NFTPOLICY_MIN_SYNC_INTERVAL": "-1"}, timeout=60)
    assert (out.returncode, out.stderr) == (2, "nftpolicy: --min-sync-interval: must be >= 0 seconds, got -1 (from NFTPOLICY_MIN_SYNC_INTERVAL)\n")


@pytest.mark.parametrize(("command", "flag", "value", "message"), [
    ("agent", "--kubeconfig", "/no/such/kubeconfig", "no such file: /no/such/kubeconfig"),
    ("agent", "--manifests", "/no/such/dir", "no such directory: /no/such/dir"),
    ("agent", "--netns", "nftp-no-such-namespace", "no such network namespace (see 'ip netns list'): nftp-no-such-namespace"),
    ("cleanup", "--netns", "nftp-no-such-namespace", "no such network namespace (see 'ip netns list'): nftp-no-such-namespace"),
])
def test_a_missing_path_is_one_line_from_the_command_line_and_from_the_environment(command, flag, value, message):
    """Checked when the command runs (the chart's paths exist only in its container); the
    environment is the agent's only (cleanup is never run with a variable: it would clean here)."""
    base = {"PATH": "/usr/bin:/bin"}
    argv = [NFTPOLICY, command, *REST[command], "--http-address", "127.0.0.1:0"][: None if command == "agent" else 2]
    given = subprocess.run([*argv, flag, value], capture_output=True, text=True, env=base, timeout=60)
    assert (given.returncode, given.stderr) == (2, f"nftpolicy: {flag}: {message}\n")
    if command != "agent":
        return
    from_env = subprocess.run(argv, capture_output=True, text=True, env=base | {flags.env_name(flag): value}, timeout=60)
    assert (from_env.returncode, from_env.stderr) == (2, f"nftpolicy: {flag}: {message} (from {flags.env_name(flag)})\n")


@pytest.mark.parametrize(("content", "message"), [
    ("x: 1\n", "nftpolicy: cannot read kubeconfig {path}: Invalid kube-config file. Expected key current-context in {path}"),
    ("clusters: [\n", "nftpolicy: cannot read kubeconfig {path}: while parsing a flow node expected the node content, "
                      "but found '<stream end>' in \"{path}\", line 2, column 1"),
    (b"\x7fELF\x02\x01\x01\x00\xd0\xd0", "nftpolicy: cannot read kubeconfig {path}: 'utf-8' codec can't decode byte 0xd0 "
                                         "in position 8: invalid continuation byte"),
])
def test_an_unreadable_kubeconfig_is_one_line(tmp_path, content, message):
    path = tmp_path / "kubeconfig"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = run("agent", "--node", "node1", "--kubeconfig", str(path), "--http-address", "127.0.0.1:0")
    assert (out.returncode, out.stderr.splitlines()[-1:]) == (2, [message.format(path=path)])
    assert "Traceback" not in out.stderr


def test_no_in_cluster_configuration_is_one_line():
    out = subprocess.run([NFTPOLICY, "agent", "--node", "node1", "--http-address", "127.0.0.1:0"], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1] == ("nftpolicy: no in-cluster configuration (Service host/port is not set.): "
                                           "outside a pod, give --kubeconfig")


@pytest.mark.parametrize("flag", ["--iptables-save", "--ipset-save"])
def test_a_binary_dump_given_to_compare_is_one_line(tmp_path, flag):
    binary = tmp_path / "dump.gz"
    binary.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)))
    files = {"--iptables-save": str(DUMPS / "node1.iptables-save"), "--ipset-save": str(DUMPS / "node1.ipset-save")}
    files[flag] = str(binary)
    out = run("compare", "--node", "node1", *[a for f, p in files.items() for a in (f, p)], SHOP)
    what = "iptables-save" if flag == "--iptables-save" else "ipset save"
    assert (out.returncode, out.stderr) == (2, f"nftpolicy: {flag} {binary}: not a text dump (not UTF-8 at byte 1); give the output of {what}\n")


def test_render_into_a_closed_pipe_ends_quietly():
    """``nftpolicy render ... | head``: the reader goes away; no BrokenPipeError traceback, exit 141
    (what a process killed by SIGPIPE reports)."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        out = subprocess.run([NFTPOLICY, "render", SHOP], stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert (out.returncode, out.stderr) == (141, "")


def test_a_repeatable_flag_on_the_command_line_replaces_its_variable(clean_env):
    clean_env.setenv("NFTPOLICY_SERVICE_CIDR", "10.96.0.0/12,fd00::/108")
    assert flags.parser().parse_args(["agent"]).service_cidr == ["10.96.0.0/12", "fd00::/108"]
    args = flags.parser().parse_args(["agent", "--service-cidr", "10.0.0.0/16", "--service-cidr", "10.1.0.0/16"])
    assert args.service_cidr == ["10.0.0.0/16", "10.1.0.0/16"]


def test_an_empty_debug_address_turns_the_endpoint_off(clean_env, capsys):
    """``--debug-address ''`` is documented as off, and the chart's schema allows
    ``agent.debugAddress: ""``: the agent must start without the endpoint, not exit 2."""
    assert flags.parser().parse_args(["agent", "--debug-address", ""]).debug_address == ""
    clean_env.setenv("NFTPOLICY_DEBUG_ADDRESS", "")
    assert flags.parser().parse_args(["agent"]).debug_address == ""
    assert exit_of(["agent", "--debug-address", "nowhere"], capsys) == (2, [
        "nftpolicy: --debug-address: invalid address 'nowhere' (expected HOST:PORT, HOST an IPv4 address, [IPv6 address], "
        "a name or empty)"])


@pytest.mark.parametrize("flag", ["--iptables-save", "--ipset-save"])
@pytest.mark.parametrize("what, reason", [("directory", "is a directory"), ("missing", "no such file or directory")])
def test_a_dump_that_cannot_be_read_is_one_line_naming_the_flag(tmp_path, flag, what, reason):
    bad = tmp_path if what == "directory" else tmp_path / "nope"
    files = {"--iptables-save": str(DUMPS / "node1.iptables-save"), "--ipset-save": str(DUMPS / "node1.ipset-save")}
    files[flag] = str(bad)
    out = run("compare", "--node", "node1", *[a for f, p in files.items() for a in (f, p)], SHOP)
    assert (out.returncode, out.stderr) == (2, f"nftpolicy: {flag} {bad}: {reason}\n")


@pytest.mark.parametrize(("argv", "line"), [
    (["--manifests", SHOP, "--metrics-secure", "true"], "--metrics-secure checks tokens with the Kubernetes API: not with --manifests"),
    (["--manifests", SHOP, "--tls-cert-file", "/etc/hostname"], "--tls-cert-file and --tls-private-key-file go together"),
    (["--manifests", SHOP, "--tls-cert-file", "/etc/hostname", "--tls-private-key-file", "/etc/hostname"],
     "--tls-cert-file is for --metrics-secure true, which is off"),
    (["--metrics-secure", "true", "--tls-cert-file", "/no/cert.pem", "--tls-private-key-file", "/etc/hostname"],
     "--tls-cert-file: no such file: /no/cert.pem"),
])
def test_secure_metrics_flags_that_do_not_fit_are_one_line(argv, line):
    out = subprocess.run([NFTPOLICY, "agent", "--node", "node1", "--http-address", "127.0.0.1:0", *argv], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert (out.returncode, out.stderr) == (2, f"nftpolicy: {line}\n")


def test_a_certificate_that_cannot_be_used_is_one_line(tmp_path):
    """Read before anything starts: exit 2 with the files and the TLS library's reason."""
    (tmp_path / "cert.pem").write_text("not a certificate")
    out = subprocess.run([NFTPOLICY, "agent", "--node", "node1", "--http-address", "127.0.0.1:0", "--metrics-secure", "true",
                          "--tls-cert-file", str(tmp_path / "cert.pem"), "--tls-private-key-file", str(tmp_path / "cert.pem")],
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"--tls-cert-file: cannot use the certificate {tmp_path}/cert.pem with the key {tmp_path}/cert.pem: " in out.stderr


def test_swapped_dumps_given_to_compare_name_the_flag_and_say_so():
    """--iptables-save and --ipset-save the wrong way round: the line names the flag, not only the
    file, and says what the file holds (issue 34 item 10)."""
    out = run("compare", "--node", "node1", "--iptables-save", str(DUMPS / "node1.ipset-save"),
              "--ipset-save", str(DUMPS / "node1.iptables-save"), SHOP)
    assert (out.returncode, out.stderr) == (2, f"nftpolicy: --ipset-save {DUMPS / 'node1.iptables-save'}:2: expected 'create' or "
                                               "'add', got '*filter' (iptables-save output: is the iptables dump given as the ipset one?)\n")



def test_trusted_resolvers_are_networks_and_any_is_none(clean_env):
    args = flags.parser().parse_args(["agent", "--node", "node1", "--dns-learn-from", "10.96.0.10, fd00::/64"])
    assert args.dns_learn_from == ("10.96.0.10/32", "fd00::/64")
    for argv in ([], ["--dns-learn-from", "any"]):
        assert flags.parser().parse_args(["agent", "--node", "node1", *argv]).dns_learn_from is None
