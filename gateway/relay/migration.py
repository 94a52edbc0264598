"""Streams that survive a worker's death: one generation across the workers that served it.

A specgate worker's chunks carry the token ids behind them and, in the first chunk, the
prompt's, in an SSE comment line of each chunk's event (``workers/api/wire.py``), which the
relay keeps and the client never sees. When the worker's stream breaks
(it died, its connection did, or it went silent past ``server.worker_timeout_s``) after the
first chunk, the generation resumes on another worker with a ``specgate.resume`` directive:
the prompt ids, the output ids so far and how many characters of their text the client
already has. That worker prefills prompt + output (the embedded engine computes the output as
the first worker's decode steps did: greedy and seeded continuations are exact), goes on
with ``max_tokens`` reduced by what was generated, the same sampling parameters and the seed's
position continued, and sends only text the client does not have. Text alone could not do
this: a stop string's holdback means the text sent is not the text of the tokens generated,
and a chat cannot continue from text.

The client sees one stream: the same ``id`` and ``created`` throughout, one role delta, usage
that counts every token once (the dead worker's step counts are carried into the final
usage), and the workers that served it in the last chunks' ``specgate.workers`` (streams) or
in ``X-Specgate-Worker`` (non-streaming). It gives up with today's clear error only when no
worker can take the generation within ``server.migration_wait_s``, after
``server.max_migrations`` migrations, or when the server is shutting down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson

from gateway.admission import Admission, NoWorker
from gateway.fleet.worker_http import WorkerResponse
from gateway.fleet.worker_stream import (
    RawChunk,
    WholeAnswer,
    WorkerLost,
    is_whole_answer,
    iter_chunk_batches,
    read_whole_answer,
)
from gateway.observe.ops_metrics import OpsMetrics
from gateway.relay.drain import Drain, ShuttingDown
from gateway.sessions.table import Session
from gateway.state import GatewayState
from workers.api.answers import chunk_text, speculative_usage
from workers.api.errors import ApiError, WorkerFailed, WorkerTimeout
from workers.api.generation import StepCounts
from workers.api.wire import (
    DIRECTIVE_FIELD,
    PROMPT_IDS_FIELD,
    TOKEN_IDS_FIELD,
    CompletionRequest,
    RequestKind,
    ResumePoint,
)

log = logging.getLogger(__name__)
# (state, session, request, exclude, resume) -> the admission and the worker's open stream
AdmitFn = Callable[[GatewayState, Session, CompletionRequest, frozenset[str], ResumePoint | None],
                   Awaitable[tuple[Admission, WorkerResponse]]]
RETRY_PAUSE_S = 0.1


class StreamIds:
    """The stream's prompt and output token ids, from its events' ids comments.

    Kept as the worker sent them and parsed only when asked (a migration, a dead worker's
    usage): most streams never migrate, and parsing every event's ids as it came showed in
    py-spy profiles of the gateway under sequential load.
    """

    __slots__ = ("_complete", "_output", "_pending", "_prompt")

    def __init__(self) -> None:
        self._pending: list[tuple[bytes | None, bool]] = []  # (ids comment, whether its chunk had text)
        self._prompt: list[int] | None = None
        self._output: list[int] = []
        self._complete = True

    def add(self, ids: bytes | None, has_text: bool) -> None:
        if ids is not None or has_text:
            self._pending.append((ids, has_text))

    def _parse(self) -> None:
        for ids, has_text in self._pending:
            try:
                parsed = orjson.loads(ids) if ids is not None else None
            except orjson.JSONDecodeError:
                parsed = None
            tokens = parsed.get(TOKEN_IDS_FIELD) if isinstance(parsed, dict) else None
            prompt = parsed.get(PROMPT_IDS_FIELD) if isinstance(parsed, dict) else None
            if isinstance(prompt, list) and self._prompt is None:
                self._prompt = prompt
            if isinstance(tokens, list):
                self._output.extend(tokens)
            elif has_text:
                self._complete = False  # text without its ids: the stream cannot resume elsewhere
        self._pending.clear()

    @property
    def prompt(self) -> list[int] | None:
        self._parse()
        return self._prompt

    @property
    def output(self) -> list[int]:
        self._parse()
        return self._output

    @property
    def complete(self) -> bool:
        """Every chunk with text carried its token ids."""
        self._parse()
        return self._complete


def resumed_request(req: CompletionRequest, generated: int) -> CompletionRequest:
    """The request as the next worker takes it: ``max_tokens`` less what was generated."""
    raw = dict(req.raw)
    limit = raw.pop("max_completion_tokens", None) if req.kind == "chat" else None
    limit = limit if limit is not None else raw.get("max_tokens")
    if isinstance(limit, int):
        raw["max_tokens"] = limit - generated
    return replace(req, raw=raw, max_tokens=None if req.max_tokens is None else req.max_tokens - generated)


class MigratingStream:
    """The chunks of one generation, resumed on another worker when its worker dies."""

    def __init__(self, state: GatewayState, session: Session, req: CompletionRequest, admission: Admission,
                 response: WorkerResponse, admit: AdmitFn, drain: Drain, ops: OpsMetrics) -> None:
        self.state, self.session, self.req = state, session, req
        self.admission = admission
        self.admit, self.drain, self.ops = admit, drain, ops
        self.workers = [admission.handle.worker_id]
        self.migrations = 0
        self.ids = StreamIds()
        self.text_sent = 0  # characters of text passed on to the client
        self.finish: str | None = None
        self.carried = StepCounts()  # steps of the workers that died
        self.segment = StepCounts()  # steps of the current worker
        self._identity: tuple[Any, Any] | None = None  # the first chunk's id and created
        self._response = response
        self._chunks = iter_chunk_batches(response)
        self._held = True  # the current admission's in-flight count is ours to release
        self._shutdown = False

    @property
    def kind(self) -> RequestKind:
        return self.req.kind

    @property
    def workers_header(self) -> str:
        return ", ".join(self.workers)

    async def batches(self) -> AsyncGenerator[list[RawChunk], None]:
        """The chunks, a worker read at a time (what the relay writes to its client in one go)."""
        while True:
            try:
                async for batch in self._chunks:
                    for raw in batch:
                        self._observe(raw)
                    yield batch
                return
            except (WorkerLost, WorkerTimeout) as exc:
                if self._shutdown:
                    raise ShuttingDown() from None
                await self._lose_worker(exc)
                if self.finish is not None:
                    # Only the tail was lost (usage, [DONE]): the answer is complete.
                    yield [RawChunk(self._usage_chunk(), None)]
                    return
                await self._resume(exc)

    async def whole_answer(self) -> WholeAnswer | None:
        """The worker's whole answer when it sent one (a non-streaming request's, workers/server/coalesce.py),
        else None: the chunks then come from ``batches``. A worker lost while sending it had
        sent the client nothing: the request goes to another worker, whose answer may be either."""
        while self.admission.handle.speaks_specgate and is_whole_answer(self._response):  # only when asked
            try:
                return await read_whole_answer(self._response)
            except (WorkerLost, WorkerTimeout) as exc:
                if self._shutdown:
                    raise ShuttingDown() from None
                await self._lose_worker(exc)
                await self._resume(exc)
        return None

    def abort_for_shutdown(self) -> None:
        """The drain's deadline passed: end the worker stream; the client gets ``ShuttingDown``."""
        self._shutdown = True
        self._response.abort(ShuttingDown())

    async def aclose(self) -> None:
        await self._chunks.aclose()  # closes the worker stream; a worker aborts sequences whose reader left
        self._response.close()  # a whole answer's, unread (a no-op once read or released)
        self._release()

    # -- bookkeeping ------------------------------------------------------------------------------
    def _observe(self, raw: RawChunk) -> None:
        chunk = raw.chunk
        if self._identity is None:
            self._identity = (chunk.get("id"), chunk.get("created"))
        elif len(self.workers) > 1:
            # One stream, whoever wrote the chunk.
            raw.changed().update(id=self._identity[0], created=self._identity[1])
        text = chunk_text(self.kind, chunk)
        self.text_sent += len(text)
        self.ids.add(raw.ids, bool(text))
        if raw.report is not None:
            for step in raw.report.steps():
                self.segment.add(step.proposed, step.accepted, step.late_steps)
        for choice in chunk.get("choices") or []:
            self.finish = choice.get("finish_reason") or self.finish
        if self.migrations:
            self._mark(raw)

    def _mark(self, raw: RawChunk) -> None:
        """The chunks that end a migrated stream name its workers; its usage counts all of them."""
        chunk = raw.chunk
        finishing = any(c.get("finish_reason") for c in chunk.get("choices") or [])
        usage = chunk.get("usage")
        if finishing or usage:
            raw.changed()
            spec = chunk.setdefault(DIRECTIVE_FIELD, {})
            if isinstance(spec, dict):
                spec["workers"], spec["migrations"] = list(self.workers), self.migrations
        if isinstance(usage, dict):
            speculative = usage.get("speculative")
            if isinstance(speculative, dict):
                carried = self.carried
                proposed = int(speculative.get("proposed") or 0) + carried.proposed
                accepted = int(speculative.get("accepted") or 0) + carried.accepted
                speculative.update(proposed=proposed, accepted=accepted,
                                   acceptance_rate=round(accepted / proposed, 4) if proposed else None)
                if speculative.get("tested") is not None:
                    speculative["tested"] += carried.tested
                if speculative.get("speculative_steps") is not None:
                    speculative["speculative_steps"] += carried.speculative_steps
                if speculative.get("plain_steps") is not None:
                    speculative["plain_steps"] += carried.steps - carried.speculative_steps

    def _usage_chunk(self) -> dict[str, Any]:
        """The usage a dead worker did not send, for an answer it had finished."""
        prompt, output = len(self.ids.prompt or ()), len(self.ids.output)
        counts = self.carried
        ident, created = self._identity or (None, None)
        chunk: dict[str, Any] = {
            "id": ident, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": created, "model": self.req.model, "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
                      "speculative": speculative_usage(
                          counts.proposed, counts.accepted, self.admission.decision.mode, counts.speculative_steps,
                          counts.steps - counts.speculative_steps, counts.tested)}}
        return chunk

    def _release(self) -> None:
        if self._held:
            self._held = False
            self.admission.handle.draft_mix.remove(self.admission.decision)
            self.admission.handle.release(self.admission.lease)

    # -- migration --------------------------------------------------------------------------------
    async def _lose_worker(self, exc: ApiError) -> None:
        handle = self.admission.handle
        await self._chunks.aclose()
        self._release()
        self.admission.attempt.failed(exc)  # its span (when tracing) ends as a failed attempt
        self.state.fleet.report_failure(handle, exc.message)
        self.carried.proposed += self.segment.proposed
        self.carried.accepted += self.segment.accepted
        self.carried.steps += self.segment.steps
        self.carried.speculative_steps += self.segment.speculative_steps
        self.segment = StepCounts()

    def _give_up(self, reason: str, message: str) -> WorkerFailed:
        self.ops.migrations_abandoned.labels(reason=reason).inc()
        log.warning("session %s: %s", self.session.session_id, message)
        return WorkerFailed(message)

    async def _resume(self, exc: ApiError) -> None:
        failed = self.admission.handle.worker_id
        prompt_ids, output_ids = self.ids.prompt, self.ids.output
        started = prompt_ids is not None or bool(output_ids) or self.text_sent > 0
        point = None
        if started:
            if not (self.ids.complete and prompt_ids and self.admission.handle.speaks_specgate):
                raise self._give_up("no_token_ids", f"worker {failed} failed mid-stream ({exc.message}); its "
                                    "protocol carries no token ids, so the generation cannot resume elsewhere")
            if self.migrations >= self.state.config.server.max_migrations:
                raise self._give_up("limit", f"worker {failed} failed mid-stream ({exc.message}); gave up after "
                                    f"{self.migrations} migrations (server.max_migrations)")
            point = ResumePoint(tuple(prompt_ids), tuple(output_ids), self.text_sent)
        req = resumed_request(self.req, len(output_ids)) if point is not None else self.req
        wait_s = self.state.config.server.migration_wait_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        exclude = frozenset({failed})
        while True:
            if self.drain.expired:
                raise ShuttingDown()
            try:
                admission, response = await self.drain.guard(self.admit(self.state, self.session, req, exclude,
                                                                        point))
                break
            except NoWorker:
                if loop.time() >= deadline:
                    raise self._give_up("no_worker", f"worker {failed} failed mid-stream ({exc.message}) and no "
                                        f"worker could take the generation within {wait_s:g}s") from None
                await self.drain.sleep(RETRY_PAUSE_S)
                # A restarted worker is a new process: it may take the generation back.
                if self.state.fleet.workers[failed].status == "ready":
                    exclude = frozenset()
        self.admission, self._response = admission, response
        self._chunks = iter_chunk_batches(response)
        self._held = True
        self.workers.append(admission.handle.worker_id)
        if point is not None:
            self.migrations += 1
            self.ops.migrations.inc()
            log.warning("session %s: worker %s failed mid-stream (%s); resumed on %s after %d tokens",
                        self.session.session_id, failed, exc.message, admission.handle.worker_id,
                        len(self.ids.output))
        else:
            self.ops.retries.inc()
