"""K auto priced at the worker's draft mix (policies/cost.py): pure data in, K out; the worker's
per-step rule; the gateway's bookkeeping of the mix (gateway/fleet/draft_mix.py).

The model is the simulated GPU deployment's derived cost model (workers/engines/sim/engine.py: a 70B
target with a 1B draft on TP4 H100s), where the mix matters most: a draft forward costs the same
whatever the batch, so K's price depends on how many sequences share it.
"""

import random
from dataclasses import replace
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.fleet.draft_mix import DraftMix
from policies import (
    CostModel,
    Decision,
    PolicyConfig,
    SessionState,
    StepMix,
    WorkerState,
    batch_step_k,
    choose_k,
    decide,
    gain,
    mixed_step_cost,
    objective,
    record_decision,
    step_cost,
    worker_acceptance,
)
from policies.states import RequestFacts
from tests.policy_data import COOL, PROPERTY, state
from workers.api.sim_config import SimConfig
from workers.costs.cost_report import report_from_forward_times
from workers.costs.online import StepCostRule
from workers.engines.sim.engine import derived_cost_report
from workers.engines.sim.roofline import SimBatch, SimSeq

SIM = derived_cost_report(SimConfig(), 8, 256).policy_model()
AUTO = PolicyConfig(num_speculative_tokens="auto")


def others(depth: int, drafting: int, alpha: float = 0.9, would_draft: int = 0) -> StepMix:
    """The mix a session joining a step of ``depth`` sequences sees when ``drafting`` of them
    (itself included) draft, the others accepting at ``alpha``."""
    return StepMix(depth - 1, drafting - 1, would_draft, alpha)


def test_a_step_where_every_sequence_drafts_costs_the_uniform_price() -> None:
    assert SIM.parts is not None
    for depth in SIM.depths:
        assert mixed_step_cost(SIM, depth, 0, 0, 0) == 1.0
        for k in range(SIM.max_k + 1):
            assert mixed_step_cost(SIM, depth, depth, depth * k, k) == pytest.approx(step_cost(SIM, depth, k),
                                                                                     abs=1e-3)


@pytest.mark.parametrize(("depth", "drafting", "uniform", "mixed"), [
    (16, 5, 4, 6),  # a third drafts (bench.policy's steady phase): deeper K than all-drafting pricing
    (24, 8, 3, 4),
    (32, 10, 2, 3),
    (16, 16, 4, 4),  # every sequence drafts: the uniform price, the same K as before
    (24, 24, 3, 3),
    (8, 8, 8, 8),
    (64, 20, 1, 0),  # a third drafting at depth 64 would slow the other two thirds more than it gains
    (4, 1, 8, 5),  # alone among plain sequences: its forwards slow all of them
])
def test_mixed_pricing_table(depth: int, drafting: int, uniform: int, mixed: int) -> None:
    assert choose_k(SIM, 0.9, depth, 8, AUTO.min_gain, AUTO.k_switch_gain) == uniform
    assert choose_k(SIM, 0.9, depth, 8, AUTO.min_gain, AUTO.k_switch_gain, mix=others(depth, drafting)) == mixed


def test_sessions_that_would_draft_count_as_drafting() -> None:
    """Alone among 23 plain sequences drafting loses; when 7 of them are plain only for no_gain
    (or the batch latch), they draft with it once a K pays, and one does."""
    assert choose_k(SIM, 0.9, 24, 8, AUTO.min_gain, AUTO.k_switch_gain, mix=StepMix(23, 0, 0, 0.9)) == 0
    assert choose_k(SIM, 0.9, 24, 8, AUTO.min_gain, AUTO.k_switch_gain, mix=StepMix(23, 0, 7, 0.9)) == 4


def test_the_others_drafting_are_priced_at_the_workers_acceptance() -> None:
    """A session at α = 0.95 among drafting sessions that accept 0.6 wants a shallower K: their
    tokens at the deeper K do not pay for its forwards."""
    assert choose_k(SIM, 0.95, 16, 8, 0.05, 0.05, mix=others(16, 5, alpha=0.95)) == 8
    assert choose_k(SIM, 0.95, 16, 8, 0.05, 0.05, mix=others(16, 5, alpha=0.6)) == 2


def test_a_model_without_its_parts_prices_uniformly_whatever_the_mix() -> None:
    """The old schema (and a vLLM worker's whole-step estimates) has no parts."""
    old = CostModel(SIM.depths, SIM.step_cost)
    assert CostModel.from_json({"depths": list(SIM.depths), "step_cost": SIM.step_cost}).parts is None
    for depth in (1, 16, 24, 100):
        for k in range(9):
            assert gain(old, 0.9, k, depth, others(depth, 1)) == gain(old, 0.9, k, depth)


@pytest.mark.parametrize("field", ["verify_cost", "draft_cost", "plain_step_ms"])
def test_malformed_parts_are_refused(field: str) -> None:
    raw = derived_cost_report(SimConfig(), 8, 256).to_json()
    raw[field] = raw[field][:-1]
    with pytest.raises(ValueError, match="cost model"):
        CostModel.from_json(raw)


@st.composite
def parts_models(draw: st.DrawFn) -> CostModel:
    """Parts at 1-3 depths: a target whose forwards grow with tokens and depth, a draft forward,
    and work outside the forwards."""
    depths = sorted(draw(st.sets(st.integers(1, 64), min_size=1, max_size=3)))
    max_k = draw(st.integers(1, 8))
    base, per_token, per_row = draw(st.floats(1, 50)), draw(st.floats(0, 2)), draw(st.floats(0, 1))
    target_s = [[base + per_row * d + per_token * d * n * draw(st.floats(0.5, 1.0)) for n in range(1, max_k + 2)]
                for d in depths]
    for row in target_s:  # costs grow with the tokens verified
        for n in range(1, len(row)):
            row[n] = max(row[n], row[n - 1])
    draft = [draw(st.floats(0.1, 10)) for _ in depths]
    overhead = [draw(st.floats(0, 20)) for _ in depths]
    return report_from_forward_times(depths, target_s, draft, overhead_s=overhead).policy_model()


@PROPERTY
@given(model=parts_models(), alpha=st.floats(0, 1), depth=st.integers(1, 80), drafting=st.integers(0, 80),
       would_draft=st.integers(0, 20), others_alpha=st.one_of(st.none(), st.floats(0, 1)),
       min_gain=st.floats(0, 0.5), current=st.one_of(st.none(), st.integers(0, 8)))
def test_chosen_k_maximizes_the_mixed_objective(model: CostModel, alpha: float, depth: int, drafting: int,
                                                 would_draft: int, others_alpha: float | None, min_gain: float,
                                                 current: int | None) -> None:
    mix = StepMix(depth - 1, min(drafting, depth - 1), would_draft, others_alpha)
    ks = range(model.max_k + 1)
    values = [objective(model, alpha, k, depth, min_gain, mix) for k in ks]
    assert values[0] == 1 + min_gain
    k = choose_k(model, alpha, depth, 8, min_gain, 0.0, mix=mix)
    assert values[k] == max(values)
    held = choose_k(model, alpha, depth, 8, min_gain, 0.05, current, mix)  # hysteresis: within the margin
    assert values[held] * 1.05 >= max(values)


def test_no_k_flapping_on_a_noisy_acceptance_in_a_mixed_batch() -> None:
    rng = random.Random(9)
    worker = WorkerState(batch_depth=15, batch_full=False, max_k=8, cost=SIM, acceptance=0.9,
                         mix=StepMix(15, 4, 0))
    session = SessionState()
    ks = []
    for _ in range(300):
        session = replace(session, acceptance_estimate=0.9 + rng.uniform(-0.03, 0.03), acceptance_weight=1000,
                          proposals_seen=1000)
        decision = decide(session, worker, COOL, AUTO)
        session = record_decision(session, decision, auto_k=True)
        ks.append(decision.k)
    assert min(ks) > 0 and sum(a != b for a, b in pairwise(ks)) <= 1, ks


def test_the_rules_still_win_over_the_mixed_price() -> None:
    worker = WorkerState(batch_depth=15, batch_full=False, max_k=8, cost=SIM, acceptance=0.9, mix=StepMix(15, 4))
    evidence = SessionState(acceptance_estimate=0.95, acceptance_weight=1000, proposals_seen=1000)
    assert decide(evidence, replace(worker, batch_full=True), COOL, AUTO) == Decision("plain", 0, "batch_full")
    hot = decide(evidence, worker, replace(COOL, temperature=1.0), AUTO)
    assert hot == Decision("plain", 0, "high_temperature")
    low = SessionState(acceptance_estimate=0.3, acceptance_weight=1000, proposals_seen=1000, low_acceptance=True)
    assert decide(low, worker, COOL, AUTO) == Decision("plain", 0, "low_acceptance")


def test_the_workers_acceptance_rests_on_its_evidence() -> None:
    """One unlucky first request (two rejected drafts, α = 0) must not send every new session
    on the worker plain: it moves the worker's estimate from acceptance_resume by its weight."""
    assert worker_acceptance(SessionState(), AUTO) is None
    m, resume = AUTO.acceptance_prior_drafts, AUTO.acceptance_resume
    assert worker_acceptance(state(0.0, 2), AUTO) == pytest.approx(resume * m / (m + 2))
    assert (worker_acceptance(state(0.0, 2), AUTO) or 0.0) > AUTO.acceptance_floor
    assert worker_acceptance(state(0.85, 92), AUTO) == pytest.approx((0.85 * 92 + resume * m) / (92 + m))


# -- the worker's per-step rule -----------------------------------------------------------------


@pytest.mark.parametrize(("requested", "expected"), [
    ([8] * 5 + [0] * 11, 6),  # a third drafts at depth 16: the K its mix pays most for
    ([3, 8, 5] + [0] * 13, 4),  # one K for all, up to the deepest asked
    ([2] * 5 + [0] * 11, 2),  # never deeper than any request asked
    ([8] + [0] * 23, 0),  # alone among 23 plain sequences: the step runs plain
    ([0] * 4, 0),
    ([8] * 16, 4),  # all drafting: the uniform price's K
])
def test_batch_step_k(requested: list[int], expected: int) -> None:
    assert batch_step_k(SIM, 0.9, requested) == expected


def test_the_rule_is_remembered_per_step_shape() -> None:
    rule = StepCostRule(SIM)
    requested = [8] * 5 + [0] * 11
    assert rule.k(requested, 0.9) == rule.k(list(reversed(requested)), 0.901) == batch_step_k(SIM, 0.9, requested)
    assert len(rule._memo) == 1


def test_sim_batch_drafts_one_k_per_step_under_the_cost_rule() -> None:
    batch = SimBatch(SimConfig(), max_slots=64, max_k=8)
    batch.cost_rule = StepCostRule(SIM)
    for i in range(16):  # 5 of 16 ask for different Ks; the rest decode plain
        k = (3, 8, 5, 6, 7)[i] if i < 5 else 0
        batch.add(SimSeq(f"r{i}", k, 0.9, 10_000, 0, random.Random(i)))
    batch.step()  # admission: no drafts, no evidence yet
    for _ in range(40):  # acceptance evidence, then the rule applies
        step = batch.step()
    assert step is not None
    drafted = {r.k for r in step.results if r.seq.k > 0}
    assert drafted == {batch_step_k(SIM, round(batch.acceptance.value or 0, 2), [3, 8, 5, 6, 7] + [0] * 11)}
    assert all(r.k == 0 for r in step.results if r.seq.k == 0)


# -- the gateway's bookkeeping --------------------------------------------------------------------


def test_draft_mix_counts_in_flight_requests_by_decision() -> None:
    mix = DraftMix()
    sent = [Decision("speculative", 5, "default"), Decision("speculative", 3, "probe"), Decision("plain", 0, "no_gain"),
            Decision("plain", 0, "batch_full"), Decision("plain", 0, "high_temperature")]
    for decision in sent:
        mix.add(decision)
    assert mix.count == 5 and mix.step_mix() == StepMix(5, 2, 2)
    assert mix.view() == {"by_k": {"0": 3, "3": 1, "5": 1}, "drafting": 2, "drafts_per_step": 8, "would_draft": 2,
                          "lookups": 0}
    mix.remove(sent[0])
    mix.remove(sent[2])
    mix.remove(Decision("speculative", 7, "default"))  # never added: nothing to take back
    assert mix.step_mix() == StepMix(3, 1, 1)
    for decision in (sent[1], sent[3], sent[4]):
        mix.remove(decision)
    assert mix.count == 0 and mix.step_mix() == StepMix() and mix.by_k == {}


def test_a_lookup_request_counts_as_drafting_nothing() -> None:
    mix = DraftMix()
    lookup, draft = Decision("speculative", 8, "default", method="ngram"), Decision("speculative", 4, "default",
                                                                                    method="draft")
    mix.add(lookup)
    mix.add(draft)
    assert mix.step_mix() == StepMix(2, 1, 0) and mix.view()["drafts_per_step"] == 4
    assert (mix.drafting, mix.lookups) == (1, 1)  # method-aware placement reads both
    mix.remove(lookup)
    assert mix.step_mix() == StepMix(1, 1, 0) and mix.lookups == 0
    mix.remove(lookup)  # never added twice: nothing more to take back
    assert mix.lookups == 0


def test_the_virtual_fleet_gives_the_policy_the_mix_the_gateway_tracks(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.policy's fleet drives decide with each replica's in-flight draft mix, as the gateway
    does, and takes requests back out of it when they finish."""
    import bench.fleet_sim as fleet_sim

    seen: list[WorkerState] = []

    def spy(session: SessionState, worker: WorkerState, facts: object, policy: PolicyConfig) -> Decision:
        seen.append(worker)
        return decide(session, worker, facts, policy)  # type: ignore[arg-type]

    monkeypatch.setattr(fleet_sim, "decide", spy)
    sim = fleet_sim.FleetSim(SimConfig(), fleet_sim.FleetPolicy("auto", AUTO), [fleet_sim.Phase("p", 30, 6)])
    sim.run()
    assert seen and all(w.mix is not None and w.mix.sequences == w.batch_depth for w in seen)
    assert any(w.mix is not None and w.mix.drafting > 0 for w in seen)
    for replica in sim.replicas.values():
        assert replica.mix.count == replica.in_flight
        assert replica.batch.cost_rule is not None  # and the replicas run the worker's step rule


# -- free_batch: auto ---------------------------------------------------------------------------------
HOT = RequestFacts(temperature=1.0)
FREE_AUTO = PolicyConfig(num_speculative_tokens="auto", free_batch="auto")
# A CPU whose verification is compute-bound from the second token (cost ~ n) and whose draft costs
# 0.3 of the target: no K pays for any acceptance, so the waiver never applies there.
NO_GAIN = CostModel((1, 16), (tuple(round(n + 0.3 * (n - 1), 3) for n in range(1, 10)),) * 2)


def hot_session(alpha: float) -> SessionState:
    return SessionState(acceptance_estimate=alpha, acceptance_weight=1000, proposals_seen=1000)


@pytest.mark.parametrize(("worker", "session", "expected_reason"), [
    # The GPU deployment at a shallow depth: a hot session accepting 0.7 still gains, so the
    # temperature rule waits, and the session runs the cost model's K.
    (WorkerState(batch_depth=5, batch_full=False, max_k=8, cost=SIM, acceptance=0.9), hot_session(0.7), "free_batch"),
    # The same session where the cost model says no K pays: the configured rule stands.
    (WorkerState(batch_depth=5, batch_full=False, max_k=8, cost=NO_GAIN, acceptance=0.9), hot_session(0.7),
     "high_temperature"),
    # No cost model to ask: the rules stand.
    (WorkerState(batch_depth=5, batch_full=False, max_k=8, acceptance=0.9), hot_session(0.7), "high_temperature"),
    # The batch latch is never waived.
    (WorkerState(batch_depth=70, batch_full=True, max_k=8, cost=SIM, acceptance=0.9), hot_session(0.7),
     "high_temperature"),
    # A session whose acceptance is too low to pay even on a shallow GPU batch stays plain.
    (WorkerState(batch_depth=5, batch_full=False, max_k=8, cost=SIM, acceptance=0.9), hot_session(0.02),
     "high_temperature"),
])
def test_free_batch_auto_waives_the_rules_only_where_the_costs_say_speculation_pays(
        worker: WorkerState, session: SessionState, expected_reason: str) -> None:
    decision = decide(session, worker, HOT, FREE_AUTO)
    assert decision.reason == expected_reason
    if expected_reason == "free_batch":
        alpha = session.acceptance_estimate
        assert alpha is not None
        best = choose_k(SIM, alpha, worker.batch_depth + 1, 8, FREE_AUTO.min_gain, 0.0, None, None)
        assert decision.mode == "speculative" and decision.k == best > 0
        assert objective(SIM, alpha, decision.k, worker.batch_depth + 1, FREE_AUTO.min_gain) > 1 + FREE_AUTO.min_gain
    else:
        assert decision == Decision("plain", 0, "high_temperature")


def test_free_batch_auto_waives_the_acceptance_floor_too_and_a_fixed_k_must_pay_itself() -> None:
    worker = WorkerState(batch_depth=3, batch_full=False, max_k=8, cost=SIM, acceptance=0.9)
    latched = SessionState(acceptance_estimate=0.55, acceptance_weight=1000, proposals_seen=1000, low_acceptance=True)
    assert decide(latched, worker, COOL, FREE_AUTO).reason == "free_batch"
    fixed = PolicyConfig(num_speculative_tokens=5, free_batch="auto")
    assert decide(latched, worker, COOL, fixed) == Decision("speculative", 5, "free_batch")
    cpu = replace(worker, cost=NO_GAIN)
    assert decide(latched, cpu, COOL, fixed).reason in ("low_acceptance", "probe")


@pytest.mark.parametrize(("value", "ok"), [("auto", True), (0, True), (32, True), (-1, False), ("deep", False),
                                            (1.5, False), (True, False)])
def test_free_batch_takes_a_depth_or_auto(value: object, ok: bool) -> None:
    if ok:
        assert PolicyConfig.from_mapping({"free_batch": value}).free_batch == value
        return
    with pytest.raises(ValueError, match=r"policy\.free_batch: must be"):
        PolicyConfig.from_mapping({"free_batch": value})
