"""Two real llama-servers behind the gateway, one plain and one n-gram: sessions steered by their
own evidence, and that evidence checked against the server's own counters."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.llama_server import LlamaServer, llamacpp_remote, start_llamacpp_gateway
from bench.peer_fleet import POLICY, Session, run_session, sessions
from bench.procs import get_json, stop

pytestmark = pytest.mark.llamacpp


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, llama_plain: LlamaServer,
          llama_ngram: LlamaServer) -> Iterator[str]:
    """``specgate serve`` in front of the plain server ("plain") and the n-gram one ("ngram")."""
    process, port = start_llamacpp_gateway(
        tmp_path_factory.mktemp("llamacpp-fleet"),
        [llamacpp_remote(llama_plain, "plain"), llamacpp_remote(llama_ngram, "ngram")], POLICY)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, 2)
    yield url
    stop(process)


def wait_ready(url: str, count: int) -> None:
    for _ in range(200):
        if sum(w["status"] == "ready" for w in get_json(url + "/admin/workers")["workers"]) >= count:
            return
        asyncio.run(asyncio.sleep(0.05))
    raise TimeoutError("llama-servers not ready behind the gateway")


def server_counts(server: LlamaServer) -> dict[str, float]:
    """The server's own speculative counters (its --metrics)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    names = {"llamacpp:spec_decode_num_draft_tokens_total": "proposed",
             "llamacpp:spec_decode_num_accepted_tokens_total": "accepted",
             "llamacpp:spec_decode_num_drafts_total": "steps"}
    out = dict.fromkeys(names.values(), 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[names[name]] = float(value)
    return out


async def drive(url: str, session: Session, session_id: str) -> list[tuple[str, str, str, dict[str, Any]]]:
    """The session's requests: (worker, route, mode, usage.speculative) of each."""
    seen: list[tuple[str, str, str, dict[str, Any]]] = []

    def on_answer(status: int, answer: dict[str, Any], headers: dict[str, str]) -> None:
        assert status == 200, answer
        seen.append((headers["X-Specgate-Worker"], headers["X-Specgate-Route"], headers["X-Specgate-Mode"],
                     answer["usage"]["speculative"]))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        await run_session(http, url, session, session_id, on_answer)
    return seen


def edit_session() -> Session:
    """An edit conversation whose first answer copies the code (peer_edits.jsonl's edit-01)."""
    return next(s for s in sessions(quick=False) if s.name == "edit-1")


def chat_session() -> Session:
    return next(s for s in sessions(quick=False) if s.name == "chat-1")


async def test_a_copy_heavy_session_moves_to_the_ngram_server(fleet: str, llama_ngram: LlamaServer) -> None:
    before = server_counts(llama_ngram)
    seen = await drive(fleet, edit_session(), "edits")
    after = server_counts(llama_ngram)
    assert len(seen) == 5, seen
    moved = [route for worker, route, _, _ in seen if worker == "ngram"]
    assert "method" in moved, seen  # it reached the n-gram server by method
    # ...and each request ran where its decision runs: the n-gram method there, plain on the other.
    assert all(mode.startswith("speculative; method=ngram") if worker == "ngram" else mode.startswith("plain")
               for worker, _, mode, _ in seen), seen
    # What the gateway believes of the session, against what the n-gram server counted while it
    # served the session's requests: proposed and accepted drafts, and its verification steps.
    session = get_json(f"{fleet}/admin/sessions/edits")
    ngram = session["speculative"]["by_method"]["ngram"]
    assert (ngram["proposed"], ngram["accepted"]) == (after["proposed"] - before["proposed"],
                                                     after["accepted"] - before["accepted"]), (ngram, before, after)
    assert ngram["proposed"] > 0
    steps = sum(spec["speculative_steps"] or 0 for worker, _, _, spec in seen if worker == "ngram")
    assert steps == after["steps"] - before["steps"]
    assert sum(spec["proposed"] for _, _, _, spec in seen) == ngram["proposed"]


async def test_an_open_chat_session_ends_on_the_plain_server(fleet: str) -> None:
    seen = await drive(fleet, chat_session(), "chat")
    assert len(seen) == 5 and seen[-1][0] == "plain", seen
    assert seen[-1][2].startswith("plain"), seen
    # The n-gram server's step costs, learned from its timings, are what priced it out.
    ngram = next(w for w in get_json(fleet + "/admin/workers")["workers"] if w["worker_id"] == "ngram")
    assert ngram["step_costs"]["plain_steps_timed"] > 0


async def test_the_fleet_view_names_each_servers_method(fleet: str) -> None:
    workers = {w["worker_id"]: w for w in get_json(fleet + "/admin/workers")["workers"]}
    assert workers["plain"]["protocol"] == workers["ngram"]["protocol"] == "llamacpp"
    assert (workers["plain"]["modes"], workers["plain"]["methods"]) == (["plain"], [])
    assert (workers["ngram"]["modes"], workers["ngram"]["methods"]) == (["speculative"], ["ngram"])
    assert workers["ngram"]["engine"] == "llamacpp" and workers["ngram"]["batch_depth"] is not None


def test_a_killed_server_ends_its_stream_with_an_error_and_the_next_request_goes_on(
        tmp_path: Path) -> None:
    """A llama-server killed mid-stream: its protocol carries no token ids, so the stream ends with
    a clear error event (never a hang, never a silent cut), and the session's next request is
    served by the other server."""
    from bench.llama_server import start_llama_server
    servers = [start_llama_server(tmp_path, slots=1) for _ in range(2)]
    try:
        process, port = start_llamacpp_gateway(tmp_path, [llamacpp_remote(s, f"s{i}") for i, s in enumerate(servers)])
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, 2)
            asyncio.run(_killed_mid_stream(url, servers))
        finally:
            stop(process)
    finally:
        for server in servers:
            server.stop()


async def _killed_mid_stream(url: str, servers: list[LlamaServer]) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell me a long story about a ship."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post(url + "/v1/chat/completions", json=body, headers={"X-Session-ID": "killed"}) as response:
            assert response.status == 200
            worker = response.headers["X-Specgate-Worker"]
            victim = servers[int(worker[1:])]
            events: list[bytes] = []
            async for line in response.content:
                if line.startswith(b"data:"):
                    events.append(line[5:].strip())
                    if len(events) == 5:
                        victim.process.kill()
            assert events[-1] == b"[DONE]" or b'"error"' in events[-1] or b'"error"' in events[-2], events[-3:]
        body["stream"] = False
        body["max_tokens"] = 8
        async with http.post(url + "/v1/chat/completions", json=body, headers={"X-Session-ID": "killed"}) as response:
            assert response.status == 200, await response.text()
            assert response.headers["X-Specgate-Worker"] != worker
