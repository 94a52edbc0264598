"""A non-streaming client's chunks sent a few at a time (``server.coalesce_s``, workers/server/coalesce.py).

The merged chunk must say everything the per-step chunks said: the text, the finish reason,
every step's report in order and every token id. End to end, a non-streaming answer through
the gateway is the streamed one, with the same usage, and leaves the session's acceptance
estimate exactly where the streamed answer leaves it.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.config.config import ConfigError, parse_config
from gateway.fleet.worker_stream import WorkerLost, read_whole_answer
from tests.e2e.harness import Gateway, GatewayFactory, start_tcp_worker, worker_sse_events
from tests.unit.worker_http_server import serve
from workers.api.errors import WorkerFailed
from workers.api.generation import SpecSteps
from workers.api.wire import (
    ANSWER_BYTES_HEADER,
    DIRECTIVE_FIELD,
    HELD_FIELD,
    IDS_COMMENT,
    WHOLE_ANSWER_TYPE,
    StepReport,
)
from workers.server.coalesce import merge_chunks

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
    assert head.ids_comment() == IDS_COMMENT + b'{"token_ids":[1,2,3,4,5,6,7]}\n\n'


@pytest.mark.parametrize("parts", [1, 3])
def test_a_merged_chunk_says_how_long_its_first_step_waited_in_report_and_json(parts: int) -> None:
    reports = [StepReport(0, 0, 1, 0, 1, token_ids=(i,)) for i in range(parts)]
    merged, head = merge_chunks("completion", [_step("completion", "x", None, r) for r in reports],
                                0.25)
    parsed = StepReport.from_json(json.loads(json.dumps(merged[DIRECTIVE_FIELD])))
    assert head is not None and parsed is not None and head.held_s == parsed.held_s == 0.25
    assert len(parsed.steps()) == parts and head.token_ids == tuple(range(parts))


def _one_step(report: StepReport) -> dict[str, Any]:
    return {key: value for key, value in report.to_json().items() if key not in ("then", HELD_FIELD)}


def test_a_step_report_lists_later_steps_one_level_deep() -> None:
    raw = {"proposed": 1, "accepted": 1, "batch_depth": 1, "k": 1, "tokens": 2,
           "then": [{"proposed": 2, "accepted": 0, "batch_depth": 1, "k": 2, "tokens": 1,
                     "then": [{"proposed": 9, "accepted": 9, "batch_depth": 1, "k": 9, "tokens": 10}]}]}
    report = StepReport.from_json(raw)
    assert report is not None and [s.proposed for s in report.steps()] == [1, 2]


@pytest.mark.parametrize(("held", "parsed"), [(0.25, 0.25), (2, 2.0), (None, 0.0), (True, 0.0), (-1, 0.0),
                                              ("0.5", 0.0), (1e9, 0.0), (float("nan"), 0.0)])
def test_a_step_reports_held_time_is_read_only_when_plausible(held: Any, parsed: float) -> None:
    raw: dict[str, Any] = {"proposed": 1, "accepted": 1, "batch_depth": 1, "k": 1, "tokens": 2, HELD_FIELD: held}
    report = StepReport.from_json(raw)
    assert report is not None and report.held_s == parsed
    assert (HELD_FIELD in report.to_json()) == bool(parsed)


def test_coalesce_s_must_stay_below_the_worker_timeout(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"server\.coalesce_s.*worker_timeout_s"):
        parse_config({"server": {"coalesce_s": 2, "worker_timeout_s": 1}}, tmp_path)
    with pytest.raises(ConfigError, match=r"server\.coalesce_s"):
        parse_config({"server": {"coalesce_s": -1}}, tmp_path)
    assert parse_config({"server": {"coalesce_s": 0}}, tmp_path).server.coalesce_s == 0


# -- end to end ------------------------------------------------------------------------------------
async def _events(url: str, body: dict[str, Any]) -> tuple[list[tuple[dict[str, Any], list[int]]], dict[str, str]]:
    """A worker's SSE events as (chunk, token ids of its comment line), [DONE] left out, and
    the response's headers."""
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        raw = (await response.read()).decode()
        headers = {k.lower(): v for k, v in response.headers.items()}
    out = worker_sse_events(raw)
    assert raw.endswith("data: [DONE]\n\n")
    return out, headers


@pytest.fixture(scope="module")
def worker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("coalesce-worker")
    process, port = start_tcp_worker(tmp, "--max-slots", "4")
    yield f"http://127.0.0.1:{port}/v1/completions"
    process.terminate()
    process.wait(timeout=30)


def _steps(events: list[tuple[dict[str, Any], list[int]]]) -> list[StepReport]:
    reports = [StepReport.from_json(chunk[DIRECTIVE_FIELD]) for chunk, _ in events if DIRECTIVE_FIELD in chunk]
    return [step for report in reports if report is not None for step in report.steps()]


def _same_generation(per_step: list[tuple[dict[str, Any], list[int]]],
                     held: list[tuple[dict[str, Any], list[int]]]) -> None:
    for events in (per_step, held):
        usage = events[-1][0]["usage"]
        steps = _steps(events[:-1])
        assert sum(s.proposed for s in steps) == usage["speculative"]["proposed"] > 0
        assert sum(s.accepted for s in steps) == usage["speculative"]["accepted"]
        assert len(steps) == usage["speculative"]["speculative_steps"] + usage["speculative"]["plain_steps"]
        assert sum(s.tokens for s in steps) == usage["completion_tokens"]
    text = ["".join(chunk["choices"][0]["text"] for chunk, _ in events[:-1]) for events in (per_step, held)]
    assert text[0] == text[1] and text[0]
    per_step_ids, held_ids = ([i for _, ids in events for i in ids] for events in (per_step, held))
    assert per_step_ids == held_ids and len(per_step_ids) == per_step[-1][0]["usage"]["completion_tokens"]
    assert held[-2][0]["choices"][0]["finish_reason"] == per_step[-2][0]["choices"][0]["finish_reason"] == "length"


DIRECTIVE = {"k": 4, "max_batch": 64, "batch_resume": 48}
GREEDY_48 = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}, "specgate": DIRECTIVE}


def test_a_worker_sends_a_generation_within_one_span_as_one_body(worker_url: str) -> None:
    per_step, streamed = asyncio.run(_events(worker_url, GREEDY_48))
    # Held up to 10 s: the whole generation is one chunk, sent with the usage and [DONE] as
    # one body with its length (one write, one read for the gateway).
    held, headers = asyncio.run(_events(worker_url, {**GREEDY_48, "specgate": {**DIRECTIVE, "coalesce_s": 10}}))
    assert len(per_step) > 4 and len(held) == 2, (len(per_step), len(held))
    assert "content-length" in headers and "transfer-encoding" not in headers, headers
    assert streamed.get("transfer-encoding") == "chunked"
    assert headers["content-type"] == streamed["content-type"] == "text/event-stream"
    _same_generation(per_step, held)
    # The chunk says how long its first step waited in the worker (the gateway's TTFT).
    report = StepReport.from_json(held[0][0][DIRECTIVE_FIELD])
    assert report is not None and 0 < report.held_s < 10
    assert StepReport.from_json(per_step[0][0][DIRECTIVE_FIELD]).held_s == 0  # type: ignore[union-attr]


def test_a_worker_streams_spans_once_the_first_is_due(worker_url: str) -> None:
    per_step, _ = asyncio.run(_events(worker_url, GREEDY_48))
    # A span of 1 ms: more than one span over 48 tokens on any CPU, so the response streams.
    spans, headers = asyncio.run(_events(worker_url, {**GREEDY_48, "specgate": {**DIRECTIVE, "coalesce_s": 0.001}}))
    assert headers.get("transfer-encoding") == "chunked" and len(spans) >= 3, (headers, len(spans))
    _same_generation(per_step, spans)
    # Spans count from the request's arrival: a first token that took longer than the span (a
    # prefill and a step of the embedded engine take more than 1 ms) goes at once, alone.
    first = StepReport.from_json(spans[0][0][DIRECTIVE_FIELD])
    assert first is not None and first.then == () and first.held_s < 0.5


def test_a_worker_answers_whole_when_the_gateway_takes_it(worker_url: str) -> None:
    """``whole_answer``: a generation done within the first span comes as the OpenAI answer a
    direct non-streaming client gets, then its merged step report; one that outlasts the span
    streams as before."""
    per_step, _ = asyncio.run(_events(worker_url, GREEDY_48))
    whole = {**GREEDY_48, "specgate": {**DIRECTIVE, "coalesce_s": 10, "whole_answer": True}}
    with urllib.request.urlopen(urllib.request.Request(worker_url, json.dumps(whole).encode(),
                                                       {"Content-Type": "application/json"}), timeout=60) as response:
        assert response.headers["Content-Type"] == WHOLE_ANSWER_TYPE
        split = int(response.headers[ANSWER_BYTES_HEADER])
        body = response.read()
    answer, report = json.loads(body[:split]), StepReport.from_json(json.loads(body[split:]))
    direct = {k: v for k, v in GREEDY_48.items() if k not in ("stream", "stream_options", "specgate")}
    with urllib.request.urlopen(urllib.request.Request(worker_url, json.dumps(direct).encode(),
                                                       {"Content-Type": "application/json"}), timeout=60) as response:
        plain_answer = json.loads(response.read())
    same = ("object", "model", "choices")
    assert {k: answer[k] for k in same} == {k: plain_answer[k] for k in same}
    assert answer["usage"]["completion_tokens"] == plain_answer["usage"]["completion_tokens"] == 48
    assert answer["choices"][0]["text"] == "".join(c["choices"][0]["text"] for c, _ in per_step[:-1])
    # The report lists every step: the same ones the per-step stream reported.
    assert report is not None and 0 < report.held_s < 10
    assert [_one_step(s) for s in report.steps()] == [_one_step(s) for s in _steps(per_step[:-1])]
    assert sum(s.proposed for s in report.steps()) == answer["usage"]["speculative"]["proposed"] > 0
    spans, headers = asyncio.run(_events(worker_url, {**GREEDY_48, "specgate": {
        **DIRECTIVE, "coalesce_s": 0.001, "whole_answer": True}}))
    assert headers["content-type"] == "text/event-stream" and len(spans) >= 3
    _same_generation(per_step, spans)


def _whole_reply(body: bytes, split: str, length: int | None = None) -> Any:
    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: %b\r\n%b: %b\r\nContent-Length: %d\r\n\r\n%b" % (
            WHOLE_ANSWER_TYPE.encode(), ANSWER_BYTES_HEADER.encode(), split.encode(),
            len(body) if length is None else length, body))
        await writer.drain()
        return False
    return reply


ANSWER = b'{"id":"c","object":"text_completion","choices":[{"index":0,"text":"hi"}]}'
REPORT = b'{"proposed":4,"accepted":3,"batch_depth":1,"k":4,"tokens":4,"held_s":0.01}'


@pytest.mark.parametrize(("body", "split", "length", "outcome"), [
    (ANSWER + REPORT, str(len(ANSWER)), None, "answer"),
    (ANSWER + b"null", str(len(ANSWER)), None, "no report"),
    (ANSWER + REPORT, str(len(ANSWER) - 1), None, WorkerFailed),  # the split is not where the answer ends
    (ANSWER + REPORT, "x", None, WorkerFailed),
    (b"[1]" + REPORT, "3", None, WorkerFailed),  # an answer that is no JSON object
    (ANSWER + b"{not json", str(len(ANSWER)), None, WorkerFailed),
    (ANSWER + REPORT, str(len(ANSWER)), 4096, WorkerLost),  # the body broke off: may go to another worker
])
async def test_a_whole_answer_is_checked_and_its_failures_told_apart(body: bytes, split: str, length: int | None,
                                                                   outcome: Any) -> None:
    async for _, http in serve(_whole_reply(body, split, length)):
        response = await http.post("/v1/completions", b"{}")
        if isinstance(outcome, type):
            with pytest.raises(outcome):
                await read_whole_answer(response)
            continue
        whole = await read_whole_answer(response)
        assert whole.answer == ANSWER
        if outcome == "answer":
            assert whole.report is not None and (whole.report.accepted, whole.report.held_s) == (3, 0.01)
        else:
            assert whole.report is None


@pytest.fixture(scope="module")
def gateway(gateway_factory: GatewayFactory) -> Gateway:
    # coalesce_s 5: a non-streaming answer's steps after the first all come as one chunk.
    return gateway_factory("coalesce-gw", server={"coalesce_s": 5}, workers={"count": 1, "max_slots": 4})


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


def test_time_to_first_token_counts_from_when_the_worker_made_it(gateway: Gateway) -> None:
    """A non-streaming answer's worker holds every chunk (coalesce_s 5) and sends them with the
    last: the time to first token is still the first token's, from the held time it reports."""
    ttft = "specgate_time_to_first_token_seconds_sum"
    e2e = "specgate_e2e_latency_seconds_sum"
    itl = "specgate_inter_token_latency_seconds_count"
    before = gateway.metric(ttft), gateway.metric(e2e, route="/v1/completions"), gateway.metric(itl)
    body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 96, "temperature": 0}
    with urllib.request.urlopen(urllib.request.Request(
            gateway.base_url + "/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Session-ID": "coalesce-ttft"}), timeout=60) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == 96
    first_token = gateway.metric(ttft) - before[0]
    whole = gateway.metric(e2e, route="/v1/completions") - before[1]
    # 96 tokens take many engine steps; the first token came after one (a prompt of 9 tokens).
    assert 0 < first_token < whole / 2, (first_token, whole)
    # Every token after the first step's (at most K + 1 of them; K <= 15 here) has its gap observed.
    assert 96 - 16 <= gateway.metric(itl) - before[2] <= 95
