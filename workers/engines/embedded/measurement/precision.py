"""The precision a worker serves: which target configurations are measured
(``target_configs``), the one chosen from their timings (``choose_precision``), and torch's
threads once it serves (``torch_threads_serving``)."""

from __future__ import annotations

from typing import Literal

from policies.cost import expected_tokens
from workers.costs.cost_report import PrecisionCandidate, PrecisionChoice
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.measurement.settings import MeasureSettings, TargetDtype
from workers.engines.embedded.projections import Products

# Candidates are compared at this per-token acceptance: the demo models' α on code at T=0 is
# 0.86, on prose lower; 0.8 ranks configurations by how well they verify without needing
# requests. (K per session is chosen later from the session's own α.)
REFERENCE_ALPHA = 0.8


def best_b1(target_s: list[float], draft_s: float | None, alpha: float) -> tuple[float, int]:
    """Predicted batch-1 tokens/s and K at acceptance ``alpha``, from depth-1 forward times."""
    options = [(1.0 / target_s[0], 0)]
    if draft_s is not None:
        options += [(expected_tokens(alpha, k) / (target_s[k] + k * draft_s), k) for k in range(1, len(target_s))]
    return max(options)


def choose_precision(candidates: list[PrecisionCandidate],
                     settings: MeasureSettings) -> tuple[PrecisionCandidate, str]:
    """The configured dtype if one is; else the best ``score`` among the bit-identical
    candidates (``exact``), or among all of them (``exact`` False, or none is bit-identical)."""
    def describe(c: PrecisionCandidate) -> str:
        packed = " prepacked" if c.prepacked else ""
        products = " with bfloat16 products" if c.products == "bfloat16" and c.target != "bfloat16" else ""
        return (f"{c.target}{packed}{products} {c.tok_s_b1:.0f} tok/s at batch 1 (K={c.best_k_b1}), "
                f"{c.tok_s_full:.0f} tok/s plain at full batch")

    fastest = max(candidates, key=lambda c: c.score)
    exact = [c for c in candidates if c.bit_identical]
    listing = ", ".join(describe(c) + ("" if c.bit_identical else " not bit-identical") for c in candidates)
    if settings.dtype != "auto":
        # The dtype is configured; its kernels (packed or F.linear) are still measured.
        only = max(exact, key=lambda c: c.score) if exact and settings.exact else fastest
        note = "" if only.bit_identical else "; its verification is not bit-identical on this CPU"
        return only, f"workers.dtype: {settings.dtype} (configured){note}: {listing}"
    if not settings.exact:
        return fastest, f"fastest predicted at alpha {REFERENCE_ALPHA} (workers.exact: false): {listing}"
    if not exact:
        return fastest, (f"no configuration verifies bit-identically on this CPU; the fastest serves, close to "
                         f"exact: {listing}")
    best = max(exact, key=lambda c: c.score)
    return best, f"fastest bit-identical at alpha {REFERENCE_ALPHA}: {listing}"


def target_configs(dtype: Literal["auto", "float32", "bfloat16", "q4_1"], stored: TargetDtype = "bfloat16",
                   blocks: str | None = "no blocks") -> dict[str, tuple[TargetDtype, bool, Products]]:
    """The target configurations to measure, by label: (dtype, packed, products). float32 packed
    runs kernels/rowgemm.py's kernels where they compiled, and is then measured against F.linear.
    Where the kernels have bfloat16 products (AVX512-BF16), a float32 model multiplying in
    bfloat16 is a bfloat16 configuration: measured for ``auto`` and ``bfloat16``, never for a
    configured ``float32``, which promises float32 arithmetic.

    ``auto`` never narrows weights stored in float32 (``stored``, the checkpoint's) to bfloat16
    weights and activations: the start-up measurement ranks speed, not fidelity, and SmolLM2's
    float32 weights in bfloat16 answer "What is the capital of France?" with "L'Étoile, la
    Marseillaise, ..." (docs/engine.md). bfloat16 products on float32 weights stay candidates.

    ``blocks``: why the target cannot be served from its GGUF blocks here (quantized.py's
    ``blocks_unavailable``), None where it can: ``auto`` then measures ``q4_1`` too (the same
    function as the float32 conversion, bit for bit: no fidelity to rank), and ``q4_1`` asked
    for where it cannot run is a ValueError saying why."""
    if dtype == "q4_1":
        if blocks is not None:
            raise ValueError(f"workers.dtype: q4_1: {blocks}")
        return {"q4_1": ("q4_1", True, "float32")}
    dtypes: list[TargetDtype] = ["bfloat16", "float32"] if dtype == "auto" else [dtype]
    if dtype == "auto" and stored == "float32":
        dtypes = ["float32"]
    if dtype == "auto" and blocks is None:
        dtypes.append("q4_1")
    configs: dict[str, tuple[TargetDtype, bool, Products]] = {d: (d, True, "float32") for d in dtypes}
    kernel = rowgemm.load()
    if kernel is not None:
        if "float32" in dtypes:
            configs["float32-F.linear"] = ("float32", False, "float32")
        if dtype != "float32" and kernel.dot_products:
            configs["float32-bfloat16-products"] = ("float32", True, "bfloat16")
    return configs


def torch_threads_serving(precision: PrecisionChoice, threads: int) -> int:
    """torch's intra-op threads once ``precision`` serves: ``threads``, except 1 where the
    kernels (workers/engines/embedded/kernels/rowgemm.py, their own ``threads``) run the forwards. torch then only glues
    between kernel calls, and its OpenMP workers, spinning after each parallel region, took the
    second core from the kernels' helper: on the 2-core AVX2 machine, ``bench.engine --threads 2``
    decoded 603 -> 900 tok/s (plain -> speculative) with them and 770 -> 1135 without
    (OMP_WAIT_POLICY=PASSIVE), its start-up verification curve erratic with them."""
    on_kernels = precision.target in ("float32", "q4_1") and precision.prepacked and rowgemm.load() is not None
    return 1 if on_kernels else threads
