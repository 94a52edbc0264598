"""Log output for the gateway and its workers: ``text`` (one human line) or ``json`` (one object
per line, for log shippers). Standard library only: a worker imports it before torch, and
``specgate check`` never does.

A JSON line carries timestamp, level, logger and message; a worker's lines also carry the
``worker`` id; a line logged while serving a request carries its ``request_id``, ``session``
and ``decision``. Those come from context variables the gateway's relay and the worker's
server set per request, so every log call made while serving it is tagged without passing
them around. Request bodies and headers are never logged, so neither prompts nor API keys
reach a log line through this module.

With ``json`` every line Python itself writes to stderr is JSON too: warnings go through the
``py.warnings`` logger, and an uncaught exception is logged (``py.exceptions``) rather than
printed. Lines that no Python code formats (a C extension's own warning, a fatal interpreter
error) are the one exception; the gateway wraps those of its workers (gateway/fleet/worker_output.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
# A record carrying this attribute is a line another process already wrote as one JSON object
# (a worker's, relayed by the gateway): the JSON formatter passes it on unchanged.
JSON_LINE_ATTR = "specgate_json_line"
# Record attributes the JSON formatter copies into the line: the gateway sets them on the
# worker output it wraps (gateway/fleet/worker_output.py).
WORKER_ATTR, STREAM_ATTR = "worker", "stream"

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("specgate_request_id", default=None)
session_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("specgate_session", default=None)
decision_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("specgate_decision", default=None)


_CONTEXT = (("request_id", request_id_var), ("session", session_var), ("decision", decision_var))


class RequestLog:
    """A server's one INFO line per request, handed to logging a batch at a time.

    Made and written while the request was served, that line cost the gateway about 45 µs of
    a sequential request's latency (bench.stacks against a checkout without the line: 43–55 µs
    less added p50; with the line formatted but not written, 13–17 µs less), most of it
    logging's own code running with caches cold after the other processes' turns. Here the
    request keeps a tuple (its time, message, arguments and context: about 1 µs), and ``run``
    turns the batch into records every ``flush_s``, as nginx's buffered access log does
    (``access_log ... flush=``). Each line keeps the time it was logged at and its request's
    id, session and decision; it reaches the log at most ``flush_s`` later, so it may follow
    lines logged after it. Warnings and errors do not go through here: they are written at once.
    """

    MAX_PENDING = 10_000  # beyond this (nothing flushing?) the batch goes out in the request

    def __init__(self, logger: logging.Logger, flush_s: float = 0.05) -> None:
        self.logger = logger
        self.flush_s = flush_s
        self._pending: list[tuple[float, str, tuple[object, ...], str | None, str | None, str | None]] = []

    def info(self, msg: str, *args: object) -> None:
        if not self.logger.isEnabledFor(logging.INFO):
            return
        # The context in _CONTEXT's order, read directly: this runs in every request.
        self._pending.append((time.time(), msg, args, request_id_var.get(), session_var.get(), decision_var.get()))
        if len(self._pending) >= self.MAX_PENDING:
            self.flush()

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for created, msg, args, *context in pending:
            record = self.logger.makeRecord(self.logger.name, logging.INFO, "", 0, msg, args, None)
            # As LogRecord sets them for its own time (Python 3.11).
            record.relativeCreated -= (record.created - created) * 1000
            record.created = created
            record.msecs = int((created - int(created)) * 1000) + 0.0
            for (key, _), value in zip(_CONTEXT, context, strict=True):
                setattr(record, key, value)
            self.logger.handle(record)

    async def run(self) -> None:
        """Flushes every ``flush_s`` until cancelled, then once more."""
        try:
            while True:
                await asyncio.sleep(self.flush_s)
                if self._pending:
                    self.flush()
        finally:
            self.flush()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """``run`` as a task while the body runs (a server's cleanup context); the rest is written as it ends."""
        task = asyncio.create_task(self.run(), name="request-log")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``fields`` are added to every line (a worker's id)."""

    def __init__(self, fields: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        relayed = getattr(record, JSON_LINE_ATTR, None)
        if isinstance(relayed, str):
            return relayed
        entry: dict[str, object] = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage(), **self.fields}
        for attr in (WORKER_ATTR, STREAM_ATTR):
            value = getattr(record, attr, None)
            if isinstance(value, str):
                entry[attr] = value
        for key, var in _CONTEXT:
            # A line logged later than it was made (RequestLog) carries its request's context.
            value = record.__dict__[key] if key in record.__dict__ else var.get()
            if value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``<time> <name> <level> <logger>: <message>``, the line ``logging.Formatter`` writes for
    ``%(asctime)s <name> %(levelname)s %(name)s: %(message)s``, with the time's text made once
    a second instead of a strftime per line (the gateway and its workers write a line per
    request); tests/unit/test_hot_path_parsing.py holds it to the generic formatter's output."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._second, self._stamp = second, self.formatTime(record)[:-4]  # without ",mmm"
        line = (f"{self._stamp},{int(record.msecs):03d} {self.name} {record.levelname} {record.name}: "
                f"{record.getMessage()}")
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line += "\n" + record.exc_text
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


def configure(log_format: LogFormat, level: str = "INFO", name: str = "gateway",
              fields: Mapping[str, str] | None = None) -> None:
    """Installs the root handler (stderr) in the chosen format, replacing any earlier one.

    ``name`` leads each text line (``gateway``, or a worker's id); ``fields`` go into each JSON
    line. Called again (the gateway does, once its config is read), it switches formats.
    """
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(fields))
    else:
        handler.setFormatter(TextFormatter(name))
    # No format here prints a record's source line, thread or process, and gathering them was
    # a third of the cost of the gateway's per-request log line (bench.overhead, py-spy).
    logging._srcfile = None  # the documented switch (logging HOWTO, "Optimization"): no findCaller
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    json_only = log_format == "json"
    logging.captureWarnings(json_only)
    sys.excepthook = _log_uncaught if json_only else sys.__excepthook__
    threading.excepthook = _log_uncaught_in_thread if json_only else threading.__excepthook__


def _log_uncaught(kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
    logging.getLogger("py.exceptions").critical("uncaught %s: %s", kind.__name__, error,
                                                exc_info=(kind, error, traceback))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    error = args.exc_value
    if error is None or isinstance(error, SystemExit):  # as the default hook: a thread's exit is no error
        return
    name = args.thread.name if args.thread is not None else "a thread"
    logging.getLogger("py.exceptions").critical("uncaught %s in %s: %s", args.exc_type.__name__, name, error,
                                                exc_info=(args.exc_type, error, args.exc_traceback))
