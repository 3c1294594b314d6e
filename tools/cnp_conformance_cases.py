"""Translate the ClusterNetworkPolicy conformance suite of sigs.k8s.io/network-policy-api v0.2.0
(``conformance/tests/*.go`` and the manifests under ``conformance/base``) into conformance cases
(``tests/conformance/cnp-upstream/*.yaml``, the format of ``tests/conformance/README.md``).

Usage (from the repository, as a module: it imports the tests' tier evaluator; the Go module
proxy must be reachable, ``go`` on the PATH)::

    .venv/bin/python -m tools.cnp_conformance_cases [--out tests/conformance/cnp-upstream]

Each upstream test (a ``suite.ConformanceTest``) becomes one ``-stepN`` file per ``t.Run``: the
policies as they stand when that sub-test probes (the sub-tests patch them in turn), and one
probe per protocol and port it pokes. A probe's ``upstream`` table holds exactly the cells the
sub-test asserts (its ``PokeServer`` calls); the ``expected`` matrix is the tier evaluator's
(``tests/tiers.py``, the spec oracle) for every pair, and the script refuses to write a case whose
matrix disagrees with an upstream cell. Upstream's namespaces lose their
``network-policy-conformance-`` prefix and the pods their surnames (``harry-potter-0`` is
``gryffindor/harry-0``), so that the matrices stay readable; labels and ports are upstream's.

Only the statements the suite uses are understood (rule swaps, a rule's action or protocols
replaced, a priority changed, a rule prepended, a NetworkPolicy deleted); anything else makes the
script stop, naming the statement. Tests that need node peers (the experimental
``SupportClusterNetworkPolicyEgressNodePeers`` feature: host-network pods) are left out and listed.

Exit codes: 0 written; 2 the module could not be read or a test could not be translated.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from nftpolicy.translators.cases import CaseError, format_matrix, load_case
from tests.tiers import evaluated_matrix

MODULE = "sigs.k8s.io/network-policy-api@v0.2.0"
PREFIX = "network-policy-conformance-"
HOUSES = {"gryffindor": "harry-potter", "slytherin": "draco-malfoy", "hufflepuff": "cedric-diggory", "ravenclaw": "luna-lovegood"}
PORTS = [{"name": "web", "port": 80, "protocol": "TCP"}, {"port": 8080, "protocol": "TCP"}, {"port": 5353, "protocol": "UDP"},
         {"name": "dns", "port": 53, "protocol": "UDP"}, {"port": 9003, "protocol": "SCTP"}, {"port": 9005, "protocol": "SCTP"}]
LEFT_OUT_FEATURE = "SupportClusterNetworkPolicyEgressNodePeers"
STATEMENT = re.compile("|".join([
    r'(?P<getpod>(?P<podvar>\w+) :?= kubernetes\.GetPod\(t, s\.Client, "(?P<podns>[\w-]+)", "(?P<podname>[\w-]+)")',
    r'(?P<getcnp>cnp := kubernetes\.GetClusterNetworkPolicy\(t, s\.Client, "(?P<cnpname>[\w-]+)")',
    r'(?P<copy>mutate := cnp\.DeepCopy\(\))',
    r'(?P<take>(?P<tmp>\w+) := mutate(?:\.DeepCopy\(\))?\.Spec\.(?P<tdir>Ingress|Egress)\[(?P<ti>\d+)\]\n)',
    r'(?P<move>mutate\.Spec\.(?P<mdir>Ingress|Egress)\[(?P<mi>\d+)\] = mutate\.Spec\.(?P<mdir2>Ingress|Egress)\[(?P<mj>\d+)\]\n)',
    r'(?P<put>mutate\.Spec\.(?P<pdir>Ingress|Egress)\[(?P<pi>\d+)\] = (?P<pvar>\w+)\n)',
    r'(?P<action>mutate\.Spec\.(?P<adir>Ingress|Egress)\[(?P<ai>\d+)\]\.Action = api\.ClusterNetworkPolicyRuleAction(?P<aval>\w+))',
    r'(?P<priority>mutate\.Spec\.Priority = (?P<prio>\d+))',
    r'(?P<named>(?P<nvar>\w+)\.Protocols = \[\]api\.ClusterNetworkPolicyProtocol\{\s*\{\s*DestinationNamedPort: (?P<nport>\w+),\s*\},\s*\})',
    r'(?P<string>(?P<svar>\w+) := "(?P<sval>[\w-]+)")',
    r'(?P<prepend>newRule := \[\]api\.ClusterNetworkPolicyEgressRule\{(?P<body>.*?)\n\t\t\t\}\n)',
    r'(?P<append>mutate\.Spec\.Egress = append\(newRule, mutate\.Spec\.Egress\.\.\.\))',
    r'(?P<patch>kubernetes\.PatchClusterNetworkPolicy\(t, s\.Client, cnp, mutate)',
    r'(?P<npkey>Namespace: "(?P<npns>[\w-]+)",\s*Name:\s*"(?P<npname>[\w-]+)")',
    r'(?P<npdelete>s\.Client\.Delete\(ctx, np\))',
    r'(?P<poke>kubernetes\.PokeServer\(t, s\.ClientSet, &s\.KubeConfig, "(?P<cns>[\w-]+)", "(?P<cpod>[\w-]+)", "(?P<proto>\w+)",\s*'
    r'(?P<server>\w+)\.Status\.PodIP, int32\((?P<port>\d+)\), s\.TimeoutConfig, (?P<want>true|false)\))',
    r'(?P<unknown>\bmutate\b[^\n]*)',
]), re.S)


class Untranslatable(Exception):
    """A statement of an upstream test that this script does not understand."""


def module_dir() -> Path:
    """The v0.2.0 module's directory in the Go module cache (downloaded through the proxy)."""
    out = subprocess.run(["go", "mod", "download", "-json", MODULE], capture_output=True, text=True, check=True)
    return Path(json.loads(out.stdout)["Dir"])


def short(value: Any) -> Any:
    """``value`` with upstream's namespace prefix dropped from every string."""
    if isinstance(value, str):
        return value.replace(PREFIX, "")
    if isinstance(value, dict):
        return {k: short(v) for k, v in value.items()}
    if isinstance(value, list):
        return [short(v) for v in value]
    return value


def pod_key(namespace: str, name: str) -> str:
    """``gryffindor/harry-0`` for upstream's ``network-policy-conformance-gryffindor``, ``harry-potter-0``."""
    namespace = short(namespace)
    return f"{namespace}/{name.replace(HOUSES[namespace], HOUSES[namespace].split('-')[0])}"


def tests_of(source: str) -> list[tuple[str, list[str], list[str], str]]:
    """``(ShortName, manifests, features, body)`` of every ConformanceTest in a Go file."""
    found = []
    for block in re.split(r"\nvar \w+ = suite\.ConformanceTest\{", source)[1:]:
        name = re.search(r'ShortName:\s*"(\w+)"', block).group(1)  # type: ignore[union-attr]
        manifests = re.findall(r'"(base/[\w/.-]+\.yaml)"', block)
        features = re.findall(r"suite\.(\w+)", block.split("Manifests:")[0])
        found.append((name, manifests, features, block.split("Test: func", 1)[1]))
    return found


def kebab(name: str) -> str:
    """``CNPAdminTierEgressInlineCIDRPeers`` -> ``admin-tier-egress-inline-cidr-peers``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "-", name.removeprefix("CNP")).lower()


def translate(name: str, objects: list[dict[str, Any]], body: str) -> list[tuple[str, list[dict[str, Any]], list[tuple[Any, ...]]]]:
    """One ``(sub-test title, objects, pokes)`` per ``t.Run``; a poke is ``(from, to, protocol,
    port, allowed)``."""
    state = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objects}
    steps = []
    for title, run in re.findall(r't\.Run\("([^"]+)", func\(t \*testing\.T\) \{(.*?)\n\t\t\}\)', body, re.S):
        pods: dict[str, str] = {}
        strings: dict[str, str] = {}
        rules: dict[str, dict[str, Any]] = {}
        pokes = []
        current = mutate = new_rule = np_key = None
        for m in STATEMENT.finditer(run):
            g = m.groupdict()
            if g["getpod"]:
                pods[g["podvar"]] = pod_key(g["podns"], g["podname"])
            elif g["getcnp"]:
                current = ("ClusterNetworkPolicy", None, g["cnpname"])
            elif g["copy"]:
                mutate = copy.deepcopy(state[current])  # type: ignore[index]
            elif g["take"]:
                rules[g["tmp"]] = copy.deepcopy(mutate["spec"][g["tdir"].lower()][int(g["ti"])])  # type: ignore[index]
            elif g["move"]:
                spec = mutate["spec"]  # type: ignore[index]
                spec[g["mdir"].lower()][int(g["mi"])] = copy.deepcopy(spec[g["mdir2"].lower()][int(g["mj"])])
            elif g["put"]:
                mutate["spec"][g["pdir"].lower()][int(g["pi"])] = rules[g["pvar"]]  # type: ignore[index]
            elif g["action"]:
                mutate["spec"][g["adir"].lower()][int(g["ai"])]["action"] = g["aval"]  # type: ignore[index]
            elif g["priority"]:
                mutate["spec"]["priority"] = int(g["prio"])  # type: ignore[index]
            elif g["named"]:
                rules[g["nvar"]]["protocols"] = [{"destinationNamedPort": strings[g["nport"]]}]
            elif g["string"]:
                strings[g["svar"]] = g["sval"]
            elif g["prepend"]:
                rule_name = re.search(r'Name:\s*"([\w-]+)"', g["body"]).group(1)  # type: ignore[union-attr]
                action = re.search(r'Action:\s*"(\w+)"', g["body"]).group(1)  # type: ignore[union-attr]
                networks = ["${hostCIDR:" + pods[v] + "}" for v in re.findall(r"api\.CIDR\((\w+)\.Status\.PodIP \+ mask\)", g["body"])]
                new_rule = {"name": rule_name, "action": action, "to": [{"networks": networks}]}
            elif g["append"]:
                mutate["spec"]["egress"] = [new_rule, *mutate["spec"]["egress"]]  # type: ignore[index]
            elif g["patch"]:
                state[current] = mutate  # type: ignore[index]
            elif g["npkey"]:
                np_key = ("NetworkPolicy", short(g["npns"]), g["npname"])
            elif g["npdelete"]:
                del state[np_key]  # type: ignore[arg-type]
            elif g["poke"]:
                pokes.append((pod_key(g["cns"], g["cpod"]), pods[g["server"]], g["proto"].upper(), int(g["port"]), g["want"] == "true"))
            else:
                raise Untranslatable(f"{name} {title!r}: {m.group(0).strip()!r}")
        steps.append((title, copy.deepcopy(list(state.values())), pokes))
    return steps


def case_text(name: str, source: str, objects: list[dict[str, Any]], pokes: list[tuple[Any, ...]]) -> str:
    """The case file: namespaces, pods, policies, one probe per poked (protocol, port), the
    expected matrices from the tier evaluator and the upstream cells."""
    pods = [{"namespace": ns, "name": f"{HOUSES[ns].split('-')[0]}-{i}", "labels": {"conformance-house": ns}}
            for ns in HOUSES for i in (0, 1)]
    document: dict[str, Any] = {
        "name": name, "source": source,
        "namespaces": {ns: {"conformance-house": ns} for ns in HOUSES},
        "pods": [{**p, "ports": PORTS} for p in pods],
        "policies": [o for o in objects if o["kind"] == "NetworkPolicy"],
        "clusterNetworkPolicies": [o for o in objects if o["kind"] == "ClusterNetworkPolicy"],
        "probes": [],
    }
    probed = sorted({(p[2], p[3]) for p in pokes}, key=lambda k: (["TCP", "UDP", "SCTP"].index(k[0]), k[1]))
    keys = [f"{p['namespace']}/{p['name']}" for p in pods]
    for protocol, port in probed:
        cells = "\n".join(f"{src} {dst} {'.' if ok else 'X'}" for src, dst, proto, prt, ok in pokes if (proto, prt) == (protocol, port))
        placeholder = format_matrix(keys, {(a, b): True for a in keys for b in keys})  # replaced below
        document["probes"].append({"port": port, "protocol": protocol, "upstream": cells + "\n", "expected": placeholder})
    case = load_case(yaml.safe_dump(document))
    for probe_doc, probe in zip(document["probes"], case.probes):
        matrix = evaluated_matrix(case, probe)
        wrong = {cell: want for cell, want in probe.upstream.items() if matrix[cell] != want}
        if wrong:
            raise Untranslatable(f"{name} {probe.protocol}/{probe.port}: the tier evaluator disagrees with upstream on {wrong}")
        probe_doc["expected"] = format_matrix(keys, matrix) + "\n"
    return _dump(document)


class _Dumper(yaml.SafeDumper):
    """Block style, literal blocks for the matrices, flow style for the pods' ports."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def _dump(document: dict[str, Any]) -> str:
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=400)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tests/conformance/cnp-upstream"))
    args = parser.parse_args(argv)
    try:
        root = module_dir() / "conformance"
    except (OSError, subprocess.CalledProcessError, ValueError, KeyError) as exc:
        print(f"cnp_conformance_cases: cannot read {MODULE} from the Go module proxy: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    written, left_out = 0, []
    for number, path in enumerate(sorted((root / "tests").glob("*.go"))):
        for name, manifests, features, body in tests_of(path.read_text()):
            if LEFT_OUT_FEATURE in features:
                left_out.append(f"{name} ({path.name}): needs {LEFT_OUT_FEATURE} (node peers and host-network pods)")
                continue
            objects = [short(o) for m in manifests for o in yaml.safe_load_all((root / m).read_text()) if o]
            try:
                steps = translate(name, objects, body)
                for k, (title, state, pokes) in enumerate(steps, 1):
                    case = f"{200 + number:03d}-{kebab(name)}" + (f"-step{k}" if len(steps) > 1 else "")
                    source = f"network-policy-api v0.2.0 conformance {path.name}: {name} t.Run({title!r})"
                    (args.out / f"{case}.yaml").write_text(f"# generated by tools/cnp_conformance_cases.py from {MODULE}\n"
                                                           + case_text(case, source, state, pokes))
                    written += 1
            except (Untranslatable, CaseError) as exc:
                print(f"cnp_conformance_cases: {exc}", file=sys.stderr)
                return 2
    for line in left_out:
        print(f"left out: {line}")
    print(f"wrote {written} cases to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
