"""``nftpolicy explain``: why traffic from A to B on a port is allowed or denied, in a few lines.

The answer is the verdict engine's (:mod:`nftpolicy.translators.verdict`) on what nftpolicy
enforces: every node's rule model rendered from manifests, or, with ``--agent``, the model a
running agent holds right now (read from its debug endpoint, :mod:`nftpolicy.agent.debughttp`).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
import urllib.error
import urllib.request
from typing import Sequence

from nftpolicy.translators.model import family_of
from nftpolicy.translators.verdict import (
    Connection,
    ConnectionProtocol,
    Endpoint,
    Enforcement,
    Verdict,
    enforcement_from_json,
    enforcement_of,
    verdict_lines,
)

from ..cli import UsageError, config_from
from ..debughttp import DEBUG_PATH
from ..manifestfiles import load_cluster

AGENT_TIMEOUT = 5.0


def parse_port(text: str) -> tuple[ConnectionProtocol, int | None]:
    """``[TCP|UDP|SCTP/]PORT`` or ``ICMP`` -> (protocol, port). Raises UsageError."""
    protocol, _, port = text.upper().partition("/")
    if protocol == "ICMP" and not port:
        return "ICMP", None
    if not port:
        protocol, port = "TCP", protocol
    if protocol not in ("TCP", "UDP", "SCTP") or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"invalid --port {text!r} (expected [TCP|UDP|SCTP/]PORT or icmp)")
    return protocol, int(port)  # type: ignore[return-value]


def resolve(enforcement: Enforcement, text: str, flag: str) -> tuple[Endpoint | None, tuple[str, ...]]:
    """``--from``/``--to`` -> (the pod or None, its candidate addresses). An address or a CIDR
    (its first address), else ``NS/POD``: exactly, or the one pod of NS whose name starts with
    POD. Raises UsageError."""
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
        raise UsageError(f"{flag} {text}: no running pod with an address of that name")
    raise UsageError(f"{flag} {text}: names {len(found)} pods ({', '.join(sorted(p.key for p in found)[:5])}): give more of the name")


def _agent(url: str) -> Enforcement:
    """The enforcement the agent at ``url`` holds. Raises UsageError when it cannot be read."""
    address = url.rstrip("/") + DEBUG_PATH
    try:
        with urllib.request.urlopen(address, timeout=AGENT_TIMEOUT) as reply:
            return enforcement_from_json(json.loads(reply.read()))
    except urllib.error.HTTPError as exc:
        raise UsageError(f"agent {url}: {exc.code} {exc.read().decode(errors='replace').strip()}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise UsageError(f"cannot reach the agent at {url}: {getattr(exc, 'reason', exc)}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"agent {url}: unreadable answer from {address}: {exc}") from None


def connections(enforcement: Enforcement, source: str, destination: str, ports: Sequence[str]) -> list[Connection]:
    """The connections ``explain`` answers: one per port, between the first addresses of the two
    ends in a family both have (IPv4 first). Raises UsageError."""
    _, sources = resolve(enforcement, source, "--from")
    target, destinations = resolve(enforcement, destination, "--to")
    pairs = [(s, d) for s in sources for d in destinations if family_of(s) == family_of(d)]
    if not pairs:
        raise UsageError(f"{source} and {destination} have no address family in common")
    src, dst = min(pairs, key=lambda pair: family_of(pair[0]))
    specs = [parse_port(p) for p in ports] or [(protocol, port) for protocol, port in (target.ports if target else ())]  # type: ignore[misc]
    return [Connection(src, dst, protocol, port) for protocol, port in (specs or [("ICMP", None)])]


def cmd_explain(args: argparse.Namespace) -> int:
    """Print the verdicts; exit 0 when every connection is allowed, 1 otherwise, 2 on bad input."""
    if args.agent:
        if args.paths:
            raise UsageError("give manifests or --agent, not both")
        enforcement = _agent(args.agent)
    else:
        if not args.paths:
            raise UsageError("give manifest paths, or --agent http://ADDR")
        cluster, errors = load_cluster(args.paths)
        for error in errors:
            print(f"nftpolicy: skipped {error}", file=sys.stderr)
        enforcement = enforcement_of(cluster, config=config_from(args))
    verdicts: list[Verdict] = [enforcement.verdict(c) for c in connections(enforcement, args.source, args.destination, args.port or ())]
    if args.output == "json":
        print(json.dumps([v.as_json() for v in verdicts], indent=2))
    else:
        print("\n".join(line for v in verdicts for line in verdict_lines(v)))
    return 0 if all(v.allowed for v in verdicts) else 1
