"""One client request through the gateway: session, route, decide, forward, account, answer."""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from typing import Any

import orjson
from aiohttp import web

from gateway.auth import scope_of
from gateway.drain import DRAIN_KEY, InFlight
from gateway.fleet import WorkerHandle
from gateway.metrics import GatewayMetrics
from gateway.migration import MigratingStream
from gateway.ops_metrics import OPS_KEY
from gateway.proxy import (
    NoWorkerLeft,
    NoWorkerReady,
    RawChunk,
    StreamTally,
    WholeAnswer,
    WorkerUnreachable,
    open_stream,
    worker_body,
)
from gateway.routing import Candidate, choose_worker
from gateway.sessions import ModeChange, Session
from gateway.state import GatewayState
from gateway.tracing import TRACING_KEY, AttemptTrace, RequestTrace
from gateway.worker_http import WorkerResponse
from policies import (
    FIXED_MODE_REASONS,
    Decision,
    PolicyConfig,
    RequestFacts,
    WorkerState,
    batch_latch,
    decide,
    observe,
    observe_steps,
    record_decision,
    worker_acceptance,
)
from workers.logs import RequestLog, decision_var, request_id_var, session_var
from workers.protocol import (
    DIRECTIVE_FIELD,
    GATEWAY_FIELDS,
    MAX_SESSION_ID,
    REQUEST_ID_HEADER,
    SESSION_HEADER,
    ApiError,
    BadRequest,
    ClientDisconnected,
    CompletionRequest,
    Directive,
    NotFound,
    RequestKind,
    ResumePoint,
    StepReport,
    assemble,
    chunk_text,
    parse_request,
    speculative_usage,
    vllm_step_report,
)
from workers.web_common import read_json, sse_event, start_sse

log = logging.getLogger(__name__)
# The one line per request, written in batches (workers/logs.py); its task runs in app.py's cleanup context.
REQUEST_LOG_KEY = web.AppKey("request_log", RequestLog)
MODE_HEADER = "X-Specgate-Mode"
WORKER_HEADER = "X-Specgate-Worker"
_PATHS: dict[RequestKind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@dataclass
class Admission:
    session: Session
    handle: WorkerHandle
    decision: Decision
    policy: PolicyConfig
    attempt: AttemptTrace
    retries: int = 0  # workers found unreachable before this one took the request


# A worker read of a non-streaming request: when it came, the admission it came under, its chunks.
Received = tuple[float, Admission, list[RawChunk]]


def _session_id(request: web.Request, req: CompletionRequest) -> str | None:
    """The session key: the ``X-Session-ID`` header, else a digest of ``user``, else None (new).

    The header is a key the client chose, so it is held to a key's rules. ``user`` is
    OpenAI's end-user id, which may be any string (long, tabs, newlines, U+2028): it is never
    refused, and keys the session through a bounded, printable digest of it.
    """
    header = request.headers.get(SESSION_HEADER)
    if header:
        if len(header) > MAX_SESSION_ID or not header.isprintable():
            raise BadRequest(f"{SESSION_HEADER} must be printable and at most {MAX_SESSION_ID} characters",
                             param=SESSION_HEADER)
        return header
    if req.user:
        return user_session_id(req.user)
    return None


def user_session_id(user: str) -> str:
    # surrogatepass: a JSON body may carry a lone surrogate (\ud800), which plain UTF-8 refuses.
    return "user-" + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _decide(session: Session, handle: WorkerHandle, req: CompletionRequest, policy: PolicyConfig,
            any_mode: bool = False) -> Decision:
    """The decision on ``handle``; with ``any_mode``, what the rules want were it to serve both modes."""
    handle.batch_full = batch_latch(handle.batch_full, handle.load, policy)
    worker = WorkerState(handle.load, handle.batch_full, handle.max_k, "speculative" in handle.modes,
                         "plain" in handle.modes, handle.cost, worker_acceptance(handle.acceptance, policy),
                         handle.draft_mix.step_mix())
    if any_mode:
        fixed_k = 1 if policy.num_speculative_tokens == "auto" else policy.num_speculative_tokens
        worker = replace(worker, max_k=max(handle.max_k, fixed_k), serves_speculative=True, serves_plain=True)
    return decide(session.policy_state, worker, RequestFacts(req.temperature), policy)


def _route(state: GatewayState, session: Session, candidates: list[Candidate], req: CompletionRequest,
           policy: PolicyConfig) -> tuple[WorkerHandle, Decision] | None:
    """The session's worker and the decision there; mode-aware when workers serve one fixed mode.

    When the sticky (or least-loaded) worker cannot serve the mode the rules want, the request
    goes to a worker that can, so ``X-Specgate-Mode`` tells what runs. The session moves only
    when the other worker's decision really is the wanted mode.
    """
    worker_id = choose_worker(session.worker_id, candidates)
    if worker_id is None:
        return None
    handle = state.fleet.workers[worker_id]
    decision = _decide(session, handle, req, policy)
    if decision.reason in FIXED_MODE_REASONS:
        wanted = _decide(session, handle, req, policy, any_mode=True)
        others = [c for c in candidates if c.worker_id != worker_id and c.ready and wanted.mode in c.modes]
        other_id = choose_worker(None, others, prefer_mode=wanted.mode) if wanted.mode != decision.mode else None
        if other_id is not None:
            other = state.fleet.workers[other_id]
            other_decision = _decide(session, other, req, policy)
            if other_decision.mode == wanted.mode:
                # It runs what the rules want, for the rules' reason (a plain-only worker's
                # decision would otherwise name the worker, not why plain was wanted).
                if other_decision.reason in FIXED_MODE_REASONS:
                    other_decision = replace(other_decision, reason=wanted.reason)
                return other, other_decision
    return handle, decision


def _record(state: GatewayState, session: Session, decision: Decision, policy: PolicyConfig) -> None:
    metrics = state.metrics
    metrics.series(metrics.decisions, decision.mode, decision.reason).inc()
    if decision.mode == "plain":
        metrics.series(metrics.fallbacks, decision.reason).inc()
    previous = session.last_decision
    if previous is None or previous.mode != decision.mode:
        if previous is not None:
            metrics.mode_switches.labels(model=metrics.model, to=decision.mode, reason=decision.reason).inc()
        session.history.append(ModeChange(time.time(), decision.mode, decision.reason, decision.k))
    session.last_decision = decision
    session.policy_state = record_decision(session.policy_state, decision, policy.auto_k)


async def _admit(state: GatewayState, session: Session, req: CompletionRequest, exclude: frozenset[str] = frozenset(),
                 resume: ResumePoint | None = None, *,
                 trace: RequestTrace | None = None) -> tuple[Admission, WorkerResponse]:
    """Routes, decides and opens the worker stream, retrying on other workers before the first chunk.

    ``resume`` continues a generation another worker began (gateway/migration.py): only
    workers that speak specgate's protocol can take it. ``trace`` gets a child span per attempt.
    """
    trace = trace or RequestTrace(None, None, False)  # tracing off: every method a no-op
    policy = state.policy.active
    tried: set[str] = set(exclude)
    while True:
        candidates = [c for c in state.fleet.candidates() if c.worker_id not in tried
                      and (resume is None or state.fleet.workers[c.worker_id].speaks_specgate)]
        routed = _route(state, session, candidates, req, policy)
        if routed is None:
            if tried - exclude:
                raise NoWorkerLeft(f"no worker could take the request (tried {', '.join(sorted(tried - exclude))})")
            raise NoWorkerReady("no worker is ready", retry_after_s=1.0)
        handle, decision = routed
        worker_id = session.worker_id = handle.worker_id
        # A non-streaming client sees no chunk: its worker may send them a few at a time.
        coalesce_s = 0.0 if req.stream else state.config.server.coalesce_s
        body = worker_body(req, Directive(decision.k, policy.max_batch, policy.batch_resume, policy.max_step_drafts,
                                          resume, policy.auto_k, coalesce_s, whole_answer=coalesce_s > 0),
                           handle.protocol)
        handle.draft_mix.add(decision)
        attempt = trace.attempt(worker_id, decision)
        headers = attempt.headers  # the trace context (gateway/tracing.py)
        request_id = request_id_var.get()
        if handle.speaks_specgate and request_id is not None:
            # A specgate worker tags its log lines for this request with the same id and session.
            headers = {**headers, REQUEST_ID_HEADER: request_id, SESSION_HEADER: session.session_id}
        try:
            response = await open_stream(handle, _PATHS[req.kind], body, state.config.server.worker_timeout_s,
                                         headers)
        except WorkerUnreachable as exc:
            handle.draft_mix.remove(decision)
            attempt.failed(exc)
            log.warning("%s unreachable (%s); retrying elsewhere", worker_id, exc)
            state.fleet.report_failure(handle, str(exc))
            tried.add(worker_id)
            session.worker_id = None
            continue
        except BaseException as exc:
            handle.draft_mix.remove(decision)
            attempt.failed(exc)
            raise
        _record(state, session, decision, policy)
        return Admission(session, handle, decision, policy, attempt, len(tried - exclude)), response


def _account(state: GatewayState, admission: Admission, tally: StreamTally, raw: RawChunk,
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
    # Tokens by the mode of the steps that made them: one step, or a coalesced chunk's steps.
    emitted: dict[str, int] = {}
    if report is not None:
        for step in report.steps():
            _account_step(metrics, admission, tally, step)
            mode = "speculative" if step.k > 0 else "plain"
            emitted[mode] = emitted.get(mode, 0) + step.tokens
    elif chunk_text(kind, chunk):
        emitted[admission.decision.mode] = 1
    tokens = sum(emitted.values())
    if tokens:
        tally.tokens += tokens
        gapped = emitted  # tokens whose gap since the one before is observed
        if tally.first_token_at is None:
            # A coalesced chunk says how long its worker held it (workers/coalesce.py): the
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
        # A specgate worker's usage says what ran (its step counts); a server that reports no
        # steps gets the gateway's tally, and the plain steps it cannot see stay unknown.
        if "speculative" not in usage:
            usage["speculative"] = speculative_usage(tally.proposed, tally.accepted, admission.decision.mode,
                                                     tally.speculative_steps if tally.proposed else None)
        chunk["usage"] = usage


def _account_step(metrics: GatewayMetrics, admission: Admission, tally: StreamTally, report: StepReport) -> None:
    """One engine step's drafts into the session's and the worker's acceptance, the tally and metrics."""
    if report.proposed <= 0 and not report.late_steps:
        return  # a plain step: no drafts to count (every step of a plain stream comes here)
    session, handle, policy = admission.session, admission.handle, admission.policy
    session.policy_state = observe(session.policy_state, report.proposed, report.accepted, policy)
    handle.acceptance = observe(handle.acceptance, report.proposed, report.accepted, policy)
    tally.proposed += report.proposed
    tally.accepted += report.accepted
    tally.speculative_steps += int(report.proposed > 0) + sum(g.count for g in report.late_steps)
    metrics.record_steps(handle.worker_id, report.proposed, report.accepted)
    if report.late_steps:  # acceptance the engine learned late (vLLM: when the request ended)
        groups = [(g.proposed, g.accepted, g.count) for g in report.late_steps]
        session.policy_state = observe_steps(session.policy_state, groups, policy)
        handle.acceptance = observe_steps(handle.acceptance, groups, policy)
        tally.proposed += sum(g.proposed * g.count for g in report.late_steps)
        tally.accepted += sum(g.accepted * g.count for g in report.late_steps)
        for group in report.late_steps:
            metrics.record_steps(handle.worker_id, group.proposed, group.accepted, group.count)


def _worth_sending(kind: RequestKind, chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices") or []
    if not choices:
        return True  # the usage chunk (filtered by the caller)
    choice = choices[0]
    return bool(chunk_text(kind, chunk) or choice.get("finish_reason") or (choice.get("delta") or {}).get("role"))


async def _send(out: web.StreamResponse, data: bytes, last: bool = False) -> None:
    try:
        if last:  # the stream's last event and its end in one write: one read fewer for the client
            await out.write_eof(data)
        else:
            await out.write(data)
    except ConnectionResetError as exc:  # the client left mid-stream (aiohttp's ClientConnectionResetError)
        raise ClientDisconnected(f"client disconnected mid-stream: {exc}") from None


def _restated(received: Received) -> bool:
    """Whether a read holds a usage chunk the gateway restates from its tally (a vLLM server's,
    or one without ``speculative``): then the tally must be whole before the answer is."""
    _, admission, batch = received
    for raw in batch:
        usage = raw.chunk.get("usage")
        if usage is not None and (admission.handle.protocol == "vllm" or "speculative" not in usage):
            return True
    return False


def _answer_response(answer: bytes, stream: MigratingStream, headers: dict[str, str]) -> web.Response:
    # After a migration: every worker that served it, in order; the mode is the last decision's.
    headers[WORKER_HEADER] = stream.workers_header
    headers[MODE_HEADER] = stream.admission.decision.header
    return web.Response(body=answer, headers=headers, content_type="application/json")


async def _answer_whole(request: web.Request, state: GatewayState, stream: MigratingStream, whole: WholeAnswer,
                        tally: StreamTally, headers: dict[str, str], started: float) -> web.Response:
    """A worker's whole answer, relayed as it came; its steps accounted after the write, as a
    stream's last read is (``_answer``)."""
    response = _answer_response(whole.answer, stream, headers)
    try:
        await response.prepare(request)
        await response.write_eof()
    finally:
        if whole.report is not None:
            _account(state, stream.admission, tally, RawChunk({}, None, None, whole.report), stream.kind, started,
                     whole.at)
    return response


async def _answer(request: web.Request, state: GatewayState, stream: MigratingStream,
                  batches: AsyncGenerator[list[RawChunk], None], tally: StreamTally, headers: dict[str, str],
                  started: float) -> web.Response:
    """A non-streaming request: the worker's whole answer (``_answer_whole``), or its chunks
    folded into one answer.

    Each worker read is accounted (acceptance, metrics, tally) when the next one comes, so a
    long generation's tokens and acceptance reach the metrics and the policy as they come; the
    last read, which ends the stream, is accounted after the answer is written, as a server
    logs after it responds: that work then runs while the client reads the answer, not before
    it (bench.overhead's added p50: a short completion is one read). It runs before this task
    yields to the loop again (``write_eof`` waits only while the socket's buffer is full, and
    then the client does not have the whole answer yet), so a session's next request still
    sees it (tests/test_sim.py). A read that restates usage from the tally is accounted first.
    Each read is accounted with the time it came and the admission it came under (a migrated
    stream has several); one held when the request fails is accounted before the failure
    leaves.
    """
    whole = await stream.whole_answer()
    if whole is not None:
        return await _answer_whole(request, state, stream, whole, tally, headers, started)
    kind = stream.kind
    held: Received | None = None

    def account(received: Received) -> None:
        at, admission, batch = received
        for raw in batch:
            _account(state, admission, tally, raw, kind, started, at)

    try:
        async for batch in batches:
            if held is not None:
                account(held)
            held = (time.monotonic(), stream.admission, batch)
            tally.collected += [raw.chunk for raw in batch]
            if request.transport is None or request.transport.is_closing():
                # The client left: stop reading, which closes the worker stream and aborts it.
                raise ClientDisconnected("client disconnected while its completion was generated")
        if held is not None and _restated(held):
            account(held)
            held = None
        response = _answer_response(orjson.dumps(assemble(kind, tally.collected)), stream, headers)
        if held is not None:
            await response.prepare(request)
            await response.write_eof()
    finally:  # a failed answer, or a client gone mid-write, does not undo what the worker did
        if held is not None:
            account(held)
    return response


async def relay(request: web.Request, kind: RequestKind, state: GatewayState) -> web.StreamResponse:
    trace = request.app[TRACING_KEY].start(request, kind)  # a no-op unless tracing is on
    error: BaseException | None = None
    drain = request.app[DRAIN_KEY]
    busy_poll = state.busy_poll
    if busy_poll is not None:  # server.busy_poll_s: awake for the worker's answer
        busy_poll.touch(time.monotonic())
    try:
        with drain.track() as in_flight:  # refused with 503 once the gateway drains for shutdown
            return await _relay(request, kind, state, trace, in_flight)
    except BaseException as exc:
        error = exc
        raise
    finally:
        trace.finish(error)
        if busy_poll is not None:  # ...and for the client's next request
            busy_poll.touch(time.monotonic())


async def _relay(request: web.Request, kind: RequestKind, state: GatewayState, trace: RequestTrace,
                 in_flight: InFlight) -> web.StreamResponse:
    started = time.monotonic()
    drain, ops = request.app[DRAIN_KEY], request.app[OPS_KEY]
    # Tags this request's log lines (workers/logs.py); each aiohttp handler runs in its own task,
    # so these values never leak into another request's context.
    request_id_var.set(state.sessions.random_id())  # 32 hex digits, as uuid4().hex without its object
    req = parse_request(kind, await read_json(request))
    if req.model != state.config.model.name:
        raise NotFound(f"model '{req.model}' does not exist; available: '{state.config.model.name}'",
                       param="model", code="model_not_found")
    for name in GATEWAY_FIELDS:  # the specgate directive and vllm_xargs: the gateway decides speculation
        if req.raw.get(name) is not None:
            raise BadRequest(f"'{name}' is set by the gateway, not by clients", param=name)
    # Sessions are scoped to the API key that made them: another key's session id is another session.
    session = state.sessions.touch(_session_id(request, req), started, scope_of(request))
    session.requests += 1
    session_var.set(session.session_id)
    admission, response = await drain.guard(_admit(state, session, req, trace=trace))
    if admission.retries:
        ops.retries.inc(admission.retries)
    trace.admitted(session.session_id, admission.handle.worker_id, admission.decision,
                   req.raw.get("prompt", req.raw.get("messages")))
    decision_var.set(admission.decision.header)
    # A worker that dies mid-way: the stream resumes on another (gateway/migration.py).
    stream = MigratingStream(state, session, req, admission, response, functools.partial(_admit, trace=trace),
                             drain, ops)
    in_flight.stream = stream
    headers = {SESSION_HEADER: session.session_id, MODE_HEADER: admission.decision.header,
               WORKER_HEADER: admission.handle.worker_id}
    tally = StreamTally()
    batches = stream.batches()
    try:
        if not req.stream:
            return await _answer(request, state, stream, batches, tally, headers, started)
        out = await start_sse(request, headers)
        try:
            # One client write per worker read, of the worker's own bytes for every chunk the
            # gateway did not change (the hot loop: bench.overhead).
            async for batch in batches:
                events = []
                now = time.monotonic()
                for raw in batch:
                    _account(state, stream.admission, tally, raw, kind, started, now)
                    if raw.chunk.get("usage") is not None and not req.include_usage:
                        continue
                    if _worth_sending(kind, raw.chunk):
                        events.append(raw.sse())
                if events:
                    await _send(out, b"".join(events))
            await _send(out, sse_event("[DONE]"), last=True)
        except ClientDisconnected:
            raise
        except ApiError as error:  # the response has started: the stream carries the error
            log.warning("stream for session %s failed mid-way: %s", session.session_id, error.message)
            admission.attempt.failed(error)
            await _send(out, sse_event(error.body()), last=True)
        return out
    finally:
        await batches.aclose()
        await stream.aclose()
        stream.admission.attempt.end()
        trace.streamed(tally.first_token_at - started if tally.first_token_at is not None else None, tally.tokens)
        # One line per request (tagged with its id, session and decision by workers/logs.py);
        # never the body or headers: no prompt text or API key reaches the log.
        request.app[REQUEST_LOG_KEY].info("%s request on %s done in %.3f s", kind, stream.admission.handle.worker_id,
                                          time.monotonic() - started)
