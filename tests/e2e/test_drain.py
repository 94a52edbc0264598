"""Graceful drain on SIGTERM: no new work, in-flight requests finish or end with a clear shutdown
error at the deadline, the workers stop, the gateway exits 0 and leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.procs import sse_data
from tests.e2e.harness import start_gateway, write_config

PROMPT = "import os\n\n\ndef walk(root):\n    "
DRAIN_S = 6.0


async def _stream(http: aiohttp.ClientSession, url: str, max_tokens: int, first: asyncio.Event) -> dict[str, Any]:
    body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    outcome: dict[str, Any] = {"text": "", "done": False, "errors": []}
    async with http.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200
        async for data in sse_data(response):
            if data == "[DONE]":
                outcome["done"] = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                outcome["errors"].append(chunk["error"])
                outcome["ended_at"] = time.monotonic()
                continue
            outcome["text"] += chunk["choices"][0]["text"] if chunk["choices"] else ""
            first.set()
    return outcome


async def _whole(http: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[int, dict[str, Any]]:
    body = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    async with http.post(url + "/v1/completions", json=body) as response:
        return response.status, await response.json()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
async def test_sigterm_drains_then_ends_what_runs_on_with_a_shutdown_error(tmp_path: Path) -> None:
    # A sim worker at twice its modelled 70B step times: 900 tokens take well over DRAIN_S on any
    # CPU (the embedded engine finished them inside the drain on a fast enough one), 3 take
    # a fraction of a second. Drain is the gateway's; the engine behind it does not matter.
    config = write_config(tmp_path / "config.yaml", workers={"count": 1, "engine": "sim", "sim": {"time_scale": 2.0}},
                          server={"drain_timeout_s": DRAIN_S})
    gw = await asyncio.to_thread(start_gateway, config, tmp_path)
    try:
        worker_pids = [w["pid"] for w in (await asyncio.to_thread(gw.get_json, "/admin/workers"))["workers"]]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            long_first, short_first = asyncio.Event(), asyncio.Event()
            long_stream = asyncio.create_task(_stream(http, gw.url, 900, long_first))
            long_whole = asyncio.create_task(_whole(http, gw.url, 900))
            await asyncio.wait_for(long_first.wait(), 120)
            short_stream = asyncio.create_task(_stream(http, gw.url, 3, short_first))
            await asyncio.wait_for(short_first.wait(), 120)
            gw.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            # 1) no new work: /ready and new completions answer 503 with Retry-After
            await asyncio.sleep(0.5)
            async with http.get(gw.url + "/ready") as ready:
                assert ready.status == 503
            async with http.post(gw.url + "/v1/completions", json={"model": "specgate-demo", "prompt": "x"}) as new:
                assert new.status == 503 and int(new.headers["Retry-After"]) >= 1
                assert (await new.json())["error"]["code"] == "server_shutting_down"
            # 2) what can finish within the drain timeout finishes
            short = await short_stream
            assert short["done"] and not short["errors"]
            # 3) what cannot ends at the deadline with a clear shutdown error, never a cut stream
            outcome = await long_stream
            assert not outcome["done"] and outcome["text"], outcome
            assert [e["code"] for e in outcome["errors"]] == ["server_shutting_down"], outcome
            assert outcome["ended_at"] - signalled >= DRAIN_S - 0.5
            status, payload = await long_whole
            assert status == 503 and payload["error"]["code"] == "server_shutting_down"
        # 4) the workers stop and the gateway exits 0, leaving no process behind
        returncode = await asyncio.to_thread(gw.process.wait, 60)
        assert returncode == 0, gw.log()
        # The gateway waited for its workers before it exited: none is left running.
        assert worker_pids and not any(_alive(pid) for pid in worker_pids)
        assert "draining:" in gw.log() and "drained; stopping" in gw.log()
    finally:
        gw.stop()
