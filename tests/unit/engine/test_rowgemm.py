"""workers/engines/embedded/kernels/rowgemm.py: the float32 kernels against F.linear and the torch forward, row
invariance (what makes float32 verification bit-identical), and the fallback without them."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from workers.demo.corpus import heldout_prompts
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.kernels import fused_forward, rowgemm
from workers.engines.embedded.kv_cache import CacheBatch, KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.measurement.measure import verification_bit_identical
from workers.engines.embedded.sampling import SamplingParams
from workers.text import TextCodec

REPO = Path(__file__).resolve().parents[3]
KERNEL = rowgemm.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="rowgemm did not build here (no C compiler or no AVX2)")


@pytest.fixture(scope="module")
def demo_models() -> dict[str, LlamaForCausalLM]:
    """The demo checkpoints in float32, on the kernels and on F.linear (the reference)."""
    return {f"{name}-{'packed' if packed else 'linear'}":
            LlamaForCausalLM.from_pretrained(REPO / f"models/demo-{name}", torch.float32, packed)
            for name in ("draft", "target") for packed in (True, False)}


@needs_kernel
@pytest.mark.parametrize(("weight_dtype", "k"), [(torch.bfloat16, 72), (torch.float32, 72), (torch.bfloat16, 73)])
def test_projection_matches_f_linear_and_rows_are_invariant(weight_dtype: torch.dtype, k: int) -> None:
    assert KERNEL is not None
    gen = torch.Generator().manual_seed(0)
    # bfloat16-valued weights are packed losslessly in bfloat16 (in pairs of k; an odd K too);
    # others stay float32.
    weight = torch.randn(200, k, generator=gen).to(weight_dtype).float()
    packed = KERNEL.pack(weight)
    assert packed.weights.dtype == weight_dtype
    assert packed.weights.shape[0] == 25 and packed.weights.shape[1] >= k
    x = torch.randn(1, 11, k, generator=gen)
    y = KERNEL.linear(x, packed)
    torch.testing.assert_close(y, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    for m in range(1, 11):  # every row as computed in a call of any size: bit for bit
        assert torch.equal(KERNEL.linear(x[:, :m], packed), y[:, :m]), m
        assert torch.equal(KERNEL.linear(x[:, m:m + 1], packed), y[:, m:m + 1]), m
    with pytest.raises(ValueError, match=f"takes {k} inputs"):  # never read past a row
        KERNEL.linear(x[..., :k - 1], packed)


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


@functools.cache
def product_models() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """The demo target and draft multiplying in bfloat16 (AVX512-BF16), as a worker serving
    bfloat16 products runs them."""
    return (LlamaForCausalLM.from_pretrained(REPO / "models/demo-target", torch.float32, True, "bfloat16"),
            LlamaForCausalLM.load_draft(REPO / "models/demo-draft", products="bfloat16"))


@needs_kernel
@pytest.mark.parametrize("products", ["float32", "bfloat16"])
def test_fused_forward_is_the_per_op_path_bit_for_bit(products: str, demo_models: dict[str, LlamaForCausalLM]) -> None:
    """One kernel call per forward (FusedForward) runs the same kernels in the same order, with
    either products."""
    assert KERNEL is not None
    if products == "bfloat16" and not KERNEL.dot_products:
        pytest.skip("no bfloat16 products here (no AVX512-BF16)")
    model = demo_models["target-packed"] if products == "float32" else product_models()[0]
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
@pytest.mark.parametrize("products", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_native_greedy_speculative_output_is_plain_output(k: int, products: str,
                                                          demo_models: dict[str, LlamaForCausalLM]) -> None:
    assert KERNEL is not None
    if products == "bfloat16" and not KERNEL.dot_products:
        pytest.skip("no bfloat16 products here (no AVX512-BF16)")
    target, draft = ((demo_models["target-packed"], demo_models["draft-packed"]) if products == "float32"
                     else product_models())
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


@needs_kernel
def test_engine_test_models_run_the_kernels(target_model: LlamaForCausalLM) -> None:
    """So the engine's parity tests (tests/unit/engine/test_engine.py) cover the native path where it builds."""
    assert target_model.native is not None


def test_native_forward_refuses_out_of_range_rows_instead_of_writing_past_the_cache() -> None:
    tokens = torch.tensor([[5, 6]])
    with pytest.raises(ValueError, match="vocabulary"):
        fused_forward.check_bounds(torch.tensor([[5, 4096]]), 4096, ((0,), (0,), (2,)), 2, 64)
    with pytest.raises(ValueError, match="cache rows"):
        fused_forward.check_bounds(tokens, 4096, ((0,), (63,), (2,)), 2, 64)  # one position past the end
    with pytest.raises(ValueError, match="cache rows"):
        fused_forward.check_bounds(tokens, 4096, ((2,), (0,), (2,)), 2, 64)  # no slot 2
    fused_forward.check_bounds(tokens, 4096, ((1,), (62,), (2,)), 2, 64)  # the last two positions: fine


@needs_kernel
def test_rows_from_lists_are_the_tensor_call_bit_for_bit(demo_models: dict[str, LlamaForCausalLM]) -> None:
    """The engine's path (``FusedForward.run_rows``, Python lists) computes what the tensor call
    computes: same logits, same cache."""
    model = demo_models["target-packed"]
    fused = model.fused
    assert fused is not None
    rows = [[11, 12, 13], [21, 22], [31]]
    slots, starts = [2, 0, 1], [40, 7, 19]
    wanted = [(0, 1), (0, 2), (1, 0), (1, 1), (2, 0)]  # (row, column) of the padded 3 x 3
    outs = []
    for from_lists in (True, False):
        cache = KVCache.allocate(model.cfg, 3, torch.float32)
        if from_lists:
            logits = fused.run_rows(rows, cache.k, cache.v, slots, starts, [b * 3 + c for b, c in wanted])
        else:
            tokens = torch.tensor([row + [0] * (3 - len(row)) for row in rows])
            meta = torch.tensor([slots, starts, [len(row) for row in rows]])
            logits = fused(tokens, cache.k, cache.v, meta, torch.tensor([b * 3 + c for b, c in wanted]))
        outs.append((logits, cache.k[5].clone(), cache.v[0].clone()))
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1], strict=True))


def draft_kernel_and_cache(
        demo_models: dict[str, LlamaForCausalLM]) -> tuple[LlamaForCausalLM, fused_forward.FusedForward, KVCache]:
    """The draft on the kernels, its one-call forward, and an empty two-slot cache for it."""
    model = demo_models["draft-packed"]
    assert model.fused is not None
    return model, model.fused, KVCache.allocate(model.cfg, 2, torch.float32)


@needs_kernel
def test_rows_from_lists_refuse_what_would_read_or_write_out_of_range(
        demo_models: dict[str, LlamaForCausalLM]) -> None:
    model, fused, cache = draft_kernel_and_cache(demo_models)
    positions = cache.k[0].shape[2]
    vocab = model.cfg.vocab_size
    with pytest.raises(ValueError, match="vocabulary"):
        fused.run_rows([[5, vocab]], cache.k, cache.v, [0], [0], [1])
    with pytest.raises(ValueError, match="vocabulary"):
        fused.run_rows([[-1]], cache.k, cache.v, [0], [0], [0])
    with pytest.raises(ValueError, match="cache rows"):
        fused.run_rows([[5, 6]], cache.k, cache.v, [0], [positions - 1], [1])  # one position past the end
    with pytest.raises(ValueError, match="cache rows"):
        fused.run_rows([[5]], cache.k, cache.v, [2], [0], [0])  # no slot 2
    with pytest.raises(ValueError, match="cache rows"):
        fused.run_rows([[5], [6]], cache.k, cache.v, [0], [0], [0])  # a start missing
    with pytest.raises(ValueError, match="logit rows"):
        fused.run_rows([[5, 6]], cache.k, cache.v, [0], [0], [2])
    assert fused.run_rows([[5, 6]], cache.k, cache.v, [1], [positions - 2], [0, 1]).shape == (2, vocab)


@needs_kernel
def test_greedy_drafting_in_one_call_is_the_per_step_forwards_bit_for_bit(
        demo_models: dict[str, LlamaForCausalLM]) -> None:
    """``draft_greedy`` (the engine's greedy drafting, one kernel call for all K drafts) runs the
    forwards the per-position path runs, row by row: the same drafts and the same cache."""
    model = demo_models["draft-packed"]
    fused = model.fused
    assert fused is not None
    rows = [[11, 12, 13], [21, 22], [31]]
    slots, starts, steps = [2, 0, 1], [40, 7, 19], 5
    one_call = KVCache.allocate(model.cfg, 3, torch.float32)
    drafts = fused.draft_greedy(rows, one_call.k, one_call.v, slots, starts, steps)
    per_step = KVCache.allocate(model.cfg, 3, torch.float32)
    expected: list[list[int]] = [[] for _ in rows]
    feed, at = rows, list(starts)
    for _ in range(steps):
        width = max(map(len, feed))
        logits = fused.run_rows(feed, per_step.k, per_step.v, slots, at,
                                [b * width + len(row) - 1 for b, row in enumerate(feed)])
        for b, token in enumerate(logits.argmax(dim=-1).tolist()):
            expected[b].append(token)
        at = [s + len(row) for s, row in zip(at, feed, strict=True)]
        feed = [[row[-1]] for row in expected]
    assert drafts == expected
    assert all(len(row) == steps for row in drafts)
    assert all(torch.equal(a, b) for a, b in zip([*one_call.k, *one_call.v], [*per_step.k, *per_step.v], strict=True))


@needs_kernel
def test_greedy_drafting_refuses_what_its_later_steps_would_write_out_of_range(
        demo_models: dict[str, LlamaForCausalLM]) -> None:
    model, fused, cache = draft_kernel_and_cache(demo_models)
    positions = cache.k[0].shape[2]
    with pytest.raises(ValueError, match="cache rows"):  # the third step's token lands one past the end
        fused.draft_greedy([[5, 6]], cache.k, cache.v, [0], [positions - 3], 3)
    with pytest.raises(ValueError, match="vocabulary"):
        fused.draft_greedy([[5, model.cfg.vocab_size]], cache.k, cache.v, [0], [0], 2)
    with pytest.raises(ValueError, match="one token per row"):
        fused.draft_greedy([[5], []], cache.k, cache.v, [0, 1], [0, 0], 2)
    with pytest.raises(ValueError, match="at least one step"):
        fused.draft_greedy([[5]], cache.k, cache.v, [0], [0], 0)
    assert len(fused.draft_greedy([[5, 6]], cache.k, cache.v, [1], [positions - 4], 3)[0]) == 3


@needs_kernel
def test_engine_greedy_drafting_in_one_call_matches_the_per_position_path(
        demo_models: dict[str, LlamaForCausalLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's one-call greedy drafting proposes, step by step, what its per-position
    path proposes: the same drafts accepted, the same tokens, at batch 3 and alone."""
    target, draft = demo_models["target-packed"], demo_models["draft-packed"]
    codec = TextCodec.from_model_dir(REPO / "models/demo-target")
    prompts = [codec.encode(t)[:12] for t in heldout_prompts(3, seed=4)]  # short: drafting catches up in one call
    greedy = SamplingParams(temperature=0.0)
    calls = 0
    one_call = fused_forward.FusedForward.draft_greedy

    def counted(*args: object, **kwargs: object) -> list[list[int]]:
        nonlocal calls
        calls += 1
        return one_call(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_forward.FusedForward, "draft_greedy", counted)
    runs = []
    for per_position in (False, True):
        engine = SpeculativeEngine(target, draft, max_slots=3, max_k=6, drafting_in_one_call=not per_position)
        for i, ids in enumerate(prompts):
            engine.add(GenerationRequest(f"r{i}", ids, 40, greedy, k=4))
        steps = []
        while engine.has_work:
            steps.append(sorted((e.request_id, e.tokens, e.proposed, e.accepted) for e in engine.step()))
        runs.append(steps)
        if not per_position:
            assert calls > 5  # the one-call path served the drafting steps
            calls = 0
    assert calls == 0  # and the per-position path never called it
    assert runs[0] == runs[1]


@pytest.fixture
def kernel_threads() -> Iterator[Callable[[int], None]]:
    """Sets the kernels' thread count (``workers.threads``); back to 1 after the test."""
    assert KERNEL is not None
    yield KERNEL.set_threads
    KERNEL.set_threads(1)


@needs_kernel
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_projections_split_across_threads_are_one_threads_bits(
        weight_dtype: torch.dtype, kernel_threads: Callable[[int], None]) -> None:
    """Each output column is one thread's FMA chain whatever the split, so every thread count
    gives the same bits, for every row count and for widths that do not split evenly."""
    assert KERNEL is not None
    gen = torch.Generator().manual_seed(3)
    for n, k in ((8, 64), (200, 72), (640, 384), (4096, 256)):
        packed = KERNEL.pack(torch.randn(n, k, generator=gen).to(weight_dtype).float())
        x = torch.randn(9, k, generator=gen)
        kernel_threads(1)
        alone = [KERNEL.linear(x[:m], packed) for m in range(1, 10)]
        assert KERNEL.threads == 1
        for threads in (2, 3):
            kernel_threads(threads)
            split = [KERNEL.linear(x[:m], packed) for m in range(1, 10)]
            assert KERNEL.threads == threads
            assert all(torch.equal(a, b) for a, b in zip(alone, split, strict=True)), (n, k, threads)


@needs_kernel
def test_forwards_and_greedy_drafting_on_two_threads_are_one_threads_bits(
        demo_models: dict[str, LlamaForCausalLM], kernel_threads: Callable[[int], None]) -> None:
    """A verification forward of the target and a draft's greedy drafting, on one thread and on
    two: the same logits, drafts and caches, bit for bit."""
    target, draft = demo_models["target-packed"], demo_models["draft-packed"]
    assert target.fused is not None and draft.fused is not None
    results = []
    for threads in (1, 2):
        kernel_threads(threads)
        t_cache = KVCache.allocate(target.cfg, 2, torch.float32)
        d_cache = KVCache.allocate(draft.cfg, 2, torch.float32)
        prompt = target.fused.run_rows([[5, 6, 7, 8, 9], [10, 11]], t_cache.k, t_cache.v, [1, 0], [0, 30],
                                       list(range(10)))
        verify = target.fused.run_rows([[9, 1, 2, 3, 4]], t_cache.k, t_cache.v, [1], [5], [0, 1, 2, 3, 4])
        drafts = draft.fused.draft_greedy([[5, 6, 7], [8]], d_cache.k, d_cache.v, [0, 1], [0, 12], 4)
        results.append((prompt, verify, drafts, [*t_cache.k, *t_cache.v, *d_cache.k, *d_cache.v]))
    (p1, v1, d1, c1), (p2, v2, d2, c2) = results
    assert torch.equal(p1, p2) and torch.equal(v1, v2) and d1 == d2
    assert all(torch.equal(a, b) for a, b in zip(c1, c2, strict=True))


@needs_kernel
def test_projections_called_from_two_threads_at_once_are_each_correct(kernel_threads: Callable[[int], None]) -> None:
    """The kernels post one split projection at a time; a second caller meanwhile (a benchmark
    or a test beside the engine) runs its projection alone, and both get their own results."""
    assert KERNEL is not None
    kernel_threads(2)
    gen = torch.Generator().manual_seed(5)
    packed = KERNEL.pack(torch.randn(2048, 384, generator=gen).bfloat16().float())
    inputs = [torch.randn(4, 384, generator=gen) for _ in range(2)]
    expected = [KERNEL.linear(x, packed) for x in inputs]
    mismatches: list[int] = []

    def hammer(i: int) -> None:
        for _ in range(200):
            if not torch.equal(KERNEL.linear(inputs[i], packed), expected[i]):
                mismatches.append(i)

    workers = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert mismatches == []


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_of_a_query_does_not_depend_on_the_queries_beside_it(
        threads: int, kernel_threads: Callable[[int], None]) -> None:
    """Attention reads each key once for a tile of queries that share a KV head (a row's group
    of heads, several rows): a query's output must be what it is alone, bit for bit, whatever
    its tile (9 rows x 3 heads: tiles of 7 and 6), and padding rows are zeros."""
    assert KERNEL is not None
    kernel_threads(threads)
    heads, kv_heads, dim, positions = 6, 2, 64, 64
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(2, 9, (heads + 2 * kv_heads) * dim, generator=gen)
    cos, sin = torch.randn(positions, dim, generator=gen), torch.randn(positions, dim, generator=gen)
    rows = torch.tensor([[1, 0], [20, 3], [9, 4]])  # slots, starts, lengths (row 1: 5 padding rows)

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(10)
        return (torch.randn(2, kv_heads, positions, dim, generator=g),
                torch.randn(2, kv_heads, positions, dim, generator=g))

    together = KERNEL.rope_attend(qkv, cos, sin, *caches(), rows, heads, kv_heads)
    assert torch.equal(together[1, 4:], torch.zeros_like(together[1, 4:]))
    for b in range(2):
        k_cache, v_cache = caches()
        for i in range(int(rows[2, b])):  # each row alone, in order: its keys written as before
            one = torch.tensor([[rows[0, b]], [rows[1, b] + i], [1]])
            alone = KERNEL.rope_attend(qkv[b:b + 1, i:i + 1].contiguous(), cos, sin, k_cache, v_cache, one, heads,
                                       kv_heads)
            assert torch.equal(alone[0, 0], together[b, i]), (b, i)


@needs_kernel
def test_sixteen_wide_tiles_are_the_eight_wide_tiles_bits(kernel_threads: Callable[[int], None]) -> None:
    """On a CPU with AVX-512 the bfloat16 projections run two panels per 512-bit register
    (``WIDE_TILES``); per column the FMA chain is the 8-wide tiles', so the bits are too: for
    every row count and tile shape, an odd last panel (200 columns: 25 panels), an odd K, and
    a split across threads. (Without AVX-512 both builds are the 8-wide one.)"""
    assert KERNEL is not None
    narrow = rowgemm.load_variant(("WIDE_TILES=0",))
    assert narrow is not None
    gen = torch.Generator().manual_seed(5)
    for n, k in ((8, 64), (16, 64), (200, 73), (640, 384), (1024, 256), (4096, 256)):
        weight = torch.randn(n, k, generator=gen).to(torch.bfloat16).float()
        packed = KERNEL.pack(weight)
        assert packed.weights.dtype == torch.bfloat16
        x = torch.randn(12, k, generator=gen)
        for threads in (1, 2):
            kernel_threads(threads)
            narrow.set_threads(threads)
            for m in range(1, 13):
                assert torch.equal(KERNEL.linear(x[:m], packed), narrow.linear(x[:m], packed)), (n, k, m, threads)
    narrow.set_threads(1)
