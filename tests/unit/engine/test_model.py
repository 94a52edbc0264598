"""The model outside the engine: checkpoints round-trip in the Hugging Face layout, and the
demo training loop resumes from its checkpoint exactly (so a later session can finish a run)."""

from __future__ import annotations

import ctypes
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from workers.demo.train import SEQ_LEN, Stage, run_stage
from workers.engines.embedded import projections
from workers.engines.embedded.config import ModelConfig
from workers.engines.embedded.kv_cache import CacheBatch, KVCache, lazy_zeros
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.memory import resident_bytes, return_freed_heap
from workers.engines.embedded.projections import FrozenLinear, resolve_dtype

from .conftest import converted, requires_bf16_prepacking


def test_save_and_load_round_trip(tmp_path: Path, target_model: LlamaForCausalLM) -> None:
    target_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, torch.bfloat16)
    reference = converted(target_model, torch.bfloat16)  # what was saved: the weights in bfloat16
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        assert torch.equal(loaded.forward_train(tokens), reference.forward_train(tokens))
    assert loaded.prepacked == reference.prepacked


@requires_bf16_prepacking
def test_frozen_linear_matches_f_linear_bitwise_and_row_by_row() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    rows = torch.randn(9, 64, generator=gen).bfloat16()
    frozen = FrozenLinear(weight)
    assert frozen.packed is not None
    together = frozen(rows)
    assert torch.equal(together, torch.nn.functional.linear(rows, weight))
    for i in range(len(rows)):  # a row's result does not depend on the other rows
        assert torch.equal(frozen(rows[i:i + 1])[0], together[i])


def test_training_resumes_from_its_checkpoint_exactly(tmp_path: Path, tiny_config: ModelConfig) -> None:
    tiny_config = dataclasses.replace(tiny_config, max_position_embeddings=SEQ_LEN)
    stream = torch.randint(0, tiny_config.vocab_size, (8 * SEQ_LEN,), generator=torch.Generator().manual_seed(1))
    heldout = torch.randint(0, tiny_config.vocab_size, (4 * SEQ_LEN,), generator=torch.Generator().manual_seed(2))
    # Both steps of the interrupted first half are warm-up, whose learning rate does not depend
    # on the stage's length, so a 2-step run is exactly the first half of the 4-step one.
    full, half = Stage("s", steps=4, batch=2, lr=1e-3, warmup=2), Stage("s", steps=2, batch=2, lr=1e-3, warmup=2)

    def fresh() -> LlamaForCausalLM:
        model = LlamaForCausalLM(tiny_config)
        model.init_weights(seed=3)
        return model

    straight, resumed = fresh(), fresh()
    for work in ("straight", "resumed"):
        (tmp_path / work).mkdir()
    report = run_stage(full, straight, None, stream, heldout, tmp_path / "straight", seed=5)
    assert report["steps"] == 4 and torch.isfinite(torch.tensor(report["heldout_loss"]))
    run_stage(half, fresh(), None, stream, heldout, tmp_path / "resumed", seed=5)  # then "the session ends"
    assert int(torch.load(tmp_path / "resumed" / "s.pt", weights_only=True)["step"]) == 2
    run_stage(full, resumed, None, stream, heldout, tmp_path / "resumed", seed=5)  # a new process resumes
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_without_prepacking_auto_serves_float32_and_bfloat16_falls_back(monkeypatch: pytest.MonkeyPatch,
                                                                          target_model: LlamaForCausalLM) -> None:
    """A CPU without AVX512-BF16/AMX, simulated: auto picks float32; a forced bfloat16 model
    still runs (plain F.linear), only not prepacked."""
    monkeypatch.setattr(projections, "bf16_prepacking_available", lambda: False)
    assert resolve_dtype("auto") == "float32"
    assert resolve_dtype("bfloat16") == "bfloat16" and resolve_dtype("float32") == "float32"
    unpacked = converted(target_model, torch.bfloat16)
    assert not unpacked.prepacked
    monkeypatch.undo()
    packed = converted(target_model, torch.bfloat16)
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():  # the same weights compute the same function in either layout
        assert torch.allclose(unpacked.forward_train(tokens), packed.forward_train(tokens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_cache_is_zero_and_takes_memory_only_as_it_fills(dtype: torch.dtype) -> None:
    shape = (16, 4, 8192, 64)  # 128 MiB in float32
    before = resident_bytes()
    cache = lazy_zeros(shape, dtype)
    size = cache.numel() * cache.element_size()
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert resident_bytes() - before < size // 8  # nothing written yet: nothing committed
    cache[3, 1, 100:164] = 1.5  # one slot's 64 positions
    assert resident_bytes() - before < size // 8
    # (Reading every element would map pages too: read what was written and its neighbours.)
    assert bool((cache[3, 1, 100:164] == 1.5).all()) and not cache[3, 1, :100].any() and not cache[3, 1, 164:].any()
    assert not cache[0, 0].any() and not cache[15, 3].any()
    assert lazy_zeros((0, 4), dtype).shape == (0, 4)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_released_sources_serve_the_same_logits_and_refuse_training(target_model: LlamaForCausalLM,
                                                                   dtype: torch.dtype) -> None:
    cfg = target_model.cfg
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])

    def logits(model: LlamaForCausalLM) -> torch.Tensor:
        with torch.inference_mode():
            cache = KVCache.allocate(cfg, 1, dtype)
            return model.forward_cached(prompt, cache, CacheBatch.build([0], [0], [8], 8, cfg.max_position_embeddings))

    model = converted(target_model, dtype)
    before = logits(model)
    laid_out = [f for f in model.frozen_projections() if f is not None and f.weight is None]
    sources = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                  if name.endswith("proj.weight") or name == "lm_head.weight")
    freed = model.release_sources()
    print(f"{dtype}: {len(laid_out)} projections laid out, {freed} bytes released")
    if not laid_out:  # this CPU runs F.linear on the weights themselves: nothing to release
        assert freed == 0
        return
    assert freed == sources  # every projection had its laid-out copy (the tiny head is untied)
    emptied = [p for name, p in model.named_parameters() if name.endswith("proj.weight")]
    assert all(p.numel() == 0 and p.dtype == dtype for p in emptied)
    assert torch.equal(logits(model), before)
    refused: list[Callable[[], object]] = [lambda: model.forward_train(prompt), model.prepare_inference,
                                           lambda: model.save_pretrained("/nonexistent")]
    for call in refused:
        with pytest.raises(RuntimeError, match="release_sources"):
            call()


def test_freed_heap_goes_back_to_the_system() -> None:
    """What a first start's measurement leaves behind (heap chunks freed below one still in use)
    is returned by ``return_freed_heap``, not kept mapped for the worker's life."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunk = 64 * 1024  # below glibc's mmap threshold: from the heap
    blocks = [libc.malloc(chunk) for _ in range(3000)]  # ~190 MiB
    for block in blocks:
        ctypes.memset(block, 1, chunk)
    pin = libc.malloc(chunk)  # keeps the heap's top in use, so free() alone trims nothing
    for block in blocks:
        libc.free(block)
    try:
        assert return_freed_heap() > 150
    finally:
        libc.free(pin)
