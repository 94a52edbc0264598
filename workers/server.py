"""A worker process's HTTP face: the OpenAI API over the embedded engine, plus specgate fields.

The worker is a standalone OpenAI-compatible server (``/v1/completions``,
``/v1/chat/completions``, streaming or not, ``/v1/models``) that also understands the
gateway's ``specgate`` directive (K and batch thresholds for this request) and attaches a
``specgate`` step report (drafts proposed/accepted, batch depth, K) to every streamed chunk.
``GET /specgate/worker`` is its self-description: engine, modes it serves, max K, load.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from workers.engine import GenerationRequest, SpeculativeEngine, StepEvent
from workers.metrics import WorkerMetrics
from workers.model import TORCH_DTYPES, LlamaForCausalLM, resolve_dtype
from workers.protocol import (
    ApiError,
    BadRequest,
    CompletionRequest,
    NotFound,
    Overloaded,
    RequestKind,
    StepReport,
    WorkerFailed,
    assemble,
    parse_request,
    speculative_usage,
)
from workers.runner import EngineRunner
from workers.sampling import SamplingParams
from workers.text import TextCodec, TextStream, render_chat
from workers.web_common import health, model_list, openai_errors, read_json, sse_event, start_sse

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSettings:
    worker_id: str
    target: Path
    draft: Path | None
    served_model_name: str
    max_slots: int = 16  # sequences batched together
    max_k: int = 8  # deepest speculation this worker runs
    default_k: int = 6  # K for requests without a gateway directive
    max_queue: int = 64  # waiting sequences before 429
    # The target's. "auto": bfloat16 where it runs prepacked (fast, bit-identical verification),
    # else float32, which is faster than unpacked bfloat16 and makes no bit-for-bit promise.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # The draft's: float32 by default, because for a model this small bfloat16's upcasts around
    # every norm cost more than its cheaper matmuls save; its numerics never reach the output.
    draft_dtype: Literal["float32", "bfloat16"] = "float32"
    max_body_bytes: int = 1 << 20


@dataclass
class WorkerContext:
    settings: WorkerSettings
    runner: EngineRunner
    codec: TextCodec
    metrics: WorkerMetrics
    registry: CollectorRegistry | None
    context_window: int


CONTEXT_KEY = web.AppKey("worker_context", WorkerContext)


def load_engine(settings: WorkerSettings) -> tuple[SpeculativeEngine, TextCodec]:
    target = LlamaForCausalLM.from_pretrained(settings.target, TORCH_DTYPES[resolve_dtype(settings.dtype)])
    draft = None
    if settings.draft is not None:
        draft = LlamaForCausalLM.from_pretrained(settings.draft, TORCH_DTYPES[settings.draft_dtype])
    if settings.dtype == "bfloat16" and not target.prepacked:
        log.warning("bfloat16 target without oneDNN prepacking on this CPU (no AVX512-BF16/AMX?): expect slow "
                    "steps and no bit-identical verification; workers.dtype: auto picks float32 here")
    engine = SpeculativeEngine(target, draft, max_slots=settings.max_slots, max_k=settings.max_k)
    return engine, TextCodec(settings.target / "tokenizer.json", target.cfg.bos_token_id)


def create_worker_app(settings: WorkerSettings, registry: CollectorRegistry | None = None) -> web.Application:
    """``registry=None`` uses prometheus_client's default (multiprocess-aware) registry."""
    app = web.Application(middlewares=[openai_errors], client_max_size=settings.max_body_bytes)

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        engine, codec = load_engine(settings)
        metrics = WorkerMetrics.create(registry)

        def on_step(engine: SpeculativeEngine, events: list[StepEvent]) -> None:
            labels = {"worker": settings.worker_id}
            proposed = sum(e.proposed for e in events)
            metrics.draft_tokens.labels(**labels).inc(proposed)
            metrics.accepted_tokens.labels(**labels).inc(sum(e.accepted for e in events))
            stats = runner.stats
            if stats.draft_tokens:
                metrics.acceptance_rate.labels(**labels).set(stats.accepted_tokens / stats.draft_tokens)
            metrics.verification_ms.labels(**labels).set(1000 * stats.verification_s_total / max(1, stats.steps))
            metrics.batch_depth.labels(**labels).set(engine.batch_depth)
            metrics.queue_length.labels(**labels).set(engine.queue_length)
            if events:  # none: the runner reports the engine went idle (gauges only, no step ran)
                metrics.step_seconds.labels(**labels).observe(engine.last_draft_s + engine.last_target_s)

        runner = EngineRunner(engine, asyncio.get_running_loop(), on_step)
        runner.start()
        window = engine.max_positions - engine.max_k
        app[CONTEXT_KEY] = WorkerContext(settings, runner, codec, metrics, registry, window)
        yield
        runner.stop()

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", health)
    app.router.add_get("/specgate/worker", _describe)
    app.router.add_get("/metrics", _metrics)
    return app


# -- handlers -----------------------------------------------------------------------------------------
def describe(ctx: WorkerContext) -> dict[str, Any]:
    engine = ctx.runner.engine
    stats = ctx.runner.stats
    return {
        "worker_id": ctx.settings.worker_id, "engine": "embedded", "model": ctx.settings.served_model_name,
        "modes": ["speculative", "plain"] if engine.max_k > 0 else ["plain"], "max_k": engine.max_k,
        "max_slots": engine.max_slots, "context_window": ctx.context_window,
        "precision": {"target": resolve_dtype(ctx.settings.dtype),
                      "draft": ctx.settings.draft_dtype if engine.draft else None,
                      "target_prepacked": engine.target.prepacked},
        "batch_depth": ctx.runner.batch_depth, "queue_length": ctx.runner.queue_length,
        "batch_full": ctx.runner.batch_full,
        "stats": {"steps": stats.steps, "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens,
                  "emitted_tokens": stats.emitted_tokens},
    }


async def _describe(request: web.Request) -> web.Response:
    return web.json_response(describe(request.app[CONTEXT_KEY]))


async def _models(request: web.Request) -> web.Response:
    return model_list(request.app[CONTEXT_KEY].settings.served_model_name)


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
        return ctx.codec.encode(render_chat(req.messages))
    if isinstance(req.prompt, list):
        vocab = ctx.runner.engine.target.cfg.vocab_size
        if any(t >= vocab for t in req.prompt):
            raise BadRequest(f"token ids must be below the vocabulary size {vocab}", param="prompt")
        return req.prompt
    return ctx.codec.encode(req.prompt or "")


async def _serve(request: web.Request, kind: RequestKind) -> web.StreamResponse:
    ctx = request.app[CONTEXT_KEY]
    req = parse_request(kind, await read_json(request))
    if req.model != ctx.settings.served_model_name:
        raise NotFound(f"model '{req.model}' does not exist; this worker serves '{ctx.settings.served_model_name}'",
                       param="model", code="model_not_found")
    prompt_ids = _prompt_ids(ctx, req)
    room = ctx.context_window - len(prompt_ids)
    if room < 1:
        raise BadRequest(f"prompt is {len(prompt_ids)} tokens; the context window is {ctx.context_window}",
                         param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
    max_tokens = req.max_tokens if req.max_tokens is not None else room
    if max_tokens > room:
        raise BadRequest(f"max_tokens ({max_tokens}) + prompt ({len(prompt_ids)} tokens) exceeds the context "
                         f"window of {ctx.context_window}", param="max_tokens", code="context_length_exceeded")
    if ctx.runner.queue_length >= ctx.settings.max_queue:
        raise Overloaded("worker queue is full", retry_after_s=1.0)
    k = req.directive.k if req.directive is not None else ctx.settings.default_k
    if req.directive is not None:
        ctx.runner.set_batch_thresholds(req.directive.max_batch, req.directive.batch_resume)
    generation = GenerationRequest(
        request_id=("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12), prompt_ids=prompt_ids,
        max_tokens=max_tokens, k=k,
        params=SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed))
    chunks = _generate(ctx, req, generation)
    try:
        # The first chunk comes before the response starts, so early failures keep their status.
        first = await anext(chunks)
        if not req.stream:
            return web.json_response(assemble(kind, [first] + [c async for c in chunks]))
        response = await start_sse(request)
        try:
            async for chunk in _prepend(first, chunks):
                if chunk.get("usage") is not None and not req.include_usage:
                    continue
                await response.write(sse_event(chunk))
        except ApiError as error:  # too late for a status code: the stream carries the error
            await response.write(sse_event(error.body()))
            return response
        await response.write(sse_event("[DONE]"))
        return response
    finally:
        await chunks.aclose()  # a vanished client aborts the sequence (see _generate's finally)


async def _prepend(first: dict[str, Any], rest: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    yield first
    async for item in rest:
        yield item


async def _generate(ctx: WorkerContext, req: CompletionRequest,
                    generation: GenerationRequest) -> AsyncGenerator[dict[str, Any], None]:
    """Chunks for one request: a chunk per engine step, then one usage chunk."""
    events: asyncio.Queue[StepEvent | BaseException] = asyncio.Queue()
    ctx.runner.submit(generation, events.put_nowait)
    rid, created, model = generation.request_id, int(time.time()), ctx.settings.served_model_name
    text = TextStream(ctx.codec, req.stop)
    emitted = proposed = accepted = 0
    finished = False
    first_chunk = True

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

    try:
        while not finished:
            item = await events.get()
            if isinstance(item, ValueError):
                raise BadRequest(str(item))
            if isinstance(item, BaseException):
                raise WorkerFailed(f"engine failed: {item}")
            emitted += len(item.tokens)
            proposed += item.proposed
            accepted += item.accepted
            delta = text.push(item.tokens)
            finish = item.finish_reason
            if text.stopped and finish is None:
                ctx.runner.abort(rid)
                finish = "stop"
            if finish is not None and not text.stopped:
                delta += text.flush()
            finished = finish is not None
            report = StepReport(item.proposed, item.accepted, item.batch_depth, item.proposed, len(item.tokens))
            yield chunk(delta, finish, report, first=first_chunk)
            first_chunk = False
        mode = "speculative" if generation.k > 0 else "plain"
        yield {"id": rid, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
               "created": created, "model": model, "choices": [],
               "usage": {"prompt_tokens": len(generation.prompt_ids), "completion_tokens": emitted,
                         "total_tokens": len(generation.prompt_ids) + emitted,
                         "speculative": speculative_usage(proposed, accepted, mode)}}
    finally:
        if not finished:
            ctx.runner.abort(rid)
