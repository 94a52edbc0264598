"""Cache-aware routing against least-loaded on the sim fleet: shared system prompts and the hotspot;
with ``--engine embedded``, the embedded engine's prefix reuse on the real pair (bench/prefix_embedded.py).

``python -m bench.prefix [--json] [--quick | --smoke]``: 16 sim workers (``--workers``), each with a
prefix cache (``workers.sim.prefix_cache_tokens``, docs/sim.md "Prefix cache"), behind one real
gateway, started afresh per gateway configuration (the workers stay; each run's system prompts
carry their own salt, so no run finds another's prompts cached). Two workloads, as issue 44
defines them, both multi-turn chat (5 turns per session, each appending the answer and a new
user message to the history):

- **shared**: sessions spread evenly over ``PROMPTS`` long system prompts (~2,000 tokens each,
  repeated text), more than a worker's cache holds at once.
- **hotspot**: one system prompt for 80% of the sessions, the rest over the others.

Each workload first finds least-loaded's capacity (sessions per simulated second, closed loop
with every worker's slots full and as many queued), then sends sessions open-loop at
``LOAD_FRACTION`` of it, the same arrivals for every configuration:

- ``cache_aware``: the gateway's defaults (prefix weight 3, load weight 2, guard 4 / 1.5, load
  bound 2 × mean + 2);
- ``least_loaded``: ``route_index_blocks: 0`` and ``route_load_factor: 0`` (no prefix index, no
  load bound: a new session goes to the least loaded worker and stays there). Sessions stay
  sticky, so this is also "session-sticky only": the gateway has no mode that routes each turn by
  load alone.

Reported per configuration, in simulated seconds: TTFT p50/p90 (time to the first streamed
content chunk), output tokens/s, the share of prompt tokens served from the workers' caches
(``usage.prompt_tokens_details.cached_tokens``), and ``X-Specgate-Route`` counts; for the
hotspot, each worker's queue (running + waiting, from its ``/specgate/worker``) sampled every
100 simulated ms, and the share of samples where some worker's exceeds 2 × the fleet mean + 2.
The targets are issue 44's, printed met or not met.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import prefix_embedded
from bench.procs import get_json, print_result, start_gateway, start_sim_worker, stop, stream_chat
from workers.costs.cache import cpu_label

PROMPTS = 8  # distinct system prompts
PROMPT_RULES = 180  # rules per system prompt: about 2,000 tokens
CACHE_TOKENS = 8192  # each worker's prefix cache: about 3 system prompts with their conversations
TURNS = 5
MAX_TOKENS = 24
MAX_SLOTS = 4  # per worker; small, so that a saturated fleet's streams stay within one CPU core
LOAD_FRACTION = 0.8
HOT_SHARE = 0.8
SAMPLE_SIM_S = 0.1
# least_loaded: no prefix index and no load bound, as the gateway routed before cache-aware routing.
CONFIGS: dict[str, dict[str, Any]] = {"cache_aware": {},
                                      "least_loaded": {"route_index_blocks": 0, "route_load_factor": 0.0}}
BASELINE = "least_loaded"


def system_prompt(salt: str, index: int) -> str:
    """A long system prompt of repeated text, its first words unique to (salt, index) so that no
    two prompts share a cached block."""
    rules = " ".join(f"Rule {n}: answer the customer about product line {index} politely and briefly."
                     for n in range(PROMPT_RULES))
    return f"[chat] Assistant profile {salt}-{index}. {rules}"


@dataclass(frozen=True)
class SessionPlan:
    session_id: str
    system: str
    users: tuple[str, ...]


def plan(salt: str, sessions: int, hot_share: float | None, seed: int) -> list[SessionPlan]:
    """``hot_share`` None: sessions spread evenly over the prompts; else that share on prompt 0."""
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        hot = hot_share is not None and rng.random() < hot_share
        index = s % PROMPTS if hot_share is None else 0 if hot else rng.randrange(1, PROMPTS)
        users = tuple(f"Question {t} of customer {s}: what about order {rng.randrange(10_000)}?" for t in range(TURNS))
        out.append(SessionPlan(f"{salt}-s{s}", system_prompt(salt, index), users))
    return out


@dataclass
class Tally:
    ttft_s: list[float] = field(default_factory=list)  # simulated
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    routes: Counter[str] = field(default_factory=Counter)
    failed: int = 0
    turns: int = 0
    finished_at: list[float] = field(default_factory=list)  # each turn's end (time.monotonic)
    admitted: list[float] = field(default_factory=list)  # each session's start past the gate


async def run_session(http: aiohttp.ClientSession, url: str, session: SessionPlan, scale: float, tally: Tally) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": session.system}]
    for user in session.users:
        messages.append({"role": "user", "content": user})
        body = {"model": "specgate-demo", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.7}
        sent = time.monotonic()
        answer, response = await stream_chat(http, url, body, {"X-Session-ID": session.session_id})
        if answer.status != 200:
            tally.failed += 1
            return
        tally.routes[response.headers.get("X-Specgate-Route", "?")] += 1
        if answer.usage:
            tally.tokens += answer.usage["completion_tokens"]
            tally.prompt_tokens += answer.usage["prompt_tokens"]
            tally.cached_tokens += (answer.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        tally.turns += 1
        tally.finished_at.append(time.monotonic())
        if answer.first_content_at is not None:
            tally.ttft_s.append((answer.first_content_at - sent) / scale)
        messages.append({"role": "assistant", "content": answer.text})


async def sample_queues(http: aiohttp.ClientSession, worker_ports: list[int], scale: float,
                        samples: list[list[int]], done: asyncio.Event) -> None:
    """Every worker's running + waiting, every ``SAMPLE_SIM_S`` simulated seconds."""
    async def one(port: int) -> int:
        async with http.get(f"http://127.0.0.1:{port}/specgate/worker") as response:
            info = await response.json()
            return int(info["batch_depth"]) + int(info["queue_length"])
    while not done.is_set():
        tick = time.monotonic()
        samples.append(list(await asyncio.gather(*(one(p) for p in worker_ports))))
        await asyncio.sleep(max(0.0, SAMPLE_SIM_S * scale - (time.monotonic() - tick)))


async def drive(url: str, sessions: list[SessionPlan], scale: float, *, rate: float | None = None,
                concurrency: int | None = None, worker_ports: list[int] | None = None
                ) -> tuple[Tally, float, list[list[int]]]:
    """Sessions open-loop at ``rate`` per simulated second, or closed-loop ``concurrency`` at a
    time; returns the tally, the run's simulated seconds and the queue samples (when sampled)."""
    tally, done = Tally(), asyncio.Event()
    samples: list[list[int]] = []
    admitted: list[float] = []  # when each session got its turn at the gate
    gate = asyncio.Semaphore(concurrency or len(sessions))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        started = time.monotonic()

        async def one(n: int, session: SessionPlan) -> None:
            if rate is not None:
                await asyncio.sleep(max(0.0, started + n / rate * scale - time.monotonic()))
            async with gate:
                admitted.append(time.monotonic())
                await run_session(http, url, session, scale, tally)
        sampler = (asyncio.create_task(sample_queues(http, worker_ports, scale, samples, done))
                   if worker_ports else None)
        await asyncio.gather(*(one(n, s) for n, s in enumerate(sessions)))
        elapsed = (time.monotonic() - started) / scale
        done.set()
        if sampler is not None:
            await sampler
    tally.admitted = admitted
    return tally, elapsed, samples


def pct(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4) if ordered else None


def hotspot_share(samples: list[list[int]]) -> float | None:
    """Samples in which some worker's queue exceeds 2 × the fleet mean + 2 (issue 44's bound)."""
    if not samples:
        return None
    over = sum(1 for queues in samples if max(queues) > 2 * statistics.fmean(queues) + 2)
    return round(over / len(samples), 4)


def summary(tally: Tally, elapsed: float, samples: list[list[int]], sessions: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "sessions": sessions, "turns": tally.turns, "failed": tally.failed,
        "ttft_p50_s": pct(tally.ttft_s, 0.5), "ttft_p90_s": pct(tally.ttft_s, 0.9),
        "output_tok_s": round(tally.tokens / elapsed, 2) if elapsed > 0 else None,
        "cached_token_share": round(tally.cached_tokens / tally.prompt_tokens, 4) if tally.prompt_tokens else 0.0,
        "routes": dict(tally.routes), "sim_s": round(elapsed, 2)}
    if samples:
        out |= {"queue_samples": len(samples), "hotspot_sample_share": hotspot_share(samples),
                "max_queue": max(max(q) for q in samples)}
    return out


async def capacity(url: str, sessions: list[SessionPlan], scale: float, workers: int) -> float:
    """Least-loaded's capacity in sessions per simulated second: closed loop, every worker's
    slots full and half as many sessions again waiting, counted while the queue was still fed
    (until the last session got in), not while the run drained."""
    tally, _, _ = await drive(url, sessions, scale, concurrency=concurrency(workers))
    started, fed_until = min(tally.admitted), max(tally.admitted)
    turns = sum(1 for t in tally.finished_at if t <= fed_until)
    return turns / TURNS / ((fed_until - started) / scale)


def concurrency(workers: int) -> int:
    return 3 * MAX_SLOTS * workers // 2


def run_workload(name: str, ports: list[int], log_dir: Path, scale: float, sessions: int, probe_sessions: int,
                 hot_share: float | None, sample: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gateway, port = start_gateway(log_dir, ports, CONFIGS[BASELINE])
    try:
        probe = plan(f"{name}-probe", probe_sessions, hot_share, seed=1)
        rate_capacity = asyncio.run(capacity(f"http://127.0.0.1:{port}", probe, scale, len(ports)))
    finally:
        stop(gateway)
    rate = LOAD_FRACTION * rate_capacity
    out["capacity_sessions_per_s"] = round(rate_capacity, 3)
    out["offered_sessions_per_s"] = round(rate, 3)
    for config, policy in CONFIGS.items():
        gateway, port = start_gateway(log_dir, ports, policy)
        try:
            runs = plan(f"{name}-{config}", sessions, hot_share, seed=2)  # the same arrivals and mix
            tally, elapsed, samples = asyncio.run(drive(f"http://127.0.0.1:{port}", runs, scale, rate=rate,
                                                        worker_ports=ports if sample else None))
        finally:
            stop(gateway)
        out[config] = summary(tally, elapsed, samples, sessions)
        print(f"{name:8} {config:13} " + " ".join(f"{k}={v}" for k, v in out[config].items()), flush=True)
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def targets(shared: dict[str, Any], hotspot: dict[str, Any]) -> dict[str, Any]:
    """Issue 44's sim-fleet targets."""
    cache, base = shared["cache_aware"], shared[BASELINE]
    hot, hot_base = hotspot["cache_aware"], hotspot[BASELINE]
    checks = {
        "shared_ttft_p90_ratio": (ratio(cache["ttft_p90_s"], base["ttft_p90_s"]), "<=", 0.5),
        "shared_tok_s_ratio": (ratio(cache["output_tok_s"], base["output_tok_s"]), ">=", 1.0),
        "hotspot_sample_share": (hot.get("hotspot_sample_share"), "<=", 0.05),
        "hotspot_tok_s_ratio": (ratio(hot["output_tok_s"], hot_base["output_tok_s"]), ">=", 0.95),
    }
    out = {}
    for name, (value, op, bound) in checks.items():
        met = value is not None and (value <= bound if op == "<=" else value >= bound)
        out[name] = {"value": value, "target": f"{op} {bound}", "met": met}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--quick", action="store_true", help="a short run: 2 workers, a few sessions")
    parser.add_argument("--smoke", action="store_true",
                        help="--quick at time scale 0.25, for the smoke test: its figures mean nothing")
    parser.add_argument("--workers", type=int, default=None, help="sim workers (default 16; 2 with --quick)")
    parser.add_argument("--sessions", type=int, default=None, help="sessions per run (default 96; 4 with --quick)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="real seconds per simulated second (default 3, 1 with --quick: slower than real "
                             "keeps the live fleet on the model's schedule on one CPU core)")
    parser.add_argument("--tenants", type=int, default=1,
                        help="with --engine embedded: N API keys, each its own tenant, all sessions on one shared "
                             "system prompt; reports cross-tenant cache hits (issue 52)")
    parser.add_argument("--engine", choices=("sim", "embedded"), default="sim",
                        help="sim: the fleet of 16 sim workers (routing); embedded: the real pair's prefix reuse, "
                             "2 workers (bench/prefix_embedded.py)")
    args = parser.parse_args()
    if args.engine == "embedded":
        embedded_main(args)
        return
    if args.smoke:
        args.quick, args.time_scale = True, args.time_scale or 0.25
    workers = args.workers or (2 if args.quick else 16)
    sessions = args.sessions or (4 if args.quick else 96)
    args.time_scale = args.time_scale or (1.0 if args.quick else 3.0)
    # The capacity probe: the closed loop's queue stays fed for half again its concurrency (a
    # smoke run only needs a figure, not a good one).
    probe_sessions = concurrency(workers) + 2 if args.quick else 3 * concurrency(workers) // 2
    sim = {"time_scale": args.time_scale, "prefix_cache_tokens": CACHE_TOKENS, "seed": 7}
    out: dict[str, Any] = {"bench": "prefix", "cpu": cpu_label(), "workers": workers, "time_scale": args.time_scale,
                           "prefix_cache_tokens": CACHE_TOKENS, "max_slots": MAX_SLOTS, "turns": TURNS,
                           "max_tokens": MAX_TOKENS, "prompts": PROMPTS, "load_fraction": LOAD_FRACTION,
                           "configs": CONFIGS, "quick": args.quick}
    procs = []
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        log_dir = Path(tmp)
        try:
            ports = []
            for _ in range(workers):
                process, port = start_sim_worker(log_dir, sim, max_slots=MAX_SLOTS)
                procs.append(process)
                ports.append(port)
            started = time.monotonic()
            out["shared"] = run_workload("shared", ports, log_dir, args.time_scale, sessions, probe_sessions,
                                         None, sample=False)
            out["hotspot"] = run_workload("hotspot", ports, log_dir, args.time_scale, sessions, probe_sessions,
                                          HOT_SHARE, sample=True)
            out["wall_s"] = round(time.monotonic() - started, 1)
            sims = [get_json(f"http://127.0.0.1:{p}/specgate/worker")["sim"] for p in ports]
            # How far the live loops fell behind the model (one CPU core for the whole fleet), and
            # the caches' bound held: the most bytes any worker's cache held at the end.
            out["lateness_p99_ms"] = max(s["lateness"]["p99_ms"] or 0.0 for s in sims)
            out["cache_bytes_held_max"] = max(s["prefix_cache"]["bytes_held"] for s in sims)
            out["cache_tokens_held_max"] = max(s["prefix_cache"]["tokens_held"] for s in sims)
        finally:
            for process in procs:
                stop(process)
    out["targets"] = targets(out["shared"], out["hotspot"])
    for name, check in out["targets"].items():
        print(f"target {name}: {check['value']} (target {check['target']}): {'met' if check['met'] else 'not met'}")
    print_result(out, args.json)


def embedded_main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-prefix-embedded-") as tmp:
        if args.tenants > 1:  # sessions per tenant
            sessions = args.sessions or (1 if args.quick or args.smoke else 2)
            out = {"bench": "prefix", "cpu": cpu_label()} | prefix_embedded.run_tenants(Path(tmp), args.tenants,
                                                                                        sessions)
        else:
            sessions = args.sessions or (2 if args.quick or args.smoke else 8)
            out = {"bench": "prefix", "cpu": cpu_label()} | prefix_embedded.run(Path(tmp), sessions)
    for name, check in out["targets"].items():
        print(f"target {name}: {check['value']} (target {check['target']}): {'met' if check['met'] else 'not met'}")
    print(f"CPU: {out['cpu']}")
    print_result(out, args.json)


if __name__ == "__main__":
    main()
