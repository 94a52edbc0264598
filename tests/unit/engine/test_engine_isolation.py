"""One request cannot hurt another inside the engine: degenerate sampling values never reach a
kernel, and a sequence whose sampling, verification or forward row raises fails alone while the
rest of its batch decodes exactly as it would have."""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import workers.engines.embedded.drafting as drafting
import workers.engines.embedded.engine as engine_module
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine, StepEvent
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.runner import EngineRunner
from workers.engines.embedded.sampling import SamplingParams
from workers.engines.interface import StepStats

GreedyReference = Callable[[Sequence[int], int], list[int]]
GREEDY = SamplingParams(temperature=0.0)
HONEST = [[3, 14, 15, 9, 2], [6, 5, 35], [8, 9, 7, 9, 3, 2, 3]]  # short: they ride in one batched forward
POISON = "poison"
MARKER = 47  # a token only the poisoned prompt holds (honest prompts stay below it)


def make_engine(target: LlamaForCausalLM, draft: LlamaForCausalLM) -> SpeculativeEngine:
    return SpeculativeEngine(target, draft, max_slots=8, max_k=6)


def run(engine: SpeculativeEngine, max_steps: int = 500) -> dict[str, list[StepEvent]]:
    by_id: dict[str, list[StepEvent]] = defaultdict(list)
    for _ in range(max_steps):
        if not engine.has_work:
            return by_id
        for event in engine.step():
            by_id[event.request_id].append(event)
    raise AssertionError("engine still busy")


def add_batch(engine: SpeculativeEngine, poison: GenerationRequest, n: int = 24) -> None:
    for i, prompt in enumerate(HONEST):
        engine.add(GenerationRequest(f"honest-{i}", prompt, n, GREEDY, k=4))
    engine.add(poison)


def assert_honest_unharmed(events: dict[str, list[StepEvent]], reference: GreedyReference, n: int = 24) -> None:
    for i, prompt in enumerate(HONEST):
        got = events[f"honest-{i}"]
        assert all(e.error is None for e in got)
        assert got[-1].finish_reason == "length"
        assert [t for e in got for t in e.tokens] == reference(prompt, n)


def assert_poison_failed_alone(engine: SpeculativeEngine, events: dict[str, list[StepEvent]]) -> None:
    failures = [e for e in events[POISON] if e.error is not None]
    assert len(failures) == 1 and isinstance(failures[0].error, RuntimeError)
    assert events[POISON][-1] is failures[0]  # nothing after its failure
    assert engine.batch_depth == 0 and sorted(engine._free_slots) == list(range(engine.max_slots))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_p=0.0), SamplingParams(temperature=0.7, top_p=-0.5),
    SamplingParams(temperature=0.7, top_p=math.nan), SamplingParams(temperature=math.nan),
    SamplingParams(temperature=-1.0), SamplingParams(temperature=math.inf), SamplingParams(top_k=-2),
])
def test_degenerate_sampling_values_are_refused_at_add(params: SamplingParams, target_model: LlamaForCausalLM,
                                                       draft_model: LlamaForCausalLM) -> None:
    engine = make_engine(target_model, draft_model)
    with pytest.raises(ValueError, match=r"temperature|top_p|top_k"):
        engine.add(GenerationRequest("bad", [1, 2, 3], 4, params, k=4))
    assert not engine.has_work


def test_tiny_temperature_decodes_greedily(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                                           greedy_reference: GreedyReference) -> None:
    engine = make_engine(target_model, draft_model)
    engine.add(GenerationRequest("tiny", HONEST[0], 20, SamplingParams(temperature=1e-30), k=4))
    assert [t for e in run(engine)["tiny"] for t in e.tokens] == greedy_reference(HONEST[0], 20)


def test_top_p_that_rounds_to_zero_in_float32_still_samples(target_model: LlamaForCausalLM,
                                                            draft_model: LlamaForCausalLM,
                                                            greedy_reference: GreedyReference) -> None:
    engine = make_engine(target_model, draft_model)
    # top_p this small keeps the top token alone: sampling is greedy decoding.
    engine.add(GenerationRequest("nucleus", HONEST[1], 20, SamplingParams(temperature=0.9, top_p=5e-324), k=4))
    events = run(engine)["nucleus"]
    assert all(e.error is None for e in events)
    assert [t for e in events for t in e.tokens] == greedy_reference(HONEST[1], 20)


def test_failed_draft_sampling_fails_only_its_sequence(target_model: LlamaForCausalLM,
                                                       draft_model: LlamaForCausalLM,
                                                       greedy_reference: GreedyReference,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(target_model, draft_model)
    original = drafting.draft_token

    def draft_token(seq: Any, logits: torch.Tensor, position: int) -> None:
        if seq.request.request_id == POISON and seq.emitted >= 3:  # fails mid-sequence, not at once
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        original(seq, logits, position)

    monkeypatch.setattr(engine_module, "draft_token", draft_token)
    add_batch(engine, GenerationRequest(POISON, [1, 2, 3], 24, SamplingParams(temperature=0.7), k=4))
    events = run(engine)
    assert_honest_unharmed(events, greedy_reference)
    assert_poison_failed_alone(engine, events)


def test_failed_verification_fails_only_its_sequence(target_model: LlamaForCausalLM,
                                                     draft_model: LlamaForCausalLM,
                                                     greedy_reference: GreedyReference,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(target_model, draft_model)
    original = engine._settle

    def settle(seq: Any, logits: torch.Tensor, depth: int) -> StepEvent:
        if seq.request.request_id == POISON:
            raise RuntimeError("verification blew up")
        return original(seq, logits, depth)

    monkeypatch.setattr(engine, "_settle", settle)
    add_batch(engine, GenerationRequest(POISON, [4, 4, 4], 24, SamplingParams(temperature=1.0), k=0))
    events = run(engine)
    assert_honest_unharmed(events, greedy_reference)
    assert_poison_failed_alone(engine, events)


def test_a_failing_row_fails_only_its_sequence_not_the_batched_forward(target_model: LlamaForCausalLM,
                                                                        draft_model: LlamaForCausalLM,
                                                                        greedy_reference: GreedyReference,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(target_model, draft_model)
    original = engine._forward
    calls: list[int] = []

    def forward(model: LlamaForCausalLM, cache: Any, rows: list[Any]) -> list[torch.Tensor]:
        calls.append(len(rows))
        if model is target_model and any(MARKER in row.new_tokens for row in rows):
            raise RuntimeError("a kernel refused this row")
        return original(model, cache, rows)

    monkeypatch.setattr(engine, "_forward", forward)
    add_batch(engine, GenerationRequest(POISON, [MARKER, 1, 2], 24, GREEDY, k=4))
    events = run(engine)
    assert_honest_unharmed(events, greedy_reference)
    assert_poison_failed_alone(engine, events)
    assert len(HONEST) + 1 in calls and 1 in calls  # the batch raised, then its rows ran alone


async def test_runner_delivers_a_failure_to_its_request_alone(target_model: LlamaForCausalLM,
                                                              draft_model: LlamaForCausalLM,
                                                              greedy_reference: GreedyReference,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(target_model, draft_model)
    original = engine._settle

    def settle(seq: Any, logits: torch.Tensor, depth: int) -> StepEvent:
        if seq.request.request_id == POISON and seq.emitted >= 2:
            raise RuntimeError("verification blew up")
        return original(seq, logits, depth)

    monkeypatch.setattr(engine, "_settle", settle)
    loop = asyncio.get_running_loop()
    steps: list[tuple[float, int]] = []  # (step time, batch depth) per on_step call
    idle = asyncio.Event()

    def on_step(stats: StepStats) -> None:  # on the compute thread
        steps.append((stats.step_s, stats.batch_depth))
        if stats.step_s == 0 and stats.batch_depth == 0:
            loop.call_soon_threadsafe(idle.set)

    runner = EngineRunner(engine, loop, on_step)
    received: dict[str, list[StepEvent | BaseException]] = defaultdict(list)
    done: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    def sink(request_id: str) -> Callable[[StepEvent | BaseException], None]:
        def put(item: StepEvent | BaseException) -> None:
            received[request_id].append(item)
            if isinstance(item, BaseException) or item.finish_reason is not None:
                done[request_id].set()
        return put

    runner.start()
    try:
        runner.submit(GenerationRequest("honest", HONEST[2], 40, GREEDY, k=4), sink("honest"))
        runner.submit(GenerationRequest(POISON, [5, 6, 7], 40, GREEDY, k=4), sink(POISON))
        await asyncio.wait_for(asyncio.gather(done["honest"].wait(), done[POISON].wait(), idle.wait()), timeout=60)
    finally:
        runner.stop()
    honest = received["honest"]
    assert all(isinstance(e, StepEvent) for e in honest)
    assert [t for e in honest if isinstance(e, StepEvent) for t in e.tokens] == greedy_reference(HONEST[2], 40)
    assert isinstance(received[POISON][-1], RuntimeError)
    # Idle, the runner reports once more (no step ran), so the batch-depth gauge falls back to 0.
    assert steps[-1] == (0.0, 0)
