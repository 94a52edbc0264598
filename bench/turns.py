"""Timing several configurations on a shared machine: they take turns, one run each per round,
so a noisy neighbour's slow second lands on all of them alike and their ratios hold."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_in_turns(runs: dict[str, Callable[[], None]], reps: int, warmup: int) -> dict[str, float]:
    """Median seconds of each run over ``reps`` rounds, after ``warmup`` untimed ones."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + reps):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            if i >= warmup:
                samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in samples.items()}
