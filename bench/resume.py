"""Does a resumed generation continue exactly as the undisturbed one would? (mid-stream migration)

    python -m bench.resume [--json] [--quick]

A generation that migrates to another worker is resumed from its prompt + output token ids:
the new worker prefills them in one forward and decodes on (gateway/migration.py). The original
computed the output's cache entries in decode steps instead. In bfloat16 on prepacked weights
the two agree bit for bit row by row; in float32 (``workers.dtype: auto`` on a CPU without
AVX512-BF16/AMX) MKL rounds a long prefill's rows differently from one-token decode rows, at
about 1e-6 of a logit, which can flip a near-tie.

For held-out prompts this runs each generation undisturbed (greedy and seeded T=0.8, K=6), then
resumes it at every ``--every``-th position and compares the continuation token for token. It
also reports the smallest gap between the best and second-best target logit along the greedy
paths: a resume can differ only where that gap is within rounding. The last line with ``--json``
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from workers.demo_corpus import heldout_prompts
from workers.engine import GenerationRequest, SpeculativeEngine
from workers.model import TORCH_DTYPES, CacheBatch, KVCache, LlamaForCausalLM, resolve_dtype
from workers.sampling import SamplingParams
from workers.text import TextCodec

REPO = Path(__file__).resolve().parent.parent


def generate(engine: SpeculativeEngine, prompt: list[int], max_tokens: int, params: SamplingParams,
             rid: str) -> list[int]:
    events = engine.generate(GenerationRequest(rid, prompt, max_tokens, params, k=6))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=REPO / "models/demo-target")
    parser.add_argument("--draft", type=Path, default=REPO / "models/demo-draft")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--every", type=int, default=4, help="resume at every Nth output position")
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens (smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.every = 2, 24, 6
    torch.set_num_threads(1)
    dtype = resolve_dtype(args.dtype)
    target = LlamaForCausalLM.from_pretrained(args.target, TORCH_DTYPES[dtype])
    draft = LlamaForCausalLM.from_pretrained(args.draft, TORCH_DTYPES["float32"])
    codec = TextCodec.from_model_dir(args.target)
    engine = SpeculativeEngine(target, draft, max_slots=1, max_k=8)
    prompts = [codec.encode(t) for t in heldout_prompts(args.prompts, seed=3)]
    cases = {"greedy": SamplingParams(temperature=0.0), "seeded": SamplingParams(temperature=0.8, seed=11)}
    compared = identical = 0
    by_case: dict[str, list[int]] = {name: [0, 0] for name in cases}
    min_gap = float("inf")
    for p, prompt in enumerate(prompts):
        for name, params in cases.items():
            full = generate(engine, prompt, args.max_tokens, params, f"{p}-{name}")
            if name == "greedy":
                min_gap = min([min_gap, *greedy_gaps(target, prompt, full)])
            for cut in range(1, len(full), args.every):
                resumed = SamplingParams(params.temperature, params.top_p, params.top_k, params.seed,
                                         position_offset=cut)
                rest = generate(engine, prompt + full[:cut], args.max_tokens - cut, resumed, f"{p}-{name}-{cut}")
                same = rest == full[cut:]
                compared += 1
                identical += same
                by_case[name][0] += same
                by_case[name][1] += 1
            print(f"prompt {p} {name}: {by_case[name][0]}/{by_case[name][1]} resumes identical so far", flush=True)
    result = {"dtype": dtype, "target_prepacked": target.prepacked, "prompts": len(prompts),
              "max_tokens": args.max_tokens, "resumes_compared": compared, "resumes_identical": identical,
              "greedy_identical": by_case["greedy"][0], "greedy_compared": by_case["greedy"][1],
              "seeded_identical": by_case["seeded"][0], "seeded_compared": by_case["seeded"][1],
              "greedy_min_logit_gap": round(min_gap, 6)}
    print(f"resumed generations identical to the undisturbed ones: {identical}/{compared} ({dtype}); smallest "
          f"greedy logit gap {min_gap:.4g}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
