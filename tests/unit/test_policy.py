"""The speculative fallback policy as pure data: states and facts in, decisions and states out.

Every rule of ``decide`` and its precedence, every hysteresis edge of the two latches, the
acceptance estimate's arithmetic, and a full fallback/probe/recovery scenario (properties and
config validation have files of their own). No I/O, no clock: each test builds frozen values.
"""


import math
from dataclasses import replace

import pytest

from policies import (
    REASONS,
    Decision,
    PolicyConfig,
    RequestFacts,
    SessionState,
    StepDepth,
    WorkerState,
    acceptance_latch,
    batch_latch,
    decide,
    observe,
    observe_steps,
    record_decision,
    run_on,
    step_depth,
)
from policies import (
    tested_drafts as drafts_tested,  # aliased: pytest would collect a name starting with 'test'
)
from policies.tree import parse_shape
from tests.policy_data import COOL, FRESH, IDLE, LATCHED, POLICY, above, below, fold, rules_only, serve, state

# --------------------------------------------------------------------------------------------
# Decision.header


@pytest.mark.parametrize(("decision", "header"), [
    (Decision("speculative", 5, "default"), "speculative; k=5; reason=default"),
    (Decision("speculative", 1, "probe"), "speculative; k=1; reason=probe"),
    (Decision("plain", 0, "high_temperature"), "plain; reason=high_temperature"),
    (Decision("plain", 0, "worker_plain_only"), "plain; reason=worker_plain_only"),
    (Decision("plain", 0, "batch_full"), "plain; reason=batch_full"),
    (Decision("plain", 0, "low_acceptance"), "plain; reason=low_acceptance"),
    # Where a method was chosen it follows the mode; k= keeps its place after it.
    (Decision("speculative", 8, "default", method="ngram"), "speculative; method=ngram; k=8; reason=default"),
    (Decision("speculative", 6, "explore", method="draft"), "speculative; method=draft; k=6; reason=explore"),
    (Decision("plain", 0, "no_gain", method=None), "plain; reason=no_gain"),
])
def test_header(decision: Decision, header: str) -> None:
    assert decision.header == header


def test_reasons_lists_every_rule() -> None:
    assert set(REASONS) == {"default", "probe", "worker_plain_only", "worker_speculative_only", "high_temperature",
                            "batch_full", "low_acceptance", "no_gain", "free_batch", "explore"}


SPEC_ONLY = WorkerState(0, False, max_k=5, serves_plain=False)


@pytest.mark.parametrize(("session", "worker", "facts", "expected"), [
    # A worker of one fixed speculative mode runs its own K, whatever the rules want.
    (SessionState(), SPEC_ONLY, RequestFacts(0.0), Decision("speculative", 5, "default")),
    (SessionState(), SPEC_ONLY, RequestFacts(1.0), Decision("speculative", 5, "worker_speculative_only")),
    (SessionState(), replace(SPEC_ONLY, batch_full=True), RequestFacts(0.0),
     Decision("speculative", 5, "worker_speculative_only")),
    (state(0.1, 100, True, 0), SPEC_ONLY, RequestFacts(0.0),
     Decision("speculative", 5, "worker_speculative_only")),
    # Serving both modes, nothing changes.
    (SessionState(), WorkerState(0, False, max_k=5), RequestFacts(1.0), Decision("plain", 0, "high_temperature")),
])
def test_worker_speculative_only(session: SessionState, worker: WorkerState, facts: RequestFacts,
                                 expected: Decision) -> None:
    assert decide(session, worker, facts, POLICY) == expected


@pytest.mark.parametrize(("wanted", "worker", "expected"), [
    # What a worker of one fixed speculative mode runs of the rules' decision: decide's last step,
    # which the gateway applies itself after asking the rules as if the worker served plain too.
    (Decision("plain", 0, "high_temperature"), SPEC_ONLY, Decision("speculative", 5, "worker_speculative_only")),
    (Decision("speculative", 2, "probe"), SPEC_ONLY, Decision("speculative", 5, "probe")),
    (Decision("speculative", 3, "default", parse_shape("2+3")), SPEC_ONLY, Decision("speculative", 5, "default")),
    (Decision("plain", 0, "high_temperature"), WorkerState(0, False, max_k=5),
     Decision("plain", 0, "high_temperature")),
])
def test_run_on_a_fixed_mode_worker(wanted: Decision, worker: WorkerState, expected: Decision) -> None:
    assert run_on(wanted, worker) == expected


# --------------------------------------------------------------------------------------------
# decide: each rule on its own


@pytest.mark.parametrize(("worker", "expected"), [
    (WorkerState(0, False, max_k=0), Decision("plain", 0, "worker_plain_only")),
    (WorkerState(0, False, max_k=-1), Decision("plain", 0, "worker_plain_only")),
    (WorkerState(0, False, max_k=4, serves_speculative=False), Decision("plain", 0, "worker_plain_only")),
    (WorkerState(0, False, max_k=0, serves_speculative=False), Decision("plain", 0, "worker_plain_only")),
    (WorkerState(0, False, max_k=1), Decision("speculative", 1, "default")),
    (WorkerState(0, False, max_k=4, serves_speculative=True), Decision("speculative", 4, "default")),
])
def test_worker_plain_only(worker: WorkerState, expected: Decision) -> None:
    assert decide(FRESH, worker, COOL, POLICY) == expected


@pytest.mark.parametrize(("temperature", "expected"), [
    (0.0, Decision("speculative", 4, "default")),
    (below(0.8), Decision("speculative", 4, "default")),
    (0.8, Decision("speculative", 4, "default")),  # exactly max_temperature still speculates
    (above(0.8), Decision("plain", 0, "high_temperature")),
    (0.81, Decision("plain", 0, "high_temperature")),
    (2.0, Decision("plain", 0, "high_temperature")),
    (math.inf, Decision("plain", 0, "high_temperature")),
])
def test_high_temperature(temperature: float, expected: Decision) -> None:
    assert decide(FRESH, IDLE, RequestFacts(temperature), POLICY) == expected


@pytest.mark.parametrize(("max_temperature", "temperature", "reason"), [
    (0.0, 0.0, "default"),  # greedy only
    (0.0, 1e-9, "high_temperature"),
    (1.5, 1.5, "default"),
    (1.5, above(1.5), "high_temperature"),
])
def test_high_temperature_follows_the_policy(max_temperature: float, temperature: float, reason: str) -> None:
    policy = rules_only(max_temperature=max_temperature)
    assert decide(FRESH, IDLE, RequestFacts(temperature), policy).reason == reason


@pytest.mark.parametrize(("worker", "expected"), [
    (WorkerState(batch_depth=100, batch_full=True, max_k=8), Decision("plain", 0, "batch_full")),
    # decide reads the latch, not the depth: the latch is batch_latch's job
    (WorkerState(batch_depth=0, batch_full=True, max_k=8), Decision("plain", 0, "batch_full")),
    (WorkerState(batch_depth=100, batch_full=False, max_k=8), Decision("speculative", 4, "default")),
])
def test_batch_full(worker: WorkerState, expected: Decision) -> None:
    assert decide(FRESH, worker, COOL, POLICY) == expected


@pytest.mark.parametrize(("session", "expected"), [
    (LATCHED, Decision("plain", 0, "low_acceptance")),
    (replace(LATCHED, plain_since_probe=6), Decision("plain", 0, "low_acceptance")),
    (replace(LATCHED, plain_since_probe=7), Decision("speculative", 4, "probe")),  # the 8th request
    (replace(LATCHED, plain_since_probe=50), Decision("speculative", 4, "probe")),
    # decide reads the latch, not the estimate
    (SessionState(acceptance_estimate=0.0, acceptance_weight=1000, proposals_seen=1000, low_acceptance=False),
     Decision("speculative", 4, "default")),
    (SessionState(acceptance_estimate=1.0, low_acceptance=True), Decision("plain", 0, "low_acceptance")),
    (FRESH, Decision("speculative", 4, "default")),
])
def test_low_acceptance_and_probe(session: SessionState, expected: Decision) -> None:
    assert decide(session, IDLE, COOL, POLICY) == expected


@pytest.mark.parametrize("plain_since_probe", [0, 1, 5])
def test_probe_every_one_probes_every_request(plain_since_probe: int) -> None:
    policy = replace(POLICY, probe_every=1)
    session = replace(LATCHED, plain_since_probe=plain_since_probe)
    assert decide(session, IDLE, COOL, policy) == Decision("speculative", 4, "probe")


@pytest.mark.parametrize(("num_speculative_tokens", "max_k", "k"), [
    (4, 8, 4),
    (4, 4, 4),
    (4, 3, 3),
    (4, 1, 1),
    (1, 8, 1),
    (16, 8, 8),
    (16, 16, 16),
])
def test_default_k_is_capped_by_the_worker(num_speculative_tokens: int, max_k: int, k: int) -> None:
    policy = rules_only(num_speculative_tokens=num_speculative_tokens)
    worker = WorkerState(0, False, max_k=max_k)
    assert decide(FRESH, worker, COOL, policy) == Decision("speculative", k, "default")
    probing = replace(LATCHED, plain_since_probe=policy.probe_every - 1)
    assert decide(probing, worker, COOL, policy) == Decision("speculative", k, "probe")


# --------------------------------------------------------------------------------------------
# decide: precedence. Each row makes several rules apply; the earliest in the list must win.

HOT = RequestFacts(temperature=1.0)
PROBE_DUE = replace(LATCHED, plain_since_probe=7)
PLAIN_ONLY = WorkerState(batch_depth=100, batch_full=True, max_k=0)
NO_DRAFT_SERVER = WorkerState(batch_depth=100, batch_full=True, max_k=4, serves_speculative=False)
FULL = WorkerState(batch_depth=100, batch_full=True, max_k=8)


@pytest.mark.parametrize(("session", "worker", "request_", "reason"), [
    # worker_plain_only beats everything
    (LATCHED, PLAIN_ONLY, HOT, "worker_plain_only"),
    (PROBE_DUE, NO_DRAFT_SERVER, HOT, "worker_plain_only"),
    (FRESH, PLAIN_ONLY, COOL, "worker_plain_only"),
    (PROBE_DUE, PLAIN_ONLY, COOL, "worker_plain_only"),
    # high_temperature beats batch_full, low_acceptance and probe
    (LATCHED, FULL, HOT, "high_temperature"),
    (PROBE_DUE, FULL, HOT, "high_temperature"),
    (PROBE_DUE, IDLE, HOT, "high_temperature"),
    (LATCHED, IDLE, HOT, "high_temperature"),
    # batch_full beats low_acceptance and probe
    (LATCHED, FULL, COOL, "batch_full"),
    (PROBE_DUE, FULL, COOL, "batch_full"),
    # probe beats low_acceptance once due
    (PROBE_DUE, IDLE, COOL, "probe"),
    (LATCHED, IDLE, COOL, "low_acceptance"),
    # nothing applies
    (FRESH, IDLE, COOL, "default"),
])
def test_precedence(session: SessionState, worker: WorkerState, request_: RequestFacts, reason: str) -> None:
    decision = decide(session, worker, request_, POLICY)
    assert decision.reason == reason
    assert decision.mode == ("speculative" if reason in ("default", "probe") else "plain")


# --------------------------------------------------------------------------------------------
# record_decision: only low_acceptance and probe touch the probe count


@pytest.mark.parametrize(("decision", "plain_since_probe"), [
    (Decision("plain", 0, "low_acceptance"), 4),
    (Decision("speculative", 4, "probe"), 0),
    (Decision("speculative", 4, "default"), 3),
    (Decision("plain", 0, "high_temperature"), 3),
    (Decision("plain", 0, "batch_full"), 3),
    (Decision("plain", 0, "worker_plain_only"), 3),
])
def test_record_decision(decision: Decision, plain_since_probe: int) -> None:
    session = replace(LATCHED, plain_since_probe=3)
    assert record_decision(session, decision) == replace(session, plain_since_probe=plain_since_probe)


def test_plain_for_other_reasons_does_not_advance_the_probe() -> None:
    session = LATCHED
    for _ in range(20):
        decision, session = serve(session, worker=FULL)
        assert decision.reason == "batch_full"
        decision, session = serve(session, request=HOT)
        assert decision.reason == "high_temperature"
    assert session == LATCHED


# --------------------------------------------------------------------------------------------
# Acceptance latch edges

FLOOR, RESUME, MIN = POLICY.acceptance_floor, POLICY.acceptance_resume, POLICY.min_proposals
BARE = replace(POLICY, acceptance_latch_stderrs=0.0)


@pytest.mark.parametrize(("latched", "ewma", "seen", "after"), [
    # unlatched: needs both evidence and an estimate strictly below the floor
    (False, 0.0, MIN - 1, False),
    (False, below(FLOOR), MIN - 1, False),
    (False, 0.0, MIN, True),
    (False, below(FLOOR), MIN, True),
    (False, below(FLOOR), 10 * MIN, True),
    (False, FLOOR, MIN, False),  # exactly at the floor: no fallback
    (False, FLOOR, 10 * MIN, False),
    (False, 0.65, 10 * MIN, False),  # inside the band, unlatched: stays unlatched
    (False, below(RESUME), 10 * MIN, False),
    (False, 1.0, 10 * MIN, False),
    # latched: clears only at or above resume, whatever the evidence
    (True, 0.0, 10 * MIN, True),
    (True, below(FLOOR), 10 * MIN, True),
    (True, FLOOR, 10 * MIN, True),
    (True, 0.65, 10 * MIN, True),
    (True, below(RESUME), 10 * MIN, True),
    (True, RESUME, 10 * MIN, False),
    (True, above(RESUME), 10 * MIN, False),
    (True, 1.0, 10 * MIN, False),
    (True, 0.65, 0, True),
    (True, RESUME, 0, False),
])
def test_acceptance_latch(latched: bool, ewma: float, seen: int, after: bool) -> None:
    """The bare thresholds (no confidence margin); the margin is tested below."""
    assert acceptance_latch(latched, ewma, 1e9, seen, BARE) is after


@pytest.mark.parametrize(("estimate", "weight", "after"), [
    # 0.5 over 32 drafts: stderr 0.088, 0.5 + 1.5 x 0.088 = 0.63 >= 0.60: not sure enough yet
    (0.5, 32, False),
    # 0.5 over 92 drafts (the weight a long session levels off at): 0.5 + 0.078 < 0.60
    (0.5, 92, True),
    (0.45, 32, True),  # 0.45 + 1.5 x 0.088 = 0.58
    (0.0, 32, True),  # no draft accepted: no doubt at all
    (0.59, 1e6, True),  # a huge weight: the bare floor
    (0.6, 1e6, False),
])
def test_acceptance_latch_trips_only_below_the_floor_by_its_margin(estimate: float, weight: float,
                                                                    after: bool) -> None:
    assert acceptance_latch(False, estimate, weight, MIN, POLICY) is after
    assert acceptance_latch(False, estimate, weight, MIN - 1, POLICY) is False  # too little lifetime evidence


@pytest.mark.parametrize("min_proposals", [0, 1, 8])
def test_acceptance_latch_trips_on_the_observation_that_reaches_min_proposals(min_proposals: int) -> None:
    policy = rules_only(min_proposals=min_proposals)
    # Each (1, 0) step tests exactly one draft and rejects it: the estimate stays at 0.
    session = FRESH
    for seen in range(1, min_proposals + 3):
        session = observe(session, 1, 0, policy)
        assert session.acceptance_estimate == 0.0
        assert session.proposals_seen == seen
        assert session.low_acceptance is (seen >= min_proposals)


# A half-life of 4 tested drafts halves a weight of 8 to 4 over a 4-draft step, which then weighs as
# much as the old evidence: the estimate moves exactly halfway, so it lands exactly on chosen
# thresholds (all values below are dyadic: no rounding). The bare thresholds: no confidence margin.
EDGE = rules_only(acceptance_floor=0.5, acceptance_resume=0.75, min_proposals=0, acceptance_half_life=4,
                  acceptance_latch_stderrs=0)


@pytest.mark.parametrize(("before", "step", "ewma", "latched"), [
    # unlatched, 0.25 halfway to 0.75 (5 proposed, 3 accepted: 4 tested) lands exactly on the floor
    (state(0.25, 8, False), (5, 3), 0.5, False),
    # 0.0 halfway to 0.75 lands below the floor (min_proposals is 0 here): trips
    (state(0.0, 8, False), (5, 3), 0.375, True),
    # latched, 0.5 halfway to 1.0 lands exactly on resume: clears
    (state(0.5, 8, True, 3), (4, 4), 0.75, False),
    # latched, 0.25 halfway to 1.0 lands inside the band: stays latched
    (state(0.25, 8, True, 3), (4, 4), 0.625, True),
    # latched, 0.0 halfway to 1.0 lands exactly on the floor: still latched (below resume)
    (state(0.0, 8, True, 3), (4, 4), 0.5, True),
    # unlatched stays unlatched at or above the floor
    (state(1.0, 8, False), (5, 3), 0.875, False),
    (state(0.75, 8, False), (5, 3), 0.75, False),
])
def test_observe_latch_edges(before: SessionState, step: tuple[int, int], ewma: float, latched: bool) -> None:
    after = observe(before, *step, EDGE)
    assert after.acceptance_estimate == ewma
    assert after.low_acceptance is latched


def test_observe_keeps_the_probe_count_while_latched_and_resets_it_on_clearing() -> None:
    latched = state(0.25, 8, True, plain_since_probe=3)
    assert observe(latched, 4, 4, EDGE).plain_since_probe == 3  # 0.625: still latched
    cleared = state(0.5, 8, True, plain_since_probe=3)
    # (the rank table, policies/tree_choice.py, is folded too: tests/unit/test_policy_tree.py)
    assert replace(observe(cleared, 4, 4, EDGE), ranks=()) == SessionState(
        acceptance_estimate=0.75, acceptance_weight=8.0, proposals_seen=12, drafts_proposed=4, drafts_accepted=4)


# --------------------------------------------------------------------------------------------
# Batch latch and the per-step depth rule (max_batch 64, batch_resume 56)

BATCH_EDGES = [
    # (latched before, depth, latched after)
    (False, 0, False),
    (False, 55, False),
    (False, 56, False),
    (False, 60, False),
    (False, 64, False),  # exactly max_batch: does not trip
    (False, 65, True),
    (False, 1000, True),
    (True, 1000, True),
    (True, 65, True),
    (True, 64, True),  # the band [56, 64] keeps the latch as it is
    (True, 60, True),
    (True, 56, True),  # exactly batch_resume: still latched
    (True, 55, False),
    (True, 0, False),
]


@pytest.mark.parametrize(("latched", "depth", "after"), BATCH_EDGES)
def test_batch_latch(latched: bool, depth: int, after: bool) -> None:
    assert batch_latch(latched, depth, POLICY) is after


@pytest.mark.parametrize(("latched", "depth", "after"), BATCH_EDGES)
@pytest.mark.parametrize("requested_k", [1, 4, 8])
def test_step_depth(latched: bool, depth: int, after: bool, requested_k: int) -> None:
    expected = StepDepth(k=0 if after else requested_k, batch_full=after)
    assert step_depth(requested_k, depth, latched, POLICY.max_batch, POLICY.batch_resume) == expected


@pytest.mark.parametrize(("latched", "depth", "after"), [
    (False, 10, False),
    (False, 11, True),
    (True, 11, True),
    (True, 10, True),  # band of one depth: [10, 10]
    (True, 9, False),
])
def test_batch_latch_with_resume_equal_to_max(latched: bool, depth: int, after: bool) -> None:
    policy = rules_only(max_batch=10, batch_resume=10)
    assert batch_latch(latched, depth, policy) is after
    assert step_depth(4, depth, latched, 10, 10) == StepDepth(0 if after else 4, after)


def test_batch_latch_rises_and_falls_once_through_the_band() -> None:
    depths = [0, 30, 56, 64, 65, 70, 64, 60, 56, 55, 40, 56, 64, 60]
    latch, history = False, []
    for depth in depths:
        latch = batch_latch(latch, depth, POLICY)
        history.append(latch)
    assert history == [False, False, False, False, True, True, True, True, True, False, False, False, False, False]


# --------------------------------------------------------------------------------------------
# observe: the acceptance estimate


@pytest.mark.parametrize(("proposed", "accepted", "tested"), [
    (1, 0, 1),
    (1, 1, 1),
    (4, 0, 1),  # the first draft was rejected; the other three were never tested
    (4, 1, 2),
    (4, 3, 4),
    (4, 4, 4),  # all passed: K tested, no rejection
    (8, 5, 6),
    (16, 16, 16),
])
def test_tested_drafts(proposed: int, accepted: int, tested: int) -> None:
    assert drafts_tested(proposed, accepted) == tested


@pytest.mark.parametrize(("proposed", "accepted", "rate"), [
    (4, 4, 1.0),
    (4, 0, 0.0),
    (4, 1, 0.5),
    (4, 2, 2 / 3),
    (4, 3, 0.75),
    (8, 5, 5 / 6),
    (1, 1, 1.0),
])
def test_first_observation_sets_the_estimate_to_the_steps_rate(proposed: int, accepted: int, rate: float) -> None:
    after = observe(FRESH, proposed, accepted, POLICY)
    assert after.acceptance_estimate == rate
    assert after.proposals_seen == drafts_tested(proposed, accepted)


@pytest.mark.parametrize("session", [FRESH, LATCHED, state(0.9, 7), replace(LATCHED, plain_since_probe=5)])
@pytest.mark.parametrize(("proposed", "accepted"), [(0, 0), (0, 3), (-1, 0), (-4, -4)])
def test_no_drafts_is_a_no_op(session: SessionState, proposed: int, accepted: int) -> None:
    assert observe(session, proposed, accepted, POLICY) == session


@pytest.mark.parametrize(("accepted", "same_as"), [(5, 4), (100, 4), (-1, 0), (-100, 0)])
def test_accepted_is_clamped_to_proposed(accepted: int, same_as: int) -> None:
    for session in (FRESH, state(0.5, 10, False), LATCHED):
        assert observe(session, 4, accepted, POLICY) == observe(session, 4, same_as, POLICY)


@pytest.mark.parametrize(("half_life", "before", "step", "after"), [
    # a step testing exactly acceptance_half_life drafts halves the old evidence's weight: from a
    # weight of 2h, it moves the estimate exactly halfway
    (4.0, 0.25, (4, 4), 0.625),
    (4.0, 0.5, (4, 4), 0.75),
    (4.0, 0.25, (5, 3), 0.5),  # rate 0.75, 4 tested
    (4.0, 1.0, (8, 3), 0.875),  # rate 0.75, 4 tested
    (64.0, 0.0, (64, 64), 0.5),  # the default half-life
    (64.0, 1.0, (65, 63), 1.0 - 0.5 / 64),  # rate 63/64, 64 tested
    (1.0, 0.0, (1, 1), 0.5),
    (1.0, 0.0, (3, 0), 0.0),  # one tested, rejected: halfway from 0 to 0
])
def test_half_life(half_life: float, before: float, step: tuple[int, int], after: float) -> None:
    policy = rules_only(acceptance_half_life=half_life, min_proposals=10_000)
    # A weight of 2h, halved by the step's h tested drafts, weighs as much as the step.
    session = state(before, int(2 * half_life))
    assert drafts_tested(*step) == half_life
    assert observe(session, *step, policy).acceptance_estimate == after


def test_weight_is_measured_in_tested_drafts() -> None:
    """Old evidence decays by the drafts tested since, however they were split into steps: after
    h tested drafts it weighs half. Each new draft is added at weight 1 and decays from then on."""
    policy = rules_only(acceptance_half_life=8, min_proposals=10_000)
    start = state(0.0, 16)
    one = observe(start, 8, 8, policy)
    two = fold(start, [(4, 4), (4, 4)], policy)
    half = 0.5 ** 0.5  # 4 drafts of a half-life of 8
    assert one.acceptance_weight == pytest.approx(8 + 8)
    assert two.acceptance_weight == pytest.approx(8 + 4 * half + 4)
    assert one.acceptance_estimate == pytest.approx(8 / 16)
    assert two.acceptance_estimate == pytest.approx((4 * half + 4) / (8 + 4 * half + 4))
    assert one.proposals_seen == two.proposals_seen == 24
    # the untested tail of a rejected step carries no weight: (8, 0) tests one draft, like (1, 0)
    assert replace(observe(one, 8, 0, policy), drafts_proposed=0) == replace(observe(one, 1, 0, policy),
                                                                            drafts_proposed=0)


def test_evidence_accumulates_tested_drafts() -> None:
    steps = [(4, 0), (4, 2), (4, 4), (8, 5), (1, 1), (0, 0), (4, 9)]
    session = fold(FRESH, steps, rules_only(min_proposals=10_000))
    assert session.proposals_seen == 1 + 3 + 4 + 6 + 1 + 0 + 4


def test_acceptance_is_per_token_not_per_step() -> None:
    """Accepting 3 of 4 drafts then rejecting the 4th is rate 3/4, not (3/4 of K) and not 0."""
    assert observe(FRESH, 4, 3, POLICY).acceptance_estimate == 0.75
    # ...and is the same whether K was 4 or 8: the drafts after the rejection were never tested
    # (vLLM's accepted / proposed, kept beside it, does depend on K)
    eight, four = observe(FRESH, 8, 3, POLICY), observe(FRESH, 4, 3, POLICY)
    assert replace(eight, drafts_proposed=4) == four
    assert (eight.drafts_proposed, four.drafts_proposed, eight.drafts_accepted) == (8, 4, 3)


# --------------------------------------------------------------------------------------------
# A whole session: fallback, plain requests, probe, recovery or not


def fall_back(policy: PolicyConfig = POLICY) -> SessionState:
    """Alternating bad steps (no draft accepted, then one of four) until the latch trips."""
    session, bad = FRESH, [(4, 0), (4, 1)]
    previous, steps = session, 0
    while not session.low_acceptance:
        decision, session = serve(session, policy=policy)
        assert decision == Decision("speculative", 4, "default")  # speculating until the trip
        previous = session
        session = observe(session, *bad[steps % 2], policy)
        steps += 1
        assert steps < 100
    # the estimate was below the floor long before; the evidence is what tripped it
    assert previous.acceptance_estimate is not None and previous.acceptance_estimate < policy.acceptance_floor
    assert previous.proposals_seen < policy.min_proposals <= session.proposals_seen
    assert session.plain_since_probe == 0
    return session


def test_scenario_fallback_needs_min_proposals_of_evidence() -> None:
    session = fall_back()
    # (4, 0) tests 1 draft, (4, 1) tests 2: 21 steps carry 31 drafts, the 22nd (a (4, 1)) reaches 33.
    assert session.proposals_seen == 33


def plain_until_probe(session: SessionState, policy: PolicyConfig = POLICY) -> SessionState:
    for i in range(policy.probe_every - 1):
        decision, session = serve(session, policy=policy)
        assert decision == Decision("plain", 0, "low_acceptance")
        assert session.plain_since_probe == i + 1
    decision, session = serve(session, policy=policy)
    assert decision == Decision("speculative", 4, "probe")
    assert decision.header == "speculative; k=4; reason=probe"
    assert session.plain_since_probe == 0
    return session


def test_scenario_good_probe_resumes_speculation() -> None:
    session = plain_until_probe(fall_back())
    # the probe's steps all accept every draft: the estimate climbs back above resume
    steps = 0
    while session.low_acceptance:
        session = observe(session, 4, 4, POLICY)
        steps += 1
        assert steps < 100
    assert session.acceptance_estimate is not None and session.acceptance_estimate >= POLICY.acceptance_resume
    assert session.plain_since_probe == 0
    for _ in range(3 * POLICY.probe_every):
        decision, session = serve(session)
        assert decision == Decision("speculative", 4, "default")


def test_scenario_probe_climbing_into_the_band_is_not_enough() -> None:
    session = plain_until_probe(fall_back())
    while session.acceptance_estimate is not None and session.acceptance_estimate < POLICY.acceptance_floor:
        session = observe(session, 4, 4, POLICY)
    # climbing in steps of under 0.02 (4 drafts of a 64-draft half-life), it stops inside the band
    assert session.acceptance_estimate is not None
    assert POLICY.acceptance_floor <= session.acceptance_estimate < POLICY.acceptance_resume
    assert session.low_acceptance
    decision, _ = serve(session)
    assert decision == Decision("plain", 0, "low_acceptance")


def test_scenario_bad_probe_stays_plain_and_restarts_the_count() -> None:
    session = plain_until_probe(fall_back())
    session = fold(session, [(4, 0), (4, 1), (4, 0)])
    assert session.low_acceptance
    assert session.plain_since_probe == 0
    # the full probe_every - 1 plain requests again, then the next probe
    session = plain_until_probe(session)
    session = fold(session, [(4, 1)])
    session = plain_until_probe(session)
    assert session.low_acceptance


@pytest.mark.parametrize("probe_every", [1, 2, 3])
def test_scenario_with_other_probe_periods(probe_every: int) -> None:
    policy = replace(POLICY, probe_every=probe_every)
    session = plain_until_probe(fall_back(policy), policy)
    session = observe(session, 4, 0, policy)
    plain_until_probe(session, policy)


# --------------------------------------------------------------------------------------------
# The estimate from a session's first draft (issue #40: sessions at 90% were sent plain)


def test_a_first_rejection_weighs_one_draft_not_the_whole_estimate() -> None:
    """The first step tests one draft and rejects it; then 10 steps of K=6 accept all: the
    rejection weighs one draft (decayed by the 60 since), not the whole estimate as in an EWMA
    seeded with the first step's rate (which read 0.44 after 58 more drafts at 0.95)."""
    steps = [(6, 0)] + [(6, 6)] * 10
    forward = fold(FRESH, steps)
    backward = fold(FRESH, steps[::-1])
    accepted = sum(6 * 0.5 ** (6 * j / 64) for j in range(10))  # each step decayed by the ones after it
    assert forward.acceptance_estimate == pytest.approx(accepted / (accepted + 0.5 ** (60 / 64)), abs=1e-12)
    assert (forward.acceptance_estimate or 0.0) > 0.98
    assert backward.acceptance_estimate is not None and forward.acceptance_estimate is not None
    assert abs(forward.acceptance_estimate - backward.acceptance_estimate) <= 0.05
    assert not forward.low_acceptance and not backward.low_acceptance


def test_a_session_at_ninety_percent_is_never_latched_after_a_bad_start() -> None:
    """The issue's session: 53 of 59 drafts accepted on its first request, starting with a rejection."""
    steps = [(6, 0)] + [(6, 6)] * 8 + [(6, 5)] * 2 + [(6, 4)]
    session = fold(FRESH, steps)
    assert session.acceptance_estimate is not None and session.acceptance_estimate > 0.85
    assert not session.low_acceptance
    decision, _ = serve(session)
    assert decision == Decision("speculative", 4, "default")


def test_a_block_folds_as_its_steps_do_whatever_their_order() -> None:
    """observe_steps (vLLM's per-request groups, no order) gives the same estimate as folding the
    steps one by one in any order, within the decay of the block (here one request's 61 drafts)."""
    groups = [(6, 0, 1), (6, 6, 10)]
    block = observe_steps(FRESH, groups, POLICY)
    assert block.acceptance_estimate == pytest.approx(60 / 61)
    assert block.proposals_seen == 61 and (block.drafts_proposed, block.drafts_accepted) == (66, 60)
    one_by_one = fold(FRESH, [(6, 0)] + [(6, 6)] * 10)
    assert block.acceptance_estimate == pytest.approx(one_by_one.acceptance_estimate, abs=0.05)
