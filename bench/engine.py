"""Benchmark of the embedded speculative engine on held-out code prompts.

    python -m bench.engine [--json] [--quick | --smoke]

Measures, in one run: tokens/s plain vs speculative at batch 1 for K = 1..Kmax; per-token
acceptance α per temperature; the cost ratio c = draft forward time / target forward time;
the speed-up bound S = (1 − α^(K+1)) / ((1 − α)(cK + 1)) of Leviathan et al. for the measured
α and c; tokens/s plain vs speculative at batch 8, 32 and 64; α of seeded requests, whose
Gumbel-max sampling is coupled across modes (same answer in every mode), against the standard
rule's α at the same temperatures. With ``--json`` the last line printed is one JSON object
with every figure.

The cost model (``workers/engines/embedded/measurement/measure.py``): the one a worker with these settings would build
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
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.engine_auto_k import AutoK, live_model, uniform_model
from bench.engine_runs import OTHER_PLAIN, RunResult, forward_times, prefill_times, run_batch, run_interleaved
from bench.engine_trees import measure_trees
from policies import CostModel, choose_k, gain
from workers.costs.cost_report import CostReport
from workers.costs.online import OnlineCosts
from workers.demo.corpus import heldout_prompts
from workers.engines.embedded.engine import SpeculativeEngine
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.measurement.measure import measure
from workers.engines.embedded.measurement.precision import torch_threads_serving
from workers.engines.embedded.measurement.settings import MeasureSettings
from workers.engines.embedded.projections import TORCH_DTYPES, Products, products_named
from workers.engines.embedded.quantized import load_target
from workers.text import TextCodec

REPO = Path(__file__).resolve().parent.parent
TEMPERATURES = (0.0, 0.5, 0.8, 1.0)



def speedup_bound(alpha: float, c: float, k: int) -> float:
    if alpha >= 1.0:
        return (k + 1) / (c * k + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (c * k + 1))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=REPO / "models/demo-target")
    parser.add_argument("--draft", type=Path, default=REPO / "models/demo-draft")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "q4_1"], default="auto",
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
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens (a short run)")
    parser.add_argument("--smoke", action="store_true",
                        help="--quick with fewer tokens, prompts and repetitions still: for the smoke test; its "
                             "figures mean nothing")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--eagle3", type=Path, default=None,
                        help="measure this EAGLE-3 head at batch 1 against plain instead (bench/engine_eagle3.py)")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.kmax, args.batches, args.batch_max_tokens = 3, 32, 4, "8", 16
        args.alpha_prompts, args.cost_budget_s, args.batch_rounds = 8, 2.0, 1
    if args.smoke:  # --quick's prompts, Ks and batch (every figure and path), with shorter runs
        args.quick = True
        args.prompts, args.max_tokens, args.kmax, args.batches, args.batch_max_tokens = 3, 12, 4, "8", 8
        args.alpha_prompts, args.cost_budget_s, args.batch_rounds = 3, 1.0, 1
    return args


def log(message: str) -> None:
    print(message, flush=True)


@dataclass
class Served:
    """What a worker with these settings measures and serves, and the batch-1 engines."""

    costs: CostReport  # the start-up measurement
    startup_model: CostModel
    online: OnlineCosts  # refined by every step below, as a serving worker's is
    target: LlamaForCausalLM
    draft: LlamaForCausalLM
    prompts: list[list[int]]
    b1_engines: dict[int, SpeculativeEngine]  # by K, and OTHER_PLAIN where the kernels have another way
    other_products: Products


def load_served(args: argparse.Namespace, batch_sizes: list[int]) -> tuple[Served, SpeculativeEngine]:
    """The cost measurement, the models as it chose them, the prompts, and the engines: the
    batch-1 ones (warmed up) in ``Served``, and the one that measures acceptance."""
    torch.set_num_threads(args.threads)  # as a worker sets them: torch's while measuring, and the kernels'
    rowgemm.set_threads(args.threads)
    torch.manual_seed(0)
    # The cost model a worker with these settings builds; "auto" serves the precision it chose.
    costs = measure(MeasureSettings(args.target, args.draft, max([*batch_sizes, 16]), args.kmax, args.dtype,
                                    args.draft_dtype, not args.inexact, args.cost_budget_s, args.threads))
    assert costs.precision is not None
    torch.set_num_threads(torch_threads_serving(costs.precision, args.threads))  # as the worker serves
    chose = costs.precision.target + (" with bfloat16 products" if costs.precision.products == "bfloat16" else "")
    print(f"cost model ({costs.cpu}): {costs.precision.why}; chose {chose}, measured "
          f"{costs.measured_points}/{costs.total_points} points in {costs.measure_s:.1f}s", flush=True)
    startup_model = CostModel(costs.depths, costs.step_cost)
    online = OnlineCosts(costs)
    # The configuration the cost model chose, as a worker serves it (a configured bfloat16 may be
    # served as a float32 model with bfloat16 products: costs_measure.target_configs).
    args.dtype = costs.precision.target
    products = products_named(costs.precision.products)
    target = load_target(args.target, args.dtype, costs.precision.prepacked,
                                              products)
    draft = LlamaForCausalLM.load_draft(args.draft, TORCH_DTYPES[args.draft_dtype], products, target=args.target)
    codec = TextCodec.from_model_dir(args.target)
    texts = heldout_prompts(max(args.prompts, args.alpha_prompts, *batch_sizes), seed=1)
    prompts = [codec.encode(t) for t in texts]
    # Each engine's caches as long as its sequences get, not the model's window: SmolLM2's 8,192
    # positions a slot made this bench 18 GB and the kernel killed it.
    args.max_positions = max(map(len, prompts)) + max(args.max_tokens, args.batch_max_tokens) + args.kmax + 1
    # Unseeded requests draw their streams' seeds from this engine's rng: fixed, so runs repeat.
    engine = SpeculativeEngine(target, draft, max_slots=args.alpha_prompts, max_k=args.kmax, rng=random.Random(7),
                               max_positions=args.max_positions)
    b1_engines = {k: SpeculativeEngine(target, draft, max_slots=1, max_k=args.kmax, max_positions=args.max_positions)
                  for k in range(args.kmax + 1)}
    # speedup_b1 is against the fastest plain configuration: where the kernels multiply in both
    # ways, the other way decodes plain too (key OTHER_PLAIN), taking turns with the rest.
    other_products: Products = "float32" if products == "bfloat16" else "bfloat16"
    kernel = rowgemm.load()
    if target.fused is not None and kernel is not None and kernel.dot_products:
        other_target = load_target(args.target, args.dtype, True, other_products)
        b1_engines[OTHER_PLAIN] = SpeculativeEngine(other_target, draft, max_slots=1, max_k=args.kmax,
                                                    max_positions=args.max_positions)
    run_interleaved(b1_engines, [prompts[:1]], 8, 0.0)  # warm-up
    served = Served(costs, startup_model, online, target, draft, prompts, b1_engines, other_products)
    return served, engine


@dataclass
class Batch1:
    """Batch 1 at T=0, plain against every K."""

    prompts: list[list[int]]
    outputs: dict[int, list[list[int]]]  # by K: each prompt's output
    plain: RunResult
    other_plain: RunResult | None  # plain with the kernels' other products
    by_k: dict[int, RunResult]
    best_k: int
    identical: int  # (prompt, K) runs whose output is plain's, token for token
    compared: int
    breakdown: dict[str, dict[str, float]]  # per decode step, plain and the best K

    @property
    def best(self) -> RunResult:
        return self.by_k[self.best_k]


def measure_batch1(args: argparse.Namespace, served: Served) -> Batch1:
    b1 = served.prompts[:args.prompts]
    b1_engines = served.b1_engines
    greedy, outputs = run_interleaved(b1_engines, [[ids] for ids in b1], args.max_tokens, 0.0, costs=served.online,
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
        log(f"batch 1, T=0, plain with {served.other_products} products (the other kernel configuration): "
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
    return Batch1(b1, outputs, plain, other_plain, by_k, best_k, identical, compared, breakdown)


@dataclass
class Forwards:
    """Single forwards at batch 1, in the served dtypes and the other ones, and prefills."""

    timed: dict[str, float]  # seconds, by name: target, draft, verify{n}, and *_alt in the other dtypes
    other: dict[str, str]  # each dtype's other
    last: int  # the widest verification, kmax + 1 tokens
    verify_cost: dict[str, float]  # n tokens / 1
    alt_verify_cost: float
    prefill: dict[str, dict[str, float]]  # by prompt tokens: as served, and per-op with SDPA

    @property
    def c(self) -> float:
        return self.timed["draft"] / self.timed["target"]


def measure_forwards(args: argparse.Namespace, served: Served, batch1: Batch1) -> Forwards:
    reps = 10 if args.smoke else 50 if args.quick else 200
    target, draft = served.target, served.draft
    # The same two models in the other dtype each: what the dtype defaults rest on (docs/engine.md).
    other = {"float32": "bfloat16", "bfloat16": "float32", "q4_1": "float32"}
    target_alt = load_target(args.target, other[args.dtype])  # type: ignore[arg-type]
    # load_draft: a reduced-vocabulary draft reads the target's embedding (models/draft_format.py)
    draft_alt = LlamaForCausalLM.load_draft(args.draft, TORCH_DTYPES[other[args.draft_dtype]], target=args.target)
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
    log(f"forward at batch 1: target {1000 * target_s:.2f} ms, draft {1000 * draft_s:.2f} ms, c = {c:.3f}")
    # What the bound leaves out: verifying K+1 tokens is not free on a CPU.
    verify_cost = {str(n): round(timed[f"verify{n}"] / target_s, 3) for n in range(2, args.kmax + 2)}
    log("target forward of n tokens / 1 token: " + ", ".join(f"n={n}: {v:.2f}" for n, v in verify_cost.items()))
    alt_verify_cost = timed[f"verify{last}_alt"] / timed["target_alt"]
    log(f"other dtypes: target in {other[args.dtype]} {1000 * timed['target_alt']:.2f} ms, n={last} / 1 token "
        f"{alt_verify_cost:.2f}; draft in {other[args.draft_dtype]} {1000 * timed['draft_alt']:.2f} ms")
    prefill = prefill_times(target, [32, 512] if args.quick else [32, 64, 128, 256, 512],
                            1 if args.smoke else 3 if args.quick else 10)
    log("prefill at batch 1, as served / per-op with SDPA attention (ms): " + ", ".join(
        f"{n} tokens {1000 * p['served']:.1f} / {1000 * p['sdpa']:.1f}" for n, p in prefill.items()))
    return Forwards(timed, other, last, verify_cost, alt_verify_cost, prefill)


@dataclass
class Prediction:
    """The cost model's prediction at the measured alpha, against what batch 1 measured."""

    k: int  # the K it chooses, from the refined model
    speedup: float  # of these requests, prefills and catch-ups included
    decode_speedup: float  # decode steps alone
    measured_at_k: float
    decode_at_k: float
    startup_k: int  # the same from the start-up measurement alone
    startup_speedup: float
    overhead_b1: dict[str, float]  # the step's work outside its forwards


def predict_b1(args: argparse.Namespace, served: Served, batch1: Batch1) -> Prediction:
    """The cost model's prediction at the measured alpha, for the K it would choose: as measured
    at start-up, and after the online refinement from the steps so far."""
    best, plain, by_k, costs = batch1.best, batch1.plain, batch1.by_k, served.costs
    refined_report = served.online.report()
    cost_model = uniform_model(refined_report)
    auto_k_b1 = choose_k(cost_model, best.alpha, 1, args.kmax, 0.0, 0.0)
    predicted_decode = gain(cost_model, best.alpha, auto_k_b1, 1)
    startup_k_b1 = choose_k(served.startup_model, best.alpha, 1, args.kmax, 0.0, 0.0)
    # speedup_b1 times whole requests: each prompt's prefill (both modes) and the draft's
    # catch-up on it (speculative) are in it, so the prediction prices them too, from the
    # prefill costs the worker measured at start-up, for these prompts and outputs.
    requests_b1 = [(len(ids), len(out)) for ids, out in zip(batch1.prompts, batch1.outputs[0], strict=True)]
    predicted = refined_report.request_speedup(best.alpha, auto_k_b1, requests_b1) or predicted_decode
    predicted_startup = (costs.request_speedup(best.alpha, startup_k_b1, requests_b1)
                         or gain(served.startup_model, best.alpha, startup_k_b1, 1))
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
    return Prediction(auto_k_b1, predicted, predicted_decode, measured_at, decode_at, startup_k_b1, predicted_startup,
                      overhead_b1)


def measure_acceptance(args: argparse.Namespace, engine: SpeculativeEngine, prompts: list[list[int]],
                       best_k: int) -> tuple[dict[str, float], dict[str, float]]:
    """α per temperature, standard and seeded (coupled): batched, over more prompts, since
    acceptance needs many drafts, not quiet timing."""
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
    return alpha_by_t, coupled_by_t


def compare_at_batch(args: argparse.Namespace, served: Served, batch1: Batch1,
                     size: int) -> dict[str, float | list[float] | dict[str, int]]:
    """Plain, the best fixed K, K auto and plain again at batch ``size``, round by round."""
    prompts, online, best_k = served.prompts, served.online, batch1.best_k
    group = (prompts * (size // len(prompts) + 1))[:size]
    # K auto: each step's K from the cost model at that step's depth (what the gateway's
    # choice and the worker's per-step rule give together), at the measured alpha. Keyed
    # kmax + 1 (requests ask for the deepest K; the rule cuts it).
    rule = AutoK(online, batch1.best.alpha, args.kmax)
    # Four engines (each with its own caches) play plain, fixed K, K auto and plain again,
    # one role per round, each role moving to the next engine every round: two engines
    # doing the same plain work differed by up to 15% over a whole round in a one-off run,
    # so a role tied to one engine carried that engine's luck (its caches, its place in the
    # turns) into the ratio. Plain again (key -1) is that noise, measured in the same run:
    # where K auto runs plain throughout, its ratio to plain is no more than that.
    roles = [0, best_k, args.kmax + 1, -1]
    engines = [SpeculativeEngine(served.target, served.draft, max_slots=size, max_k=args.kmax,
                                 max_positions=args.max_positions) for _ in roles]
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
    batched: dict[str, float | list[float] | dict[str, int]] = {}
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
        f"(K={choose_k(live_model(online), batch1.best.alpha, size, args.kmax, 0.05, 0.0)} at depth {size}) "
        f"{a.tok_s:.1f} tok/s ({a.tok_s / p.tok_s:.2f}x; by round {auto_ratios}); sequence-steps by K drafted "
        f"{dict(sorted(ran.items()))} (by K chosen at the depth {dict(sorted(rule.chosen.items()))}); plain again "
        f"{totals[-1].tok_s:.1f} tok/s ({totals[-1].tok_s / p.tok_s:.2f}x plain; by round {again_ratios})")
    return batched


def main() -> None:
    args = parse_args()
    if args.eagle3 is not None:
        from bench.engine_eagle3 import run

        run(args)
        return
    batch_sizes = [int(b) for b in args.batches.split(",") if b]
    served, engine = load_served(args, batch_sizes)
    batch1 = measure_batch1(args, served)
    plain, other_plain, best_k, best = batch1.plain, batch1.other_plain, batch1.best_k, batch1.best
    forwards = measure_forwards(args, served, batch1)
    bound = speedup_bound(best.alpha, forwards.c, best_k)
    speedup = best.tok_s / plain.tok_s
    fastest_plain = max(plain.tok_s, other_plain.tok_s if other_plain is not None else 0.0)
    log(f"best K={best_k}: speed-up {speedup:.2f}x, bound S={bound:.2f}, measured/bound {speedup / bound:.2f}; "
        f"{best.tok_s / fastest_plain:.2f}x the fastest plain configuration")
    prediction = predict_b1(args, served, batch1)
    trees = measure_trees(args, (served.target, served.draft), served.online, batch1.prompts, best_k)
    alpha_by_t, coupled_by_t = measure_acceptance(args, engine, served.prompts, best_k)
    del engine  # its caches; the batched runs get a plain and a speculative engine of their own
    batched: dict[str, float | list[float] | dict[str, int]] = {}
    for size in batch_sizes:
        batched |= compare_at_batch(args, served, batch1, size)
    if args.json:
        summary = summarize(args, served, batch1, forwards, prediction, alpha_by_t, coupled_by_t, batched, bound,
                            fastest_plain)
        print(json.dumps(summary | {"trees": trees, "targets": tree_targets(trees, batched, batch_sizes)}))


def tree_targets(trees: dict[str, object], batched: dict[str, float | list[float] | dict[str, int]],
                 batch_sizes: list[int]) -> dict[str, dict[str, object]]:
    """Issue #36's engine targets: K auto with trees at batch 1 against the better fixed
    configuration, and at each batch size against plain (K auto's run, where the policy with
    trees allowed chooses no tree there: ``trees.auto_trees_chooses_at_batch``)."""
    ratio = float(trees["auto_trees_over_better_fixed"])  # type: ignore[arg-type]
    out: dict[str, dict[str, object]] = {
        "auto_trees_b1_ge_0.97_better_fixed": {"ratio": ratio, "met": ratio >= 0.97}}
    chooses = trees["auto_trees_chooses_at_batch"]
    assert isinstance(chooses, dict)
    for size in batch_sizes:
        auto, plain = batched[f"tok_s_b{size}_auto"], batched[f"tok_s_b{size}_plain"]
        assert isinstance(auto, float) and isinstance(plain, float)
        no_tree = not str(chooses.get(str(size), "")).startswith("tree")
        out[f"auto_trees_b{size}_ge_0.97_plain"] = {"ratio": round(auto / plain, 3), "chooses": chooses.get(str(size)),
                                                    "met": no_tree and auto / plain >= 0.97}
    return out


def summarize(args: argparse.Namespace, served: Served, batch1: Batch1, forwards: Forwards, prediction: Prediction,
              alpha_by_t: dict[str, float], coupled_by_t: dict[str, float],
              batched: dict[str, float | list[float] | dict[str, int]], bound: float,
              fastest_plain: float) -> dict[str, object]:
    """The run's figures, as the one JSON object ``--json`` prints."""
    costs, target, online = served.costs, served.target, served.online
    plain, other_plain, best, by_k = batch1.plain, batch1.other_plain, batch1.best, batch1.by_k
    timed, other, last = forwards.timed, forwards.other, forwards.last
    assert costs.precision is not None
    speedup = best.tok_s / plain.tok_s
    return {
        "bench": "engine", "dtype": args.dtype, "target_prepacked": target.prepacked, "products": target.products,
        "draft_dtype": args.draft_dtype, "threads": args.threads, "kernels": rowgemm.chosen_build(),
        "prompts": len(batch1.prompts),
        "max_tokens": args.max_tokens, "alpha_t0": round(best.alpha, 4), "best_k": batch1.best_k,
        "acceptance_rate_t0": round(best.accepted / best.proposed, 4),
        "speedup_b1": round(speedup, 3), "bound_b1": round(bound, 3), "speedup_over_bound": round(speedup / bound, 3),
        "c": round(forwards.c, 4), "target_forward_ms": round(1000 * timed["target"], 3),
        "draft_forward_ms": round(1000 * timed["draft"], 3),
        "tok_s_plain_b1": round(plain.tok_s, 1), "tok_s_spec_b1": round(best.tok_s, 1),
        # Plain decoding with the kernels' other products (None where they have one way), and the
        # speed-up against the faster of the two plain configurations.
        "tok_s_plain_b1_other_products": None if other_plain is None else round(other_plain.tok_s, 1),
        "speedup_b1_vs_fastest_plain": round(best.tok_s / fastest_plain, 3),
        "tok_s_b1_by_k": {str(k): round(r.tok_s, 1) for k, r in by_k.items()},
        "alpha_b1_by_k": {str(k): round(r.alpha, 4) for k, r in by_k.items()},
        "draft_share_b1_spec": round(best.draft_share, 3),
        "step_breakdown_b1_ms": batch1.breakdown,
        "greedy_identical_runs": batch1.identical, "greedy_compared_runs": batch1.compared,
        "verify_cost_by_tokens": forwards.verify_cost,
        "other_dtypes": {"target": other[args.dtype], "target_forward_ms": round(1000 * timed["target_alt"], 3),
                         f"verify_cost_{last}_tokens": round(forwards.alt_verify_cost, 3),
                         "draft": other[args.draft_dtype], "draft_forward_ms": round(1000 * timed["draft_alt"], 3)},
        "prefill_by_tokens_ms": {n: {name: round(1000 * s, 1) for name, s in p.items()}
                                 for n, p in forwards.prefill.items()},
        "alpha_by_temperature": alpha_by_t, "alpha_seeded_coupled_by_temperature": coupled_by_t, **batched,
        "cpu": costs.cpu, "precision_choice": {"target": costs.precision.target, "exact": costs.precision.exact,
                                               "why": costs.precision.why},
        "predicted_speedup_b1": round(prediction.speedup, 3), "predicted_k_b1": prediction.k,
        "predicted_decode_speedup_b1": round(prediction.decode_speedup, 3),
        "measured_speedup_at_predicted_k_b1": round(prediction.measured_at_k, 3),
        "decode_speedup_at_predicted_k_b1": round(prediction.decode_at_k, 3),
        "predicted_speedup_b1_startup": round(prediction.startup_speedup, 3),
        "predicted_k_b1_startup": prediction.startup_k,
        "step_overhead_b1": prediction.overhead_b1,
        "cost_model": costs.to_json(), "cost_model_refined": online.report().to_json(),
    }


if __name__ == "__main__":
    main()
