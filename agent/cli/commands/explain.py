"""``nftpolicy explain``: why traffic from A to B on a port is allowed or denied, in a few lines.

The answer is the verdict engine's (:mod:`nftpolicy.translators.verdict`) on what nftpolicy
enforces: every node's rule model rendered from manifests, or, with ``--agent``, the model a
running agent holds right now (read from its debug endpoint, :mod:`nftpolicy.agent.daemon.debughttp`).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import http.client
import sys
from importlib.metadata import version
from typing import Iterable, Mapping, Sequence

from nftpolicy.translators.model import Cluster, Pod, family_of
from nftpolicy.translators.rules import Config
from nftpolicy.translators.verdict import (
    Connection,
    ConnectionProtocol,
    Endpoint,
    Enforcement,
    ModelShapeMismatch,
    Verdict,
    enforcement_from_json,
    enforcement_of,
    verdict_lines,
)
from nftpolicy.translators.workloads import Service, StandIn, place_pods, services_from

from nftpolicy.agent.cli.agenthttp import agent_get
from nftpolicy.agent.cli.flags import DEFAULT_DEBUG_ADDRESS, UsageError, config_from
from nftpolicy.agent.daemon.debughttp import DEBUG_PATH
from . import Manifests, cluster_warnings, note, placement_nodes, plural, read_manifests, report_skipped, warn


SERVICE_PREFIX = "svc/"
PROTOCOLS = ("TCP", "UDP", "SCTP")


def split_port(text: str) -> tuple[str, str | None]:
    """``DST[:PORT[/PROTO]]`` -> (DST, the port part or None). An address or CIDR takes no port
    unless bracketed (``[fd00::1]:80/TCP``)."""
    try:
        ipaddress.ip_network(text, strict=False)
        return text, None
    except ValueError:
        pass
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise UsageError(f"{text}: expected [ADDRESS]:PORT/PROTO")
        return host, rest[1:] or None
    host, colon, port = text.rpartition(":")
    return (host, port or None) if colon else (text, None)


def explain_port(text: str) -> str:
    """kubectl's ``PORT/PROTO`` (``5432/TCP``, ``53/udp``, ``http/TCP``) as ``--port`` reads it
    (``TCP/5432``); anything else as it is, for :func:`port_spec` to judge."""
    first, slash, second = text.partition("/")
    return f"{second.upper()}/{first}" if slash and second.upper() in PROTOCOLS and first.upper() not in PROTOCOLS else text


def asked(destination: str, ports: Sequence[str]) -> tuple[str, list[str]]:
    """``--to`` and ``--port`` in either syntax, as :func:`connections` reads them: ``--to``
    may also be kubectl nftpolicy's ``DST[:PORT/PROTO]`` (the port joins ``ports``, first) and
    ``svc/NS/NAME`` (a Service, as ``NS/NAME``); each port ``[PROTO/]PORT`` or ``PORT/PROTO``.
    Raises UsageError."""
    destination, port = split_port(destination)
    if destination.startswith(SERVICE_PREFIX):
        destination = destination.removeprefix(SERVICE_PREFIX)
        if destination.count("/") != 1 or not all(destination.split("/")):
            raise UsageError(f"--to {SERVICE_PREFIX}{destination}: expected svc/NAMESPACE/NAME")
    return destination, [explain_port(p) for p in ([port] if port else []) + list(ports)]


def parse_port(text: str) -> tuple[ConnectionProtocol, int | None]:
    """``[TCP|UDP|SCTP/]PORT`` or ``ICMP`` -> (protocol, port). Raises UsageError."""
    protocol, _, port = text.upper().partition("/")
    if protocol == "ICMP" and not port:
        return "ICMP", None
    if not port:
        protocol, port = "TCP", protocol
    if protocol not in ("TCP", "UDP", "SCTP") or not port.isdigit():
        raise UsageError(f"--port {text}: expected [TCP|UDP|SCTP/]PORT, a container port's name or icmp")
    if not 1 <= int(port) <= 65535:
        raise UsageError(f"--port {text}: a port number is 1-65535")
    return protocol, int(port)  # type: ignore[return-value]


def resolve(enforcement: Enforcement, text: str, flag: str,
            pods: Mapping[str, Pod] | None = None) -> tuple[Endpoint | None, tuple[str, ...]]:
    """``--from``/``--to`` -> (the pod or None, its candidate addresses). An address or a CIDR
    (its first address), else ``NS/POD``: exactly, or the one pod of NS whose name starts with
    POD. Raises UsageError (``pods``, the manifests' pods: a hostNetwork pod is named as one)."""
    try:
        return None, (str(ipaddress.ip_network(text, strict=False).network_address),)
    except ValueError:
        pass
    namespace, slash, name = text.partition("/")
    if not slash or not namespace or not name or "." in namespace or ":" in namespace:  # namespaces have neither
        raise UsageError(f"{flag} {text}: not NS/POD, an address or a CIDR")
    found = [p for p in enforcement.pods if p.key == text] or [p for p in enforcement.pods if p.key.startswith(text)]
    if len(found) == 1:
        return found[0], found[0].ips
    if not found:
        raise UsageError(f"{flag} {text}: {_host_network(enforcement, text, pods) or 'no running pod with an address of that name'}")
    raise UsageError(f"{flag} {text}: names {len(found)} pods ({', '.join(sorted(p.key for p in found)[:5])}): give more of the name")


def _host_network(enforcement: Enforcement, text: str, pods: Mapping[str, Pod] | None) -> str | None:
    """Why ``NS/POD`` ``text`` names no pod of ``enforcement`` when it names a hostNetwork pod of
    ``pods`` (exactly, else by prefix): it uses its node's addresses, and no policy applies to
    it; else None."""
    host = [p for p in (pods or {}).values() if p.host_network and p.key == text] or \
        [p for p in (pods or {}).values() if p.host_network and p.key.startswith(text)]
    if len(host) != 1:
        return None
    pod = host[0]
    addresses = pod.ips or enforcement.node_addresses.get(pod.node or "", ())
    where = f"node {pod.node}'s" if pod.node else "its node's"
    return (f"{pod.key} is a hostNetwork pod: it uses {where} address ({', '.join(addresses) or 'unknown'}), and "
            f"NetworkPolicies do not apply to it; give that address")


def _agent(url: str) -> Enforcement:
    """The enforcement the agent at ``url`` (``http://HOST:PORT`` or ``unix:PATH``) holds.
    Raises UsageError when it cannot be read."""
    try:
        status, body = agent_get(url, DEBUG_PATH)
    except ValueError as exc:
        raise UsageError(f"--agent: {exc}") from None
    except (OSError, http.client.HTTPException) as exc:
        raise UsageError(f"cannot reach the agent at {url}: {getattr(exc, 'strerror', None) or exc}") from None
    if status != 200:
        hint = (f": nothing serves {DEBUG_PATH} there (the agent serves it on its --debug-address, default "
                f"{DEFAULT_DEBUG_ADDRESS}, not on its --http-address)") if status == 404 else ""
        raise UsageError(f"agent {url}: {status} {body.decode(errors='replace').strip()[:200]}{hint}")
    data: dict[str, object] = {}
    try:
        data = json.loads(body)
        return enforcement_from_json(data)
    except ModelShapeMismatch as exc:
        raise UsageError(f"agent {url} runs nftpolicy {data.get('version', 'of another version')} and this explain is "
                         f"{version('nftpolicy')} ({exc}): run explain of the agent's version, "
                         "or kubectl nftpolicy explain, which reads the API server") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"agent {url}: unreadable answer from {DEBUG_PATH}: {exc}") from None


def port_spec(text: str, target: Endpoint | None, pods: Mapping[str, Pod] | None) -> tuple[ConnectionProtocol, int | None]:
    """:func:`parse_port`, or ``[PROTO/]NAME``: the destination pod's container port of that name
    (``pods``: the manifests' pods; None with ``--agent``, which knows port numbers only).
    Raises UsageError."""
    try:
        return parse_port(text)
    except UsageError:
        protocol, _, name = text.upper().rpartition("/")
        if not name.isalnum() and not name.replace("-", "").isalnum() or name.isdigit():
            raise
    pod = pods.get(target.key) if pods is not None and target is not None else None
    if pod is None:
        raise UsageError(f"--port {text}: a port name needs a destination pod from manifests (--agent knows numbers only)")
    found = [p for p in pod.ports if p.name == name.lower() and protocol in ("", p.protocol)]
    if not found:
        named = ", ".join(sorted(f"{p.name} ({p.protocol}/{p.port})" for p in pod.ports if p.name)) or "none"
        raise UsageError(f"--port {text}: {pod.key} has no container port of that name (its named ports: {named})")
    return found[0].protocol, found[0].port


def connections(enforcement: Enforcement, source: str, destination: str, ports: Sequence[str],
                pods: Mapping[str, Pod] | None = None, ipv6: bool = False) -> list[Connection]:
    """The connections ``explain`` answers: one per port (see :func:`port_spec`; ``pods``: the
    manifests' pods, for port names), between the first addresses of the two ends in a family
    both have (IPv4 first; ``ipv6``: IPv6 first). Raises UsageError."""
    _, sources = resolve(enforcement, source, "--from", pods)
    target, destinations = resolve(enforcement, destination, "--to", pods)
    pairs = [(s, d) for s in sources for d in destinations if family_of(s) == family_of(d)]
    if not pairs:
        raise UsageError(f"{source} and {destination} have no address family in common")
    src, dst = min(pairs, key=lambda pair: (family_of(pair[0]) != "ipv6") if ipv6 else family_of(pair[0]))
    specs = [port_spec(p, target, pods) for p in ports] or [(protocol, port) for protocol, port in (target.ports if target else ())]  # type: ignore[misc]
    return [Connection(src, dst, protocol, port) for protocol, port in (specs or [("ICMP", None)])]


def service_targets(service: Service, cluster: Cluster, ports: Sequence[str]) -> tuple[list[str], list[str]]:
    """``--to`` naming a Service: the pods it selects (keys, sorted) and the ports to ask about:
    each ``--port`` that is one of the Service's ports, by number or by name (``[PROTO/]PORT``,
    ``[PROTO/]NAME``), as its targetPort (a number or a container port's name), or, without
    ``--port``, every targetPort. Says so in one line; raises UsageError."""
    selected = sorted(key for key, pod in cluster.pods.items() if pod.ips and service.selects(pod))
    if not selected:
        raise UsageError(f"--to {service.ref}: the Service selects no pod with an address")
    targets = []
    for text in ports:
        protocol, _, port = text.rpartition("/")
        protocol = protocol.upper() or ("TCP" if port.isdigit() else "")  # a number alone is TCP; a name is unique
        found = [p for p in service.ports if (int(port) == p.port if port.isdigit() else port == p.name)
                 and protocol in ("", p.protocol)]
        if not found:
            known = ", ".join(f"{p.name + ' ' if p.name else ''}{p.protocol}/{p.port}" for p in service.ports) or "none"
            raise UsageError(f"--port {text}: not a port of Service {service.ref} (its ports: {known})")
        targets.append(f"{found[0].protocol}/{found[0].target}")
    targets = targets or [f"{p.protocol}/{p.target}" for p in service.ports]
    shown = ", ".join(selected[:3]) + (f" and {len(selected) - 3} more" if len(selected) > 3 else "")
    print(f"nftpolicy: --to {service.ref} is a Service: its pods {shown}; target ports {', '.join(targets) or '(none)'}",
          file=sys.stderr)
    return selected, targets


def service_at(destination: str, services: Iterable[Service], config: Config) -> Service | None:
    """``--to`` given as a service cluster IP (an address in ``config.service_cidrs``): the
    Service that has it, or UsageError when none in the input does. kube-proxy (iptables or
    nftables mode) sends such a connection to one of the Service's pods before any policy chain
    sees it, so the verdict is the pods' (NetworkPolicy applies to the pod, not the Service IP);
    None when ``destination`` is not an address in those ranges."""
    try:
        address = ipaddress.ip_address(destination)
    except ValueError:
        return None
    if not any(address in ipaddress.ip_network(cidr) for cidr in config.service_cidrs if family_of(cidr) == family_of(destination)):
        return None
    found = next((s for s in services if any(ipaddress.ip_address(ip) == address for ip in s.cluster_ips)), None)
    if found is None:
        raise UsageError(f"--to {destination}: a service cluster IP (--service-cidr {', '.join(config.service_cidrs)}) of no Service "
                         "in the input: the connection goes to one of the Service's pods before policy applies; give the Service "
                         "as NS/NAME, or one of its pods")
    return found


def cmd_explain(args: argparse.Namespace) -> int:
    """Print the verdicts; exit 0 when every connection is allowed, 1 otherwise, 2 on bad input
    (3: manifests left out, see :func:`~nftpolicy.agent.cli.commands.finish`)."""
    if args.agent:
        if args.paths:
            raise UsageError("give manifests or --agent, not both")
        enforcement = _agent(args.agent)
        destination, ports = asked(args.destination, args.port or ())
        service_at(destination, (), config_from(args))
        return _answer(args, enforcement, connections(enforcement, args.source, destination, ports, ipv6=args.ipv6))
    if not args.paths:
        raise UsageError("give manifest paths, or --agent http://ADDR")
    read = read_manifests(args, args.node or [], keep_objects=True, say_stand_ins=False)
    note(read.dump_notes())
    stop = read.stop_when_empty(args)
    return stop if stop is not None else explain_objects(args, read)


def explain_objects(args: argparse.Namespace, read: Manifests) -> int:
    """:func:`cmd_explain` on objects already read: from manifests, or listed from the API by
    ``kubectl nftpolicy explain`` (:mod:`nftpolicy.agent.cli.kubectl`), so that both answer
    alike. ``args``: explain's flags (``source``, ``destination``, ``port``, ``output``, the
    exemptions of :func:`~nftpolicy.agent.cli.flags.add_config_arguments`, ``strict`` and
    ``accept_skipped``). Prints the verdicts; returns the exit code. Raises UsageError."""
    given = getattr(args, "node", None) or []  # kubectl nftpolicy explain: the live cluster's nodes
    cluster = with_addresses(read.cluster, placement_nodes(read.cluster, given))
    warn(cluster_warnings(cluster, given), args.strict)  # once placed: a --node that pods were put on is no typo
    config = config_from(args)
    enforcement = enforcement_of(cluster, config=config)
    services, unread = services_from(read.objects)
    report_skipped(unread, args.strict)
    read.skipped += unread
    destination, ports = asked(args.destination, args.port or ())
    source = workload_pod(args.source, read.stand_ins, cluster, "--from")
    service = services.get(destination) if destination not in cluster.pods else None
    service = service or service_at(destination, services.values(), config)
    if service is None:
        destination = workload_pod(destination, read.stand_ins, cluster, "--to")
        questions = connections(enforcement, source, destination, ports, cluster.pods, args.ipv6)
    else:
        selected, targets = service_targets(service, cluster, ports)
        questions = [c for key in selected for c in connections(enforcement, source, key, targets, cluster.pods, args.ipv6)]
    return read.finish(args, _answer(args, enforcement, questions))


def workload_pod(text: str, stand_ins: Sequence[StandIn], cluster: Cluster, flag: str) -> str:
    """``--from``/``--to`` naming a workload of the manifests (``NS/NAME`` of a Deployment,
    StatefulSet, ... that stands in its pods, and no pod of that name): the first of its pods
    with an address, which answers for all of them (they share the template's labels, which is
    all a policy selects by), said in one line; anything else as it is."""
    if text in cluster.pods:
        return text
    workload = next((s for s in stand_ins if s.ref == text), None)
    placed = [key for key in sorted(workload.pods) if key in cluster.pods] if workload is not None else []
    if workload is None or not placed:
        return text
    print(f"nftpolicy: {flag} {text} is {workload.kind} {workload.ref}: its pod {placed[0]} answers for its "
          f"{len(workload.pods)} {plural(len(workload.pods), 'pod', 'pods')} (the same labels)", file=sys.stderr)
    return placed[0]


def _answer(args: argparse.Namespace, enforcement: Enforcement, asked: Sequence[Connection]) -> int:
    """Print the verdicts on ``asked`` (``args.output``: text or json); 0 when all are allowed, else 1."""
    verdicts: list[Verdict] = [enforcement.verdict(c) for c in asked]
    if args.output == "json":
        print(json.dumps([v.as_json() for v in verdicts], indent=2))
    else:
        print("\n".join(line for v in verdicts for line in verdict_lines(v)))
    return 0 if all(v.allowed for v in verdicts) else 1


def with_addresses(cluster: Cluster, nodes: Sequence[str]) -> Cluster:
    """``cluster`` with every pod that has no ``status.podIP`` placed on ``nodes`` and addressed
    as the sandbox and ``trace`` build it (:func:`~nftpolicy.translators.workloads.place_pods`:
    from the node's pod CIDR, else 10.244.0.10 on), said in one line, so that all three answer
    for the same pods."""
    bare = sorted(p.key for p in cluster.pods.values() if not p.ips and not p.host_network and p.phase not in ("Succeeded", "Failed"))
    if not bare:
        return cluster
    families = sorted({family_of(ip) for p in cluster.pods.values() for ip in p.ips}) or ["ipv4"]
    placed = place_pods(cluster.pods.values(), nodes, families, {n.name: n.pod_cidrs for n in cluster.nodes.values()})
    shown = ", ".join(f"{key} {' '.join(placed[key].ips)}" for key in bare[:3]) + (f" and {len(bare) - 3} more" if len(bare) > 3 else "")
    print(f"nftpolicy: {len(bare)} {plural(len(bare), 'pod without status.podIP gets', 'pods without status.podIP get')} "
          f"the sandbox's addresses: {shown}", file=sys.stderr)
    return dataclasses.replace(cluster, pods={**cluster.pods, **{key: placed[key] for key in bare}})
