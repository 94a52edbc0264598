"""specgate's vLLM scheduler plugin on real vLLM (the vLLM lane, ``make test-vllm``).

- The plugin in a real vLLM OpenAI server on the demo pair: per-request K mixed in one
  batch, greedy parity against a server without speculation, drafted counts per step equal
  to min(K, engine K), and the batch latch tripping and clearing.
- The async-scheduling variant, which cannot run on this CPU: its override runs inside vLLM's
  real ``AsyncScheduler`` with fake requests, and the lists it hands out are new objects.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from tests.e2e.vllm.vllm_harness import ENGINE_K, VllmServer

pytestmark = pytest.mark.vllm

PROMPTS = ["def fibonacci(n):\n    ", "import os\n\n\ndef list_files(root):\n    ",
           "class Stack:\n    def __init__(self):\n        ", "def parse_args(argv):\n    parser = ",
           "    for i in range(len(items)):\n        ", "def read_config(path):\n    with open(path) as f:\n        "]
# spec_k as a request sends it: absent, negative (the engine's K), plain, and deeper than the engine.
KS: list[int | None] = [None, -1, 0, 1, 2, 3, 5]


async def complete(session: aiohttp.ClientSession, server: VllmServer, prompt: str, max_tokens: int,
                   xargs: dict[str, Any] | None) -> dict[str, Any]:
    """One streamed completion; returns text, finish reason and the per-request spec metrics."""
    body: dict[str, Any] = {"model": "specgate-demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    text, finish, spec = "", None, None
    async with session.post(server.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
            if chunk.get("metrics"):
                spec = chunk["metrics"].get("speculative_decoding")
    return {"text": text, "finish": finish, "spec": spec}


def k_args(k: int | None) -> dict[str, Any] | None:
    return None if k is None else {"spec_k": k}


def test_per_request_k_mixed_in_one_batch(vllm_plugin_server: VllmServer, vllm_plain_server: VllmServer) -> None:
    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with aiohttp.ClientSession() as session:
            mixed = await asyncio.gather(*(complete(session, vllm_plugin_server, p, 40, k_args(k))
                                           for p in PROMPTS for k in KS))
            reference = await asyncio.gather(*(complete(session, vllm_plain_server, p, 40, None) for p in PROMPTS))
        return list(mixed), list(reference)

    mixed, reference = asyncio.run(run())
    for i, prompt in enumerate(PROMPTS):
        for j, k in enumerate(KS):
            result = mixed[i * len(KS) + j]
            # Greedy parity with an engine that never speculates, whatever the K.
            assert result["text"] == reference[i]["text"], (prompt, k)
            spec = result["spec"]
            expected = ENGINE_K if k is None or k < 0 else min(k, ENGINE_K)
            if expected == 0:
                assert spec is None or spec["num_spec_steps"] == 0, (prompt, k, spec)
                continue
            assert spec is not None and spec["num_spec_steps"] > 0, (prompt, k)
            # Every speculative step drafted exactly min(K, engine K).
            assert set(spec["per_step_drafted"]) == {expected}, (prompt, k, spec["per_step_drafted"])
            assert spec["num_draft_tokens"] == expected * spec["num_spec_steps"]


def test_batch_latch_trips_and_clears(vllm_plugin_server: VllmServer) -> None:
    """Deeper than spec_max_batch: every request runs plain; once the batch drains below
    spec_batch_resume, speculation resumes."""
    latch = {"spec_k": ENGINE_K, "spec_max_batch": 2, "spec_batch_resume": 2}

    async def run() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            crowd = await asyncio.gather(*(complete(session, vllm_plugin_server, p, 24, latch) for p in PROMPTS))
            alone = await complete(session, vllm_plugin_server, PROMPTS[0], 24, latch)
        return list(crowd), alone

    crowd, alone = asyncio.run(run())
    # Six requests in a batch limited to 2: they start plain, and speculate only once the batch
    # has drained below 2 (the hysteresis keeps them plain at exactly 2).
    tokens = 24
    crowd_steps = [(r["spec"] or {}).get("num_spec_steps", 0) for r in crowd]
    assert sum(crowd_steps) < len(crowd) * tokens / (ENGINE_K + 1), crowd_steps
    assert min(crowd_steps) == 0, crowd_steps
    assert alone["spec"] is not None and alone["spec"]["num_spec_steps"] > 0
    assert set(alone["spec"]["per_step_drafted"]) == {ENGINE_K}


# -- the async-scheduling variant, with fake requests -----------------------------------------------
class _FakeRequest(SimpleNamespace):
    """The attributes of ``vllm.v1.request.Request`` the scheduler's bookkeeping touches."""

    __hash__ = object.__hash__  # type: ignore[assignment]  # vLLM keeps requests in sets


def _fake_request(rid: str, k: int | None, placeholders: list[int]) -> _FakeRequest:
    extra = {} if k is None else {"spec_k": k}
    return _FakeRequest(
        request_id=rid, sampling_params=SimpleNamespace(extra_args=extra), num_computed_tokens=10,
        num_in_flight_tokens=0, num_tokens=10, num_output_placeholders=0, use_structured_output=False,
        is_prefill_chunk=False, spec_token_ids=placeholders, last_sched_seq=0, next_decode_eligible_step=0)


def _scheduler_classes() -> tuple[Any, Any]:
    """(vLLM's AsyncScheduler, the plugin's variant); vLLM's import warns about torch internals."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from specgate_vllm.scheduler import SpecgateAsyncScheduler
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    return AsyncScheduler, SpecgateAsyncScheduler


def test_async_variant_hands_out_new_shorter_lists() -> None:
    from specgate_vllm.rules import BatchLatch

    AsyncScheduler, SpecgateAsyncScheduler = _scheduler_classes()

    assert issubclass(SpecgateAsyncScheduler, AsyncScheduler)
    scheduler = object.__new__(SpecgateAsyncScheduler)  # vLLM's own code runs on these attributes
    shared = [-1] * ENGINE_K
    requests = {f"r{k}": _fake_request(f"r{k}", k, shared) for k in (0, 1, 2, 3, 5)}
    requests["r-default"] = _fake_request("r-default", None, shared)
    attributes: dict[str, Any] = {
        "num_spec_tokens": ENGINE_K, "requests": requests, "running": list(requests.values()),
        "parallel_config": SimpleNamespace(data_parallel_size=1), "specgate_latch": BatchLatch(),
        "_specgate_sets_step_depth": True, "_spec_token_placeholders": shared, "num_sampled_tokens_per_step": 1,
        "use_v2_model_runner": False, "defer_block_free": False, "sched_step_seq": 0, "finished_req_ids": set(),
        "reset_preempted_req_ids": set(), "_inflight_prefills": set(), "current_step": 0, "decode_stagger": 1,
    }
    for name, value in attributes.items():
        setattr(scheduler, name, value)
    output = SimpleNamespace(num_scheduled_tokens={rid: 1 for rid in requests}, scheduled_spec_decode_tokens={},
                             num_spec_tokens_to_schedule=ENGINE_K, has_structured_output_requests=False,
                             pending_structured_output_tokens=False)
    scheduler._update_after_schedule(output)

    assert output.num_spec_tokens_to_schedule == ENGINE_K  # the deepest K of the step
    parent_list = scheduler._spec_token_placeholders
    assert shared == [-1] * ENGINE_K  # the shared list is untouched
    for rid, request in requests.items():
        k = ENGINE_K if rid == "r-default" else min(int(rid[1:]), ENGINE_K)
        assert request.spec_token_ids == [-1] * k, rid
        if k < ENGINE_K:
            assert request.spec_token_ids is not parent_list and request.spec_token_ids is not shared, rid


def test_async_variant_all_plain_step_skips_drafting() -> None:
    from specgate_vllm.rules import BatchLatch

    _, SpecgateAsyncScheduler = _scheduler_classes()

    scheduler = object.__new__(SpecgateAsyncScheduler)
    shared = [-1] * ENGINE_K
    requests = {"a": _fake_request("a", 2, shared), "b": _fake_request("b", 1, shared)}
    for name, value in {"num_spec_tokens": ENGINE_K, "requests": requests, "running": list(requests.values()),
                        "parallel_config": SimpleNamespace(data_parallel_size=1),
                        "specgate_latch": BatchLatch(max_batch=1, batch_resume=1),
                        "_specgate_sets_step_depth": True, "_spec_token_placeholders": shared,
                        "num_sampled_tokens_per_step": 1, "use_v2_model_runner": False, "defer_block_free": False,
                        "sched_step_seq": 0, "finished_req_ids": set(), "reset_preempted_req_ids": set(),
                        "_inflight_prefills": set(), "current_step": 0, "decode_stagger": 1}.items():
        setattr(scheduler, name, value)
    output = SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1}, scheduled_spec_decode_tokens={},
                             num_spec_tokens_to_schedule=ENGINE_K, has_structured_output_requests=False,
                             pending_structured_output_tokens=False)
    scheduler._update_after_schedule(output)
    # Two running over max_batch 1: the latch trips, every request is plain, nothing is drafted.
    assert scheduler.specgate_latch.latched
    assert output.num_spec_tokens_to_schedule == 0
    assert all(r.spec_token_ids == [] for r in requests.values())
