"""The seeded answer by full forwards (no cache, no drafts): what the engine's seeded sampling must reproduce."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sampling import SamplingParams, probabilities, seeded_noise

MIN_MARGIN = 1e-3  # far above float32 rounding of the logits (test_kv_rewind_after_rejection: 1e-4)


def gumbel_reference(model: LlamaForCausalLM, prompt: Sequence[int], n: int, params: SamplingParams
                     ) -> tuple[list[int], float]:
    """The seeded answer by full forwards (no cache, no drafts), and the smallest top-2 score gap."""
    assert params.seed is not None
    tokens = list(prompt)
    margin = float("inf")
    with torch.inference_mode():
        for t in range(n):
            logits = model.forward_train(torch.tensor([tokens]))[0, -1]
            scores = torch.log(probabilities(logits, params)) + seeded_noise(params.seed, t, logits.shape[-1])
            top = torch.topk(scores, 2).values
            margin = min(margin, float(top[0] - top[1]))
            tokens.append(int(scores.argmax()))
    return tokens[len(prompt):], margin
