"""K auto against the fixed default K and plain only, measured as users measure a server:
vLLM's own bench client and sessions that carry ``X-Session-ID``.

    python -m bench.serve_modes [--quick] [--json] [--rounds N]

Three gateways, each ``specgate serve`` with two embedded workers on the demo pair, in turn:
``auto`` (``num_speculative_tokens: auto``), ``fixed`` (the default K=6) and ``plain`` (no draft).
Against each, at concurrency 1 and 16:
- ``vllm bench serve --backend openai --endpoint /v1/completions --dataset-name custom
  --dataset-path bench/data/code_prompts.jsonl --skip-chat-template --custom-output-len 64
  --temperature 0 --tokenizer models/demo-target`` (``bench.vllm_bench_client``, from the vLLM
  environment: ``make install-vllm``); every request is a new session to the gateway;
- ``bench.sessions``: sessions of four requests each carrying its ``X-Session-ID`` (T=0, 64 tokens).

Figures are output tokens/s; the targets are auto ≥ 0.97 × the better of fixed and plain, in
each cell. Rounds alternate the order of the gateways; a cell's figure is its mean over rounds.
``--json``: the last line is one JSON object, labelled with the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.procs import REPO, start_local_gateway, stop
from bench.prompts import CODE_PROMPTS, load_prompts, sessions_of
from bench.sessions import run_sessions
from workers.costs.cache import cpu_label

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CONFIGS: dict[str, tuple[dict[str, Any], bool]] = {  # name -> (policy, with a draft)
    "auto": ({"num_speculative_tokens": "auto"}, True),
    "fixed": ({}, True),
    "plain": ({}, False),
}
CONCURRENCY = (1, 16)
TARGET = 0.97


def vllm_client(port: int, concurrency: int, prompts: int, *, model: str = "specgate-demo",
                dataset: Path = CODE_PROMPTS, tokenizer: Path = REPO / "models/demo-target",
                chat_template: bool = False) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its JSON figures. ``chat_template``: the client applies the
    tokenizer's chat template to each prompt (a chat model's prompts); else it sends them as text."""
    command = [str(VLLM_PYTHON), "-m", "bench.vllm_bench_client", "--base-url", f"http://127.0.0.1:{port}",
               "--backend", "openai", "--endpoint", "/v1/completions", "--model", model,
               "--dataset-name", "custom", "--dataset-path", str(dataset),
               "--custom-output-len", "64", "--temperature", "0", "--tokenizer", str(tokenizer),
               "--max-concurrency", str(concurrency), "--num-prompts", str(prompts), "--seed", "0"]
    if not chat_template:
        command.append("--skip-chat-template")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)
    for line in done.stdout.splitlines():
        if line.startswith('{"date"'):
            figures: dict[str, Any] = json.loads(line)
            return figures
    raise RuntimeError(f"vllm bench serve printed no result (exit {done.returncode}):\n{done.stdout[-3000:]}"
                       f"\n{done.stderr[-3000:]}")


def session_driver(port: int, concurrency: int, sessions: int, tag: str) -> dict[str, Any]:
    plan = sessions_of(load_prompts(), sessions)
    started = time.perf_counter()
    runs = asyncio.run(run_sessions(f"http://127.0.0.1:{port}", plan, model="specgate-demo", max_tokens=64,
                                    temperature=0.0, concurrency=concurrency, prefix=f"{tag}-"))
    wall = time.perf_counter() - started
    tokens = sum(r.completion_tokens for r in runs)
    return {"output_throughput": tokens / wall, "completed": sum(len(r.modes) for r in runs), "failed": 0,
            "modes": sorted({m.split(";")[0] + (";" + m.split(";")[1] if ";" in m else "") for r in runs
                             for m in r.modes})}


def measure(name: str, round_no: int, log_dir: Path, quick: bool) -> dict[str, dict[str, Any]]:
    policy, draft = CONFIGS[name]
    process, port = start_local_gateway(log_dir, policy, draft=draft, cost_cache=log_dir / "costs")
    out: dict[str, dict[str, Any]] = {}
    try:
        session_driver(port, 4, 4, f"warm{round_no}")  # worker caches and the workers' estimates
        for concurrency in CONCURRENCY:
            prompts = (16 if quick else 48) * (1 if concurrency == 1 else 3)
            out[f"vllm_c{concurrency}"] = vllm_client(port, concurrency, prompts)
            sessions = (4 if quick else 12) * (1 if concurrency == 1 else 3)
            out[f"sessions_c{concurrency}"] = session_driver(port, concurrency, sessions, f"r{round_no}c{concurrency}")
    finally:
        stop(process)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: run make install-vllm (vLLM's bench client lives there)")
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in CONFIGS}
    failed = 0
    with tempfile.TemporaryDirectory(prefix="bench-serve-modes-") as tmp:
        for round_no in range(args.rounds):
            order = list(CONFIGS) if round_no % 2 == 0 else list(CONFIGS)[::-1]
            for name in order:
                for cell, result in measure(name, round_no, Path(tmp), args.quick).items():
                    figures[name].setdefault(cell, []).append(float(result["output_throughput"]))
                    failed += int(result.get("failed") or 0)
                    print(f"round {round_no} {name:5s} {cell:12s} {result['output_throughput']:8.1f} tok/s"
                          + (f"  {result['modes']}" if "modes" in result else ""), flush=True)
    mean = {name: {cell: round(statistics.mean(v), 1) for cell, v in cells.items()} for name, cells in figures.items()}
    targets = {}
    for cell in mean["auto"]:
        best = max(mean["fixed"][cell], mean["plain"][cell])
        ratio = mean["auto"][cell] / best
        targets[f"{cell}_auto_over_better_of_fixed_and_plain"] = {"ratio": round(ratio, 3), "min": TARGET,
                                                                   "met": ratio >= TARGET}
    out = {"cpu": cpu_label(), "rounds": args.rounds, "output_tokens_per_s": mean, "failed_requests": failed,
           "targets": targets}
    for name, target in targets.items():
        print(f"target {name}: {target}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
