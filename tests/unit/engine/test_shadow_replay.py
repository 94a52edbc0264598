"""Shadow evidence (lookup/replay.py): at T=0, and seeded, what the engine replays for a lookup
method a request did not run equals, step for step, what running that method reports."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.unit.engine.engine_runs import GREEDY, PROMPTS, generate, output_tokens
from workers.api.generation import ShadowSteps
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine, StepEvent
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.lookup.proposer import LookupProposer
from workers.engines.embedded.lookup.replay import _proposer_for, replay_steps
from workers.engines.embedded.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[3]
DEMO_TARGET, DEMO_DRAFT = REPO / "models" / "demo-target", REPO / "models" / "demo-draft"
MAX_K = 6
RUNS = ("plain", "draft", "ngram", "suffix")


def _steps(events: list[StepEvent]) -> list[tuple[int, int]]:
    return [(e.proposed, e.accepted) for e in events]


def _shadow(events: list[StepEvent]) -> dict[str, ShadowSteps]:
    assert all(not e.shadow for e in events[:-1])  # the last event alone carries it
    return {s.method: s for s in events[-1].shadow}


def _run_each_way(target: LlamaForCausalLM, draft: LlamaForCausalLM, prompts: list[list[int]],
                  params: SamplingParams, max_tokens: int, min_tokens: int = 0) -> dict[str, list[list[StepEvent]]]:
    """Every prompt in turn, on one engine per way it runs (the suffix store then holds the same
    documents at each request: the outputs are the same in every mode)."""
    params = SamplingParams(params.temperature, seed=params.seed, min_tokens=min_tokens)
    runs: dict[str, list[list[StepEvent]]] = {}
    for way in RUNS:
        engine = SpeculativeEngine(target, draft, max_slots=2, max_k=MAX_K)
        runs[way] = [generate(engine, GenerationRequest(
            f"{way}-{i}", prompt, max_tokens - i % 5, params, k=0 if way == "plain" else MAX_K,
            method="draft" if way == "plain" else way, session=f"s{i % 2}"))  # type: ignore[arg-type]
            for i, prompt in enumerate(prompts)]
    return runs


def _assert_replays_equal_runs(runs: dict[str, list[list[StepEvent]]]) -> int:
    """Each request's shadow for a method equals that method's run, step for step; returns the
    drafts the lookup runs accepted (the test must exercise acceptance)."""
    accepted = 0
    for i in range(len(runs["draft"])):
        outputs = {tuple(output_tokens(runs[way][i])) for way in RUNS}
        assert len(outputs) == 1, f"prompt {i}: the modes disagree"
        for method in ("ngram", "suffix"):
            real = _steps(runs[method][i])
            accepted += sum(a for _, a in real)
            for way in RUNS:
                if way == method:
                    assert method not in _shadow(runs[way][i])  # no shadow of the method that ran
                    continue
                shadow = _shadow(runs[way][i])[method]
                assert list(shadow.steps()) == real, (i, way, method)
                counts = shadow.counts()
                assert (counts.proposed, counts.accepted, counts.steps) == (
                    sum(p for p, _ in real), sum(a for _, a in real), len(real))
    return accepted


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, seed=5)], ids=["greedy", "seeded"])
def test_the_replay_equals_running_the_method(params: SamplingParams, target_model: LlamaForCausalLM,
                                              draft_model: LlamaForCausalLM) -> None:
    runs = _run_each_way(target_model, draft_model, PROMPTS[:12], params, 32)
    assert _assert_replays_equal_runs(runs) > 0


def test_the_replay_keeps_min_tokens_plain(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM) -> None:
    runs = _run_each_way(target_model, draft_model, PROMPTS[:6], GREEDY, 28, min_tokens=5)
    _assert_replays_equal_runs(runs)


@pytest.fixture(scope="module")
def demo_pair() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    return (LlamaForCausalLM.from_pretrained(DEMO_TARGET, torch.float32),
            LlamaForCausalLM.load_draft(DEMO_DRAFT, target=DEMO_TARGET))


def _demo_prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    prompts = []
    for i in range(count):
        body = torch.randint(5, 600, (4 + 7 * i,), generator=gen).tolist()
        prompts.append(body + body[: 3 + i])  # a repeat for lookup to find
    return prompts


def test_the_replay_equals_running_the_method_on_the_demo_pair(
        demo_pair: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    runs = _run_each_way(*demo_pair, _demo_prompts(6), GREEDY, 40)
    assert _assert_replays_equal_runs(runs) > 0


def test_unseeded_sampling_gets_no_shadow(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=MAX_K)
    events = generate(engine, GenerationRequest("hot", PROMPTS[0], 20, SamplingParams(temperature=0.7), k=MAX_K))
    assert all(not e.shadow for e in events)


def test_the_replay_of_a_long_output_is_cheap() -> None:
    """The cost the finish path pays: both methods over a 2,000-token output (a 500-token prompt)."""
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, 4096, (500,), generator=gen).tolist()
    # Output that half repeats the prompt, so both methods propose and get rejected often.
    output = [prompt[i % 500] if (i // 50) % 2 else int(t) for i, t in
              enumerate(torch.randint(0, 4096, (2000,), generator=gen).tolist())]
    lookup = LookupProposer()
    lookup.finished("earlier", prompt, output[:1000], "s")  # the store holds a similar request
    started = time.perf_counter()
    for method in ("ngram", "suffix"):
        steps = replay_steps(_proposer_for(lookup, method, "s", ""), prompt, output, None, 8, 1, 2000, 4096)
        assert sum(min(a + 1, 2000) for _, a in steps) >= 2000 - 8
    elapsed = time.perf_counter() - started
    print(f"replay of both methods over 2,000 output tokens: {elapsed * 1000:.1f} ms")
    assert elapsed < 1.0
