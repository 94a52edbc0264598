"""workers/engines/embedded/kernels/rowgemm.py's one-call forward computes only each row's real tokens (packed), so a
step that mixes 1-token and (K+1)-token rows costs their tokens, not the widest row's times the
rows. What must hold: every row's logits and cache are the bits of that row computed alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.costs.cost_report import report_from_forward_times
from workers.costs.online import OnlineCosts
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.kv_cache import KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.runner import fold_step
from workers.engines.embedded.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[3]
needs_kernel = pytest.mark.skipif(rowgemm.load() is None,
                                  reason="rowgemm did not build here (no C compiler or no AVX2)")


@needs_kernel
@pytest.mark.parametrize("products", ["float32", "bfloat16"])
def test_a_mixed_step_is_each_row_alone_bit_for_bit(products: str) -> None:
    kernel = rowgemm.load()
    assert kernel is not None
    if products == "bfloat16" and not kernel.dot_products:
        pytest.skip("no bfloat16 products here (no AVX512-BF16)")
    model = LlamaForCausalLM.from_pretrained(REPO / "models/demo-target", torch.float32, True,
                                             "bfloat16" if products == "bfloat16" else "float32")
    fused = model.fused
    assert fused is not None
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (12, 30, 7, 21)]
    new = [[11, 12, 13, 14], [15], [16, 17], [18]]  # a verification, plain steps, a short one
    together = KVCache.allocate(model.cfg, 4, torch.float32)
    alone = KVCache.allocate(model.cfg, 4, torch.float32)
    slots = [2, 0, 3, 1]
    for slot, prompt in zip(slots, prompts, strict=True):
        for cache in (together, alone):
            fused.run_rows([prompt], cache.k, cache.v, [slot], [0], [len(prompt) - 1])
    width = max(map(len, new))
    idx = [b * width + col for b, row in enumerate(new) for col in range(len(row))]
    mixed = fused.run_rows(new, together.k, together.v, slots, [len(p) for p in prompts], idx)
    singles = torch.cat([fused.run_rows([row], alone.k, alone.v, [slot], [len(p)], list(range(len(row))))
                         for row, slot, p in zip(new, slots, prompts, strict=True)])
    assert torch.equal(mixed, singles)
    assert all(torch.equal(a, b) for a, b in zip([*together.k, *together.v], [*alone.k, *alone.v], strict=True))
    # A padding position (row 1 has one token of 4) has no token: its logits are 0.
    padded = fused.run_rows(new, together.k, together.v, slots, [len(p) for p in prompts], [1 * width + 2])
    assert torch.equal(padded, torch.zeros_like(padded))


@needs_kernel
def test_a_ragged_step_refines_none_of_the_targets_costs() -> None:
    """The model prices a mixed step by interpolating between its (depth, tokens per row) points;
    a step whose rows differ in length (packed, cheaper than its width) must not teach the
    widest point its time, while a uniform step does."""
    target = LlamaForCausalLM.from_pretrained(REPO / "models/demo-target", torch.float32, True)
    draft = LlamaForCausalLM.load_draft(REPO / "models/demo-draft")
    report = report_from_forward_times((1, 2), [[0.010, 0.011, 0.012, 0.013], [0.020, 0.030, 0.040, 0.050]],
                                       [0.002, 0.004], source="measured")
    costs = OnlineCosts(report)
    engine = SpeculativeEngine(target, draft, max_slots=2, max_k=3)
    greedy = SamplingParams(temperature=0.0)
    engine.add(GenerationRequest("spec", [5, 6, 7, 8], 40, greedy, k=3))
    engine.add(GenerationRequest("plain", [9, 10, 11], 40, greedy, k=0))
    engine.step()  # the prompts
    before = [list(row) for row in costs.target_s]
    steps = 0
    while steps < 5 and engine.has_work:
        events = engine.step()
        shape = engine.last_shape
        assert shape.target_rows == 2 and shape.target_tokens < 2 * shape.target_width  # 1 + K and 1
        fold_step(costs, engine, events, engine.last_step_s)
        steps += 1
    assert steps == 5 and costs.target_s == before
    engine.set_k("plain", 3)  # both verify K + 1 tokens now: a uniform step refines (depth 2, n)
    while engine.last_shape.target_tokens != 2 * engine.last_shape.target_width:
        events = engine.step()
    fold_step(costs, engine, events, engine.last_step_s)
    assert costs.target_s != before
