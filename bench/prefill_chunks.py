"""What chunked prefill costs: a cold prompt prefilled in one fused forward against position-aligned
chunks of 128, 256 and 512 tokens, on the real target.

    python -m bench.prefill_chunks [--json] [--lengths 300 1000 2000] [--reps 3]

The embedded engine prefills every prompt in chunks (``prefix_cache.PREFILL_CHUNK``) so that a
cached chunk is the same bits as a cold one (prefix reuse). This times a one-token request's
prompt at each length and chunk size (one thread, the best of ``--reps``), the serving precision
the worker picks for SmolLM2 (float32 on the prepacked kernels), and prints each chunk size's
time over the one-shot prefill's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.procs import print_result
from workers.costs.cache import cpu_label
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sampling import SamplingParams

REPO = Path(__file__).resolve().parent.parent
CHUNKS = (128, 256, 512)
ONE_SHOT = 1 << 30  # a chunk longer than any prompt


def prefill_s(target: LlamaForCausalLM, prompt: list[int], chunk: int, reps: int) -> float:
    engine = SpeculativeEngine(target, None, max_slots=1, max_k=0, max_positions=len(prompt) + 64,
                               prefill_chunk=chunk)
    times = []
    for rep in range(reps):
        started = time.perf_counter()
        engine.generate(GenerationRequest(f"r{rep}", prompt, 1, SamplingParams(temperature=0.0)))
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--target", type=Path, default=REPO / "models/smollm2-135m-instruct-q4_1")
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 1000, 2000])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rowgemm.set_threads(1)
    target = LlamaForCausalLM.from_pretrained(args.target, torch.float32)
    gen = torch.Generator().manual_seed(0)
    rows: dict[str, dict[str, float]] = {}
    for length in args.lengths:
        prompt = torch.randint(100, target.cfg.vocab_size, (length,), generator=gen).tolist()
        one_shot = prefill_s(target, prompt, ONE_SHOT, args.reps)
        rows[str(length)] = {"one_shot_ms": round(1000 * one_shot, 1)} | {
            f"chunk_{chunk}_over_one_shot": round(prefill_s(target, prompt, chunk, args.reps) / one_shot, 3)
            for chunk in CHUNKS}
        print(f"{length:>5} tokens: " + ", ".join(f"{k} {v}" for k, v in rows[str(length)].items()), flush=True)
    print(f"CPU: {cpu_label()}")
    print_result({"bench": "prefill_chunks", "cpu": cpu_label(), "prefill": rows}, args.json)


if __name__ == "__main__":
    main()
