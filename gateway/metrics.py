"""The gateway's Prometheus metrics and the /metrics view over gateway + workers.

When PROMETHEUS_MULTIPROC_DIR is set (``python -m gateway`` sets it before anything imports
prometheus_client), every worker process writes its metrics there too and /metrics merges
them all; otherwise /metrics shows the given registry alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class GatewayMetrics:
    registry: CollectorRegistry
    requests: Counter
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_latency: Histogram
    tokens: Counter
    sessions: Gauge
    decisions: Counter
    fallbacks: Counter
    mode_switches: Counter
    policy_reloads: Counter
    worker_restarts: Counter
    worker_up: Gauge
    worker_in_flight: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> GatewayMetrics:
        reg = registry if registry is not None else REGISTRY
        return cls(
            registry=reg,
            requests=Counter("specgate_requests", "HTTP requests by route and status", ["route", "status"],
                             registry=reg),
            time_to_first_token=Histogram("specgate_time_to_first_token_seconds", "Time to first token", ["mode"],
                                          buckets=LATENCY_BUCKETS, registry=reg),
            inter_token_latency=Histogram("specgate_inter_token_latency_seconds",
                                          "Gap between streamed chunks, per token", ["mode"],
                                          buckets=TOKEN_GAP_BUCKETS, registry=reg),
            e2e_latency=Histogram("specgate_e2e_latency_seconds", "Request latency end to end", ["route"],
                                  buckets=LATENCY_BUCKETS, registry=reg),
            tokens=Counter("specgate_tokens", "Completion tokens by decoding mode", ["mode"], registry=reg),
            sessions=Gauge("specgate_sessions", "Sessions in the table by current mode", ["mode"],
                           multiprocess_mode="livemax", registry=reg),
            decisions=Counter("specgate_decisions", "Policy decisions", ["mode", "reason"], registry=reg),
            fallbacks=Counter("specgate_fallbacks", "Decisions to decode plain, by reason", ["reason"], registry=reg),
            mode_switches=Counter("specgate_mode_switches", "Session mode changes", ["to", "reason"], registry=reg),
            policy_reloads=Counter("specgate_policy_reloads", "Policy reloads", ["source", "result"], registry=reg),
            worker_restarts=Counter("specgate_worker_restarts", "Worker process restarts", ["worker"], registry=reg),
            worker_up=Gauge("specgate_worker_up", "1 when the worker is ready", ["worker"],
                            multiprocess_mode="livemax", registry=reg),
            worker_in_flight=Gauge("specgate_worker_in_flight", "Requests the gateway has in flight on a worker",
                                   ["worker"], multiprocess_mode="livemax", registry=reg),
        )

    def exposition(self) -> bytes:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)
            return bytes(generate_latest(merged))
        return bytes(generate_latest(self.registry))
