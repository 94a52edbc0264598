"""Shadow evidence end to end (docs/methods.md "Shadow evidence"): a real embedded worker on the
demo pair replays the lookup methods a request did not run, and the gateway folds what it
replayed into the session's evidence, so a session on the draft model learns each lookup method
without running it, count for count what the worker replayed."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.harness import Gateway, GatewayFactory, sdk_client

CODE = "".join(f"def field_{i}(self):\n    return self._field_{i}\n\n" for i in range(12))
COUNTS = ("steps", "proposed", "accepted", "tested")


@pytest.fixture(scope="module")
def gateway(gateway_factory: GatewayFactory) -> Gateway:
    return gateway_factory("gw-shadow", workers={"count": 1}, workers_ready=1,
                           policy={"num_speculative_tokens": "auto", "methods": ["draft", "ngram", "suffix"],
                                   "method_explore_every": 1})


def _ask(gateway: Gateway, session: str, turn: int, temperature: float) -> str:
    raw = sdk_client(gateway).completions.with_raw_response.create(
        model="specgate-demo", prompt=CODE + f"def field_{12 + turn}(self):\n", max_tokens=48,
        temperature=temperature, extra_headers={"X-Session-ID": session})
    answer: Any = raw.parse()
    assert "shadow" not in answer.usage.model_extra["speculative"]  # worker to gateway only
    return str(raw.headers["X-Specgate-Mode"])


def _replayed(gateway: Gateway, method: str) -> dict[str, float]:
    """What the worker says it replayed of ``method``, by count (its own counter)."""
    return {c: gateway.metric("specgate_worker_shadow_drafts_total", method=method, count=c) for c in COUNTS}


def test_a_session_on_the_draft_learns_lookup_without_running_it(gateway: Gateway) -> None:
    # Its first request runs the draft model (nothing is known of lookup yet, and a lookup
    # method is not explored where the worker's shadow will bring its evidence), or plain where
    # the worker's start-up measurement says the draft buys nothing (`no_gain`: on a machine
    # busy with other tests it can). Either way no lookup method runs.
    mode = _ask(gateway, "shadow-1", 0, 0.0)
    assert mode.startswith(("speculative; method=draft;", "plain; reason=no_gain")), mode
    admin = gateway.get_json("/admin/sessions/shadow-1")
    for method in ("ngram", "suffix"):
        evidence = admin["methods"][method]
        replayed = _replayed(gateway, method)
        assert evidence["steps"] == evidence["shadow_steps"] == replayed["steps"] > 0, (method, evidence, replayed)
        assert (evidence["shadow_drafts_proposed"], evidence["shadow_drafts_accepted"],
                evidence["shadow_drafts_tested"]) == (replayed["proposed"], replayed["accepted"], replayed["tested"]), (
            method, evidence, replayed)
        # Replays are labelled apart: no usage counted them, so they are not the method's drafts.
        assert (evidence["drafts_proposed"], evidence["drafts_tested"]) == (0, 0)
        assert admin["speculative"]["shadow"][method] == {**{c: replayed[c] for c in ("proposed", "accepted",
                                                                                       "tested")},
                                                           "steps": replayed["steps"]}
        assert admin["speculative"]["by_method"][method] == {"proposed": 0, "accepted": 0, "tested": 0}
        assert evidence["coverage"] is not None
        # The gateway's own count of what it folded, the same.
        assert {c: gateway.metric("specgate_method_shadow_drafts_total", method=method, count=c)
                for c in COUNTS} == replayed
        assert gateway.metric("specgate_method_steps_total", method=method) == 0  # it never ran
    assert _replayed(gateway, "ngram")["accepted"] > 0  # the prompt repeats: prompt lookup would have found it


def test_no_request_at_t0_explores_a_lookup_method(gateway: Gateway) -> None:
    modes = [_ask(gateway, "shadow-2", turn, 0.0) for turn in range(4)]
    assert all("reason=explore" not in m for m in modes), modes
    methods = gateway.get_json("/admin/sessions/shadow-2")["methods"]
    # Each lookup method learned from every request that ran something else (the worker's prior
    # from the first test may put the session on one of them from its first request).
    for method in ("ngram", "suffix"):
        others = sum(f"method={method};" not in m for m in modes)
        assert (methods[method]["shadow_steps"] > 0) == (others > 0), (method, modes, methods)


def test_unseeded_sampling_brings_no_shadow(gateway: Gateway) -> None:
    before = _replayed(gateway, "ngram")["steps"]
    _ask(gateway, "shadow-hot", 0, 0.5)
    assert _replayed(gateway, "ngram")["steps"] == before
    methods = gateway.get_json("/admin/sessions/shadow-hot")["methods"]
    assert all(evidence["shadow_steps"] == 0 for evidence in methods.values()), methods


def test_a_streamed_answer_shows_the_shadow_in_its_last_step_report(gateway: Gateway) -> None:
    """The relay forwards a streamed chunk's ``specgate`` step report as the worker sent it: the
    last one carries the shadow (docs/api.md, a specgate extension), never the usage."""
    stream = sdk_client(gateway).completions.create(
        model="specgate-demo", prompt=CODE, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Session-ID": "shadow-stream"})
    reports: list[Any] = [(chunk.model_extra or {}).get("specgate") for chunk in stream if chunk.choices]
    assert all(r is None or "shadow" not in r for r in reports[:-1])
    shadow = reports[-1]["shadow"]
    assert shadow and set(shadow) <= {"ngram", "suffix"}, reports[-1]
    assert all(len(run) == 3 for runs in shadow.values() for run in runs)
