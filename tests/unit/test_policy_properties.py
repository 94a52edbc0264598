"""Hypothesis properties of the fallback policy: no speculation when hot, no flapping, sane K."""

from __future__ import annotations

from dataclasses import replace
from random import Random

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from policies import (
    REASONS,
    PolicyConfig,
    RequestFacts,
    SessionState,
    StepDepth,
    WorkerState,
    batch_latch,
    decide,
    observe,
    observe_steps,
    step_depth,
)
from policies import tested_drafts as drafts_tested  # aliased: pytest would collect a name starting with 'test'
from tests.policy_data import PROPERTY, above, rules_only, serve, state, transitions

# --------------------------------------------------------------------------------------------
# Properties


@st.composite
def policies(draw: st.DrawFn) -> PolicyConfig:
    floor = draw(st.floats(0.0, 1.0))
    resume = draw(st.floats(floor, 1.0))
    max_batch = draw(st.integers(1, 200))
    return rules_only(
        acceptance_floor=floor,
        acceptance_resume=resume,
        min_proposals=draw(st.integers(0, 200)),
        acceptance_half_life=draw(st.floats(0.25, 500.0)),
        max_batch=max_batch,
        batch_resume=draw(st.integers(1, max_batch)),
        max_temperature=draw(st.floats(0.0, 4.0)),
        probe_every=draw(st.integers(1, 20)),
        num_speculative_tokens=draw(st.integers(1, 16)),
    )


sessions = st.builds(
    SessionState,
    acceptance_estimate=st.none() | st.floats(0.0, 1.0),
    proposals_seen=st.integers(0, 10_000),
    low_acceptance=st.booleans(),
    plain_since_probe=st.integers(0, 100),
)
workers = st.builds(
    WorkerState,
    batch_depth=st.integers(0, 1000),
    batch_full=st.booleans(),
    max_k=st.integers(-2, 32),
    serves_speculative=st.booleans(),
)
steps = st.tuples(st.integers(-2, 20), st.integers(-5, 25))


@PROPERTY
@given(session=sessions, worker=workers, policy=policies(), excess=st.floats(0.0, 100.0), nudge=st.booleans())
def test_never_speculative_above_max_temperature(session: SessionState, worker: WorkerState, policy: PolicyConfig,
                                                 excess: float, nudge: bool) -> None:
    temperature = above(policy.max_temperature) if nudge else policy.max_temperature + excess
    if temperature <= policy.max_temperature:  # excess too small to change the float
        temperature = above(policy.max_temperature)
    decision = decide(session, worker, RequestFacts(temperature), policy)
    assert decision.mode == "plain"
    assert decision.k == 0
    assert decision.reason in ("worker_plain_only", "high_temperature")


@PROPERTY
@given(session=sessions, worker=workers, policy=policies(), temperature=st.floats(0.0, 5.0))
def test_k_is_zero_exactly_when_plain(session: SessionState, worker: WorkerState, policy: PolicyConfig,
                                      temperature: float) -> None:
    decision = decide(session, worker, RequestFacts(temperature), policy)
    assert decision.reason in REASONS
    assert (decision.k == 0) == (decision.mode == "plain")
    if decision.mode == "speculative":
        assert isinstance(policy.num_speculative_tokens, int)  # these policies fix K (auto: test_cost.py)
        assert 1 <= decision.k <= min(policy.num_speculative_tokens, worker.max_k)
        assert decision.reason in ("default", "probe")
    else:
        assert decision.reason not in ("default", "probe")
    assert decision.header.startswith(decision.mode)


@st.composite
def banded_depths(draw: st.DrawFn) -> tuple[PolicyConfig, list[int]]:
    max_batch = draw(st.integers(1, 200))
    batch_resume = draw(st.integers(1, max_batch))
    depths = draw(st.lists(st.integers(batch_resume, max_batch), max_size=100))
    return rules_only(max_batch=max_batch, batch_resume=batch_resume), depths


@PROPERTY
@given(case=banded_depths(), initial=st.booleans())
def test_no_flapping_inside_the_batch_band(case: tuple[PolicyConfig, list[int]], initial: bool) -> None:
    policy, depths = case
    latch, history = initial, [initial]
    step_latch = initial
    for depth in depths:
        latch = batch_latch(latch, depth, policy)
        history.append(latch)
        result = step_depth(4, depth, step_latch, policy.max_batch, policy.batch_resume)
        step_latch = result.batch_full
        assert result == StepDepth(0 if initial else 4, initial)
    assert transitions(history) == 0


@PROPERTY
@given(policy=policies(), initial=st.booleans(), depths=st.lists(st.integers(0, 250), max_size=100))
def test_batch_latch_moves_only_outside_the_band(policy: PolicyConfig, initial: bool, depths: list[int]) -> None:
    latch = initial
    for depth in depths:
        after = batch_latch(latch, depth, policy)
        assert step_depth(3, depth, latch, policy.max_batch, policy.batch_resume) == StepDepth(0 if after else 3, after)
        if after and not latch:
            assert depth > policy.max_batch
        if latch and not after:
            assert depth < policy.batch_resume
        # and outside the band the latch always follows the depth
        if depth > policy.max_batch:
            assert after
        if depth < policy.batch_resume:
            assert not after
        latch = after


@st.composite
def banded_sessions(draw: st.DrawFn) -> tuple[PolicyConfig, SessionState]:
    policy = draw(policies().filter(lambda p: p.acceptance_floor < p.acceptance_resume))
    ewma = draw(st.floats(policy.acceptance_floor, policy.acceptance_resume, exclude_max=True))
    session = SessionState(ewma, draw(st.integers(0, 1000)), draw(st.booleans()), draw(st.integers(0, 30)))
    return policy, session


@PROPERTY
@given(case=banded_sessions(), signal=st.lists(steps, max_size=60))
def test_no_flapping_inside_the_acceptance_band(case: tuple[PolicyConfig, SessionState],
                                                signal: list[tuple[int, int]]) -> None:
    """Steps that would carry the estimate out of [floor, resume) are left out of the signal."""
    policy, session = case
    history = [session.low_acceptance]
    used = 0
    for proposed, accepted in signal:
        nxt = observe(session, proposed, accepted, policy)
        assert nxt.acceptance_estimate is not None
        if not policy.acceptance_floor <= nxt.acceptance_estimate < policy.acceptance_resume:
            continue
        session = nxt
        used += 1
        history.append(session.low_acceptance)
    note(f"{used} of {len(signal)} steps kept the estimate in the band")
    assert transitions(history) == 0


@PROPERTY
@given(policy=policies(), session=sessions, signal=st.lists(steps, max_size=80))
def test_acceptance_latch_moves_only_outside_the_band(policy: PolicyConfig, session: SessionState,
                                                      signal: list[tuple[int, int]]) -> None:
    for proposed, accepted in signal:
        after = observe(session, proposed, accepted, policy)
        if after.low_acceptance and not session.low_acceptance:
            assert after.acceptance_estimate is not None and after.acceptance_estimate < policy.acceptance_floor
            assert after.proposals_seen >= policy.min_proposals
        if session.low_acceptance and not after.low_acceptance:
            assert after.acceptance_estimate is not None and after.acceptance_estimate >= policy.acceptance_resume
        if proposed > 0 and not after.low_acceptance:
            assert after.plain_since_probe == 0
        session = after


@PROPERTY
@given(policy=policies(), session=sessions, signal=st.lists(steps, max_size=80))
def test_estimate_stays_in_unit_interval(policy: PolicyConfig, session: SessionState,
                                         signal: list[tuple[int, int]]) -> None:
    seen = session.proposals_seen
    for proposed, accepted in signal:
        session = observe(session, proposed, accepted, policy)
        assert session.acceptance_estimate is None or 0.0 <= session.acceptance_estimate <= 1.0
        assert session.proposals_seen >= seen  # evidence never shrinks
        seen = session.proposals_seen


@PROPERTY
@given(policy=policies(), session=sessions, worker=workers, temperature=st.floats(0.0, 5.0),
       signal=st.lists(steps, max_size=20))
def test_serving_never_breaks_the_state(policy: PolicyConfig, session: SessionState, worker: WorkerState,
                                        temperature: float, signal: list[tuple[int, int]]) -> None:
    """decide -> record_decision -> observe, repeated: the probe count never exceeds its period."""
    session = replace(session, plain_since_probe=0)
    for proposed, accepted in signal:
        decision, session = serve(session, worker, RequestFacts(temperature), policy)
        assert session.plain_since_probe < policy.probe_every
        if decision.mode == "speculative":
            session = observe(session, min(proposed, decision.k), accepted, policy)
        if not session.low_acceptance:
            assert session.plain_since_probe == 0


# -- acceptance reported late, in blocks (vLLM) --------------------------------------------------------
_groups = st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8), st.integers(1, 20)), max_size=8)


@given(_groups, st.randoms(use_true_random=False))
def test_observe_steps_ignores_the_order_of_a_block(groups: list[tuple[int, int, int]], rng: Random) -> None:
    shuffled = list(groups)
    rng.shuffle(shuffled)
    start = state(0.8, 100, False, 0)
    assert observe_steps(start, groups, PolicyConfig()) == observe_steps(start, shuffled, PolicyConfig())


@given(_groups)
def test_observe_steps_counts_every_tested_draft(groups: list[tuple[int, int, int]]) -> None:
    state = observe_steps(SessionState(), groups, PolicyConfig())
    tested = sum(c * drafts_tested(p, min(a, p)) for p, a, c in groups)
    assert state.proposals_seen == tested
    if tested:
        accepted = sum(c * min(a, p) for p, a, c in groups)
        assert state.acceptance_estimate == pytest.approx(accepted / tested)  # a fresh session takes the block's rate


@given(st.integers(1, 8), st.integers(0, 8), st.floats(0.0, 1.0), st.integers(0, 500))
def test_a_block_of_one_step_is_one_observation(proposed: int, accepted: int, ewma: float, seen: int) -> None:
    start = SessionState(ewma, seen, False, 0)
    assert observe_steps(start, [(proposed, accepted, 1)], PolicyConfig()) == observe(start, proposed, accepted,
                                                                                     PolicyConfig())
