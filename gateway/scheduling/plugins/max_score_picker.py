"""``max-score-picker`` (GIE's): the endpoint with the highest weighted score; among equal scores
the first listed, so routing is deterministic. Its reason is ``prefix`` where the pick is
expected to hold some of the prompt, else ``load``."""

from __future__ import annotations

from gateway.scheduling.framework import Candidate, Cycle, Picker, Settled


class MaxScorePicker(Picker):
    type_name = "max-score-picker"

    def pick(self, cycle: Cycle, endpoints: list[Candidate], scores: list[float]) -> Settled:
        best = max(range(len(endpoints)), key=scores.__getitem__)  # max keeps the first of equals
        chosen = endpoints[best]
        return Settled(chosen, "prefix" if cycle.hits.get(chosen.worker_id, 0.0) > 0.0 else "load")
