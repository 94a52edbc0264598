"""The sim's token trees: the acceptance model's calibration, its path draws, a tree step's time
and the tree cost curves a sim worker publishes. Pure: no process."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from policies.tree import StepPath, TreeShape, expected_tree_tokens, level_pass
from workers.api.sim_config import PUBLISHED_K, SimConfig, SimConfigError, vllm_rate
from workers.engines.sim.engine import COST_CONTEXT, derived_cost_report
from workers.engines.sim.roofline import SimBatch, SimSeq, StepCost, sample_accepted
from workers.engines.sim.trees import (
    ASSUMED_TREE,
    CALIBRATED_ALPHA,
    CHAIN_ACCEPTANCE,
    RANK_RATIO,
    TREE_ACCEPTANCE,
    acceptance,
    betas_for,
    calibrate,
    sample_path,
)


def test_calibration_reproduces_both_published_figures() -> None:
    chain = TreeShape.chain(PUBLISHED_K)
    assert acceptance(chain, betas_for(CALIBRATED_ALPHA)) == pytest.approx(CHAIN_ACCEPTANCE, abs=1e-6)
    assert vllm_rate(CALIBRATED_ALPHA, PUBLISHED_K) == pytest.approx(0.762, abs=1e-6)
    assert acceptance(ASSUMED_TREE, betas_for(CALIBRATED_ALPHA)) == pytest.approx(TREE_ACCEPTANCE, abs=1e-6)
    assert str(ASSUMED_TREE) == "2x2+3" and ASSUMED_TREE.depth == PUBLISHED_K
    # The documented numbers (docs/sim.md).
    assert pytest.approx(0.9107, abs=1e-4) == CALIBRATED_ALPHA
    assert pytest.approx(0.6991, abs=1e-4) == RANK_RATIO
    assert betas_for(CALIBRATED_ALPHA)[1] == pytest.approx(0.6367, abs=1e-4)


def test_rank_acceptances_fall_with_rank_and_rank_one_is_alpha() -> None:
    for alpha in (0.0, 0.3, 0.6, 0.9, 1.0):
        betas = betas_for(alpha)
        assert betas[0] == alpha
        assert all(b >= c for b, c in itertools.pairwise(betas))


def test_calibration_refuses_an_unreachable_tree_figure() -> None:
    with pytest.raises(ValueError):
        calibrate(tree=0.99)


@pytest.mark.parametrize("shape", ["2x2+3", "3+2", "4", "2x2x2", "+4"])
@pytest.mark.parametrize("alpha", [0.6, 0.91])
def test_sampled_paths_are_well_formed_and_match_the_model(shape: str, alpha: float) -> None:
    tree = TreeShape.parse(shape)
    betas = betas_for(alpha)
    rng = random.Random(7)
    n = 20_000
    levels = [0] * (tree.depth + 1)
    rank_hits: dict[tuple[int, int], int] = {}
    for _ in range(n):
        path = sample_path(rng, tree, betas)
        assert isinstance(path, StepPath) and path.shape == tree
        assert 1 <= len(path.ranks) <= tree.depth
        assert all(0 < r <= k for r, k in zip(path.ranks[:-1], tree.branching, strict=False))
        assert path.ranks[-1] == 0 or len(path.ranks) == tree.depth
        levels[path.accepted] += 1
        rank_hits[(1, path.ranks[0])] = rank_hits.get((1, path.ranks[0]), 0) + 1
    mean = sum(i * c for i, c in enumerate(levels)) / n
    assert mean + 1 == pytest.approx(expected_tree_tokens(tree, [betas]), abs=0.05)
    # Level 1: rank r with beta_r after the ranks before it failed.
    miss = 1.0
    for r in range(1, tree.branching[0] + 1):
        assert rank_hits.get((1, r), 0) / n == pytest.approx(miss * betas[r - 1], abs=0.015)
        miss *= 1 - betas[r - 1]
    assert rank_hits.get((1, 0), 0) / n == pytest.approx(1 - level_pass(betas, tree.branching[0]), abs=0.015)


def test_a_chain_shaped_tree_draws_what_the_chain_sampler_draws() -> None:
    rng_a, rng_b = random.Random(3), random.Random(4)
    alpha, n = 0.8, 20_000
    tree = sum(sample_path(rng_a, TreeShape.chain(5), betas_for(alpha)).accepted for _ in range(n)) / n
    chain = sum(sample_accepted(rng_b, math.log(alpha), 5) for _ in range(n)) / n
    assert tree == pytest.approx(chain, abs=0.05)


def test_tree_cost_curves_are_monotone_and_start_at_the_chain_curves() -> None:
    config = SimConfig()
    report = derived_cost_report(config, 8, 256)
    verify, draft = report.tree_verify_cost, report.tree_draft_cost
    assert verify is not None and draft is not None
    assert len(verify) == config.tree_max_nodes + 1 and len(draft) == config.tree_max_nodes
    assert all(b >= a for a, b in itertools.pairwise(verify))
    assert all(b >= a for a, b in itertools.pairwise(draft))
    assert report.verify_cost is not None and report.draft_cost is not None
    # n tokens of a tree row cost what n chain tokens do: the first entries are the chain's row.
    assert verify[0] == 1.0
    assert verify[:len(report.verify_cost[0])] == report.verify_cost[0]
    assert draft[0] == report.draft_cost[0]
    assert list(report.to_json()["tree_verify_cost"]) == list(verify)


def test_verification_curve_turns_compute_bound_where_the_roofline_says() -> None:
    # A wider deployment's curve (the default's stays memory-bound past 33 tokens): grows, and
    # only past the roofline's crossover tokens = memory time × FLOP/s / (2 × params).
    config = replace(SimConfig(), efficiency=replace(SimConfig().efficiency, flops_fraction=0.02))
    cost = StepCost(config)
    target = config.target
    memory = (target.weight_bytes + COST_CONTEXT * target.kv_bytes_per_token) / cost.bandwidth
    crossover = memory * cost.flops / (2 * target.params)
    verify = derived_cost_report(config, 8, 256).tree_verify_cost
    assert verify is not None
    flat = [n for n in range(1, len(verify) + 1) if verify[n - 1] == 1.0]
    assert max(flat) == int(crossover)
    assert verify[-1] > verify[-2] > 1.0


def test_trees_off_publishes_no_tree_curves() -> None:
    config = SimConfig.from_mapping({"tree_max_nodes": 0})
    report = derived_cost_report(config, 8, 256)
    assert report.tree_verify_cost is None and report.tree_draft_cost is None
    with pytest.raises(SimConfigError) as err:
        SimConfig.from_mapping({"tree_max_nodes": 99})
    assert err.value.field == "tree_max_nodes"


def test_tree_step_time_counts_every_node_and_each_level_width() -> None:
    cost = StepCost(SimConfig())
    config = SimConfig()
    assert config.draft is not None
    tree = TreeShape.parse("2x2+3")
    total, verify = cost.step_time([5], [1024], 0, [tree])
    assert verify == pytest.approx(cost.forward(config.target, tree.nodes + 1, 1024))
    widths = (1, 2, 4, 4, 4)
    drafts = sum(cost.forward(config.draft, w, 1024) for w in widths)
    assert total == pytest.approx(verify + drafts)
    # A chain as a tree costs what the chain does.
    assert cost.step_time([5, 3], [1024, 512], 0, [TreeShape.chain(5), None]) == \
        pytest.approx(cost.step_time([5, 3], [1024, 512]))


def test_batch_steps_trees_and_reports_paths() -> None:
    batch = SimBatch(SimConfig(), 8, 8)
    tree = TreeShape.parse("3+2")
    batch.add(SimSeq("t", 0, 0.7, 40, 16, random.Random(1), tree=tree))
    batch.add(SimSeq("c", 4, 0.7, 40, 16, random.Random(2)))
    emitted = {"t": 0, "c": 0}
    while batch.has_work:
        step = batch.step()
        assert step is not None
        for r in step.results:
            emitted[r.seq.request_id] += r.emitted
            if r.seq.request_id == "t" and r.k > 0:
                assert r.path is not None and r.accepted == r.path.accepted and r.k == r.path.shape.depth
                assert r.path.shape.branching == tree.branching[:r.k]
            else:
                assert r.path is None
    assert emitted == {"t": 40, "c": 40}


def test_a_tree_the_deployment_cannot_verify_runs_as_its_chain() -> None:
    config = SimConfig.from_mapping({"tree_max_nodes": 4})
    batch = SimBatch(config, 8, 8)
    seq = SimSeq("t", 0, 0.7, 40, 16, random.Random(1), tree=TreeShape.parse("2x2+3"))
    batch.add(seq)
    assert seq.tree is None and seq.k == 5
    small = SimSeq("s", 0, 0.7, 40, 16, random.Random(1), tree=TreeShape.parse("2+1"))
    batch.add(small)
    assert small.tree == TreeShape.parse("2+1") and small.k == 2
