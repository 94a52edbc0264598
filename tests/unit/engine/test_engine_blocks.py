"""The engine on a target served from the GGUF's blocks (workers.dtype: q4_1, quantized.py): the
same function as its float32 conversion, bit for bit; speculation greedy-identical to plain for
K = 1..8, with trees, in a mixed batch and from prefix-cache hits; verification bit-identical to
one-token-at-a-time decoding (the start-up check); a directory without panels, or with a corrupt
block, refused naming why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from policies.tree import TreeShape
from tests.unit.engine.block_models import write_block_model
from tests.unit.engine.engine_runs import GREEDY, PROMPTS, generate, output_tokens, run_until_idle
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.kernels.blocks import PANELS_DIR, PANELS_FILE
from workers.engines.embedded.kv_cache import KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.measurement.measure import verification_bit_identical
from workers.engines.embedded.measurement.precision import target_configs
from workers.engines.embedded.quantized import blocks_unavailable, load_blocks, load_target

pytestmark = pytest.mark.skipif(rowgemm.load() is None, reason="the block kernels need AVX2 and a C compiler")
MAX_K = 8


@pytest.fixture(scope="module")
def block_dir(tmp_path_factory: pytest.TempPathFactory, target_model: LlamaForCausalLM) -> Path:
    return write_block_model(target_model, tmp_path_factory.mktemp("blocks"))


@pytest.fixture(scope="module")
def quantized(block_dir: Path) -> LlamaForCausalLM:
    return load_target(block_dir, "q4_1")


@pytest.fixture(scope="module")
def plain_reference(quantized: LlamaForCausalLM) -> dict[tuple[int, int], list[int]]:
    """The quantized target's own plain greedy decoding of every test prompt."""
    engine = SpeculativeEngine(quantized, None, max_slots=1)
    return {(i, 16 + i % 9): output_tokens(generate(engine, GenerationRequest("ref", p, 16 + i % 9, GREEDY, k=0)))
            for i, p in enumerate(PROMPTS)}


def test_the_blocks_compute_the_float32_conversion_bit_for_bit(block_dir: Path, quantized: LlamaForCausalLM) -> None:
    converted = LlamaForCausalLM.from_pretrained(block_dir, torch.float32)
    assert converted.native is not None and quantized.native is not None and quantized.prepacked
    assert quantized.embed_panels is not None and quantized.released
    prompt = PROMPTS[3] * 3
    caches = [KVCache.allocate(m.cfg, 2, torch.float32) for m in (quantized, converted)]
    for start, n in [(0, len(prompt)), (len(prompt), 1), (len(prompt) + 1, 5)]:
        tokens = ([*prompt, 7, 8, 9, 10, 11, 12])[start:start + n]
        out = [m.fused.run_rows([tokens], c.k, c.v, [1], [start], list(range(n)))  # type: ignore[union-attr]
               for m, c in zip((quantized, converted), caches, strict=True)]
        assert torch.equal(out[0], out[1]), (start, n)
    assert torch.equal(quantized.embed_rows(torch.tensor([[1, 2]])), converted.embed_rows(torch.tensor([[1, 2]])))
    with pytest.raises(RuntimeError, match=r"release_sources emptied"):
        quantized.forward_train(torch.tensor([[1, 2]]))


@pytest.mark.parametrize("n", [2, 5, 9])
def test_verification_is_bit_identical_to_decoding_one_at_a_time(quantized: LlamaForCausalLM, n: int) -> None:
    assert verification_bit_identical(quantized, n)


@pytest.mark.parametrize("k", range(1, MAX_K + 1))
def test_greedy_parity_batch1(k: int, quantized: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                              plain_reference: dict[tuple[int, int], list[int]]) -> None:
    engine = SpeculativeEngine(quantized, draft_model, max_slots=2, max_k=MAX_K)
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        events = generate(engine, GenerationRequest(f"p{i}", prompt, 16 + i % 9, GREEDY, k=k))
        assert output_tokens(events) == plain_reference[(i, 16 + i % 9)], f"prompt {i}"
        accepted += sum(e.accepted for e in events)
    assert accepted > 0


@pytest.mark.parametrize("shape", ["2x2", "3x2+1", "2x2x2"])
def test_greedy_parity_with_trees(shape: str, quantized: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                                  plain_reference: dict[tuple[int, int], list[int]]) -> None:
    engine = SpeculativeEngine(quantized, draft_model, max_slots=2, max_k=MAX_K)
    tree = TreeShape.parse(shape)
    for i, prompt in enumerate(PROMPTS[:8]):
        request = GenerationRequest(f"p{i}", prompt, 16 + i % 9, GREEDY, k=tree.depth, tree=tree)
        assert output_tokens(generate(engine, request)) == plain_reference[(i, 16 + i % 9)], f"prompt {i}"


def test_greedy_parity_mixed_batch(quantized: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                                   plain_reference: dict[tuple[int, int], list[int]]) -> None:
    """Eight requests at once, plain, chains of K = 1..8 and a tree, joining as slots free."""
    engine = SpeculativeEngine(quantized, draft_model, max_slots=4, max_k=MAX_K)
    plans = {f"r{i}": (i, i % (MAX_K + 1)) for i in range(9)}
    for rid, (i, k) in plans.items():
        tree = TreeShape.parse("2x2") if i == 8 else None
        engine.add(GenerationRequest(rid, PROMPTS[i], 16 + i % 9, GREEDY, k=k if tree is None else 2, tree=tree))
    events = run_until_idle(engine)
    for rid, (i, _) in plans.items():
        assert output_tokens(events[rid]) == plain_reference[(i, 16 + i % 9)], rid
    assert max(e.batch_depth for evs in events.values() for e in evs) == 4


def test_prefix_cache_hits_change_no_token(quantized: LlamaForCausalLM, draft_model: LlamaForCausalLM) -> None:
    system = PROMPTS[5] + PROMPTS[6] + PROMPTS[7]
    prompts = [[*system, 3, 4, 5], [*system, 9], system + PROMPTS[2]]

    def run(cache_bytes: int) -> tuple[list[list[int]], list[int | None]]:
        engine = SpeculativeEngine(quantized, draft_model, max_slots=2, max_k=4, prefill_chunk=16,
                                   prefix_cache_bytes=cache_bytes)
        outs, cached = [], []
        for i, prompt in enumerate(prompts):
            events = generate(engine, GenerationRequest(f"p{i}", prompt, 20, GREEDY, k=3))
            outs.append(output_tokens(events))
            cached.append(events[0].cached_tokens)
        return outs, cached

    cold, _ = run(0)
    warm, cached = run(1 << 20)
    assert warm == cold
    assert all(c for c in cached[1:]), cached  # the later prompts did start from cached chunks


def test_q4_1_is_a_candidate_where_the_panels_are(block_dir: Path, tmp_path: Path) -> None:
    assert blocks_unavailable(block_dir) is None
    assert "q4_1" in target_configs("auto", "float32", blocks_unavailable(block_dir))
    assert target_configs("q4_1", "float32", None) == {"q4_1": ("q4_1", True, "float32")}
    (tmp_path / "config.json").write_text((block_dir / "config.json").read_text())
    (tmp_path / "conversion_stamp.json").write_text(json.dumps(
        {"panels": "refused: x.gguf: blk.0.attn_q.weight is Q5_0; the engine's block kernels read Q4_1 and Q8_0"}))
    reason = blocks_unavailable(tmp_path)
    assert reason is not None and "blk.0.attn_q.weight is Q5_0" in reason
    assert "q4_1" not in target_configs("auto", "float32", reason)
    with pytest.raises(ValueError, match=r"workers.dtype: q4_1: .*blk.0.attn_q.weight is Q5_0"):
        target_configs("q4_1", "float32", reason)
    with pytest.raises(ValueError, match=r"gguf-panels/model.safetensors is missing"):
        load_blocks(tmp_path)


def test_a_corrupt_panel_file_is_refused_at_load(block_dir: Path, tmp_path: Path) -> None:
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((block_dir / name).read_bytes())
    (tmp_path / PANELS_DIR).mkdir()
    source = block_dir / PANELS_DIR / PANELS_FILE
    tensors = load_file(str(source))
    with safe_open(str(source), "np") as f:
        metadata = f.metadata()
    bad = tensors["model.layers.1.mlp.down_proj.q4_1"].copy()
    bad[0, 0:2] = [0x00, 0x7E]  # fp16 NaN as column 0's scale of block 0
    save_file({**tensors, "model.layers.1.mlp.down_proj.q4_1": bad}, str(tmp_path / PANELS_DIR / PANELS_FILE),
              metadata=metadata)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.q4_1: block 0 of panel 0 has a non-finite "
                                          r"scale"):
        load_blocks(tmp_path)
