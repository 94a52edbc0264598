"""Token trees in the speculative engine: greedy output identical to plain decoding for every
shape, alone and in batches mixing trees, chains and plain sequences; the caches a tree step
leaves bit-identical to a plain run's; seeded output identical across modes; the step's path."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from policies.tree import TreeShape
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine, StepEvent
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sampling import SamplingParams

from .engine_runs import GREEDY, PROMPTS, generate, output_tokens, run_until_idle

GreedyReference = Callable[[Sequence[int], int], list[int]]
MAX_K = 6
SHAPES = ["2", "3", "4", "2+2", "2x2", "3x2+1", "2x2+2", "4+3", "2x2x2"]


def tree_request(rid: str, prompt: list[int], max_tokens: int, shape: str | None, params: SamplingParams = GREEDY,
                 k: int | None = None) -> GenerationRequest:
    tree = None if shape is None else TreeShape.parse(shape)
    depth = k if k is not None else (0 if tree is None else tree.depth)
    return GenerationRequest(rid, prompt, max_tokens, params, k=depth, tree=tree)


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_parity_batch1(shape: str, target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                              greedy_reference: GreedyReference) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=MAX_K)
    tree = TreeShape.parse(shape)
    tree_steps = 0
    for i, prompt in enumerate(PROMPTS):
        max_tokens = 16 + i % 9
        events = generate(engine, tree_request(f"p{i}", prompt, max_tokens, shape))
        assert output_tokens(events) == greedy_reference(prompt, max_tokens), f"prompt {i} (len {len(prompt)})"
        for e in events:
            if e.path is not None:
                tree_steps += 1
                assert e.path.shape == tree and e.proposed == tree.depth and e.accepted == e.path.accepted
    assert tree_steps > 0
    assert engine.batch_depth == 0 and engine.queue_length == 0


def test_trees_accept_children_a_chain_would_have_missed(target_model: LlamaForCausalLM,
                                                         far_draft_model: LlamaForCausalLM,
                                                         greedy_reference: GreedyReference) -> None:
    """With a draft that is often wrong, some steps accept a rank-2+ child: the tree's point."""
    engine = SpeculativeEngine(target_model, far_draft_model, max_slots=1, max_k=MAX_K)
    ranks: list[int] = []
    for i, prompt in enumerate(PROMPTS[:10]):
        events = generate(engine, tree_request(f"p{i}", prompt, 20, "3x2+1"))
        assert output_tokens(events) == greedy_reference(prompt, 20)
        ranks += [r for e in events if e.path is not None for r in e.path.ranks]
    assert any(r >= 2 for r in ranks), ranks
    assert 0 in ranks  # and some levels rejected every child


def test_greedy_parity_mixed_batch_of_trees_chains_and_plain(target_model: LlamaForCausalLM,
                                                             draft_model: LlamaForCausalLM,
                                                             greedy_reference: GreedyReference) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=4, max_k=MAX_K)
    plans = [("t1", 0, 20, "2x2+2", None), ("c1", 1, 18, None, 4), ("p1", 2, 15, None, 0),
             ("t2", 3, 22, "3+2", None), ("t3", 4, 12, "4", None), ("c2", 5, 25, None, 6),
             ("t4", 6, 17, "2x2x2", None)]
    for rid, prompt, max_tokens, shape, k in plans:
        engine.add(tree_request(rid, PROMPTS[prompt], max_tokens, shape, k=k))
    steps: list[list[StepEvent]] = []
    by_id: dict[str, list[StepEvent]] = {}
    while engine.has_work:
        events = engine.step()
        steps.append(events)
        for e in events:
            by_id.setdefault(e.request_id, []).append(e)
    for rid, prompt, max_tokens, _, _ in plans:
        assert output_tokens(by_id[rid]) == greedy_reference(PROMPTS[prompt], max_tokens), rid
    # Trees and chains really ran in the same steps, with a plain sequence beside them.
    assert any(any(e.path is not None for e in s) and any(e.path is None and e.proposed > 0 for e in s)
               and any(e.proposed == 0 for e in s) for s in steps)


@pytest.mark.usefixtures("bf16_exact")
@pytest.mark.parametrize("shape", ["2x2+2", "3+1"])
def test_greedy_parity_bfloat16(shape: str, bf16_models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    plain = SpeculativeEngine(bf16_models[0], None, max_slots=1)
    engine = SpeculativeEngine(*bf16_models, max_slots=2, max_k=MAX_K)
    for i, prompt in enumerate(PROMPTS[:8]):
        reference = output_tokens(generate(plain, tree_request(f"r{i}", prompt, 18, None)))
        events = generate(engine, tree_request(f"p{i}", prompt, 18, shape))
        assert output_tokens(events) == reference, f"prompt {i}"
        assert any(e.path is not None for e in events)


@pytest.mark.parametrize("shape", ["2x2+2", "3x2+1"])
def test_the_caches_a_tree_leaves_are_a_plain_runs_bit_for_bit(shape: str, target_model: LlamaForCausalLM,
                                                                 draft_model: LlamaForCausalLM) -> None:
    """After every tree step, the target's cache below the sequence's length equals a plain
    run's, and the draft's equals a chain run's (the nodes' K/V moved into place, not recomputed)."""
    prompt, max_tokens = PROMPTS[3], 30
    plain = SpeculativeEngine(target_model, None, max_slots=1, max_k=MAX_K)
    generate(plain, tree_request("plain", prompt, max_tokens, None))
    chain = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    generate(chain, tree_request("chain", prompt, max_tokens, None, k=TreeShape.parse(shape).depth))
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    engine.add(tree_request("tree", prompt, max_tokens, shape))
    checked = 0
    while engine.has_work:
        seq = engine._running.get("tree")
        events = engine.step()
        if seq is None or not any(e.path is not None and e.finish_reason is None for e in events):
            continue
        for mine, theirs, length in ((engine.target_cache, plain.target_cache, seq.target_len),
                                     # the chain's last steps may draft less: what it surely wrote
                                     (engine.draft_cache, chain.draft_cache,
                                      min(seq.draft_len, len(prompt) + max_tokens - MAX_K - 2))):
            assert mine is not None and theirs is not None
            for layer in range(len(mine.k)):
                assert torch.equal(mine.k[layer][0, :, :length], theirs.k[layer][0, :, :length]), (layer, length)
                assert torch.equal(mine.v[layer][0, :, :length], theirs.v[layer][0, :, :length]), (layer, length)
        checked += 1
    assert checked >= 3


def test_seeded_output_is_the_same_in_every_mode(target_model: LlamaForCausalLM,
                                                 draft_model: LlamaForCausalLM) -> None:
    params = SamplingParams(temperature=0.9, seed=1234)
    engine = SpeculativeEngine(target_model, draft_model, max_slots=3, max_k=MAX_K)
    for i, prompt in enumerate(PROMPTS[:6]):
        outputs = []
        for mode, shape, k in (("plain", None, 0), ("chain", None, 4), ("tree", "2x2+2", None)):
            outputs.append(output_tokens(generate(engine, tree_request(f"{mode}{i}", prompt, 20, shape, params, k))))
        assert outputs[0] == outputs[1] == outputs[2], i


def test_a_tree_falls_back_to_a_chain_where_the_step_k_is_shallower(target_model: LlamaForCausalLM,
                                                                     draft_model: LlamaForCausalLM,
                                                                     greedy_reference: GreedyReference) -> None:
    """The per-step rules may lower K below the tree's depth: that step runs the chain of its K."""
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K,
                               step_depth_rule=lambda k, depth: min(k, 2))
    events = generate(engine, tree_request("t", PROMPTS[0], 20, "2x2+2"))
    assert output_tokens(events) == greedy_reference(PROMPTS[0], 20)
    assert all(e.path is None for e in events) and max(e.proposed for e in events) == 2


def test_a_tree_over_the_engines_bounds_is_refused(target_model: LlamaForCausalLM,
                                                   draft_model: LlamaForCausalLM) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=3, max_tree_nodes=8)
    with pytest.raises(ValueError, match="token tree 2x2\\+2"):
        engine.add(tree_request("deep", PROMPTS[0], 10, "2x2+2"))  # depth 4 > 3
    with pytest.raises(ValueError, match="token tree 3x3"):
        engine.add(tree_request("wide", PROMPTS[0], 10, "3x3"))  # 12 nodes > 8
    assert run_until_idle(engine) == {}
