"""workers/engines/embedded/kernels/rowgemm.py's bfloat16 products (AVX512-BF16): the same panels multiplied by inputs
rounded to bfloat16, summed in float32. What makes them servable: every row's result is the
same whatever rows are beside it and however the work is split (so verification stays
bit-identical to plain decoding), and the precision they bring is measured and chosen like
every other configuration, never under a configured float32."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from workers.costs.cost_report import CostReport, PrecisionCandidate, PrecisionChoice
from workers.engines.embedded.config import stored_weight_dtype
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.measurement.measure import verification_bit_identical
from workers.engines.embedded.measurement.precision import choose_precision, target_configs
from workers.engines.embedded.measurement.settings import MeasureSettings

REPO = Path(__file__).resolve().parents[3]
KERNEL = rowgemm.load()
needs_products = pytest.mark.skipif(KERNEL is None or not KERNEL.dot_products,
                                    reason="no bfloat16 products here (no AVX512-BF16, no C compiler or no AVX2)")


@pytest.fixture
def kernel_threads() -> Iterator[Callable[[int], None]]:
    assert KERNEL is not None
    yield KERNEL.set_threads
    KERNEL.set_threads(1)


@pytest.fixture(scope="module")
def product_models() -> dict[str, LlamaForCausalLM]:
    """The demo target with bfloat16 products, and the demo draft as served (float32 FMAs)."""
    return {"target": LlamaForCausalLM.from_pretrained(REPO / "models/demo-target", torch.float32, True, "bfloat16"),
            "draft": LlamaForCausalLM.load_draft(REPO / "models/demo-draft")}


@needs_products
def test_products_are_the_rounded_inputs_times_the_weights_and_rows_are_invariant(
        kernel_threads: Callable[[int], None]) -> None:
    """Close to (inputs rounded to bfloat16) @ Wᵀ in float64; every row the same bits in a call
    of any size (1-9 rows in one tile, more in 4-row tiles), for an odd K, an odd last panel of 8
    columns and splits across 1-3 threads."""
    assert KERNEL is not None
    gen = torch.Generator().manual_seed(11)
    for n, k in ((8, 64), (200, 73), (640, 384), (4096, 256)):
        weight = torch.randn(n, k, generator=gen).to(torch.bfloat16).float()
        packed = KERNEL.pack(weight)
        x = torch.randn(20, k, generator=gen)
        kernel_threads(1)
        y = KERNEL.linear(x, packed, dot=True)
        reference = (x.to(torch.bfloat16).double() @ weight.double().T).float()
        torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)
        assert not torch.equal(y, KERNEL.linear(x, packed))  # the inputs really are rounded
        for threads in (1, 2, 3):
            kernel_threads(threads)
            for m in range(1, 21):
                assert torch.equal(KERNEL.linear(x[:m], packed, dot=True), y[:m]), (n, k, m, threads)
            for m in range(20):
                assert torch.equal(KERNEL.linear(x[m:m + 1], packed, dot=True), y[m:m + 1]), (n, k, m, threads)


@needs_products
def test_a_draft_loads_with_its_targets_products() -> None:
    for products in ("float32", "bfloat16"):
        draft = LlamaForCausalLM.load_draft(REPO / "models/demo-draft", products=products)
        assert draft.products == products and draft.fused is not None


@needs_products
def test_products_need_bfloat16_panels() -> None:
    assert KERNEL is not None
    packed = KERNEL.pack(torch.randn(16, 32))  # not bfloat16-valued: float32 panels
    assert packed.weights.dtype == torch.float32
    with pytest.raises(ValueError, match="bfloat16 panels"):
        KERNEL.linear(torch.randn(2, 32), packed, dot=True)


@needs_products
def test_a_model_with_products_verifies_bit_identically(product_models: dict[str, LlamaForCausalLM]) -> None:
    """The start-up check's finding; the fused forward is the per-op path with products too
    (tests/unit/engine/test_rowgemm.py), and greedy speculative output is plain output."""
    target = product_models["target"]
    assert target.products == "bfloat16" and target.prepacked and target.fused is not None
    assert verification_bit_identical(target, 9) and verification_bit_identical(target, 4)


def test_products_are_a_candidate_for_auto_and_bfloat16_never_for_a_configured_float32() -> None:
    products = KERNEL is not None and KERNEL.dot_products
    auto, bf16, f32 = (target_configs(d) for d in ("auto", "bfloat16", "float32"))
    assert (auto.get("float32-bfloat16-products") == ("float32", True, "bfloat16")) == products
    assert ("float32-bfloat16-products" in bf16) == products
    assert all(c[2] == "float32" for c in f32.values())


def test_auto_never_narrows_float32_weights_to_bfloat16() -> None:
    """A checkpoint stored in float32 (the converted SmolLM2): auto measures float32 weights only,
    with bfloat16 products where the kernels have them; one stored in bfloat16 (the demo pair)
    measures both, and a configured bfloat16 is served as configured."""
    products = KERNEL is not None and KERNEL.dot_products
    from_float32 = target_configs("auto", "float32")
    assert {c[0] for c in from_float32.values()} == {"float32"}
    assert ("float32-bfloat16-products" in from_float32) == products
    assert "bfloat16" in target_configs("auto", "bfloat16")
    assert "bfloat16" in target_configs("bfloat16", "float32")


def test_the_stored_dtype_is_read_from_the_weights_file(tmp_path: Path) -> None:
    assert stored_weight_dtype(REPO / "models/demo-target") == "bfloat16"
    save_file({"w": torch.zeros(2, 2, dtype=torch.float32), "ids": torch.zeros(2, dtype=torch.int64)},
              str(tmp_path / "model.safetensors"))
    assert stored_weight_dtype(tmp_path) == "float32"
    save_file({"ids": torch.zeros(2, dtype=torch.int64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no floating-point tensor"):
        stored_weight_dtype(tmp_path)


def test_the_choice_follows_measured_speed_and_the_report_keeps_products() -> None:
    def candidate(products: str, tok_s: float) -> PrecisionCandidate:
        return PrecisionCandidate("float32", True, True, 1.0, 2.0, tok_s, 3, 2 * tok_s, products)

    settings = MeasureSettings(REPO / "models/demo-target", REPO / "models/demo-draft", 16, 8)
    for fast, slow in (("bfloat16", "float32"), ("float32", "bfloat16")):
        pick, why = choose_precision([candidate(slow, 500.0), candidate(fast, 900.0)], settings)
        assert pick.products == fast
        assert "with bfloat16 products" in why
    report = CostReport((1,), (1.0,), ((1.0, 1.5),), precision=None)
    assert CostReport.from_json(report.to_json()).precision is None
    chosen = candidate("bfloat16", 900.0)
    with_choice = CostReport((1,), (1.0,), ((1.0, 1.5),),
                             precision=PrecisionChoice("float32", True, True, "why", 0.8, (chosen,), "bfloat16"))
    back = CostReport.from_json(with_choice.to_json()).precision
    assert back is not None and back.products == "bfloat16" and back.candidates[0].products == "bfloat16"
