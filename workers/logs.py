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
error) are the one exception; the gateway wraps those of its workers (gateway/worker_output.py).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
# A record carrying this attribute is a line another process already wrote as one JSON object
# (a worker's, relayed by the gateway): the JSON formatter passes it on unchanged.
JSON_LINE_ATTR = "specgate_json_line"
# Record attributes the JSON formatter copies into the line: the gateway sets them on the
# worker output it wraps (gateway/worker_output.py).
WORKER_ATTR, STREAM_ATTR = "worker", "stream"

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("specgate_request_id", default=None)
session_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("specgate_session", default=None)
decision_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("specgate_decision", default=None)


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
        for key, var in (("request_id", request_id_var), ("session", session_var), ("decision", decision_var)):
            value = var.get()
            if value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``<time> <name> <level> <logger>: <message>``, the line ``logging.Formatter`` writes for
    ``%(asctime)s <name> %(levelname)s %(name)s: %(message)s``, with the time's text made once
    a second: the gateway writes one line per request, and the generic formatter's strftime
    and ``%``-formatting of the whole record were most of that line's cost."""

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
