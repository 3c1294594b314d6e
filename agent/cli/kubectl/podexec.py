"""Running ``nftpolicy`` in an agent pod's agent container (``pods/exec``, kubernetes.stream),
and what that process sees of the agent: its environment (the chart's ``NFTPOLICY_*``
settings) and where it reaches the agent's debug endpoint."""

from __future__ import annotations

import json
from typing import Any, Mapping

from kubernetes import stream
from kubernetes.stream import ws_client

from nftpolicy.agent.cli.flags import DEFAULT_DEBUG_ADDRESS, UNIX_PREFIX, env_name
from .api import Api, PluginError, Resource

AGENT_CONTAINER = "agent"
EXEC_MARGIN = 30.0  # seconds an exec may take beyond its command's own timeout


def agent_env(agent: Mapping[str, Any]) -> dict[str, str]:
    """The environment variables the agent container of pod ``agent`` sets by value (a variable
    without a value, which the API leaves out when it is empty, is empty)."""
    for container in (agent.get("spec") or {}).get("containers") or ():
        if container.get("name") == AGENT_CONTAINER:
            return {e["name"]: str(e.get("value", "")) for e in container.get("env") or () if "valueFrom" not in e}
    return {}


def agent_debug_url(agent: Mapping[str, Any]) -> str | None:
    """Where a process in pod ``agent`` reaches its agent's debug endpoint (its
    ``NFTPOLICY_DEBUG_ADDRESS``, else the agent's default; :func:`debug_url`), None when it
    has none."""
    return debug_url(agent_env(agent).get(env_name("--debug-address"), DEFAULT_DEBUG_ADDRESS))


def debug_url(address: str) -> str | None:
    """The URL at which a process in the agent's network namespace reaches the agent's debug
    endpoint served on ``address`` (``--debug-address``: ``unix:PATH``, as it is; ``HOST:PORT``,
    an empty HOST or ``0.0.0.0``/``[::]`` every address, so loopback; ``''`` no endpoint: None)."""
    if not address or address.startswith(UNIX_PREFIX):
        return address or None
    host, _, port = address.rpartition(":")
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
    return f"http://{host}:{port}"




def run_in(api: Api, agent: Mapping[str, Any], argv: list[str], timeout: float) -> tuple[int, str, str]:
    """Run ``argv`` in ``agent``'s agent container (``pods/exec``): (exit code, stdout, stderr);
    an exec without an exit code (:func:`exec_status`) is 2, with a line on stderr saying why.
    Raises Forbidden (create on pods/exec), PluginError."""
    meta = agent.get("metadata") or {}
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    client = api.fresh()  # the exec's websocket takes over its client while it runs
    try:
        response = client.call("create", Resource("pods/exec", "", namespace), _exec, client, name, namespace, argv)
    except Exception as exc:  # noqa: BLE001 - the websocket's errors have no common base
        if isinstance(exc, PluginError):
            raise
        raise PluginError(f"cannot exec in {namespace}/{name}: {' '.join(str(exc).split())}") from None
    response.run_forever(timeout=timeout + EXEC_MARGIN)
    ended = not response.is_open()
    out, err = response.read_stdout(), response.read_stderr()
    response.close()
    code, problem = exec_status(response.read_channel(ws_client.ERROR_CHANNEL))
    if problem:
        late = "" if ended else f" (still running after {timeout + EXEC_MARGIN:g} s)"
        err += f"kubectl nftpolicy: exec in {namespace}/{name}: {problem}{late}\n"
    return code, out, err


def exec_status(text: str) -> tuple[int, str | None]:
    """The exit code of an exec from the Status its error channel carries (``text``, JSON;
    k8s.io/apimachinery's metav1.Status): 0 on ``Success``, the number of the ``ExitCode`` cause
    of a ``NonZeroExitCode`` failure; else 2 and why (the Status's message: the command could
    not start, or no Status at all: the exec ended early or is still running)."""
    try:
        status = json.loads(text) if text else None
    except ValueError:
        status = None
    if not isinstance(status, dict):
        return 2, "no exit status"
    if status.get("status") == "Success":
        return 0, None
    for cause in (status.get("details") or {}).get("causes") or ():
        if cause.get("reason") == "ExitCode" and str(cause.get("message", "")).isdigit():
            return int(cause["message"]), None
    return 2, str(status.get("message") or "no exit code")


def _exec(client: Api, name: str, namespace: str, argv: list[str], _request_timeout: float) -> Any:
    return stream.stream(client.core.connect_get_namespaced_pod_exec, name, namespace, command=argv, container=AGENT_CONTAINER,
                         stdin=False, stdout=True, stderr=True, tty=False, _preload_content=False, _request_timeout=_request_timeout)
