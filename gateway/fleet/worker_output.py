"""A local worker's stdout and stderr, relayed into the gateway's log when logs are JSON.

A worker started with ``--log-format json`` writes its log as JSON lines itself
(workers/api/logs.py). But a process also writes lines that no logger formats: a C extension's
warning, an engine's own console output (vLLM logs to stdout in its own format), the
interpreter's last words when it dies. Inherited as they are, those would break "one JSON
object per line". So in JSON mode the gateway reads both streams through pipes: a line that
is a JSON object is passed on unchanged, at its own level; any other line is wrapped in one
(logger ``workers.output``, with the worker id and the stream's name), so nothing is lost and
the combined log still parses line by line. A wrapped stderr line is a WARNING (what reaches
stderr unformatted is mostly warnings and tracebacks), a wrapped stdout line INFO.

The relay outlives the worker: what it wrote before dying is read to the end of the pipe.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Literal

from workers.api.logs import JSON_LINE_ATTR, STREAM_ATTR, WORKER_ATTR

log = logging.getLogger("workers.output")
MAX_LINE_BYTES = 1 << 20  # the pipe reader's limit: a longer line is cut, not the stream
StreamName = Literal["stdout", "stderr"]


async def relay_output(worker_id: str, stream_name: StreamName, reader: asyncio.StreamReader) -> None:
    """Logs every line of ``reader`` until the worker (and any child holding the pipe) closes it."""
    while True:
        try:
            line = await reader.readline()
        except ValueError:  # over MAX_LINE_BYTES: asyncio drops what it buffered and goes on
            log.warning("(a line over %d bytes, cut)", MAX_LINE_BYTES,
                        extra={WORKER_ATTR: worker_id, STREAM_ATTR: stream_name})
            continue
        if not line:
            return
        relay_line(worker_id, stream_name, line)


def relay_line(worker_id: str, stream_name: StreamName, line: bytes) -> None:
    text = line.decode(errors="replace").rstrip("\r\n")
    if not text.strip():
        return
    try:
        entry = json.loads(text)
    except ValueError:
        entry = None
    if isinstance(entry, dict):
        level = logging.getLevelName(str(entry.get("level", "INFO")))
        # The gateway's level applies to its workers' lines too; the line itself goes out as written.
        log.log(level if isinstance(level, int) else logging.INFO, "%s", text, extra={JSON_LINE_ATTR: text})
    else:
        log.log(logging.WARNING if stream_name == "stderr" else logging.INFO, "%s", text,
                extra={WORKER_ATTR: worker_id, STREAM_ATTR: stream_name})
