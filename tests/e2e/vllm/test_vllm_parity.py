"""Cross-engine parity: the embedded engine and vLLM give the same greedy output on the demo
models (the vLLM lane). Both run the target in float32; prompts go in as token ids and as
text, which the model directory makes one encoding everywhere (BOS declared). bfloat16's
divergence from vLLM's float32 is printed, not asserted: rounding flips near-ties.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
import torch

from tests.e2e.harness import MODELS
from tests.e2e.vllm.vllm_harness import VllmServer
from workers.api.generation import SamplingParams
from workers.demo.corpus import heldout_prompts
from workers.engines.embedded.engine import SpeculativeEngine
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.interface import GenerationRequest
from workers.text import TextCodec

pytestmark = pytest.mark.vllm

PROMPTS = heldout_prompts(20, prompt_chars=160, seed=7)
MAX_TOKENS = 32


def vllm_complete(server: VllmServer, prompt: str | list[int]) -> dict[str, Any]:
    body = {"model": "specgate-demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    request = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        payload: dict[str, Any] = json.loads(response.read())
    return payload


def embedded_greedy(dtype: torch.dtype, prompts: list[list[int]]) -> list[list[int]]:
    engine = SpeculativeEngine(LlamaForCausalLM.from_pretrained(MODELS / "demo-target", dtype), None, max_slots=4)
    outputs = []
    for i, ids in enumerate(prompts):
        events = engine.generate(GenerationRequest(f"p{i}", ids, MAX_TOKENS, SamplingParams(temperature=0.0)))
        outputs.append([t for e in events for t in e.tokens])
    return outputs


def test_greedy_parity_with_vllm_float32(vllm_plain_server: VllmServer) -> None:
    codec = TextCodec.from_model_dir(MODELS / "demo-target")
    prompt_ids = [codec.encode(p) for p in PROMPTS]
    ours = embedded_greedy(torch.float32, prompt_ids)
    by_ids = [vllm_complete(vllm_plain_server, ids) for ids in prompt_ids]
    by_text = [vllm_complete(vllm_plain_server, p) for p in PROMPTS]
    id_matches = text_matches = 0
    for mine, vllm_ids, vllm_text in zip(ours, by_ids, by_text, strict=True):
        # vLLM encodes the text prompt exactly as specgate does: same prompt, same token count.
        assert vllm_text["usage"]["prompt_tokens"] == vllm_ids["usage"]["prompt_tokens"]
        id_matches += vllm_ids["choices"][0]["token_ids"] == mine
        text_matches += vllm_text["choices"][0]["text"] == codec.decode(mine)
    # Reported, not asserted: bfloat16 rounding flips near-ties against vLLM's float32.
    bf16 = embedded_greedy(torch.bfloat16, prompt_ids)
    bf16_same = sum(a == b["choices"][0]["token_ids"] for a, b in zip(bf16, by_ids, strict=True))
    print(f"greedy parity with vLLM (float32): token-id prompts {id_matches}/{len(PROMPTS)}, text prompts "
          f"{text_matches}/{len(PROMPTS)}; embedded bfloat16 vs vLLM float32: {bf16_same}/{len(PROMPTS)}")
    assert (id_matches, text_matches) == (len(PROMPTS), len(PROMPTS))
