"""Choosing a worker for a request: pure, data in and worker ids out.

A session sticks to its worker while that worker is ready; otherwise (new session, or its
worker went down) it goes to the least-loaded ready worker. With workers that serve one fixed
mode (OpenAI servers without specgate's plugin), the route also names the least-loaded ready
worker that serves the other mode, so admission can send the request where the mode the rules
want runs (gateway/admission.py ``route``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies import Mode

BOTH_MODES: frozenset[Mode] = frozenset({"speculative", "plain"})


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    ready: bool
    load: int  # running + queued sequences (the worker's report, or the gateway's in-flight count)
    modes: frozenset[Mode]


@dataclass(frozen=True)
class Route:
    worker_id: str  # the session's worker: sticky while ready, else the least loaded
    # Where that worker serves one mode only: the least-loaded ready worker serving the other
    # (None when it serves both, or no ready worker serves the other).
    other_id: str | None = None


def choose_worker(current: str | None, candidates: Sequence[Candidate]) -> str | None:
    chosen = _session_worker(current, [c for c in candidates if c.ready])
    return None if chosen is None else chosen.worker_id


def choose_route(current: str | None, candidates: Sequence[Candidate]) -> Route | None:
    """The session's worker and, where it serves one fixed mode, a worker serving the other."""
    ready = [c for c in candidates if c.ready]
    chosen = _session_worker(current, ready)
    if chosen is None:
        return None
    if len(chosen.modes) != 1:  # both modes (or none: it runs what it can, worker_plain_only)
        return Route(chosen.worker_id)
    missing = next(iter(BOTH_MODES - chosen.modes))
    serving = [c for c in ready if c is not chosen and missing in c.modes]
    other = min(serving, key=lambda c: c.load) if serving else None
    return Route(chosen.worker_id, other.worker_id if other is not None else None)


def _session_worker(current: str | None, ready: Sequence[Candidate]) -> Candidate | None:
    for candidate in ready:
        if candidate.worker_id == current:
            return candidate
    # Ties go to the first listed, so routing is deterministic.
    return min(ready, key=lambda c: c.load, default=None)
