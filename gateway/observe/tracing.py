"""OpenTelemetry traces: one span per request, a child span per worker attempt, and the W3C
``traceparent`` passed on to the worker (a specgate worker, or a vLLM server) in the request.

Off by default. On with ``tracing.enabled`` (exporting over OTLP/HTTP to
``tracing.otlp_endpoint``) or with the standard variables: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``..._TRACES_ENDPOINT``) turns it on, ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``
keep it off, and the exporter reads the rest (headers, timeouts) itself. When off, the relay gets
a do-nothing trace and the SDK is never imported. Spans carry no prompt text unless
``tracing.record_prompts`` is on; request headers (the API key) are never recorded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.config.config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

    from policies import Decision

MAX_PROMPT_CHARS = 4096  # record_prompts: a span attribute, not an archive


def enabled_by(config: TracingConfig, environ: Mapping[str, str]) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or environ.get("OTEL_TRACES_EXPORTER") == "none":
        return False
    return config.enabled or bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                                  or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


@dataclass
class Tracing:
    """The gateway's tracer (None: tracing off) and the provider to flush at shutdown."""

    tracer: Tracer | None = None
    provider: TracerProvider | None = None
    record_prompts: bool = False

    @classmethod
    def create(cls, config: TracingConfig, exporter: SpanExporter | None = None,
               environ: Mapping[str, str] | None = None) -> Tracing:
        """``exporter``: where spans go (tests pass an in-memory one); default OTLP/HTTP."""
        if exporter is None and not enabled_by(config, os.environ if environ is None else environ):
            return cls()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            # The config's endpoint is a base URL like OTEL_EXPORTER_OTLP_ENDPOINT; without it the
            # exporter follows the OTEL_* variables (default http://localhost:4318/v1/traces).
            endpoint = config.otlp_endpoint.rstrip("/") + "/v1/traces" if config.otlp_endpoint else None
            processor: Any = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
        else:
            processor = SimpleSpanProcessor(exporter)
        # The gateway's own provider, not the global one: an embedding process keeps its own.
        provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
        provider.add_span_processor(processor)
        return cls(provider.get_tracer("specgate.gateway"), provider, config.record_prompts)

    def start(self, request: web.Request, kind: str) -> RequestTrace:
        if self.tracer is None:
            return RequestTrace(None, None, self.record_prompts)
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind

        # A client's own traceparent makes the gateway's span a child of the client's trace.
        span = self.tracer.start_span(f"specgate {kind}", context=extract(dict(request.headers)),
                                      kind=SpanKind.SERVER, attributes={"http.route": request.path})
        return RequestTrace(self.tracer, span, self.record_prompts)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()  # flushes what the batch processor still holds


TRACING_KEY = web.AppKey("tracing", Tracing)


class AttemptTrace:
    """One try on one worker: a child span, and the headers that carry it to the worker."""

    def __init__(self, span: Span | None) -> None:
        self.span = span
        self.ended = False  # a failed attempt ends its span at once; the relay's end() is then a no-op
        self.headers: dict[str, str] = {}
        if span is not None:
            from opentelemetry.propagate import inject
            from opentelemetry.trace import set_span_in_context

            inject(self.headers, context=set_span_in_context(span))

    def failed(self, error: BaseException) -> None:
        if self.span is not None and not self.ended:
            self.ended = True
            from opentelemetry.trace import Status, StatusCode

            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
            self.span.end()

    def end(self) -> None:
        if self.span is not None and not self.ended:
            self.ended = True
            self.span.end()


class RequestTrace:
    """The request's span; every method is a no-op when tracing is off."""

    def __init__(self, tracer: Tracer | None, span: Span | None, record_prompts: bool) -> None:
        self.tracer, self.span, self.record_prompts = tracer, span, record_prompts
        self.attempts = 0

    def attempt(self, worker_id: str, decision: Decision) -> AttemptTrace:
        self.attempts += 1
        if self.tracer is None or self.span is None:
            return AttemptTrace(None)
        from opentelemetry.trace import SpanKind, set_span_in_context

        span = self.tracer.start_span("specgate worker attempt", context=set_span_in_context(self.span),
                                      kind=SpanKind.CLIENT, attributes={
                                          "specgate.worker": worker_id, "specgate.attempt": self.attempts,
                                          **_decision_attributes(decision)})
        return AttemptTrace(span)

    def admitted(self, session_id: str, worker_id: str, decision: Decision, prompt: Any) -> None:
        if self.span is None:
            return
        self.span.set_attributes({"specgate.session": session_id, "specgate.worker": worker_id,
                                  "specgate.retries": self.attempts - 1, **_decision_attributes(decision)})
        if self.record_prompts and prompt is not None:
            self.span.set_attribute("specgate.prompt", str(prompt)[:MAX_PROMPT_CHARS])

    def streamed(self, ttft_s: float | None, tokens: int) -> None:
        if self.span is None:
            return
        if ttft_s is not None:
            self.span.set_attribute("specgate.ttft_s", ttft_s)
        self.span.set_attribute("specgate.tokens", tokens)

    def finish(self, error: BaseException | None = None) -> None:
        if self.span is None:
            return
        self.span.set_attribute("specgate.attempts", self.attempts)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        self.span.end()


def _decision_attributes(decision: Decision) -> dict[str, str | int]:
    return {"specgate.decision.mode": decision.mode, "specgate.decision.k": decision.k,
            "specgate.decision.reason": decision.reason}
