"""A worker process's HTTP face: the OpenAI API over any engine, plus specgate fields.

The worker is a standalone OpenAI-compatible server (``/v1/completions``,
``/v1/chat/completions``, streaming or not, ``/v1/models``) that also understands the
gateway's ``specgate`` directive (K and batch thresholds for this request) and attaches a
``specgate`` step report (drafts proposed/accepted, batch depth, K) to every streamed chunk.
``GET /specgate/worker`` is its self-description: engine, modes it serves, max K, load.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from policies.methods import Method
from policies.tree import TreeShape
from workers.api.answers import assemble, speculative_usage
from workers.api.errors import ApiError, BadRequest, NotFound, Overloaded, WorkerFailed
from workers.api.generation import SamplingParams, StepCounts
from workers.api.logs import RequestLog, request_id_var, session_var
from workers.api.request_parser import parse_request
from workers.api.schema import FIELD_NAMES
from workers.api.tokens import Unauthorized, bearer, matching
from workers.api.web_common import Handler, health, model_list, openai_errors, read_json, sse_event, start_sse
from workers.api.wire import (
    DIRECTIVE_FIELD,
    MAX_SESSION_ID,
    REQUEST_ID_HEADER,
    SESSION_HEADER,
    CompletionRequest,
    RequestKind,
    StepReport,
    step_log,
)
from workers.engines.interface import Engine, EngineRequestError, GenerationRequest, StepEvent, StepStats
from workers.server.coalesce import Chunk, chunk_event, write_coalesced
from workers.server.context import CONTEXT_KEY, WorkerContext, WorkerSettings
from workers.server.metrics import WorkerMetrics
from workers.server.tokenize import detokenize, tokenize
from workers.text import TextCodec, TextStream

log = logging.getLogger(__name__)




def create_worker_app(settings: WorkerSettings, engine: Engine,
                      registry: CollectorRegistry | None = None) -> web.Application:
    """``registry=None`` uses prometheus_client's default (multiprocess-aware) registry."""
    # Outermost, so that the error middleware's lines are tagged too.
    middlewares: list[Middleware] = [_tag_logs, openai_errors]
    if settings.token is not None:
        middlewares.append(_gateway_only(settings.token))
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        metrics = WorkerMetrics.create(registry)
        labels = {"model": settings.served_model_name, "worker": settings.worker_id}
        # Series exist from the start, at zero: rate() over a window in which a counter first
        # appears (already above zero) would otherwise miss or misjudge its first increase.
        # Looked up once: labels() takes a lock and builds a key, and on_step runs every step.
        # The acceptance and verification gauges appear with the first drafts, not at 0 before.
        drafted, accepted = metrics.draft_tokens.labels(**labels), metrics.accepted_tokens.labels(**labels)
        depth, queue = metrics.batch_depth.labels(**labels), metrics.queue_length.labels(**labels)
        acceptance = functools.cache(lambda: metrics.acceptance_rate.labels(**labels))
        verification = functools.cache(lambda: metrics.verification_ms.labels(**labels))
        step_seconds = metrics.step_seconds.labels(**labels)
        drafted.inc(0)
        accepted.inc(0)
        depth.set(0)
        queue.set(0)

        def on_step(stats: StepStats) -> None:
            if stats.proposed:
                drafted.inc(stats.proposed)
                accepted.inc(stats.accepted)
            totals = engine.totals
            if totals.draft_tokens:
                acceptance().set(totals.accepted_tokens / totals.draft_tokens)
            if stats.verify_s:
                verification().set(1000 * totals.verification_s_total / max(1, totals.steps))
            depth.set(stats.batch_depth)
            queue.set(stats.queue_length)
            if stats.prefix_cache_bytes is not None:
                metrics.prefix_cache_bytes.labels(**labels).set(stats.prefix_cache_bytes)
            if stats.step_s:
                step_seconds.observe(stats.step_s)

        await engine.start(on_step)
        request_log = RequestLog(log)
        app[CONTEXT_KEY] = WorkerContext(settings, engine, TextCodec.from_model_dir(settings.tokenizer_dir), metrics,
                                         registry, request_log)
        async with request_log.running():
            yield
            await engine.stop()

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/specgate/worker", _describe)
    app.router.add_get("/metrics", _metrics)
    return app


@web.middleware
async def _tag_logs(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tags the log lines of a request with the gateway's request id and session (workers/api/logs.py).

    Each aiohttp request runs in its own task, so the values stay with this request. Either
    header from another client is taken as well, if it is printable and not too long: it only
    labels that client's own lines.
    """
    for header, var in ((REQUEST_ID_HEADER, request_id_var), (SESSION_HEADER, session_var)):
        value = request.headers.get(header)
        if value and len(value) <= MAX_SESSION_ID and value.isprintable():
            var.set(value)
    return await handler(request)


def _gateway_only(token: str) -> Middleware:
    """Refuses every request without the gateway's token, except the liveness probe."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != "/health":
            presented = bearer(request)
            if presented is None:
                raise Unauthorized("this worker serves its gateway only: send its token as 'Authorization: Bearer'",
                                   code="invalid_api_key")
            if matching(presented, (token,)) is None:
                raise Unauthorized("wrong worker token", code="invalid_api_key")
        return await handler(request)

    return check


def _tree_of(ctx: WorkerContext, req: CompletionRequest) -> TreeShape | None:
    """The directive's token tree, where this engine verifies trees that large; else None (the
    request runs the chain of the directive's K, its depth): an engine serving chains only
    publishes ``tree_max_nodes`` 0, and a gateway never asks it for one."""
    if req.directive is None or req.directive.tree is None:
        return None
    shape = TreeShape.parse(req.directive.tree)  # the parser checked it (workers/api/request_fast.py)
    info = ctx.engine.info
    return shape if shape.nodes <= info.tree_max_nodes and shape.depth <= info.max_k else None


def _method_of(ctx: WorkerContext, req: CompletionRequest) -> Method:
    """The directive's method, where this engine runs it; else the draft model (as ``_tree_of``
    falls back to the chain)."""
    method = req.directive.method if req.directive is not None else None
    return method if method is not None and method in ctx.engine.info.methods else "draft"


# -- handlers -----------------------------------------------------------------------------------------
def describe(ctx: WorkerContext) -> dict[str, Any]:
    engine = ctx.engine
    info = engine.info
    stats = engine.totals
    cost_model = engine.cost_model
    return {
        "worker_id": ctx.settings.worker_id, "engine": info.kind, "model": ctx.settings.served_model_name,
        "modes": ["speculative", "plain"] if info.max_k > 0 else ["plain"], "max_k": info.max_k,
        "max_slots": info.max_slots, "context_window": info.context_window, "tree_max_nodes": info.tree_max_nodes,
        "methods": list(info.methods), "shadow_lookup": info.shadow_lookup, "prefix_cache": info.prefix_cache,
        **info.details,
        "batch_depth": engine.batch_depth, "queue_length": engine.queue_length, "batch_full": engine.batch_full,
        "stats": {"steps": stats.steps, "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens,
                  "emitted_tokens": stats.emitted_tokens},
        "cost_model": None if cost_model is None else cost_model.to_json(),
    }


async def _describe(request: web.Request) -> web.Response:
    return web.json_response(describe(request.app[CONTEXT_KEY]))


async def _models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    return model_list(ctx.settings.served_model_name, ctx.engine.info.context_window)


async def _metrics(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    body = generate_latest(ctx.registry) if ctx.registry is not None else generate_latest()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


def _prompt_ids(ctx: WorkerContext, req: CompletionRequest) -> list[int]:
    if req.kind == "chat":
        return ctx.codec.encode_chat(req.messages)
    if isinstance(req.prompt, list):
        vocab = ctx.engine.info.vocab_size
        if any(t >= vocab for t in req.prompt):
            raise BadRequest(f"token ids must be below the vocabulary size {vocab}", param="prompt")
        return req.prompt
    return ctx.codec.encode(req.prompt or "")


def _known_fields(body: Any) -> Any:
    """Drops top-level fields the API does not define, as vLLM's server does.

    The gateway refuses them from clients (OpenAI's strictness); a worker also sits behind
    other routers (vllm-router adds its own fields, e.g. ``no_stop_trim``), which a
    vLLM-compatible backend must tolerate.
    """
    if not isinstance(body, dict):
        return body
    unknown = [key for key in body if key not in FIELD_NAMES]
    if unknown:
        log.debug("ignoring unknown request fields %s", unknown[:8])
        body = {k: v for k, v in body.items() if k in FIELD_NAMES}
    return body


async def _serve(request: web.Request, kind: RequestKind) -> web.StreamResponse:
    arrived = time.monotonic()
    ctx = request.app[CONTEXT_KEY]
    req = parse_request(kind, _known_fields(await read_json(request)))
    if req.model != ctx.settings.served_model_name:
        raise NotFound(f"model '{req.model}' does not exist; this worker serves '{ctx.settings.served_model_name}'",
                       param="model", code="model_not_found")
    resume = req.directive.resume if req.directive is not None else None
    if resume is not None:
        # Another worker began this generation: go on from its prompt and output token ids.
        vocab = ctx.engine.info.vocab_size
        if any(t >= vocab for t in resume.prompt_ids + resume.output_ids):
            raise BadRequest(f"resumed token ids must be below the vocabulary size {vocab}", param="specgate.resume")
        prompt_ids = list(resume.prompt_ids + resume.output_ids)
    else:
        prompt_ids = _prompt_ids(ctx, req)
    window = ctx.engine.info.context_window
    room = window - len(prompt_ids)
    if room < 1:
        raise BadRequest(f"prompt is {len(prompt_ids)} tokens; the context window is {window}",
                         param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
    max_tokens = req.max_tokens if req.max_tokens is not None else room
    if max_tokens > room:
        raise BadRequest(f"max_tokens ({max_tokens}) + prompt ({len(prompt_ids)} tokens) exceeds the context "
                         f"window of {window}", param="max_tokens", code="context_length_exceeded")
    if req.min_tokens > max_tokens:  # as vLLM refuses it
        raise BadRequest(f"min_tokens ({req.min_tokens}) must be less than or equal to max_tokens ({max_tokens})",
                         param="min_tokens")
    if ctx.engine.queue_length >= ctx.settings.max_queue:
        raise Overloaded("worker queue is full", retry_after_s=1.0)
    k = req.directive.k if req.directive is not None else ctx.settings.default_k
    if req.directive is not None:
        ctx.engine.set_batch_thresholds(req.directive.max_batch, req.directive.batch_resume,
                                        req.directive.max_step_drafts, req.directive.cost_rule)
    generation = GenerationRequest(
        request_id=("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12), prompt_ids=prompt_ids,
        max_tokens=max_tokens, k=k, resumed_tokens=len(resume.output_ids) if resume is not None else 0,
        tree=_tree_of(ctx, req), method=_method_of(ctx, req), session=request.headers.get(SESSION_HEADER),
        cache_scope=req.cache_salt or "",
        params=SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                              position_offset=len(resume.output_ids) if resume is not None else 0,
                              ignore_eos=req.ignore_eos, min_tokens=req.min_tokens))
    chunks = _generate(ctx, req, generation)
    try:
        # The first chunk comes before the response starts, so early failures keep their status.
        first = await anext(chunks)
        if not req.stream:
            items = [first] + [item async for item in chunks]
            answer = assemble(kind, [chunk for chunk, _ in items])
            if req.directive is not None and req.directive.step_log:
                answer[DIRECTIVE_FIELD] = step_log(report for _, report in items if report is not None)
            return web.json_response(answer)
        coalesce_s = req.directive.coalesce_s if req.directive is not None else 0.0
        if coalesce_s > 0:  # the gateway's non-streaming client (workers/server/coalesce.py)
            return await write_coalesced(request, kind, _prepend(first, chunks), coalesce_s, req.include_usage,
                                         arrived, req.directive is not None and req.directive.whole_answer)
        response = await start_sse(request)
        try:
            async for chunk in _prepend(first, chunks):
                if chunk[0].get("usage") is not None and not req.include_usage:
                    continue
                await response.write(chunk_event(chunk))
        except ApiError as error:  # too late for a status code: the stream carries the error
            await response.write_eof(sse_event(error.body()))
            return response
        await response.write_eof(sse_event("[DONE]"))  # with the stream's end: one write
        return response
    finally:
        await chunks.aclose()  # a vanished client aborts the sequence (see _generate's finally)


async def _prepend(first: Chunk, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    yield first
    async for item in rest:
        yield item


async def _next_step(events: AsyncGenerator[StepEvent, None], rid: str) -> StepEvent:
    """The engine's next step for request ``rid``, its failures raised as the wire's errors."""
    try:
        return await anext(events)
    except EngineRequestError as exc:
        raise BadRequest(str(exc)) from None
    except StopAsyncIteration:
        raise WorkerFailed("engine ended the request without a finish reason") from None
    except ApiError:
        raise
    except Exception as exc:
        log.exception("engine failed request %s", rid)
        raise WorkerFailed(f"engine failed: {exc}") from None


def _count_prefix_lookup(ctx: WorkerContext, cached: int) -> None:
    labels = {"model": ctx.settings.served_model_name, "worker": ctx.settings.worker_id}
    ctx.metrics.prefix_cache_requests.labels(**labels, result="hit" if cached else "miss").inc()
    ctx.metrics.prefix_cached_tokens.labels(**labels).inc(cached)


async def _generate(ctx: WorkerContext, req: CompletionRequest,
                    generation: GenerationRequest) -> AsyncGenerator[Chunk, None]:
    """Chunks for one request: a chunk per engine step, then one usage chunk."""
    rid, created, model = generation.request_id, int(time.time()), ctx.settings.served_model_name
    started = time.monotonic()
    text = TextStream(ctx.codec, req.stop, min_tokens=req.min_tokens)
    resume = req.directive.resume if req.directive is not None else None
    prompt_ids = generation.prompt_ids
    earlier = 0  # output tokens generated before this worker took over (a resumed request)
    if resume is not None:
        prompt_ids, earlier = list(resume.prompt_ids), len(resume.output_ids)
        text.prime(list(resume.output_ids), resume.text_sent)
    emitted = 0
    ran = StepCounts()  # what ran, step by step (the worker's batch latch may run steps plain)
    finished, first_chunk = False, True
    cached: int | None = None  # the engine's prefix-cache hit, where it reports one

    def chunk(delta: str, finish: str | None, report: StepReport | None, first: bool = False) -> dict[str, Any]:
        if req.kind == "chat":
            content: dict[str, Any] = {"role": "assistant", "content": delta} if first else {"content": delta}
            choice: dict[str, Any] = {"index": 0, "delta": content, "finish_reason": finish, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if report is not None:
            out["specgate"] = report.to_json()
        return out

    events = ctx.engine.generate(generation)
    try:
        while not finished:
            item = await _next_step(events, rid)
            # Engines that learn acceptance late (vLLM) report their speculative steps in
            # late_steps, and the rest of their steps are plain.
            ran.add(item.proposed, item.accepted, item.late_steps)
            if item.cached_tokens is not None:
                cached = item.cached_tokens
            delta = text.push(item.tokens)
            # Tokens after a stop string were never the client's: they are not counted.
            kept = text.last_kept
            if item.eos and not text.stopped:
                kept += 1  # the EOS token was generated: counted, as vLLM counts it, never sent
            emitted += kept
            finish = item.finish_reason
            if text.stopped:
                finish = "stop"  # even when the engine also reached max_tokens in that step
            elif finish is not None:
                delta += text.flush()
            finished = finish is not None
            report = StepReport(item.proposed, item.accepted, item.batch_depth, item.proposed, kept, item.late_steps,
                                token_ids=tuple(item.tokens[:text.last_kept]),
                                prompt_ids=tuple(prompt_ids) if first_chunk else None,
                                tree=None if item.path is None else str(item.path.shape),
                                path=None if item.path is None else item.path.ranks, shadow=item.shadow,
                                cached=(len(prompt_ids), item.cached_tokens)
                                if item.cached_tokens is not None and resume is None else None)
            ctx.metrics.record_shadow(ctx.settings.served_model_name, ctx.settings.worker_id, item.shadow)
            # A resumed stream continues the client's: its role was sent by the first worker.
            yield chunk(delta, finish, report, first=first_chunk and resume is None), report
            first_chunk = False
        mode = "speculative" if generation.k > 0 else "plain"
        # One line per request (never its text), tagged by _tag_logs: it ties the id the client
        # sees to the gateway's request id in the log.
        ctx.request_log.info("%s %s finished (%s): %d prompt + %d completion tokens, %d steps (%d speculative) "
                             "in %.3f s", req.kind, rid, finish, len(prompt_ids), earlier + emitted, ran.steps,
                             ran.speculative_steps, time.monotonic() - started)
        usage: dict[str, Any] = {
            "prompt_tokens": len(prompt_ids), "completion_tokens": earlier + emitted,
            "total_tokens": len(prompt_ids) + earlier + emitted,
            "speculative": speculative_usage(ran.proposed, ran.accepted, mode, ran.speculative_steps,
                                             max(0, ran.steps - ran.speculative_steps), ran.tested)}
        if cached is not None:  # OpenAI's field, only from engines that report it
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
            _count_prefix_lookup(ctx, cached)
        yield {"id": rid, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
               "created": created, "model": model, "choices": [], "usage": usage}, None
    finally:
        await events.aclose()  # aborts the sequence if it has not finished (stop string, client gone)
