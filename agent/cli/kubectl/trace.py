"""``kubectl nftpolicy trace SRC DST[:PORT/PROTO]``: ``nftpolicy trace`` in the agent pods of the
nodes that decide, through the API (``pods/exec``, kubernetes.stream), printed here.

The nodes that decide are the source pod's (egress) and the destination pod's (ingress), or
those given with ``--node``. In each, the agent pod runs ``nftpolicy trace --from ADDR --to ADDR``
with the table, priority, marks and exemptions of its own environment (the chart's
``NFTPOLICY_*`` settings) and ``--agent`` at its debug endpoint (to name the policy rules), and
waits up to ``--timeout`` seconds for one packet of the connection: send it (``kubectl exec SRC
-- curl ...``) while the trace waits. Each node's answer
is printed under its name; the exit code is the first non-zero one of the traces.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

from kubernetes import stream
from kubernetes.stream import ws_client

from nftpolicy.agent.cli.flags import DEFAULT_DEBUG_ADDRESS, add_config_arguments, env_name
from . import api as kube
from .api import Api, PluginError
from .explain import SERVICE_PREFIX, explain_port, split_port
from .status import AGENT_CONTAINER, pod_problem

EXEC_MARGIN = 30.0  # seconds the exec may take beyond the trace's own timeout


def endpoint(api: Api, text: str) -> tuple[str, str | None]:
    """``ns/name`` (a pod: its address and node) or an address: (address, node or None).
    Raises PluginError."""
    if text.startswith(SERVICE_PREFIX):
        raise PluginError(f"{text}: trace follows a packet between addresses: give a pod or an address, not a Service")
    namespace, slash, name = text.partition("/")
    if not slash or ":" in text or "." in namespace:
        return text, None
    pod = api.get(kube.in_namespace(kube.PODS, namespace), "Pod", "v1", api.core.read_namespaced_pod, name, namespace)
    if pod is None:
        raise PluginError(f"no pod {text}")
    address = (pod.get("status") or {}).get("podIP")
    if not address:
        raise PluginError(f"pod {text} has no address yet")
    return str(address), (pod.get("spec") or {}).get("nodeName")


def table_flags() -> list[tuple[str, bool]]:
    """The flags that shape the agent's table, which ``nftpolicy trace`` takes too
    (:func:`~nftpolicy.agent.cli.flags.add_config_arguments`), each with whether it repeats."""
    flags = argparse.ArgumentParser(add_help=False)
    add_config_arguments(flags)
    return [(action.option_strings[0], isinstance(action, argparse._AppendAction)) for action in flags._actions]


def debug_url(address: str) -> str | None:
    """The URL at which a process in the agent's network namespace reaches the agent's debug
    endpoint served on ``address`` (``--debug-address``: ``HOST:PORT``, an empty HOST or
    ``0.0.0.0``/``[::]`` every address, so loopback; ``''`` no endpoint: None)."""
    if not address:
        return None
    host, _, port = address.rpartition(":")
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
    return f"http://{host}:{port}"


def trace_argv(agent: Mapping[str, Any], source: str, destination: str, port: str | None, timeout: float) -> list[str]:
    """The ``nftpolicy trace`` command line to run in ``agent`` (its pod): the connection, the
    timeout, ``--agent`` at the agent's debug endpoint (``NFTPOLICY_DEBUG_ADDRESS``, else the
    agent's default, :func:`debug_url`; so policy rules are named from the model it committed),
    ``--netns`` when the agent's ruleset is in a named namespace (``NFTPOLICY_NETNS``), and each
    table setting (:func:`table_flags`) its container's environment sets
    (``NFTPOLICY_TABLE=ours`` -> ``--table ours``; a repeatable one's comma-separated list, one
    flag each). A variable without a value (the API leaves out an empty one) is empty."""
    env: dict[str, str] = {}
    for container in (agent.get("spec") or {}).get("containers") or ():
        if container.get("name") == AGENT_CONTAINER:
            env = {e["name"]: str(e.get("value", "")) for e in container.get("env") or () if "valueFrom" not in e}
    argv = ["nftpolicy", "trace", "--from", source, "--to", destination, "--timeout", f"{timeout:g}"]
    if port:
        argv += ["--port", port]
    url = debug_url(env.get(env_name("--debug-address"), DEFAULT_DEBUG_ADDRESS))
    if url:
        argv += ["--agent", url]
    if env.get(env_name("--netns")):  # the agent's ruleset in a named namespace (the chart's agent.netns, for tests)
        argv += ["--netns", env[env_name("--netns")]]
    for flag, repeatable in table_flags():
        value = env.get(env_name(flag), "")
        values = [v.strip() for v in value.split(",") if v.strip()] if repeatable else [value] if value else []
        argv += [item for v in values for item in (flag, v)]
    return argv


def agent_on(api: Api, node: str, namespace: str | None, selector: str) -> dict[str, Any]:
    """The running agent pod on ``node``. Raises PluginError when there is none."""
    pods = api.pods(namespace, selector, f"spec.nodeName={node}")
    running = [p for p in pods if pod_problem(p) is None]
    if not running:
        why = f": {pod_problem(pods[0])}" if pods else f" (pods labelled {selector})"
        raise PluginError(f"no running agent pod on node {node}{why}")
    return running[0]


def run_in(api: Api, agent: Mapping[str, Any], argv: list[str], timeout: float) -> tuple[int, str, str]:
    """Run ``argv`` in ``agent``'s agent container (``pods/exec``): (exit code, stdout, stderr);
    an exec without an exit code (:func:`exec_status`) is 2, with a line on stderr saying why.
    Raises Forbidden (create on pods/exec), PluginError."""
    meta = agent.get("metadata") or {}
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    client = api.fresh()  # the exec's websocket takes over its client while it runs
    try:
        response = client.call("create", kube.Resource("pods/exec", "", namespace), _exec, client, name, namespace, argv)
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


def cmd_trace(api: Api, args: argparse.Namespace) -> int:
    """Trace in the deciding nodes' agents at once; print each node's answer. Raises PluginError."""
    destination, port = split_port(args.destination)
    port = explain_port(port) if port else args.port and explain_port(args.port)
    source, source_node = endpoint(api, args.source)
    target, target_node = endpoint(api, destination)
    nodes = list(dict.fromkeys(args.node or [n for n in (source_node, target_node) if n]))
    if not nodes:
        raise PluginError("neither end is a pod: give --node NODE (the node whose agent traces)")
    agents = {node: agent_on(api, node, args.namespace, args.selector) for node in nodes}
    argv = {node: trace_argv(agent, source, target, port, args.timeout) for node, agent in agents.items()}
    print(f"kubectl nftpolicy: tracing {source} -> {target} on {', '.join(nodes)} for up to {args.timeout:g}s: "
          "send the packet now", file=sys.stderr, flush=True)
    with ThreadPoolExecutor(len(nodes)) as pool:
        results = list(pool.map(lambda node: run_in(api, agents[node], argv[node], args.timeout), nodes))
    for node, (code, out, err) in zip(nodes, results):
        meta = agents[node].get("metadata") or {}
        print(f"node {node} (agent {meta.get('namespace')}/{meta.get('name')}):")
        print(out.rstrip("\n") if out.strip() else "  (no output)")
        if err.strip():
            print(err.rstrip("\n"), file=sys.stderr)
    return next((code for code, _, _ in results if code), 0)
