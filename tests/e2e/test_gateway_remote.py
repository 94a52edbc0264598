"""Workers the gateway does not start: a specgate worker over TCP, and a plain OpenAI server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.e2e.harness import sdk_client, start_gateway, start_tcp_worker, target_prepacked_expected, write_config

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


def _fixed_k_worker(tmp_path_factory: pytest.TempPathFactory, default_k: int) -> Iterator[int]:
    """A TCP worker that, without a gateway directive, always decodes with K = ``default_k``:
    like a fixed-mode server (0: plain)."""
    process, port = start_tcp_worker(tmp_path_factory.mktemp(f"tcp-worker-k{default_k}"), "--default-k",
                                     str(default_k))
    yield port
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def tcp_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    yield from _fixed_k_worker(tmp_path_factory, 0)


def test_worker_describes_its_precision(tcp_worker: int) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{tcp_worker}/specgate/worker", timeout=10) as response:
        described = json.load(response)
    # workers.dtype auto: the target dtype the start-up measurement chose, prepacked where the CPU
    # can (AVX512-BF16 or AMX); the cost model says why.
    cost = described["cost_model"]
    target = cost["precision"]["target"]
    assert described["precision"]["target"] == target and described["precision"]["draft"] == "float32"
    assert described["precision"]["target_prepacked"] == target_prepacked_expected(target)
    assert described["precision"]["why"] == cost["precision"]["why"]
    assert cost["max_k"] == 8 and cost["depths"][0] == 1 and cost["depths"][-1] == 16
    assert all(row[0] == 1.0 for row in cost["step_cost"])
    assert described["modes"] == ["speculative", "plain"] and described["max_k"] == 8


@pytest.mark.parametrize(("protocol", "expected_mode", "proposes"), [
    ("specgate", "speculative; k=6; reason=default", True),
    ("openai", "plain; reason=worker_plain_only", False),
])
def test_remote_worker(tmp_path: Path, tcp_worker: int, protocol: str, expected_mode: str, proposes: bool) -> None:
    remote = {"url": f"http://127.0.0.1:{tcp_worker}", "protocol": protocol, "name": f"remote-{protocol}",
              "mode": "plain"}
    config = write_config(tmp_path / "config.yaml", workers={"count": 0, "remote": [remote]})
    gw = start_gateway(config, tmp_path)
    try:
        with sdk_client(gw) as client:
            raw = client.completions.with_raw_response.create(model="specgate-demo", prompt=PROMPT, max_tokens=16,
                                                              temperature=0)
        assert raw.headers["X-Specgate-Mode"] == expected_mode
        assert raw.headers["X-Specgate-Worker"] == f"remote-{protocol}"
        usage = raw.parse().usage
        assert usage is not None and usage.completion_tokens >= 1
        assert ((usage.model_extra or {})["speculative"]["proposed"] > 0) == proposes
        (worker,) = gw.get_json("/admin/workers")["workers"]
        assert worker["remote"] is True and worker["status"] == "ready"
        assert worker["modes"] == (["plain", "speculative"] if protocol == "specgate" else ["plain"])
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def speculative_tcp_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    yield from _fixed_k_worker(tmp_path_factory, 3)


def test_mode_aware_routing_over_fixed_mode_workers(tmp_path: Path, tcp_worker: int,
                                                    speculative_tcp_worker: int) -> None:
    """Each decision goes to a worker that serves its mode, and the header says what ran."""
    remotes = [{"url": f"http://127.0.0.1:{tcp_worker}", "protocol": "openai", "mode": "plain", "name": "plain-a"},
               {"url": f"http://127.0.0.1:{speculative_tcp_worker}", "protocol": "openai", "mode": "speculative",
                "max_k": 3, "name": "spec-b"}]
    config = write_config(tmp_path / "config.yaml", workers={"count": 0, "remote": remotes})
    gw = start_gateway(config, tmp_path)
    try:
        gw.wait_workers_ready(2)
        with sdk_client(gw) as client:
            for temperature, worker, mode, proposes in [(0.0, "spec-b", "speculative; k=3; reason=default", True),
                                                         (1.0, "plain-a", "plain; reason=high_temperature", False),
                                                         (0.0, "spec-b", "speculative; k=3; reason=default", True)]:
                raw = client.completions.with_raw_response.create(
                    model="specgate-demo", prompt=PROMPT, max_tokens=12, temperature=temperature,
                    extra_headers={"X-Session-ID": "one-session"})
                assert (raw.headers["X-Specgate-Worker"], raw.headers["X-Specgate-Mode"]) == (worker, mode)
                usage = raw.parse().usage
                assert usage is not None
                assert ((usage.model_extra or {})["speculative"]["proposed"] > 0) == proposes
    finally:
        gw.stop()


def test_worker_ignores_fields_other_routers_add(tcp_worker: int) -> None:
    """A worker is a vLLM-compatible backend: like vLLM it drops fields it does not know (vllm-router
    adds ``no_stop_trim``), while the gateway, the public API, refuses them as OpenAI does."""
    body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "no_stop_trim": True}
    request = urllib.request.Request(f"http://127.0.0.1:{tcp_worker}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.load(response)
    assert answer["usage"]["completion_tokens"] == 4


def test_eos_is_counted_as_vllm_counts_it(tcp_worker: int) -> None:
    """An answer that ends at EOS: ``completion_tokens`` includes the EOS token, as vLLM's usage
    does (tests/e2e/vllm/test_vllm_conformance.py compares the two), though no text or token id carries it."""
    body = {"model": "specgate-demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 200,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"http://127.0.0.1:{tcp_worker}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        lines = response.read().decode().splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    # The token ids ride in an SSE comment line of each chunk's event, never in the chunk.
    assert not any("token_ids" in c.get("specgate", {}) for c in chunks)
    sent = sum(len(json.loads(line[len(": ids "):]).get("token_ids", []))
               for line in lines if line.startswith(": ids "))
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    assert finish == ["stop"] and usage["completion_tokens"] < 200
    assert usage["completion_tokens"] == sent + 1


async def _serve_garbage(events: list[bytes]) -> tuple[web.AppRunner, str]:
    """An OpenAI server whose completion stream is ``events``: a worker gone wrong."""
    async def completions(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for event in events:
            await out.write(event)
        await out.write_eof()
        return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


GOOD_CHUNK = (b'data: {"id":"c1","object":"text_completion","created":1,"model":"specgate-demo",'
              b'"choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\n')


@pytest.mark.parametrize("bad", [b"data: {not json\n\n", b"data: [1, 2]\n\n", b"data: 7\n\n",
                                 b'data: {"error": "down"}\n\n'])
async def test_a_malformed_worker_event_is_a_502_not_a_500(tmp_path: Path, bad: bytes) -> None:
    """Data that is not a JSON object (or an error that is a bare string) from an upstream fails
    the request with an OpenAI error, 502, non-streaming and streaming alike; never a 500."""
    runner, url = await _serve_garbage([GOOD_CHUNK, bad, b"data: [DONE]\n\n"])
    try:
        config = write_config(tmp_path / "config.yaml", workers={
            "count": 0, "remote": [{"url": url, "protocol": "openai", "name": "garbage", "mode": "plain"}]})
        gateway = await asyncio.to_thread(start_gateway, config, tmp_path)
        try:
            await asyncio.to_thread(gateway.wait_workers_ready, 1)
            body = {"model": "specgate-demo", "prompt": "x", "max_tokens": 4}
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{gateway.url}/v1/completions", json=body) as response:
                    assert response.status == 502, await response.text()
                    error = (await response.json())["error"]
                    assert error["type"] == "server_error" and error["message"]
                async with http.post(f"{gateway.url}/v1/completions", json={**body, "stream": True}) as response:
                    assert response.status == 200  # the stream began with the good chunk
                    events = [line[5:].strip() async for line in response.content if line.startswith(b"data:")]
                    assert json.loads(events[0])["choices"][0]["text"] == "hi"
                    assert "error" in json.loads(events[-1])
            assert "Traceback" not in gateway.log_path.read_text()
        finally:
            await asyncio.to_thread(gateway.stop)
    finally:
        await runner.cleanup()


async def test_impossible_draft_counts_are_clamped_and_counted_not_folded(tmp_path: Path) -> None:
    """A vLLM server (protocol: vllm) whose per-request spec-decode metrics claim more drafts accepted
    than proposed, and negative ones: the request is served, the session's estimate stays a
    share, and specgate_step_reports_clamped_total counts each."""
    usage = {"id": "c1", "object": "text_completion", "created": 1, "model": "specgate-demo", "choices": [],
             "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
             "metrics": {"speculative_decoding": {"per_step_drafted": [4, 4, 4],
                                                  "per_step_accepted": [9, -2, 3]}}}
    runner, url = await _serve_garbage([GOOD_CHUNK, b"data: " + json.dumps(usage).encode() + b"\n\n",
                                        b"data: [DONE]\n\n"])
    try:
        config = write_config(tmp_path / "config.yaml", workers={"count": 0, "remote": [
            {"url": url, "protocol": "vllm", "name": "liar", "mode": "speculative", "max_k": 4}]})
        gateway = await asyncio.to_thread(start_gateway, config, tmp_path)
        try:
            await asyncio.to_thread(gateway.wait_workers_ready, 1)
            body = {"model": "specgate-demo", "prompt": "x", "max_tokens": 4}
            async with aiohttp.ClientSession() as http, http.post(
                    f"{gateway.url}/v1/completions", json=body, headers={"X-Session-ID": "liar"}) as response:
                assert response.status == 200, await response.text()
                speculative = (await response.json())["usage"]["speculative"]
            # The clamped steps: (4, 4) and (4, 0), with the honest (4, 3): 7 of 4 + 1 + 4 tested.
            assert (speculative["proposed"], speculative["accepted"], speculative["tested"]) == (12, 7, 9)
            session = await asyncio.to_thread(gateway.get_json, "/admin/sessions/liar")
            assert session["acceptance"]["drafts_tested"] == 9 and session["acceptance"]["drafts_accepted"] == 7
            assert 0.0 <= session["acceptance_estimate"] <= 1.0
            assert gateway.metric("specgate_step_reports_clamped_total", reason="accepted_over_proposed") == 1
            assert gateway.metric("specgate_step_reports_clamped_total", reason="negative") == 1
        finally:
            await asyncio.to_thread(gateway.stop)
    finally:
        await runner.cleanup()
