"""What a start-up measurement is asked for (``MeasureSettings``) and the key its figures are
cached under: the models, the slots and K, the precision asked for, the CPU's kernels."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from workers.costs.cache import cache_key
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.projections import bf16_prepacking_available
from workers.engines.embedded.quantized import TargetDtype, blocks_unavailable

__all__ = ["DraftDtype", "MeasureSettings", "TargetDtype", "kernel_build"]

DraftDtype = Literal["float32", "bfloat16"]


@dataclass(frozen=True)
class MeasureSettings:
    target: Path
    draft: Path | None
    max_slots: int
    max_k: int
    dtype: Literal["auto", "float32", "bfloat16", "q4_1"] = "auto"
    draft_dtype: DraftDtype = "float32"
    exact: bool = True  # only bit-identical configurations, unless none is
    budget_s: float = 4.0
    threads: int = 1  # torch intra-op threads the worker runs with

    def cache_key(self) -> str:
        """Everything the figures depend on besides the budget (``workers/costs/cache.py``)."""
        return cache_key({"target": self.target, "draft": self.draft},
                         {"max_slots": self.max_slots, "max_k": self.max_k, "dtype": self.dtype,
                          "draft_dtype": self.draft_dtype, "exact": self.exact, "threads": self.threads,
                          "prepacking": bf16_prepacking_available(), "rowgemm": kernel_build(),
                          # whether the GGUF's blocks can serve: auto measures them then
                          "blocks": blocks_unavailable(self.target) is None},
                         torch.__version__)


def kernel_build() -> str | None:
    """The float32 kernels' build (``workers/engines/embedded/kernels/rowgemm.py``), None where they do not run."""
    kernel = rowgemm.load()
    return None if kernel is None else kernel.build
