"""Start-up measurement of the embedded engine's costs, on the machine that runs it.

Before a worker reports ready it spends at most ``budget_s`` here (or nothing, on a cache hit):

1. **Precision.** Each target configuration (``workers.dtype: auto``: bfloat16, prepacked where
   the CPU can; float32 on the kernels and on ``F.linear``; and where the CPU has AVX512-BF16,
   float32 on the kernels with bfloat16 products; and where make install laid the GGUF's blocks
   out, q4_1 on them: ``quantized.py``) is loaded, checked for bit-identical verification on this CPU
   (a (K+1)-token verification and a padded batch against one-token-at-a-time decoding, bit
   for bit, on the real models) and timed at batch 1 for n = 1..max_k+1 new tokens, next to
   the draft. The candidates take turns, one forward each, so a noisy neighbour hits them
   alike. The choice is the best predicted batch-1 throughput (at ``REFERENCE_ALPHA``) among
   the bit-identical ones; ``workers.exact: false`` admits the others. CPU flags decide nothing.
2. **Step overhead.** The engine itself steps the chosen target and the draft, plain and
   speculative, and the time each step spends outside its forwards (sampling, bookkeeping) is
   kept: at batch 1 for a plain step and per draft, and at a deeper batch for a plain step
   (``workers/engines/embedded/measurement/steps.py``). Forward times alone price speculation too high where
   forwards are cheap, since a plain step pays that work too. The same steps time the engine's draft
   phase at K = 1 and a deeper K, at every depth up to the deeper batch: a step's first draft
   forward costs more than the later ones (``draft_split``).
3. **Depth.** The chosen target and the draft are timed at the deeper batch depths (1, 2, 4, ...,
   max_slots) for a subset of n, interpolated in n; points the budget did not reach are
   extrapolated from the deepest measured depth, and the report counts both.
4. **Prefill.** A prompt's prefill at batch 1 at two lengths, the target's and the draft's
   catch-up on it (``measure_prefill``): what a whole request's predicted speed-up adds to its
   decode steps' (``CostReport.request_speedup``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from policies.tree import MAX_TREE_NODES
from workers.costs.cache import CostCache, cpu_label
from workers.costs.cost_report import (
    CostReport,
    PrecisionCandidate,
    PrecisionChoice,
    depth_grid,
    interpolate,
    report_from_forward_times,
)
from workers.engines.embedded.config import stored_weight_dtype
from workers.engines.embedded.forwards import native_forward
from workers.engines.embedded.kv_cache import CacheBatch, KVCache, padded_span
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.measurement.common import fill_line, scratch_cache, timed
from workers.engines.embedded.measurement.precision import REFERENCE_ALPHA, best_b1, choose_precision, target_configs
from workers.engines.embedded.measurement.settings import MeasureSettings, TargetDtype
from workers.engines.embedded.measurement.steps import draft_split, measure_overheads
from workers.engines.embedded.measurement.trees import TREE_LEVEL_WIDTH, measure_tree_costs
from workers.engines.embedded.projections import TORCH_DTYPES, Products
from workers.engines.embedded.quantized import blocks_unavailable, load_target

log = logging.getLogger(__name__)

CONTEXT = 128  # tokens already in the cache when a forward is timed
REPS = 3  # timings per point; the median is kept
# Prompt lengths a prefill is timed at; the cost of other lengths is on the line through them.
PREFILL_TOKENS = (32, 128)


def _forward(model: LlamaForCausalLM, cache: KVCache, depth: int, n: int, positions: int,
             row_invariant: bool) -> Callable[[], None]:
    """One cached forward of ``depth`` rows × ``n`` new tokens after CONTEXT tokens, as the engine runs it."""
    tokens = torch.full((depth, n), 7, dtype=torch.long)
    rows = torch.arange(depth).repeat_interleave(n)
    cols = torch.arange(n).repeat(depth)
    lists, slots, starts = [[7] * n for _ in range(depth)], list(range(depth)), [CONTEXT] * depth

    def run() -> None:
        if native_forward(model, cache, lists, slots, starts, list(range(depth * n)), row_invariant) is not None:
            return
        batch = CacheBatch.build(list(range(depth)), [CONTEXT] * depth, [n] * depth, n, positions,
                                 row_invariant=row_invariant)
        if depth == 1:
            model.forward_cached(tokens, cache, batch)
        else:
            model.forward_cached(tokens, cache, batch, rows, cols)
    return run


def _prefill(model: LlamaForCausalLM, n: int) -> Callable[[], None]:
    """A prompt of ``n`` tokens into an empty cache slot, the last token's logits out, as the
    engine runs a prefill (fused attention, a forward of its own) and the draft's catch-up on a
    prompt (its first drafting step)."""
    positions = padded_span(n + 1)  # the prompt's span, not the model's window (SmolLM2's: 377 MB a slot)
    cache = scratch_cache(model, 1, positions)
    lists = [[7 + i % 64 for i in range(n)]]
    tokens = torch.tensor(lists)

    def run() -> None:
        if native_forward(model, cache, lists, [0], [0], [n - 1], False) is not None:
            return
        batch = CacheBatch.build([0], [0], [n], n, positions, row_invariant=False)
        model.forward_cached(tokens, cache, batch, torch.zeros(1, dtype=torch.long), torch.tensor([n - 1]))
    return run


@torch.inference_mode()
def measure_prefill(target: LlamaForCausalLM,
                    draft: LlamaForCausalLM | None) -> tuple[tuple[float, ...], tuple[float, ...] | None]:
    """Milliseconds to prefill PREFILL_TOKENS-long prompts at batch 1: the target's, and the
    draft's catch-up on the prompt (one token more: the first output), the two taking turns.

    Decode steps are what K is chosen for; a request's speed-up also pays its prompt, once in
    plain decoding and once more by the draft in speculative, so a whole request's predicted
    speed-up (``CostReport.request_speedup``) needs both."""
    runs: dict[tuple[str, int, int], Callable[[], None]] = {}
    for n in PREFILL_TOKENS:
        runs[("target", 1, n)] = _prefill(target, n)
        if draft is not None:
            runs[("draft", 1, n)] = _prefill(draft, n + 1)
    # All REPS rounds (no deadline); no prompt length is 1, so no run is taken for a plain step.
    ms = {key: round(1000 * s, 4) for key, s in _time_rounds(runs, math.inf).items()}
    drafts = tuple(ms[("draft", 1, n)] for n in PREFILL_TOKENS) if draft is not None else None
    return tuple(ms[("target", 1, n)] for n in PREFILL_TOKENS), drafts


@torch.inference_mode()
def verification_bit_identical(model: LlamaForCausalLM, n: int) -> bool:
    """Whether this model, on this CPU, scores tokens in an n-token verification, and in a padded
    batch, exactly as it scores them decoded one at a time (bit for bit). Stops at the first
    difference, so an inexact configuration costs a few forwards only."""
    positions = 256
    gen = torch.Generator().manual_seed(3)
    # A prompt whose verification crosses a 64-key block (span padding) and a short one riding in
    # the same batch.
    prompts = [torch.randint(5, model.cfg.vocab_size, (length,), generator=gen).tolist() for length in (60, 7)]
    new = torch.randint(5, model.cfg.vocab_size, (n,), generator=gen).tolist()
    cache = scratch_cache(model, 2, positions)
    for slot, prompt in enumerate(prompts):  # a prefill, fused as the engine runs one: same cache either way
        model.forward_cached(torch.tensor([prompt]), cache, CacheBatch.build(
            [slot], [0], [len(prompt)], len(prompt), positions, row_invariant=False),
            torch.zeros(1, dtype=torch.long), torch.tensor([len(prompt) - 1]))

    def scratch() -> KVCache:
        return KVCache([k.clone() for k in cache.k], [v.clone() for v in cache.v])

    def alone(slot: int, tokens: list[int]) -> torch.Tensor:
        sc, start = scratch(), len(prompts[slot])
        return torch.cat([model.forward_cached(torch.tensor([[t]]), sc, CacheBatch.build(
            [slot], [start + i], [1], 1, positions))[0] for i, t in enumerate(tokens)])

    one_by_one = alone(0, new)
    verified = model.forward_cached(torch.tensor([new]), scratch(), CacheBatch.build([0], [60], [n], n, positions))
    if not torch.equal(verified[0], one_by_one):
        return False
    padded = torch.zeros((2, n), dtype=torch.long)
    padded[0], padded[1, 0] = torch.tensor(new), new[0]
    out = model.forward_cached(padded, scratch(), CacheBatch.build([0, 1], [60, 7], [n, 1], n, positions))
    return torch.equal(out[0], one_by_one) and torch.equal(out[1, :1], alone(1, new[:1]))



def measure(settings: MeasureSettings) -> CostReport:
    return measure_with_model(settings)[0]


def measure_with_model(settings: MeasureSettings) -> tuple[CostReport, LlamaForCausalLM]:
    """The report and the chosen target, loaded (the engine serves it; no second load)."""
    started = time.perf_counter()
    deadline = started + settings.budget_s
    max_k = settings.max_k if settings.draft is not None else 0
    width = max_k + 1
    shape = _Shape(width, CONTEXT + width + 64, settings.max_slots, sorted({n for n in (1, 2, 4, width) if n <= width}))
    loaded = _load_candidates(settings, shape)
    times = _time_candidates(loaded, shape, started + 0.55 * settings.budget_s)
    candidates = _rank_candidates(loaded, shape, times)
    chosen, why = choose_precision(candidates, settings)
    chosen_config = next(d for d, m in loaded.targets.items() if loaded.configs[d][0] == chosen.target
                         and m.prepacked == chosen.prepacked and m.products == chosen.products)
    target, cache = loaded.targets[chosen_config], loaded.caches[chosen_config]
    draft, draft_cache = loaded.drafts.get(chosen.products), loaded.draft_caches.get(chosen.products)
    depths = depth_grid(shape.full)
    engine_times = measure_overheads(target, draft, max_k, depths, started + 0.7 * settings.budget_s)
    prefill_ms, draft_prefill_ms = measure_prefill(target, draft)
    tree_verify, tree_draft = (measure_tree_costs(target, draft, MAX_TREE_NODES, TREE_LEVEL_WIDTH,
                                                  started + 0.75 * settings.budget_s)
                               if draft is not None else (None, None))
    # Phase 2, the chosen target alone: every n at batch 1, then the full batch and the depths
    # between (a sparse n each), until the budget ends. A depth's points are timed together,
    # taking turns with its plain step, and joined to what that depth already has through the
    # plain step's ratio: step costs are ratios within a depth, and points timed seconds apart on
    # a shared machine differ by its load (a 2-token step at batch 64 once came out 1.05x a plain
    # one, timed alone; 1.9x, timed in turns). Phase 1's timings of the chosen target stand in
    # only for what phase 2 does not reach: there each forward ran after another candidate's, and
    # on the AMX Xeon a plain step at batch 1 came out 2.21 ms there against 1.18 ms alone, while
    # its 2- and 4-token forwards, run after the draft's, did not; joined through that plain step,
    # verification at batch 1 priced 2 / 3 / 4 tokens at 0.76 / 1.05 / 0.66x a plain step, and
    # the start-up model predicted 2.68x where bench.engine measured 1.69x (docs/measured.md).
    phase1 = {shape.full: {1: times[(chosen_config, shape.full, 1)]}}
    phase1[1] = {n: times[(chosen_config, 1, n)] for n in shape.n_plan}  # (full may be 1: the same point)
    phase1_draft = times[(f"draft-{chosen.products}", 1, 1)] if draft is not None else None
    measured: dict[int, dict[int, float]] = {}
    draft_measured: dict[int, float] = {}
    _time_plain_steps(target, cache, depths, shape, deadline, measured)
    _time_depth_groups(target, cache, draft, draft_cache, depths, shape, deadline, measured, draft_measured)
    for depth, row in phase1.items():  # what the budget left untimed in phase 2
        if 1 not in measured.get(depth, {}):
            measured[depth] = dict(row)
    if phase1_draft is not None:
        draft_measured.setdefault(1, phase1_draft)
    measured = {d: row for d, row in measured.items() if 1 in row}
    target_s, draft_s = _curves(depths, measured, draft_measured, width, draft is not None)
    draft_first_s, draft_next_s = (draft_split(depths, draft_s, engine_times.draft_phase_s) if draft is not None
                                   else (None, draft_s))
    elapsed = time.perf_counter() - started
    choice = PrecisionChoice(chosen.target, chosen.prepacked, chosen.bit_identical, why, REFERENCE_ALPHA,
                             tuple(candidates), chosen.products)
    log.info("cost model measured in %.2fs: %s", elapsed, why)
    report = report_from_forward_times(depths, target_s, draft_next_s, source="measured", precision=choice,
                                       overhead_s=engine_times.overhead_s,
                                       draft_overhead_s=engine_times.draft_overhead_s, draft_first_s=draft_first_s,
                                       measured_points=sum(len(r) for r in measured.values()),
                                       total_points=width * len(depths), measure_s=round(elapsed, 3), cpu=cpu_label(),
                                       prefill_tokens=PREFILL_TOKENS, prefill_ms=prefill_ms,
                                       draft_prefill_ms=draft_prefill_ms, tree_verify_cost=tree_verify,
                                       tree_draft_cost=tree_draft)
    return report, target


@dataclass(frozen=True)
class _Shape:
    """The forwards the measurement times."""

    width: int  # tokens per sequence in the widest verification, max_k + 1
    positions: int  # the scratch caches' length
    full: int  # the full batch, max_slots
    n_plan: list[int]  # the tokens per sequence every depth is timed at, when the budget lets it


@dataclass(frozen=True)
class _Candidates:
    """Every target configuration, loaded and checked, with the drafts and scratch caches."""

    configs: dict[str, tuple[TargetDtype, bool, Products]]  # target_configs
    targets: dict[str, LlamaForCausalLM]
    drafts: dict[str, LlamaForCausalLM]  # by products
    identical: dict[str, bool]  # verification bit-identical to plain decoding
    caches: dict[str, KVCache]
    draft_caches: dict[str, KVCache]


def _load_candidates(settings: MeasureSettings, shape: _Shape) -> _Candidates:
    configs = target_configs(settings.dtype, "float32" if stored_weight_dtype(settings.target) == "float32"
                             else "bfloat16", blocks_unavailable(settings.target))
    # The draft multiplies as its target does (load_draft): one draft per products among the
    # candidates, each candidate priced with its own.
    drafts: dict[str, LlamaForCausalLM] = {}
    if settings.draft is not None:
        drafts = {p: LlamaForCausalLM.load_draft(settings.draft, TORCH_DTYPES[settings.draft_dtype], p,
                                                 target=settings.target)
                  for p in sorted({c[2] for c in configs.values()})}
    targets = {d: load_target(settings.target, configs[d][0], configs[d][1], configs[d][2]) for d in configs}
    identical = {d: verification_bit_identical(m, max(2, shape.width)) for d, m in targets.items()}
    caches = {d: scratch_cache(m, shape.full, shape.positions) for d, m in targets.items()}
    draft_caches = {p: scratch_cache(m, shape.full, shape.positions) for p, m in drafts.items()}
    return _Candidates(configs, targets, drafts, identical, caches, draft_caches)


def _time_candidates(loaded: _Candidates, shape: _Shape, until: float) -> dict[tuple[str, int, int], float]:
    """Phase 1, every candidate in turn (one forward each per round): batch 1 at a few n, and a
    plain step at full batch (capacity under load)."""
    runs: dict[tuple[str, int, int], Callable[[], None]] = {}
    for d, model in loaded.targets.items():
        runs |= {(d, 1, n): _forward(model, loaded.caches[d], 1, n, shape.positions, True) for n in shape.n_plan}
        runs[(d, shape.full, 1)] = _forward(model, loaded.caches[d], shape.full, 1, shape.positions, True)
    for p, model in loaded.drafts.items():
        runs[(f"draft-{p}", 1, 1)] = _forward(model, loaded.draft_caches[p], 1, 1, shape.positions, False)
    return _time_rounds(runs, until, runs.get(("draft-float32", 1, 1)))


def _rank_candidates(loaded: _Candidates, shape: _Shape,
                     times: dict[tuple[str, int, int], float]) -> list[PrecisionCandidate]:
    """Phase 1's timings as what ``choose_precision`` compares."""
    candidates = []
    for d, model in loaded.targets.items():
        curve = fill_line({n: times[(d, 1, n)] for n in shape.n_plan}, shape.width)
        tok_s, k = best_b1(curve, times.get((f"draft-{loaded.configs[d][2]}", 1, 1)), REFERENCE_ALPHA)
        candidates.append(PrecisionCandidate(loaded.configs[d][0], model.prepacked, loaded.identical[d],
                                             round(1000 * curve[0], 3), round(1000 * curve[-1], 3), round(tok_s, 1),
                                             k, round(shape.full / times[(d, shape.full, 1)], 1), model.products))
    return candidates


def _time_plain_steps(target: LlamaForCausalLM, cache: KVCache, depths: tuple[int, ...], shape: _Shape,
                      deadline: float, measured: dict[int, dict[int, float]]) -> None:
    """The plain step at every depth past 1 into ``measured``, first: it is what every decision at
    a depth is measured against, and between depths it is not linear. On the AVX2 CPU a plain
    step at depth 8 cost 4.5 ms, as much as at depth 4, where the line from depth 4 to 16 said
    6.9 ms; K auto then decoded batch 8 at K=1 and lost 14% to plain (bench.engine). A depth
    timed plain only takes its shape in n from the nearest depth timed at several (_curves)."""
    plain_steps = {("target", d, 1): _forward(target, cache, d, 1, shape.positions, True) for d in depths[1:]}
    if plain_steps and time.perf_counter() < deadline:
        for (_, depth, _), seconds in _time_rounds(plain_steps, deadline).items():
            measured.setdefault(depth, {})[1] = seconds


def _time_depth_groups(target: LlamaForCausalLM, cache: KVCache, draft: LlamaForCausalLM | None,
                       draft_cache: KVCache | None, depths: tuple[int, ...], shape: _Shape, deadline: float,
                       measured: dict[int, dict[int, float]], draft_measured: dict[int, float]) -> None:
    """Every n at batch 1; then each deeper depth's draft forward and 2-token verification (K=1:
    whether speculation pays there at all; the slope in n, from the plain step), the full
    batch's last; then the rest of n_plan at each depth, until the budget ends. The shape in n
    at batch 1 said nothing about depth 8, where a 2-token step cost 2.4x a plain one against
    1.4x at batch 1 (bench.engine's refined costs, AVX2 CPU). Each depth's points are joined to
    what it has through its plain step's ratio."""
    width, full, positions = shape.width, shape.full, shape.positions
    drafting = [0] if draft is not None else []
    groups: list[tuple[int, list[int]]] = [(1, [*drafting, *range(1, width + 1)])]
    if width > 1:
        groups += [(d, [*drafting, 2]) for d in (*depths[1:-1], full) if d > 1]
    groups += [(d, drafting + shape.n_plan) for d in (full, *depths[1:-1])]
    for depth, planned in groups:
        # What this depth has not been timed at: its draft forward (n = 0), verifications (n > 1).
        done = measured.get(depth, {})
        ns = [n for n in planned if (n == 0 and depth not in draft_measured) or (n > 1 and n not in done)]
        if not ns:
            continue
        if time.perf_counter() > deadline:
            break
        group: dict[tuple[str, int, int], Callable[[], None]] = {
            ("target", depth, 1): _forward(target, cache, depth, 1, positions, True)}
        for n in ns:
            if n == 0:
                assert draft is not None and draft_cache is not None
                group[("draft", depth, 1)] = _forward(draft, draft_cache, depth, 1, positions, False)
            else:
                group[("target", depth, n)] = _forward(target, cache, depth, n, positions, True)
        before_verify = None
        if draft is not None and draft_cache is not None:
            before_verify = group.get(("draft", depth, 1)) or _forward(draft, draft_cache, depth, 1, positions, False)
        timed = _time_rounds(group, deadline, before_verify)
        row = measured.setdefault(depth, {})
        scale = row[1] / timed[("target", depth, 1)] if 1 in row else 1.0
        row.setdefault(1, timed[("target", depth, 1)])
        for (kind, _, n), seconds in timed.items():
            if kind == "draft":
                draft_measured[depth] = seconds * scale
            elif n > 1:
                row[n] = seconds * scale


@torch.inference_mode()
def _time_rounds(runs: dict[tuple[str, int, int], Callable[[], None]], until: float,
                 before_verify: Callable[[], None] | None = None) -> dict[tuple[str, int, int], float]:
    """Median seconds of each run, the runs taking turns (REPS rounds, fewer past ``until``).

    A plain step (a target forward of 1 token a row) is timed right after an untimed one, as
    plain decoding runs them: back to back, the part of the weights the last-level cache kept
    is read from there. Timed in turns, after other forwards had pushed it out, a plain step
    came out 16-27% dearer than in a plain engine on the AVX2 CPU (bench.engine's step
    breakdown against its forward times), and the predicted speed-up up to 13% too high.
    A verifying forward (target, more than 1 token a row) is timed right after an untimed
    ``before_verify`` (a draft forward at its depth), as a speculative step runs it: after the
    draft's forwards have had their turn at the cache.
    """
    for run in runs.values():
        run()  # warm-up: first-call allocations
    samples: dict[tuple[str, int, int], list[float]] = {key: [] for key in runs}
    for rep in range(REPS):
        if rep > 0 and time.perf_counter() > until:
            break
        for key, run in runs.items():
            if not key[0].startswith("draft"):  # "draft", or a candidate's "draft-<products>"
                if key[2] == 1:
                    run()
                elif before_verify is not None:
                    before_verify()
            samples[key].append(timed(run))
    return {key: statistics.median(s) for key, s in samples.items()}


def _curves(depths: tuple[int, ...], measured: dict[int, dict[int, float]], draft_measured: dict[int, float],
            width: int, has_draft: bool) -> tuple[list[list[float]], list[float]]:
    """Every (depth, n) in seconds: measured rows filled in n; depths not reached linear between
    the measured depths around them (the full batch is measured early, so there are two)."""
    # A depth timed at one n only (the budget ran out) keeps its plain step and takes its shape
    # in n from the plain steps' growth in rows, calibrated at the nearest depth timed at
    # several n (shape_by_rows): one point says nothing about verification.
    shaped = {d: fill_line(r, width) for d, r in measured.items() if len(r) >= 2 or width == 1}
    rows = dict(shaped)
    plain = {d: r[1] for d, r in measured.items()}
    for d in measured:
        if d not in shaped and shaped:
            near = min(shaped, key=lambda s: abs(s - d))
            rows[d] = shape_by_rows(plain, near, shaped[near], d)
    target_s = _verify_rising_in_depth([rows[d] if d in rows else _between(rows, d) for d in depths])
    draft_s = []
    for i, depth in enumerate(depths):
        if not has_draft:
            draft_s.append(0.0)
        elif depth in draft_measured:
            draft_s.append(draft_measured[depth])
        else:  # as the plain step grows from the nearest measured depth below
            below = max(d for d in draft_measured if d <= depth)
            draft_s.append(draft_measured[below] * target_s[i][0] / target_s[depths.index(below)][0])
    return target_s, draft_s


def shape_by_rows(plain: dict[int, float], near: int, near_row: list[float], depth: int) -> list[float]:
    """Seconds of an n-token forward at ``depth`` (n = 1..len(near_row)), timed plain only.

    A forward reads the weights once and then works per row, so it costs about P(rows), the plain
    step at that many sequences (piecewise linear in the measured depths, extended by the last
    slope). A verification row's n tokens share one sequence's bookkeeping, so each extra token
    costs a share s_n of a whole sequence's: s_n is what ``near`` (a depth timed at several n)
    measured, (t(near, n) - t(near, 1)) / (P(near n) - P(near)). Never below the nearest shape's
    ratio. Borrowing that ratio alone priced verification at depth 8 as at depth 1: on the real
    pair (SmolLM2-135M, AMX Xeon) 3 tokens per sequence at 1.13x a plain step, where the plain
    steps' growth says about 1.8x, and K auto speculated at concurrency 16 at 0.6x plain's speed
    (bench.serve_default)."""
    depths = sorted(plain)
    times = [plain[d] for d in depths]

    def at_rows(rows: int) -> float:
        return interpolate(depths, times, rows, extend=True)

    out = []
    for n, t in enumerate(near_row, start=1):
        borrowed = t * plain[depth] / near_row[0]
        grown = at_rows(near * n) - at_rows(near)
        share = min(1.0, max(0.0, (t - near_row[0]) / grown)) if grown > 0 else 0.0
        out.append(max(borrowed, plain[depth] + share * (at_rows(depth * n) - at_rows(depth))))
    return out


def _verify_rising_in_depth(target_s: list[list[float]]) -> list[list[float]]:
    """Each n-token forward's ratio to the plain forward, made non-decreasing in depth.

    A forward reads the weights once and computes per row: with t(rows) = W + c·rows, verifying
    n tokens at depth d costs (W + c·d·n) / (W + c·d) of a plain step, which rises with d. A
    timing below a shallower depth's ratio is noise (three timings on a shared machine), and a
    cheap one made K auto draft where it lost: on the AVX2 EPYC a 2-token step at depth 64
    came out at 1.56x plain where depth 32 had 1.78x and serving then 1.83x, and K auto's
    first round at batch 64 drafted K = 1-2 and ran at 0.77x plain (bench.engine)."""
    out, floor = [], [0.0] * len(target_s[0])
    for row in target_s:
        plain = row[0]
        out.append([t if t / plain >= f else plain * f for f, t in zip(floor, row, strict=True)])
        floor = [max(f, t / plain) for f, t in zip(floor, row, strict=True)]
    return out


def _between(rows: dict[int, list[float]], depth: int) -> list[float]:
    lo = max(d for d in rows if d < depth)
    hi = min((d for d in rows if d > depth), default=None)
    if hi is None:  # unreachable while the full batch is measured; proportional to depth else
        return [t * depth / lo for t in rows[lo]]
    w = (depth - lo) / (hi - lo)
    return [(1 - w) * a + w * b for a, b in zip(rows[lo], rows[hi], strict=True)]


def measure_or_load(settings: MeasureSettings,
                    cache_dir: Path | None) -> tuple[CostReport, LlamaForCausalLM | None]:
    """The cached report for these settings on this machine, else a fresh measurement (stored,
    and returned with the chosen target already loaded)."""
    cache = CostCache(cache_dir)
    key = settings.cache_key()
    with cache.locked(key):
        cached = cache.load(key)
        if cached is not None:
            log.info("cost model from the cache (%s)", cache.path(key))
            return dataclasses.replace(cached, source="cache"), None
        report, target = measure_with_model(settings)
        cache.store(key, report)
        return report, target
