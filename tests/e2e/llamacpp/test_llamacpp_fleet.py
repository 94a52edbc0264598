"""Two real llama-servers behind the gateway, one plain and one n-gram: sessions steered by their
own evidence, and that evidence checked against the server's own counters."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.llama_server import LlamaServer, llamacpp_remote, start_llamacpp_gateway
from bench.peer_fleet import EDIT_PROMPTS, POLICY, Session, run_session, sessions
from bench.procs import get_json, stop

pytestmark = pytest.mark.llamacpp

# bench.peer --fleet's policy, with the evidence taken at its word (no shrinking towards the
# prior): a copy whose 48 drafts pass whole is priced at what it measures, not at a shrunk α
# whose expected run of 48 is a fraction of it (docs/llamacpp.md).
FLEET_POLICY = POLICY | {"acceptance_prior_drafts": 0.0}


@pytest.fixture
def fleet(tmp_path_factory: pytest.TempPathFactory, llama_plain: LlamaServer,
          llama_ngram: LlamaServer) -> Iterator[str]:
    """``specgate serve`` in front of the plain server ("plain") and the n-gram one ("ngram"): a
    gateway of its own for each test, so each starts with no evidence."""
    process, port = start_llamacpp_gateway(
        tmp_path_factory.mktemp("llamacpp-fleet"),
        [llamacpp_remote(llama_plain, "plain"), llamacpp_remote(llama_ngram, "ngram")], FLEET_POLICY)
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


def chat_session() -> Session:
    return next(s for s in sessions(quick=False) if s.name == "chat-1")


# A request the model answers by copying its prompt (peer_edits.jsonl's edit-01, asked plainly):
# llama-server's n-gram drafts pass nearly whole.
COPY_CODE = json.loads((EDIT_PROMPTS.read_text().splitlines())[1])["prompt"].split("\n", 1)[1]


def copy_session(name: str, requests: int, ask: str) -> Session:
    copy = ({"role": "user", "content": f"{ask}\n{COPY_CODE}"},)
    return Session(name, copy, prompts=(copy,) * requests)


async def test_an_open_chat_session_stays_on_the_plain_server(fleet: str) -> None:
    """An open-chat session at a chat app's temperature (0.9, above policy.max_temperature): the
    first new session on a fresh fleet tries the n-gram method there (no session ran it yet), and
    the rules then want plain decisively: it goes to the plain server at once and stays."""
    seen = await drive(fleet, replace(chat_session(), temperature=0.9), "chat")
    assert len(seen) == 5 and {worker for worker, _, _, _ in seen[1:]} == {"plain"}, seen
    assert all(mode == "plain; reason=high_temperature" for worker, _, mode, _ in seen if worker == "plain"), seen


async def test_a_copy_heavy_session_goes_to_the_ngram_server_by_method(fleet: str, llama_ngram: LlamaServer) -> None:
    """A copy-heavy session that tried the n-gram method (the first on a fresh fleet) teaches the
    server that copies pay; a new copy-heavy session then goes there at once, by method, and its
    evidence in the gateway is what the server itself counted while it served the session."""
    # The first new session on a fresh fleet tries the n-gram method: nobody ran it yet.
    warm = await drive(fleet, copy_session("warm", 2, "Repeat this code exactly, with nothing before or after it:"),
                       "warm")
    assert warm[0][0] == "ngram", warm
    before = server_counts(llama_ngram)
    seen = await drive(fleet, copy_session("copy", 3, "Copy this code exactly and add nothing:"), "copy")
    after = server_counts(llama_ngram)
    assert seen[0][:2] == ("ngram", "method"), seen
    # Each request ran where its decision runs: the n-gram method there, plain on the other.
    assert all(mode.startswith("speculative; method=ngram") if worker == "ngram" else mode.startswith("plain")
               for worker, _, mode, _ in seen), seen
    session = get_json(f"{fleet}/admin/sessions/copy")
    ngram = session["speculative"]["by_method"]["ngram"]
    assert (ngram["proposed"], ngram["accepted"]) == (after["proposed"] - before["proposed"],
                                                     after["accepted"] - before["accepted"]), (ngram, before, after)
    assert ngram["proposed"] > 0 and ngram["accepted"] > 0
    steps = sum(spec["speculative_steps"] or 0 for worker, _, _, spec in seen if worker == "ngram")
    assert steps == after["steps"] - before["steps"]  # the verification steps, one by one
    assert sum(spec["proposed"] for _, _, _, spec in seen) == ngram["proposed"]
    # The server's step times, read from its per-token timings (its cost model once 8 of each).
    workers = {w["worker_id"]: w for w in get_json(fleet + "/admin/workers")["workers"]}
    costs = workers["ngram"]["step_costs"]
    assert costs["drafting_steps_timed"] > 0 and costs["plain_step_ms"] > 0 and costs["drafting_step_ms"] > 0


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
