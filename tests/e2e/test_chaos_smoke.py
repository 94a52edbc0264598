"""bench.chaos and bench.resume run end to end and print their figures (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.harness import bench_json

CHAOS_FIGURES = {"requests_sent", "completed", "retried_transparently", "migrated_mid_stream", "failed_clear_error",
                 "lost", "multiple_outcomes", "duplicated_outputs", "max_kill_to_ready_s", "honest_harmed_by_hostile",
                 "hostile_sent", "hostile_not_4xx", "kills", "exact_precision", "mismatch_samples", "outages",
                 "failure_reasons", "admission_waited"}


@pytest.mark.slow
def test_bench_chaos_smoke_json() -> None:
    result, _ = bench_json("-m", "bench.chaos", "--smoke", "--json", timeout=900)
    # The whole result as the failure's message (pytest cuts a dict's repr at 240 characters):
    # the mismatch samples and precisions are what a failed run leaves to go on.
    log_tail = Path(result["gateway_log"]).read_text(errors="replace").splitlines()[-40:]
    whole = json.dumps(result, indent=1) + "\ngateway log, last lines:\n" + "\n".join(log_tail)
    assert set(result) >= CHAOS_FIGURES
    assert result["requests_sent"] > 0 and result["hostile_sent"] > 0
    # Every request ended in exactly one final outcome, and none was lost or harmed.
    assert result["lost"] == 0 and result["multiple_outcomes"] == 0, whole
    assert result["completed"] + result["failed_clear_error"] == result["requests_sent"], whole
    assert result["duplicated_outputs"] == 0 and result["honest_harmed_by_hostile"] == 0, whole
    assert result["hostile_not_4xx"] == 0, whole
    # Every failure is listed with the class it was counted under and why.
    failures = [r for r in result["failure_reasons"] if r["what"] != "wrong_output"]
    assert len(failures) == result["failed_clear_error"] + result["lost"], whole
    assert all(r["class"] in ("outage", "killed", "hostile", "unexplained") and r["why"] for r in failures), whole
    # The workers stay up in turn (a kill waits until all are ready): nothing should fail.
    assert result["failed_clear_error"] == 0, whole
    assert result["gateway_exit_code"] == 0


def test_bench_resume_quick_json() -> None:
    result, _ = bench_json("-m", "bench.resume", "--quick", "--json", timeout=600)
    assert [p["dtype"] for p in result["precisions"]] == ["bfloat16", "float32"]
    for precision in result["precisions"]:
        assert precision["resumes_compared"] > 0, precision
        if precision["verification_bit_identical"]:
            # Where verification is bit-identical (what workers.exact serves), a resumed prefill
            # computes what the undisturbed run did, bit for bit: every resume is exact.
            assert precision["resumes_identical"] == precision["resumes_compared"], precision
            assert precision["cache_identical"] == precision["resumes_compared"], precision
        elif precision["greedy_min_logit_gap"] > 1e-4:
            # Elsewhere (float32): where the best token leads the second by far more than
            # rounding (~1e-6 of a logit), a resumed greedy generation cannot differ.
            assert precision["greedy_identical"] == precision["greedy_compared"], precision
