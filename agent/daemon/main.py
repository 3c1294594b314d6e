"""``nftpolicy agent``: wires the sources, the reconcile loop, health, metrics and signals together."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from importlib.metadata import version

from nftpolicy.translators.rules import Config
from nftpolicy.translators.objectcost import ObjectLimits

from nftpolicy.agent import interrupts
from .debughttp import start_debug
from .dnslearn import DomainLearner
from .domainlearning import DomainLearning
from .events import EventRecorder, KubeEventWriter
from .health import Health, health_routes, serve_http
from .kubeauth import DelegatedAuth
from .logs import setup_logging
from .metrics import Metrics
from nftpolicy.agent.dataplane.iptables import IptablesError
from nftpolicy.agent.dataplane.nftables import NftDataplane
from .podhold import PodHold, remove_pod_hold_chain
from .reconcile import HEARTBEAT, Reconciler
from .rulecounters import RuleCounters
from .serving import CertificateError, ServingCertificate
from .sources import KubeSource, ManifestsSource
from .store import Store

log = logging.getLogger("nftpolicy.agent")


def settings(args: argparse.Namespace, config: Config) -> str:
    """The effective value of every flag, as ``--flag=value`` words (defaults and the
    environment included; the ruleset flags as the :class:`Config` they built)."""
    values = {k: v for k, v in vars(args).items() if k != "command"}
    values.update(table=config.table, priority=config.priority, policy_mark=f"{config.policy_mark:#x}",
                  passed_mark=f"{config.passed_mark:#x}", pass_mark=f"{config.pass_mark:#x}", service_cidr=",".join(config.service_cidrs),
                  node_port_range="-".join(map(str, config.node_port_range or ())), external_cidr=",".join(config.external_cidrs))
    return " ".join(f"--{k.replace('_', '-')}={'' if v is None else v}" for k, v in sorted(values.items()))


def run_agent(args: argparse.Namespace, config: Config) -> int:
    """Run until SIGTERM or SIGINT; the ruleset stays in the kernel afterwards. Returns the exit
    code: 1 when the kernel lacks an nft feature we need or the HTTP address cannot be bound
    (after a signal, :func:`nftpolicy.agent.cli.main.main` exits with the signal's code instead)."""
    setup_logging(args.log_format, args.log_level)
    if args.dns_ttl_floor > args.dns_ttl_cap:
        log.error("--dns-ttl-floor (%d) must not exceed --dns-ttl-cap (%d)", args.dns_ttl_floor, args.dns_ttl_cap)
        return 2
    stop = threading.Event()
    metrics, health = Metrics(), Health(window=6 * HEARTBEAT)
    store = Store(metrics, ObjectLimits(args.max_object_rules, args.max_object_elements))

    def shutdown(signum: int) -> None:
        log.info("received %s, stopping; the ruleset stays in place", signal.Signals(signum).name)
        stop.set()
        store.changed.set()

    signals = interrupts.guard()
    signals.stop_with(shutdown)  # the watchdog bounds the way out (interrupts.GRACE)
    signals.handle_in_thread()  # before any other thread: a signal is acted on at once, whichever thread the kernel gives it
    health.supervise()  # a thread that dies from here on fails /healthz (the kubelet restarts the agent)
    tls = None
    if args.metrics_secure:
        try:
            tls = ServingCertificate(args.tls_cert_file or None, args.tls_private_key_file or None,
                                     [args.node, "localhost", "127.0.0.1", "::1"])
        except CertificateError as exc:
            log.error("--tls-cert-file: %s", exc)
            return 2
    guard = None
    # The sources start first: the lists (most of a restart at scale) run while the kernel's
    # nft features are probed, the learned DNS elements read and the HTTP server bound (together
    # 20-60 ms here); nothing is synced before the probe has passed.
    if args.manifests:
        ManifestsSource(store, args.manifests, stop).start()
        source = f"manifests {args.manifests}"
    else:
        kube = KubeSource(store, metrics, args.kubeconfig, args.api_timeout, args.watch_timeout, stop,
                          idle_timeout=args.watch_idle_timeout)
        guard = DelegatedAuth(kube.api, args.api_timeout, metrics) if args.metrics_secure else None
        events = EventRecorder(KubeEventWriter(kube.api, args.api_timeout), args.node, metrics, ready_nodes=store.ready_nodes)
        store.failed_closed, store.kernel_refused, kube.crd_missing = events.failed_closed, events.kernel_refused, events.crd_missing
        events.start(stop)
        kube.start()
        source = f"kubeconfig {args.kubeconfig}" if args.kubeconfig else "in-cluster API"
    dataplane = NftDataplane(config.table, args.netns)
    missing = dataplane.missing_features()
    if missing:
        stop.set()
        for feature in missing:
            log.error("nftables feature missing: %s", feature)
        log.error("this kernel or libnftables cannot run nftpolicy; nothing was changed")
        return 1
    learner = DomainLearner(args.dns_ttl_floor, args.dns_ttl_cap, args.dns_max_per_set, args.dns_max_per_pod, args.dns_max_records)
    learning = DomainLearning(learner, dataplane.add_timed_elements, metrics, args.dns_hold, args.dns_queue, args.netns,
                              budget=args.dns_pod_budget, mark=args.dns_hold_mark, rate=args.dns_pod_rate,
                              change_elements=dataplane.change_elements, learn_from=args.dns_learn_from)
    learning.adopt(dataplane.timed_elements())  # a restart keeps what the agent before it learned
    hold = start_pod_hold(config, args, metrics)
    reconciler = Reconciler(store, config, args.node, metrics, health, args.min_sync_interval, args.resync_interval, dataplane,
                            learning=learning, hold=hold)
    counters = RuleCounters(dataplane, reconciler.chain_owners, args.counters_interval)
    metrics.registry.register(counters)  # scrapes are served from its last read
    counters.start(stop)
    health.unlisted = store.unlisted
    try:
        server = serve_http(args.http_address, metrics, health, tls=tls, guard=guard)
    except OSError as exc:
        stop.set()
        log.error("cannot serve HTTP on %s: %s", args.http_address, exc)
        return 1

    log.info("nftpolicy %s agent for node %s: source %s, table inet %s, %s %s:%d; settings: %s", version("nftpolicy"),
             args.node, source, config.table, "https" if tls else "http", *server.server_address[:2], settings(args, config))
    if hold is not None:  # after the start-up line, which stays the log's first
        log.info("holding unknown pods' packets for up to %.1f s (nfqueue %d)", args.unknown_pod_hold, args.unknown_pod_queue)
    debug = None
    try:  # a debugging aid: enforcement goes on without it
        debug = start_debug(args.debug_address, reconciler, health_routes(metrics, health)) if args.debug_address else None
    except OSError as exc:
        log.warning("no debug endpoint: cannot serve %s: %s", args.debug_address, exc)
    reconciler.run(stop)
    learning.close()
    if hold is not None:
        hold.close(remove_chain=False)  # while no agent reads the queue, the kernel drops what it would hold
    server.shutdown()
    if debug is not None:
        debug.shutdown()
    return 0


def start_pod_hold(config: Config, args: argparse.Namespace, metrics: Metrics) -> PodHold | None:
    """The hold of unknown pods' packets with ``--unknown-pods hold`` (started: it reads before
    the first sync, which releases what the table's known pods let through), else None, after
    removing a hold chain an earlier agent left (nobody would read its queue). A hold that cannot
    start is one error line: our released chains drop what the base chains mark for it, so
    unknown pods' packets are dropped, never let through."""
    if config.unknown_pods != "hold":
        if remove_pod_hold_chain(args.netns):
            log.info("removed the hold chain of unknown pods' packets that an earlier agent left: --unknown-pods %s", config.unknown_pods)
        return None
    hold = PodHold(config, args.unknown_pod_queue, args.unknown_pod_hold, metrics, netns_name=args.netns, max_held=args.unknown_pod_max_held)
    try:
        hold.start()
    except (IptablesError, OSError) as exc:
        hold.close(remove_chain=False)
        log.error("cannot hold unknown pods' packets (nfqueue %d): %s; they are dropped until an agent holds them",
                  args.unknown_pod_queue, " ".join(str(exc).split()))
        return None
    return hold
