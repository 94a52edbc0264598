"""bench.engine runs end to end and prints the figures the issue asks for (no timing asserted)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.fleet_sim import KINDS
from bench.overhead import target_lines
from bench.policy_real import live_prompt
from bench.prompts import TASK_CLASSES
from tests.e2e.harness import REPO
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.projections import bf16_prepacking_available
from workers.text import TextCodec

REQUIRED = {"alpha_t0", "best_k", "speedup_b1", "bound_b1", "c", "tok_s_plain_b1", "tok_s_spec_b1",
            "alpha_by_temperature", "verify_cost_by_tokens"}


@pytest.mark.slow
def test_bench_engine_smoke_json() -> None:
    run = subprocess.run([sys.executable, "-m", "bench.engine", "--smoke", "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=300, check=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(result) >= REQUIRED
    assert {"tok_s_b8_plain", "tok_s_b8_spec", "tok_s_b8_auto", "predicted_speedup_b1", "cpu"} <= set(result)
    assert len(result["auto_ratio_by_round_b8"]) == 1 and result["auto_ratio_by_round_b8"][0] > 0  # --smoke: 1 round
    assert result["tok_s_b8_plain_again"] > 0 and len(result["plain_again_ratio_by_round_b8"]) == 1
    # The cost model a worker would build, and the precision it chose (served by --dtype auto).
    assert result["dtype"] == result["precision_choice"]["target"] == result["cost_model"]["precision"]["target"]
    assert result["cost_model"]["depths"][-1] == 16 and result["predicted_speedup_b1"] > 0
    # Against the fastest plain configuration: where the served kernels multiply both ways, the
    # other way decoded plain too, and the ratio is to the faster of the two.
    assert result["products"] == result["cost_model"]["precision"]["products"]
    other = result["tok_s_plain_b1_other_products"]
    kernel = rowgemm.load()
    assert (other is not None) == (result["target_prepacked"] and result["dtype"] == "float32"
                                   and kernel is not None and kernel.dot_products)
    fastest = max(result["tok_s_plain_b1"], other or 0.0)
    assert result["speedup_b1_vs_fastest_plain"] == pytest.approx(result["tok_s_spec_b1"] / fastest, abs=2e-3)
    assert 1 <= result["best_k"] <= 4
    assert 0.0 <= result["alpha_t0"] <= 1.0 and result["c"] > 0
    assert set(result["alpha_by_temperature"]) == {"0.0", "0.5", "0.8", "1.0"}
    assert set(result["alpha_seeded_coupled_by_temperature"]) == {"0.5", "0.8", "1.0"}
    assert "best K=" in run.stdout
    assert result["greedy_compared_runs"] == 3 * 4
    # Prepacked: bfloat16 on oneDNN, or float32 on workers/engines/embedded/kernels/rowgemm.py's kernel, as the
    # measurement chose.
    assert result["target_prepacked"] == result["cost_model"]["precision"]["prepacked"]
    if result["dtype"] == "bfloat16":
        assert result["target_prepacked"] == bf16_prepacking_available()
    if result["precision_choice"]["exact"]:
        # Exactness on the real models (deterministic, not a timing): at T=0 every K reproduced
        # plain decoding token for token on every prompt, where the chosen configuration
        # verified bit-identically at start-up. (float32 promises closeness only.)
        assert result["greedy_identical_runs"] == result["greedy_compared_runs"]


def _json_run(*args: str, timeout: int = 240) -> tuple[dict[str, Any], str]:
    run = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         check=True)
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result, run.stdout


@pytest.mark.slow
def test_bench_policy_smoke_json(tmp_path: Path) -> None:
    result, stdout = _json_run("-m", "bench.policy", "--smoke", "--json", "--out", str(tmp_path))
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
    result, stdout = _json_run("-m", "bench.policy_methods", "--quick", "--json")
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
    summary = result["summary"]
    assert set(summary["winner_by_category"]) == categories
    assert set(summary["winner_by_category"].values()) <= {"draft", "ngram", "suffix"}
    assert summary["choice_over_best_single"] > 0 and "choice ÷ best single" in stdout


@pytest.mark.slow
def test_bench_tasks_smoke_json() -> None:
    """The real pair through real gateways: every class at T=0 and T=1, figures in range, and at
    T=1 auto follows the temperature rule or its free_batch waiver."""
    assert (REPO / "models/smollm2-135m-instruct-q4_1/model.safetensors").is_file(), "run make install"
    result, stdout = _json_run("-m", "bench.tasks", "--smoke", "--json", timeout=300)
    assert result["cpu"] and result["command"] == "python -m bench.tasks --smoke --json"
    assert result["configurations"] == ["plain", "K=5", "auto"] and set(result["temperatures"]) == {"0", "1"}
    for rows in result["temperatures"].values():
        assert list(rows) == list(TASK_CLASSES)
        for row in rows.values():
            assert set(row["tokens_per_s"]) == {"plain", "K=5", "auto"}
            assert all(rate > 0 for rate in row["tokens_per_s"].values())
            assert 0.0 <= row["alpha_k5"] <= 1.0 and row["drafts"]["K=5"]["tested"] > 0
            assert row["below_floor"] == (row["alpha_k5"] < 0.60) and row["best_fixed"] == "K=5"
            assert row["better"] in ("plain", "K=5") and row["auto_over_better"] > 0
            assert row["met"] == (row["auto_over_better"] >= 0.97)
            assert 0.0 <= row["auto"]["plain_step_share"] <= 1.0 and row["requests"] == 1
    for row in result["temperatures"]["0"].values():
        assert not any("high_temperature" in decision for decision in row["auto"]["decisions"])
    # At T=1 the temperature rule decides, or config.yaml's free_batch: auto waives it where the
    # worker's costs say this session's acceptance pays (docs/tasks.md): never another reason.
    for row in result["temperatures"]["1"].values():
        (decision,) = row["auto"]["decisions"]
        assert decision == "plain (high_temperature)" or decision.endswith("(free_batch)"), decision
        assert (row["auto"]["tested"] == 0) == decision.startswith("plain")
    same, prompts = result["t0_same_text_prompts"]
    assert prompts == len(TASK_CLASSES) and 0 <= same <= prompts
    assert result["gateway_counts_match_workers"]  # the gateway counted the drafts the answers reported
    assert "auto÷better" in stdout and f"CPU: {result['cpu']}" in stdout

@pytest.mark.slow
def test_bench_overhead_smoke_json() -> None:
    result, stdout = _json_run("-m", "bench.overhead", "--smoke", "--json")
    for key in ("added_p50_ms", "added_p99_ms", "rps_ratio_c32", "stream256_ratio_vs_vllm_router"):
        assert key in result
    assert result["rps_ratio_c32"] > 0
    assert set(result["gateway_cpu_us_per_chunk"]) == {"instant", "paced"}
    assert (result["stream256_ratio_vs_vllm_router"] is None) == (result["vllm_router"] is None)
    assert "added latency through specgate" in stdout
    # The floor path (bench/relay_floor.py) answered every request: its latency and CPU are figures.
    assert result["aiohttp_floor_cpu_us_per_request"] > 0 and "aiohttp_floor" in result["latency_ms"]
    assert result["gateway_cpu_us_per_request"] > 0
    # The polling gateway (server.busy_poll_s) is a path of its own, with its own target line.
    assert "specgate_busy_poll" in result["latency_ms"] and result["busy_poll_gateway_cpu_us_per_request"] > 0
    assert set(result["busy_poll_gateway_cpu_us_per_chunk"]) == {"instant", "paced"}
    # The targets are ratios to vllm-router in the same run; judged only where it ran.
    assert set(result["targets"]) == {"added_p50_le_2.5x_vllm_router", "stream256_ge_1x_vllm_router"}
    if result["vllm_router"] is None:
        assert set(result["targets"].values()) == {None}
    assert "added p50, specgate / vllm-router" in stdout
    assert result["cpu"] and f"CPU: {result['cpu']}" in stdout


def test_overhead_targets_are_ratios_to_vllm_router() -> None:
    base = {"added_p50_ms": 0.5, "vllm_router_added_p50_ms": 0.2, "stream256_ratio_vs_vllm_router": 1.0}
    assert target_lines(base) == {"added_p50_le_2.5x_vllm_router": True, "stream256_ge_1x_vllm_router": True}
    assert target_lines({**base, "added_p50_ms": 0.51, "stream256_ratio_vs_vllm_router": 0.99}) == {
        "added_p50_le_2.5x_vllm_router": False, "stream256_ge_1x_vllm_router": False}
    # vllm-router absent, or its added latency no latency (at or below zero on a loaded machine): not judged.
    for router in (None, -0.02, 0.0):
        lines = target_lines({**base, "vllm_router_added_p50_ms": router, "stream256_ratio_vs_vllm_router": None})
        assert set(lines.values()) == {None}


def test_bench_timeline_lines_up_every_hand_off() -> None:
    result, stdout = _json_run("-m", "bench.timeline", "--requests", "40", "--json")
    # Every request on each path got every mark (the probes found their functions).
    assert result["gateway_requests_matched"] == result["direct_requests_matched"] == 40
    assert all(v > 0 for v in result["gateway_phases_us"].values()) and len(result["gateway_phases_us"]) == 7
    assert all(v > 0 for v in result["direct_phases_us"].values()) and len(result["direct_phases_us"]) == 3
    assert set(result["added_by_part_us"]) == {"gateway_own_work", "extra_hops", "worker_extra"}
    assert "added at p50" in stdout and result["cpu"]


def test_bench_stacks_runs_one_stack() -> None:
    result, stdout = _json_run("-m", "bench.stacks", "--requests", "30", "--rounds", "1", "--seconds", "0.5", "--json")
    this = result["this"]
    assert "ref" not in result and this["gateway_p50_ms"] > 0 and this["direct_p50_ms"] > 0 and result["cpu"]
    for load in ("c32", "c32_64", "c32_stream4"):
        assert this[load]["rps"] > 0 and this[load]["gateway_cpu_us_per_request"] >= 0
    assert "added p50" in stdout and result["started_first"] == "this"


def test_bench_stacks_can_start_the_ref_stack_first() -> None:
    """The stack started first runs slower (bench/stacks.py): a comparison can run both ways."""
    result, _ = _json_run("-m", "bench.stacks", "--ref-repo", str(REPO), "--ref-first", "--requests", "10",
                          "--rounds", "1", "--seconds", "0.3", "--json")
    assert result["started_first"] == "ref" and result["repos"]["ref"] == str(REPO)
    for name in ("this", "ref"):
        assert result[name]["gateway_p50_ms"] > 0 and result[name]["c32"]["rps"] > 0


def test_bench_draft_vocab_quick_json() -> None:
    result, stdout = _json_run("-m", "bench.draft_vocab", "--quick", "--json")
    assert set(result["c_by_vocab"]) == {"1", "8"}
    for costs in result["c_by_vocab"].values():
        assert set(costs) == {"4096", "2048", "1024", "512"} and all(c > 0 for c in costs.values())
    coverage = result["coverage_by_vocab"]
    assert 0 < coverage["512"] <= coverage["1024"] <= coverage["2048"] <= 1
    assert "held-out code tokens inside" in stdout
    agreement = result["greedy_agreement_by_vocab"]
    assert set(agreement) == {"4096", "2048", "1024", "512"} and all(0 < a <= 1 for a in agreement.values())


@pytest.mark.skipif(rowgemm.load() is None,
                    reason="workers/engines/embedded/kernels/rowgemm.py does not build here (no C compiler or AVX2)")
def test_bench_kernels_quick_json() -> None:
    result, stdout = _json_run("-m", "bench.kernels", "--quick", "--json")
    wide = {"eight_wide"} if rowgemm.wide_tiles() else set()
    kernel = rowgemm.load()
    products = {"products"} if kernel is not None and kernel.dot_products else set()
    assert set(result["projections_ms"]) == {"prefetch", "no_prefetch"} | wide | products
    assert tuple(result["served"]["defines"]) in rowgemm.PREFETCH_CHOICES
    for name, times in result["projections_ms"].items():
        assert set(times) == {"1", "2", "3", "4"} and all(ms > 0 for ms in times.values()), name
        assert result["rows_over_one"][name]["1"] == 1.0
    assert result["draft_forward_ms"]["after_target"] > 0 and result["draft_forward_ms"]["cached"] > 0
    assert result["cpu"] and "draft forward at batch 1" in stdout
    mixed = result["mixed_steps_depth8"]  # packed rows: a mixed step's shapes, timed, and as priced
    assert set(mixed) == {"1 each", "4 each", "2x4 + 6x1", "1x6 + 7x1", "6 each"}
    assert mixed["1 each"]["over_one"] == mixed["1 each"]["priced_over_one"] == 1.0
    assert all(m["ms"] > 0 and m["priced_over_one"] > 0 for m in mixed.values())
    drafting = result["greedy_drafting_k3"]
    assert set(drafting) == {"one_call", "per_position"}
    assert all(f["drafting_ms"] > 0 and f["step_ms"] > f["drafting_ms"] and f["tok_s"] > 0 for f in drafting.values())


def test_bench_kauto_mix_json() -> None:
    result, stdout = _json_run("-m", "bench.kauto_mix", "--json")
    assert set(result["depths"]) == {"16", "24", "32"}
    for row in result["depths"].values():
        assert row["gain_uniform"][0] == row["gain_mixed"][0] == row["gain_sim"][0] == 1.0  # plain is the unit
        # The finding the README states: with a third of the batch drafting, deeper K pays, and
        # the mixed price comes close to the sim's own step times (never deeper).
        assert row["best_k_uniform"] < row["best_k_mixed"] <= row["best_k_sim"], row
    assert result["depths"]["16"]["best_k_mixed"] == result["depths"]["16"]["best_k_sim"]
    assert "draft K (cost model)" in stdout and "draft K (sim)" in stdout


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



def test_bench_wakeup_measures_every_placement() -> None:
    result, stdout = _json_run("-m", "bench.wakeup", "--round-trips", "200", "--json")
    for family in ("tcp", "unix"):
        placements = result[family]
        assert {"same_cpu", "unpinned"} <= set(placements)
        assert all(p["round_trip_us"] > 0 and p["send_us"] > 0 for p in placements.values())
        if result["cpus"] >= 2:
            assert "other_cpu" in placements and f"{family}_cross_cpu_wakeups_us" in result
    assert result["cpu"] and "round trip" in stdout


@pytest.mark.slow
def test_bench_methods_quick_json() -> None:
    """The real pair through real gateways, plain and the per-session choice: every session's
    request answered, the figures in range; no speed asserted."""
    assert (REPO / "models/smollm2-135m-instruct-q4_1/model.safetensors").is_file(), "run make install"
    result, stdout = _json_run("-m", "bench.methods", "--quick", "--configs", "plain,choice", "--json", timeout=300)
    assert result["bench"] == "methods" and result["cpu"] and set(result["configs"]) == {"plain", "choice"}
    for name, rows in result["figures"].items():
        assert set(rows) == {"code_edit", "rag", "agent", "chat"}
        for row in rows.values():
            assert row["requests"] == 1 and row["completion_tokens"] == result["max_tokens"] and row["tok_s"] > 0
            assert sum(row["methods"].values()) == 1 and sum(row["ended_on"].values()) == 1
        if name == "plain":
            assert all(row["methods"] == {"plain": 1} for row in rows.values())
    for clock in ("wall", "cpu"):
        assert set(result["targets"][clock]["met"]) == {"lookup_1.5x_plain", "choice_1.1x_best_single",
                                                        "choice_0.97x_hindsight"}
    assert f"CPU: {result['cpu']}" in stdout


@pytest.mark.slow
def test_bench_prefix_smoke_json() -> None:
    """Every gateway configuration served every turn of both workloads; no speed asserted."""
    result, stdout = _json_run("-m", "bench.prefix", "--smoke", "--json")
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
