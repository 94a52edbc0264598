"""Plain, chain K or token tree under K auto (policies/tree_choice.py and ``decide``): pure data only.

The curves are injected: one CPU-like worker at batch depth 1 (a plain step 10 ms of target forward
and 1 ms outside it; a chain of K verifies K + 1 tokens for 1.0-1.10x one token; draft forwards
0.1x (the first) and 0.05x), its tree verification cheap (+1% of a plain forward per node) or
expensive (+15% per node), and a draft forward over a tree level of w tokens 0.05 + 0.005 (w - 1).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from policies import (
    CostModel,
    Decision,
    PolicyConfig,
    RequestFacts,
    SessionState,
    StepMix,
    StepPath,
    TreeShape,
    WorkerState,
    choose_k,
    choose_plan,
    decide,
    expected_tree_tokens,
    objective,
    observe,
    observe_path,
    observe_steps,
    record_decision,
    tree_gain,
)
from policies.tree_choice import CELLS, EMPTY_CELL, Ranks, cell, evidence, rank_rows, tree_extra, view

CHAIN_VERIFY = (1.0, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08, 1.10)
PLAIN_MS, OVERHEAD_MS, FIRST, DRAFT, DRAFT_OVERHEAD_MS = 10.0, 1.0, 0.1, 0.05, 0.05


def cost_json(tree_slope: float | None, depths: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """A worker's ``cost_model`` with its parts; ``tree_slope``: each tree node's verification
    relative to a plain forward (None: no tree curves)."""
    row = [1.0] + [(PLAIN_MS * (CHAIN_VERIFY[k] + FIRST + (k - 1) * DRAFT) + k * DRAFT_OVERHEAD_MS + OVERHEAD_MS)
                   / (PLAIN_MS + OVERHEAD_MS) for k in range(1, len(CHAIN_VERIFY))]
    n = len(depths)
    raw: dict[str, Any] = {
        "depths": list(depths), "step_cost": [row] * n, "plain_step_ms": [PLAIN_MS] * n,
        "verify_cost": [list(CHAIN_VERIFY)] * n, "draft_cost": [DRAFT] * n, "step_overhead_ms": [OVERHEAD_MS] * n,
        "draft_overhead_ms": [DRAFT_OVERHEAD_MS] * n, "draft_first_cost": [FIRST] * n}
    if tree_slope is not None:
        raw["tree_verify_cost"] = [1.0 + tree_slope * (nodes - 1) for nodes in range(1, 33)]
        raw["tree_draft_cost"] = [DRAFT + 0.005 * (w - 1) for w in range(1, 17)]
    return raw


CHEAP = CostModel.from_json(cost_json(0.01))
DEAR = CostModel.from_json(cost_json(0.15))
CHAINS_ONLY = CostModel.from_json(cost_json(None))
# The tables were drawn at a prior of 0.47 (a more pessimistic one than the default): the
# choices below are the rules' at that prior, not the default's.
AUTO = PolicyConfig(num_speculative_tokens="auto", tree_rank_prior=0.47)
COOL = RequestFacts(temperature=0.0)


def ranks_with(beta2: float, tests: int) -> Ranks:
    """A rank table with ``tests`` rank-2 tests at depth 1 accepting ``beta2``."""
    cells = [EMPTY_CELL] * CELLS
    cells[cell(1, 2)] = (beta2, float(tests), tests)
    return tuple(cells)


PROVEN_LOW, PROVEN_HIGH = ranks_with(0.1, 200), ranks_with(0.7, 200)


def shape(text: str | None) -> TreeShape | None:
    return None if text is None else TreeShape.parse(text)


# -- the choice, table-driven -------------------------------------------------------------------------
CHOICES = [
    # (what, model, α, ranks, tree_max_nodes, explore due, expected (K, tree))
    ("middling acceptance, cheap verification: a tree", CHEAP, 0.6, (), 32, True, (4, "2+3")),
    ("low acceptance, cheap verification: still a small tree", CHEAP, 0.4, (), 32, True, (4, "2+3")),
    ("middling acceptance, extra nodes dear: a chain", DEAR, 0.6, (), 32, True, (4, None)),
    ("high acceptance: the deep chain", CHEAP, 0.9, (), 32, True, (8, None)),
    ("high acceptance, top ranks measured good: still the deeper chain", CHEAP, 0.95, PROVEN_HIGH, 32, False,
     (8, None)),
    ("nothing pays: plain", CHEAP, 0.02, (), 32, True, (0, None)),
    ("a worker without tree costs: chains", CHAINS_ONLY, 0.6, PROVEN_HIGH, 32, True, (4, None)),
    ("a worker with tree_max_nodes 0: chains", CHEAP, 0.6, PROVEN_HIGH, 0, True, (4, None)),
    ("tree_max_nodes 10: only the trees of <= 10 nodes", CHEAP, 0.6, PROVEN_HIGH, 10, False, (4, "2+3")),
    ("rank 2 measured poor: the chain, even exploring", CHEAP, 0.6, PROVEN_LOW, 32, True, (4, None)),
    ("rank 2 measured good: the bushier tree", CHEAP, 0.6, PROVEN_HIGH, 32, False, (4, "2x2+2")),
    ("no evidence and no exploration due: chains", CHEAP, 0.6, (), 32, False, (4, None)),
    ("too little evidence (31 < min_proposals) and none due: chains", CHEAP, 0.6, ranks_with(0.7, 31), 32, False,
     (4, None)),
]


@pytest.mark.parametrize(("what", "model", "alpha", "ranks", "max_nodes", "due", "expected"), CHOICES,
                         ids=[c[0] for c in CHOICES])
def test_the_choice_follows_the_curves_and_the_acceptance(what: str, model: CostModel, alpha: float, ranks: Any,
                                                          max_nodes: int, due: bool, expected: tuple[int, Any]) -> None:
    k, tree = choose_plan(model, alpha, ranks, 1, 8, max_nodes, AUTO, explore_due=due)
    assert (k, None if tree is None else str(tree)) == expected
    if tree is not None:
        assert k == tree.depth


def test_without_trees_the_choice_is_choose_k() -> None:
    for model in (CHEAP, CHAINS_ONLY):
        for alpha in (0.1, 0.5, 0.7, 0.9):
            for current in (None, 0, 3, 8):
                for policy in (AUTO, replace(AUTO, tree_shapes=())):
                    if model is CHEAP and policy.tree_shapes:
                        continue
                    plan = choose_plan(model, alpha, PROVEN_HIGH, 1, 8, 32, policy, current, explore_due=True)
                    assert plan == (choose_k(model, alpha, 1, 8, 0.05, 0.05, current), None)


def test_a_shape_deeper_than_the_workers_max_k_is_not_a_candidate() -> None:
    only_deep = replace(AUTO, tree_shapes=("2x2+4",))  # depth 6
    assert choose_plan(CHEAP, 0.6, PROVEN_HIGH, 1, 8, 32, only_deep) == (6, TreeShape.parse("2x2+4"))
    assert choose_plan(CHEAP, 0.6, PROVEN_HIGH, 1, 5, 32, only_deep) == (4, None)


def test_the_objective_prices_trees_like_chains() -> None:
    # A tree whose extra nodes and level forwards cost what the chain's cost, with rank 2 never
    # accepted, is the chain: same tokens, same price.
    flat = CostModel.from_json({**cost_json(None), "tree_verify_cost": [1.0] * 32,
                                "tree_draft_cost": [DRAFT] * 16, "draft_overhead_ms": [0.0],
                                "verify_cost": [[1.0] * 9]})
    tree = TreeShape.parse("2+3")
    tokens = expected_tree_tokens(tree, [[0.6, 0.0]] * 4)
    assert tree_gain(flat, tree, tokens, tokens, 1) == pytest.approx(objective(flat, 0.6, 4, 1, 0.05))


def test_deeper_batches_price_the_extra_nodes_at_least_at_their_batch_one_cost() -> None:
    # At depth 16 the target is compute-bound: n tokens per sequence cost about n plain forwards.
    raw = cost_json(0.01, depths=(1, 16))
    raw["verify_cost"] = [list(CHAIN_VERIFY), [float(n) for n in range(1, 10)]]
    raw["plain_step_ms"] = [PLAIN_MS, 40.0]
    deep = CostModel.from_json(raw)
    tree = TreeShape.parse("2x2+4")
    tokens = expected_tree_tokens(tree, rank_rows((), 0.6, tree, 0.47, 32))
    at_one = tree_gain(deep, tree, tokens, tokens, 1)
    # Every sequence drafting the tree at depth 16: its 16 extra nodes each, at the chain curve's
    # marginal token cost, cost more than the batch-1 extra: the gain falls.
    assert tree_gain(deep, tree, tokens, tokens, 16) < at_one
    # At batch depth 1 the extra is measured: 16 more nodes verified (+1% of a 10 ms forward
    # each, against the chain of 6's 7 tokens: 1.07), draft levels of 2 and 4 tokens, 16 draft overheads.
    batch_one_ms = PLAIN_MS * ((1.0 + 0.01 * 22) - 1.07 + 0.005 + 4 * 0.015) + 16 * DRAFT_OVERHEAD_MS
    assert tree_extra(deep, tree, 1, 1) == pytest.approx(batch_one_ms / (PLAIN_MS + OVERHEAD_MS))
    # At 16, compute-bound, each extra node costs the chain curve's marginal token (40 ms x 1 / 16
    # sequences), for each sequence drafting the tree.
    assert tree_extra(deep, tree, 16, 1) == pytest.approx(16 * 40.0 / 16 / (40.0 + OVERHEAD_MS))
    assert tree_extra(deep, tree, 16, 16) == pytest.approx(16 * tree_extra(deep, tree, 16, 1))
    assert tree_gain(deep, tree, tokens, tokens, 16, StepMix(15, 0)) < objective(deep, 0.6, 6, 16, 0.05,
                                                                                 StepMix(15, 0))


# -- hysteresis ----------------------------------------------------------------------------------------
def values_at(alpha: float) -> tuple[float, float]:
    """(best chain's objective, 2+3's) at α on CHEAP with the prior."""
    tree = TreeShape.parse("2+3")
    tokens = expected_tree_tokens(tree, rank_rows((), alpha, tree, 0.47, 32))
    return objective(CHEAP, alpha, 4, 1, 0.05), tree_gain(CHEAP, tree, tokens, tokens, 1)


@pytest.mark.parametrize("alpha", [0.5, 0.6])
def test_a_chain_session_keeps_its_chain_within_the_margin_and_switches_beyond_it(alpha: float) -> None:
    chain, tree = values_at(alpha)
    ratio = tree / chain
    assert ratio > 1.0  # the tree is better at all
    keep = replace(AUTO, tree_switch_gain=ratio - 1 + 0.005)
    switch = replace(AUTO, tree_switch_gain=max(0.0, ratio - 1 - 0.005))
    assert choose_plan(CHEAP, alpha, (), 1, 8, 32, keep, current_k=4, explore_due=True) == (4, None)
    assert choose_plan(CHEAP, alpha, (), 1, 8, 32, switch, current_k=4, explore_due=True) == (4, TreeShape.parse("2+3"))


def test_a_tree_session_keeps_its_tree_within_the_margin_and_switches_beyond_it() -> None:
    tree = TreeShape.parse("2+3")
    # At α 0.75 the chain of 6 beats 2+3 by under 1%: the tree stays; by 10% (α 0.9) it goes.
    assert choose_plan(CHEAP, 0.75, PROVEN_HIGH, 1, 8, 32, AUTO, 4, tree) == (4, tree)
    assert choose_plan(CHEAP, 0.9, ranks_with(0.3, 200), 1, 8, 32, AUTO, 4, tree) == (8, None)
    # The chain margin does not hold a tree: k_switch_gain 1 (never switch K) changes nothing here.
    assert choose_plan(CHEAP, 0.9, ranks_with(0.3, 200), 1, 8, 32, replace(AUTO, k_switch_gain=1.0), 4, tree) \
        == (8, None)


def test_ties_go_to_the_chain() -> None:
    # Rank 2 never accepted and a tree that costs nothing extra: the tree's value is the chain's.
    flat = CostModel.from_json({**cost_json(None), "tree_verify_cost": [1.0] * 32, "tree_draft_cost": [DRAFT] * 16,
                                "draft_overhead_ms": [0.0], "verify_cost": [[1.0] * 9]})
    never = ranks_with(0.0, 200)
    chain_4 = objective(flat, 0.6, 4, 1, 0.05)
    tree = TreeShape.parse("2+3")
    assert tree_gain(flat, tree, expected_tree_tokens(tree, [[0.6, 0.0]] * 4), 0, 1) == pytest.approx(chain_4)
    assert choose_plan(flat, 0.6, never, 1, 8, 32, replace(AUTO, tree_shapes=("2+3",))) == (4, None)


# -- decide, exploration and the prior -----------------------------------------------------------------
WORKER = WorkerState(batch_depth=0, batch_full=False, max_k=8, cost=CHEAP, tree_max_nodes=32)


def run(session: SessionState, worker: WorkerState = WORKER, policy: PolicyConfig = AUTO,
        temperature: float = 0.0) -> tuple[Decision, SessionState]:
    decision = decide(session, worker, RequestFacts(temperature), policy)
    return decision, record_decision(session, decision, policy.auto_k)


def test_decide_gives_a_tree_its_depth_and_says_so_in_the_header() -> None:
    session = SessionState(acceptance_estimate=0.6, acceptance_weight=100, proposals_seen=100, ranks=PROVEN_HIGH)
    decision, after = run(session)
    assert decision == Decision("speculative", 4, "default", TreeShape.parse("2x2+2"))
    assert decision.header == "speculative; tree=2x2+2; reason=default"
    assert (after.auto_k, str(after.auto_tree), after.since_tree) == (4, "2x2+2", 0)
    assert Decision("speculative", 4, "default").header == "speculative; k=4; reason=default"


def test_exploration_on_the_prior_is_bounded() -> None:
    # No rank-2 evidence: the prior says 2+3 pays at α 0.6, but it runs only every 4th request.
    session = SessionState(acceptance_estimate=0.6, acceptance_weight=100, proposals_seen=100)
    trees = []
    for _ in range(12):
        decision, session = run(session)
        trees.append(decision.tree is not None)
        assert decision.k == 4  # the chain of 4, or 2+3 (depth 4)
    assert trees == [False, False, False, True] * 3
    every_other = replace(AUTO, tree_explore_every=2)
    session, trees = SessionState(acceptance_estimate=0.6, acceptance_weight=100, proposals_seen=100), []
    for _ in range(6):
        decision, session = run(session, policy=every_other)
        trees.append(decision.tree is not None)
    assert trees == [False, True] * 3


def test_exploration_only_where_the_prior_says_it_pays() -> None:
    session = SessionState(acceptance_estimate=0.9, acceptance_weight=100, proposals_seen=100)
    for _ in range(12):
        decision, session = run(session)
        assert decision.tree is None


def test_the_prior_is_used_only_without_evidence() -> None:
    tree = TreeShape.parse("3+1")
    prior = rank_rows((), 0.6, tree, 0.5, 32)
    assert prior == [[0.6, 0.3, 0.15], [0.6]]
    # 200 tests of rank 2 at depth 1: measured there; rank 3 untested: the prior from rank 2's value.
    assert rank_rows(ranks_with(0.7, 200), 0.6, tree, 0.5, 32) == [[0.6, 0.7, 0.35], [0.6]]
    # Too few tests anywhere: still the prior.
    assert rank_rows(ranks_with(0.7, 31), 0.6, tree, 0.5, 32) == prior
    # Evidence at depth 2 only is pooled into depth 1's row.
    cells = list(ranks_with(0.0, 0))
    cells[cell(2, 2)] = (0.4, 50.0, 50)
    assert rank_rows(tuple(cells), 0.6, TreeShape.parse("3+1"), 0.5, 32)[0] == [0.6, 0.4, 0.2]


def test_every_rule_before_the_cost_model_still_applies_to_tree_sessions() -> None:
    session = SessionState(acceptance_estimate=0.6, acceptance_weight=100, proposals_seen=100, ranks=PROVEN_HIGH)
    assert run(session, temperature=1.5)[0] == Decision("plain", 0, "high_temperature")
    assert run(session, replace(WORKER, batch_full=True))[0] == Decision("plain", 0, "batch_full")
    low = replace(session, acceptance_estimate=0.3, low_acceptance=True)
    assert run(low)[0] == Decision("plain", 0, "low_acceptance")
    # A fixed speculative worker runs its own K: never a tree.
    fixed = replace(WORKER, serves_plain=False)
    assert run(session, fixed)[0] == Decision("speculative", 8, "default")
    # A fixed K (not auto) runs chains.
    assert run(session, policy=replace(AUTO, num_speculative_tokens=5))[0] == Decision("speculative", 5, "default")


# -- what a session folds ------------------------------------------------------------------------------
def test_a_tree_step_folds_its_rank_one_tests_into_alpha_and_every_test_into_the_ranks() -> None:
    tree = TreeShape.parse("2x2+3")
    # Level 1: rank 1 taken; level 2: rank 1 rejected, rank 2 taken; level 3: rejected.
    path = StepPath(tree, (1, 2, 0))
    after = observe_path(SessionState(), path, AUTO)
    assert after.acceptance_estimate == pytest.approx(1 / 3) and after.proposals_seen == 3
    assert view(after.ranks) == [
        {"depth": 1, "rank": 1, "beta": 1.0, "weight": 1.0, "tests": 1},
        {"depth": 2, "rank": 1, "beta": 0.0, "weight": 1.0, "tests": 1},
        {"depth": 2, "rank": 2, "beta": 1.0, "weight": 1.0, "tests": 1},
        {"depth": 3, "rank": 1, "beta": 0.0, "weight": 1.0, "tests": 1}]
    assert evidence(after.ranks) == 1


def test_chains_fold_rank_one_by_depth_and_alpha_as_before() -> None:
    chain = observe(SessionState(), 4, 2, AUTO)
    same = observe_path(SessionState(), StepPath.of_chain(4, 2), AUTO)
    assert (chain.acceptance_estimate, chain.proposals_seen) == (same.acceptance_estimate, same.proposals_seen)
    assert chain.ranks == same.ranks
    assert [(c["depth"], c["rank"], c["beta"]) for c in view(chain.ranks)] == [(1, 1, 1.0), (2, 1, 1.0), (3, 1, 0.0)]
    grouped = observe_steps(SessionState(), iter([(4, 2, 3)]), AUTO)
    assert [(c["depth"], c["tests"]) for c in view(grouped.ranks)] == [(1, 3), (2, 3), (3, 3)]
    assert evidence(grouped.ranks) == 0


def test_a_workers_acceptance_folds_alpha_alone() -> None:
    path = StepPath(TreeShape.parse("2x2+3"), (1, 2, 0))
    for folded, alone in ((observe(SessionState(), 4, 2, AUTO), observe(SessionState(), 4, 2, AUTO, ranks=False)),
                          (observe_path(SessionState(), path, AUTO),
                           observe_path(SessionState(), path, AUTO, ranks=False)),
                          (observe_steps(SessionState(), [(4, 2, 3)], AUTO),
                           observe_steps(SessionState(), [(4, 2, 3)], AUTO, ranks=False))):
        assert folded.ranks and alone == replace(folded, ranks=())


def test_policy_tree_fields_are_validated() -> None:
    from policies import PolicyConfigError

    with pytest.raises(PolicyConfigError) as bad:
        PolicyConfig.from_mapping({"tree_shapes": ["2x2+3", "+4", "x"], "tree_rank_prior": 2,
                                   "tree_explore_every": 0, "tree_switch_gain": -1})
    assert sorted(p.field for p in bad.value.problems) == [
        "tree_explore_every", "tree_rank_prior", "tree_shapes", "tree_switch_gain"]
    assert PolicyConfig.from_mapping({"tree_shapes": []}).trees == ()
    assert PolicyConfig.from_mapping({"tree_shapes": ["2x2+3", 3]}).trees == (TreeShape((2, 2, 1, 1, 1)),
                                                                              TreeShape((3,)))


def test_the_cost_model_reads_tree_curves_both_or_neither() -> None:
    assert CHEAP.tree is not None and len(CHEAP.tree.verify) == 32
    assert CostModel.from_json({**cost_json(0.01), "tree_draft_cost": None}).tree is None
    with pytest.raises(ValueError, match="tree_verify_cost"):
        CostModel.from_json({**cost_json(0.01), "tree_verify_cost": [1.0, -1.0]})


# -- the gateway's side: the directive a decision sends, the path a step reports ---------------------
def test_the_directive_carries_the_tree_and_a_reported_path_is_checked_against_it() -> None:
    from gateway.accounting import step_path
    from gateway.admission import directive_for
    from workers.api.wire import StepReport

    tree = TreeShape.parse("2x2+3")
    directive = directive_for(Decision("speculative", 5, "default", tree), AUTO, step_log=True)
    assert directive.to_json() == {"k": 5, "max_batch": 64, "batch_resume": 56, "cost_rule": True, "step_log": True,
                                   "tree": "2x2+3"}
    assert "tree" not in directive_for(Decision("speculative", 4, "default"), AUTO).to_json()
    report = StepReport.from_json({"proposed": 5, "accepted": 2, "batch_depth": 1, "k": 5, "tokens": 3,
                                   "tree": "2x2+3", "path": [2, 1, 0]})
    assert report is not None and step_path(report) == StepPath(tree, (2, 1, 0))
    # A path that does not fit its tree (rank 3 of 2 children), or a chain step: no path (folded as a chain).
    assert step_path(replace(report, path=(3, 0))) is None
    assert step_path(replace(report, tree=None, path=None)) is None
