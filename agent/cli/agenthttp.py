"""GET from a running agent's debug endpoint (``--agent``): ``http://HOST:PORT`` or
``unix:PATH``, the forms of the agent's ``--debug-address``
(:mod:`nftpolicy.agent.daemon.debughttp`)."""

from __future__ import annotations

import http.client
import socket
from urllib.parse import urlsplit

from nftpolicy.agent.cli.flags import UNIX_PREFIX

TIMEOUT = 5.0  # seconds to connect, and between two reads of the answer


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over the Unix socket at ``path``."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def agent_get(url: str, path: str, timeout: float = TIMEOUT) -> tuple[int, bytes]:
    """GET ``path`` (``/debug/model``) of the agent at ``url``: (HTTP status, body). Raises
    ValueError for a URL of another form, OSError (and http.client.HTTPException) when the
    agent cannot be reached or its answer read."""
    connection: http.client.HTTPConnection
    if url.startswith(UNIX_PREFIX):
        connection = _UnixConnection(url[len(UNIX_PREFIX):], timeout)
    else:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not an agent address: {url!r} (expected http://HOST:PORT or unix:PATH)")
        connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        connection.request("GET", path)
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()
