"""Log output: ``text`` (one human line) or ``json`` (one object per line, for log shippers).

A JSON line carries timestamp, level, logger and message, plus the request id, session and
decision of the request being served when there is one. Those come from context variables the
relay sets, so every log call made while serving a request is tagged without passing them
around. Request bodies and headers are never logged, so neither prompts nor API keys reach a
log line through this module.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from typing import Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("specgate_request_id", default=None)
session_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("specgate_session", default=None)
decision_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("specgate_decision", default=None)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key, var in (("request_id", request_id_var), ("session", session_var), ("decision", decision_var)):
            value = var.get()
            if value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(log_format: LogFormat, level: str = "INFO", prefix: str = "gateway") -> None:
    """Installs the root handler (stderr) in the chosen format, replacing any earlier one."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
