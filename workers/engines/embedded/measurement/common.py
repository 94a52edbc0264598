"""Helpers the start-up cost measurements share (``measure.py``, ``trees.py``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from workers.engines.embedded.kv_cache import KVCache
from workers.engines.embedded.llama import LlamaForCausalLM


def scratch_cache(model: LlamaForCausalLM, slots: int, positions: int) -> KVCache:
    """A cache of ``slots`` sequences of ``positions`` for timing ``model``'s forwards."""
    cfg = dataclasses.replace(model.cfg, max_position_embeddings=positions)
    return KVCache.allocate(cfg, slots, model.lm_head.weight.dtype)


def timed(run: Callable[[], None]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def fill_line(measured: dict[int, float], size: int) -> list[float]:
    """Seconds for n = 1..size from the n measured: linear between them, extended by the last slope."""
    ns = sorted(measured)
    out = []
    for n in range(1, size + 1):
        if n in measured:
            out.append(measured[n])
            continue
        lo = max((m for m in ns if m < n), default=ns[0])
        hi = min((m for m in ns if m > n), default=None)
        if hi is None:  # beyond the last measured n
            a, b = (ns[-2], ns[-1]) if len(ns) > 1 else (ns[-1], ns[-1])
            slope = (measured[b] - measured[a]) / (b - a) if b != a else 0.0
            out.append(measured[b] + slope * (n - b))
        else:
            out.append(measured[lo] + (measured[hi] - measured[lo]) * (n - lo) / (hi - lo))
    return out
