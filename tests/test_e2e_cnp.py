"""How .ci/e2e reads the ClusterNetworkPolicy conformance suite's log (tests/e2e_cnp.py): each
test and sub-test with its state, the suite's messages about the probes that failed, and the
cause of a failure, ``sctp`` only when the probe could not open an SCTP socket."""

from __future__ import annotations

from .e2e_cnp import parse

# The shape of a `cnp-conformance.test -test.v` log (conformance/utils/kubernetes/helper.go's
# messages; agnhost connect's "OTHER: protocol not supported" where the kernel has no SCTP).
LOG = """=== RUN   TestConformance
=== RUN   TestConformance/CNPAdminTierIngressSCTP
=== RUN   TestConformance/CNPAdminTierIngressSCTP/Should_support_an_'allow-ingress'_policy_for_SCTP_protocol
    helper.go:96: FAILED Command was [/agnhost connect --timeout=3s --protocol=sctp 10.244.2.5:9003]
    helper.go:97: Expected connection to succeed from network-policy-conformance-ravenclaw/luna-lovegood-0 to 10.244.2.5, but instead it miserably failed. stderr: OTHER: protocol not supported
=== RUN   TestConformance/CNPAdminTierIngressSCTP/Should_support_an_'allow-ingress'_policy_for_TCP
=== RUN   TestConformance/CNPAdminTierIngressTCP
=== RUN   TestConformance/CNPAdminTierIngressTCP/Should_support_a_'deny-ingress'_policy_for_TCP_protocol
    helper.go:110: Expected connection to be dropped from network-policy-conformance-ravenclaw/luna-lovegood-0 to 10.244.2.5, but instead it returned a different status: REFUSED
=== RUN   TestConformance/CNPAdminTierIngressUDP
=== RUN   TestConformance/CNPAdminTierIngressUDP/Should_support_a_'deny-ingress'_policy_for_UDP_protocol
    helper.go:97: Expected connection to succeed from network-policy-conformance-ravenclaw/luna-lovegood-0 to fd00:244:0:2::5, but instead it miserably failed. stderr: TIMEOUT
    --- FAIL: TestConformance/CNPAdminTierIngressSCTP/Should_support_an_'allow-ingress'_policy_for_SCTP_protocol (10.52s)
    --- PASS: TestConformance/CNPAdminTierIngressSCTP/Should_support_an_'allow-ingress'_policy_for_TCP (1.02s)
    --- FAIL: TestConformance/CNPAdminTierIngressSCTP (12.10s)
    --- FAIL: TestConformance/CNPAdminTierIngressTCP/Should_support_a_'deny-ingress'_policy_for_TCP_protocol (10.40s)
    --- FAIL: TestConformance/CNPAdminTierIngressTCP (10.90s)
    --- FAIL: TestConformance/CNPAdminTierIngressUDP/Should_support_a_'deny-ingress'_policy_for_UDP_protocol (10.40s)
    --- FAIL: TestConformance/CNPAdminTierIngressUDP (10.90s)
--- FAIL: TestConformance (95.00s)
"""


def test_each_sub_test_gets_its_state_and_the_cause_of_its_last_failed_probe():
    found = {t["name"]: t for t in parse(LOG)}
    sctp = found["CNPAdminTierIngressSCTP/Should_support_an_'allow-ingress'_policy_for_SCTP_protocol"]
    assert (sctp["state"], sctp["cause"], sctp["seconds"]) == ("failed", "sctp", 10.52)
    assert sctp["probes"] == ["Expected connection to succeed from network-policy-conformance-ravenclaw/luna-lovegood-0 to "
                              "10.244.2.5, but instead it miserably failed. stderr: OTHER: protocol not supported"]
    assert found["CNPAdminTierIngressSCTP/Should_support_an_'allow-ingress'_policy_for_TCP"]["state"] == "passed"
    assert found["CNPAdminTierIngressTCP/Should_support_a_'deny-ingress'_policy_for_TCP_protocol"]["cause"] == "reject"
    assert found["CNPAdminTierIngressUDP/Should_support_a_'deny-ingress'_policy_for_UDP_protocol"]["cause"] == "verdict"
    assert [t["state"] for t in found.values() if "/" not in t["name"]] == ["failed", "failed", "failed"]
    assert "TestConformance" not in found
