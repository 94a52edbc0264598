"""Does a resumed generation continue exactly as the undisturbed one would? (mid-stream migration)

    python -m bench.resume [--json] [--quick] [--dtypes bfloat16,float32]

A generation that migrates to another worker is resumed from its prompt + output token ids
(gateway/relay/migration.py). The original prefilled the prompt (fused attention, when it is longer
than what rides in a decode step) and computed the output in decode steps (row-invariant). The
resumed prefill splits the same way (``GenerationRequest.resumed_tokens``): the prompt fused,
the output row-invariant in one forward, which computes every token as its decode step did.
Where verification is bit-identical to plain decoding (bfloat16: prepacked on AVX512-BF16/AMX,
unpacked on this AVX2 CPU) the cache and the logits are then the undisturbed run's bit for bit.
float32 makes no such promise: MKL rounds one row differently from several, at about 1e-6 of a
logit, which can flip only a near-tie.

For held-out prompts, per target precision, this runs each generation undisturbed (greedy and
seeded T=0.8, K=6), then resumes it at every ``--every``-th position and compares the
continuation token for token, and the target's KV cache bit for bit. It also reports the
smallest gap between the best and second-best target logit along the greedy paths (a float32
resume can differ only where that gap is within rounding), and what the split costs: the
resumed prefill at the last cut, split against all fused (as before the split), median over the
prompts, and the same for one long output (``--long-output``). Every figure is labelled with
the CPU. The last line with ``--json`` is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from workers.costs.cache import cpu_label
from workers.demo.corpus import heldout_prompts
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.kv_cache import CacheBatch, KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.measurement.measure import verification_bit_identical
from workers.engines.embedded.projections import TORCH_DTYPES
from workers.engines.embedded.sampling import SamplingParams
from workers.text import TextCodec

REPO = Path(__file__).resolve().parent.parent
CASES = {"greedy": SamplingParams(temperature=0.0), "seeded": SamplingParams(temperature=0.8, seed=11)}


def generate(engine: SpeculativeEngine, prompt: list[int], max_tokens: int, params: SamplingParams,
             rid: str, resumed_tokens: int = 0) -> list[int]:
    events = engine.generate(GenerationRequest(rid, prompt, max_tokens, params, k=6, resumed_tokens=resumed_tokens))
    return [t for e in events for t in e.tokens]


def greedy_gaps(target: LlamaForCausalLM, prompt: list[int], output: list[int]) -> list[float]:
    """Best minus second-best target logit at each output position (one full forward)."""
    ids = prompt + output
    cache = KVCache.allocate(target.cfg, 1, target.lm_head.weight.dtype)
    n = len(ids)
    with torch.inference_mode():
        batch = CacheBatch.build([0], [0], [n], n, target.cfg.max_position_embeddings, row_invariant=True)
        wanted = torch.arange(len(prompt) - 1, n - 1)
        logits = target.forward_cached(torch.tensor([ids]), cache, batch, torch.zeros_like(wanted), wanted)
    top = logits.float().topk(2, dim=-1).values
    gaps: list[float] = (top[..., 0] - top[..., 1]).reshape(-1).tolist()
    return gaps


def cache_prefix(engine: SpeculativeEngine, positions: int) -> list[torch.Tensor]:
    """Slot 0's target keys and values at positions [0, positions), every layer."""
    cache = engine.target_cache
    return [t[0, :, :positions].clone() for t in (*cache.k, *cache.v)]


def prefill_ms(engine: SpeculativeEngine, prompt: list[int], output: list[int], rounds: int = 3) -> tuple[float, float]:
    """A resumed request's first step (its prefill) split as resumes run it, and all fused (the
    same ids as a fresh prompt, as resumes ran before the split): median ms, taking turns."""
    split: list[float] = []
    fused: list[float] = []
    for r in range(rounds):
        for resumed, times in ((len(output), split), (0, fused)):
            started = time.perf_counter()
            generate(engine, prompt + output, 1, CASES["greedy"], f"t{r}-{resumed}", resumed)
            times.append(1000 * (time.perf_counter() - started))
    return statistics.median(split), statistics.median(fused)


def run_precision(args: argparse.Namespace, dtype: str, prompts: list[list[int]], long_output: list[int]
                  ) -> dict[str, Any]:
    target = LlamaForCausalLM.from_pretrained(args.target, TORCH_DTYPES[dtype])
    draft = LlamaForCausalLM.from_pretrained(args.draft, TORCH_DTYPES["float32"])
    engine = SpeculativeEngine(target, draft, max_slots=1, max_k=8)
    # The start-up check a worker runs (docs/engine.md section 5): what workers.exact may serve.
    bit_identical = verification_bit_identical(target, 9)
    label = f"{dtype} ({'prepacked' if target.prepacked else 'unpacked'}, verification " \
            f"{'bit-identical' if bit_identical else 'not bit-identical'}) on {cpu_label()}"
    by_case: dict[str, list[int]] = {name: [0, 0] for name in CASES}
    cache_identical = 0  # resumes whose target cache ends bit-identical to the undisturbed run's
    min_gap = float("inf")
    split_ms: list[float] = []
    fused_ms: list[float] = []
    prefill_tokens: list[int] = []
    for p, prompt in enumerate(prompts):
        for name, params in CASES.items():
            full = generate(engine, prompt, args.max_tokens, params, f"{p}-{name}")
            written = len(prompt) + len(full) - 1  # positions both runs wrote from the same tokens
            undisturbed = cache_prefix(engine, written)
            if name == "greedy":
                min_gap = min([min_gap, *greedy_gaps(target, prompt, full)])
            cuts = range(1, len(full), args.every)
            for cut in cuts:
                resumed = SamplingParams(params.temperature, params.top_p, params.top_k, params.seed,
                                         position_offset=cut)
                rest = generate(engine, prompt + full[:cut], args.max_tokens - cut, resumed, f"{p}-{name}-{cut}",
                                resumed_tokens=cut)
                by_case[name][0] += rest == full[cut:]
                by_case[name][1] += 1
                cache_identical += rest == full[cut:] and all(
                    torch.equal(a, b) for a, b in zip(cache_prefix(engine, written), undisturbed, strict=True))
            if name == "greedy" and cuts:
                split, fused = prefill_ms(engine, prompt, full[:cuts[-1]])
                split_ms.append(split)
                fused_ms.append(fused)
                prefill_tokens.append(len(prompt) + cuts[-1])
            print(f"[{dtype}] prompt {p} {name}: {by_case[name][0]}/{by_case[name][1]} resumes identical so far",
                  flush=True)
    identical = sum(case[0] for case in by_case.values())
    compared = sum(case[1] for case in by_case.values())
    split, fused = statistics.median(split_ms), statistics.median(fused_ms)
    # A long output is where the row-invariant part costs: attention one query per kernel row.
    long_split, long_fused = prefill_ms(engine, prompts[0], long_output, rounds=1 if args.quick else 3)
    print(f"{label}: resumed generations identical to the undisturbed ones: {identical}/{compared} "
          f"(greedy {by_case['greedy'][0]}/{by_case['greedy'][1]}, seeded {by_case['seeded'][0]}/"
          f"{by_case['seeded'][1]}), cache bit-identical {cache_identical}/{compared}; smallest greedy logit gap "
          f"{min_gap:.4g}; resumed prefill of ~{round(statistics.median(prefill_tokens))} tokens, split / all fused: "
          f"{split:.1f} / {fused:.1f} ms; of {len(prompts[0])} + {len(long_output)} output tokens: "
          f"{long_split:.1f} / {long_fused:.1f} ms", flush=True)
    return {"dtype": dtype, "target_prepacked": target.prepacked, "verification_bit_identical": bit_identical,
            "label": label, "resumes_compared": compared, "resumes_identical": identical,
            "greedy_identical": by_case["greedy"][0], "greedy_compared": by_case["greedy"][1],
            "seeded_identical": by_case["seeded"][0], "seeded_compared": by_case["seeded"][1],
            "cache_identical": cache_identical, "greedy_min_logit_gap": round(min_gap, 6),
            "prefill_tokens_median": statistics.median(prefill_tokens),
            "resume_prefill_split_ms": round(split, 1), "resume_prefill_all_fused_ms": round(fused, 1),
            "long_resume_prompt_tokens": len(prompts[0]), "long_resume_output_tokens": len(long_output),
            "long_resume_prefill_split_ms": round(long_split, 1),
            "long_resume_prefill_all_fused_ms": round(long_fused, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=REPO / "models/demo-target")
    parser.add_argument("--draft", type=Path, default=REPO / "models/demo-draft")
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="target precisions to run, comma-separated (bfloat16 is what workers.exact serves "
                             "where it verifies bit-identically: prepacked on AVX512-BF16/AMX, unpacked on AVX2)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--every", type=int, default=4, help="resume at every Nth output position")
    parser.add_argument("--long-output", type=int, default=448,
                        help="output tokens of the long resume whose prefill is timed (held-out text's ids)")
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens (smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in TORCH_DTYPES for d in dtypes):
        parser.error(f"--dtypes: choose from {', '.join(TORCH_DTYPES)}")
    if args.quick:
        args.prompts, args.max_tokens, args.every, args.long_output = 2, 24, 6, 64
    torch.set_num_threads(1)
    codec = TextCodec.from_model_dir(args.target)
    prompts = [codec.encode(t) for t in heldout_prompts(args.prompts, seed=3)]
    # Real text's ids stand for a long output (only its prefill is timed, nothing compared).
    long_output = [t for text in heldout_prompts(64, seed=4) for t in codec.encode(text)[1:]][:args.long_output]
    results = [run_precision(args, dtype, prompts, long_output) for dtype in dtypes]
    if args.json:
        print(json.dumps({"cpu": cpu_label(), "prompts": len(prompts), "max_tokens": args.max_tokens,
                          "every": args.every, "precisions": results}))


if __name__ == "__main__":
    main()
