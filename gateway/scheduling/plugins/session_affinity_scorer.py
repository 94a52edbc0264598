"""``session-affinity-scorer``: 1 for the session's own worker, 0 elsewhere (llm-d's scorer of the
same name). Not in the default profile, where ``sticky-placement`` keeps a session on its
worker as an ordered rule; a profile that wants stickiness weighed against load lists this."""

from __future__ import annotations

from gateway.scheduling.framework import Candidate, Cycle, Scorer


class SessionAffinityScorer(Scorer):
    type_name = "session-affinity-scorer"

    def score(self, cycle: Cycle, endpoints: list[Candidate]) -> list[float]:
        current = cycle.features.session_worker
        return [1.0 if c.worker_id == current else 0.0 for c in endpoints]
