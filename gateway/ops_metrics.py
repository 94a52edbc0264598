"""Gateway counters for resilience and access: retries, migrations, drain, key reloads.

Kept apart from gateway/metrics.py's dashboard metrics; registered in the same registry, so
``/metrics`` shows them all.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge


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
            # gateway/session_store.py. "reason", not the operation: the kind of failure says whether
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
