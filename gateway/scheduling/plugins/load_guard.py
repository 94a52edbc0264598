"""``load-guard``, an ordered rule (SGLang's): the fleet is unbalanced when the most loaded ready
worker's load exceeds the least loaded's by more than ``balanceAbs`` and is more than
``balanceRel`` times it (``policy.route_balance_abs``, ``route_balance_rel``). Then load alone
places the request, and the most loaded workers (the hotspots) keep no session by stickiness:
cache affinity never piles more onto a hotspot. It settles nothing itself: it marks the cycle
(``hotspots``, ``load_only``) for the rules after it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from gateway.scheduling.framework import Candidate, Cycle, Parameters, Rule, Settled


def unbalanced(loads: Sequence[int], balance_abs: int, balance_rel: float) -> bool:
    if len(loads) < 2:
        return False
    most, least = max(loads), min(loads)
    return most - least > balance_abs and most > balance_rel * least


class LoadGuard(Rule):
    type_name = "load-guard"
    parameters: ClassVar[Parameters] = {"balanceAbs": (int, 4, 0, None), "balanceRel": (float, 1.5, 1.0, 1e9)}
    balanceAbs: int = 4
    balanceRel: float = 1.5

    def apply(self, cycle: Cycle, endpoints: list[Candidate]) -> Settled | None:
        if unbalanced([c.load for c in cycle.ready], self.balanceAbs, self.balanceRel):
            cycle.hotspots = frozenset(c.worker_id for c in cycle.ready if c.load == cycle.most)
            cycle.load_only = True
        return None
