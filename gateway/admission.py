"""Admission, the way in, shared by the relay (``specgate serve``) and the endpoint picker
(``specgate epp``): one request's session key, the worker it goes to and the decision there.

The relay opens the worker's stream itself; the endpoint picker names the worker to Envoy. Both
call ``pick`` and ``commit``, and fold what the worker reports back through the way back
(``gateway/accounting.py``), so a session's estimate moves the same way behind either.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.fleet.handle import WorkerHandle
from gateway.llamacpp import SlotLease
from gateway.placement import Placement, route
from gateway.scheduling.framework import RouteReason
from gateway.sessions.table import ModeChange, Session
from gateway.state import GatewayState
from gateway.tenancy import Caller, scoped_request
from policies import Decision, PolicyConfig, record_decision
from policies.methods import keeps_own_evidence
from workers.api.errors import BadRequest, ClientDisconnected, NotFound, Unavailable, WorkerFailed
from workers.api.request_parser import parse_request
from workers.api.wire import (
    GATEWAY_FIELDS,
    MAX_SESSION_ID,
    SESSION_HEADER,
    CompletionRequest,
    Directive,
    RequestKind,
    ResumePoint,
    valid_session_id,
)

if TYPE_CHECKING:
    from gateway.observe.ops_metrics import WaitResult
    from gateway.observe.tracing import AttemptTrace

# A waiting request checks that its client is still there at least this often (aiohttp does not
# cancel a handler whose client left; a ready worker wakes it at once).
GONE_CHECK_S = 0.25
QUEUE_FULL_RETRY_AFTER_S = 1.0


class NoWorker(Exception):
    """Marks the errors of an admission that found no worker to take the request."""


class NoWorkerReady(Unavailable, NoWorker):
    pass


class NoWorkerLeft(WorkerFailed, NoWorker):
    pass


@dataclass
class Admission:
    session: Session
    handle: WorkerHandle
    decision: Decision
    policy: PolicyConfig
    attempt: AttemptTrace
    retries: int = 0  # workers found unreachable before this one took the request
    route: RouteReason = "load"  # why this worker (X-Specgate-Route): the session's, a prefix hit, or load
    prefix_share: float = 0.0  # Placement.prefix_share
    lease: SlotLease | None = None  # a llama-server's slot and prompt reuse (gateway/llamacpp.py)


def session_id_of(headers: Mapping[str, str], req: CompletionRequest) -> str | None:
    """The session key: the ``X-Session-ID`` header, else a digest of ``user``, else None (new).

    The header is a key the client chose, so it is held to a key's rules. ``user`` is
    OpenAI's end-user id, which may be any string (long, tabs, newlines, U+2028): it is never
    refused, and keys the session through a bounded, printable digest of it.
    """
    header = headers.get(SESSION_HEADER)
    if header:
        if not valid_session_id(header):
            raise BadRequest(f"{SESSION_HEADER} must be printable ASCII and at most {MAX_SESSION_ID} characters",
                             param=SESSION_HEADER)
        return header
    if req.user:
        return user_session_id(req.user)
    return None


def accept_request(state: GatewayState, kind: RequestKind, body: Any, caller: Caller) -> CompletionRequest:
    """A client's parsed request, once it names the served model and leaves speculation to the
    gateway (the ``specgate`` directive and ``vllm_xargs`` are the gateway's to set), in its
    caller's cache scope (gateway/tenancy.py: its ``cache_salt`` is the scope's digest now)."""
    req = parse_request(kind, body)
    if req.model != state.config.model.name:
        raise NotFound(f"model '{req.model}' does not exist; available: '{state.config.model.name}'",
                       param="model", code="model_not_found")
    for name in GATEWAY_FIELDS:
        if req.raw.get(name) is not None:
            raise BadRequest(f"'{name}' is set by the gateway, not by clients", param=name)
    return scoped_request(req, caller, state.config.auth.cache_scope_secret)


def user_session_id(user: str) -> str:
    # surrogatepass: a JSON body may carry a lone surrogate (\ud800), which plain UTF-8 refuses.
    return "user-" + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def directive_for(decision: Decision, policy: PolicyConfig, resume: ResumePoint | None = None, **fields: Any
                  ) -> Directive:
    """The ``specgate`` directive a decision sends a specgate or vLLM worker (the relay's and the
    endpoint picker's): its K, or its tree (K then the tree's depth), and the live batch thresholds."""
    method = decision.method if decision.method is not None and keeps_own_evidence(decision.method) else None
    return Directive(decision.k, policy.max_batch, policy.batch_resume, policy.max_step_drafts, resume,
                     policy.auto_k, tree=None if decision.tree is None else str(decision.tree), method=method,
                     **fields)


def record(state: GatewayState, session: Session, decision: Decision, policy: PolicyConfig) -> None:
    metrics = state.metrics
    metrics.series(metrics.decisions, decision.mode, decision.reason).inc()
    if decision.mode == "speculative":  # "chain" or the tree's shape: bounded by policy.tree_shapes (at most 8)
        metrics.series(metrics.tree_decisions, "chain" if decision.tree is None else str(decision.tree)).inc()
    if decision.mode == "speculative" and decision.method is not None:
        metrics.series(metrics.method_decisions, decision.method, decision.reason).inc()
    if decision.mode == "plain":
        metrics.series(metrics.fallbacks, decision.reason).inc()
    previous = session.last_decision
    if previous is None or previous.mode != decision.mode or previous.tree != decision.tree:
        if previous is not None and previous.mode != decision.mode:
            metrics.mode_switches.labels(model=metrics.model, to=decision.mode, reason=decision.reason).inc()
        # A switch between a chain and a tree (or between trees) is kept too: flapping shows.
        session.history.append(ModeChange(time.time(), decision.mode, decision.reason, decision.k,
                                          None if decision.tree is None else str(decision.tree)))
    session.last_decision = decision
    session.policy_state = record_decision(session.policy_state, decision, policy.auto_k)


def pick(state: GatewayState, session: Session, req: CompletionRequest, policy: PolicyConfig,
         tried: Collection[str] = (), exclude: Collection[str] = (), resume: ResumePoint | None = None,
         allowed: Collection[str] | None = None) -> Placement:
    """The worker for this request and the decision there, among the ready workers not ``tried``.

    ``resume`` (a generation another worker began) needs a worker that speaks specgate's
    protocol; ``allowed`` (the endpoint picker's subset hint) limits the choice to those ids.
    Raises ``NoWorkerLeft`` when every worker was tried (beyond ``exclude``), else
    ``NoWorkerReady``.
    """
    candidates = [c for c in state.fleet.candidates() if c.worker_id not in tried
                  and (allowed is None or c.worker_id in allowed)
                  and (resume is None or state.fleet.workers[c.worker_id].speaks_specgate)]
    pipeline = state.routing.pipeline
    routed = route(pipeline, state.fleet.workers, session, candidates, req, policy)
    if routed is None:
        failed = set(tried) - set(exclude)
        if failed:
            raise NoWorkerLeft(f"no worker could take the request (tried {', '.join(sorted(failed))})")
        raise NoWorkerReady("no worker is ready", retry_after_s=1.0)
    session.worker_id = routed.handle.worker_id
    if routed.cycle is not None:  # the plugins' pre-request step: the prefix scorer records the placement
        pipeline.pre_request(routed.cycle, routed.handle.worker_id)
    state.metrics.series(state.metrics.routes, routed.route).inc()
    return routed


async def pick_ready(state: GatewayState, session: Session, req: CompletionRequest, policy: PolicyConfig,
                     tried: Collection[str] = (), exclude: Collection[str] = (), resume: ResumePoint | None = None,
                     allowed: Collection[str] | None = None, *,
                     gone: Callable[[], bool] = lambda: False) -> Placement:
    """``pick``, waiting up to ``server.admission_wait_s`` for a worker when none is ready.

    Only ``NoWorkerReady`` waits: a request that every worker failed (``NoWorkerLeft``) fails
    at once. At most ``server.admission_queue`` requests wait at a time; beyond that, a 503 at
    once. The wait ends when a worker becomes ready (the fleet's event), when ``gone()`` says
    the client left (checked every ``GONE_CHECK_S``: ``ClientDisconnected``), or when the task
    is cancelled (the drain deadline, a caller that left); after ``admission_wait_s``, the
    503 ``pick`` raises. Each wait is counted by how it ended (``specgate_admission_waits_total``).
    """
    try:
        return pick(state, session, req, policy, tried, exclude, resume, allowed)
    except NoWorkerReady:
        server = state.config.server
        if server.admission_wait_s <= 0:
            raise
    fleet, metrics = state.fleet, state.fleet.admission_waits
    if fleet.waiting >= server.admission_queue:
        metrics.record("queue_full", None)
        raise NoWorkerReady(f"no worker is ready, and {fleet.waiting} requests already wait for one "
                            "(server.admission_queue)", code="admission_queue_full",
                            retry_after_s=QUEUE_FULL_RETRY_AFTER_S)
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + server.admission_wait_s
    result: WaitResult = "cancelled"
    fleet.waiting += 1
    metrics.waiting.inc()
    try:
        while True:
            if gone():
                result = "client_gone"
                raise ClientDisconnected("client disconnected while waiting for a ready worker")
            await fleet.wait_ready(max(0.0, min(deadline - loop.time(), GONE_CHECK_S)))
            try:
                picked = pick(state, session, req, policy, tried, exclude, resume, allowed)
            except NoWorkerReady:  # none yet, or the one that came cannot take this request
                if loop.time() >= deadline:
                    result = "timeout"
                    raise
                continue
            result = "served"
            return picked
    finally:
        fleet.waiting -= 1
        metrics.waiting.dec()
        metrics.record(result, loop.time() - started)


def commit(state: GatewayState, session: Session, handle: WorkerHandle, decision: Decision,
           policy: PolicyConfig) -> None:
    """The request went to ``handle``: counted in its draft mix, the decision recorded."""
    handle.draft_mix.add(decision)
    record(state, session, decision, policy)
