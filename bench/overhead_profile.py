"""Where the gateway's CPU goes on a request: the relay under cProfile, on bench.overhead's load.

    python -m bench.overhead_profile [--requests N] [--concurrency C] [--top N] [--repo PATH] [--json]

One sim worker answering at once (time scale 0), one gateway (bench.overhead's config) run under
cProfile timing CPU (``time.process_time``), N requests of 4 tokens, non-streaming (bench.overhead's ``sequential``
load at concurrency 1), profiled after 50 unprofiled ones; the health polls of those seconds are
in it too. It prints the
functions with the most own time (``tottime``) as µs a request, and groups them by where the
code lives (the gateway's modules, aiohttp, asyncio and uvloop, orjson, prometheus_client...).
cProfile slows Python code by ~2x and C code not at all: the shares, not the absolute figures,
say where to look. With ``--json`` the last line holds the groups and the top functions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import signal
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp

from bench import procs
from bench.overhead import GATEWAY_POLICY
from workers.costs.cache import cpu_label

# The gateway's module run under a profiler timing CPU, not wall time (cProfile's command line
# times wall time: an event loop's idle waits land on whatever frame called into it), switched
# on (SIGUSR1) after start-up and the warm-up, off and written out (SIGUSR2) after the load.
PROFILED = """
import cProfile, runpy, signal, sys, time
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
profiler = cProfile.Profile(time.process_time)
signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
def stop(*_):
    profiler.disable()
    profiler.dump_stats({out!r})
signal.signal(signal.SIGUSR2, stop)
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
GROUPS = (("gateway/", "gateway"), ("workers/api", "workers.api"), ("policies/", "policies"),
          ("aiohttp", "aiohttp"), ("yarl", "yarl/multidict"), ("multidict", "yarl/multidict"),
          ("uvloop", "asyncio/uvloop"), ("asyncio", "asyncio/uvloop"), ("orjson", "orjson"),
          ("prometheus_client", "prometheus_client"), ("logging", "logging"))


async def send(url: str, n: int, concurrency: int, pid: int) -> float:
    body = {"model": "specgate-demo", "prompt": "hello there", "max_tokens": 4, "temperature": 1.0}
    async with aiohttp.ClientSession() as http:
        async def one() -> None:
            async with http.post(url + "/v1/completions", json=body) as response:
                await response.read()
                assert response.status == 200, response.status

        for _ in range(50):  # warm-up, unprofiled
            await one()
        os.kill(pid, signal.SIGUSR1)
        await asyncio.sleep(0.2)
        started = time.monotonic()
        left = n

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await one()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.monotonic() - started
        os.kill(pid, signal.SIGUSR2)
        return seconds


def group_of(filename: str) -> str:
    for needle, name in GROUPS:
        if needle in filename:
            return name
    return "builtins" if filename == "~" else "other"


def profile(requests: int, concurrency: int, repo: Path = procs.REPO) -> tuple[pstats.Stats, float]:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-overhead-profile-"))
    out = log_dir / "gateway.prof"
    upstream, up_port = procs.start_sim_worker(log_dir, {"time_scale": 0.0}, default_k=0)
    try:
        gateway, port = procs.start_gateway(log_dir, [up_port], GATEWAY_POLICY, repo,
                                            launcher=("-c", PROFILED.format(out=str(out))))
        try:
            seconds = asyncio.run(send(f"http://127.0.0.1:{port}", requests, concurrency, gateway.pid))
            deadline = time.monotonic() + 30
            while not out.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)  # written whole
        finally:
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(timeout=60)
    finally:
        upstream.terminate()
        upstream.wait(timeout=30)
    return pstats.Stats(str(out)), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--repo", type=Path, default=procs.REPO, help="profile another checkout's gateway")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    stats, seconds = profile(args.requests, args.concurrency, args.repo)
    n = args.requests
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    groups: dict[str, float] = defaultdict(float)
    rows = []
    for (filename, line, name), (_, calls, tottime, cumtime, _) in raw.items():
        groups[group_of(filename)] += tottime
        rows.append((tottime, cumtime, calls, f"{Path(filename).name}:{line}({name})", filename))
    total = sum(groups.values())
    print(f"CPU: {cpu_label()}; {args.requests} requests at concurrency {args.concurrency} in {seconds:.2f} s; "
          f"profiled gateway CPU {total / n * 1e6:.0f} µs a request (cProfile's own overhead included)")
    print("own time by where the code lives, µs a request:")
    for name, value in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {name:20s} {value / n * 1e6:8.1f}  ({value / total:6.1%})")
    print(f"top {args.top} functions by own time, µs a request (own; cumulative; calls a request):")
    top = sorted(rows, reverse=True)[:args.top]
    for tottime, cumtime, calls, where, _ in top:
        print(f"  {tottime / n * 1e6:8.1f} {cumtime / n * 1e6:9.1f} {calls / n:6.1f}  {where}")
    if args.json:
        print(json.dumps({"bench": "overhead_profile", "cpu": cpu_label(), "requests": args.requests,
                          "concurrency": args.concurrency, "us_per_request": round(total / n * 1e6, 1),
                          "groups_us": {k: round(v / n * 1e6, 1) for k, v in groups.items()},
                          "top": [{"where": where, "own_us": round(t / n * 1e6, 2), "cum_us": round(c / n * 1e6, 2),
                                   "calls": round(calls / n, 2)} for t, c, calls, where, _ in top]}))


if __name__ == "__main__":
    main()
