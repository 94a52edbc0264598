"""What an EAGLE-3 head's forwards cost on this machine, measured at start-up as the draft's are: a
step's first head forward (the catch-up on the last step's tokens: two of them, a draft accepted and
the target's bonus) and a later chain forward, relative to a whole plain step at batch depth 1
(``CostReport.head_first_cost``, ``head_draft_cost``; ``policies.cost.head_step_cost`` prices them)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from workers.costs.cost_report import CostReport
from workers.engines.embedded.eagle3.head import Eagle3Head

REPEATS = 15


@torch.inference_mode()
def head_costs(head: Eagle3Head, report: CostReport) -> dict[str, Any]:
    """The two costs, from the median of ``REPEATS`` timed forwards at position 64 of slot 0 (the
    K/V written there is overwritten before any sequence reads it: slot 0's positions are its own
    sequence's to write first)."""
    hidden = torch.randn(2, len(head.layer_ids) * head.spec.target_hidden_size)
    start = min(64, head.k_cache.shape[2] - 4)

    def timed(fused: bool) -> float:
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            if fused:
                head.forward(0, start, hidden, [1, 2], fused=True)
            else:
                head.forward(0, start + 2, hidden[:1, :head.spec.target_hidden_size], [3], fused=False)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1000

    first_ms, later_ms = timed(True), timed(False)
    plain_ms = report.plain_step_ms[0] + (report.step_overhead_ms[0] if report.step_overhead_ms else 0.0)
    return {"head_first_cost": round(first_ms / plain_ms, 5), "head_draft_cost": round(later_ms / plain_ms, 5)}
