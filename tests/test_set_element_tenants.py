"""The element cap (``--max-object-elements``) counted on the cluster is never a lever for
another tenant: the pods a policy's peers select may belong to anyone, so what counts is what
the object's peers multiply (its sets' elements beyond one per pod address), and a union set
counts what it holds once made, so that an incremental render and a full render of the same
cluster agree (a hostile review of the caps with union sets). No kernel."""

from __future__ import annotations

from typing import Any

from nftpolicy.translators.manifests import build_cluster
from nftpolicy.translators.model import Cluster
from nftpolicy.translators.noderender import NodeRenderer

NODE = "n0"


def pod(i: int, ns: str, labels: dict[str, str], node: str = NODE, v6: bool = False) -> tuple[str, dict[str, Any]]:
    ips = [{"ip": f"10.0.{i // 256}.{i % 256}"}] + ([{"ip": f"fd00::{i:x}"}] if v6 else [])
    return ("t", {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": ns, "name": f"p{i}", "labels": labels},
                  "spec": {"nodeName": node, "containers": [{"name": "c"}]}, "status": {"phase": "Running", "podIPs": ips}})


def netpol(name: str, spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return ("t", {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "shop", "name": name},
                  "spec": spec})


# shop's own pods, from its own pods (every pod of shop, or those labelled web: all of them are):
# one union set per family of shop's 8 addresses
OVERLAPPING = netpol("web", {"podSelector": {}, "ingress": [{"from": [{"podSelector": {}}, {"podSelector": {"matchLabels": {"app": "web"}}}]}]})


def cluster(shop: int, evil: int, *policies: tuple[str, dict[str, Any]], v6: bool = False) -> Cluster:
    objects = [pod(i, "shop", {"app": "web"}, v6=v6) for i in range(shop)]
    objects += [pod(1000 + i, "evil", {"app": "x"}, node="n1", v6=v6) for i in range(evil)]
    built, errors = build_cluster(objects + list(policies))
    assert not errors, errors
    return built


def test_a_union_of_overlapping_peers_within_the_cap_is_not_closed_by_another_namespaces_pods():
    """The union set holds shop's 8 addresses (cap 10), whatever the evil namespace holds; the
    renderer once counted a union not yet made as min(every pod's addresses, the sum of its
    peers'), which counted shop's pods twice once evil had pods."""
    renderer = NodeRenderer(NODE, max_elements=10).load(cluster(8, 5, OVERLAPPING))
    union = [s for s in NodeRenderer(NODE).load(cluster(8, 5, OVERLAPPING)).model().sets if s.name.startswith("KUBE-PODS-")]
    assert [len(s.elements) for s in union] == [8]
    assert list(renderer.over_limit()) == []


def test_the_same_cluster_rendered_incrementally_and_in_full_gives_the_same_model_with_the_cap():
    renderer = NodeRenderer(NODE, max_elements=10).load(cluster(8, 0, OVERLAPPING))
    renderer.take_changes()
    after = cluster(8, 20, OVERLAPPING)
    for key, evil in after.pods.items():
        if evil.namespace == "evil":
            renderer.set_pod(key, evil)
    renderer.take_changes()
    full = NodeRenderer(NODE, max_elements=10).load(after)
    assert (list(renderer.over_limit()), renderer.model()) == (list(full.over_limit()), full.model())


def test_pods_of_another_namespace_do_not_close_a_policy_whose_sets_hold_each_address_once():
    """An innocent "from every namespace" rule: its sets hold each pod's address once per family,
    no amplification. The hostile tenant only creates pods in its own namespace; the cap (here
    10 per object, by default 100,000: 50,001 dual-stack pods in the cluster) then closes
    shop's policy: every connection it allowed is denied."""
    from_anywhere = netpol("from-anywhere", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {}}]}]})
    assert list(NodeRenderer(NODE, max_elements=10).load(cluster(2, 0, from_anywhere, v6=True)).over_limit()) == []
    assert list(NodeRenderer(NODE, max_elements=10).load(cluster(2, 4, from_anywhere, v6=True)).over_limit()) == []


def test_a_tenants_pods_do_not_turn_an_admins_deny_of_that_tenant_into_a_deny_of_everyone():
    """An Admin ClusterNetworkPolicy over every namespace denies ingress from the namespaces
    labelled team=untrusted: one set of their pods' addresses. The untrusted tenant creates
    pods in its own namespace until that set is beyond the cap (here 10; by default 100,000);
    the CNP is then closed, its Deny rule denying everything: every pod of the cluster refuses
    ingress from everyone."""
    cnp = ("t", {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": "deny-untrusted"},
                 "spec": {"tier": "Admin", "priority": 10, "subject": {"namespaces": {}},
                          "ingress": [{"action": "Deny", "from": [{"namespaces": {"matchLabels": {"team": "untrusted"}}}]}]}})
    namespaces = [("t", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
                  for name, labels in (("shop", {}), ("evil", {"team": "untrusted"}))]
    objects = [pod(i, "shop", {"app": "web"}) for i in range(3)] + [pod(1000 + i, "evil", {"app": "x"}, node="n1") for i in range(11)]
    built, errors = build_cluster(namespaces + objects + [cnp])
    assert not errors
    renderer = NodeRenderer(NODE, max_elements=10).load(built)
    assert list(renderer.over_limit()) == []
