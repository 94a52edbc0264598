"""The speculative fallback policy: pure functions, no I/O (see policies/speculation.py)."""

from policies.config import PolicyConfig, PolicyConfigError
from policies.speculation import (
    FIXED_MODE_REASONS,
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
    observe_steps,
    record_decision,
    step_depth,
    tested_drafts,
)

__all__ = [
    "FIXED_MODE_REASONS",
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
    "decide",
    "observe",
    "observe_steps",
    "record_decision",
    "step_depth",
    "tested_drafts",
]
