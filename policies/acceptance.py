"""The acceptance estimator: decayed sums of accepted and tested drafts, their ratio, and how
sure that ratio is.

Pure arithmetic, no state of its own; ``policies.speculation`` keeps a session's (and a
worker's) estimate in ``SessionState`` and ``policies.tree_choice`` a rank cell's with it.

**The estimate.** Every tested draft is one Bernoulli trial of α, the per-draft acceptance given
the drafts before it were accepted. A draft tested ``n`` tested drafts ago weighs
``0.5 ** (n / half_life)``; the estimate is the weighted share accepted, and its *weight* the
sum of the weights: the evidence it rests on, which grows from 0 with the first draft and
levels off near ``half_life / ln 2`` (about 92 drafts at the default 64). A first step that
tests one draft and rejects it therefore counts as one draft, not as the whole estimate (the
bug a bare EWMA seeded with the first step's rate had: 0.0 after one rejection, then ~0.44
after 58 more drafts at 0.95). Folding a block of steps at once decays the old evidence by the
block's tested drafts and adds the block with weight 1 per draft, so a block's order does not
matter, and two orders of the same steps differ only by how much each step has decayed.

**Its uncertainty.** ``stderr = sqrt(p (1 − p) / weight)``, the binomial standard error with the
weight as the count. The acceptance latch trips when ``estimate + acceptance_latch_stderrs ×
stderr`` is below the floor (``acceptance_latch``; docs/policy.md gives
the false-fallback rate this buys).

**Before evidence.** The cost model reads ``posterior``: the estimate shrunk towards a prior
(the worker's estimate, or ``acceptance_resume`` before the worker has any) with
``prior_drafts`` pseudo-drafts, a Beta posterior mean whose prior is worth that many tested
drafts. With no evidence it is the prior; with a full weight of ~92 drafts the session's own
estimate carries 85% of it at the default 16.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from policies.config import PolicyConfig

# Arithmetic only, no branches on the values: the same functions run on floats here and on
# numpy arrays in bench.estimator, which simulates 10,000 sessions at once through them.
Values: TypeAlias = Any  # a float, or an array of them
LN2 = math.log(2.0)


def decayed_fold(estimate: Values, weight: Values, tested: Values, accepted: Values,
                 half_life: float) -> tuple[Values, Values]:
    """(estimate, weight) after ``tested`` more drafts (> 0) of which ``accepted`` were accepted:
    the old evidence decayed by the new drafts, the new ones added at weight 1 each. No
    evidence yet is weight 0 (the estimate is then ignored)."""
    kept = weight * 0.5 ** (tested / half_life)
    total = kept + tested
    return (estimate * kept + accepted) / total, total


def stderr(estimate: Values, weight: Values) -> Values:
    """The estimate's standard error: binomial, with the decayed weight as the count (weight > 0)."""
    return (estimate * (1.0 - estimate) / weight) ** 0.5


def below_floor(estimate: Values, weight: Values, floor: float, stderrs: float) -> Values:
    """The latch's test: the estimate is below ``floor`` by more than ``stderrs`` standard errors
    (weight > 0)."""
    return estimate + stderrs * stderr(estimate, weight) < floor


def posterior(estimate: float | None, weight: float, prior: float, prior_drafts: float) -> float:
    """The estimate shrunk towards ``prior``, worth ``prior_drafts`` tested drafts."""
    if estimate is None or weight <= 0.0:
        return prior
    return (estimate * weight + prior * prior_drafts) / (weight + prior_drafts)


def max_weight(half_life: float) -> float:
    """The weight an endless stream of drafts levels off at: 1 / (1 − 0.5^(1/H)) ≈ H / ln 2."""
    return 1.0 / (1.0 - math.pow(0.5, 1.0 / half_life))


def legacy_weight(drafts: int, half_life: float) -> float:
    """The weight to give an estimate stored without one (session state schema 1, whose EWMA
    kept only the lifetime count): its drafts, but at most H / ln 2."""
    return float(min(float(drafts), half_life / LN2))


def acceptance_latch(latched: bool, estimate: float, weight: float, proposals_seen: int,
                     policy: PolicyConfig) -> bool:
    """Hysteresis: trip once the estimate is below the floor by more than
    ``acceptance_latch_stderrs`` standard errors (given ``min_proposals`` tested drafts); clear
    only once the estimate is back above resume.

    The confidence margin is what keeps a session at α = 0.70 from being latched by a run of
    bad luck: a bare estimate below the floor latches 26-29% of them within 256 drafts
    (docs/policy.md, ``bench.estimator``)."""
    if latched:
        return estimate < policy.acceptance_resume
    return (proposals_seen >= policy.min_proposals and weight > 0.0
            and bool(below_floor(estimate, weight, policy.acceptance_floor, policy.acceptance_latch_stderrs)))
