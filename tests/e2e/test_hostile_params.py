"""Request parameters through a real gateway and worker: degenerate sampling values are refused and
cannot hurt another user's stream; every OpenAI parameter is supported, accepted at its default,
or refused with a 400 that names it."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import aiohttp
import openai
import pytest

from tests.e2e.harness import Gateway, sdk_client

MODEL = "specgate-demo"
PROMPT = "import os\n\n\ndef walk(root):\n    "
MESSAGES: Any = [{"role": "user", "content": "Write a Python function `add`."}]


def post(gateway: Gateway, path: str, body: dict[str, Any] | bytes) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(gateway.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


# (fields, expected status, the param a 400 names)
DEGENERATE: list[tuple[dict[str, Any], int, str | None]] = [
    ({"temperature": 0.7, "top_p": 0}, 400, "top_p"),
    ({"temperature": 0.7, "top_p": -1}, 400, "top_p"),
    ({"temperature": 0.7, "top_p": 1.5}, 400, "top_p"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"temperature": 1e308}, 400, "temperature"),
    ({"top_k": 10**12}, 400, "top_k"),
    ({"top_k": -7}, 400, "top_k"),
    ({"seed": 2**70}, 400, "seed"),
    ({"max_tokens": 2**40}, 400, "max_tokens"),
    ({"temperature": 1e-30}, 200, None),  # below 1e-5: greedy
    ({"temperature": 0.7, "top_p": 5e-324}, 200, None),  # rounds to 0 in float32: kept at the top token
]


async def test_degenerate_sampling_cannot_hurt_another_stream(gateway: Gateway) -> None:
    victim_body = completion(max_tokens=400, temperature=0, stream=True, stream_options={"include_usage": True})
    log_start = len(gateway.log())
    async with aiohttp.ClientSession() as http, http.post(gateway.base_url + "/completions",
                                                          json=victim_body) as victim:
        assert victim.status == 200
        lines = [await victim.content.readline()]  # the victim is decoding

        async def hostile(fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            async with http.post(gateway.base_url + "/completions", json=completion(**fields)) as response:
                return response.status, json.loads(await response.read())

        results = await asyncio.gather(*(hostile(fields) for fields, _, _ in DEGENERATE))
        async with http.post(gateway.base_url + "/completions", data=b'{"model": "specgate-demo", '
                             b'"prompt": "x", "temperature": NaN}',
                             headers={"Content-Type": "application/json"}) as nan:
            assert nan.status == 400 and "NaN" in (await nan.json())["error"]["message"]
        lines += [line async for line in victim.content]
    for (fields, status, param), (got, payload) in zip(DEGENERATE, results, strict=True):
        assert got == status, (fields, payload)
        if status == 400:
            assert payload["error"]["param"] == param and payload["error"]["type"] == "invalid_request_error"
    events = [line[6:].strip() for line in lines if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    usage = chunks[-1]["usage"]
    finish = next(c["choices"][0]["finish_reason"] for c in reversed(chunks) if c["choices"])
    assert finish == "stop" or usage["completion_tokens"] == 400, (finish, usage)
    logged = gateway.log()[log_start:]
    assert " ERROR " not in logged, logged


def test_tiny_temperature_is_greedy(gateway: Gateway) -> None:
    greedy = post(gateway, "/v1/completions", completion(temperature=0, max_tokens=12))
    tiny = post(gateway, "/v1/completions", completion(temperature=1e-30, max_tokens=12))
    assert greedy[0] == tiny[0] == 200
    assert tiny[1]["choices"][0]["text"] == greedy[1]["choices"][0]["text"]


def test_parameters_at_their_defaults_are_accepted_from_the_sdk(gateway: Gateway) -> None:
    with sdk_client(gateway) as client:
        chat = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, n=1, logprobs=False, top_logprobs=0,
            response_format={"type": "text"}, tool_choice="none", tools=[], parallel_tool_calls=False,
            presence_penalty=0, frequency_penalty=0.0, logit_bias={}, store=False, metadata={"team": "a"},
            service_tier="auto", modalities=["text"], seed=7, stop=["\n\n\n"], user="someone",
            stream_options=None, prompt_cache_key="k", safety_identifier="s",
            extra_body={"top_k": -1, "min_p": 0, "repetition_penalty": 1.0, "ignore_eos": False, "min_tokens": 0})
        assert chat.choices[0].message.content is not None
        text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, n=1, best_of=1,
                                         echo=False, logprobs=None, suffix="", presence_penalty=0, seed=3)
        assert text.choices[0].text is not None
        # An assistant message echoed back as the SDK returned it (empty refusal, tool calls, audio).
        echoed = chat.choices[0].message.model_dump()
        again = client.chat.completions.create(model=MODEL, messages=[*MESSAGES, echoed,  # type: ignore[list-item]
                                                                      {"role": "user", "content": "More."}],
                                               max_tokens=2, temperature=0)
        assert again.choices[0].finish_reason in ("stop", "length")


REFUSED_CHAT: list[tuple[str, Any]] = [
    ("n", 2), ("logprobs", True), ("top_logprobs", 3), ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"), ("tool_choice", "required"),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}), ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "low"), ("verbosity", "low"), ("web_search_options", {}), ("store", True),
    ("service_tier", "flex"), ("logit_bias", {"42": 5}), ("presence_penalty", 0.5), ("frequency_penalty", -1),
    ("min_p", 0.1), ("repetition_penalty", 1.2), ("ignore_eos", 1), ("min_tokens", -1), ("seed", "7"),
    ("stream", 1), ("unknown_knob", 1), ("vllm_xargs", {"a": 1}), ("specgate", {"k": 3}),
]


@pytest.mark.parametrize(("field", "value"), REFUSED_CHAT)
def test_unsupported_chat_parameters_are_refused_by_name(gateway: Gateway, field: str, value: Any) -> None:
    status, payload = post(gateway, "/v1/chat/completions",
                           {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, field: value})
    assert status == 400, payload
    assert payload["error"]["param"] == field
    assert field in payload["error"]["message"]
    assert payload["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("field", "value"), [
    ("echo", True), ("best_of", 2), ("logprobs", 1), ("logprobs", 0), ("suffix", "\n"), ("n", 3),
    ("max_completion_tokens", 3), ("messages", MESSAGES),
])
def test_unsupported_completion_parameters_are_refused_by_name(gateway: Gateway, field: str, value: Any) -> None:
    status, payload = post(gateway, "/v1/completions", completion(**{field: value}))
    assert status == 400, payload
    assert payload["error"]["param"] == field


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "tool", "content": "x", "tool_call_id": "1"}, "messages[0].role"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}, "messages[0].content"),
    ({"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}, "messages[0].tool_calls"),
    ({"role": "user", "content": "x", "extra": 1}, "messages[0].extra"),
    ({"role": "user"}, "messages[0].content"),
])
def test_unsupported_message_shapes_are_refused_by_name(gateway: Gateway, message: dict[str, Any],
                                                        param: str) -> None:
    status, payload = post(gateway, "/v1/chat/completions", {"model": MODEL, "messages": [message]})
    assert status == 400, payload
    assert payload["error"]["param"] == param


# Lone surrogates, escaped in JSON: valid JSON, no text; every field a tokenizer would read.
LONE = b"\\ud800"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", b'{"model": "specgate-demo", "prompt": "a' + LONE + b'b"}', "prompt"),
    ("/v1/completions", b'{"model": "specgate-demo", "prompt": ["ok", "' + LONE + b'"]}', "prompt[1]"),
    ("/v1/completions", b'{"model": "specgate-demo", "prompt": "x", "stop": ["' + LONE + b'"]}', "stop[0]"),
    ("/v1/chat/completions", b'{"model": "specgate-demo", "messages": [{"role": "user", "content": "'
     + LONE + b'"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"model": "specgate-demo", "messages": [{"role": "user", "content": '
     b'[{"type": "text", "text": "' + LONE + b'"}]}]}', "messages[0].content[0].text"),
])
def test_lone_surrogates_are_a_400_naming_the_field(gateway: Gateway, path: str, body: bytes, param: str) -> None:
    status, payload = post(gateway, path, body)
    assert status == 400, payload
    assert payload["error"]["param"] == param and "lone surrogate" in payload["error"]["message"]


def test_sdk_sees_a_refused_parameter_as_bad_request(gateway: Gateway) -> None:
    with sdk_client(gateway) as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                       response_format={"type": "json_object"})
    assert info.value.body["param"] == "response_format"  # type: ignore[index]


def test_the_worker_survived_every_refusal(gateway: Gateway) -> None:
    """Runs last in this module: after everything above, the one worker serves, never restarted."""
    status, payload = post(gateway, "/v1/completions", completion(temperature=0))
    assert status == 200 and payload["usage"]["completion_tokens"] >= 1
    assert all(w["status"] == "ready" and w["restarts"] == 0 for w in gateway.get_json("/admin/workers")["workers"])
