"""A real redis-server on loopback for tests (``state.backend: redis``).

Redis comes from the system (Debian: ``apt-get install redis-server``; ``.ci/run`` installs
it). A test that needs it and does not find it fails with that hint rather than skipping: a
shared-state test that silently does not run tests nothing.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.procs import free_port


def require_redis_server() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.fail("redis-server is not installed: the shared session state tests need a real Redis "
                    "(Debian: apt-get install redis-server; .ci/run installs it)", pytrace=False)
    return path


def ping(port: int, timeout_s: float = 1.0) -> bool:
    """Whether a Redis answers PING on the port (inline command: no client library involved)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    directory: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    extra_args: tuple[str, ...] = ()  # more redis-server options (a Unix socket, ...)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.directory / f"redis-{self.port}.log"

    def start(self, timeout_s: float = 30.0) -> None:
        """Starts (or starts again, on the same port) and waits for PING; nothing persisted."""
        assert self.process is None or self.process.poll() is not None, "already running"
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [require_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.directory), *self.extra_args],
                cwd=self.directory, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING:\n"
                                   + self.log_path.read_text(errors="replace"))
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_redis(directory: Path, extra_args: tuple[str, ...] = ()) -> RedisServer:
    server = RedisServer(directory, extra_args=extra_args)
    server.start()
    return server
