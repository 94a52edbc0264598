"""The worker's cost model: precision choice, the start-up measurement, its cache, online refinement."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import workers.costs.cache as cost_cache
import workers.engines.embedded.measurement.measure as costs_measure
import workers.engines.embedded.measurement.settings as measure_settings
import workers.engines.embedded.measurement.steps as costs_engine
from policies import CostModel, catch_up_pays, whole_step_costs
from workers.costs.cache import CostCache, cpu_label
from workers.costs.cost_report import (
    CostReport,
    PrecisionCandidate,
    PrecisionChoice,
    depth_grid,
    report_from_forward_times,
)
from workers.costs.online import ONLINE_WEIGHT, STALE_STEPS, OnlineCosts, StepTimeCosts
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.measurement.measure import measure, measure_or_load
from workers.engines.embedded.measurement.precision import choose_precision, torch_threads_serving
from workers.engines.embedded.measurement.settings import MeasureSettings

MODELS = Path(__file__).resolve().parents[2] / "models"


def candidate(target: str, tok_s_b1: float, tok_s_full: float, bit_identical: bool,
              prepacked: bool = False) -> PrecisionCandidate:
    return PrecisionCandidate(target, prepacked, bit_identical, 10.0, 20.0, tok_s_b1, 3, tok_s_full)


def settings(**overrides: object) -> MeasureSettings:
    base: dict[str, object] = {"target": MODELS / "demo-target", "draft": MODELS / "demo-draft", "max_slots": 4,
                               "max_k": 4}
    return MeasureSettings(**{**base, **overrides})  # type: ignore[arg-type]


@pytest.mark.parametrize(("candidates", "exact", "chosen"), [
    # The fastest bit-identical configuration, even where an inexact one is faster...
    ([candidate("bfloat16", 90, 150, True), candidate("float32", 120, 300, False)], True, "bfloat16"),
    # ...and whichever dtype that is, prepacked or not: measurement decides, not CPU flags.
    ([candidate("bfloat16", 90, 150, True, prepacked=True), candidate("float32", 95, 160, True)], True, "float32"),
    ([candidate("bfloat16", 200, 900, True, prepacked=True), candidate("float32", 95, 160, True)], True, "bfloat16"),
    # exact: false admits the faster inexact one.
    ([candidate("bfloat16", 90, 150, True), candidate("float32", 120, 300, False)], False, "float32"),
    # None bit-identical: the fastest serves (and the reason says so).
    ([candidate("bfloat16", 90, 150, False), candidate("float32", 120, 300, False)], True, "float32"),
    # The score weighs batch-1 latency and full-batch capacity alike (geometric mean).
    ([candidate("bfloat16", 130, 100, True), candidate("float32", 100, 200, True)], True, "float32"),
])
def test_precision_follows_measured_throughput(candidates: list[PrecisionCandidate], exact: bool, chosen: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for flags in (True, False):  # what the CPU claims changes nothing
        monkeypatch.setattr(measure_settings, "bf16_prepacking_available", lambda flags=flags: flags)
        pick, why = choose_precision(candidates, settings(exact=exact))
        assert pick.target == chosen
        assert ("not bit-identical" in why) == any(not c.bit_identical for c in candidates)
    if not any(c.bit_identical for c in candidates):
        assert "no configuration verifies bit-identically" in why


def test_a_configured_dtype_is_kept_and_flagged() -> None:
    pick, why = choose_precision([candidate("float32", 1, 1, False)], settings(dtype="float32"))
    assert pick.target == "float32" and "configured" in why and "not bit-identical" in why


@pytest.fixture
def one_thread() -> Iterator[None]:
    """As a worker runs (workers.threads: 1); two threads on this shared 2-core machine spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_measurement_on_the_demo_models(one_thread: None) -> None:
    report = measure(settings(budget_s=0.5, threads=1))
    assert report.depths == depth_grid(4) == (1, 2, 4)
    assert report.source == "measured" and report.cpu == cpu_label() and report.measure_s > 0
    assert all(len(row) == 5 and row[0] == 1.0 and all(c > 0 for c in row) for row in report.step_cost)
    assert report.precision is not None
    assert {c.target for c in report.precision.candidates} == {"bfloat16", "float32"}
    chosen = next(c for c in report.precision.candidates if c.target == report.precision.target)
    assert report.precision.exact == chosen.bit_identical
    assert 5 <= report.measured_points <= report.total_points == 15
    # The step's work outside the forwards: measured on the engine, never negative, not shrinking
    # with depth, and inside step_cost as policies.cost.whole_step_costs adds it up.
    assert report.step_overhead_ms is not None and report.draft_overhead_ms is not None
    assert len(report.step_overhead_ms) == len(report.draft_overhead_ms) == len(report.depths)
    assert all(x >= 0 for x in report.step_overhead_ms + report.draft_overhead_ms)
    assert list(report.step_overhead_ms) == sorted(report.step_overhead_ms)
    assert report.verify_cost is not None and report.draft_cost is not None
    # A step's first draft forward, timed apart on the engine: never cheaper than a later one.
    assert report.draft_first_cost is not None and len(report.draft_first_cost) == len(report.depths)
    assert all(f >= n > 0 for f, n in zip(report.draft_first_cost, report.draft_cost, strict=True))
    for i, plain in enumerate(report.plain_step_ms):
        parts = whole_step_costs([plain * v for v in report.verify_cost[i]], plain * report.draft_cost[i],
                                 report.step_overhead_ms[i], report.draft_overhead_ms[i],
                                 plain * report.draft_first_cost[i])
        assert report.step_cost[i] == pytest.approx(parts, abs=2e-3)
    # Prefills at two prompt lengths, the target's and the draft's catch-up: a longer prompt
    # costs more, and the draft's is the cheaper.
    assert report.prefill_tokens == costs_measure.PREFILL_TOKENS
    assert report.prefill_ms is not None and report.draft_prefill_ms is not None
    assert report.prefill_ms[1] > report.prefill_ms[0] > 0 and report.draft_prefill_ms[1] > 0
    assert report.draft_prefill_ms[1] < report.prefill_ms[1]
    # The published JSON is what the gateway builds its policy model from.
    model = CostModel.from_json(report.to_json())
    assert model.depths == report.depths and model.max_k == 4
    assert CostReport.from_json(report.to_json()) == report
    # One slot, no draft: a single depth, plain only.
    alone = measure(settings(budget_s=0.2, threads=1, max_slots=1, draft=None))
    assert alone.depths == (1,) and alone.step_cost == ((1.0,),)
    single = measure(settings(budget_s=0.2, threads=1, max_slots=1))
    assert single.depths == (1,) and len(single.step_cost[0]) == 5


def test_cache_miss_then_hit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = tmp_path / "target", tmp_path / "draft"
    for directory in (target, draft):
        directory.mkdir()
        (directory / "config.json").write_text("{}")
        (directory / "model.safetensors").write_bytes(b"weights")
    calls: list[MeasureSettings] = []
    fake = report_from_forward_times((1,), [[0.01, 0.012]], [0.002], source="measured")

    def fake_measure(s: MeasureSettings) -> tuple[CostReport, None]:
        calls.append(s)
        return fake, None

    monkeypatch.setattr(costs_measure, "measure_with_model", fake_measure)
    cache_dir = tmp_path / "cache"
    first = settings(target=target, draft=draft, max_k=1, max_slots=1)
    assert measure_or_load(first, cache_dir)[0] == fake and len(calls) == 1  # miss: measured, stored
    hit, _ = measure_or_load(first, cache_dir)
    assert len(calls) == 1 and hit.source == "cache" and hit.step_cost == fake.step_cost  # hit: instant
    measure_or_load(settings(target=target, draft=draft, max_k=1, max_slots=2), cache_dir)  # other settings
    assert len(calls) == 2
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    os.utime(target / "model.safetensors", ns=(stamp + 10**9, stamp + 10**9))  # new weights
    measure_or_load(first, cache_dir)
    assert len(calls) == 3
    # A torn entry is measured again, not trusted.
    CostCache(cache_dir).path(first.cache_key()).write_text("{not json")
    measure_or_load(first, cache_dir)
    assert len(calls) == 4


def test_cache_entries_of_another_schema_are_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry written before the overhead term (schema 1) is a miss: its step costs hold no
    work outside the forwards, and a worker must not serve them as if they did."""
    calls: list[MeasureSettings] = []
    fake = report_from_forward_times((1,), [[0.01, 0.012]], [0.002], source="measured", overhead_s=[0.001])

    def fake_measure(s: MeasureSettings) -> tuple[CostReport, None]:
        calls.append(s)
        return fake, None

    monkeypatch.setattr(costs_measure, "measure_with_model", fake_measure)
    cache_dir, wanted = tmp_path / "cache", settings(max_k=1, max_slots=1)
    monkeypatch.setattr(cost_cache, "SCHEMA_VERSION", 1)
    old_key = wanted.cache_key()
    measure_or_load(wanted, cache_dir)
    assert len(calls) == 1 and CostCache(cache_dir).load(old_key) is not None
    monkeypatch.setattr(cost_cache, "SCHEMA_VERSION", 2)
    assert wanted.cache_key() != old_key
    report, _ = measure_or_load(wanted, cache_dir)
    assert len(calls) == 2 and report.step_overhead_ms == (1.0,)
    assert measure_or_load(wanted, cache_dir)[0].source == "cache" and len(calls) == 2
    # A report in the old format still parses (a gateway reading an older worker): no overhead.
    old_format = {k: v for k, v in fake.to_json().items() if k not in ("step_overhead_ms", "draft_overhead_ms")}
    assert CostReport.from_json(old_format).step_overhead_ms is None


def test_overhead_outside_the_forwards_enters_every_step_cost() -> None:
    target_s, draft_s = [[0.010, 0.015, 0.020]], [0.002]
    bare = report_from_forward_times((1,), target_s, draft_s)
    assert bare.step_cost[0] == (1.0, 1.7, 2.4) and bare.step_overhead_ms == (0.0,)
    # 2 ms a step outside the forwards: speculation is relatively cheaper than the forwards say...
    fixed = report_from_forward_times((1,), target_s, draft_s, overhead_s=[0.002])
    assert fixed.step_cost[0] == pytest.approx((1.0, 19 / 12, 26 / 12), abs=1e-4)
    # ...and 1 ms more per draft makes it dearer again; negative estimates (noise) count as 0.
    per_draft = report_from_forward_times((1,), target_s, draft_s, overhead_s=[0.002], draft_overhead_s=[0.001])
    assert per_draft.step_cost[0] == pytest.approx((1.0, 20 / 12, 28 / 12), abs=1e-4)
    assert report_from_forward_times((1,), target_s, draft_s, overhead_s=[-0.001]).step_cost == bare.step_cost
    # The schema survives the JSON round trip.
    assert CostReport.from_json(per_draft.to_json()) == per_draft


def test_request_speedup_adds_the_prompts_to_the_decode_steps() -> None:
    """A whole request's predicted speed-up: its prefill (both modes), the draft's catch-up on
    the prompt (speculative), the first token from the prefill and the rest at the decode gain."""
    # A plain step 10 ms; K=2 verifies for 15 ms and drafts 2 x 2 ms: step cost 1.9.
    report = report_from_forward_times((1,), [[0.010, 0.012, 0.015]], [0.002], prefill_tokens=(32, 128),
                                       prefill_ms=(40.0, 100.0), draft_prefill_ms=(8.0, 20.0))
    assert report.prefill_s(32) == pytest.approx(0.040) and report.prefill_s(80) == pytest.approx(0.070)
    assert report.prefill_s(224) == pytest.approx(0.160)  # beyond: on the same line
    assert report.prefill_s(33, draft=True) == pytest.approx(0.008125)
    alpha = 0.8
    decode_gain = (1 + alpha + alpha ** 2) / 1.9
    plain = 0.040 + 0.070 + 20 * 0.010 + 60 * 0.010
    catch_up = (8 + 12 / 96) / 1000 + (8 + 12 * 49 / 96) / 1000  # the draft's, on 33 and 81 tokens
    spec = 0.040 + 0.070 + catch_up + 80 * 0.010 / decode_gain
    assert report.request_speedup(alpha, 2, [(32, 21), (80, 61)]) == pytest.approx(plain / spec, rel=1e-3)
    assert report.request_speedup(alpha, 0, [(32, 21)]) == pytest.approx(1.0)
    # Long outputs tend to the decode gain; no prefill costs, no prediction.
    assert report.request_speedup(alpha, 2, [(32, 100_000)]) == pytest.approx(decode_gain, rel=1e-3)
    assert report_from_forward_times((1,), [[0.010, 0.012, 0.015]], [0.002]).request_speedup(alpha, 2, [(8, 9)]) is None
    assert CostReport.from_json(report.to_json()) == report


def test_catch_up_pays_when_the_remaining_tokens_gain_back_the_drafts_catch_up() -> None:
    """A sequence that decoded ``lag`` tokens plain drafts again only if speculation saves, over
    its remaining tokens, more than the draft's catch-up forward on the lag costs."""
    report = report_from_forward_times((1, 8), [[0.010, 0.012, 0.015], [0.020, 0.040, 0.060]], [0.002, 0.004],
                                       prefill_tokens=(32, 128), prefill_ms=(40.0, 100.0),
                                       draft_prefill_ms=(8.0, 20.0))
    model = report.policy_model()
    alpha = 0.8
    # Depth 1, K=2: gain (1 + .8 + .64) / 1.9; each remaining token saves 10 ms x (1 - 1/gain).
    saving = 0.010 * (1 - 1.9 / 2.44)
    catch_up = (8 + 12 * 48 / 96) / 1000  # the draft's prefill of 80 tokens
    needed = catch_up / saving
    assert catch_up_pays(model, alpha, 2, 1, math.ceil(needed), *report.catch_up_prices(80, 1))
    assert not catch_up_pays(model, alpha, 2, 1, math.floor(needed), *report.catch_up_prices(80, 1))
    # Where speculation loses (depth 8: verifying 3 tokens costs 3x), nothing pays.
    assert not catch_up_pays(model, alpha, 2, 8, 10_000, *report.catch_up_prices(80, 8))
    # Without prefill costs (the sim, vLLM) the rule does not hold anything back.
    bare = report_from_forward_times((1,), [[0.010, 0.012, 0.015]], [0.002])
    assert catch_up_pays(bare.policy_model(), alpha, 2, 1, 1, *bare.catch_up_prices(500, 1))


def test_online_refinement_moves_the_overhead_toward_step_timings() -> None:
    costs = OnlineCosts(base_report())
    assert costs.overhead_s == [0.0, 0.0]
    # Plain steps at depth 4 spend 3 ms outside their 20 ms forward.
    for _ in range(300):
        costs.observe_step(4, 1, 0.020, 0, 0, 0.0, step_s=0.023)
    assert costs.overhead_s[1] == pytest.approx(0.003, rel=0.01) and costs.overhead_s[0] == 0.0
    plain_only = costs.report()
    assert plain_only.step_overhead_ms == pytest.approx((0.0, 3.0), abs=0.05)
    assert plain_only.step_cost[1][2] < base_report().step_cost[1][2]  # speculation looks cheaper
    # Speculative steps (2 drafts per sequence) spend 1 ms more per draft outside the forwards.
    for _ in range(300):
        costs.observe_step(4, 3, 0.040, 4, 2, 0.008, step_s=0.048 + 0.003 + 0.002, drafts=8)
    assert costs.draft_overhead_s[1] == pytest.approx(0.001, rel=0.02)
    assert costs.report().step_cost[1][2] > plain_only.step_cost[1][2]
    # Untimed steps, prefills (no verification time) and steps where few sequences drafted say nothing.
    before = (list(costs.overhead_s), list(costs.draft_overhead_s))
    costs.observe_step(4, 1, 0.020, 0, 0, 0.0)
    costs.observe_step(4, 1, 0.0, 0, 0, 0.0, step_s=0.5)
    costs.observe_step(4, 2, 0.030, 1, 1, 0.004, step_s=0.5, drafts=1)
    assert (costs.overhead_s, costs.draft_overhead_s) == before
    # A start-up measurement's overhead is where refinement starts.
    measured = report_from_forward_times((1, 4), [[0.010, 0.011, 0.012], [0.020, 0.030, 0.040]], [0.002, 0.004],
                                         overhead_s=[0.001, 0.002], draft_overhead_s=[0.0001, 0.0004])
    assert OnlineCosts(measured).overhead_s == pytest.approx([0.001, 0.002])
    assert OnlineCosts(measured).report().step_cost == measured.step_cost


def test_the_sim_derives_no_overhead_and_vllm_estimates_none() -> None:
    """The sim's steps are its forwards (its fixed cost is per forward, inside them); vLLM's
    whole-step timings already hold the work outside the forwards. Both publish the field."""
    from workers.engines.sim.engine import SimEngine, SimSettings

    sim = SimEngine(SimSettings(MODELS / "demo-target", max_slots=8, max_k=4)).cost_model
    assert sim.step_overhead_ms == sim.draft_overhead_ms == (0.0,) * len(sim.depths)
    vllm = StepTimeCosts(depth_grid(8), max_k=4)
    vllm.observe(1, 0, 0.010)
    vllm.observe(1, 2, 0.014)
    report = vllm.report()
    assert report is not None and report.step_overhead_ms == (0.0,) * len(report.depths)


def base_report() -> CostReport:
    # Depths 1 and 4; target 10 ms plain at depth 1, 20 ms at depth 4; n = 1..3 tokens.
    return report_from_forward_times((1, 4), [[0.010, 0.011, 0.012], [0.020, 0.030, 0.040]], [0.002, 0.004],
                                     source="measured")


def test_online_refinement_moves_costs_toward_step_timings() -> None:
    costs = OnlineCosts(base_report())
    assert costs.report().step_cost == base_report().step_cost and costs.report().online_steps == 0
    # The machine got busier: verifying 3 tokens at depth 4 now takes 80 ms, drafting 8 ms.
    for _ in range(300):
        costs.observe_step(4, 3, 0.080, 4, 2, 0.016)
    report = costs.report()
    assert report.source == "online" and report.online_steps == 300
    assert costs.target_s[1][2] == pytest.approx(0.080, rel=0.01)
    assert costs.draft_s[1] == pytest.approx(0.008, rel=0.01)
    assert report.step_cost[1][2] > base_report().step_cost[1][2]
    assert report.step_cost[0] == base_report().step_cost[0]  # depth 1 untouched
    # A point's first observation counts half, later ones less, down to ONLINE_WEIGHT; a depth
    # between grid points is scaled to the nearest one by the curve's own shape.
    fresh = OnlineCosts(base_report())
    fresh.observe_step(2, 1, 0.030, 0, 0, 0.0)
    expected_at_depth_1 = 0.030 * 0.010 / (0.010 + (0.020 - 0.010) / 3)
    assert fresh.target_s[0][0] == pytest.approx(0.010 + 0.5 * (expected_at_depth_1 - 0.010))
    for _ in range(100):
        fresh.observe_step(1, 2, 0.011, 0, 0, 0.0)
    before = fresh.target_s[0][1]
    fresh.observe_step(1, 2, 0.021, 0, 0, 0.0)
    assert fresh.target_s[0][1] == pytest.approx(before + ONLINE_WEIGHT * (0.021 - before))
    # Steps that do not fit the grid (a prefill, a prompt riding along) are ignored.
    before_curves = [list(row) for row in fresh.target_s]
    fresh.observe_step(1, 9, 1.0, 0, 0, 0.0)
    fresh.observe_step(1, 1, 0.0, 0, 0, 0.0)
    assert fresh.target_s == before_curves


def test_points_timed_at_different_rates_cover_the_same_stretch_of_steps() -> None:
    """Plain steps three times in four, a 3-token verification every fourth, and then the
    machine gets 1.5x slower: both points follow at the same pace in steps, so their ratio (what
    K auto decides on) stays where it was. Weighted per observation, the plain point moved
    three times as fast and the verification looked 12% cheaper than it is."""
    costs = OnlineCosts(base_report())

    def run(rounds: int, slow: float) -> None:
        for _ in range(rounds):
            for _ in range(3):
                costs.observe_step(1, 1, 0.010 * slow, 0, 0, 0.0)
            costs.observe_step(1, 3, 0.012 * slow, 0, 0, 0.0)

    run(200, 1.0)
    assert costs.target_s[0][2] / costs.target_s[0][0] == pytest.approx(1.2, rel=1e-3)
    run(40, 1.5)  # 160 steps of the slower machine
    assert costs.target_s[0][0] == pytest.approx(0.015, rel=0.15)  # most of the way there
    assert costs.target_s[0][2] / costs.target_s[0][0] == pytest.approx(1.2, rel=0.02)


def test_online_refinement_moves_the_prefill_line_toward_served_prefills() -> None:
    """Start-up timed its prefills cold; prompts served alone in their steps move the line (the
    draft's catch-up by the same factor), and the request prediction prices what they cost."""
    report = report_from_forward_times((1,), [[0.010, 0.012, 0.015]], [0.002], prefill_tokens=(32, 128),
                                       prefill_ms=(40.0, 100.0), draft_prefill_ms=(8.0, 20.0))
    costs = OnlineCosts(report)
    assert costs.report().prefill_ms == (40.0, 100.0)
    # Served prompts of 30 and 120 tokens prefill in 75% of the line's time there.
    for _ in range(200):
        costs.observe_prefill(30, 0.75 * report.prefill_s(30))  # type: ignore[operator]
        costs.observe_prefill(120, 0.75 * report.prefill_s(120))  # type: ignore[operator]
    refined = costs.report()
    assert refined.prefill_ms == pytest.approx((30.0, 75.0), rel=0.01)
    assert refined.draft_prefill_ms == pytest.approx((6.0, 15.0), rel=0.01)
    # Cheaper prompts: a larger share of each request is decode steps, where speculation gains.
    assert refined.request_speedup(0.8, 2, [(32, 21)]) > report.request_speedup(0.8, 2, [(32, 21)])  # type: ignore[operator]
    # Without measured prefill costs (the sim, vLLM) there is nothing to refine.
    bare = OnlineCosts(base_report())
    bare.observe_prefill(64, 0.05)
    assert bare.report().prefill_ms is None and bare.report().draft_prefill_ms is None


def test_points_no_step_times_keep_their_ratio_to_the_plain_step() -> None:
    """Only plain steps run at depth 4 while the machine gets twice as slow: the speculative
    points nobody timed must slow down with them, not look twice as cheap as before."""
    costs = OnlineCosts(base_report())
    for _ in range(300):
        costs.observe_step(4, 1, 0.040, 0, 0, 0.0)
    report = costs.report()
    assert report.plain_step_ms[1] == pytest.approx(40.0, rel=0.01)
    assert report.step_cost[1] == pytest.approx(base_report().step_cost[1], rel=1e-3)
    assert report.step_cost[0] == base_report().step_cost[0]  # another depth: untouched
    # A point timed within the last STALE_STEPS steps keeps its own measurement.
    timed = OnlineCosts(base_report())
    for _ in range(300):
        timed.observe_step(4, 3, 0.040, 4, 2, 0.008)  # 3 tokens as at start-up, drafts too
        timed.observe_step(4, 1, 0.040, 0, 0, 0.0)  # plain steps twice as slow
    assert timed.target_s[1][2] == pytest.approx(0.040, rel=0.01) and timed.draft_s[1] == pytest.approx(0.004)
    assert timed.target_s[1][1] == pytest.approx(0.060, rel=0.01)  # 2 tokens: stale, carried along
    # Once it goes untimed for longer, it follows the plain step from there on.
    for _ in range(STALE_STEPS + 1):
        timed.observe_step(4, 1, 0.040, 0, 0, 0.0)
    for _ in range(400):
        timed.observe_step(4, 1, 0.080, 0, 0, 0.0)
    assert timed.target_s[1][2] == pytest.approx(0.080, rel=0.01) and timed.draft_s[1] == pytest.approx(0.008, rel=0.01)


def test_online_acceptance_counts_tested_drafts() -> None:
    costs = OnlineCosts(base_report())
    assert costs.alpha is None
    for _ in range(50):
        costs.observe_drafts(4, 4)  # 4 tested, 4 accepted
        costs.observe_drafts(4, 1)  # 2 tested, 1 accepted
    assert costs.alpha == pytest.approx(5 / 6, abs=0.01)
    assert costs.report().acceptance == pytest.approx(5 / 6, abs=0.01)


def test_step_time_estimate_for_engines_that_time_whole_steps() -> None:
    costs = StepTimeCosts(depth_grid(8), max_k=4)
    assert costs.report() is None
    costs.observe(1, 0, 0.010)
    assert costs.report() is None  # a plain step alone says nothing about speculation
    costs.observe(1, 2, 0.014)
    report = costs.report()
    assert report is not None and report.source == "estimated"
    assert report.step_cost[0] == pytest.approx((1.0, 1.2, 1.4, 1.6, 1.8))  # the line through K=2
    assert all(row == report.step_cost[0] for row in report.step_cost)  # other depths borrow it
    for _ in range(200):
        costs.observe(8, 0, 0.020)
        costs.observe(8, 4, 0.060)
    deep = costs.report()
    assert deep is not None and deep.step_cost[-1][4] == pytest.approx(3.0, rel=0.01)


def test_measurement_times_every_depths_plain_step_and_k1_step_before_the_rest(
        one_thread: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a short budget reaches first: the plain step at every depth (what every decision
    there is weighed against; not linear in depth), then every n at batch 1, then each depth's
    draft forward and 2-token verification (K=1: does speculation pay there at all), and only
    then the deeper shapes in n. Timings are faked: this checks the plan, not the machine."""
    timed: list[list[tuple[str, int, int]]] = []

    def fake_rounds(runs: dict[tuple[str, int, int], object], until: float,
                    before_verify: object = None) -> dict[tuple[str, int, int], float]:
        timed.append(list(runs))
        return {key: 1e-3 * key[1] * (1 + 0.5 * (key[2] - 1)) for key in runs}

    monkeypatch.setattr(costs_measure, "_time_rounds", fake_rounds)
    monkeypatch.setattr(costs_measure, "measure_overheads",
                        lambda *args: costs_engine.EngineTimings([0.0] * 5, [0.0] * 5, {}))
    report = measure(settings(budget_s=60, threads=1, max_slots=16, max_k=4))
    assert report.depths == (1, 2, 4, 8, 16)
    # Phase 1 (the precision candidates), then the prefills, then phase 2 of the chosen target.
    phase2 = timed[2:]
    # Phase 1 timed the chosen target beside the other candidates: phase 2 times it again, alone.
    assert sorted(phase2[0]) == [("target", d, 1) for d in (2, 4, 8, 16)]
    assert sorted(phase2[1]) == [("draft", 1, 1)] + [("target", 1, n) for n in range(1, 6)]
    k1 = phase2[2:6]
    assert [{(kind, n) for kind, _, n in group} for group in k1] == [{("target", 1), ("draft", 1), ("target", 2)}] * 4
    assert [group[0][1] for group in k1] == [2, 4, 8, 16]
    assert all(n != 2 for group in phase2[6:] for _, _, n in group)  # never timed twice
    # Every depth's K=1 cost comes from its own timing: 2 tokens at 1.5x the plain step, here.
    assert all(row[1] == pytest.approx(1.5, abs=0.02) for row in report.verify_cost or ())


def test_torch_runs_on_one_thread_where_the_kernels_serve() -> None:
    """With the kernels serving (float32, prepacked), torch only glues between their calls: its
    OpenMP workers would spin on the cores the kernels' threads use. Elsewhere torch does the
    work and keeps ``workers.threads``."""
    def choice(target: str, prepacked: bool) -> PrecisionChoice:
        return PrecisionChoice(target, prepacked, True, "test", 0.8)

    kernels_build = rowgemm.load() is not None
    assert torch_threads_serving(choice("float32", True), 2) == (1 if kernels_build else 2)
    assert torch_threads_serving(choice("float32", False), 2) == 2
    assert torch_threads_serving(choice("bfloat16", True), 2) == 2


def split_report() -> CostReport:
    # base_report() with a step's first draft forward at 5 ms (depth 1) and 8 ms (depth 4).
    return report_from_forward_times((1, 4), [[0.010, 0.011, 0.012], [0.020, 0.030, 0.040]], [0.002, 0.004],
                                     source="measured", draft_first_s=[0.005, 0.008])


def test_online_refinement_times_the_first_draft_forward_apart() -> None:
    """A step of one draft forward times the first; a step of F > 1 the later ones, as its draft
    time less the first's price over F - 1. A model without the split keeps pricing alike."""
    costs = OnlineCosts(split_report())
    assert costs.report().draft_first_cost == split_report().draft_first_cost == (0.5, 0.4)
    for _ in range(300):
        costs.observe_step(4, 2, 0.030, 4, 1, 0.012)  # K = 1 at depth 4: the first forward now 12 ms
    assert costs.draft_first_s[1] == pytest.approx(0.012, rel=0.01)
    assert costs.draft_s[1] == pytest.approx(0.004)  # untouched: no later forward was timed
    for _ in range(300):
        costs.observe_step(4, 4, 0.040, 4, 3, 0.012 + 2 * 0.006)  # K = 3: later forwards 6 ms
    assert costs.draft_s[1] == pytest.approx(0.006, rel=0.01)
    assert costs.draft_first_s[1] == pytest.approx(0.012, rel=0.01)
    # A step whose first forward caught a draft up on a plain spell prices no forward: its
    # draft time is left out (its verification still counts).
    for _ in range(50):
        costs.observe_step(4, 4, 0.040, 4, 3, 0.060, catch_up=True)
    assert costs.draft_s[1] == pytest.approx(0.006, rel=0.01)
    assert costs.draft_first_s[1] == pytest.approx(0.012, rel=0.01)
    report = costs.report()
    assert report.draft_first_cost == pytest.approx((0.5, 0.6), rel=0.01)
    assert report.step_cost[1][2] == pytest.approx((0.040 + 0.012 + 0.006) / 0.020, rel=0.01)
    # Without the split (the sim's report, an old cache entry): per-forward averages, as before.
    alike = OnlineCosts(base_report())
    for _ in range(300):
        alike.observe_step(4, 4, 0.040, 4, 3, 0.018)
    assert alike.draft_s[1] == pytest.approx(0.006, rel=0.01) and alike.report().draft_first_cost is None


def test_draft_split_from_the_engines_draft_phases() -> None:
    """First = the phase at K = 1, later = the slope to the deeper K, at the depths timed; the
    others keep the later forward's ratio to the depth's forward timing and take the first's
    extra on the line through the timed depths."""
    depths = (1, 2, 4, 8, 16)
    forward = [0.001, 0.0012, 0.0016, 0.0024, 0.004]
    phases = {(1, 1): 0.0009, (1, 8): 0.0009 + 7 * 0.0002, (16, 1): 0.0025, (16, 4): 0.0025 + 3 * 0.001}
    first, later = costs_engine.draft_split(depths, forward, phases)
    assert later[0] == pytest.approx(0.0002) and first[0] == pytest.approx(0.0009)
    assert later[-1] == pytest.approx(0.001) and first[-1] == pytest.approx(0.0025)
    for d, f, n, fw in zip(depths, first, later, forward, strict=True):
        ratio = 0.2 + (0.25 - 0.2) * (d - 1) / 15  # later / forward: 0.2 at depth 1, 0.25 at 16
        assert n == pytest.approx(fw * ratio)
        assert f - n == pytest.approx(0.0007 + (0.0015 - 0.0007) * (d - 1) / 15)
    # max_k 1 (no deeper K timed): every forward alike.
    assert costs_engine.draft_split(depths, forward, {(1, 1): 0.0009}) == (forward, forward)
    # Timed at every depth up to 4: those are their own; beyond, the later forward keeps depth
    # 4's ratio and the first one's extra goes on along the line through depths 2 and 4.
    phases = {(1, 1): 0.0009, (1, 8): 0.0023, (2, 1): 0.0011, (2, 4): 0.0020, (4, 1): 0.0015, (4, 4): 0.0027}
    first, later = costs_engine.draft_split(depths, forward, phases)
    assert first[:3] == pytest.approx([0.0009, 0.0011, 0.0015]) and later[:3] == pytest.approx([0.0002, 0.0003, 0.0004])
    assert later[3:] == pytest.approx([f * 0.0004 / 0.0016 for f in forward[3:]])
    extra = [0.0007, 0.0008, 0.0011]  # first - later at depths 1, 2, 4
    slope = (extra[2] - extra[1]) / 2
    assert [f - n for f, n in zip(first[3:], later[3:], strict=True)] == pytest.approx(
        [extra[2] + slope * 4, extra[2] + slope * 12])


def test_start_up_verification_ratios_do_not_fall_with_depth() -> None:
    """A forward of n tokens per row costs more against a plain one the deeper the batch (the
    weights are read once, the rows' work grows): a timing that says less is noise, raised to
    the shallower depth's ratio; the plain step itself is kept."""
    rows = [[0.004, 0.0042, 0.0045], [0.008, 0.0128, 0.0170], [0.050, 0.0780, 0.1200]]  # depth 64: 1.56x < 1.6x
    fixed = costs_measure._verify_rising_in_depth(rows)
    assert [row[0] for row in fixed] == [0.004, 0.008, 0.050]
    assert fixed[0] == rows[0] and fixed[1] == rows[1]
    assert fixed[2][1] == pytest.approx(0.050 * 1.6) and fixed[2][2] == pytest.approx(0.120)


def test_a_depth_timed_plain_only_takes_its_verification_from_the_plain_steps_growth() -> None:
    """Depth 1 timed at n = 1..3, depth 8 only plain: depth 8's n-token forwards grow as the plain
    steps grow in rows (P(8 n) - P(8)), at the share of a sequence that depth 1's extra tokens
    cost, not at depth 1's ratio (the real pair's concurrency-16 miss)."""
    plain = {1: 0.034, 2: 0.0387, 4: 0.0481, 8: 0.0669, 16: 0.1044}
    near_row = [0.034, 0.0363, 0.0383]  # 1.067x, 1.126x of depth 1's plain step
    row = costs_measure.shape_by_rows(plain, 1, near_row, 8)
    assert row[0] == 0.0669
    slope = (0.1044 - 0.0669) / 8  # beyond depth 16: the last segment's slope

    def p(rows: float) -> float:
        return 0.1044 + slope * (rows - 16) if rows > 16 else 0.0669 + slope * (rows - 8)
    share_2 = (0.0363 - 0.034) / (0.0387 - 0.034)
    share_3 = (0.0383 - 0.034) / (0.0481 - 0.034 - (0.0481 - 0.0387) / 2)  # P(3) between depths 2 and 4
    assert row[1] == pytest.approx(0.0669 + share_2 * (p(16) - 0.0669))
    assert row[2] == pytest.approx(0.0669 + share_3 * (p(24) - 0.0669))
    assert row[2] / row[0] > 1.5 > near_row[2] / near_row[0]
    # A flat plain curve (the weights dominate): the borrowed ratio is the floor.
    flat = costs_measure.shape_by_rows({1: 0.03, 8: 0.03}, 1, near_row, 8)
    assert flat == pytest.approx([0.03 * t / 0.034 for t in near_row])
    # The rows grow no more than a whole sequence each (share at most 1).
    assert costs_measure.shape_by_rows(plain, 1, [0.034, 0.050], 8)[1] == pytest.approx(p(16))


def test_a_first_draft_forward_is_never_priced_below_a_later_one() -> None:
    """Serving timed only K = 3 steps at depth 4, whose later forwards came out dearer than the
    first one's start-up price: the report prices the first at least as a later one."""
    costs = OnlineCosts(split_report())
    for _ in range(300):
        costs.observe_step(4, 4, 0.040, 4, 3, 0.008 + 2 * 0.010)  # later forwards 10 ms, first still 8 ms
    assert costs.draft_s[1] == pytest.approx(0.010, rel=0.01) and costs.draft_first_s[1] == pytest.approx(0.008)
    report = costs.report()
    assert report.draft_first_cost is not None and report.draft_cost is not None
    assert report.draft_first_cost[1] == pytest.approx(report.draft_cost[1])
    assert report.draft_first_cost[0] == split_report().draft_first_cost[0]  # type: ignore[index]


def test_draft_split_ignores_a_depth_whose_deeper_phase_is_no_longer() -> None:
    """A deeper K's draft phase no longer than K = 1's (timing noise at start-up) is no
    measurement: that depth takes its neighbours' ratio, as an untimed depth does, and no later
    draft forward is priced free."""
    depths = (1, 2, 4)
    forward = [0.001, 0.0012, 0.0016]
    timed = {(1, 1): 0.0009, (1, 4): 0.0015, (4, 1): 0.0015, (4, 4): 0.0027}
    noisy = timed | {(2, 1): 0.0011, (2, 4): 0.0010}  # the K = 4 phase came out shorter
    assert costs_engine.draft_split(depths, forward, noisy) == costs_engine.draft_split(depths, forward, timed)
    first, later = costs_engine.draft_split(depths, forward, noisy)
    assert all(f >= n > 0 for f, n in zip(first, later, strict=True))
    # later / forward: 0.2 at depth 1, 0.25 at depth 4, linear in depth between
    assert later[1] == pytest.approx(forward[1] * (0.2 + 0.05 / 3))
    # An equal phase is no measurement either; with none left, every forward is the timed one.
    flat = {(1, 1): 0.0009, (1, 4): 0.0009, (4, 1): 0.0015, (4, 4): 0.0014}
    assert costs_engine.draft_split(depths, forward, flat) == (forward, forward)
