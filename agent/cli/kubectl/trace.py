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

from nftpolicy.agent.cli.flags import add_config_arguments, env_name
from . import api as kube
from .api import Api, PluginError
from nftpolicy.agent.cli.commands.explain import SERVICE_PREFIX, explain_port, split_port
from .podexec import agent_debug_url, agent_env, run_in
from .status import pod_problem


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
    add_config_arguments(flags, unknown=True)
    return [(action.option_strings[0], isinstance(action, argparse._AppendAction)) for action in flags._actions]


def trace_argv(agent: Mapping[str, Any], source: str, destination: str, port: str | None, timeout: float) -> list[str]:
    """The ``nftpolicy trace`` command line to run in ``agent`` (its pod): the connection, the
    timeout, ``--agent`` at the agent's debug endpoint (``NFTPOLICY_DEBUG_ADDRESS``, else the
    agent's default, :func:`debug_url`; so policy rules are named from the model it committed),
    ``--netns`` when the agent's ruleset is in a named namespace (``NFTPOLICY_NETNS``), and each
    table setting (:func:`table_flags`) its container's environment sets
    (``NFTPOLICY_TABLE=ours`` -> ``--table ours``; a repeatable one's comma-separated list, one
    flag each). A variable without a value (the API leaves out an empty one) is empty."""
    env = agent_env(agent)
    argv = ["nftpolicy", "trace", "--from", source, "--to", destination, "--timeout", f"{timeout:g}"]
    if port:
        argv += ["--port", port]
    url = agent_debug_url(agent)
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
