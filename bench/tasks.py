"""Acceptance by task on real text: the real pair, through real gateway and worker processes,
on each class of bench/data/task_prompts.jsonl (code, json, math, chat).

    python -m bench.tasks [--quick | --smoke] [--json] [--max-tokens 64] [--prompts-per-class 25]
                          [--fixed-k 2,3,5] [--temperatures 0,1] [--target DIR] [--draft DIR] [--eagle3 DIR|none]

Two gateways (``specgate serve``), each with one embedded worker (``threads: 1``, one slot,
``dtype: auto`` as make serve's): one serves the pair, the other the target alone (no draft loaded: plain decoding, what
a server without speculation runs). Chat completions go one at a time (batch 1), each
configuration a session of its own per class and temperature (``X-Session-ID``):

- ``plain``: the draft-less gateway;
- ``K=k`` for each ``--fixed-k`` (5 always among them): the pair's gateway with
  ``num_speculative_tokens: k`` and the rules that would stop it off (``acceptance_floor: 0``,
  ``max_temperature: 2``): every request drafts k a step, as a static K does;
- ``eagle3 K=k`` for each ``--fixed-k``, where the pair's workers have an EAGLE-3 head (``--eagle3``,
  default models/smollm2-eagle3): the same with ``methods: [eagle3]``;
- ``auto``: config.yaml's policy, as ``make serve`` runs it, with ``num_speculative_tokens: auto``
  and the model methods alone (``AUTO_METHODS``: the draft and the head; ``--auto-policy`` changes fields).

The pair's gateway moves between them with ``PUT /admin/policy`` before each request whose
configuration is not the last one's. Prompt by prompt, the classes take turns, and each class
asks every configuration, the order rotated by one each time (drift spreads over all of them).
At T=1 each request carries a ``seed`` (the prompt's), the same for every configuration.

Per class and temperature: α at K=5 (accepted ÷ tested drafts over the K=5 requests'
``usage.speculative``: the per-draft acceptance the floor reads, docs/policy.md), and at each
fixed K; what auto chose (``X-Specgate-Mode`` counted per request) and its plain share (steps the
worker decoded plain ÷ all its steps: a worker given a K may still decode plain where the
draft's catch-up would not pay); tokens/s of each configuration (completion tokens ÷ the
requests' wall seconds at the client, prefill included); the best fixed K; and auto ÷ the better
of plain and the best fixed K against the target, ``TARGET``. ``--json``: one JSON object as the
last line, labelled with the CPU.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.procs import REPO, cpu_seconds, get_json, mode_fields, print_result, start_serve_gateway, stop
from bench.prompts import load_task_prompts
from workers.costs.cache import cpu_label

TARGET = 0.97  # auto >= this x the better of plain and the best fixed K, in every class
ALPHA_K = 5  # the K α is reported at
FLOOR = 0.60  # policy.acceptance_floor's default: below it, auto should fall back to plain
DEFAULT_TARGET = REPO / "models" / "smollm2-135m-instruct-q4_1"
DEFAULT_DRAFT = REPO / "models" / "smollm2-draft"
DEFAULT_EAGLE3 = REPO / "models" / "smollm2-eagle3"
EAGLE3_ALPHA_TARGET = 0.70  # issue #54: the head's α at K=5, T=0, on code and on JSON
WARMUP_PROMPT = "Say hello in three languages."  # not in the prompt set
# The pair serves on one thread, one sequence at a time, in the precision make serve's workers
# measure fastest (dtype auto: the GGUF's blocks where make install laid them out, the float32
# conversion's function either way, so α does not depend on it); the plain gateway the same target
# the same way.
WORKERS: dict[str, Any] = {"count": 1, "threads": 1, "max_slots": 1, "dtype": "auto"}
# A shared machine can stall a worker past the default 60 s (memory pressure from other jobs):
# the bench would rather wait than fail.
SERVER: dict[str, Any] = {"worker_timeout_s": 300}
FIXED_RULES_OFF: dict[str, Any] = {"acceptance_floor": 0.0, "acceptance_resume": 0.0, "max_temperature": 2.0}


@dataclass(frozen=True)
class Setup:
    """One configuration: its name and the pair's policy (None: the plain gateway)."""
    name: str
    policy: dict[str, Any] | None


# auto proposes with the draft model only, unless --auto-policy says otherwise: every configuration
# answers the same prompt on the same worker, and a lookup method (config.yaml's methods) would copy
# the earlier configurations' answers from the worker's suffix store. (It did: auto ran 1.6-2.3x the
# best fixed K at T=0 on suffix proposals.) bench.methods measures the methods, each on a fresh worker.
AUTO_METHODS: dict[str, Any] = {"methods": ["draft"]}
EAGLE3_PREFIX = "eagle3 "  # a configuration of the head's: "eagle3 K=5"


def setups(fixed_ks: list[int], auto: dict[str, Any] | None = None, eagle3: bool = False) -> list[Setup]:
    """plain, each fixed K (the draft's, then the head's where there is one), and auto: config.yaml's
    own policy (what ``make serve`` runs) with ``num_speculative_tokens: auto`` and the model methods
    alone (``AUTO_METHODS``, and eagle3 where there is a head), updated with ``auto``."""
    fixed = [Setup(f"K={k}", {"num_speculative_tokens": k, **FIXED_RULES_OFF}) for k in fixed_ks]
    if eagle3:
        fixed += [Setup(f"{EAGLE3_PREFIX}K={k}", {"num_speculative_tokens": k, "methods": ["eagle3"],
                                                  **FIXED_RULES_OFF}) for k in fixed_ks]
    served = yaml.safe_load((REPO / "config.yaml").read_text()).get("policy") or {}
    methods = {"methods": [*AUTO_METHODS["methods"], *(["eagle3"] if eagle3 else [])]}
    return [Setup("plain", None), *fixed,
            Setup("auto", {**served, "num_speculative_tokens": "auto", **methods, **(auto or {})})]


def decision_label(header: str) -> str:
    """``X-Specgate-Mode`` shortened: "K=5", "tree 2+3", "plain (no_gain)", "suffix K=8"; a
    speculative decision's reason is added where it is not the default ("K=1 (probe)"), its
    method where it is not the draft model."""
    parts = mode_fields(header)
    reason = parts.get("reason", "")
    if header.startswith("plain"):
        return f"plain ({reason})"
    label = f"tree {parts['tree']}" if "tree" in parts else f"K={parts.get('k', '?')}"
    if parts.get("method", "draft") != "draft":
        label = f"{parts['method']} {label}"
    return label if reason in ("default", "") else f"{label} ({reason})"


@dataclass(frozen=True)
class Answer:
    body: dict[str, Any]
    mode: str  # X-Specgate-Mode
    seconds: float  # wall, at the client
    cpu_seconds: float  # the CPU time every process of the bench spent meanwhile (Gateways.pids, this one)


@dataclass
class Tally:
    """What one session (class, configuration, temperature) was answered, summed."""
    requests: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    proposed: int = 0
    accepted: int = 0
    tested: int = 0
    speculative_steps: int = 0
    plain_steps: int = 0
    decisions: Counter[str] = field(default_factory=Counter)

    def add(self, answer: Answer) -> None:
        usage = answer.body["usage"]
        speculative = usage.get("speculative") or {}
        self.requests += 1
        self.completion_tokens += int(usage["completion_tokens"])
        self.seconds += answer.seconds
        self.cpu_seconds += answer.cpu_seconds
        for name in ("proposed", "accepted", "tested", "speculative_steps", "plain_steps"):
            setattr(self, name, getattr(self, name) + int(speculative.get(name) or 0))
        self.decisions[decision_label(answer.mode)] += 1

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.completion_tokens / self.cpu_seconds if self.cpu_seconds else 0.0

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.tested if self.tested else None

    @property
    def plain_step_share(self) -> float:
        steps = self.speculative_steps + self.plain_steps
        return self.plain_steps / steps if steps else 1.0


@dataclass
class Gateways:
    """The two gateways' roots, and the policy the pair's now runs (switched as requests need)."""
    pair: str
    plain: str
    model: str
    pids: list[int] = field(default_factory=list)  # both gateways and their workers
    active: dict[str, Any] | None = None

    def cpu_seconds(self) -> float:
        """CPU time of every process of the bench so far: on one core, what a request's wall time
        would be with nothing else running there."""
        return sum(cpu_seconds(pid) for pid in self.pids) + time.process_time()

    def url(self, setup: Setup) -> str:
        return self.plain if setup.policy is None else self.pair


class Client:
    """Asks the gateways, one request at a time."""

    def __init__(self, http: aiohttp.ClientSession, gateways: Gateways, max_tokens: int) -> None:
        self.http, self.gateways, self.max_tokens = http, gateways, max_tokens

    async def use(self, setup: Setup) -> None:
        if setup.policy is None or setup.policy == self.gateways.active:
            return
        async with self.http.put(self.gateways.pair + "/admin/policy", json=setup.policy) as response:
            if response.status != 200:
                raise RuntimeError(f"PUT /admin/policy {setup.policy}: HTTP {response.status}: {await response.text()}")
        self.gateways.active = setup.policy

    async def ask(self, setup: Setup, session_id: str, prompt: str, temperature: float,
                  seed: int | None, max_tokens: int | None = None) -> Answer:
        """One chat completion, timed."""
        await self.use(setup)
        body: dict[str, Any] = {"model": self.gateways.model, "messages": [{"role": "user", "content": prompt}],
                                "temperature": temperature, "max_tokens": max_tokens or self.max_tokens}
        if seed is not None:
            body["seed"] = seed
        started, cpu_started = time.perf_counter(), self.gateways.cpu_seconds()
        async with self.http.post(self.gateways.url(setup) + "/v1/chat/completions", json=body,
                                  headers={"X-Session-ID": session_id}) as response:
            answer: dict[str, Any] = await response.json()
            seconds = time.perf_counter() - started
            if response.status != 200:
                raise RuntimeError(f"{session_id}: HTTP {response.status}: {answer}")
            return Answer(answer, response.headers.get("X-Specgate-Mode", ""), seconds,
                          self.gateways.cpu_seconds() - cpu_started)

    async def admin_session(self, session_id: str) -> dict[str, Any]:
        async with self.http.get(f"{self.gateways.pair}/admin/sessions/{session_id}") as response:
            found: dict[str, Any] = await response.json()
            return found


def session_id(class_name: str, setup: Setup, temperature: float) -> str:
    return f"tasks-{class_name}-{setup.name.replace('=', '').replace(' ', '-')}-t{temperature:g}"


@dataclass
class Run:
    """Every session's tally, by (temperature, class, configuration), and the T=0 texts."""
    tallies: dict[tuple[float, str, str], Tally] = field(default_factory=dict)
    texts_t0: dict[tuple[str, int], set[str]] = field(default_factory=dict)  # (class, prompt): every answer
    admin: dict[str, dict[str, Any]] = field(default_factory=dict)  # /admin/sessions/{id}, the pair's


async def measure(gateways: Gateways, prompts: dict[str, list[str]], plan: list[Setup], temperatures: list[float],
                  max_tokens: int) -> Run:
    """Every prompt of every class, every configuration, at each temperature (module docstring)."""
    run = Run()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        client = Client(http, gateways, max_tokens)
        for setup in (plan[0], next(s for s in plan if s.name == f"K={ALPHA_K}")):  # caches, allocator, kernels
            await client.ask(setup, f"tasks-warmup-{setup.name}", WARMUP_PROMPT, 0.0, None, min(16, max_tokens))
        per_class = max(len(texts) for texts in prompts.values())
        for temperature in temperatures:
            for index in range(per_class):
                for class_no, (class_name, texts) in enumerate(prompts.items()):
                    if index >= len(texts):
                        continue
                    turn = (index * len(prompts) + class_no) % len(plan)
                    for setup in plan[turn:] + plan[:turn]:
                        sid = session_id(class_name, setup, temperature)
                        seed = 1 + class_no * 1000 + index if temperature > 0 else None
                        answer = await client.ask(setup, sid, texts[index], temperature, seed)
                        run.tallies.setdefault((temperature, class_name, setup.name), Tally()).add(answer)
                        if temperature == 0:
                            text = str(answer.body["choices"][0]["message"]["content"])
                            run.texts_t0.setdefault((class_name, index), set()).add(text)
                print(f"  T={temperature:g} prompt {index + 1}/{per_class} done", flush=True)
        for temperature, class_name, name in run.tallies:
            if name != "plain":
                sid = session_id(class_name, next(s for s in plan if s.name == name), temperature)
                run.admin[sid] = await client.admin_session(sid)
    return run


def class_figures(run: Run, temperature: float, class_name: str, plan: list[Setup]) -> dict[str, Any]:
    """One row of the table: α, auto's choice, tokens/s by configuration, auto ÷ the better."""
    tally = {s.name: run.tallies[(temperature, class_name, s.name)] for s in plan}
    fixed = [s.name for s in plan if s.name not in ("plain", "auto")]
    rate = {name: round(t.tokens_per_s, 2) for name, t in tally.items()}
    best_fixed = max(fixed, key=lambda name: tally[name].tokens_per_s)
    better = max(("plain", best_fixed), key=lambda name: tally[name].tokens_per_s)
    ratio = tally["auto"].tokens_per_s / tally[better].tokens_per_s if tally[better].tokens_per_s else 0.0
    # The same by CPU time: what the figures would be with the core to the bench alone.
    cpu_rate = {name: round(t.tokens_per_cpu_s, 2) for name, t in tally.items()}
    cpu_best = max(fixed, key=lambda name: cpu_rate[name])
    cpu_better = max(("plain", cpu_best), key=lambda name: cpu_rate[name])
    cpu_ratio = cpu_rate["auto"] / cpu_rate[cpu_better] if cpu_rate[cpu_better] else 0.0
    alpha = {name: None if tally[name].alpha is None else round(tally[name].alpha or 0.0, 4) for name in fixed}
    auto = tally["auto"]
    decisions = dict(auto.decisions.most_common())
    alpha_k = alpha[f"K={ALPHA_K}"]
    at_k = tally[f"K={ALPHA_K}"]
    head = tally.get(f"{EAGLE3_PREFIX}K={ALPHA_K}")
    return {
        f"alpha_k{ALPHA_K}": alpha_k, "alpha_by_k": alpha,
        f"eagle3_alpha_k{ALPHA_K}": None if head is None or head.alpha is None else round(head.alpha, 4),
        f"eagle3_accepted_per_proposed_k{ALPHA_K}": (round(head.accepted / head.proposed, 4)
                                                     if head is not None and head.proposed else None),
        # vLLM's acceptance rate, the published figures' (docs/sim.md): untested drafts count as rejected
        f"accepted_per_proposed_k{ALPHA_K}": round(at_k.accepted / at_k.proposed, 4) if at_k.proposed else None,
        "below_floor": alpha_k is not None and alpha_k < FLOOR,
        "auto": {"decisions": decisions, "most_common": auto.decisions.most_common(1)[0][0],
                 "plain_decision_share": round(sum(n for d, n in decisions.items() if d.startswith("plain"))
                                               / auto.requests, 4),
                 "plain_step_share": round(auto.plain_step_share, 4),
                 "alpha": None if auto.alpha is None else round(auto.alpha, 4), "tested": auto.tested},
        "tokens_per_s": rate, "best_fixed": best_fixed, "better": better,
        "auto_over_better": round(ratio, 4), "met": ratio >= TARGET,
        "by_cpu_time": {"tokens_per_cpu_s": cpu_rate, "best_fixed": cpu_best, "better": cpu_better,
                        "auto_over_better": round(cpu_ratio, 4), "met": cpu_ratio >= TARGET},
        "busy_share": round(sum(t.cpu_seconds for t in tally.values()) / sum(t.seconds for t in tally.values()), 4),
        "requests": tally["auto"].requests,
        "completion_tokens": {name: t.completion_tokens for name, t in tally.items()},
        "drafts": {name: {"proposed": tally[name].proposed, "accepted": tally[name].accepted,
                          "tested": tally[name].tested} for name in [*fixed, "auto"]},
    }


def gateway_counts_match(run: Run, plan: list[Setup]) -> bool:
    """The pair's gateway counted the drafts each session's answers reported (its /admin/sessions):
    the draft model's under ``acceptance``, every other method's (the head's) under ``methods``."""
    for (temperature, class_name, name), tally in run.tallies.items():
        if name == "plain":
            continue
        view = run.admin[session_id(class_name, next(s for s in plan if s.name == name), temperature)]
        counts = [view.get("acceptance", {}), *(view.get("methods") or {}).values()]
        tested = sum(int(c.get("drafts_tested") or 0) for c in counts)
        accepted = sum(int(c.get("drafts_accepted") or 0) for c in counts)
        if (tested, accepted) != (tally.tested, tally.accepted):
            return False
    return True


def eagle3_targets(by_temperature: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Issue #54's: the head's α at K=5, T=0, on code and JSON, each {value, met} (absent: no head ran)."""
    rows = by_temperature.get("0", {})
    out: dict[str, Any] = {}
    for cls in ("code", "json"):
        value = rows.get(cls, {}).get(f"eagle3_alpha_k{ALPHA_K}")
        if value is not None:
            out[f"eagle3_alpha_{cls}"] = {"value": value, "target": EAGLE3_ALPHA_TARGET,
                                          "met": value >= EAGLE3_ALPHA_TARGET}
    return out


def table(figures: dict[str, dict[str, Any]], temperature: str) -> list[str]:
    """The rows as printed: tokens/s by wall time, then auto ÷ the better by CPU time, and the
    share of the wall time the bench's processes ran (below 1: something else had the core)."""
    lines = [f"T={temperature}: class  α@K={ALPHA_K}  head α  auto chose (plain steps)         "
             "tok/s plain   K=5  best fixed    auto  auto÷better  met  | by CPU: auto÷better  busy"]
    for class_name, row in figures.items():
        rate, cpu = row["tokens_per_s"], row["by_cpu_time"]
        alpha = "  -  " if row[f"alpha_k{ALPHA_K}"] is None else f"{row[f'alpha_k{ALPHA_K}']:.3f}"
        head = row[f"eagle3_alpha_k{ALPHA_K}"]
        alpha += "    -  " if head is None else f"  {head:.3f}"
        chose = f"{row['auto']['most_common']} ({row['auto']['plain_step_share']:.0%})"
        best = f"{rate[row['best_fixed']]:.1f} {row['best_fixed']}"
        lines.append(f"     {class_name:<6} {alpha:>6}  {chose:<30} {rate['plain']:>11.1f} "
                     f"{rate[f'K={ALPHA_K}']:>5.1f}  {best:>10}  {rate['auto']:>6.1f}  "
                     f"{row['auto_over_better']:>10.3f}  {'yes' if row['met'] else 'NO ':<3}  | "
                     f"{cpu['auto_over_better']:>18.3f} {'yes' if cpu['met'] else 'NO '}  {row['busy_share']:.2f}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run: 1 prompt per class, 8 tokens, K=5 only")
    parser.add_argument("--smoke", action="store_true",
                        help="--quick with 4 tokens: for the smoke test; its figures mean nothing")
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    parser.add_argument("--max-tokens", type=int, help="per request (default 64; --quick: 8)")
    parser.add_argument("--prompts-per-class", type=int, help="(default: all, 25; --quick: 1)")
    parser.add_argument("--fixed-k", help="fixed Ks to measure, comma-separated; 5 is always one (default 2,3,5; "
                                          "--quick: 5)")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated (default 0,1)")
    parser.add_argument("--auto-policy", type=json.loads, default={},
                        help="JSON: policy fields for the auto configuration over config.yaml's policy")
    parser.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    parser.add_argument("--draft", type=Path, default=DEFAULT_DRAFT)
    parser.add_argument("--eagle3", default=str(DEFAULT_EAGLE3),
                        help="the pair's EAGLE-3 head directory; none: no head (default models/smollm2-eagle3)")
    parser.add_argument("--cost-cache", type=Path, help="the workers' cost cache (default: theirs, "
                                                       "~/.cache/specgate/costs)")
    args = parser.parse_args(argv)
    args.quick = args.quick or args.smoke
    args.max_tokens = args.max_tokens or (4 if args.smoke else 8 if args.quick else 64)
    args.prompts_per_class = args.prompts_per_class or (1 if args.quick else None)
    fixed = {int(k) for k in (args.fixed_k or ("5" if args.quick else "2,3,5")).split(",") if k.strip()}
    args.fixed_k = sorted(fixed | {ALPHA_K})
    args.temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    args.eagle3 = None if args.eagle3 == "none" else Path(args.eagle3)
    return args


def start_gateways(args: argparse.Namespace, log_dir: Path) -> tuple[list[Any], Gateways]:
    """The plain gateway, then the pair's (one after the other: a worker measures its costs as it
    starts, best with the core to itself)."""
    model = {"name": args.target.name, "target": str(args.target.resolve())}
    workers = {**WORKERS, **({"cost_cache_dir": str(args.cost_cache)} if args.cost_cache else {})}
    processes = []
    try:
        plain, plain_port = start_serve_gateway(log_dir, {**model, "draft": None}, workers, None, server=SERVER,
                                                ready_timeout_s=300)
        processes.append(plain)
        head = {} if args.eagle3 is None else {"eagle3": str(args.eagle3.resolve())}
        pair, pair_port = start_serve_gateway(log_dir, {**model, "draft": str(args.draft.resolve()), **head},
                                              workers, None, server=SERVER, ready_timeout_s=300)
        processes.append(pair)
    except BaseException:
        for process in processes:
            stop(process)
        raise
    gateways = Gateways(f"http://127.0.0.1:{pair_port}", f"http://127.0.0.1:{plain_port}", args.target.name)
    for process, url in ((plain, gateways.plain), (pair, gateways.pair)):
        gateways.pids += [process.pid, *(int(w["pid"]) for w in get_json(url + "/admin/workers")["workers"])]
    return processes, gateways


def run_bench(args: argparse.Namespace, prompts: dict[str, list[str]], plan: list[Setup]) -> Run:
    """Starts the gateways, measures, stops them; where anything fails, their logs are kept and named."""
    log_dir = Path(tempfile.mkdtemp(prefix="bench-tasks-"))
    started = time.monotonic()
    try:
        processes, gateways = start_gateways(args, log_dir)
        print(f"gateways ready in {time.monotonic() - started:.1f} s", flush=True)
        try:
            run = asyncio.run(measure(gateways, prompts, plan, args.temperatures, args.max_tokens))
        finally:
            for process in processes:
                stop(process)
    except BaseException:
        print(f"bench.tasks failed: the gateways' logs are in {log_dir}", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(log_dir, ignore_errors=True)
    return run


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python -m bench.tasks" + "".join(" " + shlex.quote(a) for a in (sys.argv[1:] if argv is None
                                                                                  else argv))
    prompts = {name: texts[:args.prompts_per_class] for name, texts in load_task_prompts().items()}
    plan = setups(args.fixed_k, args.auto_policy, eagle3=args.eagle3 is not None)
    print(f"CPU: {cpu_label()}\n{command}\ntarget {args.target}, draft {args.draft}; "
          f"{sum(map(len, prompts.values()))} prompts, {args.max_tokens} tokens, configurations "
          f"{[s.name for s in plan]}, T {args.temperatures}", flush=True)
    started = time.monotonic()
    run = run_bench(args, prompts, plan)
    by_temperature = {f"{t:g}": {c: class_figures(run, t, c, plan) for c in prompts} for t in args.temperatures}
    for temperature, figures in by_temperature.items():
        print("\n".join(table(figures, temperature)))
    same = sum(len(texts) == 1 for texts in run.texts_t0.values())
    out = {"bench": "tasks", "cpu": cpu_label(),
           "cpu_bf16_flags": sorted(f for f in ("amx_bf16", "avx512_bf16") if f in cpu_label()),
           "command": command, "target": str(args.target), "draft": str(args.draft), "max_tokens": args.max_tokens,
           "prompts_per_class": {c: len(texts) for c, texts in prompts.items()}, "fixed_k": args.fixed_k,
           "configurations": [s.name for s in plan], "policies": {s.name: s.policy for s in plan},
           "target_ratio": TARGET, "acceptance_floor": FLOOR, "temperatures": by_temperature,
           "all_met": all(row["met"] for rows in by_temperature.values() for row in rows.values()),
           "t0_same_text_prompts": [same, len(run.texts_t0)],
           "gateway_counts_match_workers": gateway_counts_match(run, plan),
           "eagle3": None if args.eagle3 is None else str(args.eagle3), "targets": eagle3_targets(by_temperature),
           "wall_s": round(time.monotonic() - started, 1)}
    print(f"T=0: every configuration answered the same text for {same} of {len(run.texts_t0)} prompts; "
          f"wall {out['wall_s']} s")
    print_result(out, args.json)


if __name__ == "__main__":
    main()
