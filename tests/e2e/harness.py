"""Starts real gateway processes (with their real worker processes) on loopback for tests."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import yaml

from bench.procs import free_port, wait_ok

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "models"
# Workers' start-up cost measurement, kept short in tests (production default: 4 s).
TEST_COST_BUDGET_S = 1.0


@functools.cache
def cost_cache_dir() -> Path:
    """One temporary cost cache for the test session: the first worker measures, later ones
    start at once, as a restarted worker does; removed when the session ends."""
    path = Path(tempfile.mkdtemp(prefix="specgate-test-costs-"))
    atexit.register(shutil.rmtree, path, True)
    return path


@dataclass
class Gateway:
    process: subprocess.Popen[bytes]
    port: int
    config_path: Path
    log_path: Path
    # Sent with get_json and metrics (e.g. the admin token, when the config sets one).
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def get_json(self, path: str) -> Any:
        request = urllib.request.Request(self.url + path, headers=self.headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def metrics(self) -> str:
        request = urllib.request.Request(self.url + "/metrics", headers=self.headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            text: str = response.read().decode()
            return text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        total = 0.0
        for line in self.metrics().splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def wait_workers_ready(self, count: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            workers = self.get_json("/admin/workers")["workers"]
            if sum(1 for w in workers if w["status"] == "ready") >= count:
                return
            time.sleep(0.2)
        raise TimeoutError(f"fewer than {count} workers ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# conftest.py's gateway_factory: (name, *, env, args, workers_ready, **config sections) -> Gateway.
GatewayFactory = Callable[..., Gateway]


def sdk_client(gateway: Gateway) -> openai.OpenAI:
    """The official client, unmodified, pointed at the gateway (use it as a context manager)."""
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=60)


def write_config(path: Path, **sections: dict[str, Any]) -> Path:
    config: dict[str, Any] = {
        "model": {"name": "specgate-demo", "target": str(MODELS / "demo-target"),
                  "draft": str(MODELS / "demo-draft")},
        "workers": {"count": 1, "max_slots": 16, "poll_interval_s": 0.2, "restart_backoff_s": 0.2,
                    "cost_cache_dir": str(cost_cache_dir()), "cost_budget_s": TEST_COST_BUDGET_S},
        # The GPU-oriented shallow-batch waiver and per-step draft limit off (the defaults too):
        # these tests exercise each rule on its own (tests/e2e/test_sim.py and test_policy.py cover them).
        "policy": {"free_batch": 0, "max_step_drafts": 0},
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start_gateway(config_path: Path, log_dir: Path, ready_timeout_s: float = 120.0,
                  env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> Gateway:
    """``env``: variables added to this process's environment; ``args``: further ``serve`` flags."""
    port = free_port()
    log_path = log_dir / f"gateway-{port}.log"
    environ = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR" and not k.startswith("SPECGATE_")}
    environ.update(env or {})
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(config_path), "--port", str(port),
                                    *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=environ)
    gateway = Gateway(process, port, config_path, log_path)
    try:
        wait_ok(process, gateway.url + "/ready", ready_timeout_s, log_path)
    except RuntimeError:
        gateway.stop()
        raise
    return gateway


def start_tcp_worker(log_dir: Path, *extra: str, ready_timeout_s: float = 120.0,
                     env: dict[str, str] | None = None, target: Path = MODELS / "demo-target",
                     draft: Path | None = MODELS / "demo-draft") -> tuple[subprocess.Popen[bytes], int]:
    """A standalone specgate worker on TCP, as on another machine (``env``: extra variables;
    ``draft`` None: the target alone)."""
    port = free_port()
    log_path = log_dir / f"worker-{port}.log"
    models = ["--target", str(target)] + ([] if draft is None else ["--draft", str(draft)])
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "workers", "--worker-id", f"tcp-{port}", "--port", str(port), *models,
             "--cost-cache-dir", str(cost_cache_dir()), "--cost-budget-s", str(TEST_COST_BUDGET_S), *extra],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        wait_ok(process, f"http://127.0.0.1:{port}/health", ready_timeout_s, log_path)
    except RuntimeError:
        process.kill()
        process.wait()
        raise
    return process, port


def target_prepacked_expected(target: str) -> bool:
    """Whether a worker serving a ``target`` (dtype) model runs it on weights laid out once for a
    row-invariant kernel: oneDNN's prepacked bfloat16 where the CPU has AVX512-BF16/AMX, float32
    on workers/engines/embedded/kernels/rowgemm.py's kernels where they build (a C compiler and AVX2)."""
    from workers.engines.embedded.kernels import rowgemm
    from workers.engines.embedded.projections import bf16_prepacking_available

    return bf16_prepacking_available() if target == "bfloat16" else rowgemm.load() is not None


def worker_sse_events(raw: str) -> list[tuple[dict[str, Any], list[int]]]:
    """A specgate worker's streamed body as (chunk, the token ids sent for it), ``[DONE]`` left out.

    A worker sends each chunk's ids in an SSE comment event of its own just before the chunk
    (workers/api/wire.py, ``IDS_COMMENT``); a chunk without one gets [].
    """
    comment = ": ids "
    events: list[tuple[dict[str, Any], list[int]]] = []
    ids: list[int] = []
    for event in raw.split("\n\n"):
        data = None
        for line in event.split("\n"):
            if line.startswith(comment):
                ids = json.loads(line[len(comment):]).get("token_ids", [])
            elif line.startswith("data: "):
                data = line[len("data: "):]
        if data is not None and data != "[DONE]":
            events.append((json.loads(data), ids))
            ids = []
    return events


def bench_json(*args: str, timeout: int = 240) -> tuple[dict[str, Any], str]:
    """``python args...`` in the repository (a bench, with ``--json``): its last line's JSON
    object and its whole stdout; raises where it exits other than 0."""
    run = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         check=True)
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result, run.stdout


def put_policy(gateway: Gateway, body: bytes, content_type: str) -> tuple[int, Any]:
    """``PUT /admin/policy`` with ``body``: the status and the JSON answer, an error's too."""
    request = urllib.request.Request(gateway.url + "/admin/policy", data=body, method="PUT",
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())
