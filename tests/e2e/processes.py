"""Process plumbing for the e2e tier: free loopback ports, waiting for a server to answer, SSE
reading, sim workers. The tests' own copy: bench/procs.py serves the benches (bench must not
import tests, and no runtime package should carry test plumbing)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "models" / "demo-target"  # the sim emits ids from this vocabulary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ok(process: subprocess.Popen[bytes], url: str, timeout_s: float = 60.0, log_path: Path | None = None) -> None:
    """Polls ``url`` until it answers 200; fails early if the process exits (with its log, when given)."""

    def failed(what: str) -> RuntimeError:
        return RuntimeError(f"{url}: {what}" + (f":\n{log_path.read_text()}" if log_path is not None else ""))

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise failed(f"process exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise failed(f"not ready within {timeout_s}s")


async def sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The ``data:`` payloads of an SSE response, ``[DONE]`` included, as a client reads them."""
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data:"):
            yield line[5:].strip()


def start_sim_worker(log_dir: Path, sim: dict[str, Any], *, default_k: int = 0, max_slots: int = 256,
                     max_queue: int = 1024, port: int | None = None,
                     env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """A sim worker on TCP (``python -m workers --engine sim``): an OpenAI-compatible upstream;
    ``port``: its port (default: a free one); ``env``: more variables."""
    port = port or free_port()
    environ = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    environ["PYTHONPATH"] = str(REPO) + (os.pathsep + environ["PYTHONPATH"] if environ.get("PYTHONPATH") else "")
    environ.update(env or {})
    log_path = log_dir / f"sim-worker-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "workers", "--engine", "sim", "--port", str(port), "--worker-id", f"sim-{port}",
             "--target", str(TOKENIZER_DIR), "--draft", str(TOKENIZER_DIR), "--max-slots", str(max_slots),
             "--max-queue", str(max_queue), "--default-k", str(default_k), "--sim-config", json.dumps(sim)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=environ)
    wait_ok(process, f"http://127.0.0.1:{port}/health", log_path=log_path)
    return process, port


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
