"""Gateway counters for resilience and access: retries, migrations, drain, key reloads, and
requests waiting for a ready worker.

Kept apart from gateway/observe/metrics.py's dashboard metrics; registered in the same registry, so
``/metrics`` shows them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(frozen=True)
class OpsMetrics:
    retries: Counter
    migrations: Counter
    migrations_abandoned: Counter
    auth_reloads: Counter
    draining: Gauge
    shutdown_refusals: Counter
    state_backend_errors: Counter
    state_backend_up: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> OpsMetrics:
        metrics = cls(
            retries=Counter("specgate_retries", "Requests re-sent to another worker before their first chunk",
                            registry=registry),
            migrations=Counter("specgate_migrations", "Generations resumed on another worker after theirs died "
                               "mid-way", registry=registry),
            migrations_abandoned=Counter("specgate_migrations_abandoned", "Generations that could not be resumed "
                                         "(no worker, too many migrations, shutdown)", ["reason"], registry=registry),
            auth_reloads=Counter("specgate_auth_reloads", "API key reloads", ["source", "result"], registry=registry),
            draining=Gauge("specgate_draining", "1 while the gateway drains for shutdown",
                           multiprocess_mode="livemax", registry=registry),
            shutdown_refusals=Counter("specgate_shutdown_refusals", "Requests refused or ended because the gateway "
                                      "is shutting down", registry=registry),
            # gateway/sessions/store.py. "reason", not the operation: the kind of failure says whether
            # Redis is slow (timeout), gone (error) or holds values this schema cannot read (corrupt).
            state_backend_errors=Counter("specgate_state_backend_errors", "Session state backend (redis) calls that "
                                         "failed, by kind; the request was served from local state",
                                         ["reason"], registry=registry),
            state_backend_up=Gauge("specgate_state_backend_up", "0 while the session state backend is failing "
                                   "(served from local state); 1 otherwise, and always with the memory backend",
                                   multiprocess_mode="livemax", registry=registry),
        )
        # At zero from the start, so rate() and the dashboard see the series before the first reload.
        for source in ("file", "sighup"):
            for result in ("ok", "failed"):
                metrics.auth_reloads.labels(source=source, result=result)
        for reason in ("timeout", "error", "corrupt"):
            metrics.state_backend_errors.labels(reason=reason)
        metrics.state_backend_up.set(1)  # up until a call fails (the memory backend never does)
        return metrics


OPS_KEY = web.AppKey("ops_metrics", OpsMetrics)

# How a request that found no worker ready ended its wait (gateway/admission.py ``pick_ready``):
# a worker took it; ``server.admission_wait_s`` passed; the wait queue was full
# (``server.admission_queue``: refused at once, not waited); its client left; its task was
# cancelled (the drain deadline, or an endpoint-picker caller that left).
WaitResult = Literal["served", "timeout", "queue_full", "client_gone", "cancelled"]
WAIT_RESULTS: tuple[WaitResult, ...] = ("served", "timeout", "queue_full", "client_gone", "cancelled")
WAIT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class AdmissionWaitMetrics:
    """Requests that waited for a ready worker; created with the fleet, which holds the wait."""

    waits: Counter
    wait_seconds: Histogram
    waiting: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> AdmissionWaitMetrics:
        metrics = cls(
            waits=Counter("specgate_admission_waits", "Requests that found no worker ready, by how their wait "
                          "ended", ["result"], registry=registry),
            wait_seconds=Histogram("specgate_admission_wait_seconds", "How long requests waited for a ready "
                                   "worker (queue_full: not waited, not observed)", buckets=WAIT_BUCKETS_S,
                                   registry=registry),
            waiting=Gauge("specgate_admission_waiting", "Requests waiting for a ready worker now",
                          multiprocess_mode="livesum", registry=registry),
        )
        for result in WAIT_RESULTS:  # at zero from the start
            metrics.waits.labels(result=result)
        return metrics

    def record(self, result: WaitResult, waited_s: float | None) -> None:
        self.waits.labels(result=result).inc()
        if waited_s is not None:
            self.wait_seconds.observe(waited_s)
