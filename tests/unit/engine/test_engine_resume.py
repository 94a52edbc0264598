"""A resumed generation (mid-stream migration) continues exactly as the undisturbed one, in the
serving precision: from any split point, the same tokens, and the same KV cache bit for bit.

The resumed prefill computes the prompt as the original prefill did (fused attention) and the
output as its decode steps did (row-invariant), ``GenerationRequest.resumed_tokens``."""

from __future__ import annotations

import pytest
import torch

from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine, StepEvent
from workers.engines.embedded.kv_cache import CacheBatch, KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.measurement.measure import verification_bit_identical
from workers.engines.embedded.sampling import SamplingParams

from .conftest import VOCAB

MAX_K = 6
OUTPUT = 56  # output tokens: with the longest prompt, the resumed prefill crosses a 64-key block
AHEAD = 8  # tokens a resumed request generates before it is compared
_gen = torch.Generator().manual_seed(11)
# Short (rides in a decode forward, never fused), and long enough for a fused prefill.
PROMPTS = [torch.randint(0, VOCAB, (n,), generator=_gen).tolist() for n in (4, 23, 90)]
CASES = {"greedy": SamplingParams(temperature=0.0), "seeded": SamplingParams(temperature=0.8, seed=21)}


def generate(engine: SpeculativeEngine, request: GenerationRequest, max_steps: int = 500) -> list[StepEvent]:
    """``engine.generate`` with a step bound (a stuck engine fails instead of hanging)."""
    engine.add(request)
    events: list[StepEvent] = []
    for _ in range(max_steps):
        if not engine.has_work:
            return events
        events.extend(e for e in engine.step() if e.request_id == request.request_id)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def output_tokens(events: list[StepEvent]) -> list[int]:
    return [t for e in events for t in e.tokens]


@pytest.fixture(scope="module")
def serving_models(bf16_models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """The exact serving precision: a bfloat16 target (prepacked where the CPU can, else
    ``F.linear``), which ``workers.exact`` serves wherever its verification is bit-identical."""
    if not verification_bit_identical(bf16_models[0], MAX_K + 1):
        pytest.skip("bfloat16 verification is not bit-identical on this CPU: workers.exact does not serve it here")
    return bf16_models


def cache_prefix(engine: SpeculativeEngine, positions: int) -> list[torch.Tensor]:
    """Slot 0's keys and values at positions [0, positions), every layer."""
    cache = engine.target_cache
    return [t[0, :, :positions].clone() for t in (*cache.k, *cache.v)]


@pytest.mark.parametrize("k", [0, MAX_K])
@pytest.mark.parametrize("case", CASES)
def test_resume_from_any_split_point_is_the_undisturbed_run(case: str, k: int,
                                                           serving_models: tuple[LlamaForCausalLM, LlamaForCausalLM]
                                                           ) -> None:
    params = CASES[case]
    engine = SpeculativeEngine(*serving_models, max_slots=1, max_k=MAX_K)
    for p, prompt in enumerate(PROMPTS):
        full = output_tokens(generate(engine, GenerationRequest(f"p{p}", prompt, OUTPUT, params, k=k)))
        assert len(full) == OUTPUT
        undisturbed = cache_prefix(engine, len(prompt) + OUTPUT - 1)  # every token's but the last's
        for cut in range(1, OUTPUT):
            # A few tokens on: with the cache bit-identical, the rest cannot differ (and would
            # make this test several times slower).
            ahead = min(AHEAD, OUTPUT - cut)
            resumed = SamplingParams(params.temperature, params.top_p, params.top_k, params.seed, position_offset=cut)
            rest = output_tokens(generate(engine, GenerationRequest(
                f"p{p}-{cut}", prompt + full[:cut], ahead, resumed, k=k, resumed_tokens=cut)))
            where = f"prompt {p} ({len(prompt)} tokens), resumed after {cut}"
            assert rest == full[cut:cut + ahead], where
            # The resumed prefill's entries (prompt and output) and those decoded after it.
            written = len(prompt) + cut + ahead - 1
            assert all(torch.equal(now[:, :written], then[:, :written])
                       for now, then in zip(cache_prefix(engine, written), undisturbed, strict=True)), where


def test_resumed_prefill_is_split_where_the_original_was(serving_models: tuple[LlamaForCausalLM, LlamaForCausalLM],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt fused, in a forward of its own; the output (and a short prompt) row-invariant."""
    target, draft = serving_models
    seen: list[tuple[int, bool]] = []  # (new tokens, row_invariant) of each target forward
    original = target.forward_cached

    def recording(tokens: torch.Tensor, cache: KVCache, batch: CacheBatch, logit_rows: torch.Tensor | None = None,
                  logit_cols: torch.Tensor | None = None) -> torch.Tensor:
        seen.append((tokens.shape[1], batch.row_invariant))
        return original(tokens, cache, batch, logit_rows, logit_cols)

    monkeypatch.setattr(target, "forward_cached", recording)
    engine = SpeculativeEngine(target, draft, max_slots=1, max_k=MAX_K)
    short, long = PROMPTS[0], max(PROMPTS, key=len)
    output = list(range(1, 21))
    for prompt, first_forwards in ((long, [(len(long), False), (len(output), True)]),
                                   (short, [(len(short) + len(output), True)])):
        seen.clear()
        events: list[StepEvent] = generate(engine, GenerationRequest(
            "r", prompt + output, 4, CASES["greedy"], k=MAX_K, resumed_tokens=len(output)))
        assert events[0].proposed == 0  # a prefill never drafts
        assert seen[:len(first_forwards)] == first_forwards
        assert all(row_invariant for _, row_invariant in seen[len(first_forwards):])


@pytest.mark.parametrize("resumed_tokens", [-1, 5, 6])
def test_resumed_tokens_must_leave_a_prompt(resumed_tokens: int, target_model: LlamaForCausalLM,
                                            draft_model: LlamaForCausalLM) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    with pytest.raises(ValueError, match="resumed_tokens"):
        engine.add(GenerationRequest("r", [1, 2, 3, 4, 5], 4, resumed_tokens=resumed_tokens))
