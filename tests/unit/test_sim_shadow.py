"""Shadow evidence in the simulated engine (workers/engines/sim/shadow.py): drawn from its own
tables for the lookup methods a request did not run, on its last event, at T=0 or seeded."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from workers.api.generation import SamplingParams
from workers.api.sim_config import SimConfig
from workers.engines.interface import GenerationRequest, StepEvent
from workers.engines.sim.engine import SimEngine, SimSettings
from workers.engines.sim.shadow import sim_shadow

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "models" / "demo-target"
CONFIG = replace(SimConfig(), time_scale=0.001)


def _prompt(text: str) -> list[int]:
    return Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json")).encode(text).ids


async def _serve(requests: list[GenerationRequest]) -> list[list[StepEvent]]:
    engine = SimEngine(SimSettings(TOKENIZER_DIR, max_slots=8, max_k=8, config=CONFIG))
    await engine.start(lambda _: None)
    try:
        return [[event async for event in engine.generate(request)] for request in requests]
    finally:
        await engine.stop()


def test_the_last_event_carries_the_methods_not_run() -> None:
    prompt = _prompt("[code_edit] rename x to count in def f(x): return x + 1")
    greedy = SamplingParams(temperature=0.0)
    draft, ngram, plain, hot, seeded = asyncio.run(_serve([
        GenerationRequest("d", prompt, 40, greedy, k=5, method="draft"),
        GenerationRequest("n", prompt, 40, greedy, k=5, method="ngram"),
        GenerationRequest("p", prompt, 40, greedy, k=0),
        GenerationRequest("h", prompt, 40, SamplingParams(temperature=0.7), k=5),
        GenerationRequest("s", prompt, 40, SamplingParams(temperature=0.7, seed=3), k=5)]))
    assert all(not e.shadow for events in (draft, ngram, plain) for e in events[:-1])
    assert [s.method for s in draft[-1].shadow] == ["ngram", "suffix"]
    assert [s.method for s in ngram[-1].shadow] == ["suffix"]  # not the method it ran
    assert [s.method for s in plain[-1].shadow] == ["ngram", "suffix"]
    assert not hot[-1].shadow and [s.method for s in seeded[-1].shadow] == ["ngram", "suffix"]
    for shadow in draft[-1].shadow:
        steps = list(shadow.steps())
        assert steps[0] == (0, 0)  # the prompt's step
        assert sum(1 if p == 0 else a + 1 for p, a in steps) == 40  # the output's tokens, walked once
        assert all(p <= 5 for p, _ in steps)  # capped at the request's K
    for shadow in plain[-1].shadow:
        assert max(p for p, _ in shadow.steps()) <= 8  # a plain request's: the worker's max K


@pytest.mark.parametrize(("method", "category"), [("ngram", "code_edit"), ("suffix", "rag"), ("suffix", "chat")])
def test_the_shadow_draws_the_tables_alpha_and_coverage(method: str, category: str) -> None:
    table = CONFIG.acceptance
    alpha, coverage = table.lookup_alpha(method, category, 0.0)
    (shadow,) = [s for s in sim_shadow(table, category, 0.0, None, 6, 60_000, random.Random(1))
                 if s.method == method]
    steps = list(shadow.steps())[1:]
    counts = shadow.counts()
    assert counts.speculative_steps / len(steps) == pytest.approx(coverage, abs=0.02)
    assert counts.accepted / counts.tested == pytest.approx(alpha, abs=0.02)
