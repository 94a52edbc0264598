"""The committed EAGLE-3 head on the real target (issue #54): it loads in speculators (its config
class validates the file), drafts in the embedded engine with greedy output bit-identical to plain
for K = 1..8, and, behind a real gateway, a session chooses it per request, its drafts counted under
``eagle3`` in ``/admin/sessions`` as the responses' usage counted them.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import Gateway, GatewayFactory, sdk_client
from tests.e2e.real_prompts import held_out
from workers.engines.embedded.eagle3.head import Eagle3Head
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.quantized import load_target
from workers.engines.embedded.sampling import SamplingParams

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "smollm2-135m-instruct-q4_1"
HEAD = REPO / "models" / "smollm2-eagle3"
MODEL = "smollm2-135m-instruct"
GREEDY = SamplingParams(temperature=0.0)


def test_the_committed_head_is_speculators_eagle3_format() -> None:
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(str(HEAD))
    raw = json.loads((HEAD / "config.json").read_text())
    assert config.speculators_model_type == "eagle3" and raw["transformer_layer_config"]["model_type"] == "llama"
    assert raw["norm_before_residual"] is True and raw["draft_vocab_size"] == 8192
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] >= 1
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "models/smollm2-135m-instruct-q4_1"
    assert (HEAD / "model.safetensors").stat().st_size <= 20_000_000


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    """The target as make serve's workers serve it on these CPUs: from the GGUF's blocks, the
    float32 conversion's logits bit for bit (tests/e2e/test_smollm2_blocks.py), in about half
    the time a step; the head reads its hidden states as it would the float32 model's."""
    assert (TARGET / "model.safetensors").is_file(), f"{TARGET} is missing: run make install"
    return load_target(TARGET, "q4_1")


def test_greedy_output_with_the_head_is_plain_for_every_k(target: LlamaForCausalLM) -> None:
    head = Eagle3Head.load(HEAD, target.cfg, target.embed_rows, 2, 1024)
    plain = SpeculativeEngine(target, None, max_slots=2, max_k=8, max_positions=1024)
    engine = SpeculativeEngine(target, None, max_slots=2, max_k=8, max_positions=1024, eagle=head)
    prompts = held_out(1)
    references = [[t for e in plain.generate(GenerationRequest(f"p{i}", p, 48, GREEDY)) for t in e.tokens]
                  for i, p in enumerate(prompts)]
    accepted = 0
    for k in range(1, 9):
        for i, prompt in enumerate(prompts):
            events = engine.generate(GenerationRequest(f"k{k}-{i}", prompt, 48, GREEDY, k=k, method="eagle3"))
            assert [t for e in events for t in e.tokens] == references[i], (k, i)
            accepted += sum(e.accepted for e in events)
    assert accepted > 0  # the trained head's drafts pass


@pytest.fixture(scope="module")
def gateway(gateway_factory: GatewayFactory) -> Gateway:
    model = {"name": MODEL, "target": str(TARGET), "draft": str(REPO / "models" / "smollm2-draft"), "eagle3": str(HEAD)}
    workers = {"count": 1, "threads": 1, "max_slots": 2, "max_model_len": 1024, "dtype": "float32"}
    policy = {"num_speculative_tokens": "auto", "methods": ["draft", "eagle3"]}
    return gateway_factory("gw-eagle3", model=model, workers=workers, policy=policy, workers_ready=1)


def session(gateway: Gateway, session_id: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{gateway.url}/admin/sessions/{session_id}", timeout=30) as answer:
        found: dict[str, Any] = json.loads(answer.read())
        return found


def test_a_session_chooses_the_head_and_the_gateway_counts_its_drafts(gateway: Gateway) -> None:
    asks = ["Write a Python function that reverses a string.", "Now make it reverse the words instead.",
            "Add a docstring and type hints.", "Write a test for it with pytest.", "Return it as JSON: {\"code\": ...}"]
    modes, proposed, accepted = [], 0, 0
    with sdk_client(gateway) as client:
        for ask in asks:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": ask}], temperature=0, max_tokens=48,
                extra_headers={"X-Session-ID": "eagle3-code"})
            answer = raw.parse()
            modes.append(raw.headers.get("X-Specgate-Mode", ""))
            spec = (answer.usage.model_extra or {}).get("speculative") if answer.usage else None
            if spec is not None and "method=eagle3" in modes[-1]:
                proposed, accepted = proposed + int(spec["proposed"]), accepted + int(spec["accepted"])
    assert any("method=eagle3" in m for m in modes), modes  # explored at once, then kept where it pays
    view = session(gateway, "eagle3-code")
    head = view["methods"]["eagle3"]
    assert (head["drafts_proposed"], head["drafts_accepted"]) == (proposed, accepted), (head, modes)
    assert proposed > 0 and accepted > 0
