"""``specgate epp``: the gateway as the endpoint picker of an Envoy inference gateway.

Envoy asks, over the ext_proc gRPC protocol, which model server takes each request (the
Kubernetes Gateway API Inference Extension's endpoint-picker protocol); the picker answers with
the same session table, policy, routing and metrics as ``specgate serve``
(gateway/epp/exchange.py). The gRPC server runs beside the gateway's aiohttp app, which keeps
serving ``/metrics``, ``/health``, ``/ready`` and ``/admin`` on ``server.port``; it starts in a
cleanup context and stops after it yields. gRPC health answers for liveness (the empty
service name and ``liveness``), for the ext_proc service, and for ``readiness``, which serves
until the picker drains for shutdown (a picker without a ready model server still takes
requests: they wait for one, as behind the relay).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import socket
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from gateway.auth import AUTH_KEY, AuthStore
from gateway.epp.exchange import Exchange
from gateway.relay.drain import DRAIN_KEY
from gateway.state import STATE_KEY, GatewayState

log = logging.getLogger(__name__)
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
RESOLVE_EVERY_S = 30.0  # model servers' names (a StatefulSet's pod DNS) are looked up again this often
HEALTH_EVERY_S = 0.5
OVERRIDE_MARGIN_S = 5.0  # beyond the admission wait, for the pick and the answer to reach Envoy


class EppMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("specgate_epp_requests_total", "Requests Envoy asked the endpoint picker about, by "
                                "outcome (picked, refused: the client's fault, unavailable: no endpoint, shed: "
                                "every endpoint's queue full)", ["outcome"], registry=registry)
        self.messages = Counter("specgate_epp_messages_total", "ext_proc messages Envoy sent the endpoint picker, "
                                "by phase (request_headers, request_body, request_trailers, response_headers, "
                                "response_body, response_trailers)", ["phase"], registry=registry)
        self.by_phase = {phase: self.messages.labels(phase=phase) for phase in (
            "request_headers", "request_body", "request_trailers", "response_headers", "response_body",
            "response_trailers")}


class Picker(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, state: GatewayState, auth: AuthStore, metrics: EppMetrics) -> None:
        self.state, self.auth, self.metrics = state, auth, metrics
        self.endpoints: dict[str, str] = {}  # worker id -> ip:port

    async def Process(self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
                      context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[ext_proc.ProcessingResponse]:
        exchange = Exchange(self.state, self.auth, self.endpoints, self.state.config.epp.max_body_bytes)
        try:
            async for message in request_iterator:
                phase = self.metrics.by_phase.get(message.WhichOneof("request") or "")
                if phase is not None:
                    phase.inc()
                if exchange.picks_on(message) and not self.state.fleet.ready_count():
                    # The pick will wait for a model server (server.admission_wait_s): Envoy's
                    # per-message timeout must not end the request first. Envoy caps it at the
                    # filter's max_message_timeout.
                    wait_s = self.state.config.server.admission_wait_s + OVERRIDE_MARGIN_S
                    yield ext_proc.ProcessingResponse(override_message_timeout=Duration(seconds=math.ceil(wait_s)))
                for response in await exchange.handle(message):
                    yield response
        finally:  # the response ended, Envoy closed the stream, or the client left
            exchange.finish()
            self.metrics.requests.labels(outcome=exchange.outcome).inc()

    async def resolve(self) -> None:
        """Each remote worker's ``ip:port``, as Envoy's ORIGINAL_DST cluster needs it."""
        loop = asyncio.get_running_loop()
        for handle in self.state.fleet.workers.values():
            parts = urlsplit(handle.base_url)
            host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
            try:
                ip = str(ipaddress.ip_address(host))
            except ValueError:
                try:
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                except OSError as exc:
                    log.warning("cannot resolve %s (%s): %s", handle.worker_id, host, exc)
                    continue
                ip = str(infos[0][4][0])
            self.endpoints[handle.worker_id] = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


PICKER_KEY = web.AppKey("epp_picker", Picker)


def add_endpoint_picker(app: web.Application) -> None:
    """Makes ``app`` (from ``create_app``) the endpoint picker too: its gRPC server in a cleanup context."""
    state = app[STATE_KEY]
    app[PICKER_KEY] = Picker(state, app[AUTH_KEY], EppMetrics(state.metrics.registry))
    app.cleanup_ctx.append(_grpc_server)


async def _grpc_server(app: web.Application) -> AsyncIterator[None]:
    picker, config = app[PICKER_KEY], app[STATE_KEY].config.epp
    await picker.resolve()
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    address = f"{config.host}:{config.port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"epp: cannot listen on {address}")
    await server.start()
    for name in ("", "liveness", EXT_PROC_SERVICE):
        await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
    tasks = [asyncio.create_task(_readiness(app, checks), name="epp-readiness"),
             asyncio.create_task(_resolving(picker), name="epp-resolve")]
    log.info("endpoint picker (ext_proc) listening on %s", address)
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await server.stop(grace=1.0)


async def _readiness(app: web.Application, checks: health.aio.HealthServicer) -> None:
    # Ready while the picker is up and not draining, with or without a ready model server: a
    # picker holds requests until one is (server.admission_wait_s), which beats Envoy failing
    # them at once for want of a ready picker.
    drain, serving = app[DRAIN_KEY], None
    while True:
        ready = not drain.draining
        if ready != serving:
            serving = ready
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            await checks.set("readiness", status)
        await asyncio.sleep(HEALTH_EVERY_S)


async def _resolving(picker: Picker) -> None:
    while True:
        await asyncio.sleep(RESOLVE_EVERY_S)
        await picker.resolve()
