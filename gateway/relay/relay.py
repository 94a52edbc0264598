"""One client request through the gateway: session, route, decide, forward, account, answer."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson
from aiohttp import web

from gateway.accounting import StreamTally, account_chunk
from gateway.admission import (
    Admission,
    accept_request,
    directive_for,
    pick,
    pick_ready,
    record,
    session_id_of,
)
from gateway.auth import caller_of
from gateway.fleet.worker_http import WorkerResponse
from gateway.fleet.worker_stream import (
    RawChunk,
    WholeAnswer,
    WorkerUnreachable,
    open_stream,
    scope_key,
    worker_body,
)
from gateway.observe.ops_metrics import OPS_KEY
from gateway.observe.tracing import TRACING_KEY, RequestTrace
from gateway.relay.busy_poll import BUSY_POLL_KEY
from gateway.relay.drain import DRAIN_KEY, InFlight
from gateway.relay.migration import MigratingStream
from gateway.sessions.table import Session
from gateway.state import GatewayState
from gateway.tenancy import worker_session_id
from workers.api.answers import assemble, chunk_text
from workers.api.errors import ApiError, ClientDisconnected
from workers.api.logs import RequestLog, decision_var, request_id_var, session_var
from workers.api.web_common import read_json, sse_event, start_sse
from workers.api.wire import REQUEST_ID_HEADER, SESSION_HEADER, CompletionRequest, RequestKind, ResumePoint

log = logging.getLogger(__name__)
# The one line per request, written in batches (workers/api/logs.py); its task runs in app.py's cleanup context.
REQUEST_LOG_KEY = web.AppKey("request_log", RequestLog)
MODE_HEADER = "X-Specgate-Mode"
ROUTE_HEADER = "X-Specgate-Route"  # why this worker: sticky (the session's), prefix (a cached prefix) or load
WORKER_HEADER = "X-Specgate-Worker"
_PATHS: dict[RequestKind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


# A worker read of a non-streaming request: when it came, the admission it came under, its chunks.
Received = tuple[float, Admission, list[RawChunk]]


async def _admit(state: GatewayState, session: Session, req: CompletionRequest, exclude: frozenset[str] = frozenset(),
                 resume: ResumePoint | None = None, *, trace: RequestTrace | None = None,
                 gone: Callable[[], bool] | None = None) -> tuple[Admission, WorkerResponse]:
    """Routes, decides and opens the worker stream, retrying on other workers before the first chunk.

    ``resume`` continues a generation another worker began (gateway/relay/migration.py): only
    workers that speak specgate's protocol can take it. ``trace`` gets a child span per attempt.
    With ``gone`` (whether the client left), a request that finds no worker ready waits for one
    (``pick_ready``); without, it fails at once (a migration waits in its own way).
    """
    trace = trace or RequestTrace(None, None, False)  # tracing off: every method a no-op
    policy = state.policy.active
    tried: set[str] = set(exclude)
    while True:
        if gone is None:
            placed = pick(state, session, req, policy, tried, exclude, resume)
        else:
            placed = await pick_ready(state, session, req, policy, tried, exclude, resume, gone=gone)
        handle, decision = placed.handle, placed.decision
        worker_id = handle.worker_id
        # A non-streaming client sees no chunk: its worker may send them a few at a time.
        coalesce_s = 0.0 if req.stream else state.config.server.coalesce_s
        lease = handle.lease(scope_key(req))
        body = worker_body(req, directive_for(decision, policy, resume, coalesce_s=coalesce_s,
                                              whole_answer=coalesce_s > 0), handle.protocol, lease=lease)
        handle.draft_mix.add(decision)
        attempt = trace.attempt(worker_id, decision)
        headers = attempt.headers  # the trace context (gateway/observe/tracing.py)
        request_id = request_id_var.get()
        if handle.speaks_specgate and request_id is not None:
            # A specgate worker tags its log lines with the request id, and matches the session's
            # earlier prompts by its session id: the digest of (key, id), never the client's id
            # (gateway/tenancy.py), so two keys' sessions of one id never meet in a worker.
            headers = {**headers, REQUEST_ID_HEADER: request_id, SESSION_HEADER: worker_session_id(
                session.scope, session.session_id, state.config.auth.cache_scope_secret)}
        try:
            response = await open_stream(handle, _PATHS[req.kind], body, state.config.server.worker_timeout_s,
                                         headers)
        except WorkerUnreachable as exc:
            handle.draft_mix.remove(decision)
            handle.release(lease)
            attempt.failed(exc)
            log.warning("%s unreachable (%s); retrying elsewhere", worker_id, exc)
            state.fleet.report_failure(handle, str(exc))
            tried.add(worker_id)
            session.worker_id = None
            continue
        except BaseException as exc:
            handle.draft_mix.remove(decision)
            handle.release(lease)
            attempt.failed(exc)
            raise
        record(state, session, decision, policy)
        return Admission(session, handle, decision, policy, attempt, len(tried - exclude), placed.route,
                         placed.prefix_share, lease), response


def _client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


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
            state.settle(account_chunk(stream.admission, tally, RawChunk({}, None, None, whole.report), stream.kind,
                                       started, whole.at))
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
    sees it (tests/e2e/test_sim.py). A read that restates usage from the tally is accounted first.
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
            state.settle(account_chunk(admission, tally, raw, kind, started, at))

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
    busy_poll = request.app.get(BUSY_POLL_KEY)
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
    # Tags this request's log lines (workers/api/logs.py); each aiohttp handler runs in its own task,
    # so these values never leak into another request's context.
    request_id_var.set(state.sessions.random_id())  # 32 hex digits, as uuid4().hex without its object
    caller = caller_of(request)
    # In the caller's cache scope: the request's cache_salt is the scope's digest from here on.
    req = accept_request(state, kind, await read_json(request), caller)
    # Sessions are scoped to the API key that made them: another key's session id is another session.
    session = state.sessions.touch(session_id_of(request.headers, req), started, caller.scope)
    # What another replica learned about this session (state.backend: redis); bounded by state.timeout_s.
    await state.store.load(session)
    session.requests += 1
    session_var.set(session.session_id)
    admission, response = await drain.guard(_admit(state, session, req, trace=trace, gone=functools.partial(
        _client_gone, request)))
    if admission.retries:
        ops.retries.inc(admission.retries)
    trace.admitted(session.session_id, admission.handle.worker_id, admission.decision,
                   req.raw.get("prompt", req.raw.get("messages")))
    decision_var.set(admission.decision.header)
    # A worker that dies mid-way: the stream resumes on another (gateway/relay/migration.py).
    stream = MigratingStream(state, session, req, admission, response, functools.partial(_admit, trace=trace),
                             drain, ops)
    in_flight.stream = stream
    headers = {SESSION_HEADER: session.session_id, MODE_HEADER: admission.decision.header,
               WORKER_HEADER: admission.handle.worker_id, ROUTE_HEADER: admission.route}
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
                    state.settle(account_chunk(stream.admission, tally, raw, kind, started, now))
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
        state.store.save(session)  # queued: written by the store's own task, never on this response's time
        await batches.aclose()
        await stream.aclose()
        stream.admission.attempt.end()
        trace.streamed(tally.first_token_at - started if tally.first_token_at is not None else None, tally.tokens)
        # One line per request (tagged with its id, session and decision by workers/api/logs.py);
        # never the body or headers: no prompt text or API key reaches the log.
        request.app[REQUEST_LOG_KEY].info("%s request on %s done in %.3f s", kind, stream.admission.handle.worker_id,
                                          time.monotonic() - started)
