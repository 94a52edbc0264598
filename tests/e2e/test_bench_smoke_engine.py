"""bench.engine, bench.kernels, bench.draft_vocab, bench.kauto_mix and bench.prefill_chunks run
end to end and print the figures their issues ask for (no timing asserted)."""

from __future__ import annotations

import pytest

from tests.e2e.harness import bench_json
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.projections import bf16_prepacking_available

REQUIRED = {"alpha_t0", "best_k", "speedup_b1", "bound_b1", "c", "tok_s_plain_b1", "tok_s_spec_b1",
            "alpha_by_temperature", "verify_cost_by_tokens"}


@pytest.mark.slow
def test_bench_engine_smoke_json() -> None:
    result, stdout = bench_json("-m", "bench.engine", "--smoke", "--json", timeout=300)
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
    assert "best K=" in stdout
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



def test_bench_draft_vocab_quick_json() -> None:
    result, stdout = bench_json("-m", "bench.draft_vocab", "--quick", "--json")
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
    result, stdout = bench_json("-m", "bench.kernels", "--quick", "--json")
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
    result, stdout = bench_json("-m", "bench.kauto_mix", "--json")
    assert set(result["depths"]) == {"16", "24", "32"}
    for row in result["depths"].values():
        assert row["gain_uniform"][0] == row["gain_mixed"][0] == row["gain_sim"][0] == 1.0  # plain is the unit
        # The finding the README states: with a third of the batch drafting, deeper K pays, and
        # the mixed price comes close to the sim's own step times (never deeper).
        assert row["best_k_uniform"] < row["best_k_mixed"] <= row["best_k_sim"], row
    assert result["depths"]["16"]["best_k_mixed"] == result["depths"]["16"]["best_k_sim"]
    assert "draft K (cost model)" in stdout and "draft K (sim)" in stdout


def test_bench_prefill_chunks_json() -> None:
    """A cold prefill on the real pair, one-shot and in the chunks prefix reuse takes."""
    result, _ = bench_json("-m", "bench.prefill_chunks", "--lengths", "64", "--reps", "1", "--json")
    assert result["bench"] == "prefill_chunks" and result["cpu"] and list(result["prefill"]) == ["64"]
    row = result["prefill"]["64"]
    assert row["one_shot_ms"] > 0
    assert {key for key in row if key.endswith("_over_one_shot")} and all(
        value > 0 for key, value in row.items() if key.endswith("_over_one_shot"))
