"""Admission, shared by the relay (``specgate serve``) and the endpoint picker (``specgate epp``).

One request's session key, the worker it goes to and the decision there, and the accounting
of what the worker reports back. The relay opens the worker's stream itself; the endpoint
picker names the worker to Envoy. Both call ``pick`` and ``commit`` and fold the worker's step
reports with ``account_chunk`` / ``account_step``, so a session's estimate moves the same way
behind either.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gateway.fleet.handle import WorkerHandle
from gateway.fleet.routing import RouteReason
from gateway.llamacpp import TIMINGS_FIELD, SlotLease, TimingsSeen, timings_report
from gateway.observe.metrics import GatewayMetrics
from gateway.placement import Placement, route
from gateway.proxy import NoWorkerLeft, NoWorkerReady, RawChunk, StreamTally
from gateway.sessions.table import ModeChange, Session
from gateway.state import GatewayState
from gateway.tenancy import Caller, scoped_request
from policies import (
    Decision,
    PolicyConfig,
    StepPath,
    observe,
    observe_lookup,
    observe_path,
    observe_steps,
    record_decision,
    tested_drafts,
)
from policies.methods import Method, is_lookup, keeps_own_evidence
from policies.tree import parse_shape
from workers.api.answers import chunk_text, speculative_usage
from workers.api.errors import BadRequest, ClientDisconnected, NotFound
from workers.api.generation import ShadowSteps
from workers.api.request_parser import parse_request
from workers.api.wire import (
    DIRECTIVE_FIELD,
    GATEWAY_FIELDS,
    MAX_SESSION_ID,
    SESSION_HEADER,
    CompletionRequest,
    Directive,
    RequestKind,
    ResumePoint,
    StepReport,
    valid_session_id,
    vllm_step_report,
)

if TYPE_CHECKING:
    from gateway.observe.ops_metrics import WaitResult
    from gateway.observe.tracing import AttemptTrace

# A waiting request checks that its client is still there at least this often (aiohttp does not
# cancel a handler whose client left; a ready worker wakes it at once).
GONE_CHECK_S = 0.25
QUEUE_FULL_RETRY_AFTER_S = 1.0


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

def account_chunk(state: GatewayState, admission: Admission, tally: StreamTally, raw: RawChunk,
             kind: RequestKind, started: float, now: float) -> None:
    """One chunk into the session's and worker's acceptance, the metrics and the tally; ``now``
    is when its worker read came (time to first token, inter-token gaps)."""
    # The streaming relay forwards chunks without usage as the worker sent them: only the usage
    # chunk may be changed here.
    chunk = raw.chunk if raw.chunk.get("usage") is None else raw.changed()
    metrics = state.metrics
    report = raw.report
    if admission.handle.protocol == "vllm" and chunk.get("usage"):
        report = vllm_step_report(chunk, admission.decision.k)
        # vLLM's own field, restated in specgate's terms: every engine's chunks look alike.
        chunk.pop("metrics", None)
        if report is not None:
            chunk[DIRECTIVE_FIELD] = report.to_json()
    elif admission.handle.protocol == "llamacpp":
        # llama.cpp's counters, restated as the steps behind the chunk (gateway/llamacpp.py).
        if TIMINGS_FIELD in chunk:
            chunk = raw.changed()
        report = timings_report(chunk, tally.timings, admission.handle.max_k,
                                any(is_lookup(m) for m in admission.handle.methods), bool(chunk_text(kind, chunk)))
        for reason in tally.timings.take_clamps():
            metrics.clamped_report(reason)
        _learn_costs(admission.handle, tally.timings)
    if report is not None and report.cached is not None:
        state.routing.pipeline.post_response(admission.handle.worker_id, admission.prefix_share, *report.cached)
    elif admission.handle.protocol in ("vllm", "llamacpp") and chunk.get("usage"):
        _observe_cached(state, admission, chunk["usage"])
    # Tokens by the mode of the steps that made them: one step, or a coalesced chunk's steps.
    emitted: dict[str, int] = {}
    if report is not None:
        for step in report.steps():
            account_step(metrics, admission, tally, step)
            mode = "speculative" if step.k > 0 else "plain"
            emitted[mode] = emitted.get(mode, 0) + step.tokens
    elif chunk_text(kind, chunk):
        emitted[admission.decision.mode] = 1
    tokens = sum(emitted.values())
    if tokens:
        tally.tokens += tokens
        gapped = emitted  # tokens whose gap since the one before is observed
        if tally.first_token_at is None:
            # A coalesced chunk says how long its worker held it (workers/server/coalesce.py): the
            # first token came then, and the chunk's later steps in the time since.
            held = report.held_s if report is not None else 0.0
            tally.first_token_at = tally.last_at = max(started, now - held)
            metrics.series(metrics.time_to_first_token, admission.decision.mode).observe(
                tally.first_token_at - started)
            gapped = {}
            if report is not None and report.then:  # the first step's own tokens came together
                head = "speculative" if report.k > 0 else "plain"
                gapped = {mode: n - report.tokens if mode == head else n for mode, n in emitted.items()}
        count = sum(gapped.values())
        gap = (now - tally.last_at) / count if count else 0.0
        for mode, n in emitted.items():
            if n:
                metrics.series(metrics.tokens, mode).inc(n)
        for mode, n in gapped.items():  # a span's tokens share its time evenly, as a speculative step's do
            if n > 0:
                metrics.observe_many(metrics.series(metrics.inter_token_latency, mode), gap, n)
        tally.last_at = now
    if chunk.get("usage"):
        usage = dict(chunk["usage"])
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if type(prompt) is int and type(completion) is int and prompt >= 0 and completion >= 0:
            admission.session.context_tokens = prompt + completion
        # A specgate worker's usage says what ran (its step counts); a server that reports no
        # steps gets the gateway's tally, and the plain steps it cannot see stay unknown.
        if "speculative" not in usage:
            usage["speculative"] = speculative_usage(tally.proposed, tally.accepted, admission.decision.mode,
                                                     tally.speculative_steps if tally.proposed else None,
                                                     tested=tally.tested)
        chunk["usage"] = usage


def _learn_costs(handle: WorkerHandle, seen: TimingsSeen) -> None:
    """A llama-server's timed steps and prefill into its costs (gateway/llamacpp.py ``StepCosts``)."""
    if seen.prefill is not None and seen.prefill[0] > 0:
        handle.step_costs.observe_prefill(*seen.prefill)
        seen.prefill = (0, 0.0)  # told once a request
    step_ms = seen.take_step_ms()
    if not step_ms:
        return
    for k, ms in step_ms:
        handle.step_costs.observe(k, ms)
    if handle.max_k > 0:
        handle.cost = handle.step_costs.model(handle.max_k)


def _observe_cached(state: GatewayState, admission: Admission, usage: Any) -> None:
    """A vLLM server's or llama-server's usage, where it reports cached tokens (vLLM's
    ``--enable-prompt-tokens-details``), into the prefix index's hold for that worker."""
    if not isinstance(usage, dict):
        return
    details, prompt = usage.get("prompt_tokens_details"), usage.get("prompt_tokens")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if type(prompt) is int and type(cached) is int and 0 <= cached <= prompt:
        state.routing.pipeline.post_response(admission.handle.worker_id, admission.prefix_share, prompt, cached)


def checked_step(metrics: GatewayMetrics, report: StepReport) -> StepReport:
    """The report with counts no worker could mean (negative, or more accepted than proposed)
    clamped, each counted in ``specgate_step_reports_clamped_total{reason}``: a worker's bug
    must not poison a session's estimate, nor pass unseen."""
    if 0 <= report.accepted <= report.proposed and (report.proposed > 0 or report.accepted == 0) and all(
            0 <= g.accepted <= g.proposed and g.count >= 0 for g in report.late_steps):
        return report  # the usual report: nothing built
    proposed, accepted = _clamped(metrics, report.proposed, report.accepted)
    late = []
    for group in report.late_steps:
        if group.count < 0:
            metrics.clamped_report("negative")
            continue
        late.append(replace(group, **dict(zip(("proposed", "accepted"), _clamped(metrics, group.proposed,
                                                                                  group.accepted), strict=True))))
    return replace(report, proposed=proposed, accepted=accepted, late_steps=tuple(late))


def _clamped(metrics: GatewayMetrics, proposed: int, accepted: int) -> tuple[int, int]:
    if proposed < 0 or accepted < 0:
        metrics.clamped_report("negative")
        proposed, accepted = max(0, proposed), max(0, accepted)
    if accepted > proposed:
        metrics.clamped_report("accepted_over_proposed")
        accepted = proposed
    return proposed, accepted


def account_step(metrics: GatewayMetrics, admission: Admission, tally: StreamTally, report: StepReport) -> None:
    """One engine step's drafts into the session's and the worker's acceptance, the tally and metrics."""
    if report.shadow:
        _account_shadow(metrics, admission, report.shadow)
    method = admission.decision.method
    if method is not None and keeps_own_evidence(method) and admission.decision.mode == "speculative":
        _account_lookup_step(metrics, admission, tally, method, report)
        return
    if method == "draft" and admission.decision.mode == "speculative":
        metrics.record_method_step(method, report.proposed, report.accepted)
    if report.proposed == 0 and report.accepted == 0 and not report.late_steps:
        return  # a plain step: no drafts to count (every step of a plain stream comes here)
    report = checked_step(metrics, report)
    session, handle, policy = admission.session, admission.handle, admission.policy
    # The worker's acceptance is read for α alone: the rank table is the session's.
    path = step_path(report)
    if path is not None:  # a tree step: its rank-1 tests into α, every test into the rank table
        session.policy_state = observe_path(session.policy_state, path, policy)
        handle.acceptance = observe_path(handle.acceptance, path, policy, ranks=False)
    else:
        session.policy_state = observe(session.policy_state, report.proposed, report.accepted, policy)
        handle.acceptance = observe(handle.acceptance, report.proposed, report.accepted, policy, ranks=False)
    tally.proposed += report.proposed
    tally.accepted += report.accepted
    tally.tested += tested_drafts(report.proposed, report.accepted)
    tally.speculative_steps += int(report.proposed > 0) + sum(g.count for g in report.late_steps)
    metrics.record_steps(handle.worker_id, report.proposed, report.accepted)
    if report.late_steps:  # acceptance the engine learned late (vLLM: when the request ended)
        groups = [(g.proposed, g.accepted, g.count) for g in report.late_steps]
        session.policy_state = observe_steps(session.policy_state, groups, policy)
        handle.acceptance = observe_steps(handle.acceptance, groups, policy, ranks=False)
        tally.proposed += sum(g.proposed * g.count for g in report.late_steps)
        tally.accepted += sum(g.accepted * g.count for g in report.late_steps)
        tally.tested += sum(tested_drafts(g.proposed, g.accepted) * g.count for g in report.late_steps)
        for group in report.late_steps:
            metrics.record_steps(handle.worker_id, group.proposed, group.accepted, group.count)


def _account_lookup_step(metrics: GatewayMetrics, admission: Admission, tally: StreamTally, method: Method,
                         report: StepReport) -> None:
    """A lookup request's step: into the method's evidence, a step that proposed nothing too (it
    counts toward the method's coverage: how often a lookup finds anything to propose)."""
    report = checked_step(metrics, report)
    session, handle, policy = admission.session, admission.handle, admission.policy
    steps = [(report.proposed, report.accepted)]
    steps += [(g.proposed, g.accepted) for g in report.late_steps for _ in range(min(g.count, MAX_LATE_STEPS))]
    session.policy_state = observe_lookup(session.policy_state, method, steps, policy)
    handle.acceptance = observe_lookup(handle.acceptance, method, steps, policy)
    proposing = [(p, a) for p, a in steps if p > 0]
    tally.proposed += sum(p for p, _ in proposing)
    tally.accepted += sum(a for _, a in proposing)
    tally.tested += sum(tested_drafts(p, a) for p, a in proposing)
    tally.speculative_steps += len(proposing)
    if report.proposed > 0:
        metrics.record_steps(handle.worker_id, report.proposed, report.accepted)
    for proposed, accepted in steps:
        metrics.record_method_step(method, proposed, accepted)


MAX_LATE_STEPS = 4096  # late step groups folded one by one up to this count (a worker's bug must stay cheap)


def _account_shadow(metrics: GatewayMetrics, admission: Admission, shadow: tuple[ShadowSteps, ...]) -> None:
    """What the lookup methods the request did not run would have done (the worker replayed them
    on its output, docs/methods.md "Shadow evidence"), into their evidence as their own steps
    are, session and worker. Only the methods the policy allows; a run's counts are clamped as
    a step report's, and at most MAX_LATE_STEPS steps of each are folded."""
    session, handle, policy = admission.session, admission.handle, admission.policy
    for replay in shadow:
        if replay.method not in policy.methods:
            continue
        steps = [(max(0, p), max(0, min(a, p))) for p, a in itertools.islice(replay.steps(), MAX_LATE_STEPS)]
        session.policy_state = observe_lookup(session.policy_state, replay.method, steps, policy, shadow=True)
        handle.acceptance = observe_lookup(handle.acceptance, replay.method, steps, policy, shadow=True)
        metrics.record_shadow(replay.method, steps)


def step_path(report: StepReport) -> StepPath | None:
    """A tree step's path, checked against its shape; None for a chain step, or for a path that
    does not fit its tree (a worker's bug: the step is then folded as a chain's drafts)."""
    if report.tree is None or report.path is None:
        return None
    try:
        return StepPath(parse_shape(report.tree), report.path)
    except ValueError:  # TreeShapeError among them
        return None

