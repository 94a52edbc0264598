"""Graceful shutdown: on SIGTERM (or SIGINT) the gateway drains before it stops.

1. It stops taking new work: ``/ready`` answers 503 and new completions get 503 with
   ``Retry-After``, so a load balancer moves traffic elsewhere.
2. Requests in flight get ``server.drain_timeout_s`` to finish.
3. Those still running then end with a clear error: a stream gets an SSE error event saying
   the server is shutting down, a non-streaming request a 503 error object.
4. Then the app's cleanup runs: the workers are stopped and the process exits 0.

A second signal cuts the wait short (step 3 at once). ``workers/api/web_runner.py`` calls
``Drain.drain`` between the signal and the cleanup, while the listener still answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

from aiohttp import web

from gateway.observe.ops_metrics import OpsMetrics
from workers.api.errors import Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")
ABORT_GRACE_S = 10.0  # requests ended at the deadline finish writing their error within this
RETRY_AFTER_S = 5.0


class ShuttingDown(Unavailable):
    """The gateway is shutting down: retry elsewhere (a 503, or an SSE error event mid-stream)."""

    def __init__(self, message: str = "the server is shutting down; retry the request") -> None:
        super().__init__(message, code="server_shutting_down", retry_after_s=RETRY_AFTER_S)


class Abortable(Protocol):
    def abort_for_shutdown(self) -> None:
        """Ends the request's worker stream so that the client gets ``ShuttingDown``."""


@dataclass(eq=False)
class InFlight:
    """One request the drain waits for; ``stream`` is set once its worker stream is open."""

    stream: Abortable | None = None


class Drain:
    def __init__(self, timeout_s: float, ops: OpsMetrics) -> None:
        self.timeout_s = timeout_s
        self.ops = ops
        self.draining = False
        self._active: set[InFlight] = set()
        self._guarded: set[asyncio.Task[object]] = set()  # tasks inside guard(): the deadline cancels them
        self._cut: set[asyncio.Task[object]] = set()  # of them, those it cancelled
        self._idle = asyncio.Event()
        self._idle.set()
        self._expired = asyncio.Event()  # the deadline passed (or a second signal came)

    @property
    def expired(self) -> bool:
        return self._expired.is_set()

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def refuse(self) -> ShuttingDown:
        self.ops.shutdown_refusals.inc()
        return ShuttingDown()

    @contextlib.contextmanager
    def track(self) -> Iterator[InFlight]:
        """Holds one request in flight; refuses it with 503 once draining has begun."""
        if self.draining:
            raise self.refuse()
        entry = InFlight()
        self._active.add(entry)
        self._idle.clear()
        try:
            yield entry
        finally:
            self._active.discard(entry)
            if not self._active:
                self._idle.set()

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``, unless the drain deadline passes first: then ``ShuttingDown``.

        The deadline cancels the calling task where it waits (``_expire``), and the cancellation
        becomes ``ShuttingDown`` here; any other cancellation (the client left) goes on as one.
        Awaited in the caller's own task: racing it in a task of its own against a task waiting
        for the deadline cost two tasks and an ``asyncio.wait`` per request (bench.overhead)."""
        if self.expired:
            raise self.refuse()
        task = asyncio.current_task()
        if task is None:  # not in a task (nothing here calls it so): nothing to cancel
            return await awaitable
        self._guarded.add(task)
        try:
            return await awaitable
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            raise self.refuse() from None
        finally:
            self._guarded.discard(task)
            if task in self._cut:
                self._cut.discard(task)
                task.uncancel()  # the deadline's cancellation ends here, whether or not it landed

    async def sleep(self, seconds: float) -> None:
        """Sleeps, waking early when the deadline passes."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._expired.wait(), seconds)

    def hurry(self) -> None:
        """A second signal: end what is still running now."""
        if self.draining:
            self._expire()

    def _expire(self) -> None:
        if self.expired:
            return
        self._expired.set()
        if self._active:
            log.warning("drain: ending %d requests still in flight with a shutdown error", len(self._active))
        for entry in list(self._active):
            if entry.stream is not None:
                self.ops.shutdown_refusals.inc()
                entry.stream.abort_for_shutdown()
        for task in list(self._guarded):
            self._cut.add(task)
            task.cancel("the drain deadline passed")

    async def drain(self) -> None:
        """Steps 1-3; returns when nothing is in flight (or after a bounded grace)."""
        self.draining = True
        self.ops.draining.set(1)
        log.info("draining: %d requests in flight, up to %gs to finish", len(self._active), self.timeout_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wait_idle_or_expired(), self.timeout_s)
        self._expire()
        try:
            await asyncio.wait_for(self._idle.wait(), ABORT_GRACE_S)
        except TimeoutError:
            log.error("drain: %d requests did not end within %gs of the deadline", len(self._active), ABORT_GRACE_S)
        log.info("drained; stopping")

    async def _wait_idle_or_expired(self) -> None:
        idle = asyncio.ensure_future(self._idle.wait())
        expired = asyncio.ensure_future(self._expired.wait())
        try:
            await asyncio.wait({idle, expired}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            expired.cancel()


DRAIN_KEY = web.AppKey("drain", Drain)
