"""The row-invariant kernels' build (workers/engines/embedded/kernels/rowgemm.py): a failed or missing C
compiler falls back to F.linear, and load() chooses between two builds by measurement. These run
the C compiler, so they live in the e2e tier (split from tests/unit/engine/test_rowgemm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.llama import LlamaForCausalLM

REPO = Path(__file__).resolve().parents[2]
KERNEL = rowgemm.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="rowgemm did not build here (no C compiler or no AVX2)")


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
def test_the_build_is_chosen_by_measurement_once_per_machine_and_both_builds_give_the_same_bits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load() times the prefetching and the non-prefetching build and keeps the faster; the
    choice is recorded, so later processes (sibling workers) read it instead of measuring; a
    torn record is measured again. Prefetching moves data, not arithmetic: the same bits."""
    monkeypatch.setenv("SPECGATE_ROWGEMM_DIR", str(tmp_path))
    measured: list[Path] = []
    measure = rowgemm._measure_choice

    def counted(path: Path) -> tuple[str, ...]:
        measured.append(path)
        return measure(path)

    monkeypatch.setattr(rowgemm, "_measure_choice", counted)
    rowgemm.load.cache_clear()
    try:
        kernel = rowgemm.load()
        assert kernel is not None and len(measured) == 1
        record = json.loads(measured[0].read_text())
        assert tuple(record["defines"]) in rowgemm.PREFETCH_CHOICES
        assert set(record["pass_ms"]) == {" ".join(d) for d in rowgemm.PREFETCH_CHOICES}
        assert rowgemm.chosen_build() == {"build": kernel.build, **record}
        rowgemm.load.cache_clear()
        assert rowgemm.load() is not None and len(measured) == 1  # read, not measured again
        measured[0].write_text("{")
        rowgemm.load.cache_clear()
        assert rowgemm.load() is not None and len(measured) == 2
    finally:
        rowgemm.load.cache_clear()
    builds = [rowgemm.load_variant(d) for d in rowgemm.PREFETCH_CHOICES]
    assert KERNEL is not None
    gen = torch.Generator().manual_seed(9)
    packed = KERNEL.pack(torch.randn(640, 384, generator=gen).to(torch.bfloat16).float())
    x = torch.randn(9, 384, generator=gen)
    outputs = [b.linear(x[:m], packed) for b in builds if b is not None for m in (1, 4, 9)]
    assert len(outputs) == 6 and all(torch.equal(a, b) for a, b in zip(outputs[:3], outputs[3:], strict=True))
