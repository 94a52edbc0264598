"""The real pair's requests in the vLLM lane, shared by its tests: the 20 held-out chat prompts, and
vLLM's streamed greedy completions with their ids and per-request spec-decode metrics."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from typing import Any

from models.distill_prompts import CLASSES, load_prompts
from tests.e2e.harness import worker_sse_events
from tests.e2e.vllm.vllm_harness import REAL_PAIR, STARTUP_TIMEOUT_S, VllmServer
from workers.api.wire import ChatMessage
from workers.text import TextCodec

MAX_TOKENS = 32
PER_CLASS = 5  # held-out prompts of each class: 20 in all
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
