"""Would a restricted draft vocabulary pay? The draft's LM head over the N most frequent tokens only.

    python -m bench.draft_vocab [--json] [--quick]

Speculative sampling stays exact with any draft distribution q, so the draft may score only
the N most frequent target tokens (q = 0 for the rest). That saves LM-head work per draft
forward, and costs acceptance wherever the target's token is outside the N: such a draft
position can never be accepted. This measures both sides, nothing is built:

- ``c_by_vocab``: draft forward / target forward at batch depths 1 and 8 with the head cut to
  N rows (taking turns, one forward each, the median kept), N = the full vocabulary first;
- ``coverage_by_vocab``: the share of held-out code tokens inside the N most frequent tokens of
  the training side of the demo corpus: an upper bound on the acceptance left;
- ``greedy_agreement_by_vocab``: on held-out code, teacher-forced, the share of positions where
  the draft's argmax over the N (the full vocabulary first) is the target's: α at T=0 on that
  text, and what the cut costs in acceptance.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from bench.turns import median_in_turns
from workers.demo.corpus import stdlib_sources
from workers.engines.embedded.kv_cache import CacheBatch, KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.projections import TORCH_DTYPES, FrozenLinear
from workers.text import TextCodec

REPO = Path(__file__).resolve().parent.parent
CONTEXT = 128  # cached tokens before the timed forward, as the cost measurement uses
WINDOW = 256  # held-out tokens per teacher-forced forward (greedy agreement)


def token_order(codec: TextCodec, files: int) -> tuple[list[int], list[int]]:
    """Token ids by frequency on the training side of the corpus, and the held-out side's tokens."""
    sources = stdlib_sources()
    counts: Counter[int] = Counter()
    for source in [s for s in sources if not s.heldout][:files]:
        counts.update(codec.encode(source.text))
    held = [t for s in [s for s in sources if s.heldout][:files // 6] for t in codec.encode(s.text)]
    return [t for t, _ in counts.most_common()], held


def forward(model: LlamaForCausalLM, depth: int, head: FrozenLinear | None, row_invariant: bool) -> Callable[[], None]:
    cache = KVCache.allocate(model.cfg, depth, model.lm_head.weight.dtype)
    tokens = torch.full((depth, 1), 7, dtype=torch.long)
    rows, cols = torch.arange(depth), torch.zeros(depth, dtype=torch.long)

    def run() -> None:
        if head is not None:
            model.head_frozen = head
        batch = CacheBatch.build(list(range(depth)), [CONTEXT] * depth, [1] * depth, 1,
                                 model.cfg.max_position_embeddings, row_invariant=row_invariant)
        model.forward_cached(tokens, cache, batch, rows, cols)
    return run


@torch.inference_mode()
def c_by_vocab(target: LlamaForCausalLM, draft: LlamaForCausalLM, order: list[int], sizes: list[int], depth: int,
               reps: int) -> dict[str, float]:
    full = draft.head_frozen
    weight = draft.lm_head.weight.detach()
    heads = {n: FrozenLinear(weight[torch.tensor(order[:n])].contiguous()) for n in sizes if n < weight.shape[0]}
    runs = {"target": forward(target, depth, None, True), str(weight.shape[0]): forward(draft, depth, full, False)}
    runs |= {str(n): forward(draft, depth, head, False) for n, head in heads.items()}
    median = median_in_turns(runs, reps, warmup=5)
    draft.head_frozen = full
    return {name: round(median[name] / median["target"], 4) for name in runs if name != "target"}


def logits_over(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """(L, V) logits at every position of ``ids``, in one forward from an empty cache."""
    n = len(ids)
    cache = KVCache.allocate(model.cfg, 1, model.lm_head.weight.dtype)
    batch = CacheBatch.build([0], [0], [n], n, model.cfg.max_position_embeddings, row_invariant=False)
    return model.forward_cached(torch.tensor([ids]), cache, batch, torch.zeros(n, dtype=torch.long), torch.arange(n))


@torch.inference_mode()
def agreement_by_vocab(target: LlamaForCausalLM, draft: LlamaForCausalLM, windows: list[list[int]],
                       order: list[int], sizes: list[int]) -> dict[str, float]:
    """Teacher-forced on held-out code: the share of positions where the draft's argmax, over
    its N most frequent tokens only, is the target's argmax. A greedy draft is accepted exactly
    when it is the target's argmax after the same prefix, so this is α at T=0 on that text (the
    engine's α is over its own continuations): what a restricted head costs in acceptance."""
    vocab = draft.cfg.vocab_size
    masks = {n: torch.full((vocab,), float("-inf")) for n in [vocab, *sizes]}
    for n, mask in masks.items():
        mask[torch.tensor(order[:n])] = 0.0
    agree = dict.fromkeys(masks, 0)
    positions = 0
    for ids in windows:
        wanted = logits_over(target, ids).argmax(dim=-1)
        scores = logits_over(draft, ids)
        for n, mask in masks.items():
            agree[n] += int(((scores + mask).argmax(dim=-1) == wanted).sum())
        positions += len(ids)
    return {str(n): round(count / positions, 4) for n, count in agree.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=REPO / "models/demo-target")
    parser.add_argument("--draft", type=Path, default=REPO / "models/demo-draft")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the target's dtype")
    parser.add_argument("--sizes", default="2048,1024,512", help="restricted vocabulary sizes N")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--files", type=int, default=400, help="training-side corpus files counted")
    parser.add_argument("--windows", type=int, default=16, help=f"held-out windows of {WINDOW} tokens for agreement")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and files (smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.files, args.windows = 20, 60, 2
    torch.set_num_threads(1)  # as a worker runs
    target = LlamaForCausalLM.from_pretrained(args.target, TORCH_DTYPES[args.dtype])
    draft = LlamaForCausalLM.from_pretrained(args.draft, torch.float32)
    codec = TextCodec.from_model_dir(args.target)
    order, held = token_order(codec, args.files)
    # Tokens never seen on the training side go last, so every N is a proper head.
    seen = set(order)
    order += [t for t in range(draft.cfg.vocab_size) if t not in seen]
    sizes = [int(n) for n in args.sizes.split(",") if n]
    coverage = {}
    for n in sizes:
        top = set(order[:n])
        coverage[str(n)] = round(sum(t in top for t in held) / len(held), 4)
    windows = [held[i:i + WINDOW] for i in range(0, min(len(held) - WINDOW + 1, args.windows * WINDOW), WINDOW)]
    agreement = agreement_by_vocab(target, draft, windows, order, sizes)
    by_depth = {str(depth): c_by_vocab(target, draft, order, sizes, depth, args.reps) for depth in (1, 8)}
    for depth, costs in by_depth.items():
        print(f"depth {depth}: c by draft vocabulary " + ", ".join(f"N={n}: {c:.3f}" for n, c in costs.items()))
    shares = ", ".join(f"N={n}: {v:.3f}" for n, v in coverage.items())
    print(f"held-out code tokens inside the N most frequent: {shares}")
    print(f"draft argmax = target argmax on held-out code ({len(windows)} x {WINDOW} tokens, teacher-forced): "
          + ", ".join(f"N={n}: {v:.3f}" for n, v in agreement.items()))
    if args.json:
        print(json.dumps({"bench": "draft_vocab", "dtype": args.dtype, "c_by_vocab": by_depth,
                          "coverage_by_vocab": coverage, "heldout_tokens": len(held),
                          "greedy_agreement_by_vocab": agreement}))


if __name__ == "__main__":
    main()
