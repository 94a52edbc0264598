"""``protocol: llamacpp`` against a stand-in llama-server on loopback (the real one runs in the
llama.cpp lane, tests/e2e/llamacpp/): what the gateway sends it (``timings_per_token``,
``cache_prompt``, ``id_slot``, never ``cache_salt``), and what it reads back (``timings`` as the
session's evidence, clamped when they are garbage; ``llamacpp:`` gauges as load)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.e2e.harness import Gateway, start_gateway, write_config

KEY_A, KEY_B = "sk-llamacpp-a-0123456789", "sk-llamacpp-b-0123456789"


def chunk(content: str | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if content is None and finish is None else [
        {"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "specgate-demo",
            "choices": choices, **extra}


def timings(predicted: int, drafted: int = 0, accepted: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"predicted_n": predicted, "predicted_ms": 10.0 * predicted}
    if drafted:
        out |= {"draft_n": drafted, "draft_n_accepted": accepted}
    return out


# The prompt's token, a plain step, a step that proposed 4 and accepted 2 (3 tokens), a plain step;
# then the finish chunk and the usage chunk, which repeats the totals (as llama-server sends them).
STEPPED = [chunk("a", timings=timings(1)), chunk("b", timings=timings(2)), chunk("c", timings=timings(3, 4, 2)),
           chunk("d", timings=timings(4, 4, 2)), chunk("e", timings=timings(5, 4, 2)),
           chunk("f", timings=timings(6, 4, 2)), chunk(finish="length"),
           chunk(usage={"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}, timings=timings(6, 4, 2))]


@dataclass
class FakeLlamaServer:
    """Answers every chat completion with ``events()`` as SSE; keeps each request body."""

    events: Callable[[], list[Any]]
    metrics: str = "llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n"
    bodies: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for event in self.events():
            data = event if isinstance(event, bytes) else json.dumps(event).encode()
            await out.write(b"data: " + data + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def get_metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics, content_type="text/plain")


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@pytest.fixture
async def fake_server() -> AsyncIterator[Callable[..., Any]]:
    runners: list[web.AppRunner] = []

    async def start(events: Callable[[], list[Any]] = lambda: STEPPED) -> FakeLlamaServer:
        server = FakeLlamaServer(events)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", server.chat)
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", server.get_metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        server.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return server
    yield start
    for runner in runners:
        await runner.cleanup()


async def gateway_for(tmp_path: Path, *remotes: dict[str, Any], **sections: dict[str, Any]) -> Gateway:
    config = write_config(tmp_path / "config.yaml", workers={"count": 0, "remote": list(remotes)},
                          policy={"methods": ["draft", "ngram"]}, **sections)
    gateway = await asyncio.to_thread(start_gateway, config, tmp_path)
    await asyncio.to_thread(gateway.wait_workers_ready, len(remotes))
    return gateway


async def ask(gateway: Gateway, session: str | None = None, stream: bool = True, key: str | None = None,
              salt: str | None = None) -> tuple[int, list[dict[str, Any]] | dict[str, Any], dict[str, str]]:
    body: dict[str, Any] = {"model": "specgate-demo", "messages": [{"role": "user", "content": "copy this"}],
                            "max_tokens": 6, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"X-Session-ID": session} if session else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    async with aiohttp.ClientSession() as http, http.post(
            f"{gateway.url}/v1/chat/completions", json=body, headers=headers) as response:
        if not stream or response.status != 200:
            return response.status, await response.json(), dict(response.headers)
        events = [json.loads(line[5:]) async for line in response.content
                  if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"]
        return response.status, events, dict(response.headers)


NGRAM = {"protocol": "llamacpp", "method": "ngram", "max_k": 16, "name": "ngram"}


async def test_timings_are_the_sessions_evidence_and_never_reach_the_client(
        tmp_path: Path, fake_server: Callable[..., Any]) -> None:
    server = await fake_server()
    gateway = await gateway_for(tmp_path, {"url": server.url, **NGRAM})
    try:
        status, events, headers = await ask(gateway, session="copy")
        assert status == 200 and isinstance(events, list)
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == "abcdef"
        assert all("timings" not in e for e in events)  # llama.cpp's field: restated, not relayed
        assert headers["X-Specgate-Worker"] == "ngram" and "method=ngram" in headers["X-Specgate-Mode"]
        speculative = events[-1]["usage"]["speculative"]
        assert (speculative["proposed"], speculative["accepted"], speculative["speculative_steps"]) == (4, 2, 1)
        sent = server.bodies[0]
        assert sent["timings_per_token"] is True and sent["cache_prompt"] is True
        assert "cache_salt" not in sent and "id_slot" not in sent
        # A non-streaming client's answer is assembled from the same stream.
        status, answer, _ = await ask(gateway, session="copy", stream=False)
        assert status == 200 and isinstance(answer, dict) and "timings" not in answer
        assert answer["choices"][0]["message"]["content"] == "abcdef"
        session = await asyncio.to_thread(gateway.get_json, "/admin/sessions/copy")
        ngram = session["speculative"]["by_method"]["ngram"]
        assert (ngram["proposed"], ngram["accepted"]) == (8, 4)  # the two responses' timings, summed
        lookup = session["methods"]["ngram"]
        # Each response: the prompt's token, then 2 plain steps and a drafting one (6 tokens: 1 + 1 +
        # 3 + 1), whose 4 drafts tested 3 (2 accepted, then the rejection): coverage 1 in 3.
        assert (lookup["steps"], lookup["drafts_tested"]) == (2 * 3, 2 * 3)
        assert lookup["coverage"] == pytest.approx(1 / 3, abs=0.01)
    finally:
        await asyncio.to_thread(gateway.stop)


@pytest.mark.parametrize("garbage", [
    {"predicted_n": "six"}, {"predicted_n": 6, "draft_n": -4, "draft_n_accepted": 0}, "timings", [1, 2],
    {"predicted_n": 6, "draft_n": 2, "draft_n_accepted": 9},
])
async def test_garbage_timings_still_complete_and_are_clamped(tmp_path: Path, fake_server: Callable[..., Any],
                                                              garbage: Any) -> None:
    events = [chunk("a"), chunk("b"), chunk(finish="stop"),
              chunk(usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}, timings=garbage)]
    server = await fake_server(lambda: events)
    gateway = await gateway_for(tmp_path, {"url": server.url, **NGRAM})
    try:
        for stream in (True, False):
            status, answer, _ = await ask(gateway, session="garbage", stream=stream)
            assert status == 200, answer
        session = await asyncio.to_thread(gateway.get_json, "/admin/sessions/garbage")
        ngram = session["speculative"]["by_method"].get("ngram", {"proposed": 0, "accepted": 0})
        assert 0 <= ngram["accepted"] <= ngram["proposed"] <= 4
        assert sum(gateway.metric("specgate_step_reports_clamped_total", reason=reason)
                   for reason in ("unreadable_timings", "negative", "accepted_over_proposed")) == 2
        assert "Traceback" not in gateway.log()
    finally:
        await asyncio.to_thread(gateway.stop)


async def test_a_stream_that_is_not_json_is_a_502(tmp_path: Path, fake_server: Callable[..., Any]) -> None:
    server = await fake_server(lambda: [b"<html>bad gateway</html>"])
    gateway = await gateway_for(tmp_path, {"url": server.url, **NGRAM})
    try:
        status, answer, _ = await ask(gateway, stream=False)
        assert status == 502 and isinstance(answer, dict) and answer["error"]["type"] == "server_error"
    finally:
        await asyncio.to_thread(gateway.stop)


async def test_load_comes_from_the_llamacpp_gauges(tmp_path: Path, fake_server: Callable[..., Any]) -> None:
    server = await fake_server()
    server.metrics = "llamacpp:requests_processing 3\nllamacpp:requests_deferred 2\n"
    gateway = await gateway_for(tmp_path, {"url": server.url, "protocol": "llamacpp", "name": "plain"})
    try:
        for _ in range(50):
            (worker,) = (await asyncio.to_thread(gateway.get_json, "/admin/workers"))["workers"]
            if worker["batch_depth"] == 3:
                break
            await asyncio.sleep(0.1)
        assert (worker["engine"], worker["batch_depth"], worker["queue_length"]) == ("llamacpp", 3, 2)
        assert worker["modes"] == ["plain"] and worker["methods"] == []
    finally:
        await asyncio.to_thread(gateway.stop)


@pytest.mark.parametrize("scoped_slots", [0, 2])
async def test_another_scopes_request_never_reuses_a_prompt(tmp_path: Path, fake_server: Callable[..., Any],
                                                            scoped_slots: int) -> None:
    """Two API keys on one server: the second scope never reuses anything; with scoped slots,
    each scope finds its own slot again."""
    server = await fake_server()
    remote = {"url": server.url, "protocol": "llamacpp", "name": "plain", "scoped_slots": scoped_slots}
    gateway = await gateway_for(tmp_path, remote, auth={"api_keys": [KEY_A, KEY_B]})
    try:
        for key in (KEY_A, KEY_A, KEY_B, KEY_B, KEY_A):
            status, _, _ = await ask(gateway, key=key)
            assert status == 200
        sent = [(body["cache_prompt"], body.get("id_slot")) for body in server.bodies]
        assert all("cache_salt" not in body for body in server.bodies)
        if scoped_slots == 0:
            assert sent == [(True, None), (True, None), (False, None), (False, None), (False, None)]
        else:
            b_slot = sent[2][1]
            assert sent[:2] == [(True, None), (True, None)] and sent[2] == (False, b_slot) and b_slot is not None
            assert sent[3] == (True, b_slot)  # B's own slot again
            assert sent[4][0] is True and sent[4][1] not in (None, b_slot)  # A's: the other slot, which ran A
    finally:
        await asyncio.to_thread(gateway.stop)
