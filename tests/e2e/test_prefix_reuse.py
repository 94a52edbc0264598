"""Prefix reuse in real embedded workers (the demo pair), through the gateway and the openai SDK:
a session's second turn reports the prompt tokens its worker kept from the first
(``usage.prompt_tokens_details.cached_tokens``) and counts them in the worker's metrics; a
gateway whose workers keep nothing (``workers.prefix_cache_mb: 0``) answers the same text and
leaves the field out."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tests.e2e.harness import Gateway, GatewayFactory, sdk_client

SYSTEM = ("You are the build assistant of the Hollins project. Answer with Python code only, in the "
          "project's style: four-space indents, type hints, docstrings on public functions. ") * 8
QUESTIONS = ("def add(a, b):", "def sub(a, b):", "def mul(a, b):")
CHUNK = 128  # workers/engines/embedded/prefix_cache.py PREFILL_CHUNK


@pytest.fixture(scope="module")
def reusing(gateway_factory: GatewayFactory) -> Gateway:
    return gateway_factory("gw-prefix-reuse", workers={"count": 1, "prefix_cache_mb": 64}, workers_ready=1)


@pytest.fixture(scope="module")
def keeping_nothing(gateway_factory: GatewayFactory) -> Gateway:
    return gateway_factory("gw-prefix-none", workers={"count": 1, "prefix_cache_mb": 0}, workers_ready=1)


def conversation(gateway: Gateway, session: str) -> Generator[tuple[str, int, int | None], None, None]:
    """Three turns, each appending the answer and the next question: (text, prompt tokens, cached)."""
    messages = [{"role": "system", "content": SYSTEM}]
    with sdk_client(gateway) as client:
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            answer = client.chat.completions.create(model="specgate-demo", messages=messages,  # type: ignore[arg-type]
                                                    max_tokens=24, temperature=0,
                                                    extra_headers={"X-Session-ID": session})
            assert answer.usage is not None
            details = answer.usage.prompt_tokens_details
            text = answer.choices[0].message.content or ""
            yield text, answer.usage.prompt_tokens, None if details is None else details.cached_tokens
            messages.append({"role": "assistant", "content": text})


def test_later_turns_reuse_the_first_and_change_nothing(reusing: Gateway, keeping_nothing: Gateway) -> None:
    turns = list(conversation(reusing, "reuse-a"))
    first_prompt = turns[0][1]
    assert first_prompt > CHUNK, "the system prompt must fill a chunk"
    assert turns[0][2] == 0  # nothing kept yet: a miss, reported as 0
    for _, prompt_tokens, cached in turns[1:]:
        # At least the first turn's whole chunks (each turn's prompt starts with the one before).
        assert cached is not None and cached >= (first_prompt - 1) // CHUNK * CHUNK and cached % CHUNK == 0
        assert cached < prompt_tokens
    cold = list(conversation(keeping_nothing, "cold-a"))
    assert [t[0] for t in cold] == [t[0] for t in turns]  # the same text, turn by turn
    assert all(cached is None for _, _, cached in cold)  # no cache: no field
    # Each worker says whether it keeps prompt K/V: the gateway places no session by prefix on
    # one that keeps none (gateway/placement.py).
    assert [w["prefix_cache"] for w in reusing.get_json("/admin/workers")["workers"]] == [True]
    assert [w["prefix_cache"] for w in keeping_nothing.get_json("/admin/workers")["workers"]] == [False]
    hits = reusing.metric("specgate_worker_prefix_cache_requests_total", result="hit")
    misses = reusing.metric("specgate_worker_prefix_cache_requests_total", result="miss")
    assert hits == 2 and misses == 1
    assert reusing.metric("specgate_worker_prefix_cached_tokens_total") == sum(t[2] or 0 for t in turns)
    assert 0 < reusing.metric("specgate_worker_prefix_cache_bytes") <= 64 << 20


def test_a_new_session_with_the_same_system_prompt_hits(reusing: Gateway) -> None:
    """Another conversation on the same worker: its first turn finds the system prompt's chunks."""
    warm, turns = conversation(reusing, "reuse-b"), conversation(reusing, "reuse-c")
    next(warm)  # the system prompt kept (if no test before did)
    text, _, cached = next(turns)
    warm.close()
    turns.close()
    assert cached is not None and cached >= CHUNK and text
