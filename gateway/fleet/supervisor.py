"""Supervising the local workers: each one's process started, watched until it exits, and
restarted with exponential backoff.

One supervision task a local worker: spawn it (in its own process group, its output relayed
into the gateway's log when logs are JSON: worker_output.py), wait until the probe finds it
healthy, wait for it to exit, and start it again. Readiness itself is the probe's (probe.py):
the supervisor tells it when a worker it started is healthy and when it died.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time

from prometheus_client import multiprocess

from gateway.config.config import GatewayConfig
from gateway.fleet.handle import WorkerHandle
from gateway.fleet.probe import Probe
from gateway.fleet.worker_output import MAX_LINE_BYTES, StreamName, relay_output
from gateway.observe.metrics import GatewayMetrics

log = logging.getLogger(__name__)

# A worker that ran this long before it died was no crash loop: its restart waits the first
# delay again (a worker the kernel's OOM killer or an operator kills now and then comes back
# quickly), while one that dies sooner, or never gets healthy, waits twice as long each time.
HEALTHY_RUN_S = 60.0
TERMINATE_WAIT_S = 10.0  # a worker's own shutdown, after SIGTERM, before SIGKILL
HEALTHY_CHECK_EVERY_S = 0.1  # while a started worker is not yet healthy


class Supervisor:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics, probe: Probe) -> None:
        self.config = config
        self.metrics = metrics
        self.probe = probe
        self.stopping = False  # set by the fleet's stop: a worker that exits then stays down

    def command(self, handle: WorkerHandle) -> list[str]:
        """The worker's command line: ``python -m workers`` with the config's model and workers sections."""
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
        if cfg.model.eagle3 is not None:
            command += ["--eagle3", str(cfg.model.eagle3)]
        if wc.cost_cache_dir is not None:
            command += ["--cost-cache-dir", str(wc.cost_cache_dir)]
        if wc.max_model_len is not None:
            command += ["--max-model-len", str(wc.max_model_len)]
        if wc.engine == "embedded":
            command += ["--prefix-cache-mb", str(wc.prefix_cache_mb)]
        if wc.engine == "vllm" and wc.vllm_args:
            command += ["--vllm-args", json.dumps(dict(wc.vllm_args))]
        if wc.engine == "sim" and wc.sim:
            command += ["--sim-config", json.dumps(dict(wc.sim))]
        return command

    async def supervise(self, handle: WorkerHandle) -> None:
        """Runs the worker, restarting it whenever it exits or never gets healthy, until cancelled."""
        wc = self.config.workers
        failures = 0
        while not self.stopping:
            handle.status = "starting"
            handle.started_at = time.monotonic()
            handle.process = await self._spawn(handle)
            healthy = await self._wait_healthy(handle, wc.startup_timeout_s)
            if healthy:
                self.probe.became_ready(handle)
                log.info("%s ready (pid %d)", handle.worker_id, handle.process.pid)
                await handle.process.wait()
                kill_group(handle.process.pid)  # a worker killed -9 leaves its engine's processes behind
            else:
                await self.terminate(handle)
            await finish_output(handle)  # its last words (a traceback) reach the log before the restart line
            if self.stopping:
                return
            handle.last_error = (f"exited with code {handle.process.returncode}" if healthy
                                 else f"not healthy within {wc.startup_timeout_s}s")
            log.warning("%s %s; restarting", handle.worker_id, handle.last_error)
            self.probe.mark_down(handle, "restarting")
            multiprocess.mark_process_dead(handle.process.pid)
            failures = 0 if healthy and time.monotonic() - handle.started_at > HEALTHY_RUN_S else failures + 1
            await asyncio.sleep(restart_delay(failures, wc.restart_backoff_s, wc.restart_backoff_max_s))
            handle.restarts += 1
            self.metrics.worker_restarts.labels(model=self.metrics.model, worker=handle.worker_id).inc()

    async def _spawn(self, handle: WorkerHandle) -> asyncio.subprocess.Process:
        json_logs = self.config.server.log_format == "json"
        # Text logs: the worker writes to the gateway's own stdout and stderr. JSON logs: through
        # pipes, so that a line no logger wrote is wrapped as JSON (gateway/fleet/worker_output.py).
        pipe = asyncio.subprocess.PIPE if json_logs else None
        # Its own process group: an engine's helper processes (vLLM runs two) go with it.
        process = await asyncio.create_subprocess_exec(*self.command(handle), env=os.environ.copy(),
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
            if await self.probe.check(handle):
                return True
            await asyncio.sleep(HEALTHY_CHECK_EVERY_S)
        return False

    async def terminate(self, handle: WorkerHandle) -> None:
        """Stops the worker's process, if it runs: SIGTERM, SIGKILL after ``TERMINATE_WAIT_S``,
        then whatever is left of its process group."""
        process = handle.process
        if process is None:
            return
        if process.returncode is None:
            process.terminate()  # the worker alone first: it shuts its engine down cleanly
            try:
                await asyncio.wait_for(process.wait(), timeout=TERMINATE_WAIT_S)
            except TimeoutError:
                process.kill()
                await process.wait()
        kill_group(process.pid)


def restart_delay(failures: int, backoff_s: float, max_s: float) -> float:
    """Seconds before a worker's restart after ``failures`` consecutive failures (0: it had run
    ``HEALTHY_RUN_S`` and died): ``backoff_s``, doubled per failure after the first, at most ``max_s``."""
    return min(max_s, backoff_s * 2.0 ** max(0, failures - 1))


async def finish_output(handle: WorkerHandle, timeout_s: float = 2.0) -> None:
    """Waits for a stopped worker's output relays to read their pipes to the end; a pipe that a
    stray process still holds open after ``timeout_s`` is abandoned."""
    if not handle.output:
        return
    # Cleared only once done: a supervisor cancelled meanwhile (the gateway stopping) leaves
    # them to the fleet's stop.
    _, pending = await asyncio.wait(handle.output, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    handle.output = []


def kill_group(pgid: int) -> None:
    """Kills what is left of a worker's process group (its engine's helper processes)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
