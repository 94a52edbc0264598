"""Envoy's side of ext_proc, as much of it as bench.scaleout needs to ask `specgate epp` for picks.

One exchange is what Envoy's ext_proc filter sends for a request in BUFFERED body mode, up to
the pick: the request's headers (answered at once), then its whole body (answered with the
chosen endpoint in ``x-gateway-destination-endpoint``); then the stream is half-closed, as
when Envoy ends it, and the picker lets the request go. No response phase: a pick is counted
from the first message to the answer that names the endpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

DESTINATION_HEADER = "x-gateway-destination-endpoint"


def headers_message(path: str, extra: Mapping[str, str]) -> ext_proc.ProcessingRequest:
    """A POST's request headers, a body to follow, in BUFFERED body mode."""
    values = {":path": path, ":method": "POST", ":authority": "envoy", "content-type": "application/json", **extra}
    message = ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]),
        end_of_stream=False))
    message.protocol_config.request_body_mode = ProcessingMode.BUFFERED
    return message


def body_message(body: bytes) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=body, end_of_stream=True))


def destination(response: ext_proc.ProcessingResponse) -> str | None:
    """The endpoint a body answer names; None for anything else (an ImmediateResponse: refused)."""
    if response.WhichOneof("response") != "request_body":
        return None
    for option in response.request_body.response.header_mutation.set_headers:
        if option.header.key == DESTINATION_HEADER:
            value: str = option.header.raw_value.decode() or option.header.value
            return value
    return None


async def pick(stub: ext_proc_grpc.ExternalProcessorStub, path: str, headers: Mapping[str, str],
               body: bytes) -> str | None:
    """One exchange up to the pick: the endpoint named, or None if the picker refused."""
    call = stub.Process()
    try:
        await call.write(headers_message(path, headers))
        first = await call.read()
        if first is grpc.aio.EOF or first.WhichOneof("response") != "request_headers":
            return None
        await call.write(body_message(body))
        answer = await call.read()
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:  # the picker ends its side once Envoy's is closed
            pass
        return None if answer is grpc.aio.EOF else destination(answer)
    finally:
        call.cancel()  # a no-op once the call is over; ends it on the way out of an error


@dataclass
class PickRun:
    picks: int
    refused: int
    seconds: float

    @property
    def per_s(self) -> float:
        return self.picks / self.seconds if self.seconds > 0 else 0.0


async def picks_per_second(target: str, concurrency: int, requests: int, body: bytes,
                           sessions: int = 256) -> PickRun:
    """``requests`` exchanges, ``concurrency`` at a time over one HTTP/2 channel (as Envoy keeps
    one to each picker), each a completion of session ``s<i mod sessions>``."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        for i in range(min(32, requests)):  # warm the channel, the picker's code paths and its sessions
            await pick(stub, "/v1/completions", {"x-session-id": f"s{i % sessions}"}, body)
        counter = iter(range(requests))
        picked, refused = [0], [0]

        async def client() -> None:
            for i in counter:
                endpoint = await pick(stub, "/v1/completions", {"x-session-id": f"s{i % sessions}"}, body)
                if endpoint is None:
                    refused[0] += 1
                else:
                    picked[0] += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return PickRun(picked[0], refused[0], time.perf_counter() - started)
