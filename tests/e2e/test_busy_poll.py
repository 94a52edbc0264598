"""``server.busy_poll_s`` (gateway/relay/busy_poll.py): the loop polls around requests, never while idle."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from gateway.config.config import ConfigError, parse_config
from gateway.relay.busy_poll import BusyPoll
from tests.e2e.harness import sdk_client, start_gateway, write_config


async def test_the_poller_polls_for_its_window_after_each_touch_then_sleeps() -> None:
    poll = BusyPoll(0.05)
    async with poll.running():
        await asyncio.sleep(0.05)
        assert poll.polls == 0  # never touched: asleep
        poll.touch(time.monotonic())
        await asyncio.sleep(0.02)  # the sleep itself is a turn the poller shares
        assert poll.polls > 0
        await asyncio.sleep(0.1)
        after_window = poll.polls
        await asyncio.sleep(0.1)
        assert poll.polls == after_window  # the window passed: asleep again
        poll.touch(time.monotonic())
        await asyncio.sleep(0.02)
        assert poll.polls > after_window
    # Stopped with its context: no task left behind.
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "busy-poll"]


def test_busy_poll_s_is_checked(tmp_path: Path) -> None:
    assert parse_config({}, tmp_path).server.busy_poll_s == 0
    assert parse_config({"server": {"busy_poll_s": 0.002}}, tmp_path).server.busy_poll_s == 0.002
    for bad in (-0.001, 2, "fast"):
        with pytest.raises(ConfigError, match=r"server\.busy_poll_s"):
            parse_config({"server": {"busy_poll_s": bad}}, tmp_path)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_polling_gateway_serves_requests_and_is_idle_between_them(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", server={"busy_poll_s": 0.05},
                          workers={"count": 1, "engine": "sim", "sim": {"time_scale": 0.0}})
    gateway = start_gateway(config, tmp_path)
    try:
        gateway.wait_workers_ready(1)
        with sdk_client(gateway) as client:
            answer = client.completions.create(model="specgate-demo", prompt="[chat] hi", max_tokens=4)
            assert answer.usage is not None and answer.usage.completion_tokens == 4
            chunks = client.completions.create(model="specgate-demo", prompt="[chat] hi", max_tokens=4, stream=True)
            assert sum(len(chunk.choices) for chunk in chunks) >= 4
        time.sleep(0.3)  # past the window (and the gateway's own start-up work)
        before = _cpu_s(gateway.process.pid)
        time.sleep(1.0)
        # A poller left running would take the whole second; an idle gateway takes almost none.
        assert _cpu_s(gateway.process.pid) - before < 0.3
    finally:
        gateway.stop()
