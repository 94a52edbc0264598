"""The processes bench.scaleout runs on loopback: sim workers, `specgate serve` and `specgate epp`
over them, the real Envoy in front (round robin, or asking the picker), and a redis-server.

Each kind is launched without waiting and then waited for, so that a stack of a dozen
processes starts in the time of its slowest, not of their sum.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from bench import procs
from gateway.epp.envoy_config import epp_bootstrap, round_robin_bootstrap, to_yaml

ENVOY_BIN = procs.REPO / ".venv-envoy" / "envoy"  # `make install-envoy`
READY_TIMEOUT_S = 90.0


@dataclass
class Service:
    """A process of the stack and where it answers."""

    name: str
    process: subprocess.Popen[bytes]
    port: int  # HTTP: what clients (or Envoy) talk to
    ready_url: str  # "": a Redis, which answers PING
    log_path: Path
    grpc_port: int | None = None  # specgate epp's ext_proc port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Stack:
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-scaleout-")))
    services: list[Service] = field(default_factory=list)

    def _launch(self, name: str, argv: Sequence[str], port: int, ready_path: str | None,
                grpc_port: int | None = None) -> Service:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(list(argv), cwd=procs.REPO, stdout=log, stderr=subprocess.STDOUT,
                                       env=_environ())
        ready_url = "" if ready_path is None else f"http://127.0.0.1:{port}{ready_path}"
        service = Service(name, process, port, ready_url, log_path, grpc_port)
        self.services.append(service)
        return service

    def sim_worker(self, name: str, sim: dict[str, Any], default_k: int) -> Service:
        """A sim worker on TCP (as bench.procs.start_sim_worker, not waited for)."""
        port = procs.free_port()
        return self._launch(name, [
            sys.executable, "-m", "workers", "--engine", "sim", "--port", str(port), "--worker-id", name,
            "--target", str(procs.TOKENIZER_DIR), "--draft", str(procs.TOKENIZER_DIR), "--max-slots", "256",
            "--max-queue", "1024", "--default-k", str(default_k), "--sim-config", json.dumps(sim)], port, "/health")

    def specgate(self, name: str, command: Literal["serve", "epp"], workers: Sequence[Service],
                 policy: dict[str, Any], state: dict[str, Any] | None = None) -> Service:
        """`specgate serve` (the relay) or `specgate epp` over ``workers`` (protocol specgate,
        ``workers.count: 0``); the same config but for the picker's port."""
        port = procs.free_port()
        config: dict[str, Any] = {
            "server": {"host": "127.0.0.1", "port": port},
            "model": {"name": "specgate-demo", "target": str(procs.TOKENIZER_DIR), "draft": str(procs.TOKENIZER_DIR)},
            "workers": {"count": 0, "remote": [{"url": w.url, "protocol": "specgate", "name": w.name}
                                               for w in workers]},
            "policy": policy,
            "state": state or {"backend": "memory"},
        }
        grpc_port = None
        if command == "epp":
            grpc_port = procs.free_port()
            config["epp"] = {"host": "127.0.0.1", "port": grpc_port}
        path = self.log_dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return self._launch(name, [sys.executable, "-m", "gateway.cli", command, "--config", str(path)], port,
                            "/ready", grpc_port)

    def envoy(self, name: str, bootstrap: dict[str, Any], admin_port: int, port: int) -> Service:
        if not ENVOY_BIN.exists():
            raise RuntimeError(f"{ENVOY_BIN} not found: run `make install-envoy`")
        path = self.log_dir / f"{name}.yaml"
        path.write_text(to_yaml(bootstrap))
        # --base-id: Envoys on one host share memory per base id; the admin port makes it unique.
        # --concurrency 1: one worker thread, as the tests run it on these 2-core machines.
        service = self._launch(name, [str(ENVOY_BIN), "-c", str(path), "--base-id", str(admin_port),
                                      "--concurrency", "1", "--log-level", "warning"], port, None)
        service.ready_url = f"http://127.0.0.1:{admin_port}/ready"
        return service

    def envoy_round_robin(self, name: str, workers: Sequence[Service]) -> Service:
        port, admin = procs.free_port(), procs.free_port()
        bootstrap = round_robin_bootstrap(port, admin, [("127.0.0.1", w.port) for w in workers], health_path="/health")
        return self.envoy(name, bootstrap, admin, port)

    def envoy_epp(self, name: str, picker: Service) -> Service:
        assert picker.grpc_port is not None
        port, admin = procs.free_port(), procs.free_port()
        return self.envoy(name, epp_bootstrap(port, admin, [("127.0.0.1", picker.grpc_port)]), admin, port)

    def floor_picker(self, name: str, endpoint: Service) -> Service:
        """bench.epp_floor: a do-nothing ext_proc picker sending every request to ``endpoint``."""
        port = procs.free_port()
        service = self._launch(name, [sys.executable, "-m", "bench.epp_floor", "--port", str(port),
                                      "--endpoint", f"127.0.0.1:{endpoint.port}"], port, None, grpc_port=port)
        service.ready_url = TCP_READY
        return service

    def redis(self, name: str = "redis") -> Service:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        port = procs.free_port()
        return self._launch(name, [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", str(self.log_dir)], port, None)

    def wait(self, services: Sequence[Service]) -> None:
        """Until each answers: 200 on its ready URL (Envoy: its admin /ready says LIVE), PING (Redis)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for service in services:
            while not _ready(service):
                if service.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{service.name} not ready (exit {service.process.poll()}):\n"
                                       + service.log_path.read_text(errors="replace")[-4000:])
                time.sleep(0.1)

    def stop(self, services: Sequence[Service] | None = None) -> None:
        chosen = list(self.services if services is None else services)
        for service in reversed(chosen):
            procs.stop(service.process)
            with contextlib.suppress(ValueError):
                self.services.remove(service)


TCP_READY = "tcp"  # a gRPC server: ready once it accepts a connection


def _ready(service: Service) -> bool:
    if service.ready_url == TCP_READY:
        try:
            with socket.create_connection(("127.0.0.1", service.port), timeout=1):
                return True
        except OSError:
            return False
    if not service.ready_url:  # redis: PING, inline, no client library
        try:
            with socket.create_connection(("127.0.0.1", service.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False
    try:
        # Envoy's admin /ready is 503 until LIVE (every cluster initialized, first health checks done).
        with urllib.request.urlopen(service.ready_url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _environ() -> dict[str, str]:
    return {k: v for k, v in procs.bench_env().items() if not k.startswith("SPECGATE_")}
