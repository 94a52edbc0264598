"""D4: a seeded request's answer does not depend on the decoding mode, K or batch.

Seeded requests are sampled by the Gumbel-max trick with noise keyed by (seed, output position)
(``workers.engines.embedded.sampling.gumbel_max``). The engine's output is compared with a cache-free reference
that recomputes the whole sequence per token and applies the same rule.

Bit-level honesty: the tiny float32 models here are not verified bit-identically to plain
decoding (MKL rounds a one-row projection differently from a several-row one, ~1e-6). The
reference therefore also records, per position, the gap between the best and second-best
perturbed score; the tests require it to be far above any rounding difference, so no tie can
flip and the comparison is exact by construction, not by luck.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from tests.unit.engine.seeded_reference import MIN_MARGIN, gumbel_reference
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine, StepEvent
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sampling import SamplingParams, Verdict, noise_key, seeded_noise, verify

from .engine_runs import PROMPTS, output_tokens, run_until_idle

MAX_K = 6
HOT = 0.8
SEED = 4242
MAX_TOKENS = 40




@pytest.fixture(scope="module")
def reference(target_model: LlamaForCausalLM) -> list[int]:
    tokens, margin = gumbel_reference(target_model, PROMPTS[3], MAX_TOKENS, SamplingParams(HOT, seed=SEED))
    assert margin > MIN_MARGIN, margin
    return tokens


def seeded(rid: str, k: int, prompt: Sequence[int] = PROMPTS[3], max_tokens: int = MAX_TOKENS,
           seed: int | None = SEED, offset: int = 0) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt), max_tokens, SamplingParams(HOT, seed=seed, position_offset=offset),
                             k=k)


@pytest.mark.parametrize("k", range(MAX_K + 1))
def test_seeded_answer_alone_for_every_k(k: int, target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                                         reference: list[int]) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    events = run_until_idle(engine_with(engine, seeded("x", k)))["x"]
    assert output_tokens(events) == reference
    if k > 0:
        proposed = sum(e.proposed for e in events)
        accepted = sum(e.accepted for e in events)
        assert 0 < accepted < proposed  # drafts were both accepted and rejected on the way


def engine_with(engine: SpeculativeEngine, *requests: GenerationRequest) -> SpeculativeEngine:
    for request in requests:
        engine.add(request)
    return engine


@pytest.mark.parametrize("k", [0, 1, 3, MAX_K])
def test_seeded_answer_batched_with_seven_others(k: int, target_model: LlamaForCausalLM,
                                                 draft_model: LlamaForCausalLM, reference: list[int]) -> None:
    """Seven neighbours: seeded and unseeded, plain and speculative, joining and leaving."""
    engine = SpeculativeEngine(target_model, draft_model, max_slots=8, max_k=MAX_K, rng=random.Random(1))
    others = [seeded(f"o{i}", i % (MAX_K + 1), PROMPTS[10 + i], 8 + 5 * i, seed=None if i % 2 else 7 + i)
              for i in range(7)]
    events = run_until_idle(engine_with(engine, *others[:4], seeded("x", k), *others[4:]))
    assert output_tokens(events["x"]) == reference
    assert max(e.batch_depth for e in events["x"]) == 8


def test_seeded_answer_under_a_step_latch(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                                          reference: list[int]) -> None:
    """The worker's batch latch switches steps between plain and speculative mid-request."""
    steps = 0

    def latch(k: int, depth: int) -> int:
        return 0 if (steps // 3) % 2 else k  # three steps speculative, three plain, ...

    engine = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=MAX_K, step_depth_rule=latch)
    engine.add(seeded("x", MAX_K))
    engine.add(seeded("y", 2, PROMPTS[5], seed=99))
    events: list[StepEvent] = []
    while engine.has_work:
        events += [e for e in engine.step() if e.request_id == "x"]
        steps += 1
    assert output_tokens(events) == reference
    assert {e.proposed > 0 for e in events} == {True, False}


def test_resume_at_a_position_continues_the_noise(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                                                  reference: list[int]) -> None:
    """A request resumed after n tokens (position_offset=n) continues the same answer."""
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    head = output_tokens(run_until_idle(engine_with(engine, seeded("head", 0, max_tokens=13)))["head"])
    assert head == reference[:13]
    tail = run_until_idle(engine_with(engine, seeded("tail", 4, PROMPTS[3] + head, MAX_TOKENS - 13, offset=13)))
    assert head + output_tokens(tail["tail"]) == reference


def test_seeds_differ_and_unseeded_requests_use_the_standard_rule(
        target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM, reference: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def counting(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, gen: torch.Generator) -> Verdict:
        calls.append(len(drafts))
        return verify(drafts, q, p, gen)

    monkeypatch.setattr("workers.engines.embedded.engine.verify", counting)
    engine = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=MAX_K)
    other = output_tokens(run_until_idle(engine_with(engine, seeded("s", 3, seed=SEED + 1)))["s"])
    assert other != reference and not calls  # seeded: the Gumbel-max rule, not verify
    run_until_idle(engine_with(engine, seeded("u", 3, seed=None)))
    assert calls  # unseeded: standard speculative sampling, the higher acceptance


def test_noise_is_keyed_by_seed_and_position() -> None:
    assert torch.equal(seeded_noise(5, 3, 64), seeded_noise(5, 3, 64))
    keys = {noise_key(seed, position) for seed in (-1, 0, 1, 2) for position in range(50)}
    assert len(keys) == 200  # no collisions between nearby seeds and positions
    assert not torch.equal(seeded_noise(5, 3, 64), seeded_noise(5, 4, 64))
    assert not torch.equal(seeded_noise(5, 3, 64), seeded_noise(6, 3, 64))
    assert noise_key(-1, 0) == noise_key((1 << 64) - 1, 0)  # negative seeds as their 64-bit pattern
