"""The sim's lookup methods: the calibration reproduces the published speed-ups on the roofline,
lookup steps run no draft forward, a step without a match is plain, and the config stays
backward compatible (docs/sim.md, "Methods")."""

from __future__ import annotations

import random

import pytest

from workers.api.sim_config import (
    ASSUMED_LOOKUP_COVERAGE,
    DEFAULT_ACCEPTANCE,
    DEFAULT_LOOKUP,
    LOOKUP_SUMMARY_RATE,
    PUBLISHED_K,
    PUBLISHED_LOOKUP_SPEEDUP,
    AcceptanceTable,
    SimConfig,
    SimConfigError,
    vllm_rate,
)
from workers.engines.sim.roofline import SimBatch, SimSeq, StepCost, expected_tokens

CONTEXT = 1024


def modelled_speedup(method: str, category: str, k: int = PUBLISHED_K) -> float:
    """Tokens per second over plain at batch 1 on the sim's own step times, in expectation."""
    cost = StepCost(SimConfig())
    cell = DEFAULT_LOOKUP[method][category]
    alpha = cell.bands[0][1]
    plain, _ = cost.step_time([0], [CONTEXT])
    hit, _ = cost.step_time([k], [CONTEXT], lookup=[True])
    tokens = cell.coverage * expected_tokens(alpha, k) + (1 - cell.coverage)
    seconds = cell.coverage * hit + (1 - cell.coverage) * plain
    return (tokens / seconds) / (1 / plain)


@pytest.mark.parametrize(("method", "category"),
                         [(m, c) for m, cells in PUBLISHED_LOOKUP_SPEEDUP.items() for c in cells])
def test_fitted_cells_reproduce_the_published_speedups(method: str, category: str) -> None:
    assert modelled_speedup(method, category) == pytest.approx(PUBLISHED_LOOKUP_SPEEDUP[method][category], rel=0.01)
    assert DEFAULT_LOOKUP[method][category].coverage == ASSUMED_LOOKUP_COVERAGE[method][category]


def test_summaries_are_the_published_failure_case() -> None:
    for method in ("ngram", "suffix"):
        alpha = DEFAULT_LOOKUP[method]["summary"].bands[0][1]
        assert vllm_rate(alpha, PUBLISHED_K) == pytest.approx(LOOKUP_SUMMARY_RATE, abs=1e-6)


def test_lookup_alpha_falls_with_temperature_and_suffix_beats_ngram() -> None:
    table = AcceptanceTable()
    for category in ("chat", "code", "agent", "rag", "summary"):
        cold, hot = table.lookup_alpha("suffix", category, 0.0), table.lookup_alpha("suffix", category, 1.0)
        assert hot[0] < cold[0] and hot[1] == cold[1]
        assert modelled_speedup("suffix", category) >= modelled_speedup("ngram", category)


def test_a_lookup_step_runs_no_draft_forward() -> None:
    cost = StepCost(SimConfig())
    plain, _ = cost.step_time([0], [CONTEXT])
    lookup, lookup_verify = cost.step_time([8], [CONTEXT], lookup=[True])
    draft, draft_verify = cost.step_time([8], [CONTEXT])
    assert lookup == lookup_verify == draft_verify  # verification only: memory-bound, as a plain step at batch 1
    assert lookup == pytest.approx(plain)
    assert draft > lookup
    # Mixed: the draft forwards run over the draft's sequences alone.
    mixed, _ = cost.step_time([4, 4], [CONTEXT, CONTEXT], lookup=[True, False])
    only_draft, _ = cost.step_time([4, 0], [CONTEXT, CONTEXT])
    assert mixed - only_draft == pytest.approx(cost.step_time([4, 4], [CONTEXT] * 2, lookup=[True, True])[0]
                                               - cost.step_time([0, 0], [CONTEXT] * 2)[0])


def test_a_step_without_a_match_is_plain() -> None:
    batch = SimBatch(SimConfig(), max_slots=4, max_k=8)
    batch.add(SimSeq("s", 8, 0.9, remaining=100_000, prefill=0, rng=random.Random(1), lookup=True, coverage=0.3))
    steps = [batch.step() for _ in range(2000)]
    proposing = [s for s in steps if s is not None and s.results[0].k > 0]
    assert 0.25 < len(proposing) / len(steps) < 0.35
    for step in steps:
        assert step is not None
        r = step.results[0]
        assert (r.k, r.accepted, r.emitted) == (0, 0, 1) or r.k == 8
    assert batch.acceptance.evidenced is None  # lookup evidence stays out of the draft's estimate


def test_a_lookup_sequence_ignores_a_tree() -> None:
    from policies.tree import TreeShape

    seq = SimSeq("s", 4, 0.9, 10, 0, random.Random(0), tree=TreeShape.parse("2x2+3"), lookup=True, coverage=1.0)
    assert seq.tree is None and seq.k == 4


def test_new_categories_are_read_and_old_configs_keep_working() -> None:
    table = AcceptanceTable()
    assert table.category("[code_edit] rename x") == "code_edit"
    assert table.category("[code] def f") == "code"
    assert table.category("[agent] tool output") == "agent"
    assert table.category("no tag") == "chat"
    assert set(DEFAULT_ACCEPTANCE) >= {"json", "code", "math", "chat", "agent", "code_edit", "rag", "summary"}
    # A config with its own draft bands keeps them; lookup categories it lacks draft as its default.
    config = SimConfig.from_mapping({"acceptance": {"chat": [[None, 0.5]]}})
    assert set(config.acceptance.bands) == {"chat"}
    assert config.acceptance.alpha("agent", 0.0) == 0.5
    assert config.acceptance.lookup_alpha("suffix", "agent", 0.0) == table.lookup_alpha("suffix", "agent", 0.0)


def test_lookup_cells_are_configurable_and_bad_ones_named() -> None:
    config = SimConfig.from_mapping({"lookup": {"ngram": {"chat": {"coverage": 0.1, "acceptance": [[None, 0.2]]}}}})
    assert config.acceptance.lookup_alpha("ngram", "chat", 0.5) == (0.2, 0.1)
    default = AcceptanceTable()
    assert config.acceptance.lookup_alpha("suffix", "chat", 0.0) == default.lookup_alpha("suffix", "chat", 0.0)
    for raw, field in [({"draft": {}}, "lookup.draft"),
                       ({"ngram": {"chat": {"coverage": 2, "acceptance": [[None, 0.2]]}}},
                        "lookup.ngram.chat.coverage"),
                       ({"ngram": {"chat": {"coverage": 0.5, "acceptance": [[None, 3]]}}},
                        "lookup.ngram.chat.acceptance")]:
        with pytest.raises(SimConfigError) as caught:
            SimConfig.from_mapping({"lookup": raw})
        assert caught.value.field == field
