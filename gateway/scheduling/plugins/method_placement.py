"""``method-placement``, an ordered rule (``policy.route_method_margin``; 0: off): a session that
would stay on its worker, where that worker's in-flight requests run the other kind of step than
its own (the draft model against a lookup method), moves to the endpoint whose in-flight requests
agree with its kind by at least ``margin`` more (agreeing minus disagreeing; reason ``method``).
Listed before ``sticky-placement``: it is stickiness's one exception. Each move leaves the
session's prefix cache behind, so it is off by default."""

from __future__ import annotations

from typing import ClassVar

from gateway.scheduling.framework import Candidate, Cycle, Parameters, Rule, Settled
from gateway.scheduling.plugins.method_agreement_scorer import agreement


class MethodPlacement(Rule):
    type_name = "method-placement"
    parameters: ClassVar[Parameters] = {"margin": (int, 0, 0, 1000)}
    margin: int = 0

    @property
    def wants_kind(self) -> bool:
        return self.margin > 0

    def apply(self, cycle: Cycle, endpoints: list[Candidate]) -> Settled | None:
        kind = cycle.features.kind
        if self.margin <= 0 or kind is None:
            return None
        own = cycle.own(endpoints)
        if own is None or own.worker_id in cycle.hotspots:
            return None  # not sticky there: placed as a new session is
        if (own.looking if kind == "draft" else own.drafting) == 0:
            return None  # nothing there runs the other kind of step
        others = [c for c in endpoints if c is not own]
        best = max(others, key=lambda c: agreement(c, kind), default=None)  # max keeps the first of equals
        if best is None or agreement(best, kind) < agreement(own, kind) + self.margin:
            return None
        return Settled(best, "method")
