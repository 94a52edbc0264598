"""Issue #8, "same answers as the reference server", end to end through a real gateway and worker.

- D2/D3: a stop string ends the output with finish_reason "stop", and completion_tokens counts
  the tokens up to and including the one that completed it (vLLM's count), even when a
  speculative step emitted more, or reached max_tokens, in the same step.
- D4: a seeded request returns the same text whatever the mode, K, batch and batch latch.
- D5: any ``user`` OpenAI accepts is accepted; it keys the session through a digest.
- usage.speculative says what ran: speculative and plain steps.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
import torch

from gateway.admission import user_session_id
from tests.e2e.harness import MODELS, Gateway, sdk_client
from tests.unit.engine.seeded_reference import MIN_MARGIN, gumbel_reference
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.projections import TORCH_DTYPES, resolve_dtype
from workers.engines.embedded.sampling import SamplingParams
from workers.text import TextCodec

FIB = "def fibonacci(n):\n    "
CODE = "import os\n\n\ndef list_python_files(root):\n    "
SHORT = "import os\n"  # fewer tokens than ride in a decode step: its first step already drafts
MAX_K = 8  # the worker's (config default)


@pytest.fixture
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with sdk_client(gateway) as sdk:
        yield sdk


@dataclass(frozen=True)
class Answer:
    text: str
    finish: str | None
    usage: dict[str, Any]
    mode: str  # X-Specgate-Mode

    @property
    def speculative(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.usage["speculative"]
        return spec


def complete(client: openai.OpenAI, stream: bool, **body: Any) -> Answer:
    if not stream:
        raw = client.completions.with_raw_response.create(model="specgate-demo", **body)
        response = raw.parse()
        assert response.usage is not None
        return Answer(response.choices[0].text, response.choices[0].finish_reason, response.usage.model_dump(),
                      raw.headers["X-Specgate-Mode"])
    raw_stream = client.completions.with_raw_response.create(
        model="specgate-demo", stream=True, stream_options={"include_usage": True}, **body)
    text, finish, usage = "", None, None
    for chunk in raw_stream.parse():
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    assert usage is not None
    return Answer(text, finish, usage, raw_stream.headers["X-Specgate-Mode"])


def first_count_containing(client: openai.OpenAI, stop: str, expected: int, **body: Any) -> bool:
    """vLLM's count, checked: the free text of ``expected`` tokens contains ``stop``; one fewer does not."""
    free = [complete(client, False, max_tokens=n, **body).text for n in (expected - 1, expected)]
    return stop not in free[0] and stop in free[1]


def put_policy(gateway: Gateway, **changes: Any) -> None:
    policy = {**gateway.get_json("/admin/policy")["policy"], **changes}
    request = urllib.request.Request(gateway.url + "/admin/policy", data=json.dumps(policy).encode(), method="PUT",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


@pytest.fixture
def policy(gateway: Gateway) -> Iterator[None]:
    """Restores the policy a test edits (PUT /admin/policy)."""
    original = gateway.get_json("/admin/policy")["policy"]
    yield
    put_policy(gateway, **original)


# -- D2, D3 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_stop_in_the_step_that_reaches_max_tokens_is_stop(gateway: Gateway, client: openai.OpenAI,
                                                          stream: bool) -> None:
    """D2's reproduction: the step that completes "<= b" also reaches max_tokens=7."""
    tokens_before = gateway.metric("specgate_tokens_total")
    answer = complete(client, stream, prompt=FIB, max_tokens=7, temperature=0, stop="<= b")
    assert answer.mode.startswith("speculative")
    assert (answer.text, answer.finish, answer.usage["completion_tokens"]) == (' "Same as a ', "stop", 6)
    # The token metrics (fed by the per-chunk step reports) count the same 6.
    assert gateway.metric("specgate_tokens_total") - tokens_before == 6
    # It really is that case: one speculative step after the prefill produced all 7 tokens.
    assert answer.speculative["speculative_steps"] == 1 and answer.speculative["accepted"] >= 5
    assert first_count_containing(client, "<= b", 6, prompt=FIB, temperature=0)


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_after_a_stop_are_not_counted(gateway: Gateway, client: openai.OpenAI, stream: bool) -> None:
    """D3's reproduction: the step that completed " a" emitted more tokens, which nobody receives."""
    tokens_before = gateway.metric("specgate_tokens_total")
    answer = complete(client, stream, prompt=FIB, max_tokens=64, temperature=0, stop=" a")
    assert answer.mode.startswith("speculative")
    assert (answer.text, answer.finish, answer.usage["completion_tokens"]) == (' "Same', "stop", 3)
    assert answer.usage["total_tokens"] == answer.usage["prompt_tokens"] + 3
    assert gateway.metric("specgate_tokens_total") - tokens_before == 3
    assert first_count_containing(client, " a", 3, prompt=FIB, temperature=0)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_in_plain_mode_counts_exactly(client: openai.OpenAI, stream: bool) -> None:
    """Plain decoding (a seeded request hotter than max_temperature): the same rules."""
    body: dict[str, Any] = {"prompt": CODE, "temperature": 1.0, "seed": 3}
    free = complete(client, False, max_tokens=24, **body)
    assert free.mode == "plain; reason=high_temperature" and free.usage["completion_tokens"] == 24
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    answer = complete(client, stream, max_tokens=24, stop=stop, **body)
    assert answer.mode == "plain; reason=high_temperature"
    assert (answer.text, answer.finish) == (free.text[:free.text.index(stop)], "stop")
    count = answer.usage["completion_tokens"]
    assert count < 24 and first_count_containing(client, stop, count, **body)
    assert (answer.speculative["speculative_steps"], answer.speculative["plain_steps"]) == (0, count)


# -- usage: what ran ---------------------------------------------------------------------------------
async def _stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Answer:
    body = {"model": "specgate-demo", "stream": True, "stream_options": {"include_usage": True}, **body}
    async with http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        text, finish, usage = "", None, None
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
            usage = chunk.get("usage") or usage
        assert usage is not None
        return Answer(text, finish, usage, response.headers["X-Specgate-Mode"])


async def _together(gateway: Gateway, bodies: list[dict[str, Any]]) -> list[Answer]:
    async with aiohttp.ClientSession() as http:
        url = gateway.base_url + "/completions"
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(_stream(http, url, body)))
            await asyncio.sleep(0.02)  # in order, so the first ones are admitted speculative
        return list(await asyncio.gather(*tasks))


def test_usage_counts_the_steps_that_ran(gateway: Gateway, client: openai.OpenAI, policy: None) -> None:
    """The gateway decides speculative; the worker's batch latch (max_batch 1) runs steps plain."""
    # 120 tokens: long enough that the first request is still running when the last arrives
    # on a fast CPU (the engine emits tens of tokens in the 20 ms between arrivals).
    alone = complete(client, False, prompt=SHORT, max_tokens=120, temperature=0)
    assert alone.mode.startswith("speculative")
    # At most the final single-token step drafts nothing when alone.
    assert alone.speculative["speculative_steps"] >= 3 and alone.speculative["plain_steps"] <= 1
    put_policy(gateway, max_batch=1, batch_resume=1)
    answers = asyncio.run(_together(gateway, [{"prompt": SHORT, "max_tokens": 120, "temperature": 0}] * 4))
    decided = [a for a in answers if a.mode.startswith("speculative")]
    assert decided and any(a.mode == "plain; reason=batch_full" for a in answers), [a.mode for a in answers]
    for answer in decided:  # decided speculative, ran mostly plain: the usage says so
        assert answer.speculative["mode"] == "speculative"
        assert answer.speculative["plain_steps"] >= 5, answer.speculative
    for answer in answers:
        assert answer.text == alone.text  # greedy: the mode changes nothing
        steps = answer.speculative["speculative_steps"] + answer.speculative["plain_steps"]
        assert steps <= answer.usage["completion_tokens"]
        if answer.mode.startswith("plain"):
            assert answer.speculative["speculative_steps"] == 0 and answer.speculative["proposed"] == 0


# -- D4 ---------------------------------------------------------------------------------------------
def test_seeded_answer_is_the_same_in_every_mode(gateway: Gateway, client: openai.OpenAI, policy: None) -> None:
    """One seeded request at T=0.8: plain, K = 1..max_k, batched with 7 others, under a latch.

    Where the target runs prepacked bfloat16, verification is bit-identical to plain decoding.
    Elsewhere (float32) it rounds differently at ~1e-6, so the test first checks its premise:
    at every position of this answer the best perturbed score beats the second by far more.
    """
    seed, body = 1, {"prompt": CODE, "max_tokens": 40, "temperature": 0.8}
    if resolve_dtype("auto") == "float32":
        codec = TextCodec.from_model_dir(MODELS / "demo-target")
        with torch.inference_mode():
            target = LlamaForCausalLM.from_pretrained(MODELS / "demo-target", TORCH_DTYPES["float32"])
            _, margin = gumbel_reference(target, codec.encode(CODE), 40, SamplingParams(0.8, seed=seed))
        assert margin > MIN_MARGIN, margin
    put_policy(gateway, max_temperature=0.5)
    plain = complete(client, False, seed=seed, **body)
    assert plain.mode == "plain; reason=high_temperature" and plain.speculative["speculative_steps"] == 0
    assert len(plain.text) > 40
    put_policy(gateway, max_temperature=0.8)
    for k in range(1, MAX_K + 1):
        put_policy(gateway, num_speculative_tokens=k)
        answer = complete(client, k % 2 == 0, seed=seed, **body)
        assert answer.mode.startswith(f"speculative; k={k};") and answer.speculative["accepted"] > 0
        assert answer.text == plain.text, k
    put_policy(gateway, num_speculative_tokens=6)
    others = [{**body, "prompt": f"def helper_{i}(x):\n    ", "seed": 100 + i} for i in range(7)]
    batched = asyncio.run(_together(gateway, [*others[:3], {**body, "seed": seed}, *others[3:]]))
    assert batched[3].text == plain.text
    put_policy(gateway, max_batch=1, batch_resume=1)
    latched = asyncio.run(_together(gateway, [*others[:2], {**body, "seed": seed}, *others[2:]]))
    assert latched[2].speculative["plain_steps"] > 1  # the latch ran steps plain
    assert latched[2].text == plain.text


# -- D5 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("user", ["u" * 300, "tab\there", "line\nbreak", "para\u2028sep", "emoji ✓ \x00 nul"])
def test_any_user_is_accepted_and_keys_a_session(gateway: Gateway, client: openai.OpenAI, user: str) -> None:
    raws = [client.completions.with_raw_response.create(model="specgate-demo", prompt=SHORT, max_tokens=2,
                                                        temperature=0, user=user) for _ in range(2)]
    assert all(raw.http_response.status_code == 200 for raw in raws)
    key = user_session_id(user)
    assert {raw.headers["X-Session-ID"] for raw in raws} == {key} and len(key) == 37
    assert gateway.get_json(f"/admin/sessions/{key}")["requests"] == 2


def test_session_header_keeps_its_rules(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="specgate-demo", prompt=SHORT, max_tokens=2, user="fine",
                                  extra_headers={"X-Session-ID": "h" * 300})
    assert info.value.param == "X-Session-ID"


def test_lone_surrogate_user(gateway: Gateway) -> None:
    """JSON may carry an unpaired surrogate; Python's UTF-8 codec refuses to encode it plainly."""
    body = b'{"model": "specgate-demo", "prompt": "import os\\n", "max_tokens": 1, "user": "x\\ud800y"}'
    request = urllib.request.Request(gateway.base_url + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        assert response.headers["X-Session-ID"] == user_session_id("x\ud800y")


# -- vLLM's ignore_eos and min_tokens (what `vllm bench serve` sends) --------------------------------
CHATS = ["Write a Python function `add`.", "What does `os.walk` return?", "Fix: def f(x) return x",
         "Name a list method.", "Say hi."]


def _chat(client: openai.OpenAI, content: str, **extra: Any) -> Any:
    return client.chat.completions.create(model="specgate-demo", messages=[{"role": "user", "content": content}],
                                          max_tokens=96, temperature=0, extra_body=extra or None)


def test_ignore_eos_generates_to_max_tokens_and_min_tokens_holds_eos_back(client: openai.OpenAI) -> None:
    ended = [(c, a) for c in CHATS if (a := _chat(client, c)).choices[0].finish_reason == "stop"]
    assert ended, "no chat ended on EOS within 96 tokens"
    content, answer = ended[0]
    eos_at = answer.usage.completion_tokens  # the EOS token counts, as vLLM counts it
    ignored = _chat(client, content, ignore_eos=True)
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 96
    assert (ignored.choices[0].message.content or "").startswith(answer.choices[0].message.content or "")
    held = _chat(client, content, min_tokens=eos_at + 4)
    assert held.usage.completion_tokens >= eos_at + 4
    assert (held.choices[0].message.content or "").startswith(answer.choices[0].message.content or "")


def test_min_tokens_above_max_tokens_is_refused_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="specgate-demo", prompt=SHORT, max_tokens=4, extra_body={"min_tokens": 5})
    assert info.value.body["param"] == "min_tokens"  # type: ignore[index]


# -- issue 52's smaller findings ----------------------------------------------------------------------
COUNT_PROMPT = "import os\n\n\ndef list_python_files(root):\n    "


def _tokens_to_complete(client: openai.OpenAI, stop: str, occurrence: int, limit: int) -> int:
    """How many output tokens the greedy answer has when ``stop``'s ``occurrence``-th match is complete."""
    low, high = 1, limit  # the fewest tokens whose text holds it: a binary search on max_tokens
    while low < high:
        middle = (low + high) // 2
        text = complete(client, False, prompt=COUNT_PROMPT, max_tokens=middle, temperature=0).text
        if text.count(stop) >= occurrence:
            high = middle
        else:
            low = middle + 1
    return low


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_with_stop_as_vllm(client: openai.OpenAI, stream: bool) -> None:
    """A stop completed by token ``min_tokens`` or earlier stays and generation goes on; one
    completed after it ends the text before it (vLLM's detokenizer; tests/unit/test_text.py has
    the table)."""
    free = complete(client, False, prompt=COUNT_PROMPT, max_tokens=64, temperature=0).text
    stop = next(c for c in ("(", ")", ":", "\n", " ") if free.count(c) >= 2)
    first = _tokens_to_complete(client, stop, 1, 64)
    second_at = free.index(stop, free.index(stop) + 1)
    kept = complete(client, stream, prompt=COUNT_PROMPT, max_tokens=64, temperature=0, stop=[stop],
                    extra_body={"min_tokens": first})
    assert (kept.text, kept.finish) == (free[:second_at], "stop"), (stop, first, free)
    cut = complete(client, stream, prompt=COUNT_PROMPT, max_tokens=64, temperature=0, stop=[stop],
                   extra_body={"min_tokens": first - 1})
    assert (cut.text, cut.finish) == (free[:free.index(stop)], "stop"), (stop, first, free)


def test_stream_options_without_stream_is_refused(client: openai.OpenAI) -> None:
    for stream in (None, False):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="specgate-demo", prompt=SHORT, max_tokens=2,
                                      stream=stream, stream_options={"include_usage": True})
        body: Any = info.value.body
        assert body == {"message": "Stream options can only be defined when `stream=True`.",
                        "type": "invalid_request_error", "param": "stream_options", "code": None}


def test_a_non_ascii_session_id_is_refused_naming_the_header(gateway: Gateway) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
    body = json.dumps({"model": "specgate-demo", "prompt": SHORT, "max_tokens": 1}).encode()
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(len(body)))
    connection.putheader("X-Session-ID", "café-session".encode())  # UTF-8 bytes on the wire
    connection.endheaders(body)
    response = connection.getresponse()
    error = json.loads(response.read())["error"]
    connection.close()
    assert response.status == 400 and error["param"] == "X-Session-ID" and "ASCII" in error["message"]


def test_the_window_a_client_sees_is_the_configured_one(gateway: Gateway, client: openai.OpenAI) -> None:
    """The whole slot is the window (no positions held back for drafts), reported alike by
    /v1/models, /tokenize and the 400."""
    window = gateway.get_json("/v1/models")["data"][0]["max_model_len"]
    assert window == 1024  # the demo target's max_position_embeddings
    request = urllib.request.Request(gateway.url + "/tokenize", data=json.dumps(
        {"model": "specgate-demo", "prompt": "x"}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.loads(response.read())["max_model_len"] == window
    usage = client.completions.create(model="specgate-demo", prompt=SHORT, max_tokens=1).usage
    assert usage is not None
    prompt_tokens = usage.prompt_tokens
    answer = client.completions.create(model="specgate-demo", prompt=SHORT, max_tokens=window - prompt_tokens,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert answer.usage is not None and answer.usage.total_tokens == window  # the last position is usable
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="specgate-demo", prompt=SHORT, max_tokens=window - prompt_tokens + 1)
    assert f"context window of {window}" in info.value.body["message"]  # type: ignore[index]
