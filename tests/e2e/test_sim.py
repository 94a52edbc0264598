"""The simulated GPU engine: its calibration, its acceptance sampling, and a gateway serving over it."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace

import openai
import pytest

from gateway.config.config import ConfigError, parse_config
from tests.e2e.harness import REPO, Gateway, sdk_client, start_gateway, write_config
from workers.api.sim_config import (
    PUBLISHED_K,
    AcceptanceTable,
    Facts,
    SimConfig,
    SimConfigError,
    alpha_from_rate,
    vllm_rate,
)
from workers.engines.sim.roofline import (
    SimBatch,
    SimSeq,
    StepCost,
    expected_tokens,
    fit_efficiency,
    gain,
    sample_accepted,
)

FACTS = Facts()


def test_default_efficiencies_are_the_fit_of_the_published_facts() -> None:
    fitted = fit_efficiency(SimConfig(), FACTS)
    default = SimConfig().efficiency
    assert fitted.bandwidth_fraction == pytest.approx(default.bandwidth_fraction, rel=0.02)
    assert fitted.flops_fraction == pytest.approx(default.flops_fraction, rel=0.02)
    assert fitted.forward_overhead_ms == pytest.approx(default.forward_overhead_ms, rel=0.03)


def test_step_time_model_meets_the_three_calibration_facts() -> None:
    config = SimConfig()
    cost = StepCost(config)
    ctx = FACTS.context
    alpha = alpha_from_rate(FACTS.rate, FACTS.k)
    plain, _ = cost.step_time([0], [ctx])
    spec, verify = cost.step_time([FACTS.k], [ctx])
    assert 1 / plain == pytest.approx(34.0, rel=0.02)  # tokens/s per stream, plain, batch 1
    assert expected_tokens(alpha, FACTS.k) / spec == pytest.approx(109.0, rel=0.02)  # K=5 at the reported rate
    assert 0 < verify < spec
    assert gain(config, alpha, FACTS.breakeven_batch, FACTS.k, ctx) == pytest.approx(1.0, abs=0.03)
    # And the shape around it: speculation pays well below 64 and loses well above.
    assert gain(config, alpha, 16, FACTS.k, ctx) > 1.5
    assert gain(config, alpha, 128, FACTS.k, ctx) < 0.9


def test_roofline_weights_are_read_once_per_forward() -> None:
    cost = StepCost(SimConfig())
    one, _ = cost.step_time([0], [0])
    eight, _ = cost.step_time([0] * 8, [0] * 8)
    assert eight < 1.05 * one  # memory-bound: 8 sequences cost about what one does
    assert cost.step_time([], [])[0] == 0.0


@pytest.mark.parametrize("rate", [0.3, 0.5, 0.647, 0.814, 0.882])
def test_rate_to_alpha_round_trips(rate: float) -> None:
    alpha = alpha_from_rate(rate, PUBLISHED_K)
    assert vllm_rate(alpha, PUBLISHED_K) == pytest.approx(rate, abs=1e-9)
    assert alpha > rate  # per-token α exceeds accepted/proposed, which counts untested drafts


def test_published_rates_convert_to_the_documented_alphas() -> None:
    table = AcceptanceTable()
    assert table.alpha("json", 0.0) == pytest.approx(0.958, abs=0.001)
    assert table.alpha("code", 0.2) == pytest.approx(0.932, abs=0.001)
    assert table.alpha("math", 0.0) == pytest.approx(0.858, abs=0.001)
    assert table.alpha("math", 0.7) == pytest.approx(0.6)
    for category in table.bands:  # above T=0.8 every category's rate is below 0.5
        assert vllm_rate(table.alpha(category, 1.0), PUBLISHED_K) < 0.5


def test_category_comes_from_the_prompt_tag() -> None:
    table = AcceptanceTable()
    assert table.category("[JSON] give me an object") == "json"
    assert table.category("<|user|>[code] write it<|end|>") == "code"
    assert table.category("no tag here") == "chat"


@pytest.mark.parametrize(("alpha", "k"), [(0.6, 5), (0.86, 5), (0.95, 3), (0.3, 8)])
def test_acceptance_sampling_matches_alpha(alpha: float, k: int) -> None:
    """Over 40,000 steps, accepted/tested estimates α within 0.01 (about 4 standard errors) and
    the mean accepted count matches α(1 − α^K)/(1 − α)."""
    rng = random.Random(7)
    log_alpha = math.log(alpha)
    draws = [sample_accepted(rng, log_alpha, k) for _ in range(40_000)]
    assert all(0 <= n <= k for n in draws)
    tested = sum(n + (1 if n < k else 0) for n in draws)
    assert sum(draws) / tested == pytest.approx(alpha, abs=0.01)
    assert sum(draws) / len(draws) == pytest.approx(vllm_rate(alpha, k) * k, rel=0.02)


def test_acceptance_sampling_edges() -> None:
    rng = random.Random(0)
    assert sample_accepted(rng, 0.0, 5) == 5  # α = 1
    assert sample_accepted(rng, -math.inf, 5) == 0  # α = 0
    assert sample_accepted(rng, math.log(0.9), 0) == 0  # plain


def test_batch_applies_the_policy_latch_per_step() -> None:
    batch = SimBatch(SimConfig(), max_slots=8, max_k=8)
    batch.max_batch, batch.batch_resume = 2, 1
    for i in range(3):
        batch.add(SimSeq(f"r{i}", 5, 0.9, 50, 10, random.Random(i)))
    first = batch.step()  # prefill: no drafts
    assert first is not None and first.depth == 3 and all(r.k == 0 and r.emitted == 1 for r in first.results)
    second = batch.step()
    assert second is not None and batch.batch_full and all(r.k == 0 for r in second.results)
    batch.abort("r0")
    batch.abort("r1")
    third = batch.step()  # depth 1 < batch_resume... only once below resume
    assert third is not None and third.depth == 1
    assert [r.k for r in third.results] == [0]  # 1 is not below batch_resume=1: still latched
    batch.batch_resume = 2
    fourth = batch.step()
    assert fourth is not None and not batch.batch_full and fourth.results[0].k == 5


def test_batch_sheds_drafts_past_max_step_drafts() -> None:
    batch = SimBatch(SimConfig(), max_slots=64, max_k=8)
    batch.max_step_drafts = 48
    for i in range(32):
        batch.add(SimSeq(f"r{i}", 5, 0.9, 100, 10, random.Random(i)))
    batch.step()
    step = batch.step()
    assert step is not None and {r.k for r in step.results} == {2}  # round(48 / 32)


def test_sim_config_validation_names_the_field() -> None:
    with pytest.raises(SimConfigError) as info:
        SimConfig.from_mapping({"hardware": {"gpus": 0}})
    assert info.value.field == "hardware.gpus"
    with pytest.raises(SimConfigError):
        SimConfig.from_mapping({"acceptance": {"code": [[0.8, 1.5]]}})
    parsed = SimConfig.from_mapping({"time_scale": 0, "acceptance": {"code": [[0.5, 0.9], [None, 0.5]]},
                                     "default_category": "code", "draft": None})
    assert parsed.time_scale == 0 and parsed.draft is None
    assert parsed.acceptance.alpha("code", 1.0) == 0.5
    assert replace(SimConfig(), seed=3).seed == 3
    with pytest.raises(ConfigError) as config_error:
        parse_config({"workers": {"engine": "sim", "sim": {"efficiency": {"flops_fraction": -1}}}}, REPO)
    assert config_error.value.field == "workers.sim.efficiency.flops_fraction"


def test_sim_config_reports_every_bad_field() -> None:
    bad = {"hardware": {"gpus": 0, "peak_tflops": "fast", "hbm": 3}, "efficiency": {"flops_fraction": -1},
           "acceptance": {"code": [[0.8, 1.5]]}, "seed": 1.5, "context_window": 8, "colour": "red",
           "target": {"params": 0}}
    with pytest.raises(SimConfigError) as info:
        SimConfig.from_mapping(bad)
    assert [p.field for p in info.value.problems] == [
        "colour", "hardware.hbm", "hardware.gpus", "hardware.peak_tflops", "efficiency.flops_fraction",
        "acceptance.code", "seed", "context_window", "target.params"]
    assert info.value.field == "colour"  # the first, as str() says
    with pytest.raises(ConfigError) as config_error:
        parse_config({"workers": {"engine": "sim", "sim": bad}}, REPO)
    fields = [p.field for p in config_error.value.problems]
    assert fields[:3] == ["workers.sim.colour", "workers.sim.hardware.hbm", "workers.sim.hardware.gpus"]
    assert len(fields) == 9 and all("got" in str(p) for p in config_error.value.problems)


def test_sim_worker_imports_no_torch() -> None:
    code = ("import sys, argparse\nfrom workers.__main__ import build_engine, parse_args\n"
            "build_engine(parse_args(['--engine', 'sim', '--port', '1', '--target', 'models/demo-target']))\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# -- a gateway over sim workers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw-sim")
    config = write_config(tmp / "config.yaml", workers={"count": 2, "engine": "sim", "max_slots": 64,
                                                         "sim": {"time_scale": 0.1, "seed": 1}})
    gw = start_gateway(config, tmp)
    gw.wait_workers_ready(2)
    yield gw
    gw.stop()


def test_gateway_over_sim_workers_serves_the_sdk(sim_gateway: Gateway) -> None:
    with sdk_client(sim_gateway) as client:
        full = client.completions.create(model="specgate-demo", prompt="[code] def f():", max_tokens=24,
                                         temperature=0.2, seed=5)
        assert full.usage is not None and full.usage.completion_tokens == 24
        assert full.choices[0].finish_reason == "length" and full.choices[0].text
        speculative = (full.usage.model_extra or {})["speculative"]
        assert speculative["mode"] == "speculative" and 0 < speculative["accepted"] <= speculative["proposed"]
        again = client.completions.create(model="specgate-demo", prompt="[code] def f():", max_tokens=24,
                                          temperature=0.2, seed=5)
        assert again.choices[0].text == full.choices[0].text  # deterministic per seed
        stream = client.chat.completions.create(
            model="specgate-demo", messages=[{"role": "user", "content": "[json] an object please"}],
            max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True})
        pieces, usage = [], None
        for chunk in stream:
            usage = chunk.usage or usage
            pieces += [c.delta.content or "" for c in chunk.choices]
        assert "".join(pieces) and usage is not None and usage.completion_tokens == 16
    workers = sim_gateway.get_json("/admin/workers")["workers"]
    assert {w["engine"] for w in workers} == {"sim"}


def test_sim_worker_refuses_oversized_requests_and_reports_drafts(sim_gateway: Gateway) -> None:
    with sdk_client(sim_gateway) as client, pytest.raises(openai.BadRequestError):
        client.completions.create(model="specgate-demo", prompt="x", max_tokens=100_000)
    assert sim_gateway.metric("vllm:spec_decode_num_draft_tokens_total") > 0


def test_a_non_streaming_answer_is_accounted_before_the_next_request(sim_gateway: Gateway) -> None:
    """The gateway writes a non-streaming answer before it accounts the worker's chunks
    (gateway/relay/relay.py ``_answer``): by the time the client holds the answer, the session's
    evidence, the per-position draft counters and the token counter already include it."""
    def counters() -> tuple[float, float, float]:
        return (sim_gateway.metric("specgate_tokens_total"),
                sim_gateway.metric("specgate_spec_decode_drafted_by_position_total"),
                sim_gateway.metric("specgate_spec_decode_accepted_by_position_total"))

    evidence, proposed_total = 0, 0
    with sdk_client(sim_gateway) as client:
        for index in range(6):
            tokens, drafted, accepted = counters()
            raw = client.completions.with_raw_response.create(
                model="specgate-demo", prompt="[code] def f():", max_tokens=12, temperature=0.2, seed=index,
                extra_headers={"X-Session-ID": "answer-first"})
            usage = raw.parse().usage
            assert usage is not None and usage.model_extra is not None
            speculative = usage.model_extra["speculative"]
            proposed_total += speculative["proposed"]
            assert counters() == (tokens + usage.completion_tokens, drafted + speculative["proposed"],
                                  accepted + speculative["accepted"])
            # The session's evidence is the drafts its steps tested: the accepted ones and each
            # step's first rejected one.
            record = sim_gateway.get_json("/admin/sessions/answer-first")
            tested = record["evidence_drafted_tokens"] - evidence
            assert (speculative["accepted"] <= tested
                    <= min(speculative["proposed"], speculative["accepted"] + speculative["speculative_steps"])), \
                (index, record, speculative)
            evidence = record["evidence_drafted_tokens"]
    assert proposed_total > 0 and evidence > 0


def test_a_sim_worker_with_a_prefix_cache_reports_cached_tokens(tmp_path_factory: pytest.TempPathFactory,
                                                                 sim_gateway: Gateway) -> None:
    """Turn 2 of a session reports the prompt tokens its worker had cached (OpenAI's
    ``prompt_tokens_details.cached_tokens``); a worker without the cache leaves the field out."""
    tmp = tmp_path_factory.mktemp("gw-sim-prefix")
    config = write_config(tmp / "config.yaml", workers={"count": 1, "engine": "sim", "max_slots": 8,
                                                         "sim": {"time_scale": 0, "prefix_cache_tokens": 4096}})
    gw = start_gateway(config, tmp)
    try:
        gw.wait_workers_ready(1)
        system = "[chat] " + " ".join(f"Rule {n}: be brief." for n in range(60))
        with sdk_client(gw) as client:
            cached = []
            for turn in range(2):
                answer = client.chat.completions.create(model="specgate-demo", messages=[
                    {"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}],
                                                        max_tokens=4, extra_headers={"X-Session-ID": "prefix"})
                assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
                cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        assert cached[0] == 0 and cached[1] is not None and cached[1] >= 256
    finally:
        gw.stop()
    with sdk_client(sim_gateway) as client:  # no prefix cache configured: no field
        plain = client.completions.create(model="specgate-demo", prompt="[chat] hi", max_tokens=2)
        assert plain.usage is not None and plain.usage.prompt_tokens_details is None
