"""workers.max_model_len: the engine's context window below the model's own, and the K/V memory
allocated for it, not for ``max_position_embeddings``."""

from __future__ import annotations

import pytest

from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.kv_cache import padded_span
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sampling import SamplingParams


def test_a_cap_shrinks_the_window_and_the_cache(target_model: LlamaForCausalLM,
                                                draft_model: LlamaForCausalLM) -> None:
    full = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=4)
    capped = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=4, max_positions=64)
    assert full.max_positions == target_model.cfg.max_position_embeddings > 64
    assert capped.max_positions == 64
    for cache, model in ((capped.target_cache, target_model), (capped.draft_cache, draft_model)):
        assert cache is not None
        assert cache.k[0].shape == (2, model.cfg.num_key_value_heads, padded_span(64), model.cfg.head_dim)
    assert capped.target_cache.k[0].numel() < full.target_cache.k[0].numel()


def test_a_cap_above_the_models_window_changes_nothing(target_model: LlamaForCausalLM) -> None:
    window = target_model.cfg.max_position_embeddings
    engine = SpeculativeEngine(target_model, None, max_slots=1, max_positions=window * 4)
    assert engine.max_positions == window


def test_a_request_past_the_cap_is_refused_and_one_inside_it_runs(target_model: LlamaForCausalLM,
                                                                   draft_model: LlamaForCausalLM) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=4, max_positions=64)
    greedy = SamplingParams(temperature=0.0)
    # The whole slot is the window (issue 52: 2,040 of 2,048 before): no room is held back for
    # drafts, which shrink as a sequence nears its end.
    with pytest.raises(ValueError, match="window of 64 tokens"):
        engine.add(GenerationRequest("long", list(range(5, 45)), 25, greedy, k=4))
    engine.add(GenerationRequest("fits", list(range(5, 45)), 24, greedy, k=4))
    produced: list[int] = []
    while engine.has_work:
        produced += [t for event in engine.step() for t in event.tokens]
    assert len(produced) == 24
    plain = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=4, max_positions=64)
    plain.add(GenerationRequest("plain", list(range(5, 45)), 24, greedy, k=0))
    alone: list[int] = []
    while plain.has_work:
        alone += [t for event in plain.step() for t in event.tokens]
    assert produced == alone  # greedy speculation to the window's last position is plain's output
