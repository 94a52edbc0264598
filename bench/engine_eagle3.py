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
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from typing import Any

import torch

from bench.engine_runs import RunResult, run_interleaved
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
from workers.engines.embedded.projections import TORCH_DTYPES, products_named
from workers.text import TextCodec

SPEEDUP_TARGET = 1.8
PREDICTION_TOLERANCE = 0.10


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    rowgemm.set_threads(args.threads)
    torch.manual_seed(0)
    costs = measure(MeasureSettings(args.target, args.draft, 16, args.kmax, args.dtype, args.draft_dtype,
                                    not args.inexact, args.cost_budget_s, args.threads))
    assert costs.precision is not None
    torch.set_num_threads(torch_threads_serving(costs.precision, args.threads))
    target = LlamaForCausalLM.from_pretrained(args.target, TORCH_DTYPES[costs.precision.target],
                                              costs.precision.prepacked, products_named(costs.precision.products))
    codec = TextCodec.from_model_dir(args.target)
    prompts = [codec.encode_chat([ChatMessage("user", text)]) for text in load_task_prompts()["code"][:args.prompts]]
    positions = max(map(len, prompts)) + args.max_tokens + args.kmax + 1
    head = Eagle3Head.load(args.eagle3, target.cfg, target.embed_rows, 1, positions)
    precision = costs.precision
    costs = dataclasses.replace(costs, **head_costs(head, costs))
    model = CostModel.from_json(costs.to_json())
    engines = {0: SpeculativeEngine(target, None, max_slots=1, max_k=args.kmax, max_positions=positions)}
    for k in range(1, args.kmax + 1):
        engines[k] = SpeculativeEngine(target, None, max_slots=1, max_k=args.kmax, max_positions=positions,
                                       eagle=head, rng=random.Random(7))
    methods: dict[int, Method] = dict.fromkeys(range(1, args.kmax + 1), "eagle3")
    run_interleaved(engines, [prompts[:1]], 8, 0.0, methods=methods)  # warm-up
    print(f"CPU: {cpu_label()}; target {precision.target} ({precision.why}); head costs "
          f"first {costs.head_first_cost}, later {costs.head_draft_cost} of a plain step", flush=True)
    totals, outputs = run_interleaved(engines, [[p] for p in prompts], args.max_tokens, 0.0, methods=methods)
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
