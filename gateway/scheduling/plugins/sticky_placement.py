"""``sticky-placement``, an ordered rule: a session stays on its worker while that worker is still
among the endpoints (ready, within the load bound) and is not a hotspot the load guard moves
sessions off (reason ``sticky``). Its cached prompt is there."""

from __future__ import annotations

from gateway.scheduling.framework import Candidate, Cycle, Rule, Settled


class StickyPlacement(Rule):
    type_name = "sticky-placement"

    def apply(self, cycle: Cycle, endpoints: list[Candidate]) -> Settled | None:
        own = cycle.own(endpoints)
        if own is None or own.worker_id in cycle.hotspots:
            return None
        return Settled(own, "sticky")
