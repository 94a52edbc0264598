"""Which speculation method pays, by workload: multi-turn sessions through real gateway and
worker processes, each configuration of ``policy.methods`` on a fresh worker.

    python -m bench.methods [--quick] [--json] [--max-tokens 128] [--sessions-per-kind N]
                            [--target DIR] [--draft DIR]

The sessions are ``bench/data/method_sessions.jsonl``: code editing (rename, add type hints, fix
a bug in a given function: the answer repeats most of it), RAG (answer with quotes from a given
passage; each session opens with one worked exchange quoting another passage), an agent loop
(tool outputs fed back and partly repeated) and open chat. Each turn is
a chat completion at T=0 carrying the conversation so far (its answers included) and the
session's ``X-Session-ID``, one request at a time (batch 1). The kinds take turns session by
session, so every configuration sees the same interleaved, mixed workload.

Configurations: **plain** (a gateway without the draft), then on the pair's gateway with
``num_speculative_tokens: auto``: **draft**, **ngram**, **suffix** (``policy.methods`` of that
one method) and **choice** (``[draft, ngram, suffix]``: each session chooses,
``policies/speculation.py``). Each runs on a gateway of its own, started for it: the suffix
store keeps the worker's recent outputs, and a worker that had already answered the same
sessions would find every answer there.

Reported per configuration and kind: tokens/s (completion tokens ÷ the requests' wall seconds
at the client, prefill included) and per CPU second of the bench's processes (robust to other
jobs on the core); α and coverage of the lookup methods (from the answers' usage); the method
each session ended on (its last ``X-Specgate-Mode``). Then the targets: the best lookup method
÷ plain on code editing and RAG (≥ 1.5); choice ÷ the best single method over the mixed
workload (≥ 1.1); choice ÷ the best method per kind in hindsight (≥ 0.97).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from tokenizers import Tokenizer

from bench.procs import REPO, cpu_seconds, get_json, method_of, print_result, start_serve_gateway, stop
from bench.tasks import Answer
from bench.tasks import Tally as TaskTally
from workers.costs.cache import cpu_label
from workers.engines.embedded.lookup.ngram import DEFAULT_PROMPT_LOOKUP_MIN

SESSIONS = REPO / "bench" / "data" / "method_sessions.jsonl"
DEFAULT_TARGET = REPO / "models" / "smollm2-135m-instruct-q4_1"
DEFAULT_DRAFT = REPO / "models" / "smollm2-draft"
KINDS = ("code_edit", "rag", "agent", "chat")
LOOKUP_TARGET, CHOICE_TARGET, HINDSIGHT_TARGET = 1.5, 1.1, 0.97
WORKERS: dict[str, Any] = {"count": 1, "threads": 1, "max_slots": 1, "dtype": "float32"}
SERVER: dict[str, Any] = {"worker_timeout_s": 300}
CONFIGS: dict[str, list[str] | None] = {"plain": None, "draft": ["draft"], "ngram": ["ngram"], "suffix": ["suffix"],
                                        "choice": ["draft", "ngram", "suffix"]}


@dataclass(frozen=True)
class Session:
    id: str
    kind: str
    system: str
    turns: tuple[str, ...]
    # Messages between the system prompt and the first turn: a worked exchange that shows the
    # model the answer's form (the RAG sessions' quoting; the 135M model paraphrases when only told).
    examples: tuple[tuple[str, str], ...] = ()


def load_sessions(path: Path = SESSIONS) -> list[Session]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Session(r["id"], r["kind"], r["system"], tuple(r["turns"]),
                    tuple((m["role"], m["content"]) for m in r.get("examples", ()))) for r in rows]


def interleaved(sessions: list[Session], per_kind: int | None, turns: int | None) -> list[Session]:
    """The kinds taking turns session by session, ``per_kind`` of each (None: all), each cut to
    ``turns`` turns (None: all)."""
    by_kind = {k: [s for s in sessions if s.kind == k][:per_kind] for k in KINDS}
    out: list[Session] = []
    for i in range(max(map(len, by_kind.values()))):
        out += [by_kind[k][i] for k in KINDS if i < len(by_kind[k])]
    return [replace(s, turns=s.turns[:turns]) for s in out]


@dataclass
class Tally(TaskTally):
    """bench.tasks' tally, and the method each request ran and each session ended on."""

    methods: Counter[str] = field(default_factory=Counter)  # the method each request ran ("plain" for none)
    ended_on: Counter[str] = field(default_factory=Counter)  # each session's last request's method
    answer_tokens: int = 0  # the answers' tokens, and those a lookup could have copied (``copyable``)
    copyable_tokens: int = 0

    def add(self, answer: Answer) -> None:
        super().add(answer)
        self.methods[method_of(answer.mode)] += 1

    def figures(self) -> dict[str, Any]:
        steps = self.speculative_steps + self.plain_steps
        return {"requests": self.requests, "completion_tokens": self.completion_tokens,
                "tok_s": round(self.tokens_per_s, 2) if self.seconds else None,
                "tok_cpu_s": round(self.tokens_per_cpu_s, 2) if self.cpu_seconds else None,
                "alpha": None if self.alpha is None else round(self.alpha, 3),
                "proposing_steps": round(self.speculative_steps / steps, 3) if steps else None,
                "copyable": round(self.copyable_tokens / self.answer_tokens, 3) if self.answer_tokens else None,
                "methods": dict(self.methods), "ended_on": dict(self.ended_on)}


def copyable(context: list[int], answer: list[int], n: int = DEFAULT_PROMPT_LOOKUP_MIN) -> int:
    """The answer's tokens that the most recent earlier occurrence of the n tokens before each
    (in the context or the answer so far) is followed by: what prompt lookup at its shortest
    match would propose first. Text that is not there to copy bounds every lookup method."""
    tokens, hits = context + answer, 0
    last: dict[tuple[int, ...], int] = {}  # each n-gram's latest position: the token after it
    for i in range(n, len(tokens)):
        key = tuple(tokens[i - n:i])
        if i >= len(context) and key in last and tokens[last[key]] == tokens[i]:
            hits += 1
        last[key] = i
    return hits


async def run_config(url: str, model: str, sessions: list[Session], max_tokens: int, pids: list[int],
                     prefix: str, tokenizer: Tokenizer) -> dict[str, Tally]:
    def cpu_now() -> float:
        return sum(cpu_seconds(pid) for pid in pids) + time.process_time()

    tallies = {k: Tally() for k in KINDS}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        for session in sessions:
            messages: list[dict[str, str]] = [{"role": "system", "content": session.system},
                                              *({"role": r, "content": c} for r, c in session.examples)]
            header = ""
            for turn in session.turns:
                messages.append({"role": "user", "content": turn})
                body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens}
                started, cpu_started = time.perf_counter(), cpu_now()
                async with http.post(url + "/v1/chat/completions", json=body,
                                     headers={"X-Session-ID": f"{prefix}-{session.id}"}) as response:
                    answer = await response.json()
                    if response.status != 200:
                        raise RuntimeError(f"{session.id}: HTTP {response.status}: {answer}")
                    header = response.headers.get("X-Specgate-Mode", "")
                tally, text = tallies[session.kind], answer["choices"][0]["message"]["content"]
                tally.add(Answer(answer, header, time.perf_counter() - started, cpu_now() - cpu_started))
                said = tokenizer.encode(text, add_special_tokens=False).ids
                context = tokenizer.encode("\n".join(m["content"] for m in messages), add_special_tokens=False).ids
                tally.answer_tokens += len(said)
                tally.copyable_tokens += copyable(context, said)
                messages.append({"role": "assistant", "content": text})
            tallies[session.kind].ended_on[method_of(header)] += 1
    return tallies


def start(args: argparse.Namespace, log_dir: Path, methods: list[str] | None) -> tuple[Any, str, list[int]]:
    model = {"name": args.target.name, "target": str(args.target.resolve()),
             "draft": None if methods is None else str(args.draft.resolve())}
    policy = None if methods is None else {"num_speculative_tokens": "auto", "methods": methods}
    process, port = start_serve_gateway(log_dir, model, WORKERS, policy, server=SERVER, ready_timeout_s=300)
    url = f"http://127.0.0.1:{port}"
    pids = [process.pid, *(int(w["pid"]) for w in get_json(url + "/admin/workers")["workers"])]
    return process, url, pids


def total(tallies: dict[str, Tally], kinds: tuple[str, ...] = KINDS) -> tuple[int, float, float]:
    return (sum(tallies[k].completion_tokens for k in kinds), sum(tallies[k].seconds for k in kinds),
            sum(tallies[k].cpu_seconds for k in kinds))


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if a and b else None


def targets(runs: dict[str, dict[str, Tally]]) -> dict[str, Any]:
    """The issue's three targets, by wall time and by CPU time."""
    out: dict[str, Any] = {}
    for clock, index in (("wall", 1), ("cpu", 2)):
        def speed(config: str, kinds: tuple[str, ...] = KINDS, i: int = index) -> float:
            figures = total(runs[config], kinds)
            return figures[0] / figures[i] if figures[i] else 0.0
        singles = [c for c in ("draft", "ngram", "suffix") if c in runs]
        lookups = [c for c in ("ngram", "suffix") if c in runs]
        best_lookup = {k: max((speed(c, (k,)) for c in lookups), default=0.0) for k in ("code_edit", "rag")}
        best_single = max((speed(c) for c in singles), default=0.0)
        # In hindsight: each kind on its best method (plain included), the times summed.
        hindsight_s = sum(min((total(runs[c], (k,))[index] for c in ["plain", *singles] if c in runs
                               and total(runs[c], (k,))[index] > 0), default=0.0) for k in KINDS)
        hindsight = total(runs["plain"])[0] / hindsight_s if hindsight_s else 0.0
        out[clock] = {
            "lookup_over_plain": {k: ratio(v, speed("plain", (k,))) for k, v in best_lookup.items()},
            "choice_over_best_single": ratio(speed("choice"), best_single) if "choice" in runs else None,
            "choice_over_hindsight": ratio(speed("choice"), hindsight) if "choice" in runs else None,
        }
        row = out[clock]
        row["met"] = {"lookup_1.5x_plain": all((v or 0) >= LOOKUP_TARGET for v in row["lookup_over_plain"].values()),
                      "choice_1.1x_best_single": (row["choice_over_best_single"] or 0) >= CHOICE_TARGET,
                      "choice_0.97x_hindsight": (row["choice_over_hindsight"] or 0) >= HINDSIGHT_TARGET}
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 session per kind, 1 turn, 8 tokens")
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    parser.add_argument("--max-tokens", type=int, help="per request (default 128; --quick: 8)")
    parser.add_argument("--sessions-per-kind", type=int, help="(default: all; --quick: 1)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated among {', '.join(CONFIGS)}")
    parser.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    parser.add_argument("--draft", type=Path, default=DEFAULT_DRAFT)
    args = parser.parse_args(argv)
    args.max_tokens = args.max_tokens or (8 if args.quick else 128)
    args.sessions_per_kind = args.sessions_per_kind or (1 if args.quick else None)
    args.turns = 1 if args.quick else None
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or "plain" not in args.configs:
        parser.error(f"--configs: unknown {unknown}" if unknown else "--configs must include plain")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python -m bench.methods" + "".join(" " + shlex.quote(a) for a in (sys.argv[1:] if argv is None
                                                                                   else argv))
    sessions = interleaved(load_sessions(), args.sessions_per_kind, args.turns)
    print(f"CPU: {cpu_label()}\n{command}\ntarget {args.target}, draft {args.draft}; {len(sessions)} sessions, "
          f"{sum(len(s.turns) for s in sessions)} requests per configuration, {args.max_tokens} tokens", flush=True)
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-methods-"))
    started = time.monotonic()
    runs: dict[str, dict[str, Tally]] = {}
    try:
        for name in args.configs:
            process, url, pids = start(args, log_dir, CONFIGS[name])
            try:
                runs[name] = asyncio.run(run_config(url, args.target.name, sessions, args.max_tokens, pids, name,
                                                    tokenizer))
            finally:
                stop(process)
            tokens, seconds, _ = total(runs[name])
            print(f"{name:>7}: {tokens} tokens in {seconds:.1f} s ({tokens / seconds:.1f} tok/s)", flush=True)
    except BaseException:
        print(f"bench.methods failed: the gateways' logs are in {log_dir}", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(log_dir, ignore_errors=True)
    figures = {name: {k: tally.figures() for k, tally in tallies.items() if tally.requests}
               for name, tallies in runs.items()}
    print(f"\n{'kind':<10}" + "".join(f"{name:>10}" for name in runs) + "   (tok/s; α; ended on)")
    for kind in KINDS:
        cells = [figures[n].get(kind, {}) for n in runs]
        print(f"{kind:<10}" + "".join(f"{c.get('tok_s') or 0:>10.1f}" for c in cells)
              + "   " + "; ".join(f"{n}: α {c.get('alpha')} {c.get('ended_on')}" for n, c in zip(runs, cells,
                                                                                                 strict=True)))
    result = targets(runs)
    print(json.dumps(result, indent=1))
    out = {"bench": "methods", "cpu": cpu_label(), "command": command, "target": str(args.target),
           "draft": str(args.draft), "max_tokens": args.max_tokens, "sessions": len(sessions),
           "requests_per_config": sum(len(s.turns) for s in sessions), "configs": {n: CONFIGS[n] for n in runs},
           "figures": figures, "targets": result, "wall_s": round(time.monotonic() - started, 1)}
    print_result(out, args.json)


if __name__ == "__main__":
    main()
