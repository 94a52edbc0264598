"""Choosing a worker for a request with the policy's ``route_*`` rules: the routing pipeline
(gateway/scheduling/) as those keys describe it, for callers that hold a ``PolicyConfig`` and
the expected prefix hits (the routing table's tests, the fleet simulator). The gateway itself
runs its live pipeline (``gateway.scheduling.store``); docs/routing.md says where each rule went.

A session sticks to its worker while that worker is ready, not the one overloading an
unbalanced fleet, and within the load bound (``sticky``). A request not bound to a worker is
placed by the load guard, the minimum prefix hit, and prefix and load scores (``prefix``,
``load``); with ``route_method_margin`` a session moves to a batch that runs its kind of step
(``method``). With workers that serve one fixed mode, the route also names the least-loaded
ready worker that serves the other mode.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

from gateway.scheduling.config import build, routing_from_policy
from gateway.scheduling.framework import (
    BOTH_MODES,
    ROUTE_REASONS,
    Candidate,
    RequestFeatures,
    Route,
    RouteReason,
    StepKind,
)
from gateway.scheduling.framework import Pipeline as _Pipeline
from gateway.scheduling.plugins.load_bound_filter import load_bound as _load_bound
from gateway.scheduling.plugins.load_guard import unbalanced as _unbalanced
from gateway.scheduling.plugins.method_agreement_scorer import agreement
from policies import PolicyConfig

__all__ = ["BOTH_MODES", "ROUTE_REASONS", "Candidate", "Route", "RouteReason", "StepKind", "agreement",
           "choose_route", "choose_worker", "load_bound", "unbalanced"]

DEFAULT_RULES = PolicyConfig()


@functools.lru_cache(maxsize=32)
def _pipeline(rules: PolicyConfig) -> _Pipeline:
    return build(routing_from_policy(rules))


def choose_worker(current: str | None, candidates: Sequence[Candidate]) -> str | None:
    route = choose_route(current, candidates)
    return None if route is None else route.worker_id


def choose_route(current: str | None, candidates: Sequence[Candidate], hits: Mapping[str, float] | None = None,
                 rules: PolicyConfig = DEFAULT_RULES, kind: StepKind | None = None) -> Route | None:
    """The session's worker and, where it serves one fixed mode, a worker serving the other.

    ``hits``: each worker's expected prefix hit for this request (0..1; absent: 0); ``kind``: what
    the session's requests run (method-aware placement)."""
    placed = _pipeline(rules).place(RequestFeatures(current, kind), candidates, hits)
    return None if placed is None else placed.route


def unbalanced(loads: Sequence[int], rules: PolicyConfig) -> bool:
    """The load guard (``load-guard``) with the policy's thresholds."""
    return _unbalanced(loads, rules.route_balance_abs, rules.route_balance_rel)


def load_bound(loads: Sequence[int], rules: PolicyConfig) -> float:
    """The load bound (``load-bound-filter``) with the policy's factor and slack."""
    return _load_bound(loads, rules.route_load_factor, rules.route_load_slack)
