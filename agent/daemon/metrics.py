"""The agent's Prometheus metrics.

Metric names follow Prometheus conventions (``_seconds``, ``_total`` added by the client for
counters); every metric lives in the agent's own registry.
"""

from __future__ import annotations

from importlib.metadata import version

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
SIZE_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 5000, 10000, 50000)


class Metrics:
    """Every metric the agent exports (issue "The agent", section Operations)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.sync_duration = Histogram("nftpolicy_sync_duration_seconds", "Render plus commit time of one sync, by mode (full, incremental).",
                                       ["mode"], registry=r, buckets=LATENCY_BUCKETS)
        self.sync_failures = Counter("nftpolicy_sync_failures", "Syncs whose transaction the kernel refused, by mode.", ["mode"], registry=r)
        for mode in ("full", "incremental"):  # at 0 from the start: increase() sees the first failure too
            self.sync_failures.labels(mode)
        self.transaction_commands = Histogram("nftpolicy_transaction_commands", "Commands in one committed transaction, by mode.",
                                              ["mode"], registry=r, buckets=SIZE_BUCKETS)
        self.event_to_kernel = Histogram("nftpolicy_event_to_kernel_seconds", "From receiving an object change to committing it to the kernel.",
                                         registry=r, buckets=LATENCY_BUCKETS)
        self.api_errors = Counter("nftpolicy_api_errors", "Kubernetes API errors, by kind and reason.", ["kind", "reason"], registry=r)
        self.api_retries = Counter("nftpolicy_api_retries", "Kubernetes API retries after backoff, by kind and reason.", ["kind", "reason"], registry=r)
        self.api_access_denied = Gauge(
            "nftpolicy_api_access_denied",
            "1 while the API server refuses (401 or 403) this agent's requests to list or watch a kind (retried with backoff), else 0.",
            ["kind", "verb"], registry=r)
        self.http_auth = Counter(
            "nftpolicy_http_auth", "Requests for a path behind --metrics-secure, by result: allowed, unauthenticated (401: no or a bad "
            "token), forbidden (403: the SubjectAccessReview said no), error (503: the API server could not be asked), "
            "rate_limited (429: too many tokens to check at once).", ["result"], registry=r)
        for result in ("allowed", "unauthenticated", "forbidden", "error", "rate_limited"):
            self.http_auth.labels(result)
        self.watch_seconds_since_success = Gauge(
            "nftpolicy_watch_seconds_since_success",
            "Seconds since the last successful API response for a kind (0 while its watch is open): alert when it grows.",
            ["kind"], registry=r)
        self.watched_objects = Gauge("nftpolicy_watched_objects", "Objects held in memory, by kind.", ["kind"], registry=r)
        self.invalid_objects = Gauge("nftpolicy_invalid_objects", "Objects that failed validation (skipped, or failing closed for policies).",
                                     ["kind"], registry=r)
        self.over_limit_objects = Gauge("nftpolicy_over_limit_objects", "Policies beyond a per-object cap (--max-object-rules, "
                                        "--max-object-elements), enforced fail-closed, by kind and cap.", ["kind", "limit"], registry=r)
        self.refused_objects = Gauge("nftpolicy_refused_objects", "Policies whose rules the kernel refused, enforced fail-closed "
                                     "until they change, by kind.", ["kind"], registry=r)
        for kind in ("NetworkPolicy", "ClusterNetworkPolicy"):
            self.refused_objects.labels(kind)
        self.events = Counter("nftpolicy_events", "Kubernetes Events on objects the agent fails closed on, by result (created, patched; "
                              "failed: the write failed; rate_limited, queue_full: dropped).", ["result"], registry=r)
        self.table_objects = Gauge("nftpolicy_table_objects", "Objects in our nftables table, by type (chains, rules, sets, elements).",
                                   ["type"], registry=r)
        self.last_success = Gauge("nftpolicy_last_successful_sync_timestamp_seconds", "Unix time of the last committed sync.", registry=r)
        self.table_generation = Gauge("nftpolicy_table_generation",
                                      "Transactions committed to our table since the agent started: it grows by one per sync.", registry=r)
        self.dns_answers = Counter(
            "nftpolicy_dns_answers", "DNS answers to pods read for domainNames peers, by result: learned and dropped (over the per-set or "
            "per-pod bound) count addresses; ignored (no policy name or pod), empty (no address), malformed and capped (more answer "
            "records than --dns-max-records, the rest unread) count messages; untrusted: queued without the mark our table sets on "
            "trusted answers to subjects (let through unread).",
            ["result"], registry=r)
        for result in ("learned", "dropped", "ignored", "empty", "malformed", "capped", "untrusted"):
            self.dns_answers.labels(result)
        self.dns_over_budget = Counter("nftpolicy_dns_over_budget", "DNS answers let through unheld and unread because their pod had "
                                       "--dns-pod-budget answers waiting in the hold (what they teach is not learned).", registry=r)
        self.dns_learned_elements = Gauge("nftpolicy_dns_learned_elements", "Addresses learned from DNS answers that have not expired.",
                                          registry=r)
        self.dns_hold_seconds = Histogram("nftpolicy_dns_hold_seconds",
                                          "How long a held DNS answer waited for what it teaches to be committed (learn plus commit).",
                                          registry=r, buckets=LATENCY_BUCKETS)
        self.unknown_pod_packets = Counter(
            "nftpolicy_unknown_pod_packets", "Packets from (egress) or to (ingress) an address of the node's pod CIDRs that is no pod "
            "programmed yet, by direction and result: held (queued), released (once the pod was programmed: they walked its rules), "
            "dropped (still unknown after --unknown-pod-hold), over_limit (dropped at once: --unknown-pod-max-held packets waited "
            "for its address already).", ["direction", "result"], registry=r)
        for direction in ("ingress", "egress"):
            for result in ("held", "released", "dropped", "over_limit"):
                self.unknown_pod_packets.labels(direction, result)
        self.unknown_pod_hold_seconds = Histogram("nftpolicy_unknown_pod_hold_seconds",
                                                  "How long a released packet of an unknown pod waited for the pod to be programmed.",
                                                  registry=r, buckets=LATENCY_BUCKETS)
        self.build_info = Info("nftpolicy_build", "The agent's version.", registry=r)
        self.build_info.info({"version": version("nftpolicy")})
