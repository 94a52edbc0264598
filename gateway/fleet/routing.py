"""Choosing a worker for a request: pure, data in and a worker id out.

A session sticks to its worker while that worker is ready; otherwise (new session, or its
worker went down) it goes to the least-loaded ready worker. ``prefer_mode`` leaves room for
mode-aware routing: with single-mode workers (vLLM) the router sends a decision to a worker
that serves its mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies import Mode


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    ready: bool
    load: int  # running + queued sequences (the worker's report, or the gateway's in-flight count)
    modes: frozenset[Mode]


def choose_worker(current: str | None, candidates: Sequence[Candidate], prefer_mode: Mode | None = None) -> str | None:
    ready = [c for c in candidates if c.ready]
    if not ready:
        return None
    if prefer_mode is not None:
        serving = [c for c in ready if prefer_mode in c.modes]
        ready = serving or ready
    for candidate in ready:
        if candidate.worker_id == current:
            return current
    # Ties go to the first listed, so routing is deterministic.
    return min(ready, key=lambda c: c.load).worker_id
