"""``specgate epp`` spoken to as Envoy speaks to it: ext_proc over gRPC, message by message.

A real picker process routes to real sim workers on loopback and to a pool member that is not
a model server. The exchanges are exact where Envoy's are not repeatable: a malformed request,
a subset hint, a response cut in the middle of an SSE event. tests/e2e/test_epp_envoy.py puts the
real Envoy in front.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.procs import free_port, start_sim_worker, stop
from policies import PolicyConfig, SessionState, observe
from tests.e2e.epp_harness import (
    Epp,
    Exchange,
    body_message,
    completion_body,
    header_values,
    headers_message,
    response_body_message,
    response_headers_message,
    start_epp,
)

DESTINATION = "x-gateway-destination-endpoint"
POLICY = {"num_speculative_tokens": 6, "min_proposals": 16, "acceptance_half_life": 64, "max_temperature": 0.8}


@dataclass
class Pool:
    epp: Epp
    endpoints: list[str]  # the two sim workers' ip:port, w0 then w1
    bogus: str  # a pool member that answers HTTP but is no model server


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("epp")
    sim = {"time_scale": 0, "seed": 1}
    processes: list[subprocess.Popen[bytes]] = []
    ports = []
    for _ in range(2):
        process, port = start_sim_worker(tmp, sim)
        processes.append(process)
        ports.append(port)
    # A pool member that answers HTTP but is no model server (a static file server).
    bogus_port = free_port()
    processes.append(subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(bogus_port)],
                                      cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    remote = [{"url": f"http://127.0.0.1:{p}", "protocol": "specgate", "name": f"w{i}"} for i, p in enumerate(ports)]
    remote.append({"url": f"http://127.0.0.1:{bogus_port}", "protocol": "specgate", "name": "impostor"})
    epp = start_epp(tmp, remote, policy=POLICY, workers={"max_slots": 1, "max_queue": 1})
    try:
        epp.gateway.wait_workers_ready(2)
        yield Pool(epp, [f"127.0.0.1:{p}" for p in ports], f"127.0.0.1:{bogus_port}")
    finally:
        epp.stop()
        for process in processes:
            stop(process)


@pytest.fixture
async def channel(pool: Pool) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(pool.epp.grpc_target) as chan:
        yield chan


def immediate_error(response: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
    assert response.WhichOneof("response") == "immediate_response", response
    immediate = response.immediate_response
    return immediate.status.code, orjson.loads(immediate.body), header_values(immediate.headers)


async def pick_buffered(channel: grpc.aio.Channel, body: bytes, session: str = "",
                        subset: list[str] | None = None) -> tuple[Exchange, Any]:
    """A BUFFERED exchange up to the picker's answer to the body; the caller closes it."""
    exchange = Exchange(channel)
    await exchange.__aenter__()
    extra = {"x-session-id": session} if session else {}
    await exchange.send(headers_message("/v1/completions", extra=extra, subset=subset))
    first = await exchange.receive()
    assert first.WhichOneof("response") == "request_headers", first
    await exchange.send(body_message(body))
    return exchange, await exchange.receive()


async def test_buffered_request_names_the_endpoint_and_carries_the_decision(pool: Pool,
                                                                            channel: grpc.aio.Channel) -> None:
    exchange, answer = await pick_buffered(channel, completion_body(), "buffered")
    await exchange.close()
    assert answer.WhichOneof("response") == "request_body", answer
    common = answer.request_body.response
    endpoint = header_values(common.header_mutation)[DESTINATION]
    assert endpoint in pool.endpoints  # never the impostor: it failed the fleet's health checks
    assert answer.dynamic_metadata["envoy.lb"][DESTINATION] == endpoint
    body = orjson.loads(common.body_mutation.body)
    assert header_values(common.header_mutation)["content-length"] == str(len(common.body_mutation.body))
    assert body["specgate"]["k"] == 6 and body["specgate"]["step_log"] is True  # non-streaming: its steps logged
    assert body["prompt"] == "hello" and "stream" not in body  # the client's request, as it sent it
    views = {w["worker_id"]: w for w in pool.epp.gateway.get_json("/admin/workers")["workers"]}
    assert views["impostor"]["status"] != "ready"


async def test_a_session_sticks_and_a_hot_one_goes_plain(pool: Pool, channel: grpc.aio.Channel) -> None:
    seen = set()
    for _ in range(3):
        exchange, answer = await pick_buffered(channel, completion_body(), "sticky")
        await exchange.close()
        seen.add(header_values(answer.request_body.response.header_mutation)[DESTINATION])
    assert len(seen) == 1
    exchange, answer = await pick_buffered(channel, completion_body(temperature=1.5), "hot")
    await exchange.close()
    assert orjson.loads(answer.request_body.response.body_mutation.body)["specgate"]["k"] == 0
    session = pool.epp.gateway.get_json("/admin/sessions/hot")
    assert (session["mode"], session["reason"]) == ("plain", "high_temperature")


async def test_full_duplex_streamed_answers_headers_after_the_whole_body(pool: Pool,
                                                                         channel: grpc.aio.Channel) -> None:
    body = completion_body(stream=True)
    async with Exchange(channel) as exchange:
        await exchange.send(headers_message("/v1/completions", body_mode="FULL_DUPLEX_STREAMED"))
        await exchange.send(body_message(body[:10], end_of_stream=False))
        await exchange.send(body_message(body[10:], end_of_stream=True))
        headers = await exchange.receive()
        streamed = await exchange.receive()
    assert headers.WhichOneof("response") == "request_headers"
    assert header_values(headers.request_headers.response.header_mutation)[DESTINATION] in pool.endpoints
    piece = streamed.request_body.response.body_mutation.streamed_response
    assert piece.end_of_stream
    sent = orjson.loads(piece.body)
    assert sent["stream"] is True and "step_log" not in sent["specgate"]  # a stream reports every step


@pytest.mark.parametrize(("body", "status", "param"), [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (completion_body(model="gpt-nope"), 404, "model"),
    (completion_body(specgate={"k": 8}), 400, "specgate"),
    (completion_body(max_tokens=-1), 400, "max_tokens"),
    (completion_body(temperature="hot"), 400, "temperature"),
    (b'{"model": "specgate-demo", "prompt": "\\ud800"}', 400, "prompt"),  # a lone surrogate: no text
    (b'{"model": "specgate-demo", "messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "messages[0].content"),
])
async def test_bad_input_gets_an_openai_error_from_envoy(channel: grpc.aio.Channel, body: bytes, status: int,
                                                        param: str | None) -> None:
    exchange, answer = await pick_buffered(channel, body)
    await exchange.close()
    code, error, headers = immediate_error(answer)
    assert code == status and headers["content-type"] == "application/json"
    assert error["error"]["message"] and (param is None or error["error"]["param"] == param)


async def test_a_body_too_large_is_refused_with_413(channel: grpc.aio.Channel) -> None:
    async with Exchange(channel) as exchange:
        await exchange.send(headers_message("/v1/completions"))
        await exchange.receive()
        await exchange.send(body_message(b"x" * (1 << 20), end_of_stream=False))
        await exchange.receive()
        await exchange.send(body_message(b"x" * 1024))
        code, error, _ = immediate_error(await exchange.receive())
    assert code == 413 and "larger than" in error["error"]["message"]


async def test_garbage_messages_leave_the_picker_serving(pool: Pool, channel: grpc.aio.Channel) -> None:
    async with Exchange(channel) as exchange:  # a body before any headers, then trailers
        await exchange.send(body_message(b"\x00\x01"))
        answer = await exchange.receive()
        assert answer.WhichOneof("response") == "immediate_response"
    exchange, answer = await pick_buffered(channel, completion_body(), "after-garbage")
    await exchange.close()
    assert header_values(answer.request_body.response.header_mutation)[DESTINATION] in pool.endpoints


async def test_subset_hint_limits_the_choice(pool: Pool, channel: grpc.aio.Channel) -> None:
    for endpoint in pool.endpoints:
        exchange, answer = await pick_buffered(channel, completion_body(), f"subset-{endpoint}", subset=[endpoint])
        await exchange.close()
        assert header_values(answer.request_body.response.header_mutation)[DESTINATION] == endpoint
    for subset, why in (([pool.bogus], "not ready"), (["10.9.9.9:80"], "not in the pool")):
        exchange, answer = await pick_buffered(channel, completion_body(), "nowhere", subset=subset)
        await exchange.close()
        code, error, _headers = immediate_error(answer)
        assert code == 503, (why, error)


async def test_shedding_answers_429_with_retry_after(pool: Pool, channel: grpc.aio.Channel) -> None:
    # max_slots 1 + max_queue 1: two requests in flight fill an endpoint.
    held = []
    endpoint = pool.endpoints[0]
    try:
        for i in range(2):
            exchange, answer = await pick_buffered(channel, completion_body(), f"shed-{i}", subset=[endpoint])
            held.append(exchange)
            assert answer.WhichOneof("response") == "request_body"
        exchange, answer = await pick_buffered(channel, completion_body(), "shed-3", subset=[endpoint])
        await exchange.close()
        code, error, headers = immediate_error(answer)
        assert code == 429 and headers["retry-after"] == "1", error
    finally:
        for exchange in held:
            await exchange.close()


async def test_models_list_is_routed_without_a_decision(pool: Pool, channel: grpc.aio.Channel) -> None:
    async with Exchange(channel) as exchange:
        await exchange.send(headers_message("/v1/models", method="GET", end_of_stream=True))
        answer = await exchange.receive()
    assert header_values(answer.request_headers.response.header_mutation)[DESTINATION] in pool.endpoints


def _steps_event(proposed: int, accepted: int) -> bytes:
    chunk = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": None}],
             "specgate": {"proposed": proposed, "accepted": accepted, "batch_depth": 1, "k": proposed,
                          "tokens": accepted + 1}}
    return b": ids {\"token_ids\": [1]}\ndata: " + orjson.dumps(chunk) + b"\n\n"


async def test_streamed_feedback_moves_the_estimate_as_the_relay_would(pool: Pool,
                                                                       channel: grpc.aio.Channel) -> None:
    steps = [(6, 6), (6, 1), (6, 0), (6, 4), (6, 6), (6, 2)]
    exchange, _ = await pick_buffered(channel, completion_body(stream=True), "feedback-stream")
    try:
        headers = response_headers_message(200, "text/event-stream")
        await exchange.send(headers)
        answer = await exchange.receive()
        values = header_values(answer.response_headers.response.header_mutation)
        assert values["x-specgate-mode"].startswith("speculative") and values["x-session-id"] == "feedback-stream"
        stream = b"".join(_steps_event(p, a) for p, a in steps) + b"data: [DONE]\n\n"
        cuts = [0, 7, 150, 151, 333, len(stream)]  # pieces cut mid-line and mid-event
        for start, end in itertools.pairwise(cuts):
            await exchange.send(response_body_message(stream[start:end], end_of_stream=end == len(stream)))
            answer = await exchange.receive()
            assert answer.WhichOneof("response") == "response_body"
            assert not answer.response_body.response.HasField("body_mutation")  # the stream passes as it is
    finally:
        await exchange.close()
    expected = SessionState()
    policy = PolicyConfig.from_mapping(POLICY)
    for proposed, accepted in steps:
        expected = observe(expected, proposed, accepted, policy)
    session = pool.epp.gateway.get_json("/admin/sessions/feedback-stream")
    assert session["evidence_drafted_tokens"] == expected.proposals_seen
    assert session["acceptance_estimate"] == pytest.approx(expected.acceptance_estimate, abs=1e-12)


async def test_a_whole_answer_gives_its_step_log_and_loses_it(pool: Pool, channel: grpc.aio.Channel) -> None:
    steps = [[6, 0], [6, 5], [6, 1]]
    exchange, _ = await pick_buffered(channel, completion_body(), "feedback-whole")
    try:
        await exchange.send(response_headers_message(200, "application/json"))
        answer = await exchange.receive()
        assert answer.mode_override.response_body_mode == ProcessingMode.BUFFERED
        assert "content-length" in answer.response_headers.response.header_mutation.remove_headers
        whole = {"id": "c", "object": "text_completion", "choices": [], "usage": {"completion_tokens": 9},
                 "specgate": {"steps": steps}}
        await exchange.send(response_body_message(orjson.dumps(whole), end_of_stream=True))
        answer = await exchange.receive()
    finally:
        await exchange.close()
    relayed = orjson.loads(answer.response_body.response.body_mutation.body)
    assert "specgate" not in relayed and relayed["usage"] == {"completion_tokens": 9}
    expected = SessionState()
    for proposed, accepted in steps:
        expected = observe(expected, proposed, accepted, PolicyConfig.from_mapping(POLICY))
    session = pool.epp.gateway.get_json("/admin/sessions/feedback-whole")
    assert session["evidence_drafted_tokens"] == expected.proposals_seen


async def test_a_plain_decision_names_the_headers_and_skips_the_response_body(pool: Pool,
                                                                           channel: grpc.aio.Channel) -> None:
    """A plain decision teaches nothing: no step log is asked for, the pick's metadata carries
    the response headers the route adds, and the response's body is not sent to the picker."""
    exchange, answer = await pick_buffered(channel, completion_body(temperature=1.5), "plain-skip")
    try:
        assert "step_log" not in orjson.loads(answer.request_body.response.body_mutation.body)["specgate"]
        picked = answer.dynamic_metadata["specgate"]
        assert picked["session"] == "plain-skip" and picked["mode"] == "plain; reason=high_temperature"
        assert picked["worker"] in ("w0", "w1")
        await exchange.send(response_headers_message(200, "application/json"))
        answer = await exchange.receive()
        assert answer.mode_override.response_body_mode == ProcessingMode.NONE
        assert header_values(answer.response_headers.response.header_mutation)["x-session-id"] == "plain-skip"
    finally:
        await exchange.close()


async def test_grpc_health_answers_liveness_readiness_and_the_service(channel: grpc.aio.Channel) -> None:
    stub: Any = health_pb2_grpc.HealthStub(channel)  # its stub types declare no methods
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        deadline = time.monotonic() + 10
        while True:
            status = (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status
            if status == health_pb2.HealthCheckResponse.SERVING or time.monotonic() > deadline:
                break
        assert status == health_pb2.HealthCheckResponse.SERVING, service


async def test_the_picker_counts_what_it_answered(pool: Pool, channel: grpc.aio.Channel) -> None:
    exchange, _ = await pick_buffered(channel, b"nope")
    await exchange.close()
    text = pool.epp.gateway.metrics()
    assert 'specgate_epp_requests_total{outcome="refused"}' in text
    assert 'specgate_epp_requests_total{outcome="picked"}' in text
    assert 'specgate_decisions_total' in text


def test_epp_refuses_local_workers(tmp_path: Path) -> None:
    from tests.e2e.harness import REPO, write_config

    config = write_config(tmp_path / "c.yaml", workers={"count": 1})
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "epp", "--config", str(config)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "workers.count: specgate epp routes to workers.remote only" in result.stderr


def test_the_decision_reaches_each_kind_of_model_server_in_its_terms() -> None:
    """What the picker writes into the body Envoy forwards: the client's request as it sent it
    (its own ``stream``), plus the directive (specgate) or plugin arguments (vLLM)."""
    from gateway.fleet.worker_stream import worker_body
    from workers.api.request_parser import parse_request
    from workers.api.wire import Directive

    req = parse_request("completion", orjson.loads(completion_body(stream=True)))
    directive = Directive(3, 64, 56, step_log=False)
    specgate = worker_body(req, directive, "specgate", streamed=False)
    assert specgate["specgate"] == {"k": 3, "max_batch": 64, "batch_resume": 56} and specgate["stream"] is True
    assert "stream_options" not in specgate  # the client did not ask for usage: Envoy hands it what it asked
    vllm = worker_body(req, directive, "vllm", streamed=False)
    assert vllm["vllm_xargs"] == {"spec_k": 3, "spec_max_batch": 64, "spec_batch_resume": 56}
    assert "specgate" not in vllm
    assert worker_body(req, directive, "openai", streamed=False) == dict(req.raw)
