"""llama-server's counters read as steps (gateway/llamacpp.py): per-token timings give each
verification step its own counts, a whole answer's totals are split, garbage is clamped and
counted, and the cache-scope record decides ``cache_prompt``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config.config import ConfigError, parse_config
from gateway.llamacpp import (
    PromptScopes,
    SlotLease,
    StepCosts,
    TimingsSeen,
    llamacpp_body,
    read_depth,
    timings_report,
)
from workers.api.generation import SpecSteps

BASE = Path(__file__).resolve().parent


def timings(predicted: int, drafted: int | None = None, accepted: int | None = None, ms: float = 1.0
            ) -> dict[str, Any]:
    out: dict[str, Any] = {"predicted_n": predicted, "predicted_ms": ms}
    if drafted is not None:
        out |= {"draft_n": drafted, "draft_n_accepted": accepted}
    return {"choices": [{"delta": {"content": "x"}}], "timings": out}


def fold(chunks: list[dict[str, Any]], lookup: bool = True, max_k: int = 48) -> tuple[list[tuple[int, int]], int,
                                                                                      TimingsSeen]:
    """Every chunk through ``timings_report``: the steps (proposed, accepted) in order, as the
    lookup accounting folds them (a report's own step, then its late groups), and the tokens."""
    seen, steps, tokens = TimingsSeen(), [], 0
    for chunk in chunks:
        report = timings_report(chunk, seen, max_k, lookup, True)
        assert "timings" not in chunk  # llama.cpp's field never reaches the client
        if report is None:
            tokens += 1  # the caller counts the chunk's text
            continue
        tokens += report.tokens
        steps.append((report.proposed, report.accepted))
        steps += [(g.proposed, g.accepted) for g in report.late_steps for _ in range(g.count)]
    return steps, tokens, seen


def test_per_token_timings_give_each_step_its_counts() -> None:
    # The prompt's token; a plain step; a step proposing 4 that accepted 2 (its 3 tokens a chunk
    # each); a plain step; a step proposing 5 that accepted 0; the usage chunk repeating the totals.
    chunks = [timings(1), timings(2), timings(3, 4, 2), timings(4, 4, 2), timings(5, 4, 2),
              timings(6, 4, 2), timings(7, 9, 2), {"choices": [], "usage": {}, "timings": timings(7, 9, 2)["timings"]}]
    steps, tokens, seen = fold(chunks)
    assert steps == [(0, 0), (4, 2), (0, 0), (5, 0)]
    assert tokens == 7 + 1  # the usage chunk's text counted as a caller would: it has none in practice
    assert (seen.proposed, seen.accepted, seen.proposing_steps, seen.plain_steps) == (9, 2, 2, 2)


def test_draft_model_servers_leave_plain_steps_out() -> None:
    steps, _, _ = fold([timings(1), timings(2, 3, 3), timings(3, 3, 3), timings(4, 3, 3), timings(5, 3, 3),
                        timings(6, 3, 3)], lookup=False)
    assert steps == [(3, 3), (0, 0)]  # the report's own plain step is one the draft accounting skips


def test_a_whole_answers_totals_are_split_into_steps_of_max_k() -> None:
    seen = TimingsSeen()
    report = timings_report(timings(40, 30, 20), seen, 16, True, False)
    assert report is not None and report.tokens == 40
    assert (report.proposed, report.accepted) == (15, 10)
    assert report.late_steps == (SpecSteps(15, 10, 1), SpecSteps(0, 0, 17))  # 40 - the prompt's - 2 - 20
    total_p = report.proposed + sum(g.proposed * g.count for g in report.late_steps)
    total_a = report.accepted + sum(g.accepted * g.count for g in report.late_steps)
    assert (total_p, total_a) == (30, 20)
    assert seen.take_step_ms() == []  # many steps in one chunk: none timed alone


def test_no_drafts_means_absent_counters() -> None:
    steps, _, seen = fold([timings(1), timings(2), timings(3)])
    assert steps == [(0, 0)] * 2 and seen.proposed == seen.accepted == 0


def test_each_step_told_alone_is_timed() -> None:
    seen = TimingsSeen()
    for chunk in [timings(1, ms=0.0), timings(2, ms=20.0), timings(3, 6, 4, ms=70.0), timings(4, 6, 4, ms=70.0),
                  timings(7, 6, 4, ms=70.0), timings(8, 6, 4, ms=91.0)]:
        timings_report(chunk, seen, 8, True, True)
    assert seen.take_step_ms() == [(0, 20.0), (6, 50.0), (0, 21.0)]
    costs = StepCosts()
    assert costs.model(8) is None  # nothing timed yet
    for _ in range(StepCosts.MIN_STEPS):
        costs.observe(0, 20.0)
        costs.observe(6, 50.0)
    model = costs.model(8)
    assert model is not None and model.max_k == 8 and model.step_cost[0][0] == 1.0
    assert model.step_cost[0][1:] == pytest.approx((2.5,) * 8)  # what a drafting step costs, whatever K
    assert costs.view()["relative_draft_cost"] == 2.5


@pytest.mark.parametrize("garbage", [
    {"predicted_n": "7"}, {"predicted_n": 3, "draft_n": -1, "draft_n_accepted": 0}, {"predicted_n": 3.5},
    {"predicted_n": 3, "draft_n": True}, {"predicted_n": 1 << 40}, "timings", None, [1, 2],
])
def test_unreadable_timings_are_counted_and_ignored(garbage: Any) -> None:
    seen = TimingsSeen()
    assert timings_report({"choices": [], "timings": garbage}, seen, 16, True, True) is None
    assert seen.take_clamps() == ["unreadable_timings"]
    assert seen.tokens == 1 and seen.proposed == 0


def test_counters_that_go_back_or_accept_more_than_proposed_are_clamped() -> None:
    seen = TimingsSeen()
    timings_report(timings(3, 6, 2), seen, 16, True, True)
    assert timings_report(timings(4, 2, 2), seen, 16, True, True) is None
    assert seen.take_clamps() == ["negative"]
    report = timings_report(timings(6, 8, 6), seen, 16, True, True)
    assert report is not None and (report.proposed, report.accepted) == (2, 2)
    assert seen.take_clamps() == ["accepted_over_proposed"]


def test_client_fields_that_reach_around_the_scope_rule_are_replaced() -> None:
    body = llamacpp_body({"cache_prompt": True, "id_slot": 0, "n_cache_reuse": 64, "timings_per_token": False,
                          "messages": []}, streamed=True, lease=SlotLease(None, False))
    assert body == {"messages": [], "cache_prompt": False, "timings_per_token": True}
    assert llamacpp_body({}, streamed=False, lease=SlotLease(2, True)) == {"cache_prompt": True, "id_slot": 2}


def test_one_scope_reuses_the_servers_cache_and_the_server_picks_slots() -> None:
    scopes = PromptScopes(scoped_slots=2)
    assert [scopes.lease("a") for _ in range(3)] == [SlotLease(None, True)] * 3


def test_without_scoped_slots_a_second_scope_ends_all_reuse() -> None:
    scopes = PromptScopes()
    assert scopes.lease("a") == SlotLease(None, True)
    assert scopes.lease("b") == SlotLease(None, False)
    assert scopes.lease("a") == SlotLease(None, False)  # --cache-ram moves prompts between slots
    assert scopes.view()["scopes"] == "mixed"


def test_scoped_slots_keep_each_scope_in_slots_of_its_own() -> None:
    scopes = PromptScopes(scoped_slots=3)
    assert scopes.lease("a") == SlotLease(None, True)
    b1 = scopes.lease("b")  # every slot ran a until now: b takes one over, reusing nothing
    assert b1.slot is not None and not b1.reuse
    scopes.release(b1)
    assert scopes.lease("b") == SlotLease(b1.slot, True)  # ...and finds it again
    a1 = scopes.lease("a")
    assert a1.slot not in (None, b1.slot) and a1.reuse
    c1 = scopes.lease("c")  # one idle slot left, a's: taken over without reuse
    assert c1.slot not in (None, b1.slot, a1.slot) and not c1.reuse
    assert scopes.lease("a") == SlotLease(None, False)  # every slot busy: the server picks, no reuse
    assert scopes.view() == {"scopes": "mixed", "scoped_slots": 3, "slots_busy": 3}
    scopes.release(c1)
    again = scopes.lease("c")
    assert again == SlotLease(c1.slot, True)


def test_depth_from_llamacpp_metrics() -> None:
    text = "# HELP llamacpp:requests_processing x\nllamacpp:requests_processing 3\nllamacpp:requests_deferred 2\n"
    assert read_depth(text) == (3, 2)
    assert read_depth("vllm:num_requests_running 1\n") is None
    assert read_depth("llamacpp:requests_processing nan\n") is None  # not a count


def remote(**fields: Any) -> dict[str, Any]:
    return {"workers": {"count": 0, "remote": [{"url": "http://127.0.0.1:9", "protocol": "llamacpp", **fields}]}}


def test_llamacpp_remotes_in_the_config() -> None:
    plain = parse_config(remote(), BASE).workers.remote[0]
    assert (plain.protocol, plain.method, plain.mode) == ("llamacpp", "none", "plain")
    ngram = parse_config(remote(method="ngram", max_k=48, scoped_slots=4), BASE).workers.remote[0]
    assert (ngram.method, ngram.mode, ngram.max_k, ngram.scoped_slots) == ("ngram", "speculative", 48, 4)


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"method": "ngram"}, "workers.remote[0].max_k", "its longest draft"),
    ({"method": "suffix", "max_k": 8}, "workers.remote[0].method", "must be one of"),
    ({"mode": "speculative", "method": "ngram", "max_k": 8}, "workers.remote[0].mode", "method says what it runs"),
    ({"scoped_slots": 1000}, "workers.remote[0].scoped_slots", "must be <= 256"),
])
def test_a_method_that_does_not_fit_the_protocol_is_refused(fields: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(remote(**fields), BASE)
    assert raised.value.field == field and message in str(raised.value)


def test_an_openai_server_takes_no_method() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({"workers": {"remote": [{"url": "http://x:1", "protocol": "openai", "method": "ngram"}]}}, BASE)
    assert raised.value.field == "workers.remote[0].method"


def test_scoped_slots_are_for_llamacpp_servers() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({"workers": {"remote": [{"url": "http://x:1", "protocol": "vllm", "scoped_slots": 2}]}}, BASE)
    assert raised.value.field == "workers.remote[0].scoped_slots"


def test_the_deploy_example_is_a_valid_config() -> None:
    from gateway.config.config import load_config
    config = load_config(BASE.parents[1] / "deploy" / "llamacpp" / "config.yaml")
    plain, ngram = config.workers.remote
    assert (plain.protocol, plain.method, ngram.protocol, ngram.method) == ("llamacpp", "none", "llamacpp", "ngram")
    assert "ngram" in config.policy.methods and config.model.draft is None
