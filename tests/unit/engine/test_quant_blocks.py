"""The block kernels (kernels/quant_blocks.h, issue #55): the GGUF's Q4_1 and Q8_0 blocks widen to
exactly the float32 conversion's weights, products are the float32 kernel's bit for bit (so the
quantized target is the float32 conversion's function), every row is computed as it is alone,
and bad blocks are refused naming the weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.engine.block_models import quantized
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.kernels.blocks import BlockError, pack_blocks, panel_bytes, panels_from_bytes

KERNEL = rowgemm.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="rowgemm did not build here (no C compiler or no AVX2)")
KINDS = ["q4_1", "q8_0"]


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Rows of different scales and signs: blocks whose minimum is positive, negative, tiny.
    return torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n)[:, None] + torch.randn(n, 1, generator=gen)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k"), [(96, 64), (40, 96), (8, 32), (56, 160)])  # 12, 5, 1 and 7 panels
def test_widened_weights_are_the_float32_conversions_bit_for_bit(kind: str, n: int, k: int) -> None:
    """y = I W^T is W^T exactly (each product 1 w or 0 w, each sum exact): the values the
    kernels multiply, through the in-register tiles (1-3 rows) and the blocked path (k rows)."""
    assert KERNEL is not None
    raw, reference = quantized(weight(n, k, 1), kind)
    panels = pack_blocks(raw, kind, "w")
    eye = torch.eye(k)
    assert torch.equal(KERNEL.linear(eye, panels).t(), torch.from_numpy(reference))
    for rows in (1, 2, 3):
        assert torch.equal(KERNEL.linear(eye[:rows], panels).t(), torch.from_numpy(reference)[:, :rows])
    if kind == "q8_0":  # the embedding: rows read as the head multiplies them
        ids = torch.tensor([[0, n - 1], [3, 3]])
        assert torch.equal(KERNEL.embedding_rows(panels, ids), torch.from_numpy(reference)[ids])
        with pytest.raises(ValueError, match=r"outside the vocabulary"):
            KERNEL.embedding_rows(panels, torch.tensor([n]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k"), [(96, 64), (40, 96), (8, 32), (56, 160), (200, 576)])
def test_products_are_the_float32_kernels_and_rows_are_invariant(kind: str, n: int, k: int) -> None:
    """1..16 rows (and a prefill's 40): each row bit for bit the float32 kernel's on the converted
    weights, and as computed alone; close to a float64 reference."""
    assert KERNEL is not None
    raw, reference = quantized(weight(n, k, 2), kind)
    panels, floats = pack_blocks(raw, kind, "w"), KERNEL.pack(torch.from_numpy(reference))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(3))
    full = KERNEL.linear(x, panels)
    assert torch.equal(full, KERNEL.linear(x, floats))
    exact = x.double() @ torch.from_numpy(reference).double().t()
    scale = x.double().abs() @ torch.from_numpy(reference).double().abs().t()
    assert float(((full.double() - exact).abs() / scale).max()) < 2e-5  # float32 sums of up to 576 terms
    for m in range(1, 17):
        assert torch.equal(KERNEL.linear(x[:m], panels), full[:m]), m
        assert torch.equal(KERNEL.linear(x[m:m + 1], panels), full[m:m + 1]), m


def test_threads_split_columns_without_changing_a_bit() -> None:
    assert KERNEL is not None
    raw, _ = quantized(weight(960, 576, 4), "q4_1")
    panels = pack_blocks(raw, "q4_1", "w")
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(5))
    alone = [KERNEL.linear(x[:m], panels) for m in (1, 3, 9)]
    before = KERNEL.threads
    KERNEL.set_threads(2)
    try:
        assert all(torch.equal(KERNEL.linear(x[:m], panels), a) for m, a in zip((1, 3, 9), alone, strict=True))
    finally:
        KERNEL.set_threads(before)


def test_the_panels_read_back_from_bytes_are_the_same_weights() -> None:
    assert KERNEL is not None
    raw, _ = quantized(weight(16, 64, 6), "q4_1")
    packed = pack_blocks(raw, "q4_1", "w")
    again = panels_from_bytes(torch.from_numpy(panel_bytes(raw, "q4_1", "w")), "q4_1", 64, "w")
    x = torch.randn(2, 64)
    assert torch.equal(KERNEL.linear(x, again), KERNEL.linear(x, packed))
    with pytest.raises(BlockError, match=r"w: .* is not q4_1 panels of 96 inputs"):
        panels_from_bytes(again.weights, "q4_1", 96, "w")


@pytest.mark.parametrize(("kind", "offset", "field"), [("q4_1", 0, "scale"), ("q4_1", 2, "minimum"),
                                                       ("q8_0", 0, "scale")])
def test_a_non_finite_scale_is_refused_naming_the_weight(kind: str, offset: int, field: str) -> None:
    raw, _ = quantized(weight(16, 64, 7), kind)
    size = 20 if kind == "q4_1" else 34
    bad = raw.copy()
    bad[5, size + offset: size + offset + 2] = np.array([np.inf], dtype=np.float16).view(np.uint8)  # row 5, block 1
    with pytest.raises(BlockError, match=f"blk.3.ffn_up: block 1 of row 5 has a non-finite {field}"):
        pack_blocks(bad, kind, "blk.3.ffn_up")
    # The same corruption in a laid-out file is refused at load.
    laid_out = torch.from_numpy(panel_bytes(raw, kind, "w")).clone()
    panel_size = 160 if kind == "q4_1" else 272
    nan = torch.from_numpy(np.array([np.nan], dtype=np.float16).view(np.uint8).copy())
    scale_at = panel_size + (16 if field == "minimum" else 0) + 2 * (5 % 8)  # column 5's, block 1
    laid_out[0, scale_at:scale_at + 2] = nan
    with pytest.raises(BlockError, match=f"layer.w: block 1 of panel 0 has a non-finite {field}"):
        panels_from_bytes(laid_out, kind, 64, "layer.w")


def test_other_block_types_and_shapes_are_refused_by_name() -> None:
    raw, _ = quantized(weight(16, 64, 8), "q4_1")
    with pytest.raises(BlockError, match=r"attn_q: q5_0 blocks are not read"):
        pack_blocks(raw, "q5_0", "attn_q")
    with pytest.raises(BlockError, match=r"attn_q: 12 output rows, not a multiple of 8"):
        pack_blocks(raw[:12], "q4_1", "attn_q")
    with pytest.raises(BlockError, match=r"attn_q: uint8 \(16, 39\) is not rows of q4_1 blocks"):
        pack_blocks(raw[:, :39], "q4_1", "attn_q")
