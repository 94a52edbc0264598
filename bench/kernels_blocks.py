"""The block kernels against the float32 ones, projection by projection (issue #55, docs/engine.md
section 1b):

    python -m bench.kernels --blocks models/smollm2-135m-instruct-q4_1 [--rows 150,1000] [--json] [--quick]

One pass of the target's projections (every layer's QKV, O, gate/up and down, and the LM head on
its own) at 1-9, 16 and 150 rows, served from the GGUF's blocks (``q4_1``: Q4_1 projections, the
Q8_0 head) and from the float32 conversion's panels, taking turns a pass each (medians). Both
compute the same bits; the figures say what each path costs where: 1-3 rows widen blocks in
registers, 4-8 a block at a time into L1, 9 and more a chunk of panels into L2
(kernels/quant_blocks.h). ``cycles_per_16_weights_per_row`` puts the blocks' time at the CPU's
nominal clock (``--ghz``) in the unit the kernel's comments use."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from bench.procs import print_result
from bench.turns import median_in_turns
from workers.costs.cache import cpu_label
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.quantized import load_blocks

ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 150)


def _panels(model: LlamaForCausalLM) -> tuple[list[rowgemm.Panels], rowgemm.Panels]:
    frozen = model.frozen_projections()
    panels = [f.panels for f in frozen[:-1] if f is not None and f.panels is not None]
    head = frozen[-1]
    assert head is not None and head.panels is not None
    return panels, head.panels


def run(args: argparse.Namespace) -> None:
    kernel = rowgemm.load()
    if kernel is None:
        raise SystemExit("bench.kernels --blocks: the kernels do not build here (no C compiler or no AVX2)")
    torch.set_num_threads(1)
    blocks = load_blocks(args.blocks)
    float32 = LlamaForCausalLM.from_pretrained(args.blocks, torch.float32)
    float32.release_sources()
    (q_proj, q_head), (f_proj, f_head) = _panels(blocks), _panels(float32)
    weights = sum(p.weights.shape[0] * 8 * p.k for p in q_proj)
    rows = tuple(int(r) for r in args.rows.split(",")) if args.rows else ROWS[:5] if args.quick else ROWS
    reps = 3 if args.quick else max(5, args.reps // 4)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {"q4_1": {}, "float32": {}, "q8_0_head": {}, "float32_head": {}}
    with torch.inference_mode():
        for m in rows:
            inputs = [torch.randn(m, p.k, generator=gen) for p in q_proj]
            head_in = torch.randn(min(m, 9), q_head.k, generator=gen)  # the head: only logits a step reads

            def projections(panels: list[rowgemm.Panels], xs: list[torch.Tensor] = inputs) -> Callable[[], None]:
                def one_pass() -> None:
                    for x, p in zip(xs, panels, strict=True):
                        kernel.linear(x, p)
                return one_pass

            def head(panels: rowgemm.Panels, x: torch.Tensor = head_in) -> Callable[[], None]:
                def one_call() -> None:
                    kernel.linear(x, panels)
                return one_call

            timed = median_in_turns({"q4_1": projections(q_proj), "float32": projections(f_proj),
                                     "q8_0_head": head(q_head), "float32_head": head(f_head)}, reps, warmup=1)
            for name, seconds in timed.items():
                out[name][str(m)] = round(1000 * seconds, 3)
    cycles = {r: round(ms / 1000 * args.ghz * 1e9 / (weights / 16) / int(r), 2) for r, ms in out["q4_1"].items()}
    over = {r: round(out["float32"][r] / out["q4_1"][r], 2) for r in out["q4_1"]}
    for r in out["q4_1"]:
        print(f"{r} rows: projections q4_1 {out['q4_1'][r]:.2f} ms, float32 {out['float32'][r]:.2f} ms "
              f"({over[r]:.2f}x); head q8_0 {out['q8_0_head'][r]:.2f} ms, float32 {out['float32_head'][r]:.2f} ms; "
              f"{cycles[r]} cycles / 16 weights / row at {args.ghz} GHz", flush=True)
    print_result({"bench": "kernels_blocks", "cpu": cpu_label(), "target": str(args.blocks), "ms": out,
                  "float32_over_q4_1": over, "cycles_per_16_weights_per_row": cycles, "ghz": args.ghz,
                  "projection_weights": weights}, args.json)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=Path, default=None,
                        help="a converted directory with gguf-panels/: time its block kernels against float32")
    parser.add_argument("--ghz", type=float, default=3.2, help="the clock --blocks' cycle counts assume")
    parser.add_argument("--rows", default=None, help="--blocks: these row counts only (e.g. 150,1000: prefills)")
