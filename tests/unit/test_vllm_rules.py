"""The vLLM plugin's pure rules and the gateway's reading of vLLM's per-request metrics.

No vLLM needed: ``specgate_vllm.rules`` imports nothing from it, and the wire helpers live
in ``workers.api.wire``. The plugin is a separate distribution (no dependency on specgate),
so its batch latch restates the policy's; a property test checks the two agree.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies import step_depth
from workers.api.generation import SpecSteps
from workers.api.wire import (
    VLLM_BATCH_RESUME,
    VLLM_MAX_BATCH,
    VLLM_SPEC_K,
    Directive,
    StepReport,
    vllm_step_report,
    vllm_xargs,
)

RULES_PATH = Path(__file__).resolve().parents[2] / "workers" / "vllm_plugin" / "specgate_vllm" / "rules.py"


def _load_rules() -> ModuleType:
    spec = importlib.util.spec_from_file_location("specgate_vllm_rules_under_test", RULES_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


rules = _load_rules()


def test_the_gateway_sends_the_plugins_names() -> None:
    assert (VLLM_SPEC_K, VLLM_MAX_BATCH, VLLM_BATCH_RESUME) == (rules.SPEC_K_ARG, rules.MAX_BATCH_ARG,
                                                                 rules.BATCH_RESUME_ARG)
    assert vllm_xargs(Directive(2, 64, 56)) == {"spec_k": 2, "spec_max_batch": 64, "spec_batch_resume": 56}


@pytest.mark.parametrize(("extra", "expected"), [
    (None, 3), ({}, 3), ({"spec_k": -1}, 3), ({"spec_k": 0}, 0), ({"spec_k": 1}, 1), ({"spec_k": 3}, 3),
    ({"spec_k": 5}, 3), ({"spec_k": 2.0}, 2), ({"spec_k": True}, 3), ({"spec_k": "2"}, 3), ({"other": 1}, 3),
])
def test_requested_k(extra: dict[str, Any] | None, expected: int) -> None:
    assert rules.requested_k(extra, 3) == expected


@pytest.mark.parametrize(("extra", "expected"), [
    (None, None), ({"spec_max_batch": 8}, None), ({"spec_max_batch": 8, "spec_batch_resume": 6}, (8, 6)),
    ({"spec_max_batch": 8, "spec_batch_resume": 9}, (8, 8)), ({"spec_max_batch": 0, "spec_batch_resume": 0}, None),
    ({"spec_max_batch": True, "spec_batch_resume": 1}, None),
])
def test_thresholds(extra: dict[str, Any] | None, expected: tuple[int, int] | None) -> None:
    assert rules.thresholds(extra) == expected


def test_latch_hysteresis() -> None:
    latch = rules.BatchLatch(max_batch=4, batch_resume=2)
    trace = [latch.update(depth) for depth in (1, 4, 5, 4, 3, 2, 1, 3, 5)]
    assert trace == [False, False, True, True, True, True, False, False, True]


@given(st.lists(st.integers(0, 12), max_size=40), st.integers(1, 10), st.integers(1, 10))
def test_latch_agrees_with_the_policy(depths: list[int], max_batch: int, resume: int) -> None:
    resume = min(resume, max_batch)
    latch = rules.BatchLatch(max_batch=max_batch, batch_resume=resume)
    policy_latched = False
    for depth in depths:
        plugin = latch.update(depth)
        decision = step_depth(3, depth, policy_latched, max_batch, resume)
        policy_latched = decision.batch_full
        assert plugin == policy_latched and (decision.k == 0) == plugin


def test_summary_histogram_becomes_late_steps() -> None:
    # The example: K = 3, histogram [2, 0, 5, 6]: 13 steps, 28 accepted, 35 tested.
    chunk = {"usage": {}, "metrics": {"speculative_decoding": {
        "acceptance_histogram": [2, 0, 5, 6], "num_spec_steps": 13, "num_accepted_draft_tokens": 28,
        "num_draft_tokens": 39, "num_spec_tokens": 3}}}
    report = vllm_step_report(chunk, 3)
    assert report == StepReport(0, 0, 0, 0, 0, (SpecSteps(3, 0, 2), SpecSteps(3, 2, 5), SpecSteps(3, 3, 6)))
    tested = sum(g.count * (g.accepted + (g.accepted < g.proposed)) for g in report.late_steps)
    assert (sum(g.count * g.accepted for g in report.late_steps), tested) == (28, 35)
    # A request that asked for K = 2 on an engine of K = 3 drafted 2 per step.
    two = vllm_step_report({"metrics": {"speculative_decoding": {"acceptance_histogram": [1, 2, 3, 0],
                                                                  "num_spec_tokens": 3}}}, 2)
    assert two is not None and two.late_steps == (SpecSteps(2, 0, 1), SpecSteps(2, 1, 2), SpecSteps(2, 2, 3))


def test_detailed_metrics_are_exact_per_step() -> None:
    chunk = {"metrics": {"speculative_decoding": {"acceptance_histogram": [1, 1, 0, 1], "num_spec_tokens": 3,
                                                  "per_step_drafted": [3, 3, 1], "per_step_accepted": [3, 0, 1]}}}
    report = vllm_step_report(chunk, 3)
    assert report is not None
    assert report.late_steps == (SpecSteps(1, 1, 1), SpecSteps(3, 0, 1), SpecSteps(3, 3, 1))


@pytest.mark.parametrize("chunk", [{}, {"metrics": None}, {"metrics": {"speculative_decoding": "x"}},
                                   {"metrics": {"speculative_decoding": {"acceptance_histogram": ["a"]}}}])
def test_missing_or_malformed_metrics(chunk: dict[str, Any]) -> None:
    report = vllm_step_report(chunk, 3)
    assert report is None or report.late_steps == ()


def test_late_steps_round_trip_through_the_wire() -> None:
    report = StepReport(0, 0, 2, 0, 1, (SpecSteps(3, 1, 4),))
    assert StepReport.from_json(report.to_json()) == report
