"""Element-only commits through netlink (agent/dataplane/nfnetlink.py) against the real kernel:
the table they leave equals the one libnftables leaves for the same transaction, a refused batch
commits nothing, and what the netlink path cannot say (intervals, any other object) goes
through libnftables."""

from __future__ import annotations

import ipaddress

import pytest

from nftpolicy.agent.dataplane import DataplaneError
from nftpolicy.agent.dataplane.nftables import NftDataplane
from nftpolicy.translators import layout, nft, transaction
from nftpolicy.translators.rules import AddressSet
from nftpolicy.translators.transaction import Elements, OurTable, Transaction

pytestmark = pytest.mark.kernel
TABLE = "nftpolicy-nl"


def table() -> layout.Table:
    chains = (layout.Chain("KUBE-POD-IN-A", ()), layout.Chain("KUBE-POD-IN-B", ()))
    sets = (AddressSet("PODS4", "ipv4", "addr", ("10.0.0.1",), "pods"),
            AddressSet("PODS6", "ipv6", "addr", ("fd00::1",), "pods"),
            AddressSet("PORTS4", "ipv4", "named_port", (("10.0.0.1", "tcp", 8080),), "named ports"),
            AddressSet("NET4", "ipv4", "interval", ("10.1.0.0/16",), "ipBlock"))
    maps = (layout.VerdictMap("MAP4", "ingress", "ipv4", (layout.MapElement("10.0.0.1", "KUBE-POD-IN-A", "a/a"),), "dispatch"),)
    return layout.Table(TABLE, 0, sets, chains, maps)


def delta(*operations: tuple[str, Elements]) -> Transaction:
    tx = Transaction(TABLE, 0)
    tx.add(OurTable())
    for verb, elements in operations:
        (tx.add if verb == "add" else tx.delete)(elements)
    return tx


def loaded(make_netns) -> NftDataplane:
    dataplane = NftDataplane(TABLE, make_netns())
    dataplane.run(transaction.replacing(table()))
    return dataplane


def elements(dataplane: NftDataplane, name: str) -> list[object]:
    body = next(item[kind] for item in dataplane.listing() for kind in ("set", "map") if kind in item and item[kind]["name"] == name)
    return body.get("elem", [])


ELEMENT_DELTA = [
    ("delete", Elements("PODS4", ("10.0.0.1",))),
    ("add", Elements("PODS4", ("10.0.0.2", "10.0.0.3"))),
    ("add", Elements("PODS6", ("fd00::2",))),
    ("delete", Elements("PORTS4", (("10.0.0.1", "tcp", 8080),))),
    ("add", Elements("PORTS4", (("10.0.0.2", "udp", 53), ("10.0.0.3", "sctp", 9000)))),
    ("delete", Elements("MAP4", ("10.0.0.1",))),
    ("add", Elements("MAP4", (layout.MapElement("10.0.0.2", "KUBE-POD-IN-B", "a/b"),))),
]


def test_an_element_delta_through_netlink_leaves_the_table_libnftables_leaves(make_netns):
    ours, theirs = loaded(make_netns), loaded(make_netns)
    tx = delta(*ELEMENT_DELTA)
    assert ours._elements_only(tx) is not None
    ours.run(tx)
    theirs._deltas.cmd(nft.transaction_json(tx))
    assert ours.listing() == theirs.listing()
    assert elements(ours, "PODS4") == ["10.0.0.2", "10.0.0.3"]
    assert elements(ours, "MAP4") == [["10.0.0.2", {"jump": {"target": "KUBE-POD-IN-B"}}]]
    assert sorted(str(e) for e in elements(ours, "PORTS4")) == sorted(
        str({"concat": c}) for c in (["10.0.0.2", "udp", 53], ["10.0.0.3", "sctp", 9000]))


def test_a_large_element_delta_is_split_into_messages_in_one_transaction(make_netns):
    dataplane = loaded(make_netns)
    many = tuple(str(ipaddress.IPv4Address("10.64.0.0") + i) for i in range(20000))  # about 8 netlink messages
    dataplane.run(delta(("add", Elements("PODS4", many))))
    assert len(elements(dataplane, "PODS4")) == 20001
    dataplane.run(delta(("delete", Elements("PODS4", many))))
    assert elements(dataplane, "PODS4") == ["10.0.0.1"]


def test_a_refused_element_batch_commits_nothing_and_names_the_set(make_netns):
    dataplane = loaded(make_netns)
    before = dataplane.listing()
    with pytest.raises(DataplaneError, match="delete element in set PODS6 of inet nftpolicy-nl: No such file or directory"):
        dataplane.run(delta(("add", Elements("PODS4", ("10.0.0.9",))), ("delete", Elements("PODS6", ("fd00::9",)))))
    assert dataplane.listing() == before
    dataplane.run(delta(("add", Elements("PODS4", ("10.0.0.9",)))))  # a fresh socket after the refusal
    assert "10.0.0.9" in elements(dataplane, "PODS4")


def test_a_missing_table_refuses_an_element_delta(make_netns):
    dataplane = loaded(make_netns)
    dataplane.run(transaction.removing(TABLE))
    with pytest.raises(DataplaneError, match="No such file or directory"):
        dataplane.run(delta(("add", Elements("PODS4", ("10.0.0.9",)))))
    assert dataplane.listing() == []


@pytest.mark.parametrize("operations", [
    [("add", Elements("NET4", ("10.2.0.0/16",)))],  # an interval: a start and an end element
    [("add", Elements("PODS4", ("10.0.0.5",))), ("add", Elements("UNKNOWN", ("10.0.0.5",)))],  # a set we did not make
], ids=["interval", "unknown set"])
def test_what_netlink_does_not_say_goes_through_libnftables(make_netns, operations):
    dataplane = loaded(make_netns)
    tx = delta(*operations)
    assert dataplane._elements_only(tx) is None
    if operations[-1][1].name == "NET4":
        dataplane.run(tx)
        assert sorted(str(e) for e in elements(dataplane, "NET4")) == sorted(
            str({"prefix": {"addr": a, "len": 16}}) for a in ("10.1.0.0", "10.2.0.0"))


def test_a_chain_change_goes_through_libnftables(make_netns):
    dataplane = loaded(make_netns)
    tx = delta(("add", Elements("PODS4", ("10.0.0.5",))))
    tx.flush(layout.Chain("KUBE-POD-IN-A", ()))
    assert dataplane._elements_only(tx) is None
    dataplane.run(tx)
    assert "10.0.0.5" in elements(dataplane, "PODS4")
