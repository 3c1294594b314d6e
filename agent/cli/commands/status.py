"""``nftpolicy status``: the agent of this node, as ``kubectl nftpolicy status`` shows every node's:
ready or why not, last sync, table generation, chains and sets, drops, version. Read from the
agent's debug endpoint (``--agent``, by default where the agent serves it,
:data:`~nftpolicy.agent.cli.flags.DEFAULT_DEBUG_ADDRESS`), which needs no token: run it in the
agent's container (``kubectl exec``), as the kubectl plugin does for an agent with
``--metrics-secure``."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import time
from dataclasses import asdict

from nftpolicy.agent.cli.agenthttp import agent_get
from nftpolicy.agent.cli.flags import UsageError
from nftpolicy.agent.cli.agentstatus import AgentStatus, read_agent, table


def cmd_status(args: argparse.Namespace) -> int:
    """Print the agent's status; 0 when it is ready, 1 when not. Raises UsageError when the
    agent cannot be asked."""
    def get(path: str) -> tuple[int, str]:
        try:
            code, body = agent_get(args.agent, f"/{path}")
        except ValueError as exc:
            raise UsageError(f"--agent: {exc}") from None
        except (OSError, http.client.HTTPException) as exc:
            raise UsageError(f"cannot reach the agent at {args.agent}: {getattr(exc, 'strerror', None) or exc}") from None
        return code, body.decode(errors="replace")

    status = AgentStatus(os.environ.get("NODE_NAME") or socket.gethostname())
    read_agent(get, status, time.time())
    print(json.dumps(asdict(status), indent=2) if args.output == "json" else table([status]))
    return 0 if status.ready else 1
