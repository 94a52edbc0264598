"""Replicas behind the real Envoy that share what a session knows through a real Redis.

- Two `specgate epp` replicas in Envoy's picker cluster: a session that fell back stays in
  fallback after the replica that built its estimate dies.
- Two `specgate serve` replicas behind Envoy's ring hash on X-Session-ID: the same, when the
  replica holding the session dies and the ring moves the session.
- A request that reaches the picker while no model server is ready waits for one, past
  Envoy's per-message timeout.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from bench.procs import free_port, start_sim_worker, stop
from gateway.epp.envoy_config import epp_bootstrap, ring_hash_bootstrap
from tests.e2e.envoy_harness import Envoy, Replica, start_envoy, start_replica
from tests.e2e.epp_harness import Epp, start_epp
from tests.e2e.redis_harness import RedisServer, start_redis

LOW = "plain; reason=low_acceptance"
# The sim accepts 20% of the drafts of [math] prompts, far below the floor.
SIM = {"time_scale": 0, "seed": 1, "acceptance": {"math": [[None, 0.2]], "chat": [[None, 0.85]]}}
# probe_every high: a fallen-back session's requests are all plain (no probe to allow for).
POLICY = {"num_speculative_tokens": 4, "min_proposals": 16, "acceptance_floor": 0.6, "acceptance_resume": 0.8,
          "probe_every": 1000}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def state(redis_server: RedisServer) -> dict[str, Any]:
    return {"backend": "redis", "redis_url": redis_server.url, "timeout_s": 5, "retry_s": 1}


def client(envoy: Envoy) -> openai.OpenAI:
    return openai.OpenAI(base_url=envoy.base_url, api_key="unused", max_retries=0, timeout=120)


def complete(envoy: Envoy, session: str, prompt: str = "[math] 2 + 2 =") -> tuple[str, str]:
    with client(envoy) as sdk:
        raw = sdk.completions.with_raw_response.create(model="specgate-demo", prompt=prompt, max_tokens=24,
                                                       temperature=0, extra_headers={"X-Session-ID": session})
        assert raw.http_response.status_code == 200
        return raw.headers["x-specgate-mode"], raw.headers.get("x-specgate-worker", "")


def drive_into_fallback(envoy: Envoy, session: str) -> None:
    modes = [complete(envoy, session)[0]]
    while modes[-1] != LOW:
        assert len(modes) < 20, modes
        modes.append(complete(envoy, session)[0])


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def picker_health(envoy: Envoy, epp: Epp) -> str:
    """Envoy's view of one picker: its health flags in /clusters ("healthy" when none)."""
    prefix = f"specgate-epp::127.0.0.1:{epp.grpc_port}::health_flags::"
    for line in envoy.admin("/clusters").splitlines():
        if line.startswith(prefix):
            return line[len(prefix):]
    return "absent"


def test_a_fallen_back_session_survives_the_loss_of_its_picker(tmp_path: Path, redis_server: RedisServer) -> None:
    processes: list[subprocess.Popen[bytes]] = []
    epps: list[Epp] = []
    envoy: Envoy | None = None
    try:
        ports = []
        for _ in range(2):
            process, port = start_sim_worker(tmp_path, SIM)
            processes.append(process)
            ports.append(port)
        remote = [{"url": f"http://127.0.0.1:{p}", "protocol": "specgate", "name": f"w{i}"}
                  for i, p in enumerate(ports)]
        epps = [start_epp(tmp_path, remote, policy=POLICY, state=state(redis_server)) for _ in range(2)]
        for epp in epps:
            epp.gateway.wait_workers_ready(2)
        envoy = start_envoy(epp_bootstrap(free_port(), free_port(), [("127.0.0.1", e.grpc_port) for e in epps]),
                            tmp_path / "envoy.log")
        # Envoy spreads the session's requests over both pickers: each reads what the other wrote.
        drive_into_fallback(envoy, "alice")
        builder = epps[0]
        record = builder.gateway.get_json("/admin/sessions/alice")
        assert record["low_acceptance"], record
        builder.gateway.process.kill()
        builder.gateway.process.wait()
        wait_for("Envoy to drop the dead picker", lambda: "failed" in picker_health(envoy, builder))
        # Envoy does not retry an ext_proc stream: for a moment after its health check fails,
        # a request may still be sent to the dead picker and fail (500 from Envoy, never a
        # wrong answer). docs/scale-out.md says so. Then every answer comes from the survivor.
        modes: list[str] = []
        while modes[-4:] != [LOW] * 4:
            assert len(modes) < 40, modes
            try:
                modes.append(complete(envoy, "alice")[0])
            except openai.InternalServerError:
                modes.append("500")
                time.sleep(0.2)
        assert set(modes) <= {LOW, "500"}, modes
        survivor = epps[1].gateway.get_json("/admin/sessions/alice")
        assert survivor["low_acceptance"] and survivor["evidence_drafted_tokens"] >= record["evidence_drafted_tokens"]
    finally:
        if envoy is not None:
            envoy.stop()
        for epp in epps:
            epp.stop()
        for process in processes:
            stop(process)


def test_ring_hash_replicas_share_a_session_through_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    replicas: list[Replica] = []
    envoy: Envoy | None = None
    try:
        for name in ("a", "b"):
            replicas.append(start_replica(tmp_path / name, SIM, policy=POLICY, state=state(redis_server)))
        envoy = start_envoy(ring_hash_bootstrap(free_port(), free_port(), [("127.0.0.1", r.port) for r in replicas]),
                            tmp_path / "envoy.log")
        drive_into_fallback(envoy, "bob")
        holders = [r for r in replicas if r.session_requests("bob") is not None]
        assert len(holders) == 1  # the ring keeps the session on one replica
        holder, other = holders[0], next(r for r in replicas if r is not holders[0])
        holder.kill()
        # The ring moves the session to the survivor, which reads its state from Redis.
        assert complete(envoy, "bob")[0] == LOW
        assert other.session_requests("bob") is not None
    finally:
        if envoy is not None:
            envoy.stop()
        for replica in replicas:
            replica.stop()


def test_a_request_waits_for_a_model_server_past_envoys_message_timeout(tmp_path: Path) -> None:
    port = free_port()  # the model server's, started only after the request is sent
    remote = [{"url": f"http://127.0.0.1:{port}", "protocol": "specgate", "name": "late"}]
    epp = start_epp(tmp_path, remote, policy=POLICY, server={"admission_wait_s": 30})
    envoy = start_envoy(epp_bootstrap(free_port(), free_port(), [("127.0.0.1", epp.grpc_port)],
                                      message_timeout_s=2.0), tmp_path / "envoy.log")
    worker: subprocess.Popen[bytes] | None = None
    result: list[Any] = []

    def request() -> None:
        try:
            result.append(complete(envoy, "patient", prompt="def add(a, b):"))
        except Exception as exc:  # reported by the assertion below
            result.append(exc)

    try:
        sender = threading.Thread(target=request)
        sender.start()
        wait_for("the request to wait", lambda: "specgate_admission_waiting 1.0" in epp.gateway.metrics())
        time.sleep(3.0)  # past Envoy's 2 s message timeout: only the picker's override keeps it
        worker, _ = start_sim_worker(tmp_path, SIM, port=port)
        sender.join(timeout=60)
        assert result and isinstance(result[0], tuple), result
        assert result[0] == ("speculative; k=4; reason=default", "late")
    finally:
        envoy.stop()
        epp.stop()
        if worker is not None:
            stop(worker)
