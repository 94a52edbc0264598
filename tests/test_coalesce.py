"""A non-streaming client's chunks sent a few at a time (``server.coalesce_s``, workers/coalesce.py).

The merged chunk must say everything the per-step chunks said: the text, the finish reason,
every step's report in order and every token id. End to end, a non-streaming answer through
the gateway is the streamed one, with the same usage, and leaves the session's acceptance
estimate exactly where the streamed answer leaves it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.config import ConfigError, parse_config
from tests.harness import Gateway, start_gateway, start_tcp_worker, write_config
from workers.coalesce import merge_chunks
from workers.engine_api import SpecSteps
from workers.protocol import DIRECTIVE_FIELD, IDS_COMMENT, StepReport

PROMPT = "def fibonacci(n):\n    "


def _step(kind: str, text: str, finish: str | None, report: StepReport, first: bool = False) -> tuple[
        dict[str, Any], StepReport]:
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": "x", "object": "o", "created": 1, "model": "m", "choices": [choice],
            DIRECTIVE_FIELD: report.to_json()}, report


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_merged_chunk_carries_the_text_finish_steps_and_ids_of_its_parts(kind: str) -> None:
    reports = [StepReport(4, 3, 2, 4, 4, token_ids=(1, 2, 3, 4)), StepReport(0, 0, 2, 0, 1, token_ids=(5,)),
               StepReport(4, 1, 3, 4, 2, (SpecSteps(4, 4, 2),), token_ids=(6, 7))]
    parts = [_step(kind, "ab", None, reports[0], first=True), _step(kind, "", None, reports[1]),
             _step(kind, "cd", "length", reports[2])]
    merged, head = merge_chunks(kind, parts)  # type: ignore[arg-type]
    choice = merged["choices"][0]
    if kind == "chat":
        assert choice["delta"] == {"role": "assistant", "content": "abcd"}
    else:
        assert choice["text"] == "abcd"
    assert choice["finish_reason"] == "length"
    assert head is not None and head.token_ids == (1, 2, 3, 4, 5, 6, 7)
    assert [(s.proposed, s.accepted, s.k, s.tokens, s.late_steps) for s in head.steps()] == [
        (r.proposed, r.accepted, r.k, r.tokens, r.late_steps) for r in reports]
    # On the wire: what the gateway parses back is every step, in order.
    parsed = StepReport.from_json(json.loads(json.dumps(merged[DIRECTIVE_FIELD])))
    assert parsed is not None
    assert [_one_step(s) for s in parsed.steps()] == [_one_step(r) for r in reports]
    assert head.ids_comment() == IDS_COMMENT + b'{"token_ids":[1,2,3,4,5,6,7]}\n'


def _one_step(report: StepReport) -> dict[str, Any]:
    return {key: value for key, value in report.to_json().items() if key != "then"}


def test_a_step_report_lists_later_steps_one_level_deep() -> None:
    raw = {"proposed": 1, "accepted": 1, "batch_depth": 1, "k": 1, "tokens": 2,
           "then": [{"proposed": 2, "accepted": 0, "batch_depth": 1, "k": 2, "tokens": 1,
                     "then": [{"proposed": 9, "accepted": 9, "batch_depth": 1, "k": 9, "tokens": 10}]}]}
    report = StepReport.from_json(raw)
    assert report is not None and [s.proposed for s in report.steps()] == [1, 2]


def test_coalesce_s_must_stay_below_the_worker_timeout(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"server\.coalesce_s.*worker_timeout_s"):
        parse_config({"server": {"coalesce_s": 2, "worker_timeout_s": 1}}, tmp_path)
    with pytest.raises(ConfigError, match=r"server\.coalesce_s"):
        parse_config({"server": {"coalesce_s": -1}}, tmp_path)
    assert parse_config({"server": {"coalesce_s": 0}}, tmp_path).server.coalesce_s == 0


# -- end to end ------------------------------------------------------------------------------------
async def _events(url: str, body: dict[str, Any]) -> list[tuple[dict[str, Any], list[int]]]:
    """A worker's SSE events as (chunk, token ids of its comment line), [DONE] left out."""
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        raw = (await response.read()).decode()
    out = []
    for event in raw.split("\n\n"):
        ids: list[int] = []
        data = None
        for line in event.split("\n"):
            if line.startswith(IDS_COMMENT.decode()):
                ids = json.loads(line[len(IDS_COMMENT):]).get("token_ids", [])
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None and data != "[DONE]":
            out.append((json.loads(data), ids))
    return out


@pytest.fixture(scope="module")
def worker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("coalesce-worker")
    process, port = start_tcp_worker(tmp, "--max-slots", "4")
    yield f"http://127.0.0.1:{port}/v1/completions"
    process.terminate()
    process.wait(timeout=30)


def test_a_worker_sends_held_steps_as_one_chunk_with_every_step(worker_url: str) -> None:
    directive = {"k": 4, "max_batch": 64, "batch_resume": 48}
    body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "specgate": directive}
    per_step = asyncio.run(_events(worker_url, body))
    # Held up to 10 s: everything after the first chunk comes as one, with the usage.
    held = asyncio.run(_events(worker_url, {**body, "specgate": {**directive, "coalesce_s": 10}}))
    assert len(per_step) > 4 and len(held) == 3, (len(per_step), len(held))
    for events in (per_step, held):
        usage = events[-1][0]["usage"]
        steps = [s for chunk, _ in events[:-1] for s in StepReport.from_json(chunk[DIRECTIVE_FIELD]).steps()]  # type: ignore[union-attr]
        assert sum(s.proposed for s in steps) == usage["speculative"]["proposed"] > 0
        assert sum(s.accepted for s in steps) == usage["speculative"]["accepted"]
        assert len(steps) == usage["speculative"]["speculative_steps"] + usage["speculative"]["plain_steps"]
        assert sum(s.tokens for s in steps) == usage["completion_tokens"]
    text = ["".join(chunk["choices"][0]["text"] for chunk, _ in events[:-1]) for events in (per_step, held)]
    assert text[0] == text[1] and text[0]
    assert [i for _, ids in per_step for i in ids] == [i for _, ids in held for i in ids]
    assert held[1][0]["choices"][0]["finish_reason"] == per_step[-2][0]["choices"][0]["finish_reason"] == "length"
    # The first chunk went at once, alone: the same first step either way.
    assert held[0][0][DIRECTIVE_FIELD] == per_step[0][0][DIRECTIVE_FIELD]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("coalesce-gw")
    # coalesce_s 5: a non-streaming answer's steps after the first all come as one chunk.
    gw = start_gateway(write_config(tmp / "config.yaml", server={"coalesce_s": 5},
                                    workers={"count": 1, "max_slots": 4}), tmp)
    yield gw
    gw.stop()


async def _answer(gateway: Gateway, session: str, stream: bool) -> tuple[str, dict[str, Any]]:
    body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    async with aiohttp.ClientSession() as http, http.post(
            gateway.base_url + "/completions", json={k: v for k, v in body.items() if v is not None},
            headers={"X-Session-ID": session}) as response:
        assert response.status == 200, await response.text()
        if not stream:
            answer = await response.json()
            return answer["choices"][0]["text"], answer["usage"]
        text, usage = "", dict[str, Any]()
        async for line in response.content:
            data = line.decode().strip()[len("data: "):]
            if data and data != "[DONE]" and line.startswith(b"data: "):
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                text += "".join(c["text"] for c in chunk["choices"])
        return text, usage


def test_a_coalesced_answer_is_the_streamed_one_and_counts_each_step(gateway: Gateway) -> None:
    drafted_before = gateway.metric("specgate_spec_decode_drafted_by_position_total")
    streamed = asyncio.run(_answer(gateway, "coalesce-streamed", True))
    drafted_streamed = gateway.metric("specgate_spec_decode_drafted_by_position_total") - drafted_before
    whole = asyncio.run(_answer(gateway, "coalesce-whole", False))
    drafted_whole = (gateway.metric("specgate_spec_decode_drafted_by_position_total") - drafted_before
                     - drafted_streamed)
    assert whole == streamed and whole[1]["speculative"]["proposed"] > 0
    assert drafted_whole == drafted_streamed == whole[1]["speculative"]["proposed"]
    # The acceptance estimate folded the same steps in the same order.
    views = [gateway.get_json(f"/admin/sessions/{s}") for s in ("coalesce-streamed", "coalesce-whole")]
    for key in ("acceptance_estimate", "evidence_drafted_tokens", "low_acceptance", "mode"):
        assert views[0][key] == views[1][key], key
