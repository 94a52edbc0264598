"""OpenTelemetry traces from a real gateway process to a local OTLP/HTTP receiver.

Behind the gateway, two recording proxies forward to one real (sim) worker process: they show
what the worker received (the ``traceparent``), and one of them can drop a request before
answering so that the gateway retries it on the other.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from gateway.config.config import TracingConfig
from gateway.observe.tracing import Tracing, enabled_by
from tests.e2e.harness import Gateway, start_gateway, start_tcp_worker, write_config

PROMPT = "PROMPT-SENTINEL-not-in-spans"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@dataclass
class Rig:
    gateway: Gateway
    spans: list[Span]
    received: list[dict[str, str]]  # headers of each completion request a recorder saw
    drop_next: list[bool] = field(default_factory=lambda: [False])


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def _collector(spans: list[Span]) -> web.Application:
    async def export(request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                spans.extend(scope.spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    return app


def _recorder(worker_url: str, rig_received: list[dict[str, str]], drop_next: list[bool],
              http: aiohttp.ClientSession) -> web.Application:
    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "POST":
            rig_received.append(dict(request.headers))
            if drop_next[0]:
                drop_next[0] = False
                assert request.transport is not None
                request.transport.close()  # gone before any answer: the gateway may retry elsewhere
                return web.Response()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with http.request(request.method, worker_url + request.path_qs, data=body, headers=headers) as upstream:
            out = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "retry-after")})
            await out.prepare(request)
            async for data in upstream.content.iter_any():
                await out.write(data)
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    worker, port = await asyncio.to_thread(start_tcp_worker, tmp_path, "--engine", "sim",
                                           "--sim-config", json.dumps({"time_scale": 0}))
    spans: list[Span] = []
    received: list[dict[str, str]] = []
    drop_next = [False]
    runners = []
    async with aiohttp.ClientSession() as http:
        try:
            runner, collector_url = await _serve(_collector(spans))
            runners.append(runner)
            recorders = []
            for _ in range(2):
                runner, url = await _serve(_recorder(f"http://127.0.0.1:{port}", received, drop_next, http))
                runners.append(runner)
                recorders.append(url)
            config = write_config(
                tmp_path / "config.yaml",
                workers={"count": 0, "remote": [{"url": u, "protocol": "specgate", "name": f"rec-{i}"}
                                                for i, u in enumerate(recorders)]},
                tracing={"enabled": True, "otlp_endpoint": collector_url})
            gateway = await asyncio.to_thread(start_gateway, config, tmp_path, env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
            try:
                await asyncio.to_thread(gateway.wait_workers_ready, 2)
                yield Rig(gateway, spans, received, drop_next)
            finally:
                await asyncio.to_thread(gateway.stop)
        finally:
            for runner in runners:
                await runner.cleanup()
            worker.terminate()
            await asyncio.to_thread(worker.wait)


def attrs(span: Span) -> dict[str, Any]:
    def value(v: AnyValue) -> Any:
        return getattr(v, v.WhichOneof("value") or "string_value")
    return {kv.key: value(kv.value) for kv in span.attributes}


def context(headers: dict[str, str]) -> str:
    """A ``traceparent`` without its flags (sampled, and the SDK's random-trace-id bit)."""
    version, trace_id, parent, flags = headers["traceparent"].split("-")
    assert int(flags, 16) & 1  # sampled
    return f"{version}-{trace_id}-{parent}"


async def stream(rig: Rig, session: str, traceparent: str | None = None) -> str:
    body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    headers = {"X-Session-ID": session, **({"traceparent": traceparent} if traceparent else {})}
    async with aiohttp.ClientSession() as http, http.post(rig.gateway.base_url + "/completions", json=body,
                                                          headers=headers) as response:
        assert response.status == 200, await response.text()
        text = (await response.read()).decode()
        assert text.rstrip().endswith("data: [DONE]")
        return str(response.headers["X-Specgate-Mode"])


async def spans_of(rig: Rig, trace_id: bytes, count: int) -> list[Span]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = [s for s in rig.spans if s.trace_id == trace_id]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"expected {count} spans of the trace, got {rig.spans}")


async def test_request_span_attempt_span_and_traceparent(rig: Rig) -> None:
    mode = await stream(rig, "traced", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    spans = await spans_of(rig, bytes.fromhex(CLIENT_TRACE), 2)
    (request,) = [s for s in spans if s.name == "specgate completion"]
    (attempt,) = [s for s in spans if s.name == "specgate worker attempt"]
    assert request.parent_span_id.hex() == CLIENT_SPAN  # continues the client's trace
    assert attempt.parent_span_id == request.span_id
    a, r = attrs(attempt), attrs(request)
    decision = f"{r['specgate.decision.mode']}; " + (f"k={r['specgate.decision.k']}; " if r["specgate.decision.k"]
                                                     else "") + f"reason={r['specgate.decision.reason']}"
    assert decision == mode
    assert r["specgate.session"] == "traced" and r["specgate.worker"] == a["specgate.worker"]
    assert r["specgate.retries"] == 0 and r["specgate.tokens"] == 8 and 0 < r["specgate.ttft_s"] < 30
    assert {k: v for k, v in a.items() if k.startswith("specgate.decision")} == {
        k: v for k, v in r.items() if k.startswith("specgate.decision")}
    assert PROMPT not in str(spans)
    # The worker got the attempt's context: same trace, the attempt span as parent.
    assert context(rig.received[-1]) == f"00-{CLIENT_TRACE}-{attempt.span_id.hex()}"


async def test_a_retried_attempt_is_a_second_child(rig: Rig) -> None:
    rig.drop_next[0] = True
    await stream(rig, "retried")
    assert len(rig.received) == 2
    trace_id = bytes.fromhex(rig.received[0]["traceparent"].split("-")[1])
    spans = await spans_of(rig, trace_id, 3)
    (request,) = [s for s in spans if s.name == "specgate completion"]
    attempts = sorted((s for s in spans if s.name == "specgate worker attempt"),
                      key=lambda s: attrs(s)["specgate.attempt"])
    assert [s.parent_span_id for s in attempts] == [request.span_id] * 2
    assert attempts[0].status.code == attempts[0].status.STATUS_CODE_ERROR
    assert attempts[1].status.code != attempts[1].status.STATUS_CODE_ERROR
    assert attrs(attempts[0])["specgate.worker"] != attrs(attempts[1])["specgate.worker"]
    assert attrs(request)["specgate.retries"] == 1 and attrs(request)["specgate.worker"] == \
        attrs(attempts[1])["specgate.worker"]
    assert [context(h) for h in rig.received] == [f"00-{trace_id.hex()}-{s.span_id.hex()}" for s in attempts]


def test_off_by_default_and_on_by_the_standard_variables() -> None:
    assert Tracing.create(TracingConfig(), environ={}).tracer is None
    assert not enabled_by(TracingConfig(), {})
    assert enabled_by(TracingConfig(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert not enabled_by(TracingConfig(enabled=True), {"OTEL_SDK_DISABLED": "true"})
    assert not enabled_by(TracingConfig(enabled=True), {"OTEL_TRACES_EXPORTER": "none"})
