"""Sending a non-streaming client's chunks to the gateway a few at a time.

The gateway asks its workers for a stream whatever the client asked for: the step reports
feed the session's acceptance as they come, and a generation whose worker dies resumes from
the token ids received (gateway/relay/migration.py). A client that asked for one JSON answer sees
none of the per-step events, yet the gateway read, parsed and accounted each one, and the
worker wrote each one: for a 64-token answer half the gateway's CPU (bench.overhead, c32_64).

With ``Directive.coalesce_s`` the worker holds the chunks and sends them as one chunk when
``coalesce_s`` has passed since the request arrived or since the last send, and at the end
together with the usage chunk and ``[DONE]``: an answer made within the first span is one
response body with its length (one write; the gateway reads it in one piece and wakes once,
where a stream cost it a wake-up for the head, one per span and one for the end). The merged
chunk's step report lists every step behind it in order (``StepReport.then``), says how long its
first step waited here (``held_s``: the gateway's time to first token counts from when the token
was made) and its ids comment carries all their token ids, so the gateway's accounting and a
resume see each step as before; only the arrival times within a held span are lost (the gateway
spreads them evenly, as it does for a speculative step's tokens). A chunk is held at most
``coalesce_s`` or one engine step, whichever is longer, since the check runs when a step's chunk
arrives. The status is still decided by the first chunk (an early failure keeps its own).

With ``Directive.whole_answer`` as well, an answer made within the first span goes as the
answer itself (``WHOLE_ANSWER_TYPE``): the OpenAI JSON the client gets, then the merged step
report's JSON, split at ``ANSWER_BYTES_HEADER``. The gateway relays the answer's bytes and
accounts the report, where it had parsed two events and built the answer again (its share of
a short request's latency, bench.overhead). A failed generation, or one that outlasts the
span, is the stream above; so is an answer whose usage has no step counts or that has no
report (the gateway restates or leaves such answers, which needs their chunks).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import orjson
from aiohttp import web

from workers.api.answers import assemble, chunk_text
from workers.api.errors import ApiError
from workers.api.web_common import SSE_HEADERS, sse_event, start_sse
from workers.api.wire import (
    ANSWER_BYTES_HEADER,
    DIRECTIVE_FIELD,
    HELD_FIELD,
    WHOLE_ANSWER_TYPE,
    RequestKind,
    StepReport,
)

# A chunk and the step report behind it (None for the usage chunk).
Chunk = tuple[dict[str, Any], StepReport | None]


def chunk_event(chunk: Chunk) -> bytes:
    """The chunk's SSE event, its token ids in a comment line before the data."""
    payload, report = chunk
    return sse_event(payload, report.ids_comment() if report is not None else b"")


def merge_chunks(kind: RequestKind, chunks: Sequence[Chunk], held_s: float = 0.0) -> Chunk:
    """Consecutive step chunks of one generation as one: their text joined, the last finish
    reason, the first step's report with the later steps in ``then``, every token id, and
    ``held_s``, how long the first step waited before it was sent (in the report and its JSON).

    Built from the parts' own report JSON (no step report is copied or serialized again: a
    64-token answer merges 63 steps).
    """
    if len(chunks) == 1 and not held_s:
        return chunks[0]
    first, head = chunks[0]
    texts: list[str] = []
    finish = None
    ids: list[int] | None = []
    for payload, report in chunks:
        texts.append(chunk_text(kind, payload))
        finish = payload["choices"][0].get("finish_reason") or finish
        if ids is not None:
            if report is None or report.token_ids is None:
                ids = None  # a step without ids: the chunk claims none (a resume then cannot use it)
            else:
                ids.extend(report.token_ids)
    choice = dict(first["choices"][0], finish_reason=finish)
    if kind == "chat":
        choice["delta"] = dict(choice.get("delta") or {}, content="".join(texts))
    else:
        choice["text"] = "".join(texts)
    merged = dict(first, choices=[choice])
    if head is None:
        return merged, None
    directive = merged[DIRECTIVE_FIELD] = dict(first[DIRECTIVE_FIELD])
    if len(chunks) > 1:
        directive["then"] = [payload[DIRECTIVE_FIELD] for payload, _ in chunks[1:]]
    if held_s:
        directive[HELD_FIELD] = held_s
    later = tuple(report for _, report in chunks[1:] if report is not None)
    return merged, replace(head, token_ids=None if ids is None else tuple(ids), then=later, held_s=held_s)


def whole_answer(kind: RequestKind, merged: Chunk, usage: dict[str, Any] | None) -> web.Response | None:
    """The answer ``merged`` and ``usage`` make as one ``WHOLE_ANSWER_TYPE`` body, or None when
    it cannot be one (see above)."""
    payload, report = merged
    if report is None or usage is None or "speculative" not in (usage.get("usage") or {}):
        return None
    answer = orjson.dumps(assemble(kind, [payload, usage]))
    return web.Response(body=answer + orjson.dumps(payload[DIRECTIVE_FIELD]), content_type=WHOLE_ANSWER_TYPE,
                        headers={ANSWER_BYTES_HEADER: str(len(answer))})


async def write_coalesced(request: web.Request, kind: RequestKind, chunks: AsyncIterator[Chunk],
                          coalesce_s: float, include_usage: bool, arrived: float,
                          whole: bool = False) -> web.StreamResponse:
    """Answers with ``chunks`` (the first already due) as described above, then ``[DONE]``; an
    error from the engine goes out after what was held, as the stream's last event.
    ``arrived``: when the request came (``time.monotonic``), where the first span starts;
    ``whole``: the gateway takes a whole answer."""
    held: list[Chunk] = []
    held_since = 0.0  # when the oldest held chunk arrived
    tail: list[bytes] = []
    usage: dict[str, Any] | None = None
    response: web.StreamResponse | None = None  # started at the first send before the end
    # The first span counts from the request's arrival: a first token that took longer (a long
    # prompt) goes at once, so holding never adds to a slow time to first token, nor brings the
    # gateway's read timeout closer than a later span does.
    last_sent = arrived

    def merged() -> Chunk:
        # How long the span's first step waited here: the gateway's time to first token.
        chunk = merge_chunks(kind, held, round(time.monotonic() - held_since, 6))
        held.clear()
        return chunk

    def events() -> list[bytes]:
        return [chunk_event(merged())] if held else []

    async def finish(extra: Sequence[bytes], failed: bool = False) -> web.StreamResponse:
        last = [merged()] if held else []
        if response is None and whole and last and not failed:
            answer = whole_answer(kind, last[0], usage)
            if answer is not None:
                return answer
        body = b"".join([*map(chunk_event, last), *extra])
        if response is None:  # it all came within the first span: one body, one write
            return web.Response(body=body, headers=SSE_HEADERS)
        await response.write_eof(body)  # the last events and the stream's end in one write
        return response

    try:
        async for chunk in chunks:
            if chunk[0].get("usage") is not None:  # the last chunk: it goes out with the held steps
                usage = chunk[0]
                if include_usage:
                    tail.append(chunk_event(chunk))
                continue
            if not held:
                held_since = time.monotonic()
            held.append(chunk)
            if time.monotonic() - last_sent >= coalesce_s:
                if response is None:
                    response = await start_sse(request)
                await response.write(b"".join(events()))
                last_sent = time.monotonic()
    except ApiError as error:  # too late for a status code: the stream carries the error
        return await finish([*tail, sse_event(error.body())], failed=True)
    return await finish([*tail, sse_event("[DONE]")])
