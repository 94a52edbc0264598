"""Choosing a worker for a request: pure, data in and worker ids out.

A session sticks to its worker while that worker is ready, not the one overloading an
unbalanced fleet, and within the load bound (``sticky``). A request not bound to a worker (a new
session, or one whose worker is gone or overloaded) is placed by a score, or by load alone:

- **The load guard**, first (SGLang's rule): the fleet is unbalanced when the most loaded ready
  worker's load exceeds the least loaded's by more than ``route_balance_abs`` and is more than
  ``route_balance_rel`` times it. Then load alone places it: the least-loaded worker (``load``).
  Cache affinity never piles more onto a hotspot.
- **Prefix and load**: otherwise, where some worker is expected to hold at least
  ``route_min_prefix_hit`` of the prompt (``prefix_index.PrefixIndex``: the share of its leading
  blocks the gateway sent there before), each worker scores ``route_prefix_weight`` × its
  expected hit + ``route_load_weight`` × (1 − its load ÷ the fleet's highest), and the best wins
  (``prefix``; llm-d's picker weighs prefix, queue and KV use 3 / 2 / 2). Else the least loaded
  (``load``).
- **The method** (``route_method_margin`` > 0): a session whose worker's in-flight requests run
  the other kind of step than its own method (the draft model against a lookup method) moves to
  a worker within the load bound whose in-flight requests agree with its method by at least
  that margin more (agreeing minus disagreeing; ``method``). A batch whose sequences all look
  up pays no draft forward: on a GPU a draft forward costs the whole batch its time whoever
  drafts, so a mixed batch makes lookup sessions slower than alone (bench.policy_methods). Each
  moving session leaves its prefix cache behind, so it is off by default.
- **The load bound** (consistent hashing with bounded loads): neither stickiness nor the score
  sends a request to a worker whose load would then exceed ``route_load_factor`` × the fleet's
  mean (this request counted) + ``route_load_slack``. The guard needs a wide gap (SGLang's 64,
  4 here) and so lets a hot system prompt's worker run far ahead at shallow queues, its sessions
  sticky there; the bound holds it (bench.prefix's hotspot workload). The least-loaded worker is
  always within it.

With workers that serve one fixed mode (OpenAI servers without specgate's plugin), the route
also names the least-loaded ready worker that serves the other mode, so admission can send the
request where the mode the rules want runs (gateway/placement.py ``route``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from policies import Mode, PolicyConfig

BOTH_MODES: frozenset[Mode] = frozenset({"speculative", "plain"})


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    ready: bool
    load: int  # running + queued sequences (the worker's report, or the gateway's in-flight count)
    modes: frozenset[Mode]
    drafting: int = 0  # the gateway's requests in flight there that run the draft model
    looking: int = 0  # ...and that run a lookup method


RouteReason = Literal["sticky", "prefix", "load", "method"]
ROUTE_REASONS: tuple[RouteReason, ...] = ("sticky", "prefix", "load", "method")
# What a session's requests run, for method-aware placement: the draft model's steps or a
# lookup method's (None: plain, or not known yet).
StepKind = Literal["draft", "lookup"]


@dataclass(frozen=True)
class Route:
    worker_id: str  # the session's worker: sticky while ready, else the least loaded
    # Where that worker serves one mode only: the least-loaded ready worker serving the other
    # (None when it serves both, or no ready worker serves the other).
    other_id: str | None = None
    reason: RouteReason = "load"  # why worker_id: the session's own, the expected prefix hit, or load


DEFAULT_RULES = PolicyConfig()


def choose_worker(current: str | None, candidates: Sequence[Candidate]) -> str | None:
    route = choose_route(current, candidates)
    return None if route is None else route.worker_id


def choose_route(current: str | None, candidates: Sequence[Candidate], hits: Mapping[str, float] | None = None,
                 rules: PolicyConfig = DEFAULT_RULES, kind: StepKind | None = None) -> Route | None:
    """The session's worker and, where it serves one fixed mode, a worker serving the other.

    ``hits``: each worker's expected prefix hit for this request (0..1; absent: 0); ``kind``: what
    the session's requests run (method-aware placement)."""
    ready = [c for c in candidates if c.ready]
    chosen, reason = _session_worker(current, ready, hits or {}, rules, kind)
    if chosen is None:
        return None
    if len(chosen.modes) != 1:  # both modes (or none: it runs what it can, worker_plain_only)
        return Route(chosen.worker_id, reason=reason)
    missing = next(iter(BOTH_MODES - chosen.modes))
    serving = [c for c in ready if c is not chosen and missing in c.modes]
    other = min(serving, key=lambda c: c.load) if serving else None
    return Route(chosen.worker_id, other.worker_id if other is not None else None, reason)


def unbalanced(loads: Sequence[int], rules: PolicyConfig) -> bool:
    """The load guard: the most loaded worker is ahead of the least loaded by more than
    ``route_balance_abs`` and by more than ``route_balance_rel`` times."""
    if len(loads) < 2:
        return False
    most, least = max(loads), min(loads)
    return most - least > rules.route_balance_abs and most > rules.route_balance_rel * least


def load_bound(loads: Sequence[int], rules: PolicyConfig) -> float:
    """The most a worker may hold after taking a sticky or prefix-placed request: the fleet's
    mean load with that request counted, times ``route_load_factor``, plus ``route_load_slack``
    (infinite with the factor 0)."""
    if rules.route_load_factor == 0.0 or not loads:
        return math.inf
    return rules.route_load_factor * (sum(loads) + 1) / len(loads) + rules.route_load_slack


def agreement(candidate: Candidate, kind: StepKind) -> int:
    """How many more of the worker's in-flight requests run ``kind``'s steps than the other's."""
    difference = candidate.drafting - candidate.looking
    return difference if kind == "draft" else -difference


def _method_move(current: Candidate, ready: Sequence[Candidate], kind: StepKind | None, bound: float,
                 rules: PolicyConfig) -> Candidate | None:
    """Where a session whose worker's batch disagrees with its method should go instead, if any."""
    if rules.route_method_margin <= 0 or kind is None:
        return None
    if (current.looking if kind == "draft" else current.drafting) == 0:
        return None  # nothing there runs the other kind of step
    others = [c for c in ready if c is not current and c.load + 1 <= bound]
    best = max(others, key=lambda c: agreement(c, kind), default=None)  # max keeps the first of equals
    if best is None or agreement(best, kind) < agreement(current, kind) + rules.route_method_margin:
        return None
    return best


def _session_worker(current: str | None, ready: Sequence[Candidate], hits: Mapping[str, float],
                    rules: PolicyConfig, kind: StepKind | None = None) -> tuple[Candidate | None, RouteReason]:
    if not ready:
        return None, "load"
    loads = [c.load for c in ready]
    guard = unbalanced(loads, rules)
    most = max(loads)
    bound = load_bound(loads, rules)
    for candidate in ready:
        if candidate.worker_id == current and not (guard and candidate.load == most) and candidate.load + 1 <= bound:
            moved = _method_move(candidate, ready, kind, bound, rules)
            return (candidate, "sticky") if moved is None else (moved, "method")
    # Ties go to the first listed, so routing is deterministic.
    least = min(ready, key=lambda c: c.load)
    # The least loaded is within the bound (its load is at most the mean; the slack is at least 1).
    within = [c for c in ready if c.load + 1 <= bound]
    if guard or max((hits.get(c.worker_id, 0.0) for c in within), default=0.0) < rules.route_min_prefix_hit:
        return least, "load"

    def score(c: Candidate) -> float:
        return (rules.route_prefix_weight * hits.get(c.worker_id, 0.0)
                + rules.route_load_weight * (1.0 - c.load / max(1, most)))
    best = max(within, key=score)  # max keeps the first of equals
    return best, "prefix" if hits.get(best.worker_id, 0.0) > 0.0 else "load"
