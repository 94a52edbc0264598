"""``load-bound-filter``: consistent hashing with bounded loads. No worker takes a request that
would put its load above ``factor`` × the fleet's mean (this request counted) + ``slack``
(``policy.route_load_factor``, ``route_load_slack``; factor 0: no bound). Sticky and prefix
placement both stay within it; the least-loaded worker always is (its load is at most the mean,
the slack at least 1), so load placement never loses its pick to it.

The load guard needs a wide gap (SGLang's 64, 4 here) and so lets a hot system prompt's worker
run far ahead at shallow queues, its sessions sticky there; the bound holds it (bench.prefix's
hotspot workload)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from gateway.scheduling.framework import Candidate, Cycle, Filter, Parameters


def load_bound(loads: Sequence[int], factor: float, slack: float) -> float:
    """The most a worker may hold after taking a request: the mean load with that request
    counted, times ``factor``, plus ``slack`` (infinite with the factor 0)."""
    if factor == 0.0 or not loads:
        return math.inf
    return factor * (sum(loads) + 1) / len(loads) + slack


class LoadBoundFilter(Filter):
    type_name = "load-bound-filter"
    parameters: ClassVar[Parameters] = {"factor": (float, 2.0, 0.0, 1000.0), "slack": (float, 2.0, 1.0, 1000.0)}
    factor: float = 2.0
    slack: float = 2.0

    def filter(self, cycle: Cycle, endpoints: list[Candidate]) -> list[Candidate]:
        bound = load_bound([c.load for c in cycle.ready], self.factor, self.slack)
        cycle.bound = bound
        if bound == math.inf:
            return endpoints
        return [c for c in endpoints if c.load + 1 <= bound]
