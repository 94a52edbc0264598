"""The speculative fallback policy: pure functions, no I/O (see policies/speculation.py)."""

from policies.config import PolicyConfig, PolicyConfigError, bounded_repr, bounded_text
from policies.speculation import (
    REASONS,
    Decision,
    Mode,
    Reason,
    RequestFacts,
    SessionState,
    StepDepth,
    WorkerState,
    acceptance_latch,
    batch_latch,
    decide,
    observe,
    record_decision,
    step_depth,
    tested_drafts,
)

__all__ = [
    "REASONS",
    "Decision",
    "Mode",
    "PolicyConfig",
    "PolicyConfigError",
    "Reason",
    "RequestFacts",
    "SessionState",
    "StepDepth",
    "WorkerState",
    "acceptance_latch",
    "batch_latch",
    "bounded_repr",
    "bounded_text",
    "decide",
    "observe",
    "record_decision",
    "step_depth",
    "tested_drafts",
]
