"""The pipeline's last stage: the policy's decision where the request lands, the one place that
asks the policy's ``decide`` for a request (the relay's and the endpoint picker's, through
``admission.pick``).

``route`` asks the routing pipeline for the worker (sticky, prefix, load, or, with method-aware
placement, a batch that runs the session's kind of step), and decides there: once a request,
twice where method-aware placement moves the session. Over workers of one fixed mode
each, the rules are asked on the one that speculates; over servers of one fixed method each
(``workers.remote[].method``), as if the asked worker offered every method the fleet does, and
the request goes where the wanted method runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import NamedTuple

from gateway.fleet.handle import WorkerHandle
from gateway.scheduling.framework import Candidate, Cycle, Pipeline, RequestFeatures, RouteReason, StepKind
from gateway.scheduling.plugins.has_method_filter import serving_method
from gateway.sessions.table import Session
from policies import (
    Decision,
    PolicyConfig,
    RequestFacts,
    WorkerState,
    batch_latch,
    decide,
    run_on,
    worker_acceptance,
)
from policies.lookup import lookup_state, price_lookup
from policies.methods import METHODS, Method, is_lookup, keeps_own_evidence
from workers.api.wire import CompletionRequest


class Placement(NamedTuple):
    """Where a request goes: the worker, the decision there, and why that worker."""

    handle: WorkerHandle
    decision: Decision
    route: RouteReason
    # The share of the prompt the prefix index had seen sent to this worker (before its hold):
    # what the worker's reported cached tokens are checked against (``PrefixIndex.observe``).
    prefix_share: float = 0.0
    cycle: Cycle | None = None  # the pipeline's cycle: its pre-request step records the placement


def worker_state(handle: WorkerHandle, policy: PolicyConfig) -> WorkerState:
    """What the policy knows of ``handle``, its batch latch brought up to date first."""
    handle.batch_full = batch_latch(handle.batch_full, handle.load, policy)
    return WorkerState(handle.load, handle.batch_full, handle.max_k, "speculative" in handle.modes,
                       "plain" in handle.modes, handle.cost, worker_acceptance(handle.acceptance, policy),
                       handle.draft_mix.step_mix(), handle.tree_max_nodes if handle.speaks_specgate else 0,
                       handle.methods, handle.acceptance.lookups,
                       handle.shadow_lookup and handle.speaks_specgate)


Workers = Mapping[str, WorkerHandle]


def route(pipeline: Pipeline, workers: Workers, session: Session, candidates: list[Candidate],
          req: CompletionRequest, policy: PolicyConfig) -> Placement | None:
    """The session's worker and the decision there, from one call of the policy's ``decide`` (two
    where method-aware placement moves the session: decided on its own worker, then where it goes).

    Mode-aware where workers serve one fixed mode: when the session's (or the pipeline's) worker
    serves one mode and another ready worker serves the other (``Route.other_id``), the rules are
    asked on the one of the two that speculates, as if it served plain too, and the request goes
    to the one that serves the mode they want, for their reason, so ``X-Specgate-Mode`` tells
    what runs. Only where no ready worker serves the wanted mode does a fixed-mode reason
    (``worker_plain_only``, ``worker_speculative_only``) name what runs instead.
    """
    facts = RequestFacts(req.temperature)
    # Method-aware placement needs the session's method for this request: decided on its own
    # worker first, and kept unless the session moves (then decided again where it goes).
    here = _method_decision(pipeline, workers, session, candidates, facts, policy)
    placed = pipeline.place(RequestFeatures(session.worker_id, None if here is None else step_kind(here), req),
                            candidates)
    if placed is None:
        return None
    chosen, cycle = placed.route, placed.cycle
    shares = cycle.shares
    handle = workers[chosen.worker_id]
    if chosen.other_id is None:
        by_method = _by_server_method(workers, session, candidates, handle, cycle, facts, policy)
        if by_method is not None:
            moved, decision = by_method
            return Placement(moved, decision, "method" if moved is not handle else chosen.reason,
                             shares.get(moved.worker_id, 0.0), cycle)
        decision = here if here is not None and chosen.worker_id == session.worker_id else decide(
            session.policy_state, worker_state(handle, policy), facts, policy)
        return Placement(handle, decision, chosen.reason, shares.get(handle.worker_id, 0.0), cycle)
    other = workers[chosen.other_id]
    speculating, plain = (handle, other) if "speculative" in handle.modes else (other, handle)
    if one_method(speculating) and one_method(plain):
        return _between_servers(workers, session, candidates, handle, speculating, plain, chosen.reason, cycle,
                                facts, req, policy)
    worker = worker_state(speculating, policy)
    wanted = decide(session.policy_state, replace(worker, serves_plain=True), facts, policy)
    moved, decision = (plain, wanted) if wanted.mode == "plain" else (speculating, run_on(wanted, worker))
    return Placement(moved, decision, chosen.reason, shares.get(moved.worker_id, 0.0), cycle)


def offered_methods(candidates: list[Candidate]) -> tuple[Method, ...]:
    """Every method a ready speculating worker runs, in ``METHODS`` order."""
    offered = [c.methods for c in candidates if c.ready and "speculative" in c.modes]
    return tuple(m for m in METHODS if any(m in o for o in offered))


def one_method(handle: WorkerHandle) -> bool:
    """A server whose method is fixed for its life and named in the config (vLLM's, llama.cpp's)."""
    return handle.protocol in ("vllm", "llamacpp")


def _between_servers(workers: Workers, session: Session, candidates: list[Candidate], handle: WorkerHandle,
                     speculating: WorkerHandle, plain: WorkerHandle, reason: RouteReason, cycle: Cycle,
                     facts: RequestFacts, req: CompletionRequest, policy: PolicyConfig) -> Placement:
    """Servers of one mode and one method each (llama-servers: a plain one, an n-gram one, one
    with a draft model): the rules are asked on the speculating one as if it served plain and
    every method the fleet's ready speculating servers run, and the request goes to a server that
    runs what they want: the plain one, or the least-loaded one within the load bound that runs
    the wanted method. A request that leaves the route's worker for it moved by method
    (``X-Specgate-Route: method``).

    A move leaves the session's cached prompt behind, which a server of another method cannot
    have: a session already placed moves only where that pays (``_moves``); until then it runs
    what its server runs."""
    methods = offered_methods(candidates)
    worker = worker_state(speculating, policy)
    wanted = decide(session.policy_state, replace(worker, serves_plain=True, methods=methods), facts, policy)
    placed = plain
    if wanted.mode == "speculative":
        # Within the load bound, and never the hotspot the load guard moves sessions off.
        serving = [workers[c.worker_id] for c in serving_method([c for c in candidates if c.ready],
                                                                 wanted.method or "draft")
                   if c.worker_id == handle.worker_id or (c.load + 1 <= cycle.bound
                                                          and c.worker_id not in cycle.hotspots)]
        # None within them: the request runs what the route's worker runs.
        placed = speculating if speculating in serving else min(serving, key=lambda h: h.load) if serving else handle
    if placed is not handle and not _moves(session, handle, placed, wanted, reason, req, policy):
        placed = handle
    decision = run_on(wanted, worker_state(placed, policy)) if "speculative" in placed.modes else (
        wanted if wanted.mode == "plain" else Decision("plain", 0, "worker_plain_only", method=wanted.method))
    route_reason: RouteReason = "method" if placed is not handle else reason
    return Placement(placed, decision, route_reason, cycle.shares.get(placed.worker_id, 0.0), cycle)


def _moves(session: Session, here: WorkerHandle, target: WorkerHandle, wanted: Decision, reason: RouteReason,
           req: CompletionRequest, policy: PolicyConfig) -> bool:
    """Whether a session goes to ``target``, another server than the route's (``here``), for the
    rules' ``wanted``. A new session (or one the route moved: its server is gone, or the load's
    hotspot) goes at once, unless the decision is a trial: it tries methods where the load put it.
    A placed session never moves for a trial (``explore``, ``probe``), and otherwise only where
    the move pays for itself in this request (``_move_pays``)."""
    if wanted.reason == "probe":
        return False
    if wanted.reason == "explore":
        # Trials stay where the load put a session, except that a new session tries a server whose
        # method no session has run yet (its price is unknown to all), when that one is no busier.
        return reason != "sticky" and not _has_evidence(target, wanted) and target.load <= here.load
    if reason != "sticky":
        return True
    return _move_pays(session, here, target, req, policy)


def _has_evidence(handle: WorkerHandle, wanted: Decision) -> bool:
    method = wanted.method or "draft"
    if not keeps_own_evidence(method):
        return handle.acceptance.acceptance_weight > 0
    return lookup_state(handle.acceptance.lookups, method).tried


def _move_pays(session: Session, here: WorkerHandle, target: WorkerHandle, req: CompletionRequest,
               policy: PolicyConfig) -> bool:
    """A move's price: the session's context computed again on ``target`` (its last prompt and
    answer, at the target's measured prefill time a token), against the time this request's tokens
    save there (at most ``max_tokens``, at ``here``'s plain step, times 1 − here's value over the
    target's: each server's lookup method priced as the rules price it, plain 1). Unknown costs
    (no timings yet) or a method the gateway does not price (the draft model's) move nothing."""
    prefill, step = target.step_costs.prefill_ms_per_token, here.step_costs.plain_step_ms
    if prefill is None or step is None:
        return False
    value_here, value_there = _server_value(session, here, policy), _server_value(session, target, policy)
    if value_here is None or value_there is None or value_there <= value_here:
        return False
    saved_ms = (req.max_tokens or MOVE_HORIZON_TOKENS) * step * (1.0 - value_here / value_there)
    return saved_ms > session.context_tokens * prefill


# A request without max_tokens is priced as if it generated this many.
MOVE_HORIZON_TOKENS = 256


def _server_value(session: Session, handle: WorkerHandle, policy: PolicyConfig) -> float | None:
    """What running on a server of one mode and method is worth to the session, relative to plain:
    1 on a plain server; its lookup method as the rules price it (``price_lookup`` at the server's
    own draft length); None for a method the gateway cannot price here."""
    if "speculative" not in handle.modes:
        return 1.0
    if len(handle.methods) != 1 or not keeps_own_evidence(handle.methods[0]):
        return None
    method = handle.methods[0]
    price = price_lookup(lookup_state(session.policy_state.lookups, method), lookup_state(handle.acceptance.lookups,
                         method), handle.cost, handle.load + 1, handle.max_k, policy, policy.acceptance_resume)
    return price.value


def _by_server_method(workers: Workers, session: Session, candidates: list[Candidate], handle: WorkerHandle,
                      cycle: Cycle, facts: RequestFacts, policy: PolicyConfig
                      ) -> tuple[WorkerHandle, Decision] | None:
    """Method-aware routing over servers of one fixed method each (vLLM servers: ``method`` in
    ``workers.remote``): where other ready workers offer methods ``handle`` lacks, the rules are
    asked on it as if it offered them all, and a request whose method it lacks goes to the
    least-loaded ready worker that runs it (K cut to that worker's) if that keeps within the load
    bound, as a sticky or prefix-placed request must (``load-bound-filter``): that worker and the
    decision. None where the fleet offers nothing ``handle`` lacks, or no ready worker within the
    bound runs the method the rules want (the request then runs what ``handle`` offers)."""
    if not any(m not in handle.methods for c in candidates if c.ready and "speculative" in c.modes
               for m in c.methods):
        return None  # no ready worker offers a method ``handle`` lacks
    methods = offered_methods(candidates)
    worker = worker_state(handle, policy)
    wanted = decide(session.policy_state, replace(worker, methods=methods), facts, policy)
    method = wanted.method or "draft"
    if wanted.mode != "speculative" or method in handle.methods:
        return handle, wanted
    serving = [workers[c.worker_id] for c in serving_method([c for c in candidates if c.ready], method)
               if c.load + 1 <= cycle.bound]
    if not serving:
        return None
    target = min(serving, key=lambda h: h.load)
    return target, replace(wanted, k=min(wanted.k, target.max_k), tree=None)


def _method_decision(pipeline: Pipeline, workers: Workers, session: Session, candidates: list[Candidate],
                     facts: RequestFacts, policy: PolicyConfig) -> Decision | None:
    """Where the pipeline places by method (``method-placement``, ``method-agreement-scorer``), the
    decision on the session's own worker (ready, serving both modes), whose method places the
    request; else None."""
    if not pipeline.wants_kind or session.last_decision is None:
        return None  # off, or a new session: its first request drafts, with no evidence yet
    own = next((c for c in candidates if c.worker_id == session.worker_id and c.ready and len(c.modes) == 2), None)
    if own is None:
        return None
    return decide(session.policy_state, worker_state(workers[own.worker_id], policy), facts, policy)


def step_kind(decision: Decision) -> StepKind | None:
    """What a decision runs: the draft model's steps, a lookup method's, or None (plain)."""
    if decision.mode != "speculative":
        return None
    return "lookup" if decision.method is not None and is_lookup(decision.method) else "draft"
