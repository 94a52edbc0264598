"""The worker-stream client: one OpenAI request's body in a worker's protocol, the POST that
opens its stream, and the stream read into chunks (or a whole answer), with the errors of the
way there (the relay's and the migration's; ``worker_http.py`` below it is the HTTP client).

The gateway always asks the worker for a stream (with usage), whatever the client asked
for: each chunk's ``specgate`` step report feeds the session's acceptance estimate and the
metrics as it arrives, and a non-streaming client gets the chunks folded into one response.
A worker that cannot be reached before the first chunk is reported down and the request is
retried on another worker; after the first chunk the stream ends with an error event, so
nothing is lost silently.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.config.config import RemoteProtocol
from gateway.fleet.handle import WorkerHandle
from gateway.fleet.worker_http import WorkerConnectError, WorkerResponse, WorkerStreamError
from gateway.llamacpp import SlotLease, llamacpp_body
from workers.api.errors import (
    ApiError,
    BadRequest,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    Unavailable,
    WorkerFailed,
    WorkerTimeout,
)
from workers.api.web_common import sse_event
from workers.api.wire import (
    ANSWER_BYTES_HEADER,
    CACHE_SALT_FIELD,
    DIRECTIVE_FIELD,
    IDS_COMMENT,
    VLLM_XARGS_FIELD,
    WHOLE_ANSWER_TYPE,
    CompletionRequest,
    Directive,
    StepReport,
    vllm_xargs,
)

_STATUS_ERRORS: dict[int, type[ApiError]] = {400: BadRequest, 404: NotFound, 413: PayloadTooLarge, 429: Overloaded,
                                             503: Unavailable, 504: WorkerTimeout}


class WorkerUnreachable(Exception):
    """The worker could not be reached or broke before the first chunk: safe to retry elsewhere."""


class WorkerLost(WorkerFailed):
    """The worker's stream broke or ended early (it died, or its connection did): the generation
    can resume on another worker (gateway/relay/migration.py). An error event the worker sent is not this."""


def scope_key(request: CompletionRequest) -> str:
    """The request's cache scope as its digest (gateway/tenancy.py): "" for the default scope."""
    salt = request.raw.get(CACHE_SALT_FIELD)
    return salt if isinstance(salt, str) else ""


def worker_body(request: CompletionRequest, directive: Directive, protocol: RemoteProtocol,
                streamed: bool = True, lease: SlotLease | None = None) -> dict[str, Any]:
    """The request as the worker takes it: plus the decision in the worker's own terms (a
    specgate directive, vLLM plugin arguments, or nothing for a server of one fixed mode). The
    relay's are always streamed with usage; the endpoint picker's (``streamed`` False) keep the
    client's own ``stream``, since Envoy hands the worker's answer to the client as it is.

    The cache scope (``cache_salt``, the scope's digest: gateway/tenancy.py) goes to servers
    known to honour it: specgate workers and vLLM. A plain OpenAI-compatible server may refuse
    the field or ignore it, so it gets none, and its own cache is not scoped (docs/api.md). A
    llama-server gets none either: ``lease`` (``PromptScopes.lease``) says in which slot it runs
    and whether it may start from its cached prompts (gateway/llamacpp.py)."""
    body = dict(request.raw)
    if protocol in ("openai", "llamacpp"):
        body.pop(CACHE_SALT_FIELD, None)
    if protocol == "llamacpp":
        llamacpp_body(body, streamed, lease or SlotLease(None, False))
    if streamed:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if protocol == "specgate":
        body[DIRECTIVE_FIELD] = directive.to_json()
    elif protocol == "vllm":
        body[VLLM_XARGS_FIELD] = vllm_xargs(directive)
    return body


async def open_stream(handle: WorkerHandle, path: str, body: Mapping[str, Any],
                      worker_timeout_s: float, headers: Mapping[str, str] | None = None) -> WorkerResponse:
    """POSTs to the worker; returns the streaming response or raises the worker's error.

    The worker starts its response with the first chunk (a non-streaming client's: with the
    first span, workers/server/coalesce.py), so the read timeout bounds the time to first token as
    well as every later silence.
    """
    try:
        data = orjson.dumps(body)
    except orjson.JSONEncodeError:
        # A lone surrogate ("user": "x\ud800y" is valid JSON) is not UTF-8: json's ASCII escapes
        # carry it to the worker as the client sent it.
        data = json.dumps(body).encode()
    try:
        response = await handle.http.post(path, data, headers,  # trace context, request id, session
                                          connect_timeout=5, read_timeout=worker_timeout_s)
    except TimeoutError as exc:
        raise WorkerTimeout(f"worker {handle.worker_id} sent nothing for {worker_timeout_s}s") from exc
    except (WorkerConnectError, WorkerStreamError) as exc:
        raise WorkerUnreachable(f"{exc.__class__.__name__}: {exc}") from exc
    if response.status == 200:
        return response
    try:
        payload = orjson.loads(await response.read())
        error = payload["error"]
        message, param, code = str(error.get("message")), error.get("param"), error.get("code")
    except (ValueError, KeyError, TypeError, AttributeError, TimeoutError, WorkerStreamError):
        message, param, code = f"worker answered HTTP {response.status}", None, None
    finally:
        response.release()
    retry_after = response.headers.get("retry-after")
    cls = _STATUS_ERRORS.get(response.status, WorkerFailed)
    raise cls(message, param=param, code=code,
              retry_after_s=float(retry_after) if retry_after and retry_after.isdigit() else None)


@dataclass(slots=True)
class RawChunk:
    """One parsed worker chunk, with what the relay needs beside it."""

    chunk: dict[str, Any]
    # The chunk's JSON as the worker sent it, relayed verbatim; None once the gateway changed
    # the chunk (then it is serialized again).
    payload: bytes | None
    # The event's ids comment (workers/api/wire.py), its JSON unparsed: only a stream that
    # migrates needs the ids (gateway/relay/migration.py StreamIds).
    ids: bytes | None = None
    report: StepReport | None = None  # the chunk's ``specgate`` step report, parsed once

    def changed(self) -> dict[str, Any]:
        """The chunk, for a change: its worker's bytes no longer say what it is."""
        self.payload = None
        return self.chunk

    def sse(self) -> bytes:
        return sse_event(self.chunk) if self.payload is None else b"data: %b\n\n" % self.payload


@dataclass(frozen=True, slots=True)
class WholeAnswer:
    """A worker's whole answer (``Directive.whole_answer``, workers/server/coalesce.py)."""

    answer: bytes  # the OpenAI answer's JSON, relayed as the worker wrote it
    report: StepReport | None  # every step behind it (``then``) and how long the first waited
    at: float  # when it was read (``time.monotonic``)


def is_whole_answer(response: WorkerResponse) -> bool:
    return response.headers.get("content-type", "").startswith(WHOLE_ANSWER_TYPE)


async def read_whole_answer(response: WorkerResponse) -> WholeAnswer:
    """Reads a whole answer. Raises WorkerLost when its body breaks off (nothing of it reached
    the client: the request may go to another worker), WorkerFailed when it is no answer."""
    try:
        body = await response.read()
    except TimeoutError as exc:
        response.close()
        raise WorkerTimeout("worker went silent mid-answer") from exc
    except WorkerStreamError as exc:
        response.close()
        raise WorkerLost(f"worker answer broke: {exc}") from exc
    except BaseException:  # cancelled, or aborted by the drain: the connection cannot be reused
        response.close()
        raise
    at = time.monotonic()
    response.release()
    split = response.headers.get(ANSWER_BYTES_HEADER.lower(), "")
    answer = body[:int(split)] if split.isdigit() else b""
    try:
        # Checked, not rebuilt: the client gets a JSON object or the gateway's error.
        if not isinstance(orjson.loads(answer), dict):
            raise ValueError("not an object")
        report = StepReport.from_json(orjson.loads(body[len(answer):]))
    except ValueError:  # orjson.JSONDecodeError too
        raise WorkerFailed("worker sent a whole answer that is not one") from None
    return WholeAnswer(answer, report, at)


def _stream_error(chunk: Any) -> WorkerFailed:
    """What a worker's error event, or an event that is no JSON object, fails the request with."""
    if not isinstance(chunk, dict):
        return WorkerFailed("worker sent an event whose data is not a JSON object")
    error = chunk["error"]
    return WorkerFailed(str(error.get("message", "worker error")) if isinstance(error, dict) else str(error))


async def iter_chunk_batches(response: WorkerResponse) -> AsyncGenerator[list[RawChunk], None]:
    """The worker's SSE stream a network read at a time: every complete event that one read
    delivered. Raises WorkerFailed on an error event, WorkerLost on a cut stream.

    The relay's hot loop: it writes a batch to the client in one write (a socket write per
    chunk was the gateway's largest cost, bench.overhead) and forwards unchanged chunks'
    bytes instead of re-serializing them. orjson parses several times faster than json.
    """
    buffer = b""
    done = False
    ids: bytes | None = None  # a comment event's ids, for the data event that follows it
    try:
        while not done:
            try:
                data = await response.readany()
            except TimeoutError as exc:
                raise WorkerTimeout("worker went silent mid-stream") from exc
            if not data:
                break
            # Every complete event of the read at once; the last piece is the start of the next.
            *events, buffer = (buffer + data).split(b"\n\n")
            batch: list[RawChunk] = []
            for event in events:
                if done:
                    break
                for line in event.split(b"\n"):
                    if line.startswith(IDS_COMMENT):
                        ids = line[len(IDS_COMMENT):]
                        continue
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    try:
                        chunk = orjson.loads(payload)
                    except orjson.JSONDecodeError:
                        chunk = None
                    if not isinstance(chunk, dict) or "error" in chunk:
                        if batch:  # what came before the error still reaches the client
                            yield batch
                        raise _stream_error(chunk)
                    batch.append(RawChunk(chunk, payload, ids, StepReport.from_json(chunk.get(DIRECTIVE_FIELD))))
                    ids = None
            if batch:
                yield batch
        if done:
            # Read to the end of the response (the chunked terminator follows [DONE]) so that
            # release() returns the connection to the pool: released half-read, it is closed,
            # and a new connection per request cost as much CPU as relaying it (bench.overhead).
            while await response.readany():
                pass
    except WorkerStreamError as exc:
        raise WorkerLost(f"worker stream broke: {exc}") from exc
    finally:
        # Closing an unfinished stream drops the connection, which makes the worker abort it.
        if done:
            response.release()
        else:
            response.close()
    if not done:
        raise WorkerLost("worker stream ended without [DONE]")
