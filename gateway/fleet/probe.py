"""Probing the workers: each one's health and load, polled, and what the polls decide: which
workers are ready (routable), and when a request waiting for one may pick again.

Every worker, local or remote, has a poll task. A specgate worker answers ``/specgate/worker``
(its cost model, its depth, and a remote one's modes and max K); any other server ``/health``,
and a vLLM server's depth comes from its own Prometheus gauges. A ready worker that fails a poll
is down until one succeeds (its sessions move on their next request); a local process alive but
unresponsive for ``workers.unhealthy_restart_s`` is killed, and its supervisor (supervisor.py)
restarts it like any crashed worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import orjson

from gateway.config.config import GatewayConfig
from gateway.fleet.handle import WorkerHandle, WorkerStatus
from gateway.llamacpp import read_depth
from gateway.observe.metrics import GatewayMetrics
from policies import MAX_TREE_NODES, METHODS, CostModel, Method

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 2.0


class Probe:
    """The workers' health and load, and their readiness: the one place a status turns ready or down."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics, workers: Mapping[str, WorkerHandle],
                 on_worker_down: Callable[[str], None]) -> None:
        self.config = config
        self.metrics = metrics
        self.workers = workers  # the fleet's: a new worker's precision is compared with the others'
        self.on_worker_down = on_worker_down
        # Set, and replaced by a fresh one, whenever a worker becomes ready: it wakes the requests
        # waiting for one (gateway/admission.py ``pick_ready``).
        self._ready_event = asyncio.Event()

    # -- readiness ----------------------------------------------------------------------------------
    def became_ready(self, handle: WorkerHandle) -> None:
        handle.status = "ready"
        self.metrics.worker_up.labels(model=self.metrics.model, worker=handle.worker_id).set(1)
        # Wakes every request waiting now; later ones wait on the fresh event.
        woken, self._ready_event = self._ready_event, asyncio.Event()
        woken.set()

    def mark_down(self, handle: WorkerHandle, status: WorkerStatus) -> None:
        was_ready = handle.status == "ready"
        handle.status = status
        self.metrics.worker_up.labels(model=self.metrics.model, worker=handle.worker_id).set(0)
        if was_ready:
            self.on_worker_down(handle.worker_id)

    def report_failure(self, handle: WorkerHandle, error: str) -> None:
        """A request could not reach the worker: stop routing to it until a poll succeeds."""
        handle.last_error = error
        if handle.status == "ready":
            self.mark_down(handle, "unhealthy")

    async def wait_ready(self, timeout_s: float) -> bool:
        """Waits until a worker becomes ready, at most ``timeout_s``; whether one did. The
        worker may not suit the waiter (a resume needs specgate's protocol): it picks again."""
        event = self._ready_event
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            return False
        return True

    # -- polling ------------------------------------------------------------------------------------
    async def poll(self, handle: WorkerHandle) -> None:
        """The worker's poll, every ``workers.poll_interval_s`` until cancelled; a local worker's
        supervisor owns its status while it starts or restarts."""
        interval = self.config.workers.poll_interval_s
        hung_after = self.config.workers.unhealthy_restart_s
        unhealthy_since: float | None = None
        while True:
            await asyncio.sleep(interval)
            if handle.status in ("starting", "restarting"):
                unhealthy_since = None
                continue
            if await self.check(handle):
                unhealthy_since = None
                if handle.status != "ready":
                    self.became_ready(handle)
            else:
                unhealthy_since = self._failed_poll(handle, unhealthy_since, hung_after)

    def _failed_poll(self, handle: WorkerHandle, unhealthy_since: float | None, hung_after: float) -> float | None:
        """A poll the worker failed: down if it was ready, killed if it is a local process hung
        for ``hung_after``; when it has been unhealthy since (None: a restart starts afresh)."""
        if handle.status == "ready":
            log.warning("%s failed its health check: %s", handle.worker_id, handle.last_error)
            self.mark_down(handle, "unhealthy")
        unhealthy_since = unhealthy_since or time.monotonic()
        process = handle.process
        # A local process that is alive but does not answer is hung: kill it, and the
        # supervisor restarts it like any crashed worker.
        if (process is not None and process.returncode is None
                and time.monotonic() - unhealthy_since > hung_after):
            log.warning("%s unresponsive for %.0fs; killing pid %d", handle.worker_id, hung_after, process.pid)
            process.kill()
            return None
        return unhealthy_since

    async def check(self, handle: WorkerHandle) -> bool:
        """One health check, reading what the worker says about itself; whether it passed."""
        path = "/specgate/worker" if handle.speaks_specgate else "/health"
        try:
            async with handle.client.get(handle.base_url + path,
                                         timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    handle.last_error = f"{path} answered {resp.status}"
                    return False
                handle.last_error = ""
                if handle.speaks_specgate:
                    self._read_worker_info(handle, await resp.json(loads=_loads))
            if handle.protocol == "vllm":
                await self._read_vllm_depth(handle)
            elif handle.protocol == "llamacpp":
                await self._read_llamacpp_depth(handle)
            return True
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            handle.last_error = f"{path}: {exc.__class__.__name__}: {exc}"
            return False

    def _read_worker_info(self, handle: WorkerHandle, info: Any) -> None:
        """What a specgate worker's ``/specgate/worker`` says: its cost model and depth, and a
        remote one's modes and max K."""
        handle.info = info
        handle.cost = self._cost_model(handle, info.get("cost_model"))
        handle.reported_depth = int(info.get("batch_depth", 0)) + int(info.get("queue_length", 0))
        handle.in_flight_at_report = handle.in_flight
        handle.tree_max_nodes = _tree_max_nodes(info.get("tree_max_nodes"))
        handle.methods = _methods(info.get("methods"), handle.max_k)
        handle.shadow_lookup = info.get("shadow_lookup") is True
        cache = info.get("prefix_cache")
        handle.prefix_cache = cache if isinstance(cache, bool) else None
        if handle.remote:
            handle.modes = frozenset(m for m in info.get("modes", []) if m in ("speculative", "plain"))
            handle.max_k = int(info.get("max_k", 0))

    def _cost_model(self, handle: WorkerHandle, raw: Any) -> CostModel | None:
        if raw is None:
            return None
        if handle.cost is not None and raw == handle.cost_raw:  # unchanged since the last poll
            return handle.cost
        try:
            cost = CostModel.from_json(raw)
        except (KeyError, TypeError, ValueError) as exc:
            if str(exc) != handle.cost_error:  # once per new problem, not once per poll
                log.warning("%s published an unusable cost model (%s); K auto uses its max_k", handle.worker_id, exc)
            handle.cost_error = str(exc)
            return None
        if handle.cost is None:
            self._check_precision(handle)
        handle.cost_raw = raw
        return cost

    def _check_precision(self, handle: WorkerHandle) -> None:
        """Workers of one gateway should serve one precision (they share the cost cache, so the
        first one's choice is the others'); say so when they do not: a session that moves
        between them may get another greedy answer at a near-tie."""
        mine = precision_signature(handle.info)
        for other in self.workers.values():
            theirs = precision_signature(other.info)
            if other is not handle and not other.remote and not handle.remote and mine and theirs and mine != theirs:
                log.warning("%s serves %s but %s %s: their cost caches differ (workers.cost_cache_dir)",
                            handle.worker_id, mine, other.worker_id, theirs)

    async def _read_vllm_depth(self, handle: WorkerHandle) -> None:
        """A vLLM server's depth, from its own Prometheus gauges (it serves other clients too)."""
        text = await _metrics_text(handle)
        if text is None:
            return
        running = waiting = 0.0
        for line in text.splitlines():
            if line.startswith("vllm:num_requests_running"):
                running += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:num_requests_waiting"):
                waiting += float(line.rsplit(" ", 1)[1])
        _report_depth(handle, "vllm", int(running), int(waiting))

    async def _read_llamacpp_depth(self, handle: WorkerHandle) -> None:
        """A llama-server's depth, from its ``llamacpp:`` gauges where it exports them (``--metrics``;
        without it, /metrics answers 501 and the gateway's own in-flight count is the load)."""
        text = await _metrics_text(handle)
        depth = None if text is None else read_depth(text)
        if depth is None:
            handle.info = {"engine": "llamacpp"}
            return
        _report_depth(handle, "llamacpp", *depth)


async def _metrics_text(handle: WorkerHandle) -> str | None:
    """A server's Prometheus text; None where /metrics answers anything but 200."""
    async with handle.client.get(handle.base_url + "/metrics",
                                 timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
        return await resp.text() if resp.status == 200 else None


def _report_depth(handle: WorkerHandle, engine: str, running: int, waiting: int) -> None:
    """A server's own count of the requests it runs and holds: this gateway's and others'."""
    handle.info = {"engine": engine, "batch_depth": running, "queue_length": waiting}
    handle.reported_depth = running + waiting
    handle.in_flight_at_report = handle.in_flight


def precision_signature(info: dict[str, Any]) -> str | None:
    """What decides a worker's arithmetic, from its self-description: the target's dtype, whether
    it runs prepacked and how its projections multiply (a float32 target with bfloat16 products
    rounds otherwise than one with float32 products). None where the worker does not say."""
    precision = info.get("precision") or {}
    target = precision.get("target")
    if not target:
        return None
    packed = " prepacked" if precision.get("target_prepacked") else ""
    products = precision.get("products")
    return f"a {target}{packed} target" + (f" with {products} products" if products else "")


def _methods(raw: Any, max_k: int) -> tuple[Method, ...]:
    """A worker's ``methods``: the known ones it lists, in ``METHODS`` order; absent (a worker
    from before methods): the draft model, where it speculates at all."""
    if not isinstance(raw, list):
        return ("draft",) if max_k > 0 else ()
    return tuple(m for m in METHODS if m in raw)


def _tree_max_nodes(raw: Any) -> int:
    """A worker's ``tree_max_nodes``: absent, 0 or anything but a count means chains only."""
    if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
        return 0
    return min(raw, MAX_TREE_NODES)


def _loads(text: str) -> Any:
    """A worker's self-description: orjson, several times faster than json (one a poll per
    worker); json where orjson refuses what json.dumps wrote (NaN, a lone surrogate)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)
