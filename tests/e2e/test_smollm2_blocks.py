"""SmolLM2-135M-Instruct served from its GGUF's own blocks (issue #55): the ``gguf-panels/`` that
``make install`` lays out load, and greedy completions of 64 tokens on the 20 held-out prompts are
the float32 conversion's (at least 18 of 20 identical; each difference named with its first
diverging position and the logit gap there); the speculative engine on the blocks reproduces
their plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.real_prompts import held_out
from tests.unit.engine.engine_runs import output_tokens, run_until_idle
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.kv_cache import KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.quantized import blocks_unavailable, load_target
from workers.engines.embedded.sampling import SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(rowgemm.load() is None, reason="the block kernels need AVX2 and a C compiler")]

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "smollm2-135m-instruct-q4_1"
DRAFT = REPO / "models" / "smollm2-draft"
IGNORE_EOS = SamplingParams(temperature=0.0, ignore_eos=True)  # 64 tokens each: every position compared
TOKENS = 64


def greedy_batch(model: LlamaForCausalLM, prompts: list[list[int]], k: int = 0,
                 draft: LlamaForCausalLM | None = None) -> list[list[int]]:
    engine = SpeculativeEngine(model, draft, max_slots=len(prompts), max_k=max(k, 1) if draft else 0,
                               max_positions=max(map(len, prompts)) + TOKENS + 9)
    for i, prompt in enumerate(prompts):
        engine.add(GenerationRequest(f"r{i}", prompt, TOKENS, IGNORE_EOS, k=k))
    events = run_until_idle(engine)
    return [output_tokens(events[f"r{i}"]) for i in range(len(prompts))]


def first_difference(model: LlamaForCausalLM, prompt: list[int], a: list[int], b: list[int]) -> str:
    """Where two completions part, and the gap between the two tokens' logits there (the model's)."""
    at = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    cache = KVCache.allocate(model.cfg, 1, torch.float32, len(prompt) + at + 1)
    assert model.fused is not None
    logits = model.fused.run_rows([prompt + a[:at]], cache.k, cache.v, [0], [0], [len(prompt) + at - 1])[0]
    return f"token {at}: {a[at]} against {b[at]}, logit gap {float(logits[a[at]] - logits[b[at]]):.3g}"


@pytest.fixture(scope="module")
def models() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    assert blocks_unavailable(TARGET) is None, blocks_unavailable(TARGET)
    float32 = LlamaForCausalLM.from_pretrained(TARGET, torch.float32)
    float32.release_sources()
    return load_target(TARGET, "q4_1"), float32


def test_greedy_completions_are_the_float32_conversions(models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    blocks, float32 = models
    prompts = held_out(5)
    assert len(prompts) == 20
    got, expected = greedy_batch(blocks, prompts), greedy_batch(float32, prompts)
    differences = [f"prompt {i}: {first_difference(blocks, p, a, b)}"
                   for i, (p, a, b) in enumerate(zip(prompts, got, expected, strict=True)) if a != b]
    assert len(differences) <= 2, differences
    # The kernels widen each block to the conversion's weight and sum in its order: in practice none.
    assert not differences, differences


def test_speculation_on_the_blocks_is_their_plain_decoding(models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    blocks = models[0]
    draft = LlamaForCausalLM.load_draft(DRAFT, torch.float32, target=TARGET)
    prompts = held_out(1)
    plain = greedy_batch(blocks, prompts)
    for k in (1, 3, 8):
        assert greedy_batch(blocks, prompts, k, draft) == plain, k
