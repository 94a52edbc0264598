"""The per-session choice of speculation method (policies.speculation ``_method_rules``,
policies/lookup.py): table-driven, pure data in and a Decision out."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies import (
    CostModel,
    Decision,
    LookupState,
    PolicyConfig,
    RequestFacts,
    SessionState,
    StepParts,
    WorkerState,
    decide,
    observe_lookup,
    price_lookup,
    record_decision,
)
from policies.cost import lookup_step_cost, step_cost
from tests.policy_data import COOL, state
from tests.unit.cost_curves import AMX_VERIFY, curve

# The AMX CPU's verification curve, a draft forward at 0.2 of a plain step: a lookup step of K
# costs the verification alone (1.0-1.1), a draft step of K 1 + 0.2 K more.
PARTS = StepParts((10.0,), (AMX_VERIFY,), (0.2,), (0.0,), (0.0,))
AMX = CostModel((1,), (curve(AMX_VERIFY, 0.2),), PARTS)
AUTO = PolicyConfig(num_speculative_tokens="auto", methods=("draft", "ngram", "suffix"), tree_shapes=())
ALL = WorkerState(batch_depth=0, batch_full=False, max_k=8, cost=AMX, methods=("draft", "ngram", "suffix"))


def lookup(method: str, alpha: float, coverage: float, steps: int = 64, low: bool = False) -> LookupState:
    """Evidence at full weight: ``steps`` steps, ``coverage`` of them proposing, α over 4 drafts each."""
    proposing = coverage * steps
    return LookupState(method, alpha, proposing * 4, int(proposing * 4), int(proposing * 4),  # type: ignore[arg-type]
                       int(proposing * 4 * alpha), low, float(steps), proposing, steps)


def with_lookups(session: SessionState, *states: LookupState, since: int = 0, method: str = "draft") -> SessionState:
    return replace(session, lookups=states, since_method=since, method=method)  # type: ignore[arg-type]


def test_lookup_steps_cost_the_verification_alone() -> None:
    for k in range(1, 9):
        assert lookup_step_cost(AMX, 1, k) == pytest.approx(AMX_VERIFY[k])
        assert lookup_step_cost(AMX, 1, k) < step_cost(AMX, 1, k)


def test_draft_only_methods_decide_as_before() -> None:
    policy = replace(AUTO, methods=("draft",))
    session = state(0.8, 100)
    assert decide(session, ALL, COOL, policy) == decide(session, replace(ALL, methods=("draft",)), COOL, policy)
    assert decide(session, ALL, COOL, policy).method is None


def test_a_worker_without_lookup_decides_as_before() -> None:
    session = state(0.8, 100)
    decision = decide(session, replace(ALL, methods=("draft",)), COOL, AUTO)
    assert decision.method is None and decision.mode == "speculative"


@pytest.mark.parametrize(("draft_alpha", "ngram", "suffix", "method"), [
    # code editing: the output repeats the input, lookup finds it most steps and it passes
    (0.55, (0.9, 0.8), (0.85, 0.7), "ngram"),
    (0.55, (0.7, 0.3), (0.9, 0.9), "suffix"),
    # open chat: lookup rarely finds a match, and what it finds rarely passes
    (0.75, (0.3, 0.1), (0.35, 0.15), "draft"),
])
def test_the_method_that_promises_most_is_chosen(draft_alpha: float, ngram: tuple[float, float],
                                                 suffix: tuple[float, float], method: str) -> None:
    session = with_lookups(state(draft_alpha, 100), lookup("ngram", *ngram), lookup("suffix", *suffix))
    decision = decide(session, ALL, COOL, AUTO)
    assert (decision.mode, decision.method, decision.reason) == ("speculative", method, "default")
    assert decision.header.startswith(f"speculative; method={method}; k=")


def test_the_current_method_is_kept_within_k_switch_gain() -> None:
    ngram, suffix = lookup("ngram", 0.9, 0.8), lookup("suffix", 0.9, 0.8)
    value = price_lookup(ngram, LookupState("ngram"), AMX, 1, 8, AUTO, AUTO.acceptance_resume).value
    slightly = price_lookup(replace(suffix, acceptance_estimate=0.905), LookupState("suffix"), AMX, 1, 8, AUTO,
                            AUTO.acceptance_resume).value
    assert value < slightly < value * (1 + AUTO.k_switch_gain)
    session = with_lookups(state(0.3, 100, low_acceptance=True), ngram, replace(suffix, acceptance_estimate=0.905),
                           method="ngram")
    assert decide(session, ALL, COOL, AUTO).method == "ngram"
    assert decide(replace(session, method="suffix"), ALL, COOL, AUTO).method == "suffix"


def test_an_untried_method_is_explored_every_nth_request() -> None:
    session = state(0.8, 100)  # the draft pays; neither lookup method has run in the session or the worker
    decision, session = _serve(session)
    assert (decision.method, decision.reason) == ("draft", "default")
    decision, session = _serve(session)
    assert (decision.method, decision.reason) == ("ngram", "explore")
    session = observe_lookup(session, "ngram", [(0, 0)] * 30 + [(4, 0)] * 2, AUTO)  # it found little
    decision, session = _serve(session)
    assert (decision.method, decision.reason) == ("draft", "default")
    decision, session = _serve(session)
    assert (decision.method, decision.reason) == ("suffix", "explore")


def test_a_lone_method_runs_at_once() -> None:
    policy = replace(AUTO, methods=("ngram",))
    decision = decide(SessionState(), ALL, COOL, policy)
    assert (decision.mode, decision.method, decision.reason) == ("speculative", "ngram", "explore")


def test_an_untried_method_is_priced_on_the_workers_evidence() -> None:
    worker = replace(ALL, lookups=(lookup("ngram", 0.95, 0.9),))
    decision = decide(state(0.6, 100), worker, COOL, AUTO)  # not due to explore: priced on the worker's
    assert (decision.method, decision.reason) == ("ngram", "default")


def test_plain_only_when_every_method_is_latched() -> None:
    session = with_lookups(state(0.2, 100, low_acceptance=True), lookup("ngram", 0.3, 0.5, low=True),
                           lookup("suffix", 0.9, 0.9))
    assert decide(session, ALL, COOL, AUTO).method == "suffix"  # the draft and ngram latched: suffix still pays
    latched = with_lookups(session, lookup("ngram", 0.3, 0.5, low=True),
                           lookup("suffix", 0.2, 0.9, low=True))
    assert decide(latched, ALL, COOL, AUTO) == Decision("plain", 0, "low_acceptance", method="draft")
    probing = replace(latched, plain_since_probe=AUTO.probe_every - 1)
    probe = decide(probing, ALL, COOL, AUTO)
    assert (probe.mode, probe.reason, probe.method) == ("speculative", "probe", "ngram")  # the best estimate: 0.3


def test_a_latched_method_is_probed_while_another_runs() -> None:
    session = with_lookups(state(0.3, 100, low_acceptance=True), lookup("ngram", 0.4, 0.2), lookup("suffix", 0.9, 0.9),
                           method="suffix")
    assert decide(session, ALL, COOL, AUTO).method == "suffix"
    due = replace(session, since_method=AUTO.probe_every - 1)
    probe = decide(due, ALL, COOL, AUTO)
    assert (probe.mode, probe.method, probe.reason) == ("speculative", "draft", "probe")
    assert record_decision(due, probe).since_method == 0


def test_the_temperature_and_batch_rules_come_first() -> None:
    session = with_lookups(state(0.8, 100), lookup("ngram", 0.95, 0.9))
    assert decide(session, ALL, RequestFacts(temperature=1.0), AUTO).reason == "high_temperature"
    assert decide(session, replace(ALL, batch_full=True), COOL, AUTO).reason == "batch_full"


def test_lookup_steps_fold_into_acceptance_and_coverage() -> None:
    session = observe_lookup(SessionState(), "suffix", [(0, 0), (4, 4), (4, 1), (0, 0)], AUTO)
    (folded,) = session.lookups
    assert folded.method == "suffix" and folded.steps_seen == 4
    assert folded.drafts_proposed == 8 and folded.drafts_accepted == 5
    assert folded.proposals_seen == 4 + 2  # all four of the first passed; 1 passed and 1 failed of the second
    assert folded.coverage == pytest.approx(0.5, abs=0.02)
    assert folded.acceptance_estimate == pytest.approx(5 / 6, abs=0.02)
    assert session.acceptance_estimate is None  # the draft's evidence is its own


def test_a_lookup_floor_latches_its_method_alone() -> None:
    session = observe_lookup(SessionState(), "ngram", [(4, 0)] * 40, AUTO)
    assert session.lookups[0].low_acceptance and not session.low_acceptance


def _serve(session: SessionState) -> tuple[Decision, SessionState]:
    decision = decide(session, ALL, COOL, AUTO)
    return decision, record_decision(session, decision, AUTO.auto_k)


def test_free_batch_auto_keeps_a_latched_draft_on_offer() -> None:
    latched = with_lookups(state(0.45, 100, low_acceptance=True), lookup("ngram", 0.3, 0.1, low=True),
                           lookup("suffix", 0.3, 0.1, low=True))
    assert decide(latched, ALL, COOL, AUTO).mode == "plain"  # the floor: every method latched
    waived = decide(latched, ALL, COOL, replace(AUTO, free_batch="auto"))  # α 0.45 pays on these costs
    assert (waived.mode, waived.method, waived.reason) == ("speculative", "draft", "free_batch") and waived.k > 0


# -- shadow evidence (docs/methods.md "Shadow evidence") ------------------------------------------
SHADOW = replace(ALL, shadow_lookup=True)


def _shadow_serve(session: SessionState, shadows: dict[str, list[tuple[int, int]]],
                  worker: WorkerState = SHADOW, request: RequestFacts = COOL) -> tuple[Decision, SessionState]:
    """One request: the decision, then what it ran is left out (it is not under test) and the
    worker's shadow of each lookup method it did not run is folded as the gateway folds it."""
    decision = decide(session, worker, request, AUTO)
    session = record_decision(session, decision, auto_k=True)
    for method, steps in shadows.items():
        if decision.method != method or decision.mode != "speculative":
            session = observe_lookup(session, method, steps, AUTO, shadow=True)  # type: ignore[arg-type]
    return decision, session


def test_shadow_evidence_chooses_suffix_without_exploring() -> None:
    # The draft pays a little; suffix, never run, would pay more: its shadow says so.
    rich = {"ngram": [(8, 1), (0, 0), (0, 0)] * 10, "suffix": [(8, 8), (8, 7)] * 15}
    decisions = []
    session = state(0.6, 100)
    for _ in range(6):
        decision, session = _shadow_serve(session, rich)
        decisions.append((decision.method, decision.reason))
    assert decisions[0] == ("draft", "default")
    assert all(reason != "explore" for _, reason in decisions), decisions
    assert decisions[1:] == [("suffix", "default")] * 5
    suffix = next(s for s in session.lookups if s.method == "suffix")
    assert suffix.tried and suffix.shadow_steps == 30 and suffix.coverage == pytest.approx(1.0)


def test_a_session_whose_shadow_says_lookup_is_poor_never_runs_it() -> None:
    poor = {"ngram": [(0, 0)] * 20 + [(8, 0)] * 2, "suffix": [(0, 0)] * 25 + [(4, 1)]}
    session = state(0.8, 100)
    for _ in range(3 * max(AUTO.method_explore_every, AUTO.probe_every)):
        decision, session = _shadow_serve(session, poor)
        assert (decision.method, decision.reason) == ("draft", "default")
    ngram = next(s for s in session.lookups if s.method == "ngram")
    assert ngram.steps_seen == ngram.shadow_steps > 0  # all its evidence is shadow


def test_a_latched_lookup_method_is_not_probed_where_shadow_comes() -> None:
    session = with_lookups(state(0.8, 100), lookup("ngram", 0.2, 0.5, low=True), lookup("suffix", 0.3, 0.2),
                           since=AUTO.probe_every - 1)
    assert decide(session, ALL, COOL, AUTO).reason == "probe"  # without shadow evidence: probed
    assert decide(session, SHADOW, COOL, AUTO).reason == "default"
    # Its shadow brings it back above acceptance_resume, probes or not.
    back = observe_lookup(session, "ngram", [(8, 8)] * 40, AUTO, shadow=True)
    assert not next(s for s in back.lookups if s.method == "ngram").low_acceptance


def test_shadow_is_counted_on_only_at_t0() -> None:
    # Sampled hot, the worker sends no shadow (an unseeded T > 0 replay would be an estimate):
    # the untried lookup methods are explored as before.
    session = replace(state(0.8, 100), since_method=AUTO.method_explore_every - 1)
    assert decide(session, SHADOW, COOL, AUTO).reason == "default"
    hot = decide(session, SHADOW, RequestFacts(temperature=0.5), AUTO)
    assert (hot.method, hot.reason) == ("ngram", "explore")


def test_with_nothing_else_on_offer_a_lookup_method_runs_at_once_even_shadowed() -> None:
    policy = replace(AUTO, methods=("ngram", "suffix"))
    decision = decide(SessionState(), SHADOW, COOL, policy)
    assert (decision.mode, decision.method, decision.reason) == ("speculative", "ngram", "explore")
