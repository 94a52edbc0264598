"""The worker fleet: local worker processes the gateway starts and supervises, and remote
OpenAI-compatible servers it only health-checks.

The fleet holds the workers (handle.py) and owns their tasks: a supervision task for each local
worker (supervisor.py: spawn, wait until healthy, wait for exit, restart with backoff) and a
poll task for every worker (probe.py: health, load, readiness). All of it runs as asyncio tasks
owned by the app's cleanup context; no threads, no sleeps that block.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Callable
from pathlib import Path

import aiohttp

from gateway.config.config import GatewayConfig, RemoteMethod, RemoteWorker
from gateway.fleet.handle import WorkerHandle
from gateway.fleet.probe import Probe
from gateway.fleet.supervisor import Supervisor, finish_output
from gateway.fleet.worker_http import Endpoint, WorkerHttp
from gateway.llamacpp import PromptScopes
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.ops_metrics import AdmissionWaitMetrics
from gateway.scheduling.framework import Candidate
from policies import Mode
from policies.methods import Method

# A server's --speculative-config method, as specgate's policy names it (policies/methods.py).
SERVER_METHODS: dict[RemoteMethod, tuple[Method, ...]] = {"draft_model": ("draft",), "eagle3": ("eagle3",),
                                                          "ngram": ("ngram",), "none": ()}


class Fleet:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics,
                 on_worker_down: Callable[[str], None]) -> None:
        self.config = config
        self.metrics = metrics
        self.workers: dict[str, WorkerHandle] = {}
        # A worker that went down lost its cache: ``on_worker_down`` has the routing forget what it held.
        self.probe = Probe(config, metrics, self.workers, on_worker_down)
        self.supervisor = Supervisor(config, metrics, self.probe)
        self._tasks: list[asyncio.Task[None]] = []
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        # Requests waiting for a ready worker (gateway/admission.py ``pick_ready``): how many, and
        # their metrics; the probe wakes them.
        self.waiting = 0
        self.admission_waits = AdmissionWaitMetrics.create(metrics.registry)

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Starts the local workers' supervisors, and every worker's poll."""
        wc = self.config.workers
        socket_dir = self._socket_dir()
        for i in range(wc.count):
            handle = self._local_handle(i, socket_dir)
            self.workers[handle.worker_id] = handle
            self._tasks.append(asyncio.create_task(self.supervisor.supervise(handle),
                                                   name=f"supervise-{handle.worker_id}"))
        for remote in wc.remote:
            handle = self._remote_handle(remote)
            self.workers[handle.worker_id] = handle
        for handle in self.workers.values():
            self._tasks.append(asyncio.create_task(self.probe.poll(handle), name=f"poll-{handle.worker_id}"))

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
        can_speculate = (self.config.model.draft is not None or self.config.model.eagle3 is not None) and wc.max_k > 0
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
            speculates = remote.max_k > 0 and remote.method != "none"
            modes = frozenset({"speculative", "plain"} if speculates else {"plain"})
            max_k = remote.max_k if speculates else 0
        elif remote.protocol == "llamacpp":  # one mode and one method for its life: it drafts on every step
            speculates = remote.method != "none"
            modes = frozenset({"speculative"} if speculates else {"plain"})
            max_k = remote.max_k if speculates else 0
        else:
            modes, max_k = frozenset({remote.mode}), remote.max_k if remote.mode == "speculative" else 0
        # Not routable until its first health check passes.
        # A specgate worker on TCP serves its gateway only: it wants the shared token (auth.worker_token).
        token = self.config.auth.worker_token if remote.protocol == "specgate" else None
        auth = {"Authorization": f"Bearer {token}"} if token else None
        client = aiohttp.ClientSession(headers=auth)
        http = WorkerHttp(Endpoint.from_url(remote.url), auth)
        handle = WorkerHandle(remote.name, remote.url, client, http, modes, max_k, remote=True,
                              protocol=remote.protocol, status="unhealthy", last_error="not checked yet")
        if remote.protocol != "specgate":  # a server's one method, for its life (a specgate worker's: polled)
            handle.methods = SERVER_METHODS[remote.method]
        if remote.protocol == "llamacpp":
            handle.prompt_scopes = PromptScopes(remote.scoped_slots)
        return handle

    async def stop(self) -> None:
        self.supervisor.stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(self.supervisor.terminate(h) for h in self.workers.values()))
        await asyncio.gather(*(finish_output(h) for h in self.workers.values()))
        for handle in self.workers.values():
            await handle.client.close()
            handle.http.close()
            handle.status = "stopped"
        if self._tmpdir is not None:
            self._tmpdir.cleanup()

    # -- what admission reads -----------------------------------------------------------------------
    def candidates(self) -> list[Candidate]:
        return [h.candidate() for h in self.workers.values()]

    def ready_count(self) -> int:
        return sum(1 for h in self.workers.values() if h.status == "ready")

    async def wait_ready(self, timeout_s: float) -> bool:
        """Waits until a worker becomes ready, at most ``timeout_s`` (Probe.wait_ready)."""
        return await self.probe.wait_ready(timeout_s)

    def report_failure(self, handle: WorkerHandle, error: str) -> None:
        """A request could not reach the worker: stop routing to it until a poll succeeds."""
        self.probe.report_failure(handle, error)
