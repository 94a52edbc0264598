"""Worker crashes, client disconnects and overload, against real processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.harness import sdk_client, start_gateway, write_config

PROMPT = "class Config:\n    def __init__(self, path):\n        "


def test_killed_worker_is_restarted_and_its_sessions_move(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", workers={"count": 2, "restart_backoff_s": 0.2})
    gw = start_gateway(config, tmp_path)
    try:
        gw.wait_workers_ready(2)
        with sdk_client(gw) as client:
            first = client.completions.with_raw_response.create(
                model="specgate-demo", prompt=PROMPT, max_tokens=4, temperature=0,
                extra_headers={"X-Session-ID": "survivor"})
            victim = first.headers["X-Specgate-Worker"]
            pid = next(w["pid"] for w in gw.get_json("/admin/workers")["workers"] if w["worker_id"] == victim)
            os.kill(pid, signal.SIGKILL)
            # The session's next request is served, by the other worker, with no error.
            again = client.completions.with_raw_response.create(
                model="specgate-demo", prompt=PROMPT, max_tokens=4, temperature=0,
                extra_headers={"X-Session-ID": "survivor"})
            assert again.parse().choices[0].text
            assert again.headers["X-Specgate-Worker"] != victim
            assert gw.get_json("/admin/sessions/survivor")["worker"] != victim
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            worker = next(w for w in gw.get_json("/admin/workers")["workers"] if w["worker_id"] == victim)
            if worker["status"] == "ready" and worker["pid"] != pid:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"{victim} was not restarted:\n{gw.log()}")
        assert worker["restarts"] == 1
        assert gw.metric("specgate_worker_restarts_total", worker=victim) == 1
    finally:
        gw.stop()


async def test_client_disconnect_aborts_the_sequence(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", workers={"count": 1})
    gw = await asyncio.to_thread(start_gateway, config, tmp_path)
    try:
        body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.base_url + "/completions", json=body) as response:
                assert response.status == 200
                await response.content.readline()  # the first chunk has arrived
            # Connection dropped mid-stream. The worker must free the slot long before 900 tokens.
            deadline = time.monotonic() + 10
            depth = -1
            while time.monotonic() < deadline:
                async with http.get(gw.url + "/admin/workers") as admin:
                    worker = (await admin.json())["workers"][0]
                depth = worker["batch_depth"] if worker["in_flight"] == 0 else -1
                if depth == 0:
                    break
                await asyncio.sleep(0.1)
            assert depth == 0, worker
            assert worker["stats"]["emitted_tokens"] < 900
    finally:
        gw.stop()


async def test_overload_answers_429_with_retry_after(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", workers={"count": 1, "max_slots": 1, "max_queue": 1})
    gw = await asyncio.to_thread(start_gateway, config, tmp_path)
    try:
        body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 64, "temperature": 0}

        async def one(http: aiohttp.ClientSession) -> tuple[int, str | None, dict[str, object]]:
            async with http.post(gw.base_url + "/completions", json=body) as response:
                return response.status, response.headers.get("Retry-After"), json.loads(await response.read())

        async with aiohttp.ClientSession() as http:
            results = await asyncio.gather(*(one(http) for _ in range(8)))
        statuses = [status for status, _, _ in results]
        assert 200 in statuses and 429 in statuses, statuses
        assert set(statuses) <= {200, 429}
        for status, retry_after, payload in results:
            if status == 429:
                assert retry_after is not None and int(retry_after) >= 1
                assert payload["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    finally:
        gw.stop()


@pytest.mark.slow
def test_hung_worker_is_killed_and_restarted(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", workers={"count": 1, "unhealthy_restart_s": 1.0})
    gw = start_gateway(config, tmp_path)
    try:
        (worker,) = gw.get_json("/admin/workers")["workers"]
        pid = worker["pid"]
        os.kill(pid, signal.SIGSTOP)  # alive, but answers nothing
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            (worker,) = gw.get_json("/admin/workers")["workers"]
            if worker["status"] == "ready" and worker["pid"] != pid:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"hung worker was not replaced:\n{gw.log()}")
        assert worker["restarts"] == 1
        assert "unresponsive" in gw.log()
        with sdk_client(gw) as client:
            assert client.completions.create(model="specgate-demo", prompt=PROMPT, max_tokens=4).choices[0].text
    finally:
        gw.stop()


def test_workers_die_with_a_killed_gateway(tmp_path: Path) -> None:
    """kill -9 of the gateway leaves no worker behind (each local worker asks the kernel for
    SIGTERM when its parent dies; a worker's own helpers share its process group)."""
    gw = start_gateway(write_config(tmp_path / "config.yaml"), tmp_path)
    try:
        gw.wait_workers_ready(1)
        (worker,) = gw.get_json("/admin/workers")["workers"]
        pid = worker["pid"]
        assert os.getpgid(pid) == pid  # its own process group
        gw.process.send_signal(signal.SIGKILL)
        gw.process.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.2)
        assert not _running(pid), f"worker {pid} outlived its gateway"
    finally:
        gw.stop()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
