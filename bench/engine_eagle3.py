"""The EAGLE-3 head in the embedded engine at batch 1, against the fastest plain configuration, in one run:

    python -m bench.engine --eagle3 models/smollm2-eagle3 --target models/smollm2-135m-instruct-q4_1 \\
        --draft models/smollm2-draft [--json] [--quick]

(``bench.engine --eagle3 DIR`` runs this.) Chat-formatted code prompts (bench/data/task_prompts.jsonl's code
class), greedy, one sequence at a time: plain decoding and the head at each K = 1..kmax take turns a step
at a time (``bench.engine_runs.run_interleaved``: the same prompts, the same machine noise). The worker's
own start-up measurement (its precision choice, the target's verification costs) and the head's measured
forwards (``head_first_cost``, ``head_draft_cost``) price each K as the policy prices it
(``policies.cost.head_step_cost``): ``predicted`` is that price's speed-up at the measured α, next to the
measured speed-up of the decode steps. Targets (issue #54): ``real_pair_speedup_b1``, the best K's
tokens/s ÷ plain's (prefills included) ≥ 1.8; ``prediction_error`` ≤ 0.10 at that K.

Where the worker serves the GGUF's blocks (``q4_1``, issue #55), plain decoding of the float32
conversion takes turns with the rest too: ``quantized_plain_over_float32_plain`` (≥ 1.6), the
two plain configurations' tokens/s on the same prompts. And each prefills 150- and 1,000-token
prompts, taking turns (``prefill_ms``; the target: the blocks no slower than float32).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from typing import Any

import torch

from bench.engine_runs import RunResult, prefill_times, run_interleaved
from bench.procs import print_result
from bench.prompts import load_task_prompts
from policies import CostModel
from policies.cost import expected_tokens, head_step_cost
from policies.methods import Method
from workers.api.wire import ChatMessage
from workers.costs.cache import cpu_label
from workers.engines.embedded.eagle3.costs import head_costs
from workers.engines.embedded.eagle3.head import Eagle3Head
from workers.engines.embedded.engine import SpeculativeEngine
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.measurement.measure import measure
from workers.engines.embedded.measurement.precision import torch_threads_serving
from workers.engines.embedded.measurement.settings import MeasureSettings
from workers.engines.embedded.projections import products_named
from workers.engines.embedded.quantized import blocks_unavailable, load_target
from workers.text import TextCodec

SPEEDUP_TARGET = 1.8
PREDICTION_TOLERANCE = 0.10
QUANTIZED_PLAIN_TARGET = 1.6  # issue #55: the blocks' plain step against the float32 conversion's
OTHER_CONFIG = -3  # run_interleaved's key (a negative one: plain) for the other plain configuration
PREFILL_TOKENS = (150, 1000)


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    rowgemm.set_threads(args.threads)
    torch.manual_seed(0)
    costs = measure(MeasureSettings(args.target, args.draft, 16, args.kmax, args.dtype, args.draft_dtype,
                                    not args.inexact, args.cost_budget_s, args.threads))
    assert costs.precision is not None
    precision = costs.precision
    torch.set_num_threads(torch_threads_serving(costs.precision, args.threads))
    target = load_target(args.target, costs.precision.target, costs.precision.prepacked,  # type: ignore[arg-type]
                         products_named(costs.precision.products))
    codec = TextCodec.from_model_dir(args.target)
    prompts = [codec.encode_chat([ChatMessage("user", text)]) for text in load_task_prompts()["code"][:args.prompts]]
    positions = max(map(len, prompts)) + args.max_tokens + args.kmax + 1
    head = Eagle3Head.load(args.eagle3, target.cfg, target.embed_rows, 1, positions)
    costs = dataclasses.replace(costs, **head_costs(head, costs))
    model = CostModel.from_json(costs.to_json())
    engines = {0: SpeculativeEngine(target, None, max_slots=1, max_k=args.kmax, max_positions=positions)}
    for k in range(1, args.kmax + 1):
        engines[k] = SpeculativeEngine(target, None, max_slots=1, max_k=args.kmax, max_positions=positions,
                                       eagle=head, rng=random.Random(7))
    other = _other_plain(args, precision.target)
    if other is not None:  # the other plain configuration, taking turns with the rest
        engines[OTHER_CONFIG] = SpeculativeEngine(other[1], None, max_slots=1, max_k=args.kmax, max_positions=positions)
    methods: dict[int, Method] = dict.fromkeys(range(1, args.kmax + 1), "eagle3")
    run_interleaved(engines, [prompts[:1]], 8, 0.0, methods=methods)  # warm-up
    print(f"CPU: {cpu_label()}; target {precision.target} ({precision.why}); head costs "
          f"first {costs.head_first_cost}, later {costs.head_draft_cost} of a plain step", flush=True)
    totals, outputs = run_interleaved(engines, [[p] for p in prompts], args.max_tokens, 0.0, methods=methods)
    other_plain = totals.pop(OTHER_CONFIG, None)
    other_identical = outputs.pop(OTHER_CONFIG, None) == outputs[0]
    plain = totals.pop(0)
    identical = sum(outputs[k][i] == outputs[0][i] for k in totals for i in range(len(prompts)))
    rows = {k: _row(r, plain, model, k) for k, r in totals.items()}
    for k, row in rows.items():
        print(f"K={k}: {row['tok_s']:.1f} tok/s ({row['speedup']:.2f}x plain {plain.tok_s:.1f}), α {row['alpha']:.3f}, "
              f"accepted/proposed {row['accepted_per_proposed']:.3f}; decode {row['decode_speedup']:.2f}x, "
              f"predicted {row['predicted']:.2f}x", flush=True)
    best = max(rows, key=lambda k: rows[k]["tok_s"])
    error = abs(rows[best]["predicted"] - rows[best]["decode_speedup"]) / rows[best]["decode_speedup"]
    out: dict[str, Any] = {
        "bench": "engine_eagle3", "cpu": cpu_label(), "target": str(args.target), "eagle3": str(args.eagle3),
        "prompts": len(prompts), "max_tokens": args.max_tokens, "threads": args.threads,
        "precision": precision.target, "head_first_cost": costs.head_first_cost,
        "head_draft_cost": costs.head_draft_cost, "plain_tok_s": round(plain.tok_s, 2),
        "plain_decode_tok_s": round(plain.decode_tok_s, 2), "by_k": rows, "best_k": best,
        "identical_to_plain": [identical, len(totals) * len(prompts)],
        "targets": {"real_pair_speedup_b1": {"ratio": rows[best]["speedup"], "target": SPEEDUP_TARGET,
                                             "met": rows[best]["speedup"] >= SPEEDUP_TARGET},
                    "prediction_error": {"value": round(error, 4), "target": PREDICTION_TOLERANCE,
                                         "met": error <= PREDICTION_TOLERANCE}}}
    out["what_alpha_buys"] = _what_alpha_buys(model, args.kmax)
    buys = out["what_alpha_buys"]
    print("the cost model's price of the head on this target: break-even α by K " + ", ".join(
        f"K={k} {a}" for k, a in buys["break_even_alpha"].items()) + "; at α 0.7: " + ", ".join(
        f"K={k} {v}x" for k, v in buys["at_alpha"]["0.7"].items()), flush=True)
    if other is not None and other_plain is not None:
        out |= _quantized_figures(args, precision.target, target, other, plain, other_plain, other_identical)
        out["targets"] |= out.pop("quantized_targets")
    print(f"best K={best}: {rows[best]['speedup']:.2f}x plain (target {SPEEDUP_TARGET}); prediction error "
          f"{error:.3f}; output identical to plain in {identical}/{len(totals) * len(prompts)} (prompt, K) runs")
    print_result(out, args.json)


def _row(result: RunResult, plain: RunResult, model: CostModel, k: int) -> dict[str, float]:
    alpha = result.alpha
    return {"tok_s": round(result.tok_s, 2), "speedup": round(result.tok_s / plain.tok_s, 4),
            "decode_speedup": round(result.decode_tok_s / plain.decode_tok_s, 4), "alpha": round(alpha, 4),
            "accepted_per_proposed": round(result.accepted / max(1, result.proposed), 4),
            "predicted": round(expected_tokens(alpha, k) / head_step_cost(model, 1, k), 4),
            "draft_share": round(result.draft_share, 4)}


def _other_plain(args: argparse.Namespace, served: str) -> tuple[str, LlamaForCausalLM] | None:
    """The plain configuration to compare the served one with: float32 where the blocks serve,
    the blocks where float32 serves and they can; None otherwise."""
    if served == "q4_1":
        other = LlamaForCausalLM.from_pretrained(args.target, torch.float32)
        other.release_sources()
        return "float32", other
    if served == "float32" and blocks_unavailable(args.target) is None:
        return "q4_1", load_target(args.target, "q4_1")
    return None


def _quantized_figures(args: argparse.Namespace, served: str, target: LlamaForCausalLM,
                       other: tuple[str, LlamaForCausalLM], plain: RunResult, other_plain: RunResult,
                       identical: bool) -> dict[str, Any]:
    """Issue #55's figures: the blocks' plain decoding against the float32 conversion's (the same
    prompts, taking turns), and their prefills."""
    models = {served: target, other[0]: other[1]}
    quantized, float32 = (plain, other_plain) if served == "q4_1" else (other_plain, plain)
    ratio = quantized.tok_s / float32.tok_s
    reps = 1 if args.quick else 3
    prefill = {name: prefill_times(model, list(PREFILL_TOKENS), reps, only_served=True) for name, model in
               models.items()}
    prefill_ms = {str(n): {name: round(1000 * prefill[name][str(n)]["served"], 1) for name in models}
                  for n in PREFILL_TOKENS}
    slowest = max(row["q4_1"] / row["float32"] for row in prefill_ms.values())
    print(f"plain: q4_1 {quantized.tok_s:.1f} tok/s, float32 {float32.tok_s:.1f} tok/s ({ratio:.2f}x; target "
          f"{QUANTIZED_PLAIN_TARGET}); the same tokens: {identical}; prefill ms by prompt tokens: {prefill_ms}",
          flush=True)
    return {"float32_plain_tok_s": round(float32.tok_s, 2), "q4_1_plain_tok_s": round(quantized.tok_s, 2),
            "q4_1_output_is_float32s": identical, "prefill_ms": prefill_ms,
            "quantized_targets": {
                "quantized_plain_over_float32_plain": {"ratio": round(ratio, 3), "target": QUANTIZED_PLAIN_TARGET,
                                                       "met": ratio >= QUANTIZED_PLAIN_TARGET},
                "quantized_prefill_over_float32": {"ratio": round(slowest, 3), "target": 1.0,
                                                   "met": slowest <= 1.0}}}


def _what_alpha_buys(model: CostModel, kmax: int) -> dict[str, Any]:
    """What the head can buy on this target by the cost model's own price of its steps (the
    measured verification costs and head forwards): the per-token acceptance at which each K
    breaks even with plain decoding, and each K's predicted speed-up at a few acceptances."""
    def speedup(alpha: float, k: int) -> float:
        return expected_tokens(alpha, k) / head_step_cost(model, 1, k)

    def break_even(k: int) -> float | None:
        lo, hi = 0.0, 1.0
        if speedup(hi, k) < 1.0:
            return None  # not even a head that is always right pays at this K
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if speedup(mid, k) < 1.0 else (lo, mid)
        return round(hi, 3)

    return {"break_even_alpha": {str(k): break_even(k) for k in range(1, kmax + 1)},
            "at_alpha": {str(a): {str(k): round(speedup(a, k), 3) for k in range(1, kmax + 1)}
                         for a in (0.3, 0.5, 0.7, 0.9)}}
