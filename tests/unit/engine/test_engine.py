"""The speculative engine against cache-free references: greedy parity, the output distribution,
KV-cache rewind, scheduling (join/leave/abort), stopping and per-step accounting."""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch

from tests.unit.engine.engine_runs import GREEDY, PROMPTS, generate, output_tokens, random_prompts, run_until_idle
from workers.engines.embedded.config import ModelConfig
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine, StepDepthRule, StepEvent
from workers.engines.embedded.kv_cache import CacheBatch, KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sampling import SamplingParams, Verdict

from .conftest import converted

GreedyReference = Callable[[Sequence[int], int], list[int]]
ChiSquare = Callable[[Sequence[int], torch.Tensor], float]
VerifyFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], Verdict]

MAX_K = 6










assert min(map(len, PROMPTS)) <= 5 and max(map(len, PROMPTS)) >= 30  # the table spans short and long


# -- 1. greedy parity at batch 1 ---------------------------------------------------------------
@pytest.mark.parametrize("k", range(MAX_K + 1))
def test_greedy_parity_batch1(k: int, target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                              greedy_reference: GreedyReference) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=MAX_K)
    proposed = accepted = full_steps = partial_steps = 0
    for i, prompt in enumerate(PROMPTS):
        max_tokens = 16 + i % 9
        events = generate(engine, GenerationRequest(f"p{i}", prompt, max_tokens, GREEDY, k=k))
        assert output_tokens(events) == greedy_reference(prompt, max_tokens), f"prompt {i} (len {len(prompt)})"
        assert all(e.batch_depth == 1 for e in events)
        assert events[-1].finish_reason == "length"
        proposed += sum(e.proposed for e in events)
        accepted += sum(e.accepted for e in events)
        full_steps += sum(e.proposed > 0 and e.accepted == e.proposed for e in events)
        partial_steps += sum(e.accepted < e.proposed for e in events)
    assert engine.batch_depth == 0 and engine.queue_length == 0
    if k == 0:
        assert proposed == 0
    else:
        # The draft is right often but not always: both the bonus and the rewind paths ran.
        assert full_steps > 0 and partial_steps > 0, (full_steps, partial_steps)
        assert 0 < accepted < proposed


def test_greedy_parity_plain_engine_without_draft(target_model: LlamaForCausalLM,
                                                  greedy_reference: GreedyReference) -> None:
    engine = SpeculativeEngine(target_model, None, max_slots=2, max_k=MAX_K)
    assert engine.max_k == 0
    for i, prompt in enumerate(PROMPTS):
        events = generate(engine, GenerationRequest(f"p{i}", prompt, 20, GREEDY, k=3))  # k clamps to 0
        assert output_tokens(events) == greedy_reference(prompt, 20)
        assert all(e.proposed == 0 and e.accepted == 0 and len(e.tokens) == 1 for e in events)


# -- 2 & 10. a mixed batch: joins, leaves, a queue, depth changes ------------------------------
@dataclass(frozen=True)
class Planned:
    prompt: int  # index into PROMPTS
    max_tokens: int
    k: int


MIXED = {
    "a": Planned(0, 18, 0),
    "b": Planned(1, 9, 3),
    "c": Planned(2, 40, 6),
    "d": Planned(3, 7, 1),
    "e": Planned(4, 15, 0),
    "f": Planned(5, 20, 4),
    "g": Planned(6, 5, 2),
    "h": Planned(7, 20, 10),  # clamps to MAX_K
    "i": Planned(8, 1, 5),  # a single token: never speculates
}
ARRIVALS = {0: ["a", "b", "c", "d"], 2: ["e"], 5: ["f", "g"], 9: ["h", "i"]}
# step -> {request: new K}; a -> spec, c -> plain -> spec again, f -> plain, h -> beyond max_k.
# (f's prompt is long: its first step is a prefill, which never drafts.)
K_CHANGES = {3: {"a": 4, "c": 0}, 7: {"c": 5, "e": 2}, 10: {"h": 99}, 12: {"a": 0, "f": 0}}
MIXED_SLOTS = 3


@dataclass
class MixedRun:
    events: dict[str, list[StepEvent]] = field(default_factory=lambda: defaultdict(list))
    steps: list[list[StepEvent]] = field(default_factory=list)
    max_queue: int = 0


def run_mixed(engine: SpeculativeEngine, params: SamplingParams,
              step_depth_rule: StepDepthRule | None = None) -> MixedRun:
    """Drives the MIXED scenario and checks the per-step accounting invariants as it goes."""
    run = MixedRun()
    requested_k: dict[str, int] = {}
    emitted: dict[str, int] = defaultdict(int)
    step = 0
    while step <= max(ARRIVALS) or engine.has_work:
        assert step < 500, "engine stuck"
        for rid in ARRIVALS.get(step, []):
            plan = MIXED[rid]
            seeded = SamplingParams(temperature=params.temperature, seed=1000 + ord(rid))
            engine.add(GenerationRequest(rid, PROMPTS[plan.prompt], plan.max_tokens, seeded, k=plan.k))
            requested_k[rid] = min(plan.k, MAX_K)
        for rid, k in K_CHANGES.get(step, {}).items():
            if engine.set_k(rid, k):  # running or still queued: both take the new depth
                requested_k[rid] = min(k, MAX_K)
        running_before = set(engine._running)
        expected_depth = min(MIXED_SLOTS, engine.batch_depth + engine.queue_length)
        run.max_queue = max(run.max_queue, engine.queue_length)
        events = engine.step()
        step += 1
        run.steps.append(events)
        ids = [e.request_id for e in events]
        assert len(ids) == len(set(ids)) == expected_depth
        assert running_before <= set(ids)
        for e in events:
            # 10. per-step accounting
            assert e.batch_depth == expected_depth
            k = requested_k[e.request_id]
            if step_depth_rule is not None:
                k = step_depth_rule(k, expected_depth)
            remaining = MIXED[e.request_id].max_tokens - emitted[e.request_id]
            if emitted[e.request_id] == 0 and len(PROMPTS[MIXED[e.request_id].prompt]) > MAX_K + 2:
                k = 0  # a prefill step (the prompt alone) never drafts
            assert e.proposed == max(0, min(k, MAX_K, remaining - 1)), (e, k, remaining)
            assert 0 <= e.accepted <= e.proposed
            assert len(e.tokens) <= e.accepted + 1
            if e.finish_reason is None:
                assert len(e.tokens) == e.accepted + 1  # no EOS in this vocabulary config
                assert e.request_id in engine._running
            else:
                assert e.finish_reason == "length"
                assert e.request_id not in engine._running
            emitted[e.request_id] += len(e.tokens)
            run.events[e.request_id].append(e)
        assert engine.batch_depth == expected_depth - sum(e.finish_reason is not None for e in events)
    assert set(run.events) == set(MIXED)
    for rid, plan in MIXED.items():
        assert emitted[rid] == plan.max_tokens
    return run


def depth_pattern(events: Sequence[StepEvent]) -> list[bool]:
    """Per step, whether the sequence speculated; consecutive repeats collapsed."""
    pattern: list[bool] = []
    for e in events:
        if not pattern or pattern[-1] != (e.proposed > 0):
            pattern.append(e.proposed > 0)
    return pattern


def test_greedy_parity_mixed_batch(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                                   greedy_reference: GreedyReference) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=MIXED_SLOTS, max_k=MAX_K)
    run = run_mixed(engine, GREEDY)
    for rid, plan in MIXED.items():
        assert output_tokens(run.events[rid]) == greedy_reference(PROMPTS[plan.prompt], plan.max_tokens), rid
    # The scenario really exercised what it is meant to.
    assert run.max_queue >= 2
    assert max(len(s) for s in run.steps) == MIXED_SLOTS
    assert depth_pattern(run.events["a"])[:2] == [False, True]  # plain -> spec
    assert depth_pattern(run.events["c"])[:3] == [True, False, True]  # spec -> plain -> spec
    assert depth_pattern(run.events["f"])[:3] == [False, True, False]  # prefill (28 tokens), spec, plain
    assert max(e.proposed for e in run.events["h"]) == MAX_K
    assert any(e.accepted < e.proposed for s in run.steps for e in s)
    assert any(0 < e.proposed == e.accepted for s in run.steps for e in s)


# -- 1b & 2b. the same parity in bfloat16 (the serving default) -----------------------------------
# The reference is the engine's own plain decoding in bfloat16: a float32 cache-free forward
# rounds differently, so it is the wrong yardstick for "speculation changes nothing".
@pytest.fixture(scope="module")
def bf16_plain_reference(bf16_models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> GreedyReference:
    engine = SpeculativeEngine(bf16_models[0], None, max_slots=1)
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def reference(prompt: Sequence[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in memo:
            memo[key] = output_tokens(generate(engine, GenerationRequest("ref", list(prompt), n, GREEDY, k=0)))
        return memo[key]

    return reference


@pytest.mark.usefixtures("bf16_exact")
@pytest.mark.parametrize("k", range(1, MAX_K + 1))
def test_greedy_parity_bfloat16_batch1(k: int, bf16_models: tuple[LlamaForCausalLM, LlamaForCausalLM],
                                       bf16_plain_reference: GreedyReference) -> None:
    engine = SpeculativeEngine(*bf16_models, max_slots=2, max_k=MAX_K)
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        max_tokens = 16 + i % 9
        events = generate(engine, GenerationRequest(f"p{i}", prompt, max_tokens, GREEDY, k=k))
        assert output_tokens(events) == bf16_plain_reference(prompt, max_tokens), f"prompt {i}"
        accepted += sum(e.accepted for e in events)
    assert accepted > 0


@pytest.mark.usefixtures("bf16_exact")
def test_greedy_parity_bfloat16_mixed_batch(bf16_models: tuple[LlamaForCausalLM, LlamaForCausalLM],
                                            bf16_plain_reference: GreedyReference) -> None:
    run = run_mixed(SpeculativeEngine(*bf16_models, max_slots=MIXED_SLOTS, max_k=MAX_K), GREEDY)
    for rid, plan in MIXED.items():
        assert output_tokens(run.events[rid]) == bf16_plain_reference(PROMPTS[plan.prompt], plan.max_tokens), rid


def test_step_accounting_sampled_with_depth_rule(target_model: LlamaForCausalLM,
                                                 draft_model: LlamaForCausalLM) -> None:
    def rule(k: int, depth: int) -> int:
        return k if depth < 3 else min(k, 2)

    engine = SpeculativeEngine(target_model, draft_model, max_slots=MIXED_SLOTS, max_k=MAX_K, step_depth_rule=rule)
    run = run_mixed(engine, SamplingParams(temperature=1.0), step_depth_rule=rule)  # invariants checked inside
    assert {e.batch_depth for s in run.steps for e in s} >= {2, 3}
    assert any(e.proposed == 2 and e.batch_depth == 3 and MIXED[e.request_id].k > 2
               for s in run.steps for e in s)


def test_step_cost_rule_gives_the_drafting_sequences_one_k(target_model: LlamaForCausalLM,
                                                           draft_model: LlamaForCausalLM) -> None:
    """K auto's per-step rule (the runner plugs in policies.cost.batch_step_k) sees the step's
    Ks and returns one K for every drafting sequence; plain ones and prefills stay plain, and no
    sequence drafts past what it could emit."""
    seen: list[list[int]] = []

    def common(requested: list[int]) -> int:
        seen.append(list(requested))
        return 3

    engine = SpeculativeEngine(target_model, draft_model, max_slots=3, max_k=MAX_K)
    engine.step_cost_rule = common
    engine.add(GenerationRequest("deep", PROMPTS[0], 24, GREEDY, k=6))
    engine.add(GenerationRequest("shallow", PROMPTS[1], 24, GREEDY, k=1))
    engine.add(GenerationRequest("plain", PROMPTS[2], 24, GREEDY, k=0))
    events = run_until_idle(engine)
    assert [6, 1, 0] in seen  # the step's requests, in slot order, after the prefills
    for rid in ("deep", "shallow"):
        drafted = [e.proposed for e in events[rid] if e.proposed]
        assert drafted[0] == max(drafted) == 3, (rid, drafted)  # "shallow" asked for 1: raised to the step's K
    assert all(e.proposed == 0 for e in events["plain"])
    assert output_tokens(events["deep"]) == output_tokens(generate(
        SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K),
        GenerationRequest("alone", PROMPTS[0], 24, GREEDY, k=0)))  # greedy: the same text whatever K


def test_a_step_cost_rule_without_an_answer_leaves_each_sequence_its_own_k(
        target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM) -> None:
    """The runner's rule answers None while the cost rule is off (a fixed K) or has too little
    evidence: then no sequence is raised to another's K."""
    engine = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=MAX_K)
    engine.step_cost_rule = lambda requested: None
    engine.add(GenerationRequest("deep", PROMPTS[0], 24, GREEDY, k=6))
    engine.add(GenerationRequest("shallow", PROMPTS[1], 24, GREEDY, k=1))
    events = run_until_idle(engine)
    assert max(e.proposed for e in events["deep"]) == 6
    assert {e.proposed for e in events["shallow"]} <= {0, 1} and max(e.proposed for e in events["shallow"]) == 1



def plain_for(engine: SpeculativeEngine, max_tokens: int, tokens: int) -> list[StepEvent]:
    """Greedy request "r" on PROMPTS[0], decoded plain for ``tokens`` tokens, then set to K=3."""
    engine.add(GenerationRequest("r", PROMPTS[0], max_tokens, GREEDY, k=0))
    events: list[StepEvent] = []
    while engine.has_work and sum(len(e.tokens) for e in events) < tokens:
        events += engine.step()
    engine.set_k("r", 3)
    return events


def test_a_catch_up_rule_keeps_a_lagging_sequence_plain_until_it_pays(target_model: LlamaForCausalLM,
                                                                       draft_model: LlamaForCausalLM) -> None:
    """K auto prices the draft's catch-up on tokens decoded plain (workers.costs.cost_report.catch_up_pays):
    the engine asks its rule before a sequence whose draft lags drafts, with the lag, the tokens
    left and the step's K and depth, and decodes the step plain on a no. Output is unchanged."""
    asked: list[tuple[int, int, int, int]] = []

    def rule(lag: int, remaining: int, k: int, depth: int) -> bool:
        asked.append((lag, remaining, k, depth))
        return remaining > 20

    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    engine.catch_up_rule = rule
    events = plain_for(engine, 40, 12)
    assert asked == []  # plain: nothing to price
    events += engine.step()
    # The draft has seen nothing of the prompt or the 12 tokens: it lags all of them, 28 left.
    assert asked == [(len(PROMPTS[0]) + 12, 28, 3, 1)] and events[-1].proposed == 3
    asked.clear()
    events += run_until_idle(engine)["r"]
    assert asked == []  # caught up: each step's lag is ordinary
    assert output_tokens(events) == output_tokens(generate(
        SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K),
        GenerationRequest("alone", PROMPTS[0], 40, GREEDY, k=0)))
    # A short remainder: the rule says no at every step, and the sequence ends plain.
    late = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    late.catch_up_rule = rule
    done = plain_for(late, 30, 12)
    asked.clear()
    done += run_until_idle(late)["r"]
    assert asked and all(remaining <= 20 for _, remaining, _, _ in asked)
    assert all(e.proposed == 0 for e in done)


def test_a_sequence_the_catch_up_rule_keeps_plain_is_plain_in_the_step_cost_rules_view(
        target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM) -> None:
    """The catch-up rule runs before the step's K: the per-step rule prices the mix that will
    really run. Decided after it, the step's K was chosen for two drafting sequences, one was
    then kept plain, and the other drafted alone in a step whose rows are all padded to its width."""
    seen: list[list[int]] = []

    def common(requested: list[int]) -> int:
        seen.append(list(requested))
        return 3 if all(requested) else 0  # speculation pays here only with every sequence drafting

    engine = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=MAX_K)
    engine.catch_up_rule = lambda lag, remaining, k, depth: lag <= 8  # "r"'s draft lags its prompt + 12
    plain_for(engine, 40, 12)
    engine.step_cost_rule = common
    engine.add(GenerationRequest("fresh", PROMPTS[1][:4], 20, GREEDY, k=3))  # rides along: no prefill
    events = engine.step()
    assert seen == [[0, 3]]  # "r" (slot 0) kept plain by the catch-up rule, "fresh" asking for 3
    assert [e.proposed for e in events] == [0, 0]  # so no one drafts: the step runs plain


def test_step_times_and_shape_cover_the_whole_step(target_model: LlamaForCausalLM,
                                                   draft_model: LlamaForCausalLM) -> None:
    """What the cost model's overhead term is read from: the whole step's time holds its draft and
    target phases, and the shape counts every sequence's drafts."""
    engine = SpeculativeEngine(target_model, draft_model, max_slots=3, max_k=MAX_K)
    for i, k in enumerate((3, 1, 0)):
        engine.add(GenerationRequest(f"r{i}", PROMPTS[i][:4], 20, GREEDY, k=k))
    engine.step()  # short prompts ride in the batched forward: no prefill forward
    shape = engine.last_shape
    assert (shape.target_rows, shape.prefill, shape.draft_rows, shape.draft_forwards) == (3, False, 2, 3)
    assert shape.drafts == 3 + 1
    assert engine.last_step_s >= engine.last_target_s + engine.last_draft_s > 0

# -- 3. the output distribution at T=1 ---------------------------------------------------------
DIST_PROMPT = [17, 37, 41, 45, 24]
DIST_K = 2
DIST_DRAWS = 6000
DIST_SLOTS = 1000


def first_two_tokens(target: LlamaForCausalLM, draft: LlamaForCausalLM, seed0: int,
                     seeded: bool = False) -> tuple[list[int], list[int]]:
    """DIST_DRAWS independent generations of 3 tokens, batched DIST_SLOTS at a time.

    Unseeded requests take standard speculative sampling (the engine's rng is fixed, so the
    run repeats); seeded ones (``seeded``) take the Gumbel-max sampler coupled across modes.
    """
    engine = SpeculativeEngine(target, draft, max_slots=DIST_SLOTS, max_k=MAX_K, rng=random.Random(seed0))
    firsts: list[int] = []
    seconds: list[int] = []
    first_step_accepts: set[int] = set()
    for r in range(DIST_DRAWS // DIST_SLOTS):
        for i in range(DIST_SLOTS):
            params = SamplingParams(temperature=1.0, seed=seed0 + r * DIST_SLOTS + i if seeded else None)
            engine.add(GenerationRequest(f"d{r}-{i}", DIST_PROMPT, DIST_K + 1, params, k=DIST_K))
        events = run_until_idle(engine)
        assert len(events) == DIST_SLOTS
        for evs in events.values():
            assert evs[0].proposed == DIST_K and evs[0].batch_depth == DIST_SLOTS
            first_step_accepts.add(evs[0].accepted)
            tokens = output_tokens(evs)
            firsts.append(tokens[0])
            seconds.append(tokens[1])
    assert first_step_accepts == set(range(DIST_K + 1))  # rejection, partial and full acceptance all occur
    return firsts, seconds


@pytest.fixture(scope="module")
def dist_reference(target_model: LlamaForCausalLM, far_draft_model: LlamaForCausalLM
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p(x1), the marginal p(x2) = sum_x1 p(x1) p(x2 | x1), and the draft's q(x1)."""
    with torch.inference_mode():
        prompt = torch.tensor([DIST_PROMPT])
        p1 = torch.softmax(target_model.forward_train(prompt)[0, -1].double(), -1)
        q1 = torch.softmax(far_draft_model.forward_train(prompt)[0, -1].double(), -1)
        vocab = p1.shape[0]
        extended = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        conditional = torch.softmax(target_model.forward_train(extended)[:, -1].double(), -1)
    return p1, p1 @ conditional, q1


def test_speculative_sampling_matches_target_distribution(
        target_model: LlamaForCausalLM, far_draft_model: LlamaForCausalLM, chi_square: ChiSquare,
        dist_reference: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    p1, p2, _ = dist_reference
    firsts, seconds = first_two_tokens(target_model, far_draft_model, seed0=100_000)
    assert chi_square(firsts, p1) > 1e-3
    assert chi_square(seconds, p2) > 1e-3


def test_seeded_coupled_sampling_matches_target_distribution(
        target_model: LlamaForCausalLM, far_draft_model: LlamaForCausalLM, chi_square: ChiSquare,
        dist_reference: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """D4: over many seeds, the Gumbel-max sampler's tokens (drafted, verified, replaced, bonus)
    follow the target's distribution, the first token and the marginal of the second."""
    p1, p2, _ = dist_reference
    firsts, seconds = first_two_tokens(target_model, far_draft_model, seed0=200_000, seeded=True)
    assert chi_square(firsts, p1) > 1e-3
    assert chi_square(seconds, p2) > 1e-3


def test_distribution_harness_rejects_wrong_rule(
        target_model: LlamaForCausalLM, far_draft_model: LlamaForCausalLM, chi_square: ChiSquare,
        dist_reference: tuple[torch.Tensor, torch.Tensor, torch.Tensor], wrong_verify: VerifyFn,
        monkeypatch: pytest.MonkeyPatch) -> None:
    p1, _, q1 = dist_reference
    # Power check: the wrong rule's first-token law min(p,q) + (1 - sum min(p,q)) p is far from p.
    overlap = torch.minimum(p1, q1)
    wrong_law = overlap + (1 - overlap.sum()) * p1
    noncentrality = DIST_DRAWS * float(((wrong_law - p1) ** 2 / p1).sum())
    assert noncentrality > 200, noncentrality
    monkeypatch.setattr("workers.engines.embedded.engine.verify", wrong_verify)
    firsts, _ = first_two_tokens(target_model, far_draft_model, seed0=100_000)
    assert chi_square(firsts, p1) < 1e-6


def test_drafts_are_always_verified_with_row_invariant_attention(target_model: LlamaForCausalLM,
                                                                 draft_model: LlamaForCausalLM,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a bare long prompt (a prefill) may take the fused kernel; any forward that scores
    drafts must be row-invariant, including a short prompt plus K drafts that, together, are
    longer than what rides in a batched forward."""
    target = converted(target_model, torch.bfloat16)
    seen: list[tuple[int, int, bool]] = []  # (new tokens, logits, row_invariant)
    original = target.forward_cached

    def recording(tokens: torch.Tensor, cache: KVCache, batch: CacheBatch, logit_rows: torch.Tensor | None = None,
                  logit_cols: torch.Tensor | None = None) -> torch.Tensor:
        logits = original(tokens, cache, batch, logit_rows, logit_cols)
        wanted = logits.shape[0] if logit_rows is not None else logits.shape[1]
        seen.append((tokens.shape[1], wanted, batch.row_invariant))
        return logits

    monkeypatch.setattr(target, "forward_cached", recording)
    engine = SpeculativeEngine(target, draft_model, max_slots=3, max_k=MAX_K)
    limit = MAX_K + 2  # rows up to this long ride in a batched decode forward
    short = next(p for p in PROMPTS if limit < len(p) + MAX_K and len(p) <= limit)
    long = next(p for p in PROMPTS if len(p) > limit)
    for name, prompt in (("short", short), ("long", long)):
        events = generate(engine, GenerationRequest(name, prompt, 12, GREEDY, k=MAX_K))
        assert events[0].proposed == (MAX_K if name == "short" else 0)  # a prefill never drafts
    assert any(n > limit and logits > 1 for n, logits, _ in seen)  # the short prompt + drafts case ran
    assert any(n > limit and logits == 1 for n, logits, _ in seen)  # and a prefill did
    for n, logits, row_invariant in seen:
        assert row_invariant == (logits > 1 or n <= limit), (n, logits, row_invariant)


# -- 3b. row invariance: a verification scores each token exactly as decoding it alone would -------
@pytest.mark.usefixtures("bf16_exact")
def test_verification_logits_equal_one_at_a_time_bitwise(tiny_config: ModelConfig) -> None:
    # bfloat16 (the serving default where the start-up check passes) promises bit-identical rows. float32
    # matmuls round one row differently from several, so float32 is only close (1e-6), which the
    # float32 parity tests cover. The demo models' head size (64) and long contexts: that is
    # where the fused kernel's blocking changes with the number of queries.
    dtype = torch.bfloat16
    cfg = dataclasses.replace(tiny_config, hidden_size=384, num_attention_heads=6, num_key_value_heads=2,
                              num_hidden_layers=1, max_position_embeddings=640)
    source = LlamaForCausalLM(cfg)
    source.init_weights(seed=4)
    model = converted(source, dtype)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 250, 500)]
    drafts = [torch.randint(0, cfg.vocab_size, (6,), generator=gen).tolist() for _ in prompts]
    with torch.inference_mode():
        cache = KVCache.allocate(cfg, 3, dtype)
        for slot, prompt in enumerate(prompts):
            model.forward_cached(torch.tensor([prompt]), cache,
                                 CacheBatch.build([slot], [0], [len(prompt)], len(prompt), cfg.max_position_embeddings))
        alone = []
        for slot, (prompt, new) in enumerate(zip(prompts, drafts, strict=True)):
            scratch = KVCache([k.clone() for k in cache.k], [v.clone() for v in cache.v])
            alone.append(torch.cat([model.forward_cached(
                torch.tensor([[token]]), scratch,
                CacheBatch.build([slot], [len(prompt) + i], [1], 1, cfg.max_position_embeddings))[0]
                for i, token in enumerate(new)]))
        for slot, (prompt, new) in enumerate(zip(prompts, drafts, strict=True)):  # one (K+1)-token forward
            scratch = KVCache([k.clone() for k in cache.k], [v.clone() for v in cache.v])
            batch = CacheBatch.build([slot], [len(prompt)], [len(new)], len(new), cfg.max_position_embeddings)
            assert torch.equal(model.forward_cached(torch.tensor([new]), scratch, batch)[0], alone[slot])
        # All three sequences in one batch, with different numbers of new tokens (padding).
        widths = [6, 3, 1]
        tokens = torch.zeros((3, 6), dtype=torch.long)
        for row, (new, width) in enumerate(zip(drafts, widths, strict=True)):
            tokens[row, :width] = torch.tensor(new[:width])
        batch = CacheBatch.build([0, 1, 2], [len(p) for p in prompts], widths, 6, cfg.max_position_embeddings)
        batched = model.forward_cached(tokens, cache, batch)
        for row, width in enumerate(widths):
            assert torch.equal(batched[row, :width], alone[row][:width]), row


# -- 4. KV rewind ---------------------------------------------------------------------------------
def cache_logits(model: LlamaForCausalLM, cache: KVCache, slot: int, start: int, new_tokens: list[int],
                 max_positions: int) -> torch.Tensor:
    """Last-position logits from feeding new_tokens at [start, ...) on top of a copy of the cache."""
    scratch = KVCache([k.clone() for k in cache.k], [v.clone() for v in cache.v])
    batch = CacheBatch.build([slot], [start], [len(new_tokens)], len(new_tokens), max_positions)
    return model.forward_cached(torch.tensor([new_tokens]), scratch, batch)[0, -1]


# (1.0, None): standard speculative sampling; (1.0, 5): seeded, the Gumbel-max sampler.
@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 5), (1.0, None), (1.0, 5)])
def test_kv_rewind_after_rejection(temperature: float, seed: int | None, target_model: LlamaForCausalLM,
                                   draft_model: LlamaForCausalLM) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=3, max_k=MAX_K, rng=random.Random(5))
    plans = {"x": (PROMPTS[9], 4), "y": (PROMPTS[10], 6), "z": (PROMPTS[11], 0)}  # z goes plain -> spec
    for rid, (prompt, k) in plans.items():
        engine.add(GenerationRequest(rid, prompt, 60, SamplingParams(temperature=temperature, seed=seed), k=k))
    checked_after_rejection = checked_after_full = 0
    step = 0
    with torch.inference_mode():
        while engine.has_work:
            assert step < 500, "engine stuck"
            if step == 8:
                engine.set_k("z", 5)  # the draft cache of z must catch up over 8+ tokens
                engine.set_k("y", 0)  # and y's draft cache falls behind
            if step == 16:
                engine.set_k("y", 3)
            events = {e.request_id: e for e in engine.step()}
            step += 1
            for rid, e in events.items():
                if e.finish_reason is not None:
                    continue
                seq = engine._running[rid]
                assert seq.target_len == len(seq.tokens) - 1
                # The draft cache is empty only before a sequence first drafts: z (plain until step
                # 8), or after a prefill step (a long prompt's first step never drafts).
                not_drafted_yet = (rid == "z" and step <= 8) or (step == 1 and e.proposed == 0)
                assert 0 < seq.draft_len < len(seq.tokens) or (seq.draft_len == 0 and not_drafted_yet)
                reference = target_model.forward_train(torch.tensor([seq.tokens]))[0, -1]
                from_cache = cache_logits(target_model, engine.target_cache, seq.slot, seq.target_len,
                                          seq.tokens[-1:], engine.max_positions)
                torch.testing.assert_close(from_cache, reference, atol=1e-4, rtol=1e-4)
                if seq.draft_len > 0:
                    assert engine.draft_cache is not None
                    draft_reference = draft_model.forward_train(torch.tensor([seq.tokens]))[0, -1]
                    draft_from_cache = cache_logits(draft_model, engine.draft_cache, seq.slot, seq.draft_len,
                                                    seq.tokens[seq.draft_len:], engine.max_positions)
                    torch.testing.assert_close(draft_from_cache, draft_reference, atol=1e-4, rtol=1e-4)
                if e.accepted < e.proposed:
                    checked_after_rejection += 1
                elif e.proposed > 0:
                    checked_after_full += 1
    assert checked_after_rejection >= 5 and checked_after_full >= 2, (checked_after_rejection, checked_after_full)


# -- 5. abort -------------------------------------------------------------------------------------
def test_abort_frees_slot_at_once(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                                  greedy_reference: GreedyReference) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=MAX_K)
    for rid, k in (("r0", 2), ("r1", 0), ("r2", 3)):
        engine.add(GenerationRequest(rid, PROMPTS[int(rid[1])], 30, GREEDY, k=k))
    first = engine.step()
    assert {e.request_id for e in first} == {"r0", "r1"}
    assert engine.queue_length == 1 and engine.batch_depth == 2

    assert engine.abort("nope") is False
    assert engine.abort("r0") is True
    assert engine.batch_depth == 1 and engine.queue_length == 1
    assert engine.abort("r0") is False  # already gone

    second = engine.step()
    assert {e.request_id for e in second} == {"r1", "r2"}
    assert all(e.batch_depth == 2 for e in second)
    assert engine.queue_length == 0 and engine.batch_depth == 2

    # Aborting a waiting request removes it from the queue; it never runs.
    engine.add(GenerationRequest("r3", PROMPTS[3], 30, GREEDY, k=1))
    assert engine.queue_length == 1
    assert engine.abort("r3") is True
    assert engine.queue_length == 0
    rest = run_until_idle(engine)
    assert set(rest) == {"r1", "r2"}
    # The survivors (r2 reused r0's slot mid-flight) are unaffected by the abort.
    r1 = output_tokens([e for e in first + second if e.request_id == "r1"] + rest["r1"])
    r2 = output_tokens([e for e in second if e.request_id == "r2"] + rest["r2"])
    assert r1 == greedy_reference(PROMPTS[1], 30)
    assert r2 == greedy_reference(PROMPTS[2], 30)


# -- 6. max_tokens -------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 3, MAX_K])
@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_max_tokens_stops_exactly(k: int, max_tokens: int, target_model: LlamaForCausalLM,
                                  draft_model: LlamaForCausalLM) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    events = generate(engine, GenerationRequest("m", PROMPTS[12], max_tokens, SamplingParams(seed=3), k=k))
    assert len(output_tokens(events)) == max_tokens
    assert events[-1].finish_reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    assert all(e.tokens for e in events)
    assert engine.batch_depth == 0 and not engine.has_work


# -- 7. EOS --------------------------------------------------------------------------------------
EOS_PROMPT = PROMPTS[13]
EOS_HORIZON = 30


@pytest.fixture(scope="module")
def eos_choice(greedy_reference: GreedyReference) -> tuple[int, int]:
    """(token, j): the greedy token whose first occurrence is latest, at index j > 0."""
    reference = greedy_reference(EOS_PROMPT, EOS_HORIZON)
    first_index: dict[int, int] = {}
    for j, t in enumerate(reference):
        first_index.setdefault(t, j)
    token, j = max(first_index.items(), key=lambda item: item[1])
    assert j >= 3, reference
    return token, j


@pytest.mark.parametrize("how", ["engine_attr", "model_config"])
@pytest.mark.parametrize("k", [0, 2, 4])
def test_eos_stops_exactly(how: str, k: int, target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                           eos_target_factory: Callable[[list[int]], LlamaForCausalLM],
                           greedy_reference: GreedyReference, eos_choice: tuple[int, int]) -> None:
    token, j = eos_choice
    if how == "engine_attr":
        engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
        engine.eos_ids = frozenset({token})
    else:
        engine = SpeculativeEngine(eos_target_factory([token]), draft_model, max_slots=1, max_k=MAX_K)
        assert engine.eos_ids == frozenset({token})
    events = generate(engine, GenerationRequest("s", EOS_PROMPT, EOS_HORIZON, GREEDY, k=k))
    out = output_tokens(events)
    assert out == greedy_reference(EOS_PROMPT, EOS_HORIZON)[:j]
    assert token not in out
    assert events[-1].finish_reason == "stop"
    assert all(e.finish_reason is None for e in events[:-1])
    assert not engine.has_work


def test_eos_as_first_token_emits_nothing(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                                          greedy_reference: GreedyReference) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    engine.eos_ids = frozenset({greedy_reference(EOS_PROMPT, 1)[0]})
    events = generate(engine, GenerationRequest("s0", EOS_PROMPT, 10, GREEDY, k=3))
    assert [(e.tokens, e.finish_reason) for e in events] == [([], "stop")]


@pytest.mark.parametrize("k", [0, 2, 4])
def test_ignore_eos_generates_to_max_tokens(k: int, target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                                            greedy_reference: GreedyReference, eos_choice: tuple[int, int]) -> None:
    """vLLM's ignore_eos: the EOS token is generated like any other and the length decides."""
    token, j = eos_choice
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    engine.eos_ids = frozenset({token})
    params = dataclasses.replace(GREEDY, ignore_eos=True)
    events = generate(engine, GenerationRequest("s", EOS_PROMPT, EOS_HORIZON, params, k=k))
    out = output_tokens(events)
    assert out == greedy_reference(EOS_PROMPT, EOS_HORIZON) and out[j] == token
    assert events[-1].finish_reason == "length" and not any(e.eos for e in events)


def masked_greedy(model: LlamaForCausalLM, prompt: Sequence[int], n: int, banned: int, until: int) -> list[int]:
    """Greedy decoding with ``banned`` impossible at output positions below ``until``."""
    tokens = list(prompt)
    for position in range(n):
        logits = model.forward_train(torch.tensor([tokens]))[0, -1]
        if position < until:
            logits[banned] = float("-inf")
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("k", [0, 3])
def test_min_tokens_masks_eos_until_reached(k: int, target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                                            eos_choice: tuple[int, int]) -> None:
    """vLLM's min_tokens: EOS is out of the target's distribution until that many tokens are out;
    after them EOS ends the generation as usual. Speculative or not, the same tokens."""
    token, j = eos_choice
    minimum = j + 2
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    engine.eos_ids = frozenset({token})
    params = dataclasses.replace(GREEDY, min_tokens=minimum)
    events = generate(engine, GenerationRequest("s", EOS_PROMPT, EOS_HORIZON, params, k=k))
    out = output_tokens(events)
    expected = masked_greedy(target_model, EOS_PROMPT, EOS_HORIZON, token, minimum)
    stop = expected.index(token) if token in expected[minimum:] else None
    assert len(out) >= minimum and token not in out[:minimum]
    assert out == (expected[:stop] if stop is not None else expected)
    assert all(e.proposed == 0 for e in events if sum(len(x.tokens) for x in events[:events.index(e)]) < minimum)


# -- 8. seeded reproducibility ---------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 3])
def test_seed_reproducibility(k: int, target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=MAX_K)

    def run(rid: str, seed: int) -> list[int]:
        params = SamplingParams(temperature=0.9, seed=seed)
        return output_tokens(generate(engine, GenerationRequest(rid, PROMPTS[14], 30, params, k=k)))

    first, again = run("a", 11), run("b", 11)
    assert first == again
    others = [run(f"o{s}", s) for s in (12, 13, 14)]
    assert all(o != first for o in others)
    # Unseeded requests draw fresh seeds.
    unseeded = [output_tokens(generate(engine, GenerationRequest(f"u{i}", PROMPTS[14], 30,
                                                                SamplingParams(temperature=0.9), k=k)))
                for i in range(2)]
    assert unseeded[0] != unseeded[1]


# -- 9. validation -------------------------------------------------------------------------------
@pytest.mark.parametrize(("prompt_len", "max_tokens"), [
    (0, 5),  # empty prompt
    (5, 0),  # max_tokens < 1
    (5, -3),
    (100, 93),  # 100 + 93 > 192 positions (no room is held back for drafts: issue 52)
    (192, 1),
])
def test_add_rejects_invalid(prompt_len: int, max_tokens: int, target_model: LlamaForCausalLM,
                             draft_model: LlamaForCausalLM) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    with pytest.raises(ValueError):
        engine.add(GenerationRequest("v", [1] * prompt_len, max_tokens, GREEDY, k=2))
    assert engine.queue_length == 0 and not engine.has_work


def test_add_rejects_duplicate_id(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    engine.add(GenerationRequest("dup", [1, 2], 3, GREEDY))
    engine.add(GenerationRequest("other", [1, 2], 3, GREEDY))
    engine.step()  # "dup" running, "other" waiting
    for rid in ("dup", "other"):
        with pytest.raises(ValueError):
            engine.add(GenerationRequest(rid, [1, 2], 3, GREEDY))


def test_request_at_context_limit_runs(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                                       greedy_reference: GreedyReference) -> None:
    prompt = random_prompts(1, seed=99, min_len=100, max_len=100)[0]
    max_tokens = target_model.cfg.max_position_embeddings - MAX_K - len(prompt)  # exactly fits
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    events = generate(engine, GenerationRequest("edge", prompt, max_tokens, GREEDY, k=MAX_K))
    assert output_tokens(events) == greedy_reference(prompt, max_tokens)


def test_engine_generate_convenience(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM,
                                     greedy_reference: GreedyReference) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=MAX_K)
    events = engine.generate(GenerationRequest("g", PROMPTS[15], 12, GREEDY, k=2))
    assert {e.request_id for e in events} == {"g"}
    assert output_tokens(events) == greedy_reference(PROMPTS[15], 12)


def test_set_k_reaches_queued_requests(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=4)
    engine.add(GenerationRequest("running", [1, 2, 3], 4, SamplingParams(temperature=0.0), k=0))
    engine.add(GenerationRequest("queued", [4, 5, 6], 6, SamplingParams(temperature=0.0), k=0))
    engine.step()
    assert engine.queue_length == 1
    assert engine.set_k("queued", 3) and not engine.set_k("unknown", 3)
    proposed: list[int] = []
    for _ in range(50):
        if not engine.has_work:
            break
        proposed += [e.proposed for e in engine.step() if e.request_id == "queued"]
    assert proposed and proposed[0] > 0  # admitted speculating, as set while it waited
