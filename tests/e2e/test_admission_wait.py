"""While no worker is ready, a request waits for one (``server.admission_wait_s``), a bounded
number at a time (``server.admission_queue``): real gateways whose only worker is a remote
specgate worker that is not up (yet), real clients. Outcomes are asserted, never durations."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from bench.procs import free_port, wait_ok
from gateway.admission import NoWorkerReady, pick_ready
from gateway.config.config import parse_config
from gateway.fleet.fleet import Fleet
from gateway.fleet.handle import WorkerHandle
from gateway.fleet.worker_http import Endpoint, WorkerHttp
from gateway.observe.metrics import GatewayMetrics
from gateway.policy_store import PolicyStore
from gateway.sessions.table import SessionTable
from gateway.state import GatewayState
from tests.e2e.harness import MODELS, REPO, TEST_COST_BUDGET_S, Gateway, cost_cache_dir, write_config
from workers.api.errors import ClientDisconnected
from workers.api.request_parser import parse_request
from workers.api.wire import CompletionRequest

PROMPT = "def fib(n):\n    "
BODY = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
WAITS = "specgate_admission_waits_total"


def start_unready_gateway(tmp_path: Path, worker_port: int, **server: Any) -> Gateway:
    """A gateway whose one worker is a remote specgate worker on ``worker_port``, which may not
    be up: it waits for ``/health``, as ``/ready`` says 503 until a worker is."""
    config = write_config(tmp_path / f"config-{worker_port}.yaml", server=server,
                          workers={"count": 0, "remote": [{"url": f"http://127.0.0.1:{worker_port}",
                                                           "protocol": "specgate", "name": "remote"}]})
    port = free_port()
    log_path = tmp_path / f"gateway-{port}.log"
    environ = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR" and not k.startswith("SPECGATE_")}
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(config), "--port", str(port)],
                                   cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=environ)
    gateway = Gateway(process, port, config, log_path)
    try:
        wait_ok(process, gateway.url + "/health", 60, log_path)
    except RuntimeError:
        gateway.stop()
        raise
    return gateway


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[Callable[..., Gateway]]:
    started: list[Gateway] = []

    def start(worker_port: int, **server: Any) -> Gateway:
        gateway = start_unready_gateway(tmp_path, worker_port, **server)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


def wait_for(what: Callable[[], bool], gateway: Gateway, timeout_s: float = 60.0) -> None:
    """Polls until ``what`` holds (a generous bound: only a broken gateway reaches it)."""
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s}s:\n{gateway.log()[-3000:]}")
        time.sleep(0.05)


def ready_status(gateway: Gateway) -> int:
    try:
        gateway.get_json("/ready")
    except urllib.error.HTTPError as exc:
        return exc.code
    return 200


def client(gateway: Gateway, timeout_s: float = 300.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=timeout_s)


def send_raw(gateway: Gateway) -> socket.socket:
    """A completion request on a plain socket, left unanswered: closing it is the client leaving."""
    body = json.dumps(BODY).encode()
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def start_worker(port: int, log_dir: Path) -> subprocess.Popen[bytes]:
    """The remote specgate worker, on the port the gateway was told (``python -m workers --port N``)."""
    log_path = log_dir / f"worker-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "workers", "--worker-id", "remote", "--port", str(port),
             "--target", str(MODELS / "demo-target"), "--draft", str(MODELS / "demo-draft"),
             "--cost-cache-dir", str(cost_cache_dir()), "--cost-budget-s", str(TEST_COST_BUDGET_S)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return process


# -- end to end ------------------------------------------------------------------------------------------------
def test_requests_sent_before_the_worker_starts_are_served(gateways: Callable[..., Gateway], tmp_path: Path) -> None:
    worker_port = free_port()
    gateway = gateways(worker_port, admission_wait_s=600)
    assert ready_status(gateway) == 503  # /ready keeps its meaning while requests wait

    def streamed() -> str:
        with client(gateway) as sdk:
            stream = sdk.completions.create(model="specgate-demo", prompt=PROMPT, max_tokens=8, temperature=0,
                                            stream=True)
            return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    def whole() -> str:
        with client(gateway) as sdk:
            return sdk.completions.create(model="specgate-demo", prompt=PROMPT, max_tokens=8, temperature=0,
                                          ).choices[0].text

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(streamed), pool.submit(whole)]
        wait_for(lambda: gateway.metric("specgate_admission_waiting") == 2, gateway)
        assert not any(f.done() for f in futures)
        worker = start_worker(worker_port, tmp_path)
        try:
            texts = [f.result(timeout=600) for f in futures]
        finally:
            worker.send_signal(signal.SIGINT)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    assert all(texts), texts
    assert gateway.metric(WAITS, result="served") == 2
    assert gateway.metric(WAITS) == 2
    assert gateway.metric("specgate_admission_wait_seconds_count") == 2
    assert gateway.metric("specgate_admission_waiting") == 0


def test_no_worker_within_the_wait_is_a_503_with_retry_after(gateways: Callable[..., Gateway]) -> None:
    gateway = gateways(free_port(), admission_wait_s=0.3)  # nothing listens there
    with client(gateway) as sdk:
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as caught:
                sdk.completions.create(model="specgate-demo", prompt=PROMPT, max_tokens=8, stream=stream)
            assert caught.value.status_code == 503
            assert caught.value.response.headers.get("Retry-After")
            assert "no worker is ready" in caught.value.message
    assert gateway.metric(WAITS, result="timeout") == 2
    assert gateway.metric("specgate_admission_wait_seconds_count") == 2
    assert ready_status(gateway) == 503


def test_a_full_queue_is_refused_at_once_and_a_client_that_leaves_frees_its_slot(
        gateways: Callable[..., Gateway]) -> None:
    gateway = gateways(free_port(), admission_wait_s=600, admission_queue=1, drain_timeout_s=0.5)
    first = send_raw(gateway)
    try:
        wait_for(lambda: gateway.metric("specgate_admission_waiting") == 1, gateway)
        with client(gateway) as sdk, pytest.raises(openai.InternalServerError) as caught:
            sdk.completions.create(model="specgate-demo", prompt=PROMPT, max_tokens=8)
        assert caught.value.status_code == 503 and caught.value.code == "admission_queue_full"
        assert caught.value.response.headers.get("Retry-After")
        assert gateway.metric(WAITS, result="queue_full") == 1
        assert gateway.metric("specgate_admission_waiting") == 1  # the first still waits
    finally:
        first.close()  # the client leaves
    wait_for(lambda: gateway.metric(WAITS, result="client_gone") == 1, gateway)
    assert gateway.metric("specgate_admission_waiting") == 0
    # Its slot is free: the next request waits rather than being refused...
    last = send_raw(gateway)
    try:
        wait_for(lambda: gateway.metric("specgate_admission_waiting") == 1, gateway)
        assert gateway.metric(WAITS, result="queue_full") == 1
        # ...until the gateway drains for shutdown: past the drain deadline it gets the shutdown error.
        gateway.process.send_signal(signal.SIGTERM)
        answer = b""
        while chunk := last.recv(65536):
            answer += chunk
            if b"}}" in answer:
                break
    finally:
        last.close()
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert b"server_shutting_down" in answer and b"Retry-After" in answer, answer
    assert gateway.process.wait(timeout=60) == 0


# -- pick_ready alone --------------------------------------------------------------------------------------------
def unit_state(**server: Any) -> GatewayState:
    config = parse_config({"server": server, "workers": {"count": 0, "remote": [
        {"url": "http://127.0.0.1:9", "protocol": "specgate", "name": "remote"}]}}, REPO)
    metrics = GatewayMetrics.create(config.model.name)
    store = PolicyStore(config.policy, None, metrics)
    return GatewayState(config, metrics, SessionTable(config.sessions), store, Fleet(config, metrics, lambda _: None))


def request() -> CompletionRequest:
    return parse_request("completion", dict(BODY))


def waits(state: GatewayState, result: str) -> float:
    return state.metrics.registry.get_sample_value(WAITS, {"result": result}) or 0.0


async def test_pick_ready_ends_its_wait_when_the_client_leaves_or_the_task_is_cancelled() -> None:
    state = unit_state(admission_wait_s=600, admission_queue=1)
    session = state.sessions.touch("s", 0.0)
    policy = state.policy.active
    left = False
    waiting = asyncio.create_task(pick_ready(state, session, request(), policy, gone=lambda: left))
    await asyncio.sleep(0)  # the task runs to its wait
    assert state.fleet.waiting == 1
    with pytest.raises(NoWorkerReady, match="admission_queue"):  # the queue (one) is full
        await pick_ready(state, session, request(), policy)
    left = True
    with pytest.raises(ClientDisconnected):
        await waiting
    assert state.fleet.waiting == 0 and waits(state, "client_gone") == 1 and waits(state, "queue_full") == 1

    cancelled = asyncio.create_task(pick_ready(state, session, request(), policy))
    await asyncio.sleep(0)  # the task runs to its wait
    assert state.fleet.waiting == 1
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert state.fleet.waiting == 0 and waits(state, "cancelled") == 1


async def test_pick_ready_wakes_when_a_worker_becomes_ready_and_refuses_at_once_with_no_wait() -> None:
    state = unit_state(admission_wait_s=600)
    session = state.sessions.touch("s", 0.0)
    policy = state.policy.active
    async with aiohttp.ClientSession() as http:
        handle = WorkerHandle("remote", "http://127.0.0.1:9", http, WorkerHttp(Endpoint.from_url("http://127.0.0.1:9")),
                              frozenset({"speculative", "plain"}), 4, remote=True, status="unhealthy")
        state.fleet.workers = {"remote": handle}
        waiting = asyncio.create_task(pick_ready(state, session, request(), policy))
        await asyncio.sleep(0)
        assert state.fleet.waiting == 1
        state.fleet.probe.became_ready(handle)
        placed = await waiting
        assert placed.handle is handle and placed.decision.mode in ("speculative", "plain")
        assert waits(state, "served") == 1 and state.fleet.waiting == 0
        handle.http.close()
    refusing = unit_state(admission_wait_s=0)
    with pytest.raises(NoWorkerReady, match="no worker is ready"):
        await pick_ready(refusing, refusing.sessions.touch("s", 0.0), request(), refusing.policy.active)
    assert sum(waits(refusing, r) for r in ("served", "timeout", "queue_full", "client_gone", "cancelled")) == 0
