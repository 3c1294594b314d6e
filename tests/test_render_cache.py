"""The agent's render cache never changes the result: after any sequence of changes, a render
that reuses the previous one equals a render from scratch."""

from __future__ import annotations

import dataclasses
import random

import pytest

from nftpolicy.translators.model import Namespace
from nftpolicy.translators.rules import RenderCache, build_rule_model

from .conftest import example_cluster


def _mutate(cluster, rng: random.Random):
    pods, namespaces, policies = dict(cluster.pods), dict(cluster.namespaces), dict(cluster.policies)
    action = rng.randrange(6)
    key = rng.choice(sorted(pods))
    pod = pods[key]
    if action == 0:    # relabel a pod
        pods[key] = dataclasses.replace(pod, labels={**pod.labels, "app": rng.choice(["frontend", "api", "db", "cache", "x"])})
    elif action == 1:  # a pod finishes, or runs again
        pods[key] = dataclasses.replace(pod, phase=rng.choice(["Running", "Succeeded"]))
    elif action == 2:  # a pod moves to another address
        pods[key] = dataclasses.replace(pod, ips=(f"10.244.{rng.choice([1, 2])}.{rng.randrange(10, 40)}",))
    elif action == 3:  # relabel a namespace
        name = rng.choice(sorted(namespaces))
        namespaces[name] = Namespace(name, {**namespaces[name].labels, "team": rng.choice(["ops", "shop", "none"])})
    elif action == 4 and policies:  # delete a policy
        policies.pop(rng.choice(sorted(policies)))
    else:              # re-create a policy of the original cluster
        original = example_cluster().policies
        name = rng.choice(sorted(original))
        policies[name] = original[name]
    return dataclasses.replace(cluster, pods=pods, namespaces=namespaces, policies=policies)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("node", ["node1", "node2", None])
def test_cached_render_equals_fresh_render(seed, node):
    rng = random.Random(seed)
    cluster, cache = example_cluster(), RenderCache()
    for _ in range(40):
        cluster = _mutate(cluster, rng)
        assert build_rule_model(cluster, node, cache=cache) == build_rule_model(cluster, node)


def test_unchanged_policies_are_not_rendered_again():
    cluster, cache = example_cluster(), RenderCache()
    build_rule_model(cluster, None, cache=cache)
    before = dict(cache.rendered)
    key = "ops/debug-6c7d8f9b7-m4n5b"
    pods = {**cluster.pods, key: dataclasses.replace(cluster.pods[key], labels={"app": "other"})}
    build_rule_model(dataclasses.replace(cluster, pods=pods), None, cache=cache)
    reused = {k for k in before if cache.rendered[k] is before[k]}
    # ops/debug is a peer of no policy, so every rendered policy is reused as it was.
    assert reused == set(before) and before


def test_equal_addresses_written_differently_are_one_address():
    from nftpolicy.translators.manifests import pod_from

    a = pod_from({"metadata": {"name": "a", "namespace": "x"}, "status": {"podIPs": [{"ip": "FD00::A"}, {"ip": "10.0.0.1"}]}})
    assert a.ips == ("fd00::a", "10.0.0.1")


def test_renaming_a_named_port_stays_incremental():
    from nftpolicy.translators import nft
    from nftpolicy.translators.manifests import policy_from

    cluster = example_cluster()
    obj = {"metadata": {"namespace": "shop", "name": "api-ingress"},
           "spec": {"podSelector": {"matchLabels": {"app": "api"}}, "ingress": [{"ports": [{"port": "metrics"}]}]}}
    renamed = {**obj, "spec": {**obj["spec"], "ingress": [{"ports": [{"port": "http"}]}]}}
    before = nft.TableState(nft.ruleset_objects(build_rule_model(
        dataclasses.replace(cluster, policies={**cluster.policies, "shop/api-ingress": policy_from(obj)}), "node1")))
    after = nft.TableState(nft.ruleset_objects(build_rule_model(
        dataclasses.replace(cluster, policies={**cluster.policies, "shop/api-ingress": policy_from(renamed)}), "node1")))
    batch = nft.incremental_transaction(before, after)
    assert batch is not None and any("delete" in c and "set" in c["delete"] for c in batch["nftables"])
