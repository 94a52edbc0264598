"""Tenant isolation and min_tokens with stop against vLLM itself (the vLLM lane, issue 52).

- A vLLM server with prefix caching and ``--enable-prompt-tokens-details`` honours
  ``cache_salt`` (checked on it directly: one salt hits, another misses). Behind the gateway as
  a ``protocol: vllm`` remote, the gateway sends it each request's scope digest as the salt: two
  keys share no ``cached_tokens``, one key still hits, a named tenant's keys share, one key's two
  salts do not (the same trial as tests/e2e/test_tenancy.py).
- ``min_tokens`` with ``stop``: vLLM's own server and specgate's text stream, on the same greedy
  token ids (``ignore_eos``: min_tokens' EOS masking changes no token), end the text at the same
  place for every ``min_tokens``, one token a push and several.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.harness import MODELS, Gateway, start_gateway, write_config
from tests.e2e.tenancy_harness import API_KEYS, secret_system, two_keys_never_share
from tests.e2e.vllm.vllm_harness import VllmServer, start_vllm_server
from workers.text import TextCodec, TextStream

pytestmark = pytest.mark.vllm
WORDS = 90  # about 250 tokens: the vLLM lane's servers hold 512 (vllm_harness.MAX_MODEL_LEN)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        payload: dict[str, Any] = json.loads(response.read())
    return payload


@pytest.fixture(scope="module")
def caching_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    server = start_vllm_server(tmp_path_factory.mktemp("vllm-caching"), speculative=False, plugin=False,
                               extra=("--enable-prefix-caching", "--enable-prompt-tokens-details"))
    yield server
    server.stop()


def cached(server_url: str, system: str, salt: str | None) -> int:
    body: dict[str, Any] = {"model": "specgate-demo", "max_tokens": 2, "temperature": 0,
                            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi."}]}
    if salt is not None:
        body["cache_salt"] = salt
    usage = post(server_url + "/v1/chat/completions", body)["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_vllm_itself_honours_cache_salt(caching_server: VllmServer) -> None:
    system = secret_system(4242, WORDS)
    assert cached(caching_server.url, system, "one") == 0
    assert cached(caching_server.url, system, "one") > 0
    assert cached(caching_server.url, system, "two") == 0


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, caching_server: VllmServer) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("vllm-tenancy")
    remote = {"url": caching_server.url, "protocol": "vllm", "max_k": 0, "name": "vllm-caching"}
    config = write_config(tmp / "config.yaml", auth={"api_keys": API_KEYS},
                          workers={"count": 0, "remote": [remote], "poll_interval_s": 0.2})
    gateway = start_gateway(config, tmp)
    gateway.wait_workers_ready(1)
    yield gateway
    gateway.stop()


def test_two_keys_share_no_cached_tokens_on_vllm(gateway: Gateway) -> None:
    two_keys_never_share(gateway.base_url, words=WORDS)


COUNT_PROMPT = "import os\n\n\ndef list_python_files(root):\n    "


@pytest.mark.parametrize("push", [1, 3])
def test_min_tokens_with_stop_ends_where_vllm_ends_it(caching_server: VllmServer, push: int) -> None:
    codec = TextCodec.from_model_dir(MODELS / "demo-target")
    free = post(caching_server.url + "/v1/completions", {"model": "specgate-demo", "prompt": COUNT_PROMPT,
                                                         "max_tokens": 40, "temperature": 0, "return_token_ids": True,
                                                         "ignore_eos": True})
    ids: list[int] = free["choices"][0]["token_ids"]
    text = free["choices"][0]["text"]
    stops = [c for c in ("(", ")", ":", "\n", " ", "_") if text.count(c) >= 2][:2]
    assert stops, text
    compared = 0
    for stop in stops:
        for min_tokens in range(0, 16):
            vllm = post(caching_server.url + "/v1/completions", {
                "model": "specgate-demo", "prompt": COUNT_PROMPT, "max_tokens": 40, "temperature": 0,
                "stop": [stop], "min_tokens": min_tokens, "ignore_eos": True})["choices"][0]
            stream = TextStream(codec, (stop,), min_tokens=min_tokens)
            ours = ""
            for start in range(0, len(ids), push):
                ours += stream.push(ids[start:start + push])
                if stream.stopped:
                    break
            if not stream.stopped:
                ours += stream.flush()
            assert (ours, "stop" if stream.stopped else "length") == (vllm["text"], vllm["finish_reason"]), (
                stop, min_tokens, push)
            compared += 1
    assert compared >= 16
