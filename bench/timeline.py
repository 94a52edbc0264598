"""Where a sequential request's time goes, through the gateway and straight to its worker.

    python -m bench.timeline [--requests N] [--json]

bench.overhead measures what the gateway adds to a request; this says where it is added. A sim
worker answering at once (time scale 0) and a gateway in front of it run with timestamps at each
hand-off (bench/timeline_probe.py: the gateway's outermost middleware in, its worker request
sent and answered, its answer assembled for the write, the worker's handler in and out).
Sequential non-streaming 4-token requests at T=1.0 (plain, as in bench.overhead) go through the
gateway and straight to the worker in turn, one each, so both paths see the machine in the same
state. Per request the marks give the phases, in microseconds at the median:

    through the gateway: client -> gateway | gateway, before the worker | hop to the worker |
                         worker | hop back | gateway, after the worker | gateway -> client
    straight:            client -> worker | worker | worker -> client

A hop is the sender's write, the loopback, the receiver's wake-up and aiohttp's request or
response parsing up to the probe. The gateway adds its two phases, one more pair of hops, and
whatever the worker does more for a gateway (the directive, step reports, SSE).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from bisect import bisect_left
from pathlib import Path
from typing import Any

import aiohttp

from bench import procs
from bench.overhead import GATEWAY_POLICY
from bench.timeline_probe import OUT_ENV
from workers.costs.cache import cpu_label

PROBE = ("-m", "bench.timeline_probe")
GATEWAY_PHASES = [  # (name, from mark, to mark)
    ("client_to_gateway", "sent", "gateway_in"),
    ("gateway_before_worker", "gateway_in", "to_worker"),
    ("hop_to_worker", "to_worker", "worker_in"),
    ("worker", "worker_in", "worker_out"),
    ("hop_back", "worker_out", "from_worker"),
    ("gateway_after_worker", "from_worker", "gateway_out"),
    ("gateway_to_client", "gateway_out", "answered"),
]
DIRECT_PHASES = [("client_to_worker", "sent", "worker_in"), ("worker", "worker_in", "worker_out"),
                 ("worker_to_client", "worker_out", "answered")]


async def _requests(gateway_url: str, worker_url: str, n: int) -> dict[str, list[tuple[float, float]]]:
    windows: dict[str, list[tuple[float, float]]] = {"gateway": [], "direct": []}
    async with aiohttp.ClientSession() as http:
        for i in range(n + 20):  # the first 20 of each warm code paths and connections
            for path, url in (("gateway", gateway_url), ("direct", worker_url)):
                window = await procs.timed_completion(http, url, path)
                if i >= 20:
                    windows[path].append(window)
            if i % 500 == 499:
                print(f"  {i + 1 - 20} of {n} requests a path", flush=True)
    return windows


def _phases(windows: list[tuple[float, float]], marks: dict[str, list[float]],
            phases: list[tuple[str, str, str]]) -> dict[str, list[float]]:
    """Each request's phases in µs: every mark taken as the first of its name in the request's window."""
    out: dict[str, list[float]] = {name: [] for name, _, _ in phases}
    for sent, answered in windows:
        at = {"sent": sent, "answered": answered}
        for name, times in marks.items():
            j = bisect_left(times, sent)
            if j < len(times) and times[j] <= answered:
                at[name] = times[j]
        if all(start in at and end in at for _, start, end in phases):
            for name, start, end in phases:
                out[name].append(1e6 * (at[end] - at[start]))
    return out


def _load_marks(prefix: str) -> dict[str, dict[str, list[float]]]:
    marks: dict[str, dict[str, list[float]]] = {}
    for path in Path(prefix).parent.glob(Path(prefix).name + ".*.json"):
        target = path.name.split(".")[-3]
        marks[target] = {name: sorted(times) for name, times in json.loads(path.read_text()).items()}
    return marks


def run(n: int) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-timeline-"))
    os.environ[OUT_ENV] = str(log_dir / "marks")
    worker, worker_port = procs.start_sim_worker(log_dir, {"time_scale": 0.0}, launcher=PROBE)
    started = [worker]
    try:
        gateway, gateway_port = procs.start_gateway(log_dir, [worker_port], GATEWAY_POLICY, launcher=PROBE)
        started.append(gateway)
        windows = asyncio.run(_requests(f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{worker_port}", n))
    finally:
        for process in reversed(started):
            procs.stop(process)  # SIGINT: each writes its marks at exit
    marks = _load_marks(os.environ.pop(OUT_ENV))
    if set(marks) != {"gateway", "workers"}:
        raise RuntimeError(f"marks came back from {sorted(marks)} only; logs in {log_dir}")
    paths = {"gateway": _phases(windows["gateway"], {**marks["gateway"], **marks["workers"]}, GATEWAY_PHASES),
             "direct": _phases(windows["direct"], marks["workers"], DIRECT_PHASES)}
    out: dict[str, Any] = {"requests": n, "cpu": cpu_label()}
    for path, phases in paths.items():
        out[f"{path}_phases_us"] = {name: round(statistics.median(v), 1) for name, v in phases.items() if v}
        out[f"{path}_requests_matched"] = min((len(v) for v in phases.values()), default=0)
    latency = {path: statistics.median(1e6 * (b - a) for a, b in w) for path, w in windows.items()}
    g, d = out["gateway_phases_us"], out["direct_phases_us"]
    out["added_p50_us"] = round(latency["gateway"] - latency["direct"], 1)
    out["added_by_part_us"] = {
        "gateway_own_work": round(g["gateway_before_worker"] + g["gateway_after_worker"], 1),
        "extra_hops": round(g["client_to_gateway"] + g["gateway_to_client"] + g["hop_to_worker"] + g["hop_back"]
                            - d["client_to_worker"] - d["worker_to_client"], 1),
        "worker_extra": round(g["worker"] - d["worker"], 1),
    }
    return out


def report(out: dict[str, Any]) -> None:
    print(f"\nCPU: {out['cpu']}; {out['requests']} sequential requests a path, medians in µs")
    for path, phases in (("through the gateway", GATEWAY_PHASES), ("straight to the worker", DIRECT_PHASES)):
        key = "gateway" if path.startswith("through") else "direct"
        print(f"{path} ({out[f'{key}_requests_matched']} requests with every mark):")
        for name, _, _ in phases:
            print(f"  {name:<24}{out[f'{key}_phases_us'][name]:9.1f}")
    parts = out["added_by_part_us"]
    print(f"added at p50: {out['added_p50_us']:.1f} µs; by part: gateway's own work {parts['gateway_own_work']:.1f}, "
          f"one more pair of hops {parts['extra_hops']:.1f}, the worker's extra {parts['worker_extra']:.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.timeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="sequential requests a path (default 2000)")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args(argv)
    out = run(args.requests)
    report(out)
    procs.print_result(out, args.json)


if __name__ == "__main__":
    main()
