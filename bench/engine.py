"""Benchmark of the embedded speculative engine on held-out code prompts.

    python -m bench.engine [--json] [--quick]

Measures, in one run: tokens/s plain vs speculative at batch 1 for K = 1..Kmax; per-token
acceptance α per temperature; the cost ratio c = draft forward time / target forward time;
the speed-up bound S = (1 − α^(K+1)) / ((1 − α)(cK + 1)) of Leviathan et al. for the measured
α and c; tokens/s plain vs speculative at batch 8, 32 and 64; α of seeded requests, whose
Gumbel-max sampling is coupled across modes (same answer in every mode), against the standard
rule's α at the same temperatures. With ``--json`` the last line printed is one JSON object
with every figure.

The cost model (``workers/engines/embedded/measure.py``): the one a worker with these settings would build
(``cost_model``, with ``max_slots`` the largest batch measured here), the precision it chose
(``--dtype auto`` serves that), ``predicted_speedup_b1`` (its prediction at the measured α, for
the same requests: prefills and the draft's catch-up on each prompt included, as in the measured
``speedup_b1``; ``predicted_decode_speedup_b1``: decode steps alone) next to the measured
``speedup_b1``, and ``tok_s_b{8,32,64}_auto``: batched throughput with K chosen
per step from the cost model at the step's depth, next to plain and a fixed K.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from policies import CostModel, catch_up_pays, choose_k, gain, tested_drafts
from workers.costs.model import CostReport, OnlineCosts, StepCostRule
from workers.demo.corpus import heldout_prompts
from workers.engines.embedded import rowgemm
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine, native_forward
from workers.engines.embedded.kv_cache import CacheBatch, KVCache
from workers.engines.embedded.measure import MeasureSettings, measure, torch_threads_serving
from workers.engines.embedded.model import TORCH_DTYPES, LlamaForCausalLM, Products, products_named
from workers.engines.embedded.runner import COST_TABLE_STEPS, fold_step
from workers.engines.embedded.sampling import SamplingParams
from workers.text import TextCodec

REPO = Path(__file__).resolve().parent.parent
TEMPERATURES = (0.0, 0.5, 0.8, 1.0)


@dataclass(frozen=True)
class RunResult:
    tokens: int
    seconds: float
    proposed: int
    accepted: int
    tested: int
    draft_seconds: float = 0.0  # of ``seconds``, spent proposing drafts
    target_seconds: float = 0.0  # of ``seconds``, in the target's forwards of decode steps
    prefill_seconds: float = 0.0  # of ``seconds``, in steps that prefilled a prompt (alike in every mode)
    steps: int = 0  # decode steps (steps without a prefill)

    def __add__(self, other: RunResult) -> RunResult:
        return RunResult(self.tokens + other.tokens, self.seconds + other.seconds, self.proposed + other.proposed,
                         self.accepted + other.accepted, self.tested + other.tested,
                         self.draft_seconds + other.draft_seconds, self.target_seconds + other.target_seconds,
                         self.prefill_seconds + other.prefill_seconds, self.steps + other.steps)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def alpha(self) -> float:
        return self.accepted / self.tested if self.tested else float("nan")

    @property
    def draft_share(self) -> float:
        return self.draft_seconds / self.seconds

    @property
    def decode_tok_s(self) -> float:
        """Tokens/s without the prefills' time (a prompt's prefill is the same in every mode)."""
        return self.tokens / (self.seconds - self.prefill_seconds)

    def per_step_ms(self) -> dict[str, float]:
        """Where a decode step's time went, in ms a step: the target's forward, the drafts'
        (with their bookkeeping), the rest; and the prefills' share of all the time."""
        steps = max(1, self.steps)
        decode = self.seconds - self.prefill_seconds
        return {"step": round(1000 * decode / steps, 3), "target": round(1000 * self.target_seconds / steps, 3),
                "drafts": round(1000 * self.draft_seconds / steps, 3),
                "rest": round(1000 * (decode - self.target_seconds - self.draft_seconds) / steps, 3),
                "prefill_share": round(self.prefill_seconds / self.seconds, 3)}


def add_group(engine: SpeculativeEngine, prompts: list[list[int]], max_tokens: int, k: int, temperature: float,
              seed: int | None) -> None:
    """``seed`` None: unseeded requests (standard speculative sampling; the engine's rng is fixed)."""
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=temperature, seed=None if seed is None else seed + i)
        engine.add(GenerationRequest(f"r{i}", ids, max_tokens, params, k=k))


def run_batch(engine: SpeculativeEngine, prompts: list[list[int]], max_tokens: int, k: int,
              temperature: float, seed: int | None = 0) -> RunResult:
    """All prompts at once (batch = len(prompts)), each to max_tokens or EOS."""
    return run_interleaved({k: engine}, [prompts], max_tokens, temperature, seed)[0][k]


def run_interleaved(engines: dict[int, SpeculativeEngine], groups: list[list[list[int]]], max_tokens: int,
                    temperature: float, seed: int | None = 0, costs: OnlineCosts | None = None,
                    drafted: dict[int, dict[int, int]] | None = None, unfolded: frozenset[int] = frozenset(),
                    ) -> tuple[dict[int, RunResult], dict[int, list[list[int]]]]:
    """Each group of prompts as one batch, one group after another, under every K at once.

    Each K has its own engine (sharing the models) and the engines take turns a step at a
    time: next is the one that has emitted the fewest tokens of the group so far, ties broken
    in a seeded shuffled order. So they move through the group together (at T=0 they emit the
    same tokens) and finish it together, and a noisy neighbour's slow second, and the cache
    state the previous engine left, land on all configurations alike: the ratios between them
    stay meaningful on a shared machine. (With one step each per round, the speculative
    engines finished a prompt in a quarter of the plain engine's steps, and the plain engine
    then ran alone, back to back, with more of its weights in the cache. A worker's cost model
    refined from those steps, ``costs``, took its plain step from that phase and its
    verifications from the shared one: ``predicted_speedup_b1`` came out 16% over and 12%
    under the measured speed-up in two runs of the same code.) Prefill is in the first
    step's time. Returns the totals per K and each K's output tokens per prompt, in order.
    A negative key is one more plain engine (the noise between two engines doing the same
    work). ``costs`` hears every step, as a worker's online cost refinement does; ``drafted`` gets,
    per K, how many sequence-steps drafted each number of tokens (what ran, after every rule).
    ``unfolded``: keys whose steps ``costs`` does not hear (an engine on another configuration).
    """
    totals = {k: RunResult(0, 0.0, 0, 0, 0) for k in engines}
    outputs: dict[int, list[list[int]]] = {k: [] for k in engines}
    for g, group in enumerate(groups):
        for k, engine in engines.items():
            add_group(engine, group, max_tokens, max(0, k), temperature, None if seed is None else seed + g)
        produced: dict[int, dict[str, list[int]]] = {k: {f"r{i}": [] for i in range(len(group))} for k in engines}
        emitted = dict.fromkeys(engines, 0)
        order = list(engines.items())
        shuffle = random.Random(g)
        while any(engine.has_work for engine in engines.values()):
            # Ties in a fresh order each time: with a fixed order, the engine that always ran
            # after a speculative one (whose draft evicts part of the target's weights from the
            # cache) paid for it every step; of two engines doing the same plain work, the one
            # that followed the speculative engine was up to 10% slower for a whole batched run.
            shuffle.shuffle(order)
            k, engine = min(((k, e) for k, e in order if e.has_work), key=lambda item: emitted[item[0]])
            started = time.perf_counter()
            events = engine.step()
            elapsed = time.perf_counter() - started
            if costs is not None and k not in unfolded:
                fold_step(costs, engine, events, elapsed)  # as a worker does; the step's whole time
            counts = drafted.setdefault(k, {}) if drafted is not None else None
            for event in events:
                produced[k][event.request_id].extend(event.tokens)
                emitted[k] += len(event.tokens)
                if counts is not None:
                    counts[event.proposed] = counts.get(event.proposed, 0) + 1
                totals[k] += RunResult(len(event.tokens), 0.0, event.proposed, event.accepted,
                                       tested_drafts(event.proposed, event.accepted))
            if engine.last_shape.prefill:
                totals[k] += RunResult(0, elapsed, 0, 0, 0, prefill_seconds=elapsed)
            else:
                totals[k] += RunResult(0, elapsed, 0, 0, 0, engine.last_draft_s, engine.last_target_s, steps=1)
        for k in engines:
            outputs[k].extend(produced[k][f"r{i}"] for i in range(len(group)))
    return totals, outputs


OTHER_PLAIN = -2  # run_interleaved's key for plain decoding on the other kernel configuration


def live_model(costs: OnlineCosts) -> CostModel:
    return uniform_model(costs.report())


def uniform_model(report: CostReport) -> CostModel:
    """The policy's model of whole-step costs, every sequence priced drafting the same K."""
    return CostModel(report.depths, report.step_cost)


class AutoK:
    """K auto as the worker runs it, on the live cost model: each sequence's K the one chosen
    at the step's depth (the gateway's choice), the catch-up rule, then the worker's per-step
    rule on the step's actual mix (``step_cost``, as ``workers.engines.embedded.runner`` installs it). The model
    is re-read every COST_TABLE_STEPS steps, as the worker's runner re-reads it (every 256
    calls, four steps at batch 64, cost 0.6% of a plain step there), and answers are kept per
    depth until then, as the worker's rule keeps them per step shape (a choice per sequence per
    step is about 16 µs of Python a worker does not spend)."""

    def __init__(self, costs: OnlineCosts, alpha: float, max_k: int) -> None:
        self.costs, self.alpha, self.max_k = costs, alpha, max_k
        self.chosen: dict[int, int] = {}  # K -> sequence-steps it was chosen for (why auto wins or loses)
        self._reread()

    def _reread(self) -> None:
        """The live model afresh, for every rule, with no answers kept from the last one."""
        self.calls, self.report = 0, self.costs.report()
        self.by_depth: dict[int, int] = {}
        self.model = uniform_model(self.report)
        self.step_rule = StepCostRule(self.report.policy_model())

    def step_cost(self, requested: list[int]) -> int:
        """The worker's per-step rule (``SpeculativeEngine.step_cost_rule``) on the same model."""
        return self.step_rule.k(requested, self.alpha)

    def catch_up(self, lag: int, remaining: int, k: int, depth: int) -> bool:
        """The worker's catch-up rule (``SpeculativeEngine.catch_up_rule``) on the same model."""
        return catch_up_pays(self.model, self.alpha, k, depth, remaining, *self.report.catch_up_prices(lag, depth))

    def __call__(self, requested_k: int, depth: int) -> int:
        self.calls += 1
        if self.calls >= COST_TABLE_STEPS * depth:  # a sequence per call: about that many steps
            self._reread()
        best = self.by_depth.get(depth)
        if best is None:
            best = self.by_depth[depth] = choose_k(self.model, self.alpha, depth, self.max_k, 0.05, 0.0)
        k = min(requested_k, best)
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k


def forward_times(models: dict[str, tuple[LlamaForCausalLM, int]], drafts: tuple[LlamaForCausalLM, ...], reps: int,
                  context: int = 128) -> dict[str, float]:
    """Seconds per cached forward at batch 1 after ``context`` tokens, for each (model, new tokens).

    The configurations take turns, one forward each, so machine noise hits them alike. Like the
    engine, drafts skip row-invariant attention (only the target's rows must be exact).
    """
    setups = {}
    for name, (model, tokens) in models.items():
        cache = KVCache.allocate(model.cfg, 1, model.lm_head.weight.dtype)
        setups[name] = (model, cache, torch.zeros((1, tokens), dtype=torch.long), tokens)
    totals = dict.fromkeys(models, 0.0)
    with torch.inference_mode():
        for i in range(reps + 5):
            for name, (model, cache, new, tokens) in setups.items():
                started = time.perf_counter()
                row_invariant = all(model is not d for d in drafts)
                # As the engine runs a forward: from lists into the one-call kernel where it can.
                if native_forward(model, cache, [[0] * tokens], [0], [context], list(range(tokens)),
                                  row_invariant) is None:
                    batch = CacheBatch.build([0], [context], [tokens], tokens, model.cfg.max_position_embeddings,
                                             row_invariant=row_invariant)
                    model.forward_cached(new, cache, batch, torch.zeros(tokens, dtype=torch.long),
                                         torch.arange(tokens))
                if i >= 5:  # after warm-up
                    totals[name] += time.perf_counter() - started
    return {name: total / reps for name, total in totals.items()}


def prefill_times(target: LlamaForCausalLM, prompt_tokens: list[int], reps: int) -> dict[str, dict[str, float]]:
    """Seconds to prefill a prompt of each length at batch 1 as the engine does (fused, not
    row-invariant: the one-call kernel up to ``native_attention_max_tokens``, SDPA beyond) and
    with SDPA attention in the per-op path (what served prefills longer than 16 tokens before),
    taking turns."""
    cache = KVCache.allocate(target.cfg, 1, target.lm_head.weight.dtype)
    served = target.native_attention_max_tokens
    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for n in prompt_tokens:
            prompt = torch.randint(5, target.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
            totals = {"served": 0.0, "sdpa": 0.0}
            for i in range(reps + 1):
                for name in totals:
                    target.native_attention_max_tokens = served if name == "served" else 0
                    started = time.perf_counter()
                    batch = CacheBatch.build([0], [0], [n], n, target.cfg.max_position_embeddings, row_invariant=False)
                    target.forward_cached(prompt, cache, batch, torch.zeros(1, dtype=torch.long), torch.tensor([n - 1]))
                    if i >= 1:
                        totals[name] += time.perf_counter() - started
            target.native_attention_max_tokens = served
            out[str(n)] = {name: total / reps for name, total in totals.items()}
    return out


def speedup_bound(alpha: float, c: float, k: int) -> float:
    if alpha >= 1.0:
        return (k + 1) / (c * k + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (c * k + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=REPO / "models/demo-target")
    parser.add_argument("--draft", type=Path, default=REPO / "models/demo-draft")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="the target's dtype (auto: as a worker resolves it)")
    parser.add_argument("--draft-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=1,
                        help="compute threads, torch's and the kernels' (a worker uses 1 by default)")
    parser.add_argument("--kmax", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts at batch 1")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batches", default="8,32,64")
    parser.add_argument("--batch-max-tokens", type=int, default=64,
                        help="tokens per sequence in the batched runs (their prefills, alike in every mode, are "
                             "timed too)")
    parser.add_argument("--batch-rounds", type=int, default=4,
                        help="rounds of each batched comparison; four engines swap roles each round (a "
                             "multiple of 4 gives each engine every role equally often)")
    parser.add_argument("--alpha-prompts", type=int, default=32, help="held-out prompts for alpha per temperature")
    parser.add_argument("--inexact", action="store_true", help="as workers.exact: false (auto may pick float32)")
    parser.add_argument("--cost-budget-s", type=float, default=8.0, help="the cost measurement's time budget")
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens (smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.kmax, args.batches, args.batch_max_tokens = 3, 32, 4, "8", 16
        args.alpha_prompts, args.cost_budget_s, args.batch_rounds = 8, 2.0, 1
    torch.set_num_threads(args.threads)  # as a worker sets them: torch's while measuring, and the kernels'
    rowgemm.set_threads(args.threads)
    torch.manual_seed(0)
    batch_sizes = [int(b) for b in args.batches.split(",") if b]
    # The cost model a worker with these settings builds; "auto" serves the precision it chose.
    costs = measure(MeasureSettings(args.target, args.draft, max([*batch_sizes, 16]), args.kmax, args.dtype,
                                    args.draft_dtype, not args.inexact, args.cost_budget_s, args.threads))
    assert costs.precision is not None
    torch.set_num_threads(torch_threads_serving(costs.precision, args.threads))  # as the worker serves
    chose = costs.precision.target + (" with bfloat16 products" if costs.precision.products == "bfloat16" else "")
    print(f"cost model ({costs.cpu}): {costs.precision.why}; chose {chose}, measured "
          f"{costs.measured_points}/{costs.total_points} points in {costs.measure_s:.1f}s", flush=True)
    startup_model = CostModel(costs.depths, costs.step_cost)
    online = OnlineCosts(costs)  # refined by every step below, as a serving worker's is
    # The configuration the cost model chose, as a worker serves it (a configured bfloat16 may be
    # served as a float32 model with bfloat16 products: costs_measure.target_configs).
    args.dtype = costs.precision.target
    products = products_named(costs.precision.products)
    target = LlamaForCausalLM.from_pretrained(args.target, TORCH_DTYPES[args.dtype], costs.precision.prepacked,
                                              products)
    draft = LlamaForCausalLM.load_draft(args.draft, TORCH_DTYPES[args.draft_dtype], products)
    codec = TextCodec.from_model_dir(args.target)
    texts = heldout_prompts(max(args.prompts, args.alpha_prompts, *batch_sizes), seed=1)
    prompts = [codec.encode(t) for t in texts]
    # Unseeded requests draw their streams' seeds from this engine's rng: fixed, so runs repeat.
    engine = SpeculativeEngine(target, draft, max_slots=args.alpha_prompts, max_k=args.kmax, rng=random.Random(7))
    b1_engines = {k: SpeculativeEngine(target, draft, max_slots=1, max_k=args.kmax) for k in range(args.kmax + 1)}
    # speedup_b1 is against the fastest plain configuration: where the kernels multiply in both
    # ways, the other way decodes plain too (key OTHER_PLAIN), taking turns with the rest.
    other_products: Products = "float32" if products == "bfloat16" else "bfloat16"
    kernel = rowgemm.load()
    if target.fused is not None and kernel is not None and kernel.dot_products:
        other_target = LlamaForCausalLM.from_pretrained(args.target, TORCH_DTYPES[args.dtype], True, other_products)
        b1_engines[OTHER_PLAIN] = SpeculativeEngine(other_target, draft, max_slots=1, max_k=args.kmax)
    run_interleaved(b1_engines, [prompts[:1]], 8, 0.0)  # warm-up

    def log(message: str) -> None:
        print(message, flush=True)

    b1 = prompts[:args.prompts]
    greedy, outputs = run_interleaved(b1_engines, [[ids] for ids in b1], args.max_tokens, 0.0, costs=online,
                                      unfolded=frozenset({OTHER_PLAIN}))
    other_plain = greedy.pop(OTHER_PLAIN, None)
    b1_engines.pop(OTHER_PLAIN, None)
    # Exactness on the real models: at T=0 every K must reproduce plain decoding token for token.
    identical = sum(outputs[k][i] == outputs[0][i] for k in range(1, args.kmax + 1) for i in range(len(b1)))
    compared = args.kmax * len(b1)
    plain = greedy.pop(0)
    by_k = greedy
    log(f"batch 1, T=0, plain: {plain.tok_s:.1f} tok/s; speculative output identical to plain in "
        f"{identical}/{compared} (prompt, K) runs")
    if other_plain is not None:
        log(f"batch 1, T=0, plain with {other_products} products (the other kernel configuration): "
            f"{other_plain.tok_s:.1f} tok/s ({other_plain.tok_s / plain.tok_s:.2f}x the served plain)")
    for k, r in by_k.items():
        log(f"batch 1, T=0, K={k}: {r.tok_s:.1f} tok/s, alpha {r.alpha:.3f}, "
            f"accepted/proposed {r.accepted / r.proposed:.3f}, speed-up {r.tok_s / plain.tok_s:.2f}x")
    best_k = max(by_k, key=lambda k: by_k[k].tok_s)
    best = by_k[best_k]
    # Where the time goes: a speculative step against a plain one (the drafts include the
    # draft's catch-up on the prompt in its first step).
    breakdown = {"plain": plain.per_step_ms(), f"k{best_k}": best.per_step_ms()}
    shares = [100 * b["prefill_share"] for b in breakdown.values()]
    log("batch 1 per decode step (ms): " + "; ".join(
        f"{name}: step {b['step']:.2f}, target forward {b['target']:.2f}, drafts {b['drafts']:.2f}, rest "
        f"{b['rest']:.2f}" for name, b in breakdown.items())
        + f"; prefills {shares[0]:.0f}% of plain's time, {shares[1]:.0f}% of K={best_k}'s")
    reps = 50 if args.quick else 200
    # The same two models in the other dtype each: what the dtype defaults rest on (docs/engine.md).
    other = {"float32": "bfloat16", "bfloat16": "float32"}
    target_alt = LlamaForCausalLM.from_pretrained(args.target, TORCH_DTYPES[other[args.dtype]])
    draft_alt = LlamaForCausalLM.from_pretrained(args.draft, TORCH_DTYPES[other[args.draft_dtype]])
    last = args.kmax + 1
    # The other dtypes take turns among themselves: between the served forwards, their per-op
    # torch path (another copy of the weights, oneDNN's scratch) evicted the target's weights
    # before every 1-token forward, which then came out slower than a 4-token one.
    timed = forward_times({"target": (target, 1), "draft": (draft, 1),
                           **{f"verify{n}": (target, n) for n in range(2, last + 1)}}, (draft,), reps)
    timed |= forward_times({"target_alt": (target_alt, 1), f"verify{last}_alt": (target_alt, last),
                            "draft_alt": (draft_alt, 1)}, (draft_alt,), reps)
    target_s, draft_s = timed["target"], timed["draft"]
    c = draft_s / target_s
    bound = speedup_bound(best.alpha, c, best_k)
    speedup = best.tok_s / plain.tok_s
    log(f"forward at batch 1: target {1000 * target_s:.2f} ms, draft {1000 * draft_s:.2f} ms, c = {c:.3f}")
    # What the bound leaves out: verifying K+1 tokens is not free on a CPU.
    verify_cost = {str(n): round(timed[f"verify{n}"] / target_s, 3) for n in range(2, args.kmax + 2)}
    log("target forward of n tokens / 1 token: " + ", ".join(f"n={n}: {v:.2f}" for n, v in verify_cost.items()))
    alt_verify_cost = timed[f"verify{last}_alt"] / timed["target_alt"]
    log(f"other dtypes: target in {other[args.dtype]} {1000 * timed['target_alt']:.2f} ms, n={last} / 1 token "
        f"{alt_verify_cost:.2f}; draft in {other[args.draft_dtype]} {1000 * timed['draft_alt']:.2f} ms")
    prefill = prefill_times(target, [32, 512] if args.quick else [32, 64, 128, 256, 512], 3 if args.quick else 10)
    log("prefill at batch 1, as served / per-op with SDPA attention (ms): " + ", ".join(
        f"{n} tokens {1000 * p['served']:.1f} / {1000 * p['sdpa']:.1f}" for n, p in prefill.items()))
    fastest_plain = max(plain.tok_s, other_plain.tok_s if other_plain is not None else 0.0)
    log(f"best K={best_k}: speed-up {speedup:.2f}x, bound S={bound:.2f}, measured/bound {speedup / bound:.2f}; "
        f"{best.tok_s / fastest_plain:.2f}x the fastest plain configuration")
    # The cost model's prediction at the measured alpha, for the K it would choose: as measured
    # at start-up, and after the online refinement from the steps above.
    refined_report = online.report()
    cost_model = uniform_model(refined_report)
    auto_k_b1 = choose_k(cost_model, best.alpha, 1, args.kmax, 0.0, 0.0)
    predicted_decode = gain(cost_model, best.alpha, auto_k_b1, 1)
    startup_k_b1 = choose_k(startup_model, best.alpha, 1, args.kmax, 0.0, 0.0)
    # speedup_b1 times whole requests: each prompt's prefill (both modes) and the draft's
    # catch-up on it (speculative) are in it, so the prediction prices them too, from the
    # prefill costs the worker measured at start-up, for these prompts and outputs.
    requests_b1 = [(len(ids), len(out)) for ids, out in zip(b1, outputs[0], strict=True)]
    predicted = refined_report.request_speedup(best.alpha, auto_k_b1, requests_b1) or predicted_decode
    predicted_startup = (costs.request_speedup(best.alpha, startup_k_b1, requests_b1)
                         or gain(startup_model, best.alpha, startup_k_b1, 1))
    measured_at = by_k[auto_k_b1].tok_s / plain.tok_s if auto_k_b1 else 1.0
    decode_at = by_k[auto_k_b1].decode_tok_s / plain.decode_tok_s if auto_k_b1 else 1.0
    log(f"decode steps alone (no prefills) at K={auto_k_b1}: {decode_at:.2f}x measured, {predicted_decode:.2f}x "
        f"predicted")
    log(f"cost model at alpha {best.alpha:.3f}: K={auto_k_b1}, predicted speed-up of these requests {predicted:.2f}x "
        f"(measured at that K {measured_at:.2f}x); from the start-up measurement alone K={startup_k_b1}, "
        f"{predicted_startup:.2f}x")
    # The step's work outside its forwards, as the model holds it now (start-up, then refined).
    outside_ms = (refined_report.step_overhead_ms or (0.0,))[0]
    overhead_b1 = {"startup_ms": (costs.step_overhead_ms or (0.0,))[0], "refined_ms": outside_ms,
                   "per_draft_refined_ms": (refined_report.draft_overhead_ms or (0.0,))[0],
                   "share_of_plain_step": round(outside_ms / (refined_report.plain_step_ms[0] + outside_ms), 4)}
    log(f"step work outside the forwards at batch 1: {outside_ms:.2f} ms "
        f"({100 * overhead_b1['share_of_plain_step']:.1f}% of a plain step; start-up {overhead_b1['startup_ms']:.2f} "
        f"ms), {overhead_b1['per_draft_refined_ms']:.3f} ms more per draft")
    # Acceptance needs many drafts, not quiet timing: measure it batched, over more prompts.
    alpha_prompts = prompts[:args.alpha_prompts]
    alpha_by_t: dict[str, float] = {}
    coupled_by_t: dict[str, float] = {}
    for temperature in TEMPERATURES:
        # Unseeded: standard speculative sampling, what an unseeded request gets.
        result = run_batch(engine, alpha_prompts, args.max_tokens, best_k, temperature, seed=None)
        alpha_by_t[str(temperature)] = round(result.alpha, 4)
        line = f"{len(alpha_prompts)} prompts, K={best_k}, T={temperature}: alpha {result.alpha:.3f}"
        if temperature > 0:
            # Seeded: the Gumbel-max sampler coupled across modes, which accepts less.
            coupled = run_batch(engine, alpha_prompts, args.max_tokens, best_k, temperature, seed=7)
            coupled_by_t[str(temperature)] = round(coupled.alpha, 4)
            line += f", seeded (coupled) {coupled.alpha:.3f} over {coupled.tested} tested drafts"
        log(f"{line}; standard over {result.tested} tested drafts")
    batched: dict[str, float | list[float] | dict[str, int]] = {}
    del engine  # its caches; the batched runs get a plain and a speculative engine of their own
    for size in batch_sizes:
        group = (prompts * (size // len(prompts) + 1))[:size]
        # K auto: each step's K from the cost model at that step's depth (what the gateway's
        # choice and the worker's per-step rule give together), at the measured alpha. Keyed
        # kmax + 1 (requests ask for the deepest K; the rule cuts it).
        rule = AutoK(online, best.alpha, args.kmax)
        # Four engines (each with its own caches) play plain, fixed K, K auto and plain again,
        # one role per round, each role moving to the next engine every round: two engines
        # doing the same plain work differed by up to 15% over a whole round in a one-off run,
        # so a role tied to one engine carried that engine's luck (its caches, its place in the
        # turns) into the ratio. Plain again (key -1) is that noise, measured in the same run:
        # where K auto runs plain throughout, its ratio to plain is no more than that.
        roles = [0, best_k, args.kmax + 1, -1]
        engines = [SpeculativeEngine(target, draft, max_slots=size, max_k=args.kmax) for _ in roles]
        totals: dict[int, RunResult] = {}
        auto_ratios, again_ratios = [], []
        drafted: dict[int, dict[int, int]] = {}
        for round_index in range(args.batch_rounds):
            cast = {k: engines[(i + round_index) % len(roles)] for i, k in enumerate(roles)}
            for k, engine in cast.items():
                engine.step_depth_rule = rule if k == args.kmax + 1 else None
                engine.catch_up_rule = rule.catch_up if k == args.kmax + 1 else None
                engine.step_cost_rule = rule.step_cost if k == args.kmax + 1 else None
            round_results, _ = run_interleaved(cast, [group], args.batch_max_tokens, 0.0, costs=online, drafted=drafted)
            auto_ratios.append(round(round_results[args.kmax + 1].tok_s / round_results[0].tok_s, 3))
            again_ratios.append(round(round_results[-1].tok_s / round_results[0].tok_s, 3))
            for key, result in round_results.items():
                totals[key] = totals[key] + result if key in totals else result
        del engines
        p, s, a = totals[0], totals[best_k], totals[args.kmax + 1]
        batched[f"tok_s_b{size}_plain"], batched[f"tok_s_b{size}_spec"] = round(p.tok_s, 1), round(s.tok_s, 1)
        batched[f"tok_s_b{size}_auto"] = round(a.tok_s, 1)
        batched[f"auto_ratio_by_round_b{size}"] = auto_ratios
        batched[f"tok_s_b{size}_plain_again"] = round(totals[-1].tok_s, 1)
        batched[f"plain_again_ratio_by_round_b{size}"] = again_ratios
        # What K auto's sequences drafted, step by step, after every rule (the depth rule's own
        # choices: auto_k_chosen_b*; the catch-up and per-step rules may cut them).
        ran = drafted.get(args.kmax + 1, {})
        batched[f"auto_k_sequence_steps_b{size}"] = {str(k): n for k, n in sorted(ran.items())}
        batched[f"auto_k_chosen_b{size}"] = {str(k): n for k, n in sorted(rule.chosen.items())}
        batched[f"draft_share_b{size}_spec"] = round(s.draft_share, 3)
        log(f"batch {size}, T=0, {args.batch_rounds} rounds: plain {p.tok_s:.1f} tok/s, speculative K={best_k} "
            f"{s.tok_s:.1f} tok/s ({s.tok_s / p.tok_s:.2f}x), alpha {s.alpha:.3f}, drafting "
            f"{100 * s.draft_share:.0f}% of its time; K auto "
            f"(K={choose_k(live_model(online), best.alpha, size, args.kmax, 0.05, 0.0)} at depth {size}) "
            f"{a.tok_s:.1f} tok/s ({a.tok_s / p.tok_s:.2f}x; by round {auto_ratios}); sequence-steps by K drafted "
            f"{dict(sorted(ran.items()))} (by K chosen at the depth {dict(sorted(rule.chosen.items()))}); plain again "
            f"{totals[-1].tok_s:.1f} tok/s ({totals[-1].tok_s / p.tok_s:.2f}x plain; by round {again_ratios})")
    summary = {
        "bench": "engine", "dtype": args.dtype, "target_prepacked": target.prepacked, "products": target.products,
        "draft_dtype": args.draft_dtype, "threads": args.threads, "kernels": rowgemm.chosen_build(),
        "prompts": len(b1),
        "max_tokens": args.max_tokens, "alpha_t0": round(best.alpha, 4), "best_k": best_k,
        "acceptance_rate_t0": round(best.accepted / best.proposed, 4),
        "speedup_b1": round(speedup, 3), "bound_b1": round(bound, 3), "speedup_over_bound": round(speedup / bound, 3),
        "c": round(c, 4), "target_forward_ms": round(1000 * target_s, 3), "draft_forward_ms": round(1000 * draft_s, 3),
        "tok_s_plain_b1": round(plain.tok_s, 1), "tok_s_spec_b1": round(best.tok_s, 1),
        # Plain decoding with the kernels' other products (None where they have one way), and the
        # speed-up against the faster of the two plain configurations.
        "tok_s_plain_b1_other_products": None if other_plain is None else round(other_plain.tok_s, 1),
        "speedup_b1_vs_fastest_plain": round(best.tok_s / fastest_plain, 3),
        "tok_s_b1_by_k": {str(k): round(r.tok_s, 1) for k, r in by_k.items()},
        "alpha_b1_by_k": {str(k): round(r.alpha, 4) for k, r in by_k.items()},
        "draft_share_b1_spec": round(best.draft_share, 3),
        "step_breakdown_b1_ms": breakdown,
        "greedy_identical_runs": identical, "greedy_compared_runs": compared,
        "verify_cost_by_tokens": verify_cost,
        "other_dtypes": {"target": other[args.dtype], "target_forward_ms": round(1000 * timed["target_alt"], 3),
                         f"verify_cost_{last}_tokens": round(alt_verify_cost, 3), "draft": other[args.draft_dtype],
                         "draft_forward_ms": round(1000 * timed["draft_alt"], 3)},
        "prefill_by_tokens_ms": {n: {name: round(1000 * s, 1) for name, s in p.items()} for n, p in prefill.items()},
        "alpha_by_temperature": alpha_by_t, "alpha_seeded_coupled_by_temperature": coupled_by_t, **batched,
        "cpu": costs.cpu, "precision_choice": {"target": costs.precision.target, "exact": costs.precision.exact,
                                               "why": costs.precision.why},
        "predicted_speedup_b1": round(predicted, 3), "predicted_k_b1": auto_k_b1,
        "predicted_decode_speedup_b1": round(predicted_decode, 3),
        "measured_speedup_at_predicted_k_b1": round(measured_at, 3),
        "decode_speedup_at_predicted_k_b1": round(decode_at, 3),
        "predicted_speedup_b1_startup": round(predicted_startup, 3), "predicted_k_b1_startup": startup_k_b1,
        "step_overhead_b1": overhead_b1,
        "cost_model": costs.to_json(), "cost_model_refined": online.report().to_json(),
    }
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
