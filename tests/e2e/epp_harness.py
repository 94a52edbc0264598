"""Starts a real ``specgate epp`` process on loopback, and speaks Envoy's side of ext_proc to it.

The Envoy tests put the real Envoy in front (tests/e2e/envoy_harness.py); the tests here that
need exact control over what the picker receives (a malformed exchange, a subset hint, a
response split mid-event) speak ext_proc themselves, as Envoy would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import orjson
import yaml
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from bench.procs import free_port, wait_ok
from tests.e2e.harness import REPO, Gateway

MODELS = REPO / "models"


@dataclass
class Epp:
    gateway: Gateway  # the HTTP side: /metrics, /ready, /admin
    grpc_port: int

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def stop(self) -> None:
        self.gateway.stop()


def start_epp(log_dir: Path, remote: Sequence[dict[str, Any]], **sections: dict[str, Any]) -> Epp:
    """``specgate epp`` routing to ``remote`` (workers.remote entries); ``sections``: more config."""
    http_port, grpc_port = free_port(), free_port()
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": http_port, "admission_wait_s": 5},
        "model": {"name": "specgate-demo", "target": str(MODELS / "demo-target")},
        "workers": {"count": 0, "poll_interval_s": 0.2, "remote": list(remote)},
        "epp": {"host": "127.0.0.1", "port": grpc_port},
        "policy": {"free_batch": 0, "max_step_drafts": 0},
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    path = log_dir / f"epp-{http_port}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = log_dir / f"epp-{http_port}.log"
    environ = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR" and not k.startswith("SPECGATE_")}
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "gateway.cli", "epp", "--config", str(path)], cwd=REPO,
                                   stdout=log, stderr=subprocess.STDOUT, env=environ)
    gateway = Gateway(process, http_port, path, log_path)
    try:
        wait_ok(process, gateway.url + "/health", 60, log_path)
    except RuntimeError:
        gateway.stop()
        raise
    return Epp(gateway, grpc_port)


# -- Envoy's side of the protocol -------------------------------------------------------------------
def headers_message(path: str, method: str = "POST", end_of_stream: bool = False,
                    extra: dict[str, str] | None = None, body_mode: str = "BUFFERED",
                    subset: Sequence[str] | None = None) -> ext_proc.ProcessingRequest:
    values = {":path": path, ":method": method, ":authority": "envoy", "content-type": "application/json",
              **(extra or {})}
    message = ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]),
        end_of_stream=end_of_stream))
    message.protocol_config.request_body_mode = ProcessingMode.BodySendMode.Value(body_mode)
    if subset is not None:
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
            {"x-gateway-destination-endpoint-subset": list(subset)})
    return message


def body_message(body: bytes, end_of_stream: bool = True) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=body, end_of_stream=end_of_stream))


def response_headers_message(status: int, content_type: str) -> ext_proc.ProcessingRequest:
    values = {":status": str(status), "content-type": content_type}
    return ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()])))


def response_body_message(body: bytes, end_of_stream: bool = False) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=body, end_of_stream=end_of_stream))


def completion_body(**fields: Any) -> bytes:
    return orjson.dumps({"model": "specgate-demo", "prompt": "hello", "max_tokens": 8, "temperature": 0, **fields})


class Exchange:
    """One ext_proc stream, message by message: ``send`` then ``receive`` what the picker answers."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._outbox: list[ext_proc.ProcessingRequest] = []
        self._queue: Any = None
        self._call: Any = None
        self._channel = channel

    async def __aenter__(self) -> Exchange:
        import asyncio

        queue: asyncio.Queue[ext_proc.ProcessingRequest | None] = asyncio.Queue()
        self._queue = queue

        async def messages() -> AsyncIterator[ext_proc.ProcessingRequest]:
            while (item := await queue.get()) is not None:
                yield item

        self._call = ext_proc_grpc.ExternalProcessorStub(self._channel).Process(messages())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def send(self, message: ext_proc.ProcessingRequest) -> None:
        await self._queue.put(message)

    async def receive(self, timeout_s: float = 30.0) -> ext_proc.ProcessingResponse:
        import asyncio

        response: ext_proc.ProcessingResponse = await asyncio.wait_for(self._call.read(), timeout_s)
        return response

    async def close(self) -> None:
        if self._call is not None and not self._call.done():
            await self._queue.put(None)
            self._call.cancel()


def header_values(mutation: ext_proc.HeaderMutation) -> dict[str, str]:
    return {o.header.key: (o.header.raw_value.decode() or o.header.value) for o in mutation.set_headers}
