"""Two checkouts' whole stacks side by side: each its own sim worker and gateway, one load.

    python -m bench.stacks [--ref-repo PATH] [--requests N] [--rounds R] [--json]

bench.overhead's ``--ref-repo`` runs another checkout's gateway on the same upstream, which
measures a gateway change and nothing else; a change to the worker's side of the protocol (what
it sends the gateway, and how) needs each checkout's own worker. Here every checkout
(this one as ``this``; ``--ref-repo``, e.g. ``git worktree add /tmp/ref <rev>``, as ``ref``)
runs a sim worker answering at once (time scale 0) and a gateway in front of it, and:
- sequential non-streaming 4-token requests: each round sends one request to every gateway and
  every worker, in a new seeded order, so the machine's drift (a third within minutes on
  these machines) falls on all alike; added latency is a stack's gateway p50 minus its own
  worker's;
- 32 concurrent clients for ``--seconds`` a turn, the stacks in turns (``--rounds`` each),
  non-streaming 4-token and 64-token and streaming 4-token completions: requests/s and the
  gateway's and the worker's CPU per request (/proc utime + stime).
Every request samples at T=1.0 under bench.overhead's plain policy.

The stack started first runs slower: in A/A runs (``--ref-repo`` a worktree of the same
commit) on the AMX Xeon it added 0.01–0.03 ms more at p50 and spent 7–33 µs more gateway CPU
a sequential request, whichever checkout it was (README, "Relay overhead", stop 28). ``this``
starts first unless ``--ref-first``: run a comparison both ways, or against an A/A run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench import procs
from bench.overhead import GATEWAY_POLICY, _load
from workers.costs.cache import cpu_label

LOADS = [("c32", 4, False), ("c32_64", 64, False), ("c32_stream4", 4, True)]  # (name, max_tokens, stream)


@dataclass
class Stack:
    name: str
    worker: Any
    worker_url: str
    gateway: Any
    gateway_url: str


def _start(name: str, repo: Path, log_dir: Path, started: list[Any]) -> Stack:
    worker, worker_port = procs.start_sim_worker(log_dir, {"time_scale": 0.0}, repo=repo)
    started.append(worker)
    gateway, gateway_port = procs.start_gateway(log_dir, [worker_port], GATEWAY_POLICY, repo)
    started.append(gateway)
    return Stack(name, worker, f"http://127.0.0.1:{worker_port}", gateway, f"http://127.0.0.1:{gateway_port}")


async def _sequential(stacks: list[Stack], rounds: int) -> dict[str, dict[str, list[float]]]:
    targets = [(s.name, path, url) for s in stacks for path, url in (("gateway", s.gateway_url),
                                                                    ("direct", s.worker_url))]
    latencies: dict[str, dict[str, list[float]]] = {s.name: {"gateway": [], "direct": []} for s in stacks}
    order = random.Random(0)
    async with aiohttp.ClientSession() as http:
        for i in range(rounds + 30):  # 30 rounds to warm connections and code paths
            order.shuffle(targets)
            for name, path, url in targets:
                sent, answered = await procs.timed_completion(http, url, f"{name} {path}")
                if i >= 30:
                    latencies[name][path].append(answered - sent)
            if i % 1000 == 999:
                print(f"  sequential: {i + 1 - 30} of {rounds} rounds", flush=True)
    return latencies


def run(ref_repo: Path | None, rounds: int, turns: int, seconds: float, ref_first: bool = False) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-stacks-"))
    started: list[Any] = []
    out: dict[str, Any] = {"cpu": cpu_label(), "started_first": "ref" if ref_first and ref_repo is not None else "this"}
    try:
        repos = [("this", procs.REPO)] + ([("ref", ref_repo)] if ref_repo is not None else [])
        by_name = {name: _start(name, repo, log_dir, started) for name, repo in (repos[::-1] if ref_first else repos)}
        stacks = [by_name[name] for name, _ in repos]  # "this" first in every report, whichever started first
        out["repos"] = {name: str(repo) for name, repo in repos}
        cpu0 = {s.name: procs.cpu_seconds(s.gateway.pid) for s in stacks}
        latencies = asyncio.run(_sequential(stacks, rounds))
        for s in stacks:
            gateway, direct = latencies[s.name]["gateway"], latencies[s.name]["direct"]
            gateway.sort()
            out[s.name] = {
                "added_p50_ms": round(1000 * (statistics.median(gateway) - statistics.median(direct)), 3),
                "gateway_p50_ms": round(1000 * statistics.median(gateway), 3),
                "gateway_p99_ms": round(1000 * gateway[int(0.99 * len(gateway))], 3),
                "direct_p50_ms": round(1000 * statistics.median(direct), 3),
                "gateway_cpu_us_per_sequential_request": round(
                    1e6 * (procs.cpu_seconds(s.gateway.pid) - cpu0[s.name]) / (rounds + 30), 1)}
        for name, max_tokens, stream in LOADS:
            totals = {s.name: [0, 0.0, 0.0, 0.0] for s in stacks}  # requests, seconds, gateway CPU, worker CPU
            for turn in range(turns):
                for s in (stacks if turn % 2 == 0 else stacks[::-1]):
                    worker_cpu = procs.cpu_seconds(s.worker.pid)
                    result = asyncio.run(_load(s.gateway_url, 32, max_tokens, stream, seconds, s.gateway.pid))
                    total = totals[s.name]
                    total[0] += result.requests
                    total[1] += result.seconds
                    total[2] += result.cpu_s
                    total[3] += procs.cpu_seconds(s.worker.pid) - worker_cpu
            for s in stacks:
                requests, secs, gateway_cpu, worker_cpu = totals[s.name]
                out[s.name][name] = {"rps": round(requests / secs, 1),
                                     "gateway_cpu_us_per_request": round(1e6 * gateway_cpu / max(1, requests), 1),
                                     "worker_cpu_us_per_request": round(1e6 * worker_cpu / max(1, requests), 1)}
            print(f"  {name}: " + "; ".join(f"{s.name} {out[s.name][name]['rps']} req/s" for s in stacks), flush=True)
    finally:
        for process in reversed(started):
            procs.stop(process)
    return out


def report(out: dict[str, Any]) -> None:
    print(f"\nCPU: {out['cpu']}")
    for name in ("this", "ref"):
        if name not in out:
            continue
        r = out[name]
        print(f"\n{name} ({out['repos'][name]}): added p50 {r['added_p50_ms']} ms (gateway p50 {r['gateway_p50_ms']} "
              f"ms, p99 {r['gateway_p99_ms']} ms; its worker straight {r['direct_p50_ms']} ms); gateway CPU "
              f"{r['gateway_cpu_us_per_sequential_request']} µs a sequential request")
        for load, _, _ in LOADS:
            f = r[load]
            print(f"  {load:<12} {f['rps']:8.1f} req/s, gateway CPU {f['gateway_cpu_us_per_request']:7.1f} µs, "
                  f"worker CPU {f['worker_cpu_us_per_request']:7.1f} µs a request")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stacks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref-repo", default=None, help="another checkout whose stack runs beside this one's")
    parser.add_argument("--requests", type=int, default=3000, help="sequential rounds (default 3000)")
    parser.add_argument("--rounds", type=int, default=4, help="turns of each concurrent load a stack (default 4)")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds a turn (default 4)")
    parser.add_argument("--ref-first", action="store_true", help="start the ref stack first (the first runs slower)")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args(argv)
    out = run(Path(args.ref_repo) if args.ref_repo else None, args.requests, args.rounds, args.seconds,
              args.ref_first)
    report(out)
    procs.print_result(out, args.json)


if __name__ == "__main__":
    main()
