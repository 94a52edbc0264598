"""``method-agreement-scorer``: how well a worker's in-flight requests agree with the session's
kind of step (the draft model's, or a lookup method's): agreeing minus disagreeing, scaled to
[0, 1] across the endpoints (all 0 for a session whose kind is unknown or plain). A batch whose
sequences all look up pays no draft forward: on a GPU a draft forward costs the whole batch its
time whoever drafts (bench.policy_methods). Off in the default profile: ``method-placement``
moves sessions by the same count, as an ordered rule with a margin."""

from __future__ import annotations

from gateway.scheduling.framework import Candidate, Cycle, Scorer, StepKind


def agreement(candidate: Candidate, kind: StepKind) -> int:
    """How many more of the worker's in-flight requests run ``kind``'s steps than the other's."""
    difference = candidate.drafting - candidate.looking
    return difference if kind == "draft" else -difference


class MethodAgreementScorer(Scorer):
    type_name = "method-agreement-scorer"

    @property
    def wants_kind(self) -> bool:
        return True

    def score(self, cycle: Cycle, endpoints: list[Candidate]) -> list[float]:
        kind = cycle.features.kind
        if kind is None:
            return [0.0] * len(endpoints)
        agreements = [agreement(c, kind) for c in endpoints]
        low, high = min(agreements), max(agreements)
        if high == low:
            return [0.0] * len(endpoints)
        return [(a - low) / (high - low) for a in agreements]
