"""The DNS learner of domainNames peers (agent/daemon/dnslearn.py) on DNS messages that dnspython
builds: CNAME chains, TTL floor and cap, wildcard depth, bounds, TCP framing, malformed input."""

from __future__ import annotations

import dns.flags
import dns.message
import dns.rrset
import pytest
from nftpolicy.agent.daemon.dnslearn import DomainLearner
from nftpolicy.translators.domainnames import DomainSet, domain_sets
from nftpolicy.translators.manifests import build_cluster

POD, OTHER_POD = "10.0.1.5", "10.0.1.6"
V4 = DomainSet("KUBE-DNS-A", "ipv4", ("api.partner.example", "*.cdn.example"), frozenset({POD}), ("partner",))
V6 = DomainSet("KUBE-DNS-B", "ipv6", V4.names, V4.clients, V4.policies)


def answer(qname: str, *records: tuple[str, int, str, str], qtype: str = "A", tc: bool = False) -> bytes:
    """A response to ``qname`` with answer records ``(owner, ttl, type, value)``."""
    query = dns.message.make_query(qname, qtype)
    response = dns.message.make_response(query)
    for owner, ttl, rtype, value in records:
        response.answer.append(dns.rrset.from_text(owner, ttl, "IN", rtype, value))
    if tc:
        response.flags |= dns.flags.TC
    return response.to_wire()


def learner(**bounds: int) -> DomainLearner:
    made = DomainLearner(ttl_floor=bounds.get("floor", 5), ttl_cap=bounds.get("cap", 3600),
                         max_per_set=bounds.get("per_set", 100), max_per_pod=bounds.get("per_pod", 100))
    made.update([V4, V6])
    return made


def test_an_answer_for_a_named_host_is_learned_with_its_ttl_in_the_set_of_its_family():
    got = learner().learn(POD, answer("api.partner.example", ("api.partner.example.", 60, "A", "192.0.2.10"),
                                      ("api.partner.example.", 60, "A", "192.0.2.11")), now=0)
    assert [(x.set_name, x.address, x.timeout, x.name, x.pattern) for x in got] == [
        ("KUBE-DNS-A", "192.0.2.10", 60, "api.partner.example", "api.partner.example"),
        ("KUBE-DNS-A", "192.0.2.11", 60, "api.partner.example", "api.partner.example")]


def test_aaaa_answers_fill_the_ipv6_set():
    got = learner().learn(POD, answer("api.partner.example", ("api.partner.example.", 30, "AAAA", "2001:db8::10"), qtype="AAAA"), now=0)
    assert [(x.set_name, x.address) for x in got] == [("KUBE-DNS-B", "2001:db8::10")]


def test_a_cname_chain_is_followed_and_the_smallest_ttl_counts():
    got = learner().learn(POD, answer("api.partner.example", ("api.partner.example.", 300, "CNAME", "edge.cdn-host.net."),
                                      ("edge.cdn-host.net.", 20, "CNAME", "a1.cdn-host.net."),
                                      ("a1.cdn-host.net.", 600, "A", "198.51.100.7")), now=0)
    assert [(x.address, x.timeout, x.name) for x in got] == [("198.51.100.7", 20, "api.partner.example")]


def test_records_outside_the_chain_are_not_learned():
    got = learner().learn(POD, answer("api.partner.example", ("api.partner.example.", 60, "A", "192.0.2.10"),
                                      ("evil.example.", 60, "A", "203.0.113.66")), now=0)
    assert [x.address for x in got] == ["192.0.2.10"]


@pytest.mark.parametrize("name, learned", [("img.cdn.example", True), ("a.b.cdn.example", True), ("cdn.example", False),
                                           ("other.example", False), ("API.Partner.Example", True),
                                           ("evilcdn.example", False), ("cdn.example.evil", False),
                                           # one label 'x.cdn' under 'example' (written 'x\\.cdn.example'): no child of cdn.example
                                           ("x\\.cdn.example", False), ("x.y\\.cdn.example", False), ("api\\.partner.example", False)])
def test_wildcard_depth_and_case(name, learned):
    got = learner().learn(POD, answer(name, (name + ".", 60, "A", "192.0.2.20")), now=0)
    assert bool(got) is learned


def test_ttl_is_raised_to_the_floor_and_cut_to_the_cap():
    made = learner(floor=10, cap=100)
    low = made.learn(POD, answer("api.partner.example", ("api.partner.example.", 0, "A", "192.0.2.1")), now=0)
    high = made.learn(POD, answer("a.cdn.example", ("a.cdn.example.", 86400, "A", "192.0.2.2")), now=0)
    assert [x.timeout for x in low + high] == [10, 100]


def test_answers_to_pods_no_policy_selects_and_unasked_names_are_ignored():
    made = learner()
    assert made.learn(OTHER_POD, answer("api.partner.example", ("api.partner.example.", 60, "A", "192.0.2.10")), now=0) == []
    assert made.learn(POD, answer("www.example", ("www.example.", 60, "A", "192.0.2.10")), now=0) == []
    assert made.counts["ignored"] == 2 and made.size() == 0


def test_a_repeated_answer_is_committed_again_only_when_it_lasts_longer():
    made = learner()
    wire = answer("api.partner.example", ("api.partner.example.", 60, "A", "192.0.2.10"))
    assert len(made.learn(POD, wire, now=0)) == 1
    assert made.learn(POD, wire, now=0) == []
    assert [x.timeout for x in made.learn(POD, wire, now=30)] == [60]
    assert made.why("192.0.2.10", now=80) == [("KUBE-DNS-A", "api.partner.example", "api.partner.example")]
    assert made.why("192.0.2.10", now=91) == []


def test_tcp_segments_that_repeat_an_answer_milliseconds_apart_commit_its_addresses_once():
    """A TCP stream's segments (or a resolver asked again and again) repeat an answer a few
    milliseconds apart: its known addresses are not committed again until an answer moves
    their expiry later by more than a second."""
    made = learner()
    records = [("api.partner.example.", 60, "A", f"192.0.2.{i}") for i in range(1, 101)]
    wire = answer("api.partner.example", *records)
    segment = (len(wire).to_bytes(2, "big") + wire) * 3  # three messages in one segment
    assert len(made.learn(POD, segment, now=0.0, tcp=True)) == 100
    assert [made.learn(POD, segment, now=0.005 * i, tcp=True) for i in range(1, 200)] == [[]] * 199  # up to 0.995 s later
    assert len(made.learn(POD, segment, now=1.5, tcp=True)) == 100  # 1.5 s later: the elements last longer
    assert made.counts["learned"] == 200


def test_bounds_per_set_and_per_pod_drop_and_count():
    made = learner(per_set=2)
    wire = answer("api.partner.example", *[("api.partner.example.", 60, "A", f"192.0.2.{i}") for i in range(1, 5)])
    assert [x.address for x in made.learn(POD, wire, now=0)] == ["192.0.2.1", "192.0.2.2"]
    assert made.counts["dropped"] == 2
    made.expire(now=61)
    assert made.size() == 0
    per_pod = learner(per_pod=1)
    assert len(per_pod.learn(POD, wire, now=0)) == 1 and per_pod.counts["dropped"] == 3


def test_full_replace_readds_what_is_held_with_the_time_left():
    made = learner()
    made.learn(POD, answer("api.partner.example", ("api.partner.example.", 60, "A", "192.0.2.10")), now=0)
    assert [(x.set_name, x.address, x.timeout) for x in made.held(now=45.5)] == [("KUBE-DNS-A", "192.0.2.10", 15)]


@pytest.mark.parametrize("now", [0.2, 45.5, 59.9])
def test_a_full_replace_never_ends_an_element_before_the_learner_does(now):
    """The learner skips a repeated answer that its element outlives (a caching resolver's
    answer, its TTL counting down to the same end): the element a full replace re-adds must
    then live at least as long, or the pod's connection in the gap is refused."""
    made = learner(floor=1)
    wire = answer("api.partner.example", ("api.partner.example.", 60, "A", "192.0.2.10"))
    made.learn(POD, wire, now=0)
    [again] = made.held(now=now)
    assert now + again.timeout >= 60
    cached = answer("api.partner.example", ("api.partner.example.", 60 - int(now), "A", "192.0.2.10"))
    assert made.learn(POD, cached, now=int(now)) == []  # skipped: the kernel's element outlives it


def test_a_set_that_goes_forgets_its_addresses():
    made = learner()
    made.learn(POD, answer("api.partner.example", ("api.partner.example.", 60, "A", "192.0.2.10")), now=0)
    made.update([V6])
    assert made.size() == 0


def test_truncated_answers_teach_what_they_hold():
    got = learner().learn(POD, answer("api.partner.example", ("api.partner.example.", 60, "A", "192.0.2.10"), tc=True), now=0)
    assert [x.address for x in got] == ["192.0.2.10"]


def test_dns_over_tcp_reads_each_length_prefixed_message():
    one = answer("api.partner.example", ("api.partner.example.", 60, "A", "192.0.2.10"))
    two = answer("a.cdn.example", ("a.cdn.example.", 60, "A", "192.0.2.11"))
    segment = len(one).to_bytes(2, "big") + one + len(two).to_bytes(2, "big") + two
    assert [x.address for x in learner().learn(POD, segment, now=0, tcp=True)] == ["192.0.2.10", "192.0.2.11"]


def test_tcp_segments_without_data_are_no_message_and_count_nothing():
    """A DNS server's SYN-ACK, ACKs and FIN come from port 53 too (each is held): none is a DNS
    message, malformed or otherwise."""
    made = learner()
    assert made.learn(POD, b"", now=0, tcp=True) == []
    assert made.counts == dict.fromkeys(made.counts, 0)


@pytest.mark.parametrize("payload, tcp", [
    (b"", False), (b"\x00" * 3, False), (b"garbage that is not dns at all", False),
    (answer("api.partner.example", ("api.partner.example.", 60, "A", "192.0.2.10"))[:-3], False),  # cut mid-record
    (dns.message.make_query("api.partner.example", "A").to_wire(), False),  # a query, not an answer
    (b"\x00\x40" + b"\x00" * 10, True),  # a TCP message longer than its segment
])
def test_malformed_input_is_one_count_never_an_exception(payload, tcp):
    made = learner()
    assert made.learn(POD, payload, now=0, tcp=tcp) == []
    assert made.counts["malformed"] == 1


def test_domain_sets_of_a_cluster_name_their_clients_and_policies():
    pods = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": n, "namespace": ns, "labels": {"app": n}},
             "spec": {"nodeName": "node-1"}, "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}
            for n, ns, ip in (("client", "shop", POD), ("db", "other", OTHER_POD))]
    cnp = {"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": "partner"},
           "spec": {"tier": "Admin", "priority": 1, "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "shop"}}},
                    "egress": [{"action": "Accept", "to": [{"domainNames": ["api.partner.example"]}]}]}}
    cluster, errors = build_cluster(("test", obj) for obj in pods + [cnp])
    assert not errors
    [found] = domain_sets(cluster, ["ipv4"])
    assert (found.family, found.names, found.clients, found.policies) == ("ipv4", ("api.partner.example",), frozenset({POD}), ("partner",))
    assert found.name.startswith("KUBE-DNS-")


def test_adopted_addresses_are_held_until_they_expire_and_named_as_before_this_agent():
    made = learner()
    made.adopt("KUBE-DNS-A", "192.0.2.99", seconds_left=30, now=0)
    assert [(x.address, x.timeout) for x in made.held(now=10)] == [("192.0.2.99", 20)]
    assert made.why("192.0.2.99", now=10) == [("KUBE-DNS-A", "(before this agent)", "(before this agent)")]
    made.expire(now=31)
    assert made.size() == 0


def test_an_answer_to_a_pod_no_set_has_as_client_is_not_read_at_all():
    """Not even its question: a message that would be malformed costs the same nothing."""
    made = learner()
    assert made.learn(OTHER_POD, answer("api.partner.example", ("api.partner.example.", 60, "A", "192.0.2.10")), now=0) == []
    assert made.learn(OTHER_POD, b"\xff" * 40, now=0) == []
    assert made.counts["ignored"] == 2 and made.counts["malformed"] == 0 and made.decoded == 0


def test_an_answer_for_a_name_no_set_matches_costs_its_question_only():
    """Its records are never read: a record cut short after the question is not even seen."""
    made = learner()
    whole = answer("www.other.example", *[("www.other.example.", 60, "A", f"192.0.2.{i}") for i in range(1, 200)])
    assert made.learn(POD, whole[:-30], now=0) == []
    assert made.counts["ignored"] == 1 and made.counts["malformed"] == 0 and made.decoded == 0


def test_at_most_max_records_answer_records_are_read():
    made = DomainLearner(ttl_floor=5, ttl_cap=3600, max_per_set=1000, max_per_pod=1000, max_records=100)
    made.update([V4])
    wire = answer("n1.cdn.example", *[("n1.cdn.example.", 60, "A", f"192.0.{i >> 8}.{i & 255}") for i in range(250)])
    got = made.learn(POD, wire, now=0)
    assert [x.address for x in got] == [f"192.0.{i >> 8}.{i & 255}" for i in range(100)]
    assert made.counts["capped"] == 1 and made.decoded == 1
    assert made.learn(POD, wire[:-16 * 150 - 10], now=1) == []  # cut inside the 100th record: malformed, nothing learned
    assert made.counts["malformed"] == 1


def test_a_tcp_segment_of_many_messages_reads_the_questions_of_those_nobody_asked_for():
    """1,140 messages in one 64 KB segment, only the last for a name of the set."""
    made = learner()
    other = answer("www.other.example", ("www.other.example.", 60, "A", "192.0.2.1"))
    asked = answer("api.partner.example", ("api.partner.example.", 60, "A", "192.0.2.10"))
    segment = b"".join(len(w).to_bytes(2, "big") + w for w in [other] * 1139 + [asked])
    assert [x.address for x in made.learn(POD, segment, now=0, tcp=True)] == ["192.0.2.10"]
    assert made.counts["ignored"] == 1139 and made.decoded == 1


def test_expiry_forgets_the_earliest_first_and_keeps_what_a_later_answer_renewed():
    made = learner(floor=1)
    made.learn(POD, answer("api.partner.example", ("api.partner.example.", 10, "A", "192.0.2.10")), now=0)
    made.learn(POD, answer("n1.cdn.example", ("n1.cdn.example.", 20, "A", "192.0.2.11")), now=0)
    made.learn(POD, answer("api.partner.example", ("api.partner.example.", 10, "A", "192.0.2.10")), now=5)  # renewed to 15
    made.expire(now=12)
    assert made.size() == 2
    made.expire(now=15)
    assert made.size() == 1 and made.why("192.0.2.11", now=15)
    made.expire(now=20)
    assert made.size() == 0


def test_the_hold_marks_only_answers_on_connections_to_trusted_resolvers_and_counts_the_others():
    """--dns-learn-from in the hold chains: the asked address (conntrack's original destination)
    decides, before the pod's meter; a family without a trusted address only counts."""
    from nftpolicy.translators import transaction
    from nftpolicy.translators.domainnames import with_hold_marks
    from nftpolicy.translators.layout import Table
    from nftpolicy.translators.nfttext import transaction_text

    subjects = {"ipv4": frozenset({POD}), "ipv6": frozenset({"fd00:1::5"})}
    text = transaction_text(transaction.replacing(with_hold_marks(Table("nftpolicy", 0, (), (), ()), subjects, 0x800000, 200, 32,
                                                                  ("10.96.0.10/32", "10.0.2.0/24"))))
    forward = text.split("chain KUBE-DNS-HOLD-FORWARD {")[1].split("}\n")[0]
    rules = [line.strip().split(" comment ")[0] for line in forward.splitlines() if "th sport 53" in line]
    answers = "meta l4proto { udp, tcp } th sport 53"
    assert rules == [
        f"{answers} ip daddr @KUBE-DNS-SUBJECTS4 ct state established ct original ip daddr != {{ 10.96.0.10/32, 10.0.2.0/24 }} counter",
        f"{answers} ip daddr @KUBE-DNS-SUBJECTS4 ct state established ct original ip daddr {{ 10.96.0.10/32, 10.0.2.0/24 }} "
        "meter KUBE-DNS-HOLD-FORWARD-4 size 65535 { ip daddr limit rate 200/second burst 32 packets } meta mark set meta mark | 0x00800000",
        f"{answers} ip6 daddr @KUBE-DNS-SUBJECTS6 ct state established counter"]
    untrusting = transaction_text(transaction.replacing(with_hold_marks(Table("nftpolicy", 0, (), (), ()), subjects, 0x800000, 200, 32)))
    assert "ct original" not in untrusting and "counter" not in untrusting
