"""Starting real gateway and worker processes on loopback: free ports, waiting for a server to
answer, SSE reading, sim workers and gateways. The one copy, for the benches and the e2e tests
alike (tests/e2e/harness.py builds on it); bench/ never imports tests."""

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
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parent.parent
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


@dataclass
class StreamedChat:
    """One streamed chat completion as a client saw it."""

    status: int
    first_content_at: float | None = None  # time.monotonic() of the first content chunk
    text: str = ""
    usage: dict[str, Any] | None = None


async def stream_chat(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      headers: dict[str, str]) -> tuple[StreamedChat, aiohttp.ClientResponse]:
    """POSTs a streamed chat completion (``stream_options.include_usage`` added) and reads it to
    its end; returns what came and the response (its headers)."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
        out = StreamedChat(response.status)
        if response.status != 200:
            await response.read()
            return out, response
        parts: list[str] = []
        async for data in sse_data(response):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or ():
                content = choice.get("delta", {}).get("content")
                if content:
                    out.first_content_at = out.first_content_at or time.monotonic()
                    parts.append(content)
            out.usage = chunk.get("usage") or out.usage
        out.text = "".join(parts)
        return out, response


def served_sections() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """config.yaml's model (its directories made absolute), workers and policy sections: what
    ``make serve`` serves, for the benches that measure it."""
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    model = {key: str(REPO / value) if key in ("target", "draft", "eagle3") and value else value
             for key, value in config["model"].items()}
    return model, dict(config["workers"]), dict(config["policy"])


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def bench_env(repo: Path = REPO) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["PYTHONPATH"] = str(repo) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def start_sim_worker(log_dir: Path, sim: dict[str, Any], *, default_k: int = 0, max_slots: int = 256,
                     max_queue: int = 1024, launcher: Sequence[str] = ("-m",),
                     repo: Path = REPO, port: int | None = None,
                     env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """A sim worker on TCP (``python -m workers --engine sim``): an OpenAI-compatible upstream.
    ``launcher``: what runs the module (bench.timeline: ``-m bench.timeline_probe``); ``repo``:
    whose code (bench.stacks); ``port``: its port (default: a free one); ``env``: more variables."""
    port = port or free_port()
    log_path = log_dir / f"sim-worker-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, *launcher, "workers", "--engine", "sim", "--port", str(port), "--worker-id", f"sim-{port}",
             "--target", str(TOKENIZER_DIR), "--draft", str(TOKENIZER_DIR), "--max-slots", str(max_slots),
             "--max-queue", str(max_queue), "--default-k", str(default_k), "--sim-config", json.dumps(sim)],
            cwd=repo, stdout=log, stderr=subprocess.STDOUT, env={**bench_env(repo), **(env or {})})
    wait_ok(process, f"http://127.0.0.1:{port}/health", log_path=log_path)
    return process, port


def start_gateway(log_dir: Path, remote_ports: Sequence[int], policy: dict[str, Any], repo: Path = REPO,
                  launcher: Sequence[str] = ("-m",),
                  server: dict[str, Any] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """A gateway with no local workers, routing to the given specgate workers on loopback; its
    code from ``repo`` (another checkout: bench.overhead's --ref-repo); ``server``: more of
    its ``server`` section."""
    port = free_port()
    config = {
        "server": {**(server or {}), "host": "127.0.0.1", "port": port},
        "model": {"name": "specgate-demo", "target": str(TOKENIZER_DIR), "draft": str(TOKENIZER_DIR)},
        "workers": {"count": 0, "poll_interval_s": 0.2,
                    "remote": [{"url": f"http://127.0.0.1:{p}", "protocol": "specgate", "name": f"sim-{i}"}
                               for i, p in enumerate(remote_ports)]},
        "policy": policy,
    }
    path = log_dir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    with (log_dir / f"gateway-{port}.log").open("wb") as log:
        process = subprocess.Popen([sys.executable, *launcher, "gateway", "--config", str(path), "--port", str(port)],
                                   cwd=repo, stdout=log, stderr=subprocess.STDOUT, env=bench_env(repo))
    wait_ok(process, f"http://127.0.0.1:{port}/ready")
    return process, port


def start_local_gateway(log_dir: Path, policy: dict[str, Any] | None = None, *, draft: bool = True,
                        workers: int = 2, cost_cache: Path | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """``specgate serve`` with ``workers`` embedded workers on the demo pair (no draft: plain
    only), as ``make serve`` runs it; the workers' start-up costs cached in ``cost_cache``."""
    models = REPO / "models"
    model = {"name": "specgate-demo", "target": str(models / "demo-target"),
             "draft": str(models / "demo-draft") if draft else None}
    # The workers measure their costs for the default budget, as make serve's do (a shorter
    # one leaves most batch depths extrapolated from batch 1, and K auto prices them so).
    worker_config = {"count": workers, "cost_cache_dir": str(cost_cache or log_dir / "costs")}
    return start_serve_gateway(log_dir, model, worker_config, policy)


@dataclass
class ServerProcess:
    """A server process this machine started on loopback: its URL, and a stop that waits."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, path: str, timeout_s: float) -> None:
        """Returns once ``path`` answers 200; else stops the process and raises (with its log)."""
        try:
            wait_ok(self.process, self.url + path, timeout_s, self.log_path)
        except RuntimeError:
            self.stop()
            raise

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def serve_config(log_dir: Path, config: dict[str, Any], ready_timeout_s: float, *, name: str = "gateway",
                 repo: Path = REPO, cpus: str | None = None) -> subprocess.Popen[bytes]:
    """``specgate serve`` on ``config`` (its ``server.port`` set), written beside its log in
    ``log_dir``; returns once it is ready. ``cpus``: pinned to those cores (taskset's list)."""
    port = config["server"]["port"]
    path = log_dir / f"{name}-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = log_dir / f"{name}-{port}.log"
    with log_path.open("wb") as log:
        pin = ["taskset", "-c", cpus] if cpus is not None else []
        process = subprocess.Popen([*pin, sys.executable, "-m", "gateway", "--config", str(path)], cwd=repo,
                                   stdout=log, stderr=subprocess.STDOUT, env=bench_env(repo))
    try:
        wait_ok(process, f"http://127.0.0.1:{port}/ready", ready_timeout_s, log_path)
    except RuntimeError:
        stop(process)
        raise
    return process


def start_serve_gateway(log_dir: Path, model: dict[str, Any], workers: dict[str, Any],
                        policy: dict[str, Any] | None = None, *, server: dict[str, Any] | None = None,
                        ready_timeout_s: float = 180.0, repo: Path = REPO,
                        auth: dict[str, Any] | None = None, cpus: str | None = None,
                        ) -> tuple[subprocess.Popen[bytes], int]:
    """``specgate serve`` with embedded workers: ``model``, ``workers``, ``policy``, ``auth`` and
    more of ``server`` are those sections of its config; returns once it is ready (a worker is).
    ``repo``: whose code serves (bench.serve_memory compares checkouts); ``cpus``: the gateway
    and its workers pinned to those cores (taskset's list)."""
    port = free_port()
    config = {"server": {**(server or {}), "host": "127.0.0.1", "port": port}, "model": model, "workers": workers,
              "policy": policy or {}, **({"auth": auth} if auth else {})}
    return serve_config(log_dir, config, ready_timeout_s, repo=repo, cpus=cpus), port


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# One short plain completion (T=1.0 under bench.overhead's policy): the sequential benches' request.
SHORT_COMPLETION = {"model": "specgate-demo", "prompt": "[chat] hello there", "max_tokens": 4, "temperature": 1.0}


async def timed_completion(http: aiohttp.ClientSession, url: str, what: str) -> tuple[float, float]:
    """One ``SHORT_COMPLETION`` to ``url``: when it was sent and answered (``time.monotonic``,
    one clock for every process here); raises on any status but 200."""
    sent = time.monotonic()
    async with http.post(url + "/v1/completions", json=SHORT_COMPLETION) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{what}: HTTP {response.status}")
    return sent, time.monotonic()


def print_result(out: dict[str, Any], as_json: bool) -> None:
    """The benches' ``--json`` contract: one JSON object as the last line."""
    if as_json:
        print(json.dumps(out))
    sys.stdout.flush()


def mode_fields(header: str) -> dict[str, str]:
    """``X-Specgate-Mode``'s fields after the mode: ``speculative; method=ngram; k=8;
    reason=default`` -> {"method": "ngram", "k": "8", "reason": "default"}."""
    return dict(part.strip().split("=", 1) for part in header.split(";")[1:] if "=" in part)


def method_of(header: str) -> str:
    """``speculative; method=ngram; k=8; reason=default`` -> ngram; a draft-model decision made
    without methods -> draft; plain -> plain."""
    if not header.startswith("speculative"):
        return "plain"
    return mode_fields(header).get("method", "draft")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
