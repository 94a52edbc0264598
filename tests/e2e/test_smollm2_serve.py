"""SmolLM2-135M-Instruct (make install's converted directory) served by a real gateway and worker,
asked by the unmodified openai SDK: a real question gets a real answer.

Plain decoding: the draft distilled for it (models/distill.py) is not trained yet. Two slots:
the engine's KV cache holds the model's whole 8,192-token context per slot (377 MB each).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import Gateway, GatewayFactory, sdk_client

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = REPO / "models" / "smollm2-135m-instruct-q4_1"
MODEL = "smollm2-135m-instruct-q4_1"


@pytest.fixture(scope="module")
def gateway(gateway_factory: GatewayFactory) -> Gateway:
    assert (SMOLLM2 / "model.safetensors").is_file(), f"{SMOLLM2} is missing: run make install"
    return gateway_factory("gw-smollm2", model={"name": MODEL, "target": str(SMOLLM2), "draft": None},
                           workers={"count": 1, "max_slots": 2, "dtype": "float32"}, workers_ready=1)


def test_the_capital_of_france_is_paris(gateway: Gateway) -> None:
    with sdk_client(gateway) as client:
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=24, extra_headers={"X-Session-ID": "france"})
    assert "Paris" in (answer.choices[0].message.content or ""), answer
    assert answer.choices[0].finish_reason == "stop"  # the model ends its turn (<|im_end|>)


def test_a_streamed_chat_and_a_completion_work(gateway: Gateway) -> None:
    with sdk_client(gateway) as client:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name one planet."}], temperature=0, max_tokens=16,
            stream=True, stream_options={"include_usage": True})
        pieces, usage = [], None
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
        assert "".join(pieces).strip() and usage is not None and usage.completion_tokens >= 1
        completion = client.completions.create(model=MODEL, prompt="The capital of Italy is", temperature=0,
                                               max_tokens=8)
    assert completion.choices[0].text.strip() and completion.usage is not None
    assert completion.usage.completion_tokens >= 1
