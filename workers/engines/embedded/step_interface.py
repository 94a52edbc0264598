"""What the engine's step takes from the worker (the rules it plugs in: K by batch depth, one K
for the step, whether a catch-up pays) and what it reports back (``StepShape``, what a step's
forwards computed, for the online cost model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# (requested K, batch depth) -> K for this step. The worker plugs in the policy's batch rule.
StepDepthRule = Callable[[int, int], int]
# The step's Ks after that rule (0: plain or a prefill) -> the one K every drafting sequence
# drafts this step, each within its own limits (K auto: policies.cost.batch_step_k); None leaves
# each sequence its own K (the rule is off, or has no evidence yet).
StepCostRule = Callable[[list[int]], int | None]
# (tokens the draft lags, tokens the sequence has left, the step's K, batch depth) -> whether
# catching the draft up on those tokens (they were decoded plain) pays before the sequence ends
# (K auto: policies.cost.catch_up_pays); False: the sequence decodes this step plain.
CatchUpRule = Callable[[int, int, int, int], bool]
# The draft's lag after an ordinary speculative or plain step (1-2 tokens): no catch-up to price.
ORDINARY_LAG = 2


@dataclass(frozen=True)
class StepShape:
    """What the last step's forwards computed: the target's rows and widest row, whether a
    prefill forward ran too (its time is then in the target's), the draft's rows and forwards,
    and the drafts proposed over all sequences; ``catch_up``, the most tokens a drafting
    sequence's draft caught up on in its first forward (more than ORDINARY_LAG after a plain
    spell: that forward then costs more than a step's first draft forward ordinarily does)."""

    target_rows: int
    target_width: int
    prefill: bool
    draft_rows: int
    draft_forwards: int
    drafts: int = 0
    catch_up: int = 0
    # The target's tokens over all rows: below rows x width where rows differ in length (the
    # one-call forward computes only real tokens, so such a step costs less than its width says).
    target_tokens: int = 0
    # A token tree was drafted and verified: its forwards are not the (depth, n) points the
    # cost model's curves hold (a level's forward has several rows; nodes attend by the map).
    tree: bool = False
