"""``make serve``'s default config against plain-only and speculative-only, on the real pair,
measured with vLLM's own bench client.

    python -m bench.serve_default [--quick] [--json] [--rounds N]

Three gateways, each ``specgate serve`` on config.yaml's model, workers and policy sections
(SmolLM2-135M-Instruct with its distilled draft, two embedded workers), in turn:
- ``default``: config.yaml as it is;
- ``plain``: no draft;
- ``speculative``: the draft model at a fixed K that never falls back (no acceptance floor, no
  batch or temperature limit): config.yaml's K, or K=2 where config.yaml's is auto.

Against each, at concurrency 1 and 16: ``vllm bench serve --backend openai --endpoint
/v1/completions --dataset-name custom --dataset-path bench/data/task_prompts.jsonl
--custom-output-len 64 --temperature 0 --tokenizer models/smollm2-135m-instruct-q4_1``
(``bench.vllm_bench_client`` from the vLLM environment: ``make install-vllm``). The client applies
the model's chat template to each prompt, as it does for any chat model. Every request is a new
session to the gateway.

Figures: output tokens/s; beside each speculative cell, α (accepted ÷ tested drafts, from the
gateway's counters over that run) and the tokens decoded speculatively; per config, the workers'
measured c (a draft forward ÷ a target forward at depth 1) and verify ratio (the target verifying
K+1 tokens ÷ one). The target: default ≥ 0.97 × the better of plain and speculative, in each
cell. Rounds alternate the order of the gateways; a cell's figure is its mean over rounds.
``--json``: the last line is one JSON object, labelled with the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.procs import REPO, free_port, get_json, serve_config, served_sections, stop
from bench.serve_modes import VLLM_PYTHON, vllm_client
from workers.costs.cache import cpu_label

TASK_PROMPTS = REPO / "bench" / "data" / "task_prompts.jsonl"
CONCURRENCY = (1, 16)
TARGET = 0.97
NEVER_FALL_BACK = {"acceptance_floor": 0.0, "acceptance_resume": 0.0, "max_batch": 100_000, "batch_resume": 99_999,
                   "max_temperature": 2.0}
SPECULATIVE_K_FOR_AUTO = 2
CONFIGS = ("default", "plain", "speculative")


def gateway_config(name: str, port: int, cost_cache: Path, policy_changes: dict[str, Any]) -> dict[str, Any]:
    """config.yaml's model, workers and policy sections as ``name`` (and ``--policy``) change them."""
    model, workers, policy = served_sections()
    workers |= {"cost_cache_dir": str(cost_cache)}
    policy |= policy_changes
    if name == "plain":
        model["draft"] = model["eagle3"] = None
    elif name == "speculative":
        # Always the draft at a fixed K: config.yaml's K, or where that is auto, the real pair's best
        # fixed K at batch 1 (bench.engine, docs/measured.md). With K auto every request of vLLM's
        # client is a new session priced on a prior shrunk towards acceptance_resume, 0 here, and
        # the "speculative" gateway decoded plain throughout.
        policy |= NEVER_FALL_BACK | {"methods": ["draft"]}
        if policy.get("num_speculative_tokens") == "auto":
            policy["num_speculative_tokens"] = SPECULATIVE_K_FOR_AUTO
    return {"server": {"host": "127.0.0.1", "port": port}, "model": model, "workers": workers, "policy": policy}


def start(name: str, log_dir: Path,
          policy_changes: dict[str, Any]) -> tuple[subprocess.Popen[bytes], int, dict[str, Any]]:
    port = free_port()
    config = gateway_config(name, port, log_dir / "costs", policy_changes)
    return serve_config(log_dir, config, 300, name=name), port, config


def counters(port: int) -> dict[str, float]:
    """The gateway's draft counters and tokens by mode, summed over workers."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    wanted = {"specgate_spec_decode_accepted_by_position": "accepted", "specgate_spec_decode_tested_drafts": "tested",
              "specgate_spec_decode_drafted_by_position": "proposed"}
    out = {"accepted": 0.0, "tested": 0.0, "proposed": 0.0, "tokens_speculative": 0.0, "tokens_plain": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            base = sample.name.removesuffix("_total")
            if base in wanted:
                out[wanted[base]] += sample.value
            elif base == "specgate_tokens" and sample.labels.get("mode") in ("speculative", "plain"):
                out[f"tokens_{sample.labels['mode']}"] += sample.value
    return out


def worker_costs(port: int, k: int) -> dict[str, float | None]:
    """c and the verify ratio at ``k`` from the first ready worker's measured cost model."""
    workers = get_json(f"http://127.0.0.1:{port}/admin/workers")["workers"]
    model = next((w["cost_model"] for w in workers if w.get("cost_model")), None)
    if model is None:
        return {"c": None, "verify_ratio": None}
    verify = model["verify_cost"][0] if model.get("verify_cost") else None
    return {"c": model["draft_cost"][0] if model.get("draft_cost") else None,
            "verify_ratio": verify[min(k, len(verify) - 1)] if verify else None}


def run_client(port: int, model: str, concurrency: int, prompts: int, dataset: Path) -> dict[str, Any]:
    return vllm_client(port, concurrency, prompts, model=model, dataset=dataset,
                       tokenizer=REPO / "models/smollm2-135m-instruct-q4_1", chat_template=True)


def measure(name: str, log_dir: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    quick, dataset = args.quick, args.dataset_path
    process, port, config = start(name, log_dir, args.policy)
    k_setting = config["policy"].get("num_speculative_tokens", 6)
    model, k = config["model"]["name"], int(k_setting) if k_setting != "auto" else 6
    out: dict[str, dict[str, Any]] = {}
    try:
        run_client(port, model, 2, 4, dataset)  # warm-up: the workers' first prefills and caches
        for concurrency in CONCURRENCY:
            before = counters(port)
            prompts = (8 if quick else 24) * (1 if concurrency == 1 else 4)
            result = run_client(port, model, concurrency, prompts, dataset)
            after = counters(port)
            delta = {key: after[key] - before[key] for key in after}
            decoded = delta["tokens_speculative"] + delta["tokens_plain"]
            out[f"c{concurrency}"] = {
                "output_throughput": float(result["output_throughput"]), "failed": int(result.get("failed") or 0),
                "alpha": round(delta["accepted"] / delta["tested"], 4) if delta["tested"] else None,
                "speculative_share": round(delta["tokens_speculative"] / decoded, 3) if decoded else None,
                **worker_costs(port, k)}
    finally:
        stop(process)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer prompts, one round (a smoke run)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dataset-path", type=Path, default=TASK_PROMPTS, help="JSONL of {\"prompt\": ...}")
    parser.add_argument("--policy", type=json.loads, default={},
                        help="changes to config.yaml's policy for every gateway, a JSON object (exploring)")
    parser.add_argument("--only", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="configs to run")
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: run make install-vllm (vLLM's bench client lives there)")
    rounds = 1 if args.quick else args.rounds
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {} for name in args.only}
    with tempfile.TemporaryDirectory(prefix="bench-serve-default-") as tmp:
        for round_no in range(rounds):
            for name in args.only if round_no % 2 == 0 else args.only[::-1]:
                for cell, figures in measure(name, Path(tmp), args).items():
                    runs[name].setdefault(cell, []).append(figures)
                    print(f"round {round_no} {name:11s} {cell:3s} {figures['output_throughput']:7.1f} tok/s  "
                          f"alpha {figures['alpha']}  speculative share {figures['speculative_share']}  "
                          f"c {figures['c']}  verify {figures['verify_ratio']}", flush=True)
    table = {name: {cell: summary(figures) for cell, figures in cells.items()} for name, cells in runs.items()}
    targets = {}
    for cell in table["default"] if set(CONFIGS) <= set(table) else ():
        best = max(table["plain"][cell]["output_throughput"], table["speculative"][cell]["output_throughput"])
        ratio = table["default"][cell]["output_throughput"] / best
        targets[f"{cell}_default_over_better_of_plain_and_speculative"] = {
            "ratio": round(ratio, 3), "min": TARGET, "met": ratio >= TARGET}
    for name, target in targets.items():
        print(f"target {name}: {target}")
    if args.json:
        print(json.dumps({"cpu": cpu_label(), "rounds": rounds, "policy_changes": args.policy, "table": table,
                          "targets": targets,
                          "failed_requests": sum(f["failed"] for c in runs.values() for v in c.values() for f in v)}))


def summary(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """A cell over rounds: mean throughput; the rest from the rounds that have them."""
    def mean(key: str) -> float | None:
        values = [f[key] for f in figures if f[key] is not None]
        return round(statistics.mean(values), 4) if values else None

    return {"output_throughput": round(statistics.mean(f["output_throughput"] for f in figures), 1),
            "alpha": mean("alpha"), "speculative_share": mean("speculative_share"), "c": mean("c"),
            "verify_ratio": mean("verify_ratio"), "failed": sum(f["failed"] for f in figures)}


if __name__ == "__main__":
    main()
