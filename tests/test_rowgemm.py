"""workers/rowgemm.py: the float32 kernels against F.linear and the torch forward, row
invariance (what makes float32 verification bit-identical), and the fallback without them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from workers import rowgemm
from workers.costs_measure import verification_bit_identical
from workers.demo_corpus import heldout_prompts
from workers.engine import GenerationRequest, SpeculativeEngine
from workers.kv_cache import CacheBatch, KVCache
from workers.model import LlamaForCausalLM
from workers.sampling import SamplingParams
from workers.text import TextCodec

REPO = Path(__file__).resolve().parent.parent
KERNEL = rowgemm.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="rowgemm did not build here (no C compiler or no AVX2)")


@pytest.fixture(scope="module")
def demo_models() -> dict[str, LlamaForCausalLM]:
    """The demo checkpoints in float32, on the kernels and on F.linear (the reference)."""
    return {f"{name}-{'packed' if packed else 'linear'}":
            LlamaForCausalLM.from_pretrained(REPO / f"models/demo-{name}", torch.float32, packed)
            for name in ("draft", "target") for packed in (True, False)}


@needs_kernel
@pytest.mark.parametrize(("weight_dtype", "int8"), [(torch.bfloat16, False), (torch.float32, False),
                                                    (torch.bfloat16, True)])
def test_projection_matches_f_linear_and_rows_are_invariant(weight_dtype: torch.dtype, int8: bool) -> None:
    assert KERNEL is not None
    gen = torch.Generator().manual_seed(0)
    # bfloat16-valued weights are packed losslessly in bfloat16; others stay float32; int8 on request.
    weight = torch.randn(200, 72, generator=gen).to(weight_dtype).float()
    packed = KERNEL.pack(weight, int8)
    assert packed.weights.dtype == (torch.int8 if int8 else weight_dtype)
    assert packed.weights.shape[0] == 25 and packed.weights.shape[1] >= 72
    x = torch.randn(1, 11, 72, generator=gen)
    y = KERNEL.linear(x, packed)
    # int8: within the rounding of 8 bits per weight (a column's largest / 254 each).
    tolerance = 0.3 if int8 else 1e-5
    torch.testing.assert_close(y, F.linear(x, weight), rtol=tolerance, atol=tolerance)
    for m in range(1, 11):  # every row as computed in a call of any size: bit for bit
        assert torch.equal(KERNEL.linear(x[:, :m], packed), y[:, :m]), m
        assert torch.equal(KERNEL.linear(x[:, m:m + 1], packed), y[:, m:m + 1]), m


@needs_kernel
def test_native_forward_is_close_to_the_torch_forward(demo_models: dict[str, LlamaForCausalLM]) -> None:
    """Held-out prompts, prefill then decode steps: logits close, argmax equal, on both models."""
    codec = TextCodec.from_model_dir(REPO / "models/demo-target")
    for name in ("draft", "target"):
        native, reference = demo_models[f"{name}-packed"], demo_models[f"{name}-linear"]
        assert native.native is not None and reference.native is None and native.prepacked
        for text in heldout_prompts(3, seed=5):
            ids = codec.encode(text)[:40]
            caches = [KVCache.allocate(m.cfg, 1, torch.float32) for m in (native, reference)]
            with torch.inference_mode():
                for step, (start, n) in enumerate([(0, len(ids) - 3), (len(ids) - 3, 1), (len(ids) - 2, 2)]):
                    tokens = torch.tensor([ids[start:start + n]])
                    out = [m.forward_cached(tokens, c, CacheBatch.build([0], [start], [n], n, 1024, name == "target"))
                           for m, c in zip((native, reference), caches, strict=True)]
                    torch.testing.assert_close(out[0], out[1], rtol=1e-3, atol=2e-3)
                    assert torch.equal(out[0].argmax(-1), out[1].argmax(-1)), (name, step)


@needs_kernel
def test_fused_forward_is_the_per_op_path_bit_for_bit(demo_models: dict[str, LlamaForCausalLM]) -> None:
    """One kernel call per forward (FusedForward) runs the same kernels in the same order."""
    model = demo_models["target-packed"]
    fused = model.fused
    assert fused is not None
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(5, model.cfg.vocab_size, (2, 5), generator=gen)
    batch = CacheBatch.build([0, 1], [30, 12], [5, 3], 5, 1024)
    outs = []
    for use_fused in (True, False):
        cache = KVCache.allocate(model.cfg, 2, torch.float32)
        model.fused = fused if use_fused else None
        try:
            with torch.inference_mode():
                model.forward_cached(torch.randint(5, 100, (2, 30), generator=torch.Generator().manual_seed(1)), cache,
                                     CacheBatch.build([0, 1], [0, 0], [30, 12], 30, 1024))
                outs.append((model.forward_cached(tokens, cache, batch, torch.tensor([0, 0, 1]),
                                                  torch.tensor([3, 4, 2])), cache.k[3].clone()))
        finally:
            model.fused = fused
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@needs_kernel
def test_native_float32_verification_is_bit_identical(demo_models: dict[str, LlamaForCausalLM]) -> None:
    """What the start-up check finds: F.linear's float32 is not row-invariant here, the kernels are."""
    assert verification_bit_identical(demo_models["target-packed"], 9)
    assert verification_bit_identical(demo_models["target-packed"], 4)


@needs_kernel
@pytest.mark.parametrize("k", [1, 3, 6])
def test_native_greedy_speculative_output_is_plain_output(k: int, demo_models: dict[str, LlamaForCausalLM]) -> None:
    target, draft = demo_models["target-packed"], demo_models["draft-packed"]
    codec = TextCodec.from_model_dir(REPO / "models/demo-target")
    prompts = [codec.encode(t) for t in heldout_prompts(3, seed=2)]
    greedy = SamplingParams(temperature=0.0)
    outputs = {}
    for depth in (0, k):
        engine = SpeculativeEngine(target, draft, max_slots=3, max_k=6)
        for i, ids in enumerate(prompts):  # a batch of three, then each alone
            engine.add(GenerationRequest(f"b{i}", ids, 24, greedy, k=depth))
        got: dict[str, list[int]] = {}
        while engine.has_work:
            for event in engine.step():
                got.setdefault(event.request_id, []).extend(event.tokens)
        for i, ids in enumerate(prompts):
            got[f"a{i}"] = [t for e in engine.generate(GenerationRequest(f"a{i}", ids, 24, greedy, k=depth))
                            for t in e.tokens]
        outputs[depth] = got
    assert outputs[k] == outputs[0]
    assert all(outputs[0][f"a{i}"] == outputs[0][f"b{i}"] for i in range(len(prompts)))


def test_disabled_kernel_falls_back_to_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECGATE_ROWGEMM", "0")
    rowgemm.load.cache_clear()
    try:
        assert rowgemm.load() is None
        model = LlamaForCausalLM.from_pretrained(REPO / "models/demo-draft", torch.float32)
        assert model.native is None and not model.prepacked
        cache = KVCache.allocate(model.cfg, 1, torch.float32)
        with torch.inference_mode():
            logits = model.forward_cached(torch.tensor([[5, 6, 7]]), cache, CacheBatch.build([0], [0], [3], 3, 1024))
        assert logits.shape == (1, 3, model.cfg.vocab_size) and torch.isfinite(logits).all()
    finally:
        rowgemm.load.cache_clear()


@pytest.mark.parametrize("compiler", ["/bin/false", "/nonexistent/cc"])
def test_failed_or_missing_compiler_falls_back(compiler: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("SPECGATE_ROWGEMM_DIR", str(tmp_path))
    rowgemm.load.cache_clear()
    try:
        assert rowgemm.load() is None
        assert not LlamaForCausalLM.from_pretrained(REPO / "models/demo-draft", torch.float32).prepacked
    finally:
        rowgemm.load.cache_clear()


@needs_kernel
def test_engine_test_models_run_the_kernels(target_model: LlamaForCausalLM) -> None:
    """So the engine's parity tests (tests/test_engine.py) cover the native path where it builds."""
    assert target_model.native is not None


@needs_kernel
def test_int8_draft_agrees_with_the_target_as_often(demo_models: dict[str, LlamaForCausalLM]) -> None:
    """The draft the engine serves (int8 projections, ``load_draft``) predicts the target's next
    token on held-out text as often as the checkpoint's own bfloat16 weights do (what α rests on)."""
    int8_draft = LlamaForCausalLM.load_draft(REPO / "models/demo-draft")
    models = {"target": demo_models["target-packed"], "draft": demo_models["draft-packed"], "int8": int8_draft}
    codec = TextCodec.from_model_dir(REPO / "models/demo-target")
    agree = {"draft": 0, "int8": 0}
    total = 0
    with torch.inference_mode():
        for text in heldout_prompts(16, seed=3):
            ids = torch.tensor([codec.encode(text)[:120]])
            n = ids.shape[1]
            argmax = {}
            for name, model in models.items():
                cache = KVCache.allocate(model.cfg, 1, torch.float32)
                batch = CacheBatch.build([0], [0], [n], n, 1024, row_invariant=False)
                argmax[name] = model.forward_cached(ids, cache, batch).argmax(-1)
            agree["draft"] += int((argmax["draft"] == argmax["target"]).sum())
            agree["int8"] += int((argmax["int8"] == argmax["target"]).sum())
            total += n
    assert agree["int8"] >= agree["draft"] - 0.01 * total, (agree, total)


def test_native_forward_refuses_out_of_range_rows_instead_of_writing_past_the_cache() -> None:
    tokens = torch.tensor([[5, 6]])
    with pytest.raises(ValueError, match="vocabulary"):
        rowgemm.check_bounds(torch.tensor([[5, 4096]]), 4096, ((0,), (0,), (2,)), 2, 64)
    with pytest.raises(ValueError, match="cache rows"):
        rowgemm.check_bounds(tokens, 4096, ((0,), (63,), (2,)), 2, 64)  # one position past the end
    with pytest.raises(ValueError, match="cache rows"):
        rowgemm.check_bounds(tokens, 4096, ((2,), (0,), (2,)), 2, 64)  # no slot 2
    rowgemm.check_bounds(tokens, 4096, ((1,), (62,), (2,)), 2, 64)  # the last two positions: fine
