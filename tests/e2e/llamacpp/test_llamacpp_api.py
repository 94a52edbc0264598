"""A real llama-server behind the gateway, through the official client: streamed and whole answers
alike (text, usage, finish_reason, a stop string across chunks), the same as the server's own;
and two API keys that never share its prompt cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from bench.llama_server import LlamaServer, llamacpp_remote, start_llama_server, start_llamacpp_gateway
from bench.procs import stop
from tests.e2e.tenancy_harness import API_KEYS, two_keys_never_share

pytestmark = pytest.mark.llamacpp

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


@pytest.fixture(scope="module")
def plain_gateway(tmp_path_factory: pytest.TempPathFactory, llama_plain: LlamaServer) -> Iterator[str]:
    process, port = start_llamacpp_gateway(tmp_path_factory.mktemp("llamacpp-api"),
                                           [llamacpp_remote(llama_plain, "plain")])
    yield f"http://127.0.0.1:{port}/v1"
    stop(process)


def complete(base_url: str, stream: bool, max_tokens: int, stop: list[str] | None) -> tuple[str, str | None, Any]:
    """(text, finish_reason, usage) of one chat completion, streamed or not."""
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as client:
        if not stream:
            answer = client.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=0,
                                                    max_tokens=max_tokens, stop=stop)
            return answer.choices[0].message.content or "", answer.choices[0].finish_reason, answer.usage
        text, finish, usage, pieces = "", None, None, 0
        for chunk in client.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=0,
                                                    max_tokens=max_tokens, stop=stop, stream=True,
                                                    stream_options={"include_usage": True}):
            assert "timings" not in (chunk.model_extra or {})
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                pieces += bool(chunk.choices[0].delta.content)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        assert pieces > 1
        return text, finish, usage


@pytest.mark.parametrize(("max_tokens", "stop"), [(48, None), (200, ["n < 2"])])
def test_streamed_and_whole_answers_agree_with_the_server(plain_gateway: str, llama_plain: LlamaServer,
                                                          max_tokens: int, stop: list[str] | None) -> None:
    streamed = complete(plain_gateway, True, max_tokens, stop)
    whole = complete(plain_gateway, False, max_tokens, stop)
    direct = complete(llama_plain.url + "/v1", False, max_tokens, stop)
    assert streamed[0] == whole[0] == direct[0] and streamed[1] == whole[1] == direct[1]
    for usage in (streamed[2], whole[2]):
        assert (usage.prompt_tokens, usage.completion_tokens) == (direct[2].prompt_tokens, direct[2].completion_tokens)
        assert usage.model_extra["speculative"]["mode"] == "plain"
    if stop:  # "n < 2" spans tokens: cut where the server cuts, the stop string left out
        assert streamed[1] == "stop" and "n < 2" not in streamed[0] and streamed[0].endswith("if ")
    else:
        assert streamed[1] == "length" and streamed[2].completion_tokens == 48


@pytest.mark.parametrize("scoped_slots", [4])
def test_two_keys_never_share_a_llama_servers_cache(tmp_path: Path, scoped_slots: int) -> None:
    """The tenant-isolation trial on one llama-server with 4 slots and no host prompt cache
    (--cache-ram 0), each scope in slots of its own: cold for the other key, warm for one's own."""
    server = start_llama_server(tmp_path, slots=4, extra=("--cache-ram", "0"))
    try:
        remote = llamacpp_remote(server, "shared") | {"scoped_slots": scoped_slots}
        process, port = start_llamacpp_gateway(tmp_path, [remote], auth={"api_keys": API_KEYS},
                                               model_name="specgate-demo")
        try:
            two_keys_never_share(f"http://127.0.0.1:{port}/v1", rounds=2, words=120)
        finally:
            stop(process)
    finally:
        server.stop()
