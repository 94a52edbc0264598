"""The real pair in the embedded engine: SmolLM2-135M-Instruct (make install's converted directory)
with the draft distilled for it (models/smollm2-draft, a reduced-vocabulary draft that reads the
target's embedding). Greedy speculative output is the target's own, token for token, for K = 1..6
and in a mixed batch: verification does not depend on how good the draft is.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.api.wire import ChatMessage
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine, StepEvent
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sampling import SamplingParams
from workers.text import TextCodec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "smollm2-135m-instruct-q4_1"
DRAFT = REPO / "models" / "smollm2-draft"
GREEDY = SamplingParams(temperature=0.0)
QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string.",
             'Fill {"name": str, "age": int} from: Ada is 36.', "A train goes 60 km/h for 2 hours. How far?"]
TOKENS = 20


@pytest.fixture(scope="module")
def pair() -> tuple[LlamaForCausalLM, LlamaForCausalLM, list[list[int]]]:
    assert (TARGET / "model.safetensors").is_file(), f"{TARGET} is missing: run make install"
    torch.set_num_threads(1)
    target = LlamaForCausalLM.from_pretrained(TARGET, torch.float32)
    draft = LlamaForCausalLM.load_draft(DRAFT, target=TARGET)
    codec = TextCodec.from_model_dir(TARGET)
    prompts = [codec.encode_chat([ChatMessage("user", q)]) for q in QUESTIONS]
    return target, draft, prompts


def run(engine: SpeculativeEngine, requests: list[GenerationRequest]) -> dict[str, list[StepEvent]]:
    for request in requests:
        engine.add(request)
    events: dict[str, list[StepEvent]] = {r.request_id: [] for r in requests}
    while engine.has_work:
        for event in engine.step():
            events[event.request_id].append(event)
    return events


def tokens(events: list[StepEvent]) -> list[int]:
    return [t for e in events for t in e.tokens]


def test_greedy_speculation_is_the_targets_output_for_every_k(
        pair: tuple[LlamaForCausalLM, LlamaForCausalLM, list[list[int]]]) -> None:
    target, draft, prompts = pair
    # The four prompts share each step (one K for all), as a worker's batch does: a quarter of
    # the forwards of one prompt at a time, and the same guarantee (verification is row-invariant;
    # the mixed test below gives each row its own K).
    slots = len(prompts)
    plain = run(SpeculativeEngine(target, None, max_slots=slots, max_k=8),
                [GenerationRequest(f"p{i}", p, TOKENS, GREEDY) for i, p in enumerate(prompts)])
    reference = {rid: tokens(events) for rid, events in plain.items()}
    engine = SpeculativeEngine(target, draft, max_slots=slots, max_k=8)
    accepted = 0
    for k in range(1, 7):
        out = run(engine, [GenerationRequest(f"p{i}", p, TOKENS, GREEDY, k=k) for i, p in enumerate(prompts)])
        for rid, events in out.items():
            assert tokens(events) == reference[rid], (k, rid)
            accepted += sum(e.accepted for e in events)
    assert accepted > 0  # the draft was right sometimes


def test_a_mixed_batch_of_the_real_pair_is_the_targets_output(
        pair: tuple[LlamaForCausalLM, LlamaForCausalLM, list[list[int]]]) -> None:
    target, draft, prompts = pair
    requests = [GenerationRequest(f"m{i}", p, TOKENS, GREEDY, k=k) for i, (p, k) in enumerate(zip(prompts, (0, 2, 5, 3),
                                                                                                   strict=True))]
    plain = run(SpeculativeEngine(target, None, max_slots=4, max_k=8),
                [GenerationRequest(r.request_id, r.prompt_ids, TOKENS, GREEDY) for r in requests])
    mixed = run(SpeculativeEngine(target, draft, max_slots=4, max_k=8), requests)
    assert {rid: tokens(e) for rid, e in mixed.items()} == {rid: tokens(e) for rid, e in plain.items()}
