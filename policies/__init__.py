"""The speculation policy, sans I/O: every rule about whether to speculate, and with which K.

Which K, if any: ``decide(session, worker, request, policy) -> Decision`` is the entry point.
The gateway calls it at admission, per request and worker, and sends its mode and K to the
worker (``policies/speculation.py`` reads its rules top to bottom; ``policies/cost.py`` prices
K under ``num_speculative_tokens: auto``).

Inside a worker, each step may only lower that K, by the per-step rules:
- ``step_depth``: the batch latch and ``max_step_drafts`` (every engine, every step);
- ``batch_step_k``: under K auto, the one K the step's drafting sequences draft;
- ``catch_up_pays``: under K auto, whether a sequence whose draft lags catches it up and drafts
  now, or decodes this step plain.

Under K auto a session may get a token tree instead of a chain (``Decision.tree``;
``policies/tree_choice.py`` prices it, ``policies/tree.py`` defines its shape and notation);
``observe_path`` folds a tree step's path.

What ``decide`` and the per-step rules are built from (``choose_k``, ``choose_plan``, ``objective``, ``gain``,
``step_k``, the step prices) stays public for the benches and the table-driven tests; nothing
else should call them to choose a K. After a request, ``record_decision``, ``observe`` and
``observe_steps`` fold what happened into the session's state.
"""

from policies.acceptance import acceptance_latch
from policies.config import FieldError, PolicyConfig, PolicyConfigError, bounded_repr, bounded_text, raise_problems
from policies.cost import (
    CostModel,
    StepMix,
    StepParts,
    TreeCosts,
    batch_step_k,
    catch_up_pays,
    choose_k,
    expected_tokens,
    gain,
    mixed_step_cost,
    objective,
    step_cost,
    step_k,
    whole_step_costs,
)
from policies.lookup import LookupState, price_lookup
from policies.methods import METHODS, Method
from policies.speculation import (
    FIXED_MODE_REASONS,
    REASONS,
    Decision,
    Mode,
    Reason,
    StepDepth,
    batch_latch,
    decide,
    observe,
    observe_lookup,
    observe_path,
    observe_steps,
    record_decision,
    run_on,
    step_depth,
    tested_drafts,
)
from policies.states import RequestFacts, SessionState, WorkerState
from policies.tree import MAX_TREE_NODES, StepPath, TreeShape, TreeShapeError, expected_tree_tokens, level_pass
from policies.tree_choice import choose_plan, plan_value, tree_gain
from policies.trial_k import acceptance_for_k, worker_acceptance
from policies.views import acceptance_view, lookup_views, speculative_view

__all__ = [
    "FIXED_MODE_REASONS",
    "MAX_TREE_NODES",
    "METHODS",
    "REASONS",
    "CostModel",
    "Decision",
    "FieldError",
    "LookupState",
    "Method",
    "Mode",
    "PolicyConfig",
    "PolicyConfigError",
    "Reason",
    "RequestFacts",
    "SessionState",
    "StepDepth",
    "StepMix",
    "StepParts",
    "StepPath",
    "TreeCosts",
    "TreeShape",
    "TreeShapeError",
    "WorkerState",
    "acceptance_for_k",
    "acceptance_latch",
    "acceptance_view",
    "batch_latch",
    "batch_step_k",
    "bounded_repr",
    "bounded_text",
    "catch_up_pays",
    "choose_k",
    "choose_plan",
    "decide",
    "expected_tokens",
    "expected_tree_tokens",
    "gain",
    "level_pass",
    "lookup_views",
    "mixed_step_cost",
    "objective",
    "observe",
    "observe_lookup",
    "observe_path",
    "observe_steps",
    "plan_value",
    "price_lookup",
    "raise_problems",
    "record_decision",
    "run_on",
    "speculative_view",
    "step_cost",
    "step_depth",
    "step_k",
    "tested_drafts",
    "tree_gain",
    "whole_step_costs",
    "worker_acceptance",
]
