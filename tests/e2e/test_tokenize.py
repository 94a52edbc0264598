"""``POST /tokenize`` and ``/detokenize`` through the gateway, with vLLM's shapes (the same answers
as vLLM's server on the same weights: tests/e2e/vllm/test_vllm_conformance.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.e2e.harness import MODELS, Gateway
from workers.api.wire import ChatMessage
from workers.text import TextCodec

CODEC = TextCodec.from_model_dir(MODELS / "demo-target")


def post(gateway: Gateway, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(gateway.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


def test_a_prompt_tokenizes_as_completions_encode_it(gateway: Gateway) -> None:
    status, out = post(gateway, "/tokenize", {"model": "specgate-demo", "prompt": "import os\n"})
    assert status == 200, out
    assert out["tokens"] == CODEC.encode("import os\n") and out["count"] == len(out["tokens"])
    assert out["token_strs"] is None and out["max_model_len"] > 0
    status, bare = post(gateway, "/tokenize", {"prompt": "import os\n", "add_special_tokens": False,
                                               "return_token_strs": True})
    assert status == 200 and bare["tokens"] == CODEC.encode("import os\n", add_special_tokens=False)
    assert bare["token_strs"] == CODEC.token_strs(bare["tokens"])


def test_a_chat_tokenizes_as_chat_completions_render_it(gateway: Gateway) -> None:
    messages = [{"role": "user", "content": "Write `add`."}]
    status, out = post(gateway, "/tokenize", {"messages": messages})
    assert status == 200, out
    assert out["tokens"] == CODEC.encode_chat([ChatMessage("user", "Write `add`.")])  # what a chat request sends
    status, both = post(gateway, "/tokenize", {"messages": messages, "add_generation_prompt": True,
                                               "continue_final_message": True})
    assert status == 400 and both["error"]["param"] == "continue_final_message"
    status, cont = post(gateway, "/tokenize", {"messages": [*messages, {"role": "assistant", "content": "def add"}],
                                               "add_generation_prompt": False, "continue_final_message": True})
    assert status == 200 and CODEC.decode(cont["tokens"]).endswith("def add")


def test_detokenize_returns_the_text_special_tokens_included(gateway: Gateway) -> None:
    ids = CODEC.encode("import os\n")
    status, out = post(gateway, "/detokenize", {"model": "specgate-demo", "tokens": ids})
    assert status == 200 and out == {"prompt": CODEC.decode(ids, skip_special_tokens=False)}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"model": "gpt-nope", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"model": "gpt-nope", "tokens": [1]}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
    ("/tokenize", {"prompt": "x", "chat_template": "{{ x }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, 400, "chat_template"),
    ("/tokenize", {"prompt": 7}, 400, "prompt"),
])
def test_bad_tokenize_requests_get_openai_errors(gateway: Gateway, path: str, body: dict[str, Any], status: int,
                                                 param: str) -> None:
    code, out = post(gateway, path, body)
    assert code == status, out
    assert out["error"]["param"] == param and out["error"]["message"]
