"""The agent's debug endpoint: ``GET /debug/model``, what the agent enforces right now, as JSON,
and the health and metrics paths of :func:`~.health.health_routes`, without a token.

It names every pod, label-selected set and policy of the cluster, so it is served on its own
address (``--debug-address``), by default a Unix socket of mode 0600
(:data:`~nftpolicy.agent.cli.flags.DEFAULT_DEBUG_ADDRESS`) that only the agent's container
reaches (``kubectl exec``), never on the port that the chart exposes on every node address.
Read-only; ``nftpolicy explain --agent unix:PATH``, ``trace --agent`` and ``status --agent`` read
it (:func:`nftpolicy.translators.verdict.enforcement_from_json`).
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any, Callable, Mapping

import orjson

from nftpolicy.translators.verdict import node_json

from .httpserver import TEXT, HttpServer, Route, start_http
from .reconcile import Reconciler

DEBUG_PATH = "/debug/model"


def serve_debug(address: str, snapshot: Callable[[], dict[str, Any] | None], more: Mapping[str, Route] | None = None) -> HttpServer:
    """Serve ``GET /debug/model`` on ``unix:PATH`` or ``host:port`` (``[::1]:port`` for IPv6;
    port 0: a free one) from a daemon thread: ``snapshot()`` as JSON
    (:func:`~nftpolicy.translators.verdict.node_json` of the committed model), or 503 while it
    returns None (no sync committed yet); and the paths of ``more``. Raises OSError when the
    address cannot be bound."""
    def model() -> tuple[int, bytes, str]:
        data = snapshot()
        if data is None:
            return 503, b"no sync committed yet\n", TEXT
        return 200, orjson.dumps(data), "application/json"

    return start_http(address, {**(more or {}), DEBUG_PATH: model}, "127.0.0.1", "debug-http")


def start_debug(address: str, reconciler: Reconciler, more: Mapping[str, Route] | None = None) -> HttpServer:
    """:func:`serve_debug` of ``reconciler``'s committed model and pods (taken under its lock,
    between syncs: a few milliseconds; turned into JSON after it, which takes about 0.1 s per
    10,000 pods) and of the addresses of every Node object (its own and those nodes peers match),
    with ``version``: the agent's nftpolicy version, which explain names when it reads another
    version's model; and the paths of ``more`` (the agent's health and metrics)."""
    def snapshot() -> dict[str, Any] | None:
        with reconciler.lock:
            renderer = reconciler.renderer
            if renderer is None:
                return None
            model, pods = renderer.model(ordered=False), list(renderer.pods.values())
            node_addresses = {name: node.addresses for name, node in renderer.sets.nodes.items()}
        learned = reconciler.learning.taught() if reconciler.learning is not None else {}
        return {**node_json(reconciler.node, model, pods, node_addresses, learned), "version": version("nftpolicy")}
    return serve_debug(address, snapshot, more)
