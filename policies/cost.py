"""K from measured costs: which depth of speculation buys the most tokens per second.

Pure, like the rest of ``policies/``: a worker's cost curves come in as a frozen ``CostModel``
(the gateway builds it from the JSON the worker publishes, ``workers/cost_model.py``), the
acceptance estimate and batch depth as numbers, and a K comes out.

The objective, per sequence and step, relative to a plain step at the same batch depth d:

    gain(α, K, d) = E(α, K) / step_cost(d, K),   E(α, K) = (1 − α^(K+1)) / (1 − α)

E is the expected number of tokens a step with K drafts emits (Leviathan et al.);
``step_cost(d, K)`` is what that whole step costs divided by what a whole plain step costs at
depth d, so ``step_cost(d, 0) = 1`` and a plain step's gain is 1. "Whole" matters: a step is
the target verifying K+1 tokens and K draft forwards, plus work outside the forwards (sampling,
bookkeeping) that plain steps pay too. Leaving that fixed work out prices speculation too high
wherever forwards are cheap (``whole_step_costs`` says how the parts add up). Plain is credited
``min_gain`` on top: a K must promise at least (1 + min_gain)× plain's throughput to be chosen
(the cost curves are measurements, not exact).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CostModel:
    """A worker's step cost by batch depth and K, relative to a plain step at that depth."""

    depths: tuple[int, ...]  # batch depths measured, ascending, the first >= 1
    step_cost: tuple[tuple[float, ...], ...]  # [depth index][K], K = 0..max_k; [i][0] == 1.0

    def __post_init__(self) -> None:
        if not self.depths or len(self.depths) != len(self.step_cost):
            raise ValueError("cost model: one step_cost row per depth")
        if any(b <= a for a, b in zip(self.depths, self.depths[1:], strict=False)) or self.depths[0] < 1:
            raise ValueError(f"cost model: depths must be ascending and >= 1 (got {self.depths})")
        width = len(self.step_cost[0])
        for row in self.step_cost:
            if len(row) != width or width < 1:
                raise ValueError("cost model: every depth needs the same K = 0..max_k")
            if not all(math.isfinite(c) and c > 0 for c in row):
                raise ValueError(f"cost model: costs must be positive and finite (got {row})")

    @property
    def max_k(self) -> int:
        return len(self.step_cost[0]) - 1

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> CostModel:
        """From the ``cost_model`` object a worker publishes (``depths``, ``step_cost``)."""
        depths = tuple(int(d) for d in raw["depths"])
        rows = tuple(tuple(float(c) for c in row) for row in raw["step_cost"])
        return cls(depths, rows)


def whole_step_costs(target_s: Sequence[float], draft_s: float, overhead_s: float = 0.0,
                     draft_overhead_s: float = 0.0) -> tuple[float, ...]:
    """``step_cost`` for K = 0..len(target_s)-1 at one depth, from its parts in seconds.

    ``target_s[n-1]``: the target's forward of n tokens per sequence; ``draft_s``: one draft
    forward; ``overhead_s``: a plain step's work outside its forwards; ``draft_overhead_s``: what
    each draft per sequence adds to that outside the forwards. A K-draft step costs
    target_s[K] + K (draft_s + draft_overhead_s) + overhead_s, a plain one target_s[0] + overhead_s.
    """
    plain = target_s[0] + overhead_s
    return tuple((target_s[k] + k * (draft_s + draft_overhead_s) + overhead_s) / plain for k in range(len(target_s)))


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step with K drafts emits on average at per-token acceptance α."""
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def step_cost(model: CostModel, depth: int, k: int) -> float:
    """Relative cost of a K-draft step at ``depth``, linear between measured depths.

    Outside the measured range the nearest depth's curve holds: a worker never batches more
    than its slots, so the deepest measured depth is as deep as its steps get.
    """
    depths = model.depths
    if depth <= depths[0]:
        return model.step_cost[0][k]
    for i in range(1, len(depths)):
        if depth <= depths[i]:
            lo, hi = depths[i - 1], depths[i]
            w = (depth - lo) / (hi - lo)
            return (1 - w) * model.step_cost[i - 1][k] + w * model.step_cost[i][k]
    return model.step_cost[-1][k]


def gain(model: CostModel, alpha: float, k: int, depth: int) -> float:
    """Tokens per unit of time with K drafts, relative to plain decoding (plain: 1)."""
    return expected_tokens(alpha, k) / step_cost(model, depth, k)


def objective(model: CostModel, alpha: float, k: int, depth: int, min_gain: float) -> float:
    """What ``choose_k`` maximizes: the gain, with plain credited ``min_gain``."""
    return 1.0 + min_gain if k == 0 else gain(model, alpha, k, depth)


def choose_k(model: CostModel, alpha: float, depth: int, max_k: int, min_gain: float, k_switch_gain: float,
             current: int | None = None) -> int:
    """The K (0: plain) that maximizes ``objective``, with hysteresis.

    A session keeps its ``current`` K (plain included) unless another K's objective is higher
    by a factor of more than 1 + ``k_switch_gain``: near the optimum the curve is flat, so a
    noisy acceptance estimate would otherwise move K back and forth for nothing. Ties go to the
    smaller K (less work for the same tokens).
    """
    ks = range(0, min(max_k, model.max_k) + 1)
    values = {k: objective(model, alpha, k, depth, min_gain) for k in ks}
    best = max(ks, key=lambda k: (values[k], -k))
    if current is not None and current in values and values[current] * (1.0 + k_switch_gain) >= values[best]:
        return current
    return best


def step_k(model: CostModel, alpha: float, depth: int, requested_k: int) -> int:
    """The worker's per-step rule: the best K up to the requested one at this step's depth,
    0 where no K beats plain. No margin and no hysteresis: depth is exact, not an estimate,
    and the gateway's choice already carries both."""
    if requested_k <= 0:
        return 0
    ks: Sequence[int] = range(0, min(requested_k, model.max_k) + 1)
    return max(ks, key=lambda k: (gain(model, alpha, k, depth), -k))
