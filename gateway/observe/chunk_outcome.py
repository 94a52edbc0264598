"""What one worker chunk taught the gateway (``gateway/accounting.py`` returns it), and its record
in the metrics in one call: the tokens by mode, time to first token, inter-token gaps, the
speculative steps by worker and by method, shadow replays, and the reports that were clamped."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.observe.metrics import GatewayMetrics


@dataclass(slots=True)
class ChunkOutcome:
    worker_id: str
    tokens: dict[str, int] = field(default_factory=dict)  # emitted, by the mode of the steps that made them
    first_token: tuple[str, float] | None = None  # (mode, seconds since the request came)
    gaps: list[tuple[str, float, int]] = field(default_factory=list)  # (mode, gap s, tokens): inter-token gaps
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # (proposed, accepted, count) on the worker
    method_steps: list[tuple[str, int, int]] = field(default_factory=list)  # (method, proposed, accepted)
    shadows: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)  # (method, steps) replayed
    clamps: list[str] = field(default_factory=list)  # why reports were clamped (CLAMP_REASONS)
    # (share expected cached, prompt tokens, cached tokens): the worker's report of its cache, for
    # the prefix scorer's post-response step (``Pipeline.post_response``).
    cached: tuple[float, int, int] | None = None


def record_chunk(metrics: GatewayMetrics, outcome: ChunkOutcome) -> None:
    """The chunk's outcome into the dashboard metrics."""
    for reason in outcome.clamps:
        metrics.clamped_report(reason)
    for method, proposed, accepted in outcome.method_steps:
        metrics.record_method_step(method, proposed, accepted)
    for method, steps in outcome.shadows:
        metrics.record_shadow(method, steps)
    for proposed, accepted, count in outcome.steps:
        metrics.record_steps(outcome.worker_id, proposed, accepted, count)
    if outcome.first_token is not None:
        mode, seconds = outcome.first_token
        metrics.observe_many(metrics.series(metrics.time_to_first_token, mode), seconds, 1)
    for mode, n in outcome.tokens.items():
        if n:
            metrics.series(metrics.tokens, mode).inc(n)
    for mode, gap, n in outcome.gaps:
        metrics.observe_many(metrics.series(metrics.inter_token_latency, mode), gap, n)
