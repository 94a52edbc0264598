"""``min-prefix-hit``, an ordered rule: where no endpoint is expected to hold at least ``minHit``
of the prompt (``policy.route_min_prefix_hit``; the prefix scorer's expected hits), load alone
places the request: the least-loaded worker, whatever the scorers say."""

from __future__ import annotations

from typing import ClassVar

from gateway.scheduling.framework import Candidate, Cycle, Parameters, Rule, Settled


class MinPrefixHit(Rule):
    type_name = "min-prefix-hit"
    parameters: ClassVar[Parameters] = {"minHit": (float, 0.1, 0.0, 1.0)}
    minHit: float = 0.1

    def apply(self, cycle: Cycle, endpoints: list[Candidate]) -> Settled | None:
        hits = cycle.hits
        if max((hits.get(c.worker_id, 0.0) for c in endpoints), default=0.0) < self.minHit:
            cycle.load_only = True
        return None
