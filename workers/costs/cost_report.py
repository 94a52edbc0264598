"""The cost model every engine publishes: what a step costs, by batch depth and K. No torch.

One schema for every engine (``CostReport``; ``/specgate/worker`` publishes it under
``cost_model``, and the gateway reads ``depths`` and ``step_cost`` into a
``policies.cost.CostModel``):

- ``depths``: batch depths (running sequences) the curves are given at, ascending.
- ``plain_step_ms``: a plain step's target forward (one token per sequence) at each depth.
- ``step_cost[d][K]``: a whole step with K drafts per sequence (the target verifying K+1 tokens
  per sequence, K draft forwards, and the step's work outside the forwards) divided by a whole
  plain step at the same depth; ``[d][0]`` is 1 (``policies.cost.whole_step_costs``).
- ``verify_cost[d][n-1]`` and ``draft_cost[d]`` (optional): the forwards, the target's of n tokens
  per sequence relative to n = 1, and a draft forward (after a step's first) relative to a plain
  step's target forward.
- ``draft_first_cost[d]`` (optional; absent: as ``draft_cost``): a step's first draft forward,
  which costs more than the later ones: the target's forward before it has pushed the draft's
  weights out of the cache, and it catches the draft up on the last step's tokens.
- ``step_overhead_ms[d]`` and ``draft_overhead_ms[d]``: the work outside the forwards, a plain
  step's (sampling, bookkeeping; it grows with depth) and what each draft per sequence adds to
  it. The embedded engine measures both; the simulated engine derives them from its model (0:
  its steps are forwards only); a vLLM worker publishes 0, because its ``step_cost`` comes from
  whole-step timings that already hold that work.

Where the figures come from differs by engine: the embedded engine measures them at start-up
(``workers/engines/embedded/measurement/measure.py``) and refines them online from its step timings
(``OnlineCosts``, workers/costs/online.py); the simulated engine derives them from its model
(``report_from_forward_times``);
a vLLM worker estimates them from iteration timings only (``StepTimeCosts``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from policies.cost import CostModel, gain, whole_step_costs

CostSource = Literal["measured", "cache", "derived", "online", "estimated"]

@dataclass(frozen=True)
class PrecisionCandidate:
    """One target configuration measured at start-up."""

    target: str  # the target's dtype
    prepacked: bool  # projections on oneDNN's prepacked weights
    bit_identical: bool  # verification logits equal plain decoding's, bit for bit (checked on this machine)
    plain_ms: float  # target forward, 1 token, batch 1
    verify_ms: float  # target forward, max_k + 1 tokens, batch 1
    tok_s_b1: float  # predicted batch-1 tokens/s at the reference acceptance, at its best K
    best_k_b1: int
    tok_s_full: float  # plain tokens/s at full batch (max_slots): capacity under load
    products: str = "float32"  # how the embedded engine's kernels multiply (Products); float32 off them

    @property
    def score(self) -> float:
        """What the choice ranks: latency when idle and capacity under load, weighed alike
        (geometric mean, so neither unit dominates)."""
        return math.sqrt(self.tok_s_b1 * self.tok_s_full)


@dataclass(frozen=True)
class PrecisionChoice:
    target: str
    prepacked: bool
    exact: bool  # the chosen configuration's verification is bit-identical to plain decoding
    why: str
    reference_alpha: float  # the acceptance the candidates were compared at
    candidates: tuple[PrecisionCandidate, ...] = ()
    # The chosen target's on the kernels (workers.engines.embedded.projections.Products); its draft's too.
    products: str = "float32"


@dataclass(frozen=True)
class CostReport:
    depths: tuple[int, ...]
    plain_step_ms: tuple[float, ...]
    step_cost: tuple[tuple[float, ...], ...]
    verify_cost: tuple[tuple[float, ...], ...] | None = None
    draft_cost: tuple[float, ...] | None = None
    source: CostSource = "measured"
    precision: PrecisionChoice | None = None
    online_steps: int = 0  # step timings folded in since start-up
    acceptance: float | None = None  # the worker's own per-token acceptance estimate
    measured_points: int = 0  # (depth, n) points timed at start-up; the rest are interpolated
    total_points: int = 0
    measure_s: float = 0.0  # start-up measurement's wall time (0: from the cache or derived)
    cpu: str = ""
    step_overhead_ms: tuple[float, ...] | None = None  # a plain step's work outside its forwards, per depth
    draft_overhead_ms: tuple[float, ...] | None = None  # what each draft per sequence adds to it, per depth
    # A prompt's prefill at batch 1, at these prompt lengths: the target's, and the draft's
    # catch-up on it in a request's first drafting step (None: not measured; the sim and vLLM).
    prefill_tokens: tuple[int, ...] | None = None
    prefill_ms: tuple[float, ...] | None = None
    draft_prefill_ms: tuple[float, ...] | None = None
    draft_first_cost: tuple[float, ...] | None = None  # a step's first draft forward / plain_step_ms
    # Token trees (policies/tree.py) at batch depth 1, relative to plain_step_ms[0]: the target's
    # forward of one row of n = 1..T tokens (the root and n - 1 nodes, tree mask), and one draft
    # forward over n = 1..W nodes (a tree level). None: the engine is not priced for trees.
    tree_verify_cost: tuple[float, ...] | None = None
    tree_draft_cost: tuple[float, ...] | None = None
    # An EAGLE-3 head (method eagle3) at batch 1, relative to plain_step_ms[0]: a step's first head
    # forward (its catch-up on the last step's tokens, 2 of them) and each later one (a chain
    # draft). None: the worker has no head.
    head_first_cost: float | None = None
    head_draft_cost: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["max_k"] = len(self.step_cost[0]) - 1
        return out

    def prefill_s(self, tokens: int, draft: bool = False) -> float | None:
        """Seconds to prefill a prompt of ``tokens`` at batch 1 (``draft``: the draft's catch-up
        on it), on the line through the measured lengths; None where they were not measured."""
        times = self.draft_prefill_ms if draft else self.prefill_ms
        if not self.prefill_tokens or not times:
            return None
        return _line(self.prefill_tokens, times, tokens) / 1000

    def request_speedup(self, alpha: float, k: int, requests: Sequence[tuple[int, int]]) -> float | None:
        """Predicted speed-up of these requests run one at a time at depth K over plain, from
        (prompt tokens, output tokens) each: the prompt prefilled in both modes, and caught up
        on by the draft in speculative; the first output token from the prefill; the rest in
        decode steps at ``policies.cost.gain``. None without prefill costs."""
        plain_s, spec_s = 0.0, 0.0
        step_s = self.plain_step_s(0)
        speed = gain(self.policy_model(), alpha, k, 1) if k > 0 else 1.0
        for prompt, output in requests:
            prefill, catch_up = self.prefill_s(prompt), self.prefill_s(prompt + 1, draft=True) if k > 0 else 0.0
            if prefill is None or catch_up is None:
                return None
            decode = max(0, output - 1) * step_s
            plain_s += prefill + decode
            spec_s += prefill + catch_up + decode / speed
        return plain_s / spec_s if spec_s > 0 else None

    def catch_up_prices(self, lag: int, depth: int) -> tuple[float | None, float, int]:
        """What ``policies.cost.catch_up_pays`` weighs for a draft ``lag`` tokens behind at
        ``depth``: the catch-up's seconds (the draft's prefill of the lag; None: not measured),
        and a whole plain step's seconds at the measured depth nearest ``depth``, with that depth."""
        i = _nearest(self.depths, depth)
        return self.prefill_s(lag, draft=True), self.plain_step_s(i), self.depths[i]

    def plain_step_s(self, i: int) -> float:
        """Seconds of a whole plain step at ``depths[i]``: the target's forward and the work
        outside it."""
        return (self.plain_step_ms[i] + (self.step_overhead_ms[i] if self.step_overhead_ms else 0.0)) / 1000

    def policy_model(self) -> CostModel:
        """The policy's view of it, parts included, as the gateway parses the JSON."""
        return CostModel.from_json(self.to_json())

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> CostReport:
        def rows(value: Any) -> tuple[tuple[float, ...], ...] | None:
            return None if value is None else tuple(tuple(float(c) for c in row) for row in value)

        def floats(value: Any) -> tuple[float, ...] | None:
            return None if value is None else tuple(float(x) for x in value)

        precision = raw.get("precision")
        choice = None
        if precision is not None:
            cands = tuple(PrecisionCandidate(**c) for c in precision.get("candidates", ()))
            choice = PrecisionChoice(**{**precision, "candidates": cands})
        step_cost = rows(raw["step_cost"])
        assert step_cost is not None
        return cls(
            depths=tuple(int(d) for d in raw["depths"]), plain_step_ms=tuple(float(x) for x in raw["plain_step_ms"]),
            step_cost=step_cost, verify_cost=rows(raw.get("verify_cost")),
            draft_cost=floats(raw.get("draft_cost")),
            source=raw.get("source", "measured"), precision=choice, online_steps=int(raw.get("online_steps", 0)),
            acceptance=raw.get("acceptance"), measured_points=int(raw.get("measured_points", 0)),
            total_points=int(raw.get("total_points", 0)), measure_s=float(raw.get("measure_s", 0.0)),
            cpu=str(raw.get("cpu", "")), step_overhead_ms=floats(raw.get("step_overhead_ms")),
            draft_overhead_ms=floats(raw.get("draft_overhead_ms")),
            prefill_tokens=None if raw.get("prefill_tokens") is None else tuple(int(n) for n in raw["prefill_tokens"]),
            prefill_ms=floats(raw.get("prefill_ms")), draft_prefill_ms=floats(raw.get("draft_prefill_ms")),
            draft_first_cost=floats(raw.get("draft_first_cost")),
            tree_verify_cost=floats(raw.get("tree_verify_cost")), tree_draft_cost=floats(raw.get("tree_draft_cost")),
            head_first_cost=None if raw.get("head_first_cost") is None else float(raw["head_first_cost"]),
            head_draft_cost=None if raw.get("head_draft_cost") is None else float(raw["head_draft_cost"]))


def report_from_forward_times(depths: Sequence[int], target_s: Sequence[Sequence[float]], draft_s: Sequence[float],
                              *, source: CostSource = "derived", overhead_s: Sequence[float] | None = None,
                              draft_overhead_s: Sequence[float] | None = None,
                              draft_first_s: Sequence[float] | None = None, **extra: Any) -> CostReport:
    """The schema from absolute times: ``target_s[d][n-1]``, seconds of the target's forward
    with n tokens per sequence (n = 1..max_k+1) at ``depths[d]``; ``draft_s[d]``, one draft
    forward (one token per sequence) there, after a step's first, ``draft_first_s[d]`` (None: as
    the others); ``overhead_s[d]`` and ``draft_overhead_s[d]``, a plain
    step's work outside the forwards and what each draft per sequence adds to it (None: 0; a
    negative estimate counts as 0). What the simulated engine calls with its model's step
    times; what the embedded engine's measurements go through."""
    fixed = [max(0.0, x) for x in overhead_s] if overhead_s is not None else [0.0] * len(depths)
    per_draft = [max(0.0, x) for x in draft_overhead_s] if draft_overhead_s is not None else [0.0] * len(depths)
    firsts = draft_s if draft_first_s is None else draft_first_s
    step_cost, verify_cost, draft_cost, first_cost = [], [], [], []
    for times, draft, first, over, over_k in zip(target_s, draft_s, firsts, fixed, per_draft, strict=True):
        plain = times[0]
        step_cost.append(tuple(round(c, 4) for c in whole_step_costs(times, draft, over, over_k, first)))
        verify_cost.append(tuple(round(t / plain, 4) for t in times))
        draft_cost.append(round(draft / plain, 4))
        first_cost.append(round(first / plain, 4))
    return CostReport(depths=tuple(depths), plain_step_ms=tuple(round(1000 * t[0], 4) for t in target_s),
                      step_cost=tuple(step_cost), verify_cost=tuple(verify_cost), draft_cost=tuple(draft_cost),
                      source=source, step_overhead_ms=tuple(round(1000 * x, 4) for x in fixed),
                      draft_overhead_ms=tuple(round(1000 * x, 4) for x in per_draft),
                      draft_first_cost=None if draft_first_s is None else tuple(first_cost), **extra)


def _ratio(curve: Sequence[float], i: int, depths: Sequence[int], depth: int) -> float:
    """What scales an observation at ``depth`` to grid point ``i``: the curve's own ratio (1
    where the curve is zero there, e.g. an overhead nobody measured yet)."""
    here = interpolate(depths, curve, depth)
    return curve[i] / here if here > 0 and curve[i] > 0 else 1.0


def _nearest(depths: Sequence[int], depth: int) -> int:
    """Index of the grid depth nearest to ``depth`` on a log scale (costs grow about so)."""
    return min(range(len(depths)), key=lambda i: abs(math.log(depths[i]) - math.log(max(1, depth))))


def _line(lengths: Sequence[int], values: Sequence[float], tokens: int) -> float:
    """``values`` at ``tokens`` on the line through the first two points, as
    ``CostReport.prefill_s`` prices a prompt (through the origin with one point)."""
    if len(lengths) == 1:
        return values[0] * tokens / lengths[0]
    (n0, n1), (v0, v1) = lengths[:2], values[:2]
    return max(0.0, v0 + (v1 - v0) * (tokens - n0) / (n1 - n0))


def interpolate(depths: Sequence[int], values: Sequence[float], depth: int, *, extend: bool = False) -> float:
    """``values`` at ``depth``: linear between the ascending ``depths``; beyond them the nearest
    value, or with ``extend`` the line through the nearest two."""
    if len(depths) == 1 or (not extend and (depth <= depths[0] or depth >= depths[-1])):
        return values[0] if depth <= depths[0] else values[-1]
    i = 1
    while i < len(depths) - 1 and depth > depths[i]:
        i += 1
    w = (depth - depths[i - 1]) / (depths[i] - depths[i - 1])
    return (1 - w) * values[i - 1] + w * values[i]


def depth_grid(max_slots: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``max_slots`` (included): costs grow smoothly in between."""
    grid = [1]
    while grid[-1] * 2 < max_slots:
        grid.append(grid[-1] * 2)
    if max_slots > 1:
        grid.append(max_slots)
    return tuple(grid)
