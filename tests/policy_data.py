"""Shared values and helpers for the policy tests: pure data, no I/O."""


import math
from collections.abc import Sequence
from itertools import pairwise

from hypothesis import settings

from policies import (
    Decision,
    PolicyConfig,
    RequestFacts,
    SessionState,
    WorkerState,
    decide,
    observe,
    record_decision,
)

# floor 0.60, resume 0.70, min_proposals 32, half-life 64, batch 64/56, T 0.8, probe 8; K 4 (explicit);
# the shallow-batch waiver and the per-step draft limit off, so each rule is tested on its own
# (tests/unit/test_policy.py tests those two).
POLICY = PolicyConfig(num_speculative_tokens=4, free_batch=0, max_step_drafts=0)


def rules_only(**fields: float) -> PolicyConfig:
    """A policy with the given fields, and the shallow-batch waiver and the draft limit off."""
    return PolicyConfig(**{"free_batch": 0, "max_step_drafts": 0, **fields})  # type: ignore[arg-type]
def state(alpha: float, drafts: int, low_acceptance: bool = False, plain_since_probe: int = 0) -> SessionState:
    """A session whose estimate ``alpha`` rests on ``drafts`` tested drafts, all of them still
    at full weight (as if just tested)."""
    return SessionState(acceptance_estimate=alpha, acceptance_weight=float(drafts), proposals_seen=drafts,
                        low_acceptance=low_acceptance, plain_since_probe=plain_since_probe)


FRESH = SessionState()
LATCHED = state(0.2, 100, low_acceptance=True)
IDLE = WorkerState(batch_depth=0, batch_full=False, max_k=8)
COOL = RequestFacts(temperature=0.0)
PROPERTY = settings(max_examples=200, deadline=None)


def above(x: float) -> float:
    return math.nextafter(x, math.inf)


def below(x: float) -> float:
    return math.nextafter(x, -math.inf)


def fold(session: SessionState, steps: Sequence[tuple[int, int]], policy: PolicyConfig = POLICY) -> SessionState:
    for proposed, accepted in steps:
        session = observe(session, proposed, accepted, policy)
    return session


def serve(session: SessionState, worker: WorkerState = IDLE, request: RequestFacts = COOL,
          policy: PolicyConfig = POLICY) -> tuple[Decision, SessionState]:
    """One request as the gateway serves it: decide, then count the decision."""
    decision = decide(session, worker, request, policy)
    return decision, record_decision(session, decision)


def transitions(latches: Sequence[bool]) -> int:
    return sum(a != b for a, b in pairwise(latches))
