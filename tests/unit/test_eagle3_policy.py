"""The eagle3 method in the policy (issue #54): its evidence kept per method, priced on the worker's
measured head costs (``policies.cost.head_step_cost``), chosen per session by the same rules as
the other methods: table-driven, pure data in and a Decision out."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies import CostModel, PolicyConfig, SessionState, StepParts, WorkerState, decide, observe_lookup
from policies.cost import head_step_cost, lookup_step_cost, step_cost
from policies.lookup import LookupState, lookup_state
from policies.methods import is_lookup, keeps_own_evidence
from tests.policy_data import COOL, state
from tests.unit.cost_curves import AMX_VERIFY, curve

PARTS = StepParts((10.0,), (AMX_VERIFY,), (0.2,), (0.0,), (0.0,))
# A draft forward at 0.2 of a plain step, the head's first forward at 0.04 and each later one at 0.02.
MODEL = CostModel((1,), (curve(AMX_VERIFY, 0.2),), PARTS, head=(0.04, 0.02))
POLICY = PolicyConfig(num_speculative_tokens="auto", methods=("draft", "eagle3"), tree_shapes=())
WORKER = WorkerState(batch_depth=0, batch_full=False, max_k=8, cost=MODEL, methods=("draft", "eagle3"))


def head_evidence(alpha: float, drafts: int = 256) -> LookupState:
    return LookupState("eagle3", alpha, float(drafts), drafts, drafts, int(drafts * alpha), False,
                       float(drafts // 4), float(drafts // 4), drafts // 4)


def test_the_head_is_a_model_method_with_evidence_of_its_own() -> None:
    assert not is_lookup("eagle3") and keeps_own_evidence("eagle3") and not keeps_own_evidence("draft")


def test_a_head_step_costs_the_verification_and_the_heads_forwards() -> None:
    for k in range(1, 9):
        assert head_step_cost(MODEL, 1, k) == pytest.approx(lookup_step_cost(MODEL, 1, k) + 0.04 + 0.02 * (k - 1))
        assert head_step_cost(MODEL, 1, k) < step_cost(MODEL, 1, k)
    assert head_step_cost(replace(MODEL, head=None), 1, 3) == step_cost(MODEL, 1, 3)  # unmeasured: as the draft


def test_a_new_session_explores_the_head_then_keeps_it_where_it_pays() -> None:
    session = replace(state(0.55, 100), since_method=1)
    explored = decide(session, WORKER, COOL, POLICY)
    assert (explored.mode, explored.method, explored.reason) == ("speculative", "eagle3", "explore")
    tried = replace(session, lookups=(head_evidence(0.8),), since_method=0)
    chosen = decide(tried, WORKER, COOL, POLICY)
    assert (chosen.mode, chosen.method, chosen.reason) == ("speculative", "eagle3", "default")
    assert chosen.header.startswith("speculative; method=eagle3; k=")


def test_a_session_on_the_head_that_turns_to_chat_changes_method_or_falls_back() -> None:
    """Its head evidence falls: where the draft model promises more it moves there; where neither
    pays, plain (no_gain), and the latch at the floor stops the head as it stops the draft."""
    on_head = replace(state(0.5, 100), lookups=(head_evidence(0.85),), method="eagle3")
    assert decide(on_head, WORKER, COOL, POLICY).method == "eagle3"
    policy = replace(POLICY, acceptance_half_life=32)
    fell = on_head
    for _ in range(40):  # chat: a step accepts one draft, the next none (α 1/3 per tested draft)
        fell = observe_lookup(fell, "eagle3", [(5, 1), (5, 0)], policy)
    head = lookup_state(fell.lookups, "eagle3")
    assert head.acceptance_estimate is not None and head.acceptance_estimate < 0.55 and head.low_acceptance
    to_draft = decide(replace(fell, acceptance_estimate=0.8), WORKER, COOL, policy)
    assert (to_draft.mode, to_draft.method) == ("speculative", "draft")
    neither = decide(replace(fell, acceptance_estimate=0.1, acceptance_weight=200.0, low_acceptance=True,
                             plain_since_probe=0), WORKER, COOL, policy)
    assert neither.mode == "plain"


def test_a_worker_without_the_head_never_gets_it() -> None:
    worker = replace(WORKER, methods=("draft",))
    session = SessionState()
    for _ in range(5):
        decision = decide(session, worker, COOL, POLICY)
        assert decision.method in (None, "draft")


def test_deeper_steps_weigh_the_heads_forwards_less() -> None:
    """The head runs per sequence: its time is the same at any depth, a smaller share of a deeper
    (slower) plain step."""
    deep = CostModel((1, 8), (curve(AMX_VERIFY, 0.2), curve(AMX_VERIFY, 0.2)),
                     StepParts((10.0, 20.0), (AMX_VERIFY, AMX_VERIFY), (0.2, 0.2), (0.0, 0.0), (0.0, 0.0)),
                     head=(0.04, 0.02))
    assert head_step_cost(deep, 1, 3) == pytest.approx(lookup_step_cost(deep, 1, 3) + 0.08)
    assert head_step_cost(deep, 8, 3) == pytest.approx(lookup_step_cost(deep, 8, 3) + 0.04)


def test_the_head_is_explored_where_lookups_learn_from_shadows() -> None:
    """At T=0 a worker replays the lookup methods on every answer, so they are never explored; the
    head has no shadow and is explored as the draft is."""
    policy = replace(POLICY, methods=("draft", "eagle3", "ngram", "suffix"))
    worker = replace(WORKER, methods=("draft", "eagle3", "ngram", "suffix"), shadow_lookup=True)
    session = replace(state(0.55, 100), since_method=1)
    decision = decide(session, worker, COOL, policy)
    assert (decision.method, decision.reason) == ("eagle3", "explore")


# The quantized target's verification on the AMD EPYC (AVX2): n = 1..9 rows against one
# (bench.kernels --blocks: 9.6, 12.6, 13.5, 21.6 ms for 1-4 rows, 38.1 for 9; 5-8 between).
Q4_1_VERIFY = (1.0, 1.31, 1.41, 2.25, 2.6, 2.95, 3.3, 3.6, 3.97)


@pytest.mark.parametrize(("verify", "worker_alpha", "largest"), [
    (Q4_1_VERIFY, None, 3),  # dear verification, no evidence: a short trial
    (Q4_1_VERIFY, 0.2, 1),  # the worker's head evidence says it barely pays: the cheapest trial
    (AMX_VERIFY, None, 8),  # flat verification: a long trial costs little more than a short one
])
def test_a_trial_runs_at_the_k_its_prior_prices_best(verify: tuple[float, ...], worker_alpha: float | None,
                                                     largest: int) -> None:
    """A method never tried is explored at the K the cost model prices best on its prior, not at
    the worker's largest K: on a dequantizing target K = 8 verifies at four plain steps' cost."""
    parts = StepParts((10.0,), (verify,), (0.2,), (0.0,), (0.0,))
    model = CostModel((1,), (curve(verify, 0.2),), parts, head=(0.04, 0.02))
    worker = replace(WORKER, cost=model, lookups=() if worker_alpha is None else (head_evidence(worker_alpha),))
    explored = decide(replace(state(0.55, 100), since_method=1), worker, COOL, POLICY)
    assert (explored.method, explored.reason) == ("eagle3", "explore")
    assert 1 <= explored.k <= largest
    if verify is AMX_VERIFY:
        assert explored.k >= 4
    fixed = decide(replace(state(0.55, 100), since_method=1), worker, COOL,
                   replace(POLICY, num_speculative_tokens=5))
    assert (fixed.reason, fixed.k) == ("explore", 5)  # a fixed K is the operator's: trials run it
