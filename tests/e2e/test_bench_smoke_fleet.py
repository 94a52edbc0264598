"""The simulated fleets' benches: bench.policy, bench.policy_methods, bench.prefix, bench.sim_fit
and bench.estimator run end to end and print their figures (no speed asserted)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench.fleet_sim import KINDS
from bench.policy_real import live_prompt
from tests.e2e.harness import REPO, bench_json
from workers.text import TextCodec


@pytest.mark.slow
def test_bench_policy_smoke_json(tmp_path: Path) -> None:
    result, stdout = bench_json("-m", "bench.policy", "--smoke", "--json", "--out", str(tmp_path))
    policies = {"always", "never", "vllm_rule", "bare_thresholds", "specgate", "specgate_auto", "specgate_cost"}
    assert policies <= set(result["goodput"])
    for rows in result["goodput"].values():
        assert set(rows) == {"light", "steady", "burst", "recovery", "overall"}
        assert all(value > 0 for value in rows.values())
    assert result["winner_overall"] in result["goodput"]
    assert result["goodput"]["never"]["overall"] > 0 and result["detail"]["never"]["overall"]["spec_share"] == 0
    assert (tmp_path / "policy_goodput.png").stat().st_size > 0
    assert "goodput (output tokens/s" in stdout


@pytest.mark.slow
def test_bench_policy_methods_quick_json() -> None:
    """Every configuration served every request of every category; no speed asserted."""
    result, stdout = bench_json("-m", "bench.policy_methods", "--quick", "--json")
    assert result["bench"] == "policy_methods" and result["cpu"]
    configs = result["configs"]
    assert set(configs) == {"draft", "ngram", "suffix", "choice"}
    categories = {"chat", "code", "agent", "code_edit", "rag", "summary"}
    expected = result["sessions_per_kind"] * result["turns"]
    for name, config in configs.items():
        assert set(config["categories"]) == categories
        for row in config["categories"].values():
            assert row["requests"] == expected and row["completion_tokens"] == expected * result["max_tokens"]
            assert row["tok_s"] > 0
        ran = set(config["overall"]["methods"]) - {"plain"}
        assert ran <= set(config["methods"]), name  # a single-method gateway ran that method (or plain) only
        routes = config["overall"]["routes"]
        assert sum(routes.values()) == len(categories) * expected, (name, routes)  # every request placed once
        if len(config["methods"]) == 1:  # one kind of step everywhere: nothing to move for
            assert routes.get("method", 0) == 0, (name, routes)
    summary = result["summary"]
    assert set(summary["winner_by_category"]) == categories
    assert set(summary["winner_by_category"].values()) <= {"draft", "ngram", "suffix"}
    assert summary["choice_over_best_single"] > 0 and "choice ÷ best single" in stdout


def test_live_prompts_are_as_long_as_the_virtual_fleets() -> None:
    """bench.policy --real sends text; the sim counts its tokens. A prompt drawn as n tokens
    must tokenize to about n, or the live run prefills more than the virtual one it is checked
    against."""
    codec = TextCodec.from_model_dir(REPO / "models" / "demo-target")
    for kind in KINDS:
        for seed in range(5):
            drawn = random.Random(seed).randint(*kind.prompt_tokens)
            ids = codec.encode(live_prompt(kind, random.Random(seed)))
            assert drawn <= len(ids) <= drawn + 6, (kind.name, drawn, len(ids))


@pytest.mark.slow
def test_bench_prefix_smoke_json() -> None:
    """Every gateway configuration served every turn of both workloads; no speed asserted."""
    result, stdout = bench_json("-m", "bench.prefix", "--smoke", "--json")
    assert result["bench"] == "prefix" and result["cpu"]
    turns = result["turns"]
    for workload in ("shared", "hotspot"):
        runs = result[workload]
        assert runs["capacity_sessions_per_s"] > 0
        for config in ("cache_aware", "least_loaded"):
            run = runs[config]
            assert run["failed"] == 0 and run["turns"] == run["sessions"] * turns, (workload, config)
            assert run["output_tok_s"] > 0 and run["ttft_p90_s"] >= run["ttft_p50_s"] > 0
            assert sum(run["routes"].values()) == run["turns"]
            assert 0 < run["cached_token_share"] < 1  # later turns found their history cached
        assert "prefix" not in runs["least_loaded"]["routes"]  # route_index_blocks 0: no prefix routing
    assert result["hotspot"]["cache_aware"]["queue_samples"] > 0
    assert set(result["targets"]) == {"shared_ttft_p90_ratio", "shared_tok_s_ratio", "hotspot_sample_share",
                                      "hotspot_tok_s_ratio"}
    assert "target shared_ttft_p90_ratio" in stdout
    assert 0 < result["cache_tokens_held_max"] <= result["prefix_cache_tokens"]


def test_bench_sim_fit_json() -> None:
    """The sim's fit to the published GPU figures: fractions of the hardware, a K per depth."""
    result, _ = bench_json("-m", "bench.sim_fit", "--quick", "--json")
    fitted = result["fitted"]
    assert 0 < fitted["bandwidth_fraction"] <= 1 and 0 < fitted["flops_fraction"] <= 1
    assert result["reproduced"]["spec_tok_s_b1"] > result["reproduced"]["plain_tok_s_b1"] > 0
    assert set(result["best_k"]) == set(result["gain_k5"]) and all(
        0 <= k <= 8 for ks in result["best_k"].values() for k in ks)


def test_bench_estimator_quick_json() -> None:
    """The acceptance estimate on simulated streams and on real sessions through a gateway, whose
    counts match the workers' (the ground truth the estimate is judged against)."""
    result, _ = bench_json("-m", "bench.estimator", "--quick", "--json")
    assert result["cpu"] and result["calibration"]["sessions"] > 0
    assert all(0 <= row["mean_at_32"] <= 1 and 0 <= row["mean_at_128"] <= 1 for row in result["calibration"]["means"])
    assert set(result["calibration"]["targets"]) and all("met" in t for t in result["calibration"]["targets"].values())
    real = result["real"]
    assert real["gateway_counts_match_workers"] is True and real["judged_sessions"] > 0
    assert 0 <= real["false_fallback_share"] <= 1 and real["max_abs_error"] >= real["median_abs_error"] >= 0
