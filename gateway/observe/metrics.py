"""The gateway's Prometheus metrics and the /metrics view over gateway + workers.

When PROMETHEUS_MULTIPROC_DIR is set (``python -m gateway`` sets it before anything imports
prometheus_client), every worker process writes its metrics there and /metrics shows the
gateway's own registry followed by the merged worker files. The gateway's own series stay in
its memory (``keep_series_in_memory``): it is one process, and a file-backed increment (a
lock, a pid check, packing two doubles into the shared file) cost about ten times an
in-memory one, about ten of them per request.

Every series carries a ``model`` label (the one model this gateway serves), so one Prometheus
can watch several gateways and the dashboard can pick one. No series carries a session id:
what the session table knows is exported as bounded aggregates (``LiveStateCollector``).

docs/metrics.md describes every metric; tests/e2e/test_observability.py checks it stays complete.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.core import GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from policies import PolicyConfig, SessionState, tested_drafts
from workers.api.prometheus import use_cached_pid

use_cached_pid()  # before any metric exists (see there)


def keep_series_in_memory() -> None:
    """The gateway process's own series as plain in-memory values, before any is created.

    Only the workers write multiprocess files (they inherit PROMETHEUS_MULTIPROC_DIR); the
    gateway serves its own registry from memory beside them (``exposition``). No ``_created``
    series: the merged files never had them, so /metrics keeps the same families.
    """
    values.ValueClass = values.MutexValue
    disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
# Why a step report was clamped (gateway.admission.checked_step).
CLAMP_REASONS = ("negative", "accepted_over_proposed")
# Upper bounds of the per-session acceptance histogram: fixed, so its cardinality is too.
ACCEPTANCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)


@dataclass(frozen=True)
class GatewayMetrics:
    model: str
    registry: CollectorRegistry
    requests: Counter
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_latency: Histogram
    tokens: Counter
    sessions: Gauge
    decisions: Counter
    tree_decisions: Counter
    routes: Counter
    method_decisions: Counter
    method_steps: Counter
    method_drafts: Counter
    method_shadow_drafts: Counter
    fallbacks: Counter
    mode_switches: Counter
    policy_reloads: Counter
    worker_restarts: Counter
    worker_up: Gauge
    worker_in_flight: Gauge
    drafted_by_position: Counter
    accepted_by_position: Counter
    tested_drafts: Counter
    clamped_step_reports: Counter
    # Collectors computed at scrape from live state; kept apart from the multiprocess files,
    # which hold only what processes wrote.
    live: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))
    # Labelled series the relay touches per chunk, looked up once: prometheus_client's labels()
    # takes a lock and builds a key on every call. Keys are bounded (modes, workers x positions).
    _series: dict[tuple[int, tuple[str, ...]], Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def create(cls, model: str, registry: CollectorRegistry | None = None) -> GatewayMetrics:
        # Its own registry by default: not the process-wide one, whose process and GC collectors
        # /metrics never showed.
        reg = registry if registry is not None else CollectorRegistry()

        def labels(*names: str) -> list[str]:
            return ["model", *names]

        return cls(
            model=model,
            registry=reg,
            requests=Counter("specgate_requests", "HTTP requests by route and status", labels("route", "status"),
                             registry=reg),
            time_to_first_token=Histogram("specgate_time_to_first_token_seconds", "Time to first token",
                                          labels("mode"), buckets=LATENCY_BUCKETS, registry=reg),
            inter_token_latency=Histogram("specgate_inter_token_latency_seconds",
                                          "Gap between streamed chunks, per token", labels("mode"),
                                          buckets=TOKEN_GAP_BUCKETS, registry=reg),
            e2e_latency=Histogram("specgate_e2e_latency_seconds", "Request latency end to end", labels("route"),
                                  buckets=LATENCY_BUCKETS, registry=reg),
            tokens=Counter("specgate_tokens", "Completion tokens by decoding mode", labels("mode"), registry=reg),
            sessions=Gauge("specgate_sessions", "Sessions in the table by current mode", labels("mode"),
                           multiprocess_mode="livemax", registry=reg),
            decisions=Counter("specgate_decisions", "Policy decisions", labels("mode", "reason"), registry=reg),
            tree_decisions=Counter("specgate_speculation_shapes", "Decisions to speculate by what is drafted: "
                                   "chain, or a token tree's shape (policy.tree_shapes: at most 8)", labels("shape"),
                                   registry=reg),
            routes=Counter("specgate_routes", "Requests placed on a worker, by why that worker: sticky (the "
                           "session's own), prefix (an expected prefix hit won the score), load (least loaded, "
                           "or the load guard) or method (to a batch that runs the session's kind of step)",
                           labels("reason"), registry=reg),
            method_decisions=Counter("specgate_method_decisions", "Decisions to speculate by method, where sessions "
                                     "choose one (policy.methods)", labels("method", "reason"), registry=reg),
            method_steps=Counter("specgate_method_steps", "Engine steps of requests speculating with a method "
                                 "(a lookup step that found nothing to propose included)", labels("method"),
                                 registry=reg),
            method_drafts=Counter("specgate_method_drafts", "Drafts by method: proposed, tested (accepted plus the "
                                  "first rejected) and accepted", labels("method", "count"), registry=reg),
            method_shadow_drafts=Counter("specgate_method_shadow_drafts",
                                         "Shadow evidence by lookup method: what the requests that ran another method "
                                         "would have got from it (replayed by the worker); count: steps, proposed, "
                                         "tested, accepted", labels("method", "count"), registry=reg),
            fallbacks=Counter("specgate_fallbacks", "Decisions to decode plain, by reason", labels("reason"),
                              registry=reg),
            mode_switches=Counter("specgate_mode_switches", "Session mode changes", labels("to", "reason"),
                                  registry=reg),
            policy_reloads=Counter("specgate_policy_reloads", "Policy reloads", labels("source", "result"),
                                   registry=reg),
            worker_restarts=Counter("specgate_worker_restarts", "Worker process restarts", labels("worker"),
                                    registry=reg),
            worker_up=Gauge("specgate_worker_up", "1 when the worker is ready", labels("worker"),
                            multiprocess_mode="livemax", registry=reg),
            worker_in_flight=Gauge("specgate_worker_in_flight", "Requests the gateway has in flight on a worker",
                                   labels("worker"), multiprocess_mode="livemax", registry=reg),
            drafted_by_position=Counter("specgate_spec_decode_drafted_by_position",
                                        "Draft tokens proposed at each position of a speculative step",
                                        labels("worker", "position"), registry=reg),
            accepted_by_position=Counter("specgate_spec_decode_accepted_by_position",
                                         "Draft tokens accepted at each position of a speculative step",
                                         labels("worker", "position"), registry=reg),
            tested_drafts=Counter("specgate_spec_decode_tested_drafts",
                                  "Draft tokens tested: the accepted ones and each step's first rejected one "
                                  "(accepted / tested is the per-draft acceptance the policy's floor reads)",
                                  labels("worker"), registry=reg),
            clamped_step_reports=Counter("specgate_step_reports_clamped",
                                         "Worker step reports whose draft counts no worker could mean, clamped "
                                         "before they reached an estimate", labels("reason"), registry=reg),
        )

    def __post_init__(self) -> None:
        for reason in CLAMP_REASONS:  # exported at 0, so an alert's rate() has a series before the first
            self.series(self.clamped_step_reports, reason)

    def series(self, metric: Counter | Histogram, *values: str) -> Any:
        """``metric.labels(model, *values)``, cached."""
        key = (id(metric), values)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = metric.labels(self.model, *values)
        return child

    def record_method_step(self, method: str, proposed: int, accepted: int) -> None:
        """One step of a request speculating with ``method`` (chosen among ``policy.methods``)."""
        self.series(self.method_steps, method).inc()
        if proposed > 0:
            accepted = max(0, min(accepted, proposed))
            self.series(self.method_drafts, method, "proposed").inc(proposed)
            self.series(self.method_drafts, method, "tested").inc(tested_drafts(proposed, accepted))
            self.series(self.method_drafts, method, "accepted").inc(accepted)

    def record_shadow(self, method: str, steps: list[tuple[int, int]]) -> None:
        """One request's shadow steps of ``method`` (``gateway.admission._account_shadow``)."""
        self.series(self.method_shadow_drafts, method, "steps").inc(len(steps))
        for count, value in (("proposed", sum(p for p, _ in steps)), ("accepted", sum(a for _, a in steps)),
                             ("tested", sum(tested_drafts(p, a) for p, a in steps if p > 0))):
            self.series(self.method_shadow_drafts, method, count).inc(value)

    def clamped_report(self, reason: str) -> None:
        """One step report (or late-step group) clamped for ``reason`` (``gateway.admission.checked_step``)."""
        self.series(self.clamped_step_reports, reason).inc()

    def record_steps(self, worker: str, proposed: int, accepted: int, count: int = 1) -> None:
        """``count`` speculative steps that each drafted ``proposed`` and accepted ``accepted``.

        A step that accepted n drafts accepted positions 1..n (acceptance stops at the first
        rejection), so per-position counts follow from the step report alone, for every engine.
        Positions run to K, which the policy caps at 16 (a fixed-mode worker: its max_k).
        """
        if proposed <= 0 or count <= 0:
            return
        accepted = max(0, min(accepted, proposed))
        self.series(self.tested_drafts, worker).inc(count * tested_drafts(proposed, accepted))
        for position in range(1, proposed + 1):
            label = str(position)
            self.series(self.drafted_by_position, worker, label).inc(count)
            if position <= accepted:
                self.series(self.accepted_by_position, worker, label).inc(count)

    @staticmethod
    def observe_many(child: Any, amount: float, n: int) -> None:
        """``n`` observations of ``amount`` in a histogram series: a span of n tokens shares one
        gap (a coalesced chunk's 63 were 63 observations, two multiprocess-file writes each).

        prometheus_client has no weighted observe: this adds n to the one bucket and n x amount
        to the sum, as n ``observe`` calls would (tests/unit/test_gateway_units.py holds it to that);
        a client without those attributes gets the n calls.
        """
        if n > 1:  # one token a chunk (a plain stream) is the hot case: no lookups for it
            buckets, total, bounds = (getattr(child, name, None) for name in ("_buckets", "_sum", "_upper_bounds"))
            if buckets is not None and total is not None and bounds is not None:
                total.inc(amount * n)
                for i, bound in enumerate(bounds):
                    if amount <= bound:
                        buckets[i].inc(n)
                        return
        for _ in range(n):
            child.observe(amount)

    def exposition(self) -> bytes:
        """The gateway's own series, then every worker's (merged from their files), then the live state."""
        own, live = bytes(generate_latest(self.registry)), bytes(generate_latest(self.live))
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)
            return own + bytes(generate_latest(merged)) + live
        return own + live


class LiveStateCollector(Collector):
    """The live policy's thresholds and the sessions' acceptance, computed at every scrape.

    Thresholds come from the policy in force when Prometheus scrapes, so a reload shows up at
    the next scrape and dashboards draw the floor and the ``max_batch`` line the policy uses.
    Sessions are summarised in fixed buckets (never one series per session): only sessions
    with at least ``min_proposals`` tested drafts count, the evidence the policy itself needs
    before the acceptance rule may act on a session.
    """

    def __init__(self, model: str, policy: Callable[[], PolicyConfig],
                 sessions: Callable[[], Iterable[SessionState]]) -> None:
        self.model = model
        self.policy = policy
        self.sessions = sessions

    def collect(self) -> Iterator[Metric]:
        policy = self.policy()
        thresholds = GaugeMetricFamily("specgate_policy_threshold", "The live policy's settings, by config.yaml name",
                                       labels=["model", "name"])
        for name, value in policy.as_dict().items():
            if isinstance(value, int | float):  # num_speculative_tokens "auto" is no number: no series
                thresholds.add_metric([self.model, name], float(value))
        yield thresholds

        counts = [0] * len(ACCEPTANCE_BUCKETS)
        judged = below = 0
        total = 0.0
        for state in self.sessions():
            estimate = state.acceptance_estimate
            if estimate is None or state.proposals_seen < policy.min_proposals:
                continue
            judged += 1
            total += estimate
            below += estimate < policy.acceptance_floor
            for i, bound in enumerate(ACCEPTANCE_BUCKETS):
                if estimate <= bound:
                    counts[i] += 1
        histogram = GaugeHistogramMetricFamily(
            "specgate_session_acceptance",
            "Sessions (with min_proposals tested drafts) by acceptance estimate, now", labels=["model"])
        histogram.add_metric([self.model], [(str(b), float(c)) for b, c in zip(ACCEPTANCE_BUCKETS, counts, strict=True)]
                             + [("+Inf", float(judged))], gsum_value=total)
        yield histogram
        yield _gauge("specgate_sessions_below_acceptance_floor",
                     "Sessions (with min_proposals tested drafts) whose estimate is below acceptance_floor",
                     self.model, below)


def _gauge(name: str, documentation: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["model"])
    family.add_metric([model], value)
    return family
