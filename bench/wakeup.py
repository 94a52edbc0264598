"""What one loopback hop costs on this machine, before any HTTP: a ping-pong between two processes.

    python -m bench.wakeup [--round-trips N] [--json]

bench.timeline puts about half of what the gateway adds to a sequential request in its second
pair of hops. This measures a hop with nothing else in it: a parent sends 600 bytes (about a
worker request) over loopback TCP or a Unix socket, a child blocked in ``epoll`` answers 400
bytes, and the parent waits in ``epoll`` for them. Medians of the round trip and of the send
call alone, with the two processes placed three ways:

- ``same_cpu``: both pinned to one CPU (a wake-up is a switch on that CPU);
- ``other_cpu``: pinned to two different CPUs (every wake-up reaches a CPU that went idle);
- ``unpinned``: where the scheduler puts them (what the gateway, its workers and clients get).

On a virtual machine whose idle CPUs halt, waking a process on another CPU costs an
inter-processor interrupt and the halted CPU's wake-up; the ``other_cpu`` round trip minus the
``same_cpu`` one is what those two wake-ups add. ``other_cpu`` needs two CPUs this process
may run on (the first two of its affinity set).
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import procs
from workers.costs.cache import cpu_label

REQUEST, ANSWER = b"x" * 600, b"y" * 400


def placements(cpus: list[int]) -> dict[str, tuple[int | None, int | None]]:
    """(parent CPU, child CPU) per placement, among the CPUs this process may use."""
    out: dict[str, tuple[int | None, int | None]] = {"same_cpu": (cpus[0], cpus[0])}
    if len(cpus) >= 2:
        out["other_cpu"] = (cpus[0], cpus[1])
    out["unpinned"] = (None, None)
    return out


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def _answer_forever(connection: socket.socket, cpu: int | None) -> None:
    """The child: answers every request until the parent closes the connection."""
    _pin(cpu)
    poller = select.epoll()
    poller.register(connection.fileno(), select.EPOLLIN)
    while True:
        poller.poll()
        if not connection.recv(65536):
            return
        connection.sendall(ANSWER)


def ping_pong(family: str, parent_cpu: int | None, child_cpu: int | None, round_trips: int) -> dict[str, float]:
    """Median send and round-trip times in µs for ``round_trips`` exchanges (after 100 to warm)."""
    allowed = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory() as directory:
        if family == "tcp":
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))
        else:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(Path(directory) / "hop.sock"))
        listener.listen(1)
        address = listener.getsockname()
        child = os.fork()
        if child == 0:  # pragma: no cover - the forked child
            try:
                connection, _ = listener.accept()
                _answer_forever(connection, child_cpu)
            finally:
                os._exit(0)
        listener.close()
        _pin(parent_cpu)
        sender = socket.socket(socket.AF_INET if family == "tcp" else socket.AF_UNIX, socket.SOCK_STREAM)
        sender.connect(address)
        if family == "tcp":
            sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as uvloop sets it
        poller = select.epoll()
        poller.register(sender.fileno(), select.EPOLLIN)
        sends, trips = [], []
        try:
            for i in range(round_trips + 100):
                started = time.perf_counter()
                sender.sendall(REQUEST)
                sent = time.perf_counter()
                poller.poll()
                received = 0
                while received < len(ANSWER):
                    received += len(sender.recv(65536))
                if i >= 100:
                    sends.append(sent - started)
                    trips.append(time.perf_counter() - started)
        finally:
            sender.close()
            os.waitpid(child, 0)
            os.sched_setaffinity(0, allowed)
    return {"send_us": round(statistics.median(sends) * 1e6, 1),
            "round_trip_us": round(statistics.median(trips) * 1e6, 1)}


def run(round_trips: int) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    out: dict[str, Any] = {"cpu": cpu_label(), "cpus": len(cpus), "round_trips": round_trips}
    for family in ("tcp", "unix"):
        results: dict[str, dict[str, float]] = {}
        for placement, (parent_cpu, child_cpu) in placements(cpus).items():
            results[placement] = ping_pong(family, parent_cpu, child_cpu, round_trips)
            print(f"  {family:4} {placement:9}  round trip {results[placement]['round_trip_us']:7.1f} µs   "
                  f"send {results[placement]['send_us']:6.1f} µs", flush=True)
        out[family] = results
        if "other_cpu" in results:
            out[f"{family}_cross_cpu_wakeups_us"] = round(
                results["other_cpu"]["round_trip_us"] - results["same_cpu"]["round_trip_us"], 1)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round-trips", type=int, default=5000, help="round trips a placement (default 5000)")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_label()}; loopback ping-pong, {args.round_trips} round trips a placement, medians:")
    out = run(args.round_trips)
    for family in ("tcp", "unix"):
        added = out.get(f"{family}_cross_cpu_wakeups_us")
        if added is not None:
            print(f"{family}: the two cross-CPU wake-ups of a round trip add {added} µs")
    procs.print_result(out, args.json)


if __name__ == "__main__":
    main()
