"""What the float32 kernels' choices buy on this CPU (workers/engines/embedded/kernels/rowgemm.py,
docs/engine.md section 1).

    python -m bench.kernels [--json] [--quick]
    python -m bench.kernels --blocks models/smollm2-135m-instruct-q4_1 [--json]   (bench/kernels_blocks.py)

- ``projections_ms``: one pass of the target's projections (all of its bfloat16 panels, 28 MB
  for the demo target: more than stays cached beside everything else) for 1 to 9 rows, in
  each build ``workers.engines.embedded.kernels.rowgemm.load()`` chooses between (``prefetch``: software prefetching 12
  KB ahead; ``no_prefetch``: the hardware prefetcher alone) and, on a CPU with AVX-512,
  ``eight_wide``: the served build with the 8-column tiles of an AVX2 CPU (``WIDE_TILES=0``)
  instead of 16-column ones; on a CPU with AVX512-BF16, ``products``: the served build's
  bfloat16 products (inputs rounded to bfloat16, ``vdpbf16ps``) on the same panels. The builds
  take turns, a pass each, and every figure is a median.
  ``rows_over_one`` divides each row count's time by one row's: the shape of the verification
  curve's projections. ``served``: the build ``load()`` chose here, and its start-up timings.
- ``draft_forward_ms``: a draft forward of 1 token at batch 1 right after a target forward (as
  the first draft forward of every speculative step runs: the target's weights have just
  streamed past the draft's) and right after another draft forward (its weights cached).
- ``mixed_steps_depth8``: the target's one-call forward at batch 8 after 100 cached tokens, for
  rows of 1 token each, 4 each, and mixes (2 rows of 4 and 6 of 1; 1 of 6 and 7 of 1, as when
  some sessions verify K + 1 tokens beside plain ones), taking turns; each shape's median, and
  its ratio to the 1-token step next to what the cost model's mixed pricing says (the forward
  at n = tokens / rows, linear between the uniform shapes): the forward computes only real
  tokens (packed rows), so a mixed step costs about its tokens.
- ``greedy_drafting_k3``: greedy decoding at K=3, batch 1, on held-out prompts, by two engines
  taking turns a step each: drafting all K in one kernel call (as served) and per position
  from Python; the median drafting phase and step, and tokens/s, of each.

Python's call overhead (about 10 µs a projection) is inside ``projections_ms`` alike for both
builds; the forwards go through ``workers.engines.embedded.forwards.native_forward``, as the engine runs them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.kernels_blocks import add_arguments as add_block_arguments
from bench.kernels_blocks import run as run_blocks
from bench.turns import median_in_turns
from workers.api.generation import SamplingParams
from workers.costs.cache import cpu_label
from workers.demo.corpus import heldout_prompts
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.forwards import native_forward
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.kv_cache import KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.text import TextCodec

REPO = Path(__file__).resolve().parent.parent
CONTEXT = 128  # cached tokens before each timed forward, as the cost measurement uses


def projection_pass(kernel: rowgemm.RowGemm, panels: list[rowgemm.Panels], inputs: list[torch.Tensor],
                    dot: bool = False) -> Callable[[], None]:
    def run() -> None:
        for packed, x in zip(panels, inputs, strict=True):
            kernel.linear(x, packed, dot)
    return run


PRODUCTS = "products"  # projections_ms's name for the served build multiplying in bfloat16


def projections_ms(target: LlamaForCausalLM, builds: dict[str, rowgemm.RowGemm], max_rows: int,
                   reps: int) -> dict[str, dict[str, float]]:
    panels = [f.panels for f in target.frozen_projections() if f is not None and f.panels is not None]
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {name: {} for name in builds}
    for rows in range(1, max_rows + 1):
        inputs = [torch.randn(rows, p.k, generator=gen) for p in panels]
        runs = {name: projection_pass(kernel, panels, inputs, name == PRODUCTS) for name, kernel in builds.items()}
        for name, seconds in median_in_turns(runs, reps, warmup=2).items():
            out[name][str(rows)] = round(1000 * seconds, 3)
    return out


def draft_forward_ms(target: LlamaForCausalLM, draft: LlamaForCausalLM, reps: int) -> dict[str, float]:
    target_cache = KVCache.allocate(target.cfg, 1, torch.float32)
    draft_cache = KVCache.allocate(draft.cfg, 1, torch.float32)

    def forward(model: LlamaForCausalLM, cache: KVCache) -> float:
        started = time.perf_counter()
        if native_forward(model, cache, [[7]], [0], [CONTEXT], [0], row_invariant=model is target) is None:
            raise SystemExit("bench.kernels: the models do not run on the kernels here")
        return time.perf_counter() - started

    after_target, cached = [], []
    for i in range(reps + 2):
        forward(target, target_cache)
        cold = forward(draft, draft_cache)
        warm = forward(draft, draft_cache)
        if i >= 2:
            after_target.append(cold)
            cached.append(warm)
    return {"after_target": round(1000 * statistics.median(after_target), 3),
            "cached": round(1000 * statistics.median(cached), 3)}


MIXED_SHAPES = {"1 each": [1] * 8, "4 each": [4] * 8, "2x4 + 6x1": [4, 4] + [1] * 6, "1x6 + 7x1": [6] + [1] * 7,
                "6 each": [6] * 8}


def mixed_steps(target: LlamaForCausalLM, reps: int) -> dict[str, dict[str, float]]:
    fused = target.fused
    if fused is None:
        raise SystemExit("bench.kernels: the target does not run on the kernels here")
    cache = KVCache.allocate(target.cfg, 8, torch.float32)
    for slot in range(8):
        fused.run_rows([list(range(5, 5 + CONTEXT - 28))], cache.k, cache.v, [slot], [0], [0])
    start = CONTEXT - 28

    def step(lengths: list[int]) -> Callable[[], None]:
        rows = [[7] * n for n in lengths]
        width = max(lengths)
        idx = [b * width + c for b, n in enumerate(lengths) for c in range(n)]

        def run() -> None:
            fused.run_rows(rows, cache.k, cache.v, list(range(8)), [start] * 8, idx)
        return run

    times = median_in_turns({name: step(lengths) for name, lengths in MIXED_SHAPES.items()}, reps, warmup=2)
    one, four, six = times["1 each"], times["4 each"], times["6 each"]
    out = {}
    for name, lengths in MIXED_SHAPES.items():
        n = sum(lengths) / len(lengths)  # tokens per row: what the mixed pricing interpolates on
        priced = one + (four - one) * (n - 1) / 3 if n <= 4 else four + (six - four) * (n - 4) / 2
        out[name] = {"ms": round(1000 * times[name], 3), "over_one": round(times[name] / one, 3),
                     "priced_over_one": round(priced / one, 3)}
    return out


def greedy_drafting(target: LlamaForCausalLM, draft: LlamaForCausalLM, prompts: list[list[int]], k: int,
                    max_tokens: int) -> dict[str, dict[str, float]]:
    """Greedy decoding at batch 1 and depth ``k`` on two engines that differ only in how they
    draft: all K drafts in one kernel call (as served) or a forward and an argmax per draft
    position from Python. The engines take turns, a step each, over the same prompts; per
    engine: the median drafting phase of a decode step, the median step, and tokens/s."""
    engines = {name: SpeculativeEngine(target, draft, max_slots=1, max_k=k, drafting_in_one_call=one_call)
               for name, one_call in (("one_call", True), ("per_position", False))}
    drafts: dict[str, list[float]] = {name: [] for name in engines}
    steps: dict[str, list[float]] = {name: [] for name in engines}
    tokens, seconds = dict.fromkeys(engines, 0), dict.fromkeys(engines, 0.0)
    greedy = SamplingParams(temperature=0.0)
    for i, ids in enumerate(prompts):
        for engine in engines.values():
            engine.add(GenerationRequest(f"p{i}", ids, max_tokens, greedy, k=k))
        while any(engine.has_work for engine in engines.values()):
            for name, engine in engines.items():
                if not engine.has_work:
                    continue
                started = time.perf_counter()
                events = engine.step()
                seconds[name] += time.perf_counter() - started
                tokens[name] += sum(len(e.tokens) for e in events)
                shape = engine.last_shape
                if not shape.prefill and shape.drafts == k and shape.target_width == k + 1:
                    drafts[name].append(engine.last_draft_s)
                    steps[name].append(engine.last_step_s)
    return {name: {"drafting_ms": round(1000 * statistics.median(drafts[name]), 3),
                   "step_ms": round(1000 * statistics.median(steps[name]), 3),
                   "tok_s": round(tokens[name] / seconds[name], 1)} for name in engines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=REPO / "models/demo-target")
    parser.add_argument("--draft", type=Path, default=REPO / "models/demo-draft")
    parser.add_argument("--max-rows", type=int, default=9)
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--quick", action="store_true", help="fewer rows and repetitions (smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    add_block_arguments(parser)
    args = parser.parse_args()
    if args.blocks is not None:
        run_blocks(args)
        return
    if args.quick:
        args.max_rows, args.reps = 4, 5
    torch.set_num_threads(1)  # as a worker runs
    served = rowgemm.load()
    builds = {name: rowgemm.load_variant(defines)
              for name, defines in zip(("prefetch", "no_prefetch"), rowgemm.PREFETCH_CHOICES, strict=True)}
    chosen = rowgemm.chosen_build()
    if served is None or chosen is None or None in builds.values():
        raise SystemExit("bench.kernels: workers/engines/embedded/kernels/rowgemm.py does not build here "
                         "(no C compiler or no AVX2)")
    if rowgemm.wide_tiles():
        builds["eight_wide"] = rowgemm.load_variant((*chosen["defines"], "WIDE_TILES=0"))  # type: ignore[misc]
    if served.dot_products:
        builds[PRODUCTS] = served
    target = LlamaForCausalLM.from_pretrained(args.target, torch.float32)
    draft = LlamaForCausalLM.load_draft(args.draft, target=args.target)
    cpu = cpu_label()
    print(f"CPU: {cpu}; served build {chosen}", flush=True)
    with torch.inference_mode():
        projections = projections_ms(target, {n: b for n, b in builds.items() if b is not None}, args.max_rows,
                                     args.reps)
        draft_ms = draft_forward_ms(target, draft, args.reps * 4)
        mixed = mixed_steps(target, args.reps)
        codec = TextCodec.from_model_dir(args.target)
        prompts = [codec.encode(text) for text in heldout_prompts(2 if args.quick else 8, seed=1)]
        drafting = greedy_drafting(target, draft, prompts, 3, 16 if args.quick else 96)
    over_one = {name: {rows: round(ms / times["1"], 3) for rows, ms in times.items()}
                for name, times in projections.items()}
    for name, times in projections.items():
        print(f"target projections, one pass, {name}: " + ", ".join(
            f"{rows} rows {ms:.2f} ms ({over_one[name][rows]:.2f}x)" for rows, ms in times.items()), flush=True)
    print(f"draft forward at batch 1: right after a target forward {draft_ms['after_target']:.3f} ms, "
          f"with its weights cached {draft_ms['cached']:.3f} ms")
    print("target forward at batch 8 (ms, x the 1-token step; the mixed pricing's x): " + ", ".join(
        f"{name} {m['ms']:.2f} ({m['over_one']:.2f}x; priced {m['priced_over_one']:.2f}x)"
        for name, m in mixed.items()), flush=True)
    for name, figures in drafting.items():
        print(f"greedy decoding at batch 1, K=3, drafting {name.replace('_', ' ')}: drafting "
              f"{figures['drafting_ms']:.3f} ms of a {figures['step_ms']:.3f} ms step, {figures['tok_s']:.1f} tok/s")
    if args.json:
        print(json.dumps({"bench": "kernels", "cpu": cpu, "served": chosen, "projections_ms": projections,
                          "rows_over_one": over_one, "draft_forward_ms": draft_ms, "mixed_steps_depth8": mixed,
                          "greedy_drafting_k3": drafting}))


if __name__ == "__main__":
    main()
