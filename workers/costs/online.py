"""The cost report learned while serving: the embedded engine's ``OnlineCosts`` refine its start-up
measurements from its step timings, a vLLM worker's ``StepTimeCosts`` estimate them from
iteration timings only, and ``AcceptanceEstimate`` and ``StepCostRule`` are the worker's own
acceptance estimate and per-step batch rule. The report itself: workers/costs/cost_report.py.
No torch."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from policies.cost import CostModel, batch_step_k
from workers.costs.cost_report import (
    CostReport,
    CostSource,
    _line,
    _nearest,
    _ratio,
    interpolate,
    report_from_forward_times,
)

# Folded per step of the engine, not per observation of a point: every curve point's estimate
# covers about the same last 100 steps, however often it is timed, so the curves follow the
# machine's load within a second or two of busy serving and step costs, ratios between points,
# compare the same stretch of time. A point timed once every g steps weighs each timing as g
# steps' worth (1 - (1 - ONLINE_WEIGHT)^g, at most MAX_ONLINE_WEIGHT). Per observation, the
# plain step timed every step of a run averaged its last 50 steps and a verification timed
# every 4th step its last 200; when the last stretch was slower (a long context, a busy
# neighbour), the plain step came out 25% dearer than the verifications beside it and the
# prediction 13% high (bench.engine, AVX512-BF16 EPYC). A point's first observations weigh
# more (1/2, 1/3, ...): many points were interpolated at start-up, and the start-up timing is
# one sample of a quiet moment.
ONLINE_WEIGHT = 0.01
MAX_ONLINE_WEIGHT = 0.25
# Per observation in StepTimeCosts (vLLM's whole-step timings), which starts from no
# measurement at all: about the last 10 steps of a cell carry it.
STEP_TIME_WEIGHT = 0.1
# A curve point no step has timed for this many steps is stale: it moves with its depth's plain
# point (OnlineCosts). About a second of serving; long enough that a point timed now and then
# (a K some sessions use) keeps its own measurements.
STALE_STEPS = 64
# The worker's own acceptance estimate (per-step batch rule): evidence this many tested drafts
# old weighs half.
ACCEPTANCE_HALF_LIFE = 256.0
# The per-step rule reads that estimate only once this many tested drafts stand behind it: a
# first unlucky request (two rejections, α = 0) would otherwise cut every later step to plain,
# and plain steps add no evidence to undo it.
RULE_EVIDENCE = 32.0


@dataclass
class AcceptanceEstimate:
    """Per-token acceptance over tested drafts (the policy's definition), decayed by half-life."""

    tested: float = 0.0
    accepted: float = 0.0

    def add(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        tested = accepted + (1 if accepted < proposed else 0)
        decay = 0.5 ** (tested / ACCEPTANCE_HALF_LIFE)
        self.tested = self.tested * decay + tested
        self.accepted = self.accepted * decay + accepted

    @property
    def value(self) -> float | None:
        return None if self.tested <= 0 else self.accepted / self.tested

    @property
    def evidenced(self) -> float | None:
        """The value once ``RULE_EVIDENCE`` tested drafts stand behind it (the per-step rule's α)."""
        return self.value if self.tested >= RULE_EVIDENCE else None


@dataclass
class StepCostRule:
    """The worker's per-step K rule under K auto (``policies.cost.batch_step_k``) at the
    worker's acceptance estimate. It runs every step, so answers are kept per step shape
    (depth, drafting sequences, deepest K asked, α to 0.01); a new model starts afresh."""

    model: CostModel
    _memo: dict[tuple[int, int, int, int], int] = field(default_factory=dict)

    def k(self, requested: Sequence[int], alpha: float) -> int:
        """The K each drafting sequence of the step drafts (each within its own limits)."""
        deepest = max(requested, default=0)
        if deepest <= 0:
            return 0
        alpha = round(alpha, 2)
        key = (round(alpha * 100), len(requested), sum(1 for k in requested if k > 0), deepest)
        chosen = self._memo.get(key)
        if chosen is None:
            if len(self._memo) > 4096:  # shapes come and go with the load: keep the recent ones
                self._memo.clear()
            chosen = self._memo[key] = batch_step_k(self.model, alpha, requested)
        return chosen


@dataclass
class OnlineCosts:
    """The embedded engine's curves, refined by every step it times (thread-safe).

    Start-up measured them on a quiet context of 128 tokens; serving has longer contexts and
    neighbours that come and go. Each step's verification time (at its depth and widest row)
    and draft time move the nearest grid point by ``ONLINE_WEIGHT`` per step since it was last
    timed (``_weight``), after scaling
    the observation from the step's depth to the grid depth by the curves' own ratio. A step
    of one draft forward times the first forward; a step of F > 1, the later ones: (its draft
    time less the first forward's price) / (F - 1). So does
    the step's time outside its forwards: a plain step's moves ``overhead_s``; a speculative
    step's, less the plain overhead at its depth and divided by its drafts per sequence, moves
    ``draft_overhead_s``. A prompt's prefill alone in its step moves the prefill line
    (``observe_prefill``); the draft's catch-up line moves with it by the same factor (no step
    times the catch-up apart). Start-up timed prefills on a cold cache: 19.4 / 77.5 ms at
    32 / 128 tokens where serving prefilled in 15.6 / 52.5 (AVX2 CPU), which priced every
    request's prompt a third too dear and predicted its speed-up 12% low.

    **Stale points follow the plain step.** A step observes one or two points of a depth's
    curve; step costs are ratios to the plain step. A point no step has timed for
    ``STALE_STEPS`` steps is moved by the same factor as its depth's plain point whenever that
    one moves, so it keeps its last measured ratio to it. Otherwise a busier machine raises the
    plain point and leaves the untimed ones at quiet seconds, and the K nobody ran looks ever
    cheaper and gets chosen, wrongly (on the AVX2 CPU under a load average of 5-7: verifying 3
    tokens at batch 8 fell from 3.6x to 1.8x a plain step, at the same 248 ms).
    """

    base: CostReport
    target_s: list[list[float]] = field(default_factory=list)
    draft_s: list[float] = field(default_factory=list)  # a draft forward after the step's first
    draft_first_s: list[float] = field(default_factory=list)
    overhead_s: list[float] = field(default_factory=list)
    draft_overhead_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)  # at base.prefill_tokens; empty: not measured
    draft_prefill_s: list[float] = field(default_factory=list)
    steps: int = 0
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    # Observations per (depth index, n); n = 0: draft, -1: overhead, -2: draft overhead, -3: first draft;
    # (-1, i): the prefill of base.prefill_tokens[i].
    seen: dict[tuple[int, int], int] = field(default_factory=dict)
    last_seen: dict[tuple[int, int], int] = field(default_factory=dict)  # (depth index, n) -> step last timed
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _weight(self, point: tuple[int, int]) -> float:
        count = self.seen.get(point, 0)
        self.seen[point] = count + 1
        last = self.last_seen.get(point)
        self.last_seen[point] = self.steps
        gap = 1 if last is None else max(1, self.steps - last)  # steps since the point was last timed
        return max(min(MAX_ONLINE_WEIGHT, 1.0 - (1.0 - ONLINE_WEIGHT) ** gap), 1.0 / (count + 2))

    def __post_init__(self) -> None:
        base = self.base
        assert base.verify_cost is not None and base.draft_cost is not None
        self.target_s = [[p / 1000 * v for v in row] for p, row in zip(base.plain_step_ms, base.verify_cost,
                                                                         strict=True)]
        self.draft_s = [p / 1000 * d for p, d in zip(base.plain_step_ms, base.draft_cost, strict=True)]
        self.draft_first_s = ([p / 1000 * d for p, d in zip(base.plain_step_ms, base.draft_first_cost, strict=True)]
                              if base.draft_first_cost is not None else list(self.draft_s))
        zeros = (0.0,) * len(base.depths)
        self.overhead_s = [x / 1000 for x in base.step_overhead_ms or zeros]
        self.draft_overhead_s = [x / 1000 for x in base.draft_overhead_ms or zeros]
        if base.prefill_tokens and base.prefill_ms:
            self.prefill_s = [x / 1000 for x in base.prefill_ms]
            self.draft_prefill_s = [x / 1000 for x in base.draft_prefill_ms or ()]

    def _stale(self, point: tuple[int, int]) -> bool:
        last = self.last_seen.get(point)
        return last is None or self.steps - last > STALE_STEPS

    def _carry(self, i: int, factor: float) -> None:
        """Depth i's plain point moved by ``factor``: its stale points move with it."""
        row = self.target_s[i]
        for n in range(1, len(row)):
            if self._stale((i, n + 1)):
                row[n] *= factor
        if self._stale((i, 0)):
            self.draft_s[i] *= factor
        if self._stale((i, -3)):
            self.draft_first_s[i] *= factor

    def observe_step(self, depth: int, width: int, verify_s: float, draft_depth: int, draft_forwards: int,
                     draft_s: float, *, step_s: float = 0.0, drafts: int = 0, catch_up: bool = False) -> None:
        """One step: ``depth`` rows of up to ``width`` tokens verified in ``verify_s``, and
        ``draft_forwards`` draft forwards of up to ``draft_depth`` rows in ``draft_s``; the whole
        step took ``step_s`` (0: not timed) with ``drafts`` drafts over all its sequences.
        ``catch_up``: its first draft forward caught a draft up on a plain spell, which prices
        no forward the model holds (``policies.cost.catch_up_pays`` prices it from the prefill line): the
        draft time is not observed. Observed, K auto's steps after plain spells put the
        catch-up into the later forwards, which then cost more than the first one at depth 16."""
        with self._lock:
            if depth >= 1 and 1 <= width <= len(self.target_s[0]) and verify_s > 0:
                self._observe_verify(depth, width, verify_s)
            if draft_depth >= 1 and draft_forwards >= 1 and draft_s > 0 and not catch_up:
                self._observe_draft(draft_depth, draft_forwards, draft_s)
            if step_s > 0 and verify_s > 0 and depth >= 1:
                self._observe_overhead(depth, step_s - verify_s - max(0.0, draft_s), drafts)
            self.steps += 1

    def _observe_verify(self, depth: int, width: int, verify_s: float) -> None:
        """The target's forward of ``width`` tokens per row at ``depth``: its nearest grid point
        (a plain one carries the depth's stale points with it)."""
        depths = self.base.depths
        i, n = _nearest(depths, depth), width - 1
        column = [row[n] for row in self.target_s]
        scaled = verify_s * column[i] / interpolate(depths, column, depth)
        old = self.target_s[i][n]
        self.target_s[i][n] += self._weight((i, n + 1)) * (scaled - old)
        if n == 0 and old > 0:
            self._carry(i, self.target_s[i][n] / old)

    def _observe_draft(self, draft_depth: int, draft_forwards: int, draft_s: float) -> None:
        """The step's ``draft_forwards`` draft forwards over ``draft_depth`` rows: the first
        forward's point for one forward, the later ones' (less the first's price) for more."""
        depths = self.base.depths
        i = _nearest(depths, draft_depth)
        if self.base.draft_first_cost is None:  # a model that prices every forward alike
            scaled = draft_s / draft_forwards * _ratio(self.draft_s, i, depths, draft_depth)
            self.draft_s[i] += self._weight((i, 0)) * (scaled - self.draft_s[i])
        elif draft_forwards == 1:
            scaled = draft_s * _ratio(self.draft_first_s, i, depths, draft_depth)
            self.draft_first_s[i] += self._weight((i, -3)) * (scaled - self.draft_first_s[i])
        else:
            first = interpolate(depths, self.draft_first_s, draft_depth)
            later = max(0.0, draft_s - first) / (draft_forwards - 1)
            scaled = later * _ratio(self.draft_s, i, depths, draft_depth)
            self.draft_s[i] += self._weight((i, 0)) * (scaled - self.draft_s[i])

    def _observe_overhead(self, depth: int, outside: float, drafts: int) -> None:
        """``outside``: seconds of the step outside its forwards."""
        depths, i = self.base.depths, _nearest(self.base.depths, depth)
        per_sequence = drafts / depth
        if drafts <= 0:
            scaled = outside * _ratio(self.overhead_s, i, depths, depth)
            self.overhead_s[i] += self._weight((i, -1)) * (scaled - self.overhead_s[i])
        elif per_sequence >= 1:
            # Fewer drafts than sequences would divide timing noise by a small number; such
            # steps (a few sequences speculating in a plain batch) teach nothing reliable here.
            per_draft = (outside - interpolate(depths, self.overhead_s, depth)) / per_sequence
            scaled = per_draft * _ratio(self.draft_overhead_s, i, depths, depth)
            self.draft_overhead_s[i] += self._weight((i, -2)) * (scaled - self.draft_overhead_s[i])

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prompt of ``tokens`` prefilled alone in ``seconds`` (the target's forward)."""
        lengths = self.base.prefill_tokens
        if not lengths or not self.prefill_s or tokens < 1 or seconds <= 0:
            return
        with self._lock:
            i = _nearest(lengths, tokens)
            scaled = seconds * self.prefill_s[i] / max(1e-9, _line(lengths, self.prefill_s, tokens))
            old = self.prefill_s[i]
            self.prefill_s[i] += self._weight((-1, i)) * (scaled - old)
            if i < len(self.draft_prefill_s) and old > 0:
                self.draft_prefill_s[i] *= self.prefill_s[i] / old

    def observe_drafts(self, proposed: int, accepted: int) -> None:
        with self._lock:
            self.acceptance.add(proposed, accepted)

    @property
    def alpha(self) -> float | None:
        return self.acceptance.value

    def report(self) -> CostReport:
        with self._lock:
            target, draft, steps, alpha = [list(r) for r in self.target_s], list(self.draft_s), self.steps, self.alpha
            # The first forward is a later one plus the reads and catch-up before it: never
            # cheaper. A first forward no step has timed lately (K auto ran K > 1 there) keeps its
            # start-up price while the later ones follow serving, and came out below them (0.18
            # against 0.30 of a plain step at batch 8 on the AVX2 EPYC), pricing K = 1 cheap.
            draft_first = [max(f, n) for f, n in zip(self.draft_first_s, self.draft_s, strict=True)]
            overhead, draft_overhead = list(self.overhead_s), list(self.draft_overhead_s)
            prefill, draft_prefill = list(self.prefill_s), list(self.draft_prefill_s)
        source: CostSource = "online" if steps else self.base.source
        live = report_from_forward_times(self.base.depths, target, draft, source=source, overhead_s=overhead,
                                         draft_overhead_s=draft_overhead,
                                         draft_first_s=None if self.base.draft_first_cost is None else draft_first)
        return replace(self.base, plain_step_ms=live.plain_step_ms, step_cost=live.step_cost,
                       verify_cost=live.verify_cost, draft_cost=live.draft_cost,
                       draft_first_cost=live.draft_first_cost, source=live.source,
                       step_overhead_ms=live.step_overhead_ms, draft_overhead_ms=live.draft_overhead_ms,
                       online_steps=steps, acceptance=None if alpha is None else round(alpha, 4),
                       prefill_ms=tuple(round(1000 * x, 4) for x in prefill) if prefill else self.base.prefill_ms,
                       draft_prefill_ms=(tuple(round(1000 * x, 4) for x in draft_prefill) if draft_prefill
                                         else self.base.draft_prefill_ms))


@dataclass
class StepTimeCosts:
    """Whole-step timings only (vLLM): an EWMA of step seconds per (grid depth, K).

    vLLM times neither its verification nor its drafting apart, so the estimate is the
    speculative step's whole cost relative to a plain step at the same depth. K cells never
    observed at a depth are filled on the line cost(K) = 1 + slope·K through the observed
    ones (drafting and verification both grow about linearly in K); a depth with no
    observations borrows its nearest observed neighbour's curve. No report until a plain
    step and a speculative one have been seen.
    """

    depths: tuple[int, ...]
    max_k: int
    cells: dict[tuple[int, int], float] = field(default_factory=dict)  # (depth index, K) -> seconds
    steps: int = 0
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, depth: int, k: int, step_s: float) -> None:
        if depth < 1 or step_s <= 0 or not 0 <= k <= self.max_k:
            return
        key = (_nearest(self.depths, depth), k)
        with self._lock:
            old = self.cells.get(key)
            self.cells[key] = step_s if old is None else old + STEP_TIME_WEIGHT * (step_s - old)
            self.steps += 1

    def report(self) -> CostReport | None:
        with self._lock:
            cells, steps, alpha = dict(self.cells), self.steps, self.acceptance.value
        curves: dict[int, tuple[float, list[float]]] = {}
        for i in range(len(self.depths)):
            plain = cells.get((i, 0))
            spec = [(k, s / plain) for (j, k), s in cells.items() if j == i and k > 0] if plain else []
            if not plain or not spec:
                continue
            slope = max(0.0, sum(k * (c - 1) for k, c in spec) / sum(k * k for k, _ in spec))
            curves[i] = (plain, [1.0] + [cells[(i, k)] / plain if (i, k) in cells else 1 + slope * k
                                         for k in range(1, self.max_k + 1)])
        if not curves:
            return None
        observed = sorted(curves)
        rows = [curves[_closest(observed, i)] for i in range(len(self.depths))]
        # Whole-step timings already hold each step's work outside the forwards: no separate term.
        zeros = (0.0,) * len(self.depths)
        return CostReport(depths=self.depths, plain_step_ms=tuple(round(1000 * p, 4) for p, _ in rows),
                          step_cost=tuple(tuple(round(c, 4) for c in costs) for _, costs in rows),
                          step_overhead_ms=zeros, draft_overhead_ms=zeros, source="estimated", online_steps=steps,
                          acceptance=None if alpha is None else round(alpha, 4))


def _closest(observed: Sequence[int], i: int) -> int:
    return min(observed, key=lambda j: abs(j - i))


