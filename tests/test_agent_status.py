"""What the agent says about itself: /readyz names why it is not ready, the start-up line has
the version and every effective setting, and an empty table is explained in the log."""

from __future__ import annotations

import subprocess
import time
from importlib.metadata import version

import pytest

from nftpolicy.agent.daemon.health import Health, serve_http
from nftpolicy.agent.daemon.metrics import Metrics
from nftpolicy.agent.daemon.store import Store

from .conftest import REPO, http_get
from .test_cli import NFTPOLICY


def test_readyz_names_the_kinds_not_listed_and_the_last_failure():
    metrics, health = Metrics(), Health(window=30)
    store = Store(metrics)
    health.unlisted = store.unlisted
    server = serve_http("127.0.0.1:0", metrics, health)
    url = f"http://127.0.0.1:{server.server_address[1]}/readyz"
    try:
        assert http_get(url) == (503, "not ready: not listed yet: Namespace, Pod, NetworkPolicy, Node, ClusterNetworkPolicy\n"
                                      "not ready: no sync committed yet\n")
        store.replace("Namespace", [])
        store.replace("Node", [])
        store.replace("ClusterNetworkPolicy", [])
        assert http_get(url) == (503, "not ready: not listed yet: Pod, NetworkPolicy\nnot ready: no sync committed yet\n")
        store.replace("Pod", [])
        store.replace("NetworkPolicy", [])
        health.sync_failure = "Error: Could not process rule: No such file or directory"
        assert http_get(url) == (503, "not ready: no sync committed yet; the last one failed (the log says why)\n")
        health.ready = True
        assert http_get(url) == (200, "ok\n")
    finally:
        server.shutdown()


def run_agent_until(ns: str, manifests: str, node: str, wanted: str, tmp_path, *flags: str) -> str:
    """Run the agent inside ``ns`` until its log has ``wanted`` (at most 30 s); its log."""
    log = tmp_path / "agent.log"
    with log.open("w") as out:
        agent = subprocess.Popen([NFTPOLICY, "agent", "--manifests", manifests, "--node", node, "--netns", ns,
                                  "--http-address", "127.0.0.1:0", *flags], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 30
        while wanted not in log.read_text() and time.monotonic() < deadline and agent.poll() is None:
            time.sleep(0.1)
    finally:
        agent.terminate()
        agent.wait(timeout=20)
    return log.read_text()


@pytest.mark.kernel
def test_the_start_up_line_has_the_version_and_the_settings(make_netns, tmp_path):
    ns = make_netns()
    text = run_agent_until(ns, str(REPO / "examples" / "shop"), "node1", "sync full", tmp_path, "--priority", "-5")
    first = text.splitlines()[0]
    assert f"nftpolicy {version('nftpolicy')} agent for node node1: source manifests " in first
    for setting in ("--priority=-5", "--min-sync-interval=0.2", "--policy-mark=0x10000", "--service-cidr=10.96.0.0/12",
                    "--node-port-range=30000-32767", f"--netns={ns}", "--log-format=text", "--watch-timeout=300"):
        assert f" {setting}" in first, (setting, first)


@pytest.mark.kernel
@pytest.mark.parametrize(("node", "reason"), [
    ("node9", "the table isolates no pod: no running pod with an IP address on node node9 (6 pods in the cluster)"),
    ("node1", "the table isolates no pod: no NetworkPolicy selects any of the 1 pods on node node1"),
])
def test_an_empty_table_is_explained(make_netns, tmp_path, node, reason):
    manifests = tmp_path / "cluster"
    manifests.mkdir()
    text = (REPO / "examples" / "shop" / "cluster.yaml").read_text()
    if node == "node1":  # the pods only, one of them on node1, and no policy
        docs = [d for d in text.split("\n---") if "kind: NetworkPolicy" not in d]
        text = "\n---".join(docs)
        text = text.replace("nodeName: node1", "nodeName: node2").replace("nodeName: node2", "nodeName: node1", 1)
    (manifests / "cluster.yaml").write_text(text)
    log = run_agent_until(make_netns(), str(manifests), node, "sync full", tmp_path)
    assert reason in log, log
