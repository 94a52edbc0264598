"""A worker server's settings and per-app state (``CONTEXT_KEY``), apart from the handlers so
the handler modules (``app``, ``tokenize``) share them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from workers.api.logs import RequestLog
from workers.engines.interface import Engine
from workers.server.metrics import WorkerMetrics
from workers.text import TextCodec


@dataclass(frozen=True)
class WorkerSettings:
    worker_id: str
    tokenizer_dir: Path  # the target model's directory: tokenizer.json and tokenizer_config.json
    served_model_name: str
    default_k: int = 6  # K for requests without a gateway directive
    max_queue: int = 64  # waiting sequences before 429
    max_body_bytes: int = 1 << 20
    # The gateway's shared token (SPECGATE_WORKER_TOKEN): with one, every route but /health
    # wants it as a bearer token. A worker on a private Unix socket needs none.
    token: str | None = None


@dataclass
class WorkerContext:
    settings: WorkerSettings
    engine: Engine
    codec: TextCodec
    metrics: WorkerMetrics
    registry: CollectorRegistry | None
    request_log: RequestLog  # the one line per request, written in batches (workers/api/logs.py)


CONTEXT_KEY = web.AppKey("worker_context", WorkerContext)
