"""The plugin's rules as pure functions: which K a request asks for, and the batch latch.

No vLLM import, so the rules are tested without an engine; ``scheduler`` applies them.
The batch latch is the same hysteresis as specgate's ``policies.speculation.step_depth``
(restated here because the plugin depends on nothing but vLLM; a test checks they agree).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SPEC_K_ARG = "spec_k"  # drafts per step for this request; 0 = plain; absent or < 0 = the engine's K
MAX_BATCH_ARG = "spec_max_batch"  # every request runs plain while the batch is deeper than this...
BATCH_RESUME_ARG = "spec_batch_resume"  # ...until it is shallower than this
UNLIMITED = 1 << 30


def requested_k(extra_args: Mapping[str, Any] | None, engine_k: int) -> int:
    """The K a request asks for, capped at the engine's; the engine's K when it asks for none."""
    raw = extra_args.get(SPEC_K_ARG) if extra_args else None
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)  # JSON clients may send 3.0
    if raw is None or isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        return engine_k
    return min(raw, engine_k)


def thresholds(extra_args: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """(max_batch, batch_resume) when a request carries both as positive integers."""
    if not extra_args:
        return None
    max_batch, resume = extra_args.get(MAX_BATCH_ARG), extra_args.get(BATCH_RESUME_ARG)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (max_batch, resume)):
        return None
    assert isinstance(max_batch, int) and isinstance(resume, int)
    return max_batch, min(resume, max_batch)


@dataclass
class BatchLatch:
    """Plain for every request while the batch is deep: trips above ``max_batch``, clears only
    below ``batch_resume``, so throughput does not collapse near one threshold."""

    max_batch: int = UNLIMITED
    batch_resume: int = UNLIMITED
    latched: bool = False

    def update(self, batch_depth: int) -> bool:
        if batch_depth > self.max_batch:
            self.latched = True
        elif batch_depth < self.batch_resume:
            self.latched = False
        return self.latched
