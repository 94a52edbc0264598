"""What ``make serve``'s deployment holds in memory: each embedded worker's resident set once the
gateway is ready, and again after a short drive.

    python -m bench.serve_memory [--json] [--requests 4] [--repo DIR]

Starts ``specgate serve`` with config.yaml's model, workers and policy sections (the real pair,
two embedded workers) on a free port, waits for ``/ready`` (the time is reported) and for every
worker to be ready, then reads each worker's ``VmRSS`` (pids from ``/admin/workers``). It then
sends ``--requests`` chat completions of one session (64 tokens, T=0) and reads them again: the
K/V cache and the prefix cache commit memory as sequences fill them. ``--repo``: serve another
checkout's code (a worktree of an earlier commit) with this checkout's config and models, to
compare; run both on the same machine, one after the other. ``--json``: the last line is one
JSON object, labelled with the CPU, with ``targets``: ``worker_rss_mib``, the largest worker's
resident set at idle, against 600 MiB.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.procs import REPO, get_json, print_result, served_sections, start_serve_gateway, stop
from workers.costs.cache import cpu_label
from workers.engines.embedded.memory import resident_bytes

# Issue #55: a make-serve worker at idle, the target served from the GGUF's blocks (1,015 MiB before,
# its float32 projections 540 MB of it).
RSS_TARGET_MIB = 600
QUESTIONS = ("What is the capital of France?", "And of Italy?", "Which of the two is larger?", "Name a river in each.")


def chat(url: str, model: str, messages: list[dict[str, str]]) -> str:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 64, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json",
                                                                         "X-Session-ID": "serve-memory"})
    with urllib.request.urlopen(request, timeout=300) as response:
        text: str = json.loads(response.read())["choices"][0]["message"]["content"]
    return text


def measure(requests: int, repo: Path) -> dict[str, Any]:
    model, workers, policy = served_sections()
    with tempfile.TemporaryDirectory(prefix="serve-memory-") as tmp:
        started = time.perf_counter()
        process, port = start_serve_gateway(Path(tmp), model, workers, policy, repo=repo)
        url = f"http://127.0.0.1:{port}"
        try:
            ready_s = time.perf_counter() - started
            deadline = time.monotonic() + 300
            while True:
                listed = get_json(url + "/admin/workers")["workers"]
                if len(listed) == workers.get("count", 1) and all(w["status"] == "ready" for w in listed):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers not ready: {listed}")
                time.sleep(0.5)
            all_ready_s = time.perf_counter() - started
            pids = {w["worker_id"]: int(w["pid"]) for w in listed}
            idle = {w: resident_bytes(pid) / 2**20 for w, pid in pids.items()}
            messages: list[dict[str, str]] = []
            for question in QUESTIONS[:requests]:
                messages.append({"role": "user", "content": question})
                messages.append({"role": "assistant", "content": chat(url, model["name"], messages)})
            driven = {w: resident_bytes(pid) / 2**20 for w, pid in pids.items()}
        finally:
            stop(process)
    return {"ready_s": round(ready_s, 2), "all_workers_ready_s": round(all_ready_s, 2), "requests": requests,
            "workers": {w: {"idle_mib": round(idle[w], 1), "after_requests_mib": round(driven[w], 1)} for w in pids},
            "idle_mib_mean": round(sum(idle.values()) / len(idle), 1),
            "after_requests_mib_mean": round(sum(driven.values()) / len(driven), 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=4, choices=range(0, len(QUESTIONS) + 1))
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose code serves")
    args = parser.parse_args(argv)
    cpu = cpu_label()
    print(f"CPU: {cpu}\nserving {args.repo.resolve()}'s code with config.yaml's model, workers and policy", flush=True)
    figures = measure(args.requests, args.repo.resolve())
    for worker, rss in figures["workers"].items():
        print(f"  {worker}: {rss['idle_mib']:.0f} MiB resident at idle, {rss['after_requests_mib']:.0f} MiB after "
              f"{args.requests} requests")
    print(f"  /ready after {figures['ready_s']:.1f} s, every worker ready after {figures['all_workers_ready_s']:.1f} s")
    command = "python -m bench.serve_memory --json" + (f" --repo {args.repo}" if args.repo != REPO else "")
    worst = max(rss["idle_mib"] for rss in figures["workers"].values())
    targets = {"worker_rss_mib": {"value": worst, "target": RSS_TARGET_MIB, "met": worst <= RSS_TARGET_MIB}}
    print(f"  the largest worker at idle: {worst:.0f} MiB (target <= {RSS_TARGET_MIB})")
    print_result({"bench": "serve_memory", "cpu": cpu, "command": command, **figures, "targets": targets}, args.json)


if __name__ == "__main__":
    main()
