"""``load-scorer``: spare load, 1 − the worker's load ÷ the fleet's highest (GIE's queue scorer
scores queue depth the same way). With the prefix scorer, llm-d's picker weighs prefix, queue
and KV use 3 / 2 / 2; specgate's defaults are prefix 3, load 2 (``policy.route_*_weight``)."""

from __future__ import annotations

from gateway.scheduling.framework import Candidate, Cycle, Scorer


class LoadScorer(Scorer):
    type_name = "load-scorer"

    def score(self, cycle: Cycle, endpoints: list[Candidate]) -> list[float]:
        most = max(1, cycle.most)
        return [1.0 - c.load / most for c in endpoints]
