"""``python -m bench.policy --real``: the same kind of traffic through a real gateway and sim workers.

Two sim workers (``python -m workers --engine sim``) behind a real gateway running specgate's
default policy (K=5), closed-loop streaming sessions from aiohttp clients, phases ``light`` and
``steady`` of bench.policy's workload (the burst's hundreds of streams would need more than
this machine's CPUs). The sim runs ``--time-scale`` times slower than the modelled GPUs, which
keeps the chunk rate within what the CPUs here can relay; figures are reported in simulated
time (real tokens/s × time scale). The same phases then run in virtual time
(bench/fleet_sim.py) and the two must agree within ``AGREEMENT`` on goodput per phase.
The workers' step lateness (how late their step loop woke against the model) and this
process's own event-loop lag are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import procs
from bench.fleet_sim import KINDS, THINK_TIME_S, FleetPolicy, FleetSim, LogHistogram, Phase, SessionKind
from policies import PolicyConfig
from workers.api.sim_config import SimConfig

AGREEMENT = 0.15  # live goodput per phase within ±15% of the virtual-time figure
POLICY: dict[str, Any] = {"num_speculative_tokens": 5}


# One token each with the demo tokenizer, so a prompt of n of them is n tokens after BOS and
# the tag (a few more), as long as the virtual fleet's prompt of n tokens. The filler words
# used until this round ("alpha", "beta", ...) were 2.5 tokens each: the live runs prefilled
# 2.5 times the virtual fleet's prompts, and their TTFT came out twice the model's.
FILLER = (" self", " return", " the", " None")


def live_prompt(kind: SessionKind, rng: random.Random) -> str:
    """A prompt of about ``kind.prompt_tokens`` tokens; the tag sets the sim's category."""
    return f"[{kind.category}]" + "".join(rng.choice(FILLER) for _ in range(rng.randint(*kind.prompt_tokens)))


class Recorder:
    def __init__(self, phases: list[Phase], scale: float) -> None:
        self.bounds = []
        t = 0.0
        for p in phases:
            self.bounds.append((p.name, t * scale, (t + p.duration_s) * scale))
            t += p.duration_s
        self.tokens = {p.name: 0 for p in phases}
        self.itl = {p.name: LogHistogram() for p in phases}
        self.ttft = {p.name: LogHistogram() for p in phases}
        self.start = time.monotonic()

    def phase(self, now: float) -> str | None:
        t = now - self.start
        return next((name for name, lo, hi in self.bounds if lo <= t < hi), None)


async def _session(http: aiohttp.ClientSession, url: str, kind: SessionKind, sid: str, rng: random.Random,
                   rec: Recorder, until: float, scale: float) -> None:
    while True:
        await asyncio.sleep(rng.expovariate(1 / THINK_TIME_S) * scale)
        if time.monotonic() >= until:
            return
        body = {"model": "specgate-demo", "prompt": live_prompt(kind, rng), "max_tokens": rng.randint(*kind.max_tokens),
                "temperature": kind.temperature, "stream": True}
        sent = last = time.monotonic()
        first = True
        async with http.post(url + "/v1/completions", json=body, headers={"X-Session-ID": sid}) as response:
            response.raise_for_status()
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                n = int((chunk.get("specgate") or {}).get("tokens", 1))
                now = time.monotonic()
                phase = rec.phase(now)
                if phase is not None and n:
                    rec.tokens[phase] += n
                    if first:
                        rec.ttft[phase].add((now - sent) / scale)
                    else:
                        rec.itl[phase].add((now - last) / scale / n, n)
                first, last = False, now


async def _loop_lag(stop: asyncio.Event, samples: LogHistogram) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(0.01)
        samples.add(max(1e-6, loop.time() - before - 0.01))


async def _drive(url: str, phases: list[Phase], scale: float, seed: int) -> tuple[Recorder, LogHistogram]:
    rec = Recorder(phases, scale)
    rng = random.Random(seed)
    lag = LogHistogram()
    stop = asyncio.Event()
    tasks = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        lag_task = asyncio.create_task(_loop_lag(stop, lag))
        t = 0.0
        started: dict[str, int] = {k.name: 0 for k in KINDS}
        for phase in phases:
            # Closed loop: sessions alive in this phase (those from the last phase carry on).
            for kind in KINDS:
                for i in range(started[kind.name], phase.sessions_per_kind):
                    tasks.append(asyncio.create_task(_session(
                        http, url, kind, f"{kind.name}-{i}", random.Random(rng.getrandbits(64)), rec,
                        rec.start + sum(p.duration_s for p in phases) * scale, scale)))
                started[kind.name] = max(started[kind.name], phase.sessions_per_kind)
            t += phase.duration_s
            print(f"  real: phase {phase.name} ({phase.sessions_per_kind} sessions per kind) until "
                  f"{t * scale:.0f}s wall", flush=True)
            await asyncio.sleep(max(0.0, rec.start + t * scale - time.monotonic()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stop.set()
        await lag_task
    return rec, lag


def run_real(args: argparse.Namespace) -> dict[str, Any]:
    scale = args.time_scale
    duration = 15.0 if args.quick else 60.0
    phases = [Phase("light", duration, 4), Phase("steady", duration, 16)]
    sim = {"time_scale": scale, "seed": args.seed}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-policy-real-"))
    workers = [procs.start_sim_worker(log_dir, sim, default_k=5) for _ in range(2)]
    gateway = None
    try:
        gateway, port = procs.start_gateway(log_dir, [p for _, p in workers], POLICY)
        url = f"http://127.0.0.1:{port}"
        time.sleep(0.6)  # a poll or two, so both workers are routable
        print(f"real: gateway :{port}, 2 sim workers, time scale {scale}, {2 * duration * scale:.0f}s of wall time")
        rec, lag = asyncio.run(_drive(url, phases, scale, args.seed))
        lateness = [procs.get_json(f"http://127.0.0.1:{p}/specgate/worker")["sim"]["lateness"] for _, p in workers]
    finally:
        if gateway is not None:
            procs.stop(gateway)
        for process, _ in workers:
            procs.stop(process)
    print("virtual: the same phases in simulated time...", flush=True)
    virtual = FleetSim(SimConfig(), FleetPolicy("specgate", PolicyConfig(**POLICY)), phases, seed=args.seed).run()
    rows: dict[str, Any] = {}
    agree = True
    for name, _, _ in rec.bounds:
        live = rec.tokens[name] / duration  # real tokens over a phase of duration × scale wall seconds, × scale
        sim_goodput = virtual.phases[name].tokens / duration
        ratio = live / sim_goodput if sim_goodput else None
        ok = ratio is not None and abs(ratio - 1) <= AGREEMENT
        agree = agree and ok
        itl, ttft = rec.itl[name].quantile(0.5), rec.ttft[name].quantile(0.5)
        rows[name] = {"goodput_live": round(live, 1), "goodput_virtual": round(sim_goodput, 1),
                      "ratio": round(ratio, 3) if ratio else None, "agrees": ok,
                      "itl_p50_ms_live": round(1000 * itl, 1) if itl else None,
                      "itl_p50_ms_virtual": round(1000 * (virtual.phases[name].itl.quantile(0.5) or 0), 1),
                      "ttft_p50_ms_live": round(1000 * ttft, 1) if ttft else None,
                      "ttft_p50_ms_virtual": round(1000 * (virtual.phases[name].ttft.quantile(0.5) or 0), 1)}
        print(f"  {name:<8} goodput live {live:8.1f} vs virtual {sim_goodput:8.1f} tok/s (×{rows[name]['ratio']}, "
              f"{'agrees' if ok else 'DISAGREES'} within ±{AGREEMENT:.0%}); ITL p50 {rows[name]['itl_p50_ms_live']}"
              f" vs {rows[name]['itl_p50_ms_virtual']} ms; TTFT p50 {rows[name]['ttft_p50_ms_live']} vs "
              f"{rows[name]['ttft_p50_ms_virtual']} ms")
    lag_p50, lag_p99 = lag.quantile(0.5) or 0.0, lag.quantile(0.99) or 0.0
    print(f"  worker step lateness (wall ms, per worker): {lateness}")
    print(f"  load generator loop lag: p50 {1000 * lag_p50:.2f} ms, p99 {1000 * lag_p99:.2f} ms")
    return {"mode": "real", "time_scale": scale, "phase_s": duration, "phases": rows, "agrees": agree,
            "tolerance": AGREEMENT, "goodput": {"specgate": {k: v["goodput_live"] for k, v in rows.items()}},
            "goodput_virtual": {"specgate": {k: v["goodput_virtual"] for k, v in rows.items()}},
            "winner_overall": None, "worker_lateness": lateness,
            "loadgen_lag_ms": {"p50": round(1000 * lag_p50, 3), "p99": round(1000 * lag_p99, 3)}}
