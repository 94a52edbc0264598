"""A worker's Prometheus metrics, under the names operators already chart for vLLM.

Under the gateway, workers run with PROMETHEUS_MULTIPROC_DIR set (prometheus_client's
multiprocess mode), so the gateway's /metrics covers every worker; gauges use ``livemax``
so a restarted worker's dead process drops out.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from workers.api.generation import ShadowSteps
from workers.api.prometheus import use_cached_pid

use_cached_pid()  # before any metric exists (see there)


@dataclass(frozen=True)
class WorkerMetrics:
    draft_tokens: Counter
    accepted_tokens: Counter
    acceptance_rate: Gauge
    verification_ms: Gauge
    batch_depth: Gauge
    queue_length: Gauge
    step_seconds: Histogram
    prefix_cache_requests: Counter
    prefix_cached_tokens: Counter
    prefix_cache_bytes: Gauge
    shadow_drafts: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None) -> WorkerMetrics:
        reg = registry if registry is not None else REGISTRY
        # ``model`` (not vLLM's ``model_name``): the label every specgate series carries.
        labels = ["model", "worker"]
        return cls(
            draft_tokens=Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", labels, registry=reg),
            accepted_tokens=Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels,
                                    registry=reg),
            acceptance_rate=Gauge("vllm:spec_decode_draft_acceptance_rate",
                                  "Accepted / proposed draft tokens since the worker started", labels,
                                  multiprocess_mode="livemax", registry=reg),
            verification_ms=Gauge("vllm:spec_decode_mean_verification_time_ms",
                                  "Mean time of the target's verification forward per step", labels,
                                  multiprocess_mode="livemax", registry=reg),
            batch_depth=Gauge("specgate_worker_batch_depth", "Sequences running in the worker's batch", labels,
                              multiprocess_mode="livemax", registry=reg),
            queue_length=Gauge("specgate_worker_queue_length", "Sequences waiting for a batch slot", labels,
                               multiprocess_mode="livemax", registry=reg),
            step_seconds=Histogram("specgate_worker_step_seconds", "Wall time of one engine step", labels,
                                   buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
                                   registry=reg),
            prefix_cache_requests=Counter("specgate_worker_prefix_cache_requests",
                                          "Requests that looked up the prefix cache, by result (hit: some of the "
                                          "prompt's K/V was reused)", [*labels, "result"], registry=reg),
            prefix_cached_tokens=Counter("specgate_worker_prefix_cached_tokens",
                                         "Prompt tokens served from the prefix cache, not prefilled", labels,
                                         registry=reg),
            prefix_cache_bytes=Gauge("specgate_worker_prefix_cache_bytes", "Bytes of K/V the prefix cache holds",
                                     labels, multiprocess_mode="livemax", registry=reg),
            shadow_drafts=Counter("specgate_worker_shadow_drafts",
                                  "What lookup methods the requests did not run would have done on their output "
                                  "(replayed; count: steps, proposed, tested, accepted)", [*labels, "method", "count"],
                                  registry=reg),
        )

    def record_shadow(self, model: str, worker: str, shadows: tuple[ShadowSteps, ...]) -> None:
        """A request's replays of the lookup methods it did not run (``StepEvent.shadow``)."""
        for shadow in shadows:
            counts = shadow.counts()
            for name, value in (("steps", counts.steps), ("proposed", counts.proposed), ("tested", counts.tested),
                                ("accepted", counts.accepted)):
                self.shadow_drafts.labels(model=model, worker=worker, method=shadow.method, count=name).inc(value)
