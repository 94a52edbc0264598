"""The worker fleet: local worker processes the gateway starts and supervises, and remote
OpenAI-compatible servers it only health-checks.

Each local worker gets a supervision task (spawn, wait until healthy, wait for exit, restart
with exponential backoff) and every worker a polling task (health and load). All of it runs
as asyncio tasks owned by the app's cleanup context; no threads, no sleeps that block.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
import orjson
from prometheus_client import multiprocess

from gateway.config import GatewayConfig, RemoteProtocol, RemoteWorker
from gateway.draft_mix import DraftMix
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.ops_metrics import AdmissionWaitMetrics
from gateway.routing import Candidate
from gateway.worker_http import Endpoint, WorkerHttp
from gateway.worker_output import MAX_LINE_BYTES, StreamName, relay_output
from policies import MAX_TREE_NODES, CostModel, Mode, SessionState

log = logging.getLogger(__name__)
WorkerStatus = Literal["starting", "ready", "unhealthy", "restarting", "stopped"]


# A worker that ran this long before it died was no crash loop: its restart waits the first
# delay again (a worker the kernel's OOM killer or an operator kills now and then comes back
# quickly), while one that dies sooner, or never gets healthy, waits twice as long each time.
HEALTHY_RUN_S = 60.0


@dataclass
class WorkerHandle:
    worker_id: str
    base_url: str  # http://worker for a Unix socket, the server's URL for remote workers
    client: aiohttp.ClientSession  # health polls and metrics scrapes
    http: WorkerHttp  # the relay's requests (gateway/worker_http.py)
    modes: frozenset[Mode]
    max_k: int
    socket_path: Path | None = None  # local workers only
    remote: bool = False
    # specgate: takes the directive and reports every step; vllm: a vLLM server with specgate's
    # plugin, driven through vllm_xargs; openai: any OpenAI server, serving one fixed mode.
    protocol: RemoteProtocol = "specgate"
    status: WorkerStatus = "starting"
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    # The requests the gateway has forwarded and not yet finished, by the decision each went
    # with: their count is ``in_flight``, their drafting mix what K auto prices a step at.
    draft_mix: DraftMix = field(default_factory=DraftMix)
    reported_depth: int = 0  # the worker's own running + queued count, from its last poll
    batch_full: bool = False  # the policy's batch latch for this worker (gateway side)
    info: dict[str, Any] = field(default_factory=dict)
    last_error: str = ""
    started_at: float = 0.0
    cost: CostModel | None = None  # its published step costs (policy K auto), from its last poll
    tree_max_nodes: int = 0  # the most token-tree nodes its engine verifies in a step (0: chains only)
    # Acceptance over all the worker's sessions, folded as a session's is: the α a session new
    # to it is costed at (policies.speculation.acceptance_for_k).
    acceptance: SessionState = field(default_factory=SessionState)
    cost_error: str = ""  # why its last published cost model was unusable
    cost_raw: Any = None  # the published cost model ``cost`` was parsed from
    # JSON logs only: the tasks relaying its stdout and stderr into the gateway's log.
    output: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def in_flight(self) -> int:
        return self.draft_mix.count

    @property
    def speaks_specgate(self) -> bool:
        return self.protocol == "specgate"

    @property
    def load(self) -> int:
        # A local worker's socket is private to this gateway, so the in-flight count is exact and
        # current; the worker's own report lags by a poll. A remote worker may serve other
        # clients too, so its report counts as well.
        return max(self.in_flight, self.reported_depth) if self.remote else self.in_flight

    def candidate(self) -> Candidate:
        return Candidate(self.worker_id, self.status == "ready", self.load, self.modes)

    def view(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id, "status": self.status, "remote": self.remote, "protocol": self.protocol,
            "engine": self.info.get("engine"), "url": self.base_url
            if self.remote else str(self.socket_path), "pid": self.process.pid if self.process else None,
            "modes": sorted(self.modes), "max_k": self.max_k, "restarts": self.restarts, "in_flight": self.in_flight,
            "batch_depth": self.info.get("batch_depth", self.in_flight), "queue_length": self.info.get("queue_length"),
            "batch_full": self.batch_full, "precision": self.info.get("precision"), "stats": self.info.get("stats"),
            "cost_model": self.info.get("cost_model"), "acceptance": self.acceptance.acceptance_estimate,
            "tree_max_nodes": self.tree_max_nodes,
            "draft_mix": self.draft_mix.view(),
            "last_error": self.last_error or None,
        }


def _tree_max_nodes(raw: Any) -> int:
    """A worker's ``tree_max_nodes``: absent, 0 or anything but a count means chains only."""
    if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
        return 0
    return min(raw, MAX_TREE_NODES)


class Fleet:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics,
                 on_worker_down: Callable[[str], None]) -> None:
        self.config = config
        self.metrics = metrics
        self.on_worker_down = on_worker_down
        self.workers: dict[str, WorkerHandle] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._stopping = False
        # Requests waiting for a ready worker (gateway/admission.py ``pick_ready``): how many, the
        # event that wakes them (set, and replaced by a fresh one, whenever a worker becomes
        # ready), and their metrics.
        self.waiting = 0
        self._ready_event = asyncio.Event()
        self.admission_waits = AdmissionWaitMetrics.create(metrics.registry)

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Starts the local workers' supervisors, and every worker's poll."""
        wc = self.config.workers
        socket_dir = self._socket_dir()
        for i in range(wc.count):
            handle = self._local_handle(i, socket_dir)
            self.workers[handle.worker_id] = handle
            self._tasks.append(asyncio.create_task(self._supervise(handle), name=f"supervise-{handle.worker_id}"))
        for remote in wc.remote:
            handle = self._remote_handle(remote)
            self.workers[handle.worker_id] = handle
        for handle in self.workers.values():
            self._tasks.append(asyncio.create_task(self._poll(handle), name=f"poll-{handle.worker_id}"))

    def _socket_dir(self) -> Path:
        socket_dir = self.config.workers.socket_dir
        if socket_dir is None:
            # Unix socket paths are limited to ~100 bytes: keep them short.
            self._tmpdir = tempfile.TemporaryDirectory(prefix="specgate-")
            socket_dir = Path(self._tmpdir.name)
        socket_dir.mkdir(parents=True, exist_ok=True)
        return socket_dir

    def _local_handle(self, i: int, socket_dir: Path) -> WorkerHandle:
        wc = self.config.workers
        can_speculate = self.config.model.draft is not None and wc.max_k > 0
        path = socket_dir / f"w{i}.sock"
        client = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(path)))
        http = WorkerHttp(Endpoint.from_url("http://worker", unix_path=str(path)))
        return WorkerHandle(f"worker-{i}", "http://worker", client, http,
                            frozenset({"speculative", "plain"} if can_speculate else {"plain"}),
                            wc.max_k if can_speculate else 0, socket_path=path)

    def _remote_handle(self, remote: RemoteWorker) -> WorkerHandle:
        modes: frozenset[Mode]
        if remote.protocol == "specgate":  # describes its own modes and max K on its first poll
            modes, max_k = frozenset(), 0
        elif remote.protocol == "vllm":  # one engine serves both modes, up to its num_speculative_tokens
            modes = frozenset({"speculative", "plain"} if remote.max_k > 0 else {"plain"})
            max_k = remote.max_k
        else:
            modes, max_k = frozenset({remote.mode}), remote.max_k if remote.mode == "speculative" else 0
        # Not routable until its first health check passes.
        # A specgate worker on TCP serves its gateway only: it wants the shared token (auth.worker_token).
        token = self.config.auth.worker_token if remote.protocol == "specgate" else None
        auth = {"Authorization": f"Bearer {token}"} if token else None
        client = aiohttp.ClientSession(headers=auth)
        http = WorkerHttp(Endpoint.from_url(remote.url), auth)
        return WorkerHandle(remote.name, remote.url, client, http, modes, max_k, remote=True,
                            protocol=remote.protocol, status="unhealthy", last_error="not checked yet")

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(self._terminate(h) for h in self.workers.values()))
        await asyncio.gather(*(_finish_output(h) for h in self.workers.values()))
        for handle in self.workers.values():
            await handle.client.close()
            handle.http.close()
            handle.status = "stopped"
        if self._tmpdir is not None:
            self._tmpdir.cleanup()

    async def _terminate(self, handle: WorkerHandle) -> None:
        process = handle.process
        if process is None:
            return
        if process.returncode is None:
            process.terminate()  # the worker alone first: it shuts its engine down cleanly
            try:
                await asyncio.wait_for(process.wait(), timeout=10)
            except TimeoutError:
                process.kill()
                await process.wait()
        _kill_group(process.pid)

    def candidates(self) -> list[Candidate]:
        return [h.candidate() for h in self.workers.values()]

    def ready_count(self) -> int:
        return sum(1 for h in self.workers.values() if h.status == "ready")

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

    def _became_ready(self, handle: WorkerHandle) -> None:
        handle.status = "ready"
        self.metrics.worker_up.labels(model=self.metrics.model, worker=handle.worker_id).set(1)
        # Wakes every request waiting now; later ones wait on the fresh event.
        woken, self._ready_event = self._ready_event, asyncio.Event()
        woken.set()

    # -- local workers ------------------------------------------------------------------------------
    def _command(self, handle: WorkerHandle) -> list[str]:
        cfg, wc = self.config, self.config.workers
        python = str(wc.python) if wc.python is not None else sys.executable
        command = [python, "-m", "workers", "--engine", wc.engine, "--worker-id", handle.worker_id,
                   "--uds", str(handle.socket_path),
                   "--target", str(cfg.model.target), "--served-model-name", cfg.model.name,
                   "--max-slots", str(wc.max_slots), "--max-queue", str(wc.max_queue), "--max-k", str(wc.max_k),
                   "--default-k", str(wc.max_k if cfg.policy.auto_k else cfg.policy.num_speculative_tokens),
                   "--threads", str(wc.threads), "--dtype", wc.dtype, "--draft-dtype", wc.draft_dtype,
                   "--exact" if wc.exact else "--no-exact", "--cost-budget-s", str(wc.cost_budget_s),
                   "--max-body-bytes", str(cfg.server.max_body_bytes), "--log-format", cfg.server.log_format]
        if cfg.model.draft is not None:
            command += ["--draft", str(cfg.model.draft)]
        if wc.cost_cache_dir is not None:
            command += ["--cost-cache-dir", str(wc.cost_cache_dir)]
        if wc.max_model_len is not None:
            command += ["--max-model-len", str(wc.max_model_len)]
        if wc.engine == "vllm" and wc.vllm_args:
            command += ["--vllm-args", json.dumps(dict(wc.vllm_args))]
        if wc.engine == "sim" and wc.sim:
            command += ["--sim-config", json.dumps(dict(wc.sim))]
        return command

    async def _supervise(self, handle: WorkerHandle) -> None:
        wc = self.config.workers
        failures = 0
        while not self._stopping:
            handle.status = "starting"
            handle.started_at = time.monotonic()
            handle.process = await self._spawn(handle)
            healthy = await self._wait_healthy(handle, wc.startup_timeout_s)
            if healthy:
                self._became_ready(handle)
                log.info("%s ready (pid %d)", handle.worker_id, handle.process.pid)
                await handle.process.wait()
                _kill_group(handle.process.pid)  # a worker killed -9 leaves its engine's processes behind
            else:
                await self._terminate(handle)
            await _finish_output(handle)  # its last words (a traceback) reach the log before the restart line
            if self._stopping:
                return
            handle.last_error = (f"exited with code {handle.process.returncode}" if healthy
                                 else f"not healthy within {wc.startup_timeout_s}s")
            log.warning("%s %s; restarting", handle.worker_id, handle.last_error)
            self._mark_down(handle, "restarting")
            multiprocess.mark_process_dead(handle.process.pid)
            failures = 0 if healthy and time.monotonic() - handle.started_at > HEALTHY_RUN_S else failures + 1
            await asyncio.sleep(restart_delay(failures, wc.restart_backoff_s, wc.restart_backoff_max_s))
            handle.restarts += 1
            self.metrics.worker_restarts.labels(model=self.metrics.model, worker=handle.worker_id).inc()

    async def _spawn(self, handle: WorkerHandle) -> asyncio.subprocess.Process:
        json_logs = self.config.server.log_format == "json"
        # Text logs: the worker writes to the gateway's own stdout and stderr. JSON logs: through
        # pipes, so that a line no logger wrote is wrapped as JSON (gateway/worker_output.py).
        pipe = asyncio.subprocess.PIPE if json_logs else None
        # Its own process group: an engine's helper processes (vLLM runs two) go with it.
        process = await asyncio.create_subprocess_exec(*self._command(handle), env=os.environ.copy(),
                                                       start_new_session=True, stdout=pipe, stderr=pipe,
                                                       limit=MAX_LINE_BYTES)
        if json_logs and process.stdout is not None and process.stderr is not None:
            streams: tuple[tuple[StreamName, asyncio.StreamReader], ...] = (
                ("stdout", process.stdout), ("stderr", process.stderr))
            handle.output = [asyncio.create_task(relay_output(handle.worker_id, name, reader),
                                                 name=f"output-{handle.worker_id}-{name}") for name, reader in streams]
        return process

    async def _wait_healthy(self, handle: WorkerHandle, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if handle.process is not None and handle.process.returncode is not None:
                return False
            if await self._probe(handle):
                return True
            await asyncio.sleep(0.1)
        return False

    def _mark_down(self, handle: WorkerHandle, status: WorkerStatus) -> None:
        was_ready = handle.status == "ready"
        handle.status = status
        self.metrics.worker_up.labels(model=self.metrics.model, worker=handle.worker_id).set(0)
        if was_ready:
            self.on_worker_down(handle.worker_id)

    def report_failure(self, handle: WorkerHandle, error: str) -> None:
        """A request could not reach the worker: stop routing to it until a poll succeeds."""
        handle.last_error = error
        if handle.status == "ready":
            self._mark_down(handle, "unhealthy")

    # -- polling ----------------------------------------------------------------------------------
    async def _probe(self, handle: WorkerHandle) -> bool:
        path = "/specgate/worker" if handle.speaks_specgate else "/health"
        try:
            async with handle.client.get(handle.base_url + path, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status != 200:
                    handle.last_error = f"{path} answered {resp.status}"
                    return False
                handle.last_error = ""
                if handle.speaks_specgate:
                    self._read_worker_info(handle, await resp.json(loads=_loads))
            if handle.protocol == "vllm":
                await self._probe_vllm_depth(handle)
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
        handle.tree_max_nodes = _tree_max_nodes(info.get("tree_max_nodes"))
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

    async def _probe_vllm_depth(self, handle: WorkerHandle) -> None:
        """A vLLM server's depth, from its own Prometheus gauges (it serves other clients too)."""
        async with handle.client.get(handle.base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp:
            if resp.status != 200:
                return
            text = await resp.text()
        running = waiting = 0.0
        for line in text.splitlines():
            if line.startswith("vllm:num_requests_running"):
                running += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:num_requests_waiting"):
                waiting += float(line.rsplit(" ", 1)[1])
        handle.info = {"engine": "vllm", "batch_depth": int(running), "queue_length": int(waiting)}
        handle.reported_depth = int(running + waiting)

    async def _poll(self, handle: WorkerHandle) -> None:
        interval = self.config.workers.poll_interval_s
        hung_after = self.config.workers.unhealthy_restart_s
        unhealthy_since: float | None = None
        while True:
            await asyncio.sleep(interval)
            if handle.status in ("starting", "restarting"):
                unhealthy_since = None
                continue
            ok = await self._probe(handle)
            if ok:
                unhealthy_since = None
                if handle.status != "ready":
                    self._became_ready(handle)
            else:
                unhealthy_since = self._failed_poll(handle, unhealthy_since, hung_after)

    def _failed_poll(self, handle: WorkerHandle, unhealthy_since: float | None, hung_after: float) -> float | None:
        """A poll the worker failed: down if it was ready, killed if it is a local process hung
        for ``hung_after``; when it has been unhealthy since (None: a restart starts afresh)."""
        if handle.status == "ready":
            log.warning("%s failed its health check: %s", handle.worker_id, handle.last_error)
            self._mark_down(handle, "unhealthy")
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


def restart_delay(failures: int, backoff_s: float, max_s: float) -> float:
    """Seconds before a worker's restart after ``failures`` consecutive failures (0: it had run
    ``HEALTHY_RUN_S`` and died): ``backoff_s``, doubled per failure after the first, at most ``max_s``."""
    return min(max_s, backoff_s * 2.0 ** max(0, failures - 1))


def _loads(text: str) -> Any:
    """A worker's self-description: orjson, several times faster than json (one a poll per
    worker); json where orjson refuses what json.dumps wrote (NaN, a lone surrogate)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


async def _finish_output(handle: WorkerHandle, timeout_s: float = 2.0) -> None:
    """Waits for a stopped worker's output relays to read their pipes to the end; a pipe that a
    stray process still holds open after ``timeout_s`` is abandoned."""
    if not handle.output:
        return
    # Cleared only once done: a supervisor cancelled meanwhile (the gateway stopping) leaves
    # them to Fleet.stop.
    _, pending = await asyncio.wait(handle.output, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    handle.output = []


def _kill_group(pgid: int) -> None:
    """Kills what is left of a worker's process group (its engine's helper processes)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
