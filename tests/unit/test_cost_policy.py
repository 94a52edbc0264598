"""K from measured costs (policies/cost.py) and the ``auto`` rules of ``decide``: pure data only.

The curves are the two CPUs' measured shapes from issue #9: an AMX CPU whose bfloat16 target
verifies 9 tokens for 1.10× one token, and a 2-core AVX512-BF16 CPU where the same costs 2.36×.
"""

import random
from dataclasses import replace
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies import (
    CostModel,
    Decision,
    PolicyConfig,
    RequestFacts,
    SessionState,
    WorkerState,
    acceptance_for_k,
    choose_k,
    decide,
    expected_tokens,
    gain,
    mixed_step_cost,
    objective,
    record_decision,
    step_cost,
    step_k,
    whole_step_costs,
)
from tests.policy_data import COOL, PROPERTY, state
from tests.unit.cost_curves import AMX_VERIFY, curve

AVX512_VERIFY = (1.0, 1.23, 1.38, 1.52, 1.67, 1.82, 1.98, 2.16, 2.36)




# Depth 1 as measured; at depth 16 the target is compute-bound: verifying n tokens costs ~n.
AMX = CostModel((1, 16), (curve(AMX_VERIFY, 0.2), curve(tuple(float(n) for n in range(1, 10)), 0.2)))
AVX512 = CostModel((1,), (curve(AVX512_VERIFY, 0.3),))
AUTO = PolicyConfig(num_speculative_tokens="auto")
IDLE_AMX = WorkerState(batch_depth=0, batch_full=False, max_k=8, cost=AMX)


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 6) == 1.0
    assert expected_tokens(1.0, 6) == 7.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.9, 3) == pytest.approx(1 + 0.9 + 0.81 + 0.729)


def test_step_cost_interpolates_between_depths_and_holds_outside() -> None:
    assert step_cost(AMX, 1, 0) == 1.0
    assert step_cost(AMX, 16, 4) == pytest.approx(5 + 0.8)
    assert step_cost(AMX, 0, 4) == step_cost(AMX, 1, 4)
    assert step_cost(AMX, 100, 4) == step_cost(AMX, 16, 4)
    mid = step_cost(AMX, 8, 4)  # 7/15 of the way from depth 1 to 16
    assert mid == pytest.approx(AMX.step_cost[0][4] + 7 / 15 * (AMX.step_cost[1][4] - AMX.step_cost[0][4]))


@pytest.mark.parametrize(("model", "alpha", "depth", "expected"), [
    (AMX, 0.9, 1, 6),  # cheap verification, high acceptance: deep K
    (AMX, 0.86, 1, 5),
    (AMX, 0.7, 1, 3),
    (AMX, 0.5, 1, 2),
    (AVX512, 0.9, 1, 4),  # costlier verification on that CPU: shallower
    (AVX512, 0.86, 1, 3),  # (issue #9: best K measured there was 3)
    (AVX512, 0.5, 1, 0),  # alpha 0.5, c 0.3: no K beats plain by min_gain
    (AMX, 0.9, 4, 4),  # deeper batches: smaller K...
    (AMX, 0.9, 8, 2),
    (AMX, 0.9, 16, 0),  # ...and plain once verification is compute-bound
])
def test_choose_k_table(model: CostModel, alpha: float, depth: int, expected: int) -> None:
    assert choose_k(model, alpha, depth, 8, AUTO.min_gain, AUTO.k_switch_gain) == expected


def test_choose_k_respects_the_workers_max_k() -> None:
    assert choose_k(AMX, 0.9, 1, 3, 0.05, 0.05) == 3
    assert choose_k(AMX, 0.999, 1, 8, 0.05, 0.05) == 8
    assert choose_k(AMX, 0.9, 1, 0, 0.05, 0.05) == 0


def test_min_gain_is_the_margin_over_plain() -> None:
    # At alpha 0.5 on the AMX curve K=2 promises 1.75 / 1.41 = 1.24x plain.
    assert gain(AMX, 0.5, 2, 1) == pytest.approx(1.75 / 1.41)
    assert choose_k(AMX, 0.5, 1, 8, 0.20, 0.0) == 2
    assert choose_k(AMX, 0.5, 1, 8, 0.30, 0.0) == 0


alphas = st.floats(0.0, 1.0)
depths = st.integers(1, 64)


@st.composite
def cost_models(draw: st.DrawFn) -> CostModel:
    grid = sorted(draw(st.sets(st.integers(1, 64), min_size=1, max_size=4)))
    max_k = draw(st.integers(1, 10))
    rows = []
    for _ in grid:
        steps = draw(st.lists(st.floats(0.0, 2.0), min_size=max_k, max_size=max_k))
        row = [1.0]
        for s in steps:  # costs grow with K
            row.append(row[-1] + s + 0.01)
        rows.append(tuple(row))
    return CostModel(tuple(grid), tuple(rows))


@PROPERTY
@given(model=cost_models(), alpha=alphas, depth=depths, max_k=st.integers(0, 12),
       min_gain=st.floats(0.0, 0.5))
def test_chosen_k_maximizes_the_objective(model: CostModel, alpha: float, depth: int, max_k: int,
                                          min_gain: float) -> None:
    k = choose_k(model, alpha, depth, max_k, min_gain, 0.05)
    ks = range(min(max_k, model.max_k) + 1)
    assert k in ks
    assert all(objective(model, alpha, k, depth, min_gain) >= objective(model, alpha, j, depth, min_gain) for j in ks)


@st.composite
def step_parts(draw: st.DrawFn) -> tuple[list[float], float, float, float]:
    """One depth's parts in ms: target forwards of n = 1.. tokens (growing), a draft forward,
    the step's work outside the forwards and what each draft adds to it."""
    target = [draw(st.floats(1.0, 100.0))]
    for _ in range(draw(st.integers(1, 9))):
        target.append(target[-1] + draw(st.floats(0.0, 50.0)))
    return (target, draw(st.floats(0.0, 50.0)), draw(st.floats(0.0, 50.0)), draw(st.floats(0.0, 5.0)))


@PROPERTY
@given(parts=step_parts(), alpha=alphas, min_gain=st.floats(0.0, 0.5))
def test_chosen_k_maximizes_tokens_per_second_including_the_overhead(
        parts: tuple[list[float], float, float, float], alpha: float, min_gain: float) -> None:
    """Tokens per second from the parts themselves, written out independently of the model: the
    K chosen is the best one, the step's work outside the forwards counted in every step."""
    target, draft, overhead, draft_overhead = parts
    model = CostModel((1,), (whole_step_costs(target, draft, overhead, draft_overhead),))
    k = choose_k(model, alpha, 1, 16, min_gain, 0.0)

    def tokens_per_ms(j: int) -> float:
        step_ms = target[j] + j * (draft + draft_overhead) + overhead
        return expected_tokens(alpha, j) / step_ms * (1.0 + min_gain if j == 0 else 1.0)

    best = max(tokens_per_ms(j) for j in range(len(target)))
    assert tokens_per_ms(k) == pytest.approx(best, rel=1e-9)


def test_overhead_outside_the_forwards_can_make_speculation_pay() -> None:
    """The AVX512 CPU's curve at alpha 0.5: on forwards alone no K beats plain by min_gain; when a
    plain step also spends half its forward's time on sampling and bookkeeping, K=1 does."""
    forwards = [10.0 * v for v in AVX512_VERIFY]
    bare = CostModel((1,), (whole_step_costs(forwards, 3.0),))
    busy = CostModel((1,), (whole_step_costs(forwards, 3.0, overhead_s=5.0),))
    assert bare.step_cost[0] == pytest.approx(curve(AVX512_VERIFY, 0.3))
    assert choose_k(bare, 0.5, 1, 8, AUTO.min_gain, 0.0) == 0
    assert choose_k(busy, 0.5, 1, 8, AUTO.min_gain, 0.0) == 1
    assert gain(busy, 0.5, 1, 1) == pytest.approx(1.5 * 15.0 / (12.3 + 3.0 + 5.0))
    # Work per draft outside the forwards counts against speculation.
    drafty = CostModel((1,), (whole_step_costs(forwards, 3.0, overhead_s=5.0, draft_overhead_s=2.0),))
    assert choose_k(drafty, 0.5, 1, 8, AUTO.min_gain, 0.0) == 0


@PROPERTY
@given(model=cost_models(), alpha=alphas, depth=depths, current=st.integers(0, 10), switch=st.floats(0.0, 0.3))
def test_hysteresis_keeps_a_k_within_the_margin_of_the_best(model: CostModel, alpha: float, depth: int, current: int,
                                                            switch: float) -> None:
    k = choose_k(model, alpha, depth, 8, 0.05, switch, current)
    ks = range(min(8, model.max_k) + 1)
    best = max(objective(model, alpha, j, depth, 0.05) for j in ks)
    assert objective(model, alpha, k, depth, 0.05) * (1 + switch) >= best
    if k != current:  # it moved only to the best, and only because current was out of the margin
        assert objective(model, alpha, k, depth, 0.05) == best


def test_no_k_flapping_on_a_noisy_acceptance_sequence() -> None:
    rng = random.Random(5)
    session = SessionState()
    ks = []
    for _ in range(300):
        # A session near alpha 0.8 whose estimate wobbles by +-0.04 from request to request.
        session = replace(session, acceptance_estimate=0.8 + rng.uniform(-0.04, 0.04), acceptance_weight=1000,
                          proposals_seen=1000)
        decision = decide(session, IDLE_AMX, COOL, AUTO)
        session = record_decision(session, decision, auto_k=True)
        ks.append(decision.k)
    changes = sum(a != b for a, b in pairwise(ks))
    assert changes <= 1, ks
    # Without the margin the same sequence moves K back and forth.
    flappy = [choose_k(AMX, 0.8 + rng.uniform(-0.04, 0.04), 1, 8, 0.05, 0.0) for _ in range(300)]
    assert sum(a != b for a, b in pairwise(flappy)) > 10


M = AUTO.acceptance_prior_drafts  # the prior's weight: 16 tested drafts


@pytest.mark.parametrize(("session", "worker", "expected"), [
    (SessionState(), IDLE_AMX, 0.70),  # no evidence anywhere: acceptance_resume
    (SessionState(), replace(IDLE_AMX, acceptance=0.9), 0.9),  # a new session: the worker's
    # the session's own evidence and the prior, each by its weight
    (state(0.3, 10), replace(IDLE_AMX, acceptance=0.9), (0.3 * 10 + 0.9 * M) / (10 + M)),
    (state(0.3, 10), IDLE_AMX, (0.3 * 10 + 0.7 * M) / (10 + M)),
    (state(0.6, 32), replace(IDLE_AMX, acceptance=0.9), (0.6 * 32 + 0.9 * M) / (32 + M)),
    (state(0.6, 92), replace(IDLE_AMX, acceptance=0.9), (0.6 * 92 + 0.9 * M) / (92 + M)),  # a full weight
])
def test_acceptance_for_k(session: SessionState, worker: WorkerState, expected: float) -> None:
    assert acceptance_for_k(session, worker, AUTO) == pytest.approx(expected)


@pytest.mark.parametrize(("session", "worker", "facts", "expected"), [
    # (the worker's estimate agrees: the priced α is 0.9, not shrunk towards acceptance_resume)
    (state(0.9, 100), replace(IDLE_AMX, acceptance=0.9), COOL, Decision("speculative", 6, "default")),
    (state(0.5, 100), replace(IDLE_AMX, cost=AVX512), COOL, Decision("plain", 0, "no_gain")),
    (state(0.9, 100), replace(IDLE_AMX, batch_depth=15), COOL, Decision("plain", 0, "no_gain")),
    # The configured rules still win over the cost model.
    (state(0.9, 100), IDLE_AMX, RequestFacts(1.0), Decision("plain", 0, "high_temperature")),
    (state(0.9, 100), replace(IDLE_AMX, batch_full=True), COOL, Decision("plain", 0, "batch_full")),
    (state(0.2, 100, True), IDLE_AMX, COOL, Decision("plain", 0, "low_acceptance")),
    (state(0.2, 100, True, 7), IDLE_AMX, COOL, Decision("speculative", 1, "probe")),  # the best K at 0.2
    # A worker that publishes no cost model speculates with its own max K.
    (state(0.9, 100), replace(IDLE_AMX, cost=None, max_k=5), COOL, Decision("speculative", 5, "default")),
])
def test_decide_auto(session: SessionState, worker: WorkerState, facts: RequestFacts, expected: Decision) -> None:
    assert decide(session, worker, facts, AUTO) == expected


def test_no_gain_sessions_are_probed_and_a_fixed_k_is_unchanged() -> None:
    session, worker = state(0.5, 100), replace(IDLE_AMX, cost=AVX512)
    reasons = []
    for _ in range(16):
        decision = decide(session, worker, COOL, AUTO)
        session = record_decision(session, decision, auto_k=True)
        reasons.append(decision.reason)
    assert reasons == (["no_gain"] * 7 + ["probe"]) * 2
    # A fixed integer K keeps today's behaviour: the cost model is not consulted.
    fixed = PolicyConfig(num_speculative_tokens=6)
    assert decide(state(0.5, 100), worker, COOL, fixed) == Decision("speculative", 6, "default")


@pytest.mark.parametrize(("alpha", "depth", "requested", "expected"), [
    (0.9, 1, 6, 6),  # wins at this depth: as requested (never deeper)
    (0.9, 1, 20, 6),  # the best K, however deep the request
    (0.9, 16, 6, 0),  # loses at this depth: the step runs plain
    (0.9, 8, 6, 2),  # a smaller K pays more here
    (0.9, 1, 0, 0),
])
def test_step_k(alpha: float, depth: int, requested: int, expected: int) -> None:
    assert step_k(AMX, alpha, depth, requested) == expected


@pytest.mark.parametrize("raw", [
    {"depths": [], "step_cost": []},
    {"depths": [2, 1], "step_cost": [[1.0, 1.2], [1.0, 1.3]]},
    {"depths": [1, 4], "step_cost": [[1.0, 1.2], [1.0]]},
    {"depths": [1], "step_cost": [[1.0, float("nan")]]},
    {"depths": [0], "step_cost": [[1.0, 1.2]]},
    {"step_cost": [[1.0]]},
])
def test_cost_model_refuses_malformed_curves(raw: dict[str, object]) -> None:
    with pytest.raises((ValueError, KeyError)):
        CostModel.from_json(raw)


@pytest.mark.parametrize(("raw", "problem"), [
    ({"num_speculative_tokens": "six"}, "policy.num_speculative_tokens: must be an integer"),
    ({"num_speculative_tokens": 17}, "policy.num_speculative_tokens: must be in 1..16 or auto"),
    ({"num_speculative_tokens": "auto", "min_gain": -0.1}, "policy.min_gain: must be between 0 and 1"),
    ({"k_switch_gain": 2}, "policy.k_switch_gain: must be between 0 and 1"),
])
def test_auto_policy_fields_are_validated(raw: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        PolicyConfig.from_mapping(raw)
    assert PolicyConfig.from_mapping({"num_speculative_tokens": "auto"}).auto_k


def test_a_steps_first_draft_forward_is_priced_apart_from_the_later_ones() -> None:
    """The engine on the AVX2 EPYC at batch 1: the first draft forward 0.85 ms (the draft's
    weights read back after the target's forward, and the catch-up), each later one 0.22 ms,
    plain 4.1 ms. Priced at one average per forward, K = 2 and K = 8 cost what they do only
    where the average was taken; priced apart, every K costs what the engine's steps cost."""
    target = [4.1 * v for v in (1.0, 1.02, 1.05, 1.12, 1.16, 1.47, 1.62, 1.77, 1.84)]
    split = whole_step_costs(target, 0.22, draft_first_s=0.85)
    for k in range(1, 9):
        assert split[k] == pytest.approx((target[k] + 0.85 + (k - 1) * 0.22) / target[0])
    assert whole_step_costs(target, 0.22)[3] == pytest.approx((target[3] + 3 * 0.22) / target[0])  # alike
    # An average taken at K = 4 ((0.85 + 3 x 0.22) / 4 = 0.3775 a forward) prices K = 8 dear
    # and K = 1 cheap; the split prices both as the steps cost.
    average = whole_step_costs(target, (0.85 + 3 * 0.22) / 4)
    assert average[4] == pytest.approx(split[4])
    assert average[8] > split[8] and average[1] < split[1]
    model = CostModel((1,), (split,))
    k = choose_k(model, 0.95, 1, 8, 0.0, 0.0)
    assert all(gain(model, 0.95, k, 1) >= gain(model, 0.95, j, 1) for j in range(9))
    assert choose_k(CostModel((1,), (average,)), 0.95, 1, 8, 0.0, 0.0) <= k


def test_the_first_draft_forward_in_mixed_pricing_and_the_json() -> None:
    """With its parts, a step of F draft forwards pays the first one once and F - 1 later ones;
    the worker's JSON carries ``draft_first_cost`` (optional: absent, as the later ones)."""
    raw = {"depths": [1, 4], "step_cost": [[1.0, 1.4, 1.5], [1.0, 1.7, 2.2]], "plain_step_ms": [4.0, 6.0],
           "verify_cost": [[1.0, 1.05, 1.1], [1.0, 1.4, 1.8]], "draft_cost": [0.05, 0.1],
           "step_overhead_ms": [0.0, 0.0], "draft_overhead_ms": [0.0, 0.0]}
    alike = CostModel.from_json(raw)
    split = CostModel.from_json({**raw, "draft_first_cost": [0.25, 0.3]})
    assert alike.parts is not None and alike.parts.draft_first is None
    assert split.parts is not None and split.parts.draft_first == (0.25, 0.3)
    # Depth 4, all drafting K = 2: target 1.8 x 6 ms, drafts (0.3 + 0.1) x 6 ms, over a 6 ms plain step.
    assert mixed_step_cost(split, 4, 4, 8, 2) == pytest.approx(1.8 + 0.3 + 0.1)
    assert mixed_step_cost(alike, 4, 4, 8, 2) == pytest.approx(1.8 + 2 * 0.1)
    with pytest.raises(ValueError, match="draft"):
        CostModel.from_json({**raw, "draft_first_cost": [0.25, -1.0]})
    with pytest.raises(ValueError, match="one value of each part per depth"):
        CostModel.from_json({**raw, "draft_first_cost": [0.25]})
