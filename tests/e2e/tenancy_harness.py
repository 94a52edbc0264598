"""The tenant-isolation trial (issue 52), shared by tests/e2e/test_tenancy.py and the vLLM lane's
tests/e2e/vllm/test_vllm_tenancy.py: API keys, secret system prompts, one streamed request, and
the two checks (caches and lookup proposals) against any OpenAI base URL."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import openai

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"
KEY_C, KEY_D = "sk-team-c-0123456789", "sk-team-d-0123456789"  # both of tenant "team"
KEY_E = "sk-tenant-e-0123456789"  # never used before the suffix test: a fresh scope
API_KEYS: list[Any] = [KEY_A, KEY_B, {"key": KEY_C, "tenant": "team"}, {"key": KEY_D, "tenant": "team"}, KEY_E]
WORDS = ("amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor", "indigo", "juniper", "kelp",
         "lagoon", "meadow", "nectar", "obsidian", "prairie", "quartz", "reef", "sierra", "tundra", "umber")


def secret_system(seed: int, words: int = 180) -> str:
    """A system prompt no one else sends (180 words: about 500 tokens of the demo tokenizer)."""
    rng = random.Random(seed)
    return "Keep these notes private: " + " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(words))


@dataclass
class Answer:
    ttft_s: float
    cached: int | None
    route: str
    mode: str
    text: str
    usage: Any


def ask(base_url: str, key: str, system: str, question: str, session: str | None = None, salt: str | None = None,
        max_tokens: int = 8) -> Answer:
    """One streamed chat request: its time to first token, cached tokens, route and mode."""
    extra: dict[str, Any] = {} if salt is None else {"cache_salt": salt}
    headers = {} if session is None else {"X-Session-ID": session}
    with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60) as client:
        started = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(
            model="specgate-demo",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_headers=headers, extra_body=extra)
        first: float | None = None
        text, usage = "", None
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter() - started
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
    assert usage is not None and first is not None
    details = usage.prompt_tokens_details
    return Answer(first, None if details is None else details.cached_tokens, raw.headers.get("X-Specgate-Route", ""),
                  raw.headers.get("X-Specgate-Mode", ""), text, usage)


def two_keys_never_share(base_url: str, rounds: int = 3, route_header: bool = True, words: int = 180) -> None:
    """The issue's trial, ``rounds`` times with a fresh secret each: B's first request is cold in
    every way a client can see; A's second and the named tenant's other key hit; a salt scopes."""
    ratios = []
    # The first requests of a fresh process are slower (connections, first forwards): not A's to pay.
    for warm_up in range(2):
        ask(base_url, KEY_E, secret_system(-1 - warm_up, words), "Hello.", salt="warm-up")
    for r in range(rounds):
        system = secret_system(1000 * r + int(time.time()) % 1000, words)
        a_cold = ask(base_url, KEY_A, system, "Summarise the notes.", session=f"a-{r}")
        # B with a session id of its own, or none at all (every other round).
        b = ask(base_url, KEY_B, system, "What is the first note?", session=f"b-{r}" if r % 2 == 0 else None)
        a_warm = ask(base_url, KEY_A, system, "Anything else?", session=f"a-{r}-again")
        b_warm = ask(base_url, KEY_B, system, "And the last note?")
        assert a_cold.cached == 0, a_cold
        assert b.cached == 0, b
        if route_header:
            assert b.route != "prefix", b
        assert a_warm.cached is not None and a_warm.cached > 0, a_warm  # scoping costs A none of its own hits
        assert b_warm.cached is not None and b_warm.cached > 0, b_warm  # ...nor B, once B sent it
        # B's first request against A's warm one: a hit on A's tokens would make them alike.
        ratios.append(b.ttft_s / a_warm.ttft_s)
        # Two keys of one named tenant share their caches (their sessions stay apart).
        c = ask(base_url, KEY_C, system + " team", "Summarise.", session="team")
        d = ask(base_url, KEY_D, system + " team", "Summarise again.", session="team")
        assert c.cached == 0 and d.cached is not None and d.cached > 0, (c, d)
        # One key, two salts: two scopes; the same salt again: a hit.
        x1 = ask(base_url, KEY_A, system + " salted", "Summarise.", salt=f"x-{r}")
        y1 = ask(base_url, KEY_A, system + " salted", "Summarise.", salt=f"y-{r}")
        x2 = ask(base_url, KEY_A, system + " salted", "Summarise once more.", salt=f"x-{r}")
        assert x1.cached == 0 and y1.cached == 0, (x1, y1)
        assert x2.cached is not None and x2.cached > 0, x2
    # Timing says nothing either: B's first request takes the time of a cold prompt, well beyond
    # A's warm one (median over the rounds). Against A's own cold request (as close as two cold
    # requests are) a bound flaked under 3 test processes on 2 cores: 0.72, 1.01, 0.69.
    assert statistics.median(ratios) >= 1.25, ratios


CODE_PROMPT = "def parse_header(line):\n    "  # the demo target writes code; little of it repeats the prompt


def suffix_proposals_stay_in_scope(base_url: str) -> None:
    """Key A's session generates a text; key B, with the same session id, on the same prompt,
    gets the proposals a fresh key gets (its own sequence only), and key A's next request gets
    its earlier output proposed. Every request carries one salt no other test sends, so each key's
    scope here starts empty (what the other tests' requests left is in other scopes)."""
    def run(key: str) -> tuple[str, dict[str, Any]]:
        with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60) as client:
            raw = client.completions.with_raw_response.create(
                model="specgate-demo", prompt=CODE_PROMPT, max_tokens=48, temperature=0,
                extra_headers={"X-Session-ID": "same-id"}, extra_body={"cache_salt": "suffix-test"})
            answer: Any = raw.parse()
        assert "method=suffix" in raw.headers["X-Specgate-Mode"], raw.headers["X-Specgate-Mode"]
        return answer.choices[0].text, answer.usage.model_extra["speculative"]

    text_a1, spec_a1 = run(KEY_A)
    text_a2, spec_a2 = run(KEY_A)
    text_b, spec_b = run(KEY_B)
    text_e, spec_e = run(KEY_E)
    assert text_a1 == text_a2 == text_b == text_e  # greedy: one text whatever was proposed
    # A's second request replays A's first output: nearly every draft accepted.
    assert spec_a2["accepted"] > spec_b["accepted"], (spec_a2, spec_b)
    # B proposes exactly what a never-seen key proposes, as A did the first time: nothing came from
    # A's prompt or answer.
    fresh = (spec_e["proposed"], spec_e["accepted"])
    assert (spec_b["proposed"], spec_b["accepted"]) == fresh == (spec_a1["proposed"], spec_a1["accepted"]), (
        spec_a1, spec_b, spec_e)
