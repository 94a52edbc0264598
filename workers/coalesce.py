"""Sending a non-streaming client's chunks to the gateway a few at a time.

The gateway asks its workers for a stream whatever the client asked for: the step reports
feed the session's acceptance as they come, and a generation whose worker dies resumes from
the token ids received (gateway/migration.py). A client that asked for one JSON answer sees
none of the per-step events, yet the gateway read, parsed and accounted each one, and the
worker wrote each one: for a 64-token answer half the gateway's CPU (bench.overhead, c32_64).

With ``Directive.coalesce_s`` the worker sends the first chunk at once (it starts the
response, so the gateway's time to first token and its read timeout keep their meaning), then
holds the chunks that follow and sends them as one chunk when ``coalesce_s`` has passed since
the last send, and at the end together with the usage chunk and ``[DONE]``. The merged chunk's
step report lists every step behind it in order (``StepReport.then``) and its ids comment all
their token ids, so the gateway's accounting and a resume see each step as before; only the
arrival times within a held span are lost (the gateway spreads them evenly, as it does for a
speculative step's tokens). A chunk is held at most ``coalesce_s`` or one engine step, whichever
is longer, since the check runs when a step's chunk arrives.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from aiohttp import web

from workers.protocol import DIRECTIVE_FIELD, ApiError, RequestKind, StepReport, chunk_text
from workers.web_common import sse_event

# A chunk and the step report behind it (None for the usage chunk).
Chunk = tuple[dict[str, Any], StepReport | None]


def chunk_event(chunk: Chunk) -> bytes:
    """The chunk's SSE event, its token ids in a comment line before the data."""
    payload, report = chunk
    return sse_event(payload, report.ids_comment() if report is not None else b"")


def merge_chunks(kind: RequestKind, chunks: Sequence[Chunk]) -> Chunk:
    """Consecutive step chunks of one generation as one: their text joined, the last finish
    reason, the first step's report with the later steps in ``then`` and every token id.

    Built from the parts' own report JSON (no step report is copied or serialized again: a
    64-token answer merges 63 steps).
    """
    if len(chunks) == 1:
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
    merged[DIRECTIVE_FIELD] = {**first[DIRECTIVE_FIELD],
                               "then": [payload[DIRECTIVE_FIELD] for payload, _ in chunks[1:]]}
    later = tuple(report for _, report in chunks[1:] if report is not None)
    return merged, replace(head, token_ids=None if ids is None else tuple(ids), then=later)


async def write_coalesced(response: web.StreamResponse, kind: RequestKind, chunks: AsyncIterator[Chunk],
                          coalesce_s: float, include_usage: bool) -> None:
    """Writes ``chunks`` (the first already due) as described above, then ``[DONE]``; an
    error from the engine goes out after what was held, as the stream's last event."""
    held: list[Chunk] = []
    tail: list[bytes] = []
    last_sent = float("-inf")  # the first chunk goes at once

    async def send(extra: Sequence[bytes] = ()) -> None:
        nonlocal last_sent
        events = [chunk_event(merge_chunks(kind, held))] if held else []
        held.clear()
        if events or extra:
            await response.write(b"".join([*events, *extra]))
        last_sent = time.monotonic()

    try:
        async for chunk in chunks:
            if chunk[0].get("usage") is not None:  # the last chunk: it goes out with the held steps
                if include_usage:
                    tail.append(chunk_event(chunk))
                continue
            held.append(chunk)
            if time.monotonic() - last_sent >= coalesce_s:
                await send()
    except ApiError as error:  # too late for a status code: the stream carries the error
        await send([*tail, sse_event(error.body())])
        return
    await send([*tail, sse_event("[DONE]")])
