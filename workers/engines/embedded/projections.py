"""The embedded models' projections and precisions: ``Linear`` and ``Embedding`` (torch's, not
initialised), ``FrozenLinear`` (a weight laid out once, at
load: oneDNN's prepacked bfloat16, or float32 panels on kernels/rowgemm.py), the dtypes a config
names, and how the kernels multiply (``Products``)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from workers.engines.embedded.kernels import rowgemm


class Linear(nn.Linear):
    """``nn.Linear`` without torch's random init (~0.8 s of SmolLM2's start): a
    ``LlamaForCausalLM``'s weights always come from ``init_weights`` or a checkpoint (building on
    the meta device instead imports torch's Python reference ops, which costs more)."""

    def reset_parameters(self) -> None:
        pass


def release_sources(sources: list[Linear], frozen: FrozenLinear | None) -> int:
    """Empty the weights of ``sources`` where ``frozen`` (built from them) holds its own laid-out
    copy (packed or panels), so a serving model keeps one copy of each projection, not two; the
    bytes freed. An emptied weight keeps its dtype."""
    if frozen is None or frozen.weight is not None:
        return 0
    freed = 0
    for source in sources:
        weight = source.weight
        freed += weight.numel() * weight.element_size()
        source.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
    return freed


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:  # as Linear's
        pass


def bf16_prepacking_available() -> bool:
    """Whether this CPU and build run bfloat16 projections on oneDNN's prepacked weights."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise") and bool(ops._is_mkldnn_bf16_supported()))


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # config names -> torch dtypes
# How a float32 model's projections on workers/engines/embedded/kernels/rowgemm.py's kernels multiply: float32 FMAs of
# the bfloat16 weights, or bfloat16 products (inputs rounded to bfloat16, sums in float32: the
# arithmetic of oneDNN's bfloat16 and of AMX) where the CPU has AVX512-BF16. Both kernels are
# row-invariant, so either keeps verification bit-identical to plain decoding.
Products = Literal["float32", "bfloat16"]


def products_named(name: str) -> Products:
    """A cost report's ``products`` (a plain string in its JSON) as ``Products``."""
    return "bfloat16" if name == "bfloat16" else "float32"


def resolve_dtype(requested: Literal["auto", "float32", "bfloat16"]) -> Literal["float32", "bfloat16"]:
    """"auto" is bfloat16 where it runs prepacked (fast, bit-identical verification), else
    float32, which is then faster than unpacked bfloat16 and close to, not bit-for-bit, exact."""
    if requested == "auto":
        return "bfloat16" if bf16_prepacking_available() else "float32"
    return requested


class FrozenLinear:
    """An inference-only projection ``y = x Wᵀ`` whose weight is laid out once, at load.

    In bfloat16 the weight is prepacked into oneDNN's blocked layout (what torch.compile's CPU
    backend does with frozen weights). On CPUs with AMX or AVX512-BF16 a packed projection then
    costs about the same for 1 row as for 9, which is what lets the target verify K drafts in
    one forward for little more than the price of one token; ``F.linear`` on a plain bfloat16
    weight re-lays it out on every call and is slower at batch 1. The packed kernel's rows do
    not depend on how many rows there are, so verification sees the same logits as a plain
    step. Where packing is unavailable (other dtypes, builds without oneDNN) it is ``F.linear``.
    """

    def __init__(self, weight: torch.Tensor, packed: bool = True, products: Products = "float32") -> None:
        weight = weight.detach().contiguous()
        # Exactly one of the three is kept: a packed copy replaces the plain weight.
        self.packed: torch.Tensor | None = None
        self.panels: rowgemm.Panels | None = None  # float32 on workers/engines/embedded/kernels/rowgemm.py's kernel
        self.weight: torch.Tensor | None = weight
        self.dot = False  # the panels multiply as bfloat16 products (``Products``)
        self._rowgemm = rowgemm.load() if packed and weight.dtype == torch.float32 else None
        if not packed:
            return
        if weight.dtype == torch.bfloat16 and bf16_prepacking_available():
            self.packed, self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1), None
        elif self._rowgemm is not None and self._rowgemm.packable(weight):
            self.panels, self.weight = self._rowgemm.pack(weight), None
            self.dot = products == "bfloat16" and self._rowgemm.can_dot(self.panels)

    @classmethod
    def from_panels(cls, panels: rowgemm.Panels, kernel: rowgemm.RowGemm) -> FrozenLinear:
        """A projection already laid out for the kernels (the GGUF's blocks: kernels/blocks.py)."""
        frozen = cls.__new__(cls)
        frozen.packed, frozen.weight, frozen.panels, frozen.dot = None, None, panels, False
        frozen._rowgemm = kernel
        return frozen

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [None], "")
            return out
        if self.panels is not None:
            assert self._rowgemm is not None
            return self._rowgemm.linear(x, self.panels, self.dot)
        assert self.weight is not None
        return F.linear(x, self.weight)
