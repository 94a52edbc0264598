"""Polling the event loop instead of sleeping around requests (``server.busy_poll_s``).

On virtual machines an idle CPU halts (or is given to another guest), and waking a process
that sleeps in ``epoll`` costs an interrupt and the halted CPU's return: about 43 µs each way
across the two CPUs of the machines this project is measured on (``python -m bench.wakeup``).
A request through the gateway sleeps twice: waiting for its worker, and waiting for the next
request. With ``busy_poll_s`` set, each request's arrival and end keep the loop polling (a
zero ``epoll`` timeout, one ``asyncio.sleep(0)`` a turn) for that long, so the worker's answer
finds the gateway awake; the loop sleeps again once nothing has come or ended for the span.
HAProxy's ``busy-polling`` trades the same way (the whole process, always). It costs a CPU
while requests come, so it is off by default: it suits a gateway with a core to itself, not
one sharing its cores with CPU workers (``make serve``). Measured: docs/relay-overhead.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from aiohttp import web


class BusyPoll:
    """Keeps the loop polling until ``window_s`` after the latest ``touch``."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._until = 0.0
        self._wake = asyncio.Event()
        self.polls = 0  # loop turns spent polling (tests, and what it cost)

    def touch(self, now: float) -> None:
        """A request arrived or ended at ``now`` (``time.monotonic``)."""
        self._until = now + self.window_s
        self._wake.set()  # a no-op while set; a touch while polling costs one empty turn after it

    async def run(self) -> None:
        sleep, clock = asyncio.sleep, time.monotonic
        while True:
            await self._wake.wait()
            self._wake.clear()
            while clock() < self._until:
                await sleep(0)  # one loop turn: epoll with a zero timeout, then every ready callback
                self.polls += 1

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        task = asyncio.create_task(self.run(), name="busy-poll")
        try:
            yield
        finally:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task


# In the app only with ``server.busy_poll_s`` > 0 (gateway/relay/app.py); the relay touches it.
BUSY_POLL_KEY = web.AppKey("busy_poll", BusyPoll)
