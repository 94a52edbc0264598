"""Running the embedded engine in tests: seeded random prompts, stepping until idle, the tokens a request got."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine, StepEvent
from workers.engines.embedded.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def random_prompts(count: int, seed: int, vocab: int = 48, min_len: int = 1, max_len: int = 40) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def output_tokens(events: Sequence[StepEvent]) -> list[int]:
    return [t for e in events for t in e.tokens]


def run_until_idle(engine: SpeculativeEngine, max_steps: int = 1000) -> dict[str, list[StepEvent]]:
    """Steps until nothing is running or queued; a stuck engine fails instead of hanging."""
    by_id: dict[str, list[StepEvent]] = defaultdict(list)
    for _ in range(max_steps):
        if not engine.has_work:
            return by_id
        for event in engine.step():
            by_id[event.request_id].append(event)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def generate(engine: SpeculativeEngine, request: GenerationRequest) -> list[StepEvent]:
    """``engine.generate`` with a step bound."""
    engine.add(request)
    return run_until_idle(engine)[request.request_id]


PROMPTS = random_prompts(20, seed=7)
