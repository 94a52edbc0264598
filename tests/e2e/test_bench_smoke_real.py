"""bench.tasks, bench.methods and bench.serve_memory: the real pair through real gateways, end to
end (no speed asserted)."""

from __future__ import annotations

import pytest

from bench.prompts import TASK_CLASSES
from tests.e2e.harness import REPO, bench_json


@pytest.mark.slow
def test_bench_tasks_smoke_json() -> None:
    """The real pair through real gateways: every class at T=0 and T=1, figures in range, and at
    T=1 auto follows the temperature rule or its free_batch waiver."""
    assert (REPO / "models/smollm2-135m-instruct-q4_1/model.safetensors").is_file(), "run make install"
    result, stdout = bench_json("-m", "bench.tasks", "--smoke", "--json", timeout=300)
    assert result["cpu"] and result["command"] == "python -m bench.tasks --smoke --json"
    # The pair's workers load make serve's head (models/smollm2-eagle3): its K=5 runs too.
    assert result["configurations"] == ["plain", "K=5", "eagle3 K=5", "auto"]
    assert set(result["temperatures"]) == {"0", "1"}
    for rows in result["temperatures"].values():
        assert list(rows) == list(TASK_CLASSES)
        for row in rows.values():
            assert set(row["tokens_per_s"]) == {"plain", "K=5", "eagle3 K=5", "auto"}
            assert all(rate > 0 for rate in row["tokens_per_s"].values())
            assert 0.0 <= row["alpha_k5"] <= 1.0 and row["drafts"]["K=5"]["tested"] > 0
            assert row["below_floor"] == (row["alpha_k5"] < 0.60) and row["best_fixed"] in ("K=5", "eagle3 K=5")
            assert row["better"] in ("plain", "K=5", "eagle3 K=5") and row["auto_over_better"] > 0
            assert row["eagle3_alpha_k5"] is not None and 0.0 <= row["eagle3_alpha_k5"] <= 1.0
            assert row["met"] == (row["auto_over_better"] >= 0.97)
            assert 0.0 <= row["auto"]["plain_step_share"] <= 1.0 and row["requests"] == 1
    for row in result["temperatures"]["0"].values():
        assert not any("high_temperature" in decision for decision in row["auto"]["decisions"])
    # At T=1 the temperature rule decides, or config.yaml's free_batch: auto waives it where the
    # worker's costs say this session's acceptance pays (docs/tasks.md): never another reason.
    for row in result["temperatures"]["1"].values():
        (decision,) = row["auto"]["decisions"]
        assert decision == "plain (high_temperature)" or decision.endswith("(free_batch)"), decision
        # A plain decision drafts nothing; a K may still decode every step plain, where the worker's
        # step costs say the draft's catch-up would not pay (on the quantized target, often).
        assert row["auto"]["tested"] == 0 if decision.startswith("plain") else (
            row["auto"]["tested"] > 0 or row["auto"]["plain_step_share"] == 1.0), row["auto"]
    same, prompts = result["t0_same_text_prompts"]
    assert prompts == len(TASK_CLASSES) and 0 <= same <= prompts
    assert result["gateway_counts_match_workers"]  # the gateway counted the drafts the answers reported
    assert "auto÷better" in stdout and f"CPU: {result['cpu']}" in stdout


@pytest.mark.slow
def test_bench_methods_quick_json() -> None:
    """The real pair through real gateways, plain and the per-session choice: every session's
    request answered, the figures in range; no speed asserted."""
    assert (REPO / "models/smollm2-135m-instruct-q4_1/model.safetensors").is_file(), "run make install"
    result, stdout = bench_json("-m", "bench.methods", "--quick", "--configs", "plain,choice", "--json", timeout=300)
    assert result["bench"] == "methods" and result["cpu"] and set(result["configs"]) == {"plain", "choice"}
    for name, rows in result["figures"].items():
        assert set(rows) == {"code_edit", "rag", "agent", "chat"}
        for row in rows.values():
            assert row["requests"] == 1 and row["completion_tokens"] == result["max_tokens"] and row["tok_s"] > 0
            assert sum(row["methods"].values()) == 1 and sum(row["ended_on"].values()) == 1
            assert 0.0 <= row["copyable"] <= 1.0
        if name == "plain":
            assert all(row["methods"] == {"plain": 1} for row in rows.values())
    for clock in ("wall", "cpu"):
        assert set(result["targets"][clock]["met"]) == {"lookup_1.5x_plain", "choice_1.1x_best_single",
                                                        "choice_0.97x_hindsight"}
    assert f"CPU: {result['cpu']}" in stdout


def test_bench_serve_memory_json() -> None:
    """make serve's deployment: every worker's resident memory read, at idle and after a request."""
    result, stdout = bench_json("-m", "bench.serve_memory", "--requests", "1", "--json", timeout=300)
    assert result["bench"] == "serve_memory" and result["cpu"] and result["requests"] == 1
    assert len(result["workers"]) == 2  # config.yaml's two workers
    for rss in result["workers"].values():
        # torch, the models and the caches: about 550 MiB with the target's blocks, 1,100 with float32.
        assert 400 < rss["idle_mib"] <= rss["after_requests_mib"] + 64
    assert set(result["targets"]) == {"worker_rss_mib"}
    assert 0 < result["ready_s"] <= result["all_workers_ready_s"]
    assert "MiB resident at idle" in stdout and f"CPU: {result['cpu']}" in stdout
