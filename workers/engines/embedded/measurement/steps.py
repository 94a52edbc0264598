"""Start-up timings of the serving engine's own steps (``workers/engines/embedded/measurement/measure.py``, step 2).

Forward times alone miss what a step spends outside its forwards (sampling, bookkeeping,
which a plain step pays too) and what a step's first draft forward costs beyond a later one
(the target's forward just streamed its weights past the draft's, and the draft catches up on
the last step's tokens). Both are timed here on a ``SpeculativeEngine`` over the models that
will serve.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from workers.api.generation import SamplingParams
from workers.costs.cost_report import interpolate
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.llama import LlamaForCausalLM

# The deeper batch the step overhead is timed at (or max_slots, if smaller): deep enough that
# its per-sequence part stands out of timing noise, shallow enough to be cheap.
OVERHEAD_DEPTH = 16
OVERHEAD_TOKENS = 256  # each timed sequence's budget
OVERHEAD_POSITIONS = 2 * OVERHEAD_TOKENS
# The deeper K the draft phase is timed at beyond batch 1 (draft_split): K = 1 and this give
# the later forwards' cost; a deeper K would only cost start-up time.
SPLIT_K = 4


@dataclass(frozen=True)
class EngineTimings:
    """What ``measure_overheads`` timed on the serving engine's own steps."""

    overhead_s: list[float]  # per grid depth: a plain step's work outside its forwards
    draft_overhead_s: list[float]  # per grid depth: what each draft per sequence adds to it
    draft_phase_s: dict[tuple[int, int], float]  # (depth, K): the step's drafting, all K forwards


@torch.inference_mode()
def measure_overheads(target: LlamaForCausalLM, draft: LlamaForCausalLM | None, max_k: int,
                      depths: tuple[int, ...], until: float) -> EngineTimings:
    """Per grid depth, seconds of a plain step outside its forwards, and what each draft per
    sequence adds to that, timed on the engine that will serve (``SpeculativeEngine``); and
    its draft phase at K = 1 and a deeper K (``max_k`` at batch 1, at most SPLIT_K deeper) at
    every grid depth up to the deeper batch.

    Outside = the whole step less the engine's own draft and target phases, step by step, so
    context length and machine load cancel. Timed at batch 1 (plain and at ``max_k``,
    alternating) and plain at a deeper batch; the plain part is linear in depth between them
    (per-sequence work) and beyond; the per-draft part is per (sequence, draft), so it grows in
    proportion to depth. Rounds stop at ``until``, after at least one of each.
    """
    k = max_k if draft is not None else 0
    deep = min(depths[-1], OVERHEAD_DEPTH)
    phases: dict[tuple[int, int], list[float]] = {}
    # Caches as long as the timed sequences get (OVERHEAD_TOKENS from one-token prompts), not the
    # model's window: SmolLM2's 8,192 positions at 16 slots were 6 GB to zero, 12 s of start-up.
    engine = SpeculativeEngine(target, draft, max_slots=deep, max_k=k, max_positions=OVERHEAD_POSITIONS)
    greedy = SamplingParams(temperature=0.0)
    live: list[str] = []  # sequences in the engine, oldest first
    added = 0

    def outside(depth: int, step_k: int) -> float | None:
        nonlocal added
        while len(live) > depth:  # leave exactly ``depth`` sequences
            engine.abort(live.pop())
        while len(live) < depth:  # one-token prompts: no prefill forward
            live.append(f"o{added}")
            engine.add(GenerationRequest(live[-1], [5 + added % 64], OVERHEAD_TOKENS, greedy))
            added += 1
        for request_id in live:
            engine.set_k(request_id, step_k)
        for event in engine.step():
            if event.finish_reason is not None:
                live.remove(event.request_id)
        shape = engine.last_shape
        if shape.target_rows != depth or shape.prefill or shape.drafts != depth * step_k:
            return None  # a sequence ended or drafted less (end of its budget): not this shape
        if step_k:
            phases.setdefault((depth, step_k), []).append(engine.last_draft_s)
        return engine.last_step_s - engine.last_target_s - engine.last_draft_s

    # Speculative steps follow speculative ones where they can, as K auto serves them: after a
    # plain step the draft catches up on one token more.
    plans = [(1, 0)] + ([(deep, 0)] if deep > 1 else []) + ([(1, k)] if k else [])
    if k > 1:  # the draft phase's first forward apart from the later ones (draft_split)
        plans += [(1, 1)] + [(d, j) for d in depths if 1 < d <= deep for j in (1, min(k, SPLIT_K))]
    samples: dict[tuple[int, int], list[float]] = {plan: [] for plan in plans}
    with torch.inference_mode():
        for plan in plans:  # warm-up: first-call allocations, each shape once
            outside(*plan)
        for _ in range(5):
            for plan in plans:
                if (value := outside(*plan)) is not None:
                    samples[plan].append(value)
            if time.perf_counter() > until and all(samples.values()):
                break
    med = {plan: statistics.median(v) for plan, v in samples.items() if v}
    plain_1 = max(0.0, med.get((1, 0), 0.0))
    per_sequence = max(0.0, (med[(deep, 0)] - plain_1) / (deep - 1)) if deep > 1 and (deep, 0) in med else 0.0
    per_draft_1 = max(0.0, (med[(1, k)] - plain_1) / k) if k and (1, k) in med else 0.0
    # Each shape's first draft phase is the warm-up's (first-call allocations): not kept.
    return EngineTimings([plain_1 + per_sequence * (d - 1) for d in depths], [per_draft_1 * d for d in depths],
                         {shape: statistics.median(v[1:] or v) for shape, v in phases.items()})


def draft_split(depths: tuple[int, ...], forward_s: list[float],
                phases: dict[tuple[int, int], float]) -> tuple[list[float], list[float]]:
    """Per grid depth, seconds of a step's first draft forward and of each later one, from the
    engine's draft phases at K = 1 and a deeper K (``measure_overheads``) and the draft forward
    timed at each depth (``forward_s``, which gives the shape beyond the depths timed so).

    At a depth with both phases: first = phase(K=1), later = (phase(K) - phase(1)) / (K - 1).
    Elsewhere the later forward keeps the measured ratio to ``forward_s`` (linear in depth
    between the measured depths, the nearest beyond them), and the first one's extra over it
    follows the measured extras (linear between them, and on from the last two: its catch-up
    grows with the rows). Without the phases (``max_k`` 1), both are ``forward_s``. (Timed at
    batch 1 and 16 only, with the ratio interpolated between, the later forward at batch 8
    came out 0.68 ms where K auto's steps there took 1.0 ms or more: K = 2 looked 9% better
    than plain at batch 8 and lost to it.) A depth whose deeper-K phase is no longer than its
    K = 1 phase counts as not timed."""
    split: dict[int, tuple[float, float]] = {}
    for (depth, k), phase in phases.items():
        # A deeper K's phase no longer than K = 1's is timing noise, not a measurement: priced
        # as a slope of 0 it made every later draft forward free there (and, interpolated, at
        # the depths beside it). Such a depth takes its neighbours' ratio, as an untimed one.
        if k > 1 and (depth, 1) in phases and phase > phases[(depth, 1)]:
            one = phases[(depth, 1)]
            split[depth] = (one, (phase - one) / (k - 1))
    measured = sorted(d for d in split if d in depths)
    if not measured:
        return list(forward_s), list(forward_s)
    ratio = [split[d][1] / max(1e-9, forward_s[depths.index(d)]) for d in measured]
    extra = [max(0.0, split[d][0] - split[d][1]) for d in measured]
    later = [f * interpolate(measured, ratio, d) for f, d in zip(forward_s, depths, strict=True)]
    first = [n + max(0.0, interpolate(measured, extra, d, extend=True)) for n, d in zip(later, depths, strict=True)]
    return first, later
