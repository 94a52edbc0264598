"""``GET /openapi.json``: an OpenAPI 3.1 document of the gateway's public API.

The schemas come from the pydantic models in workers/api/schema.py, the very classes
``parse_request`` validates with, so the document cannot drift from what is enforced. The
one refinement is the deployment's model id: ``model`` is documented as the one name this
gateway serves (others get a 404), which is also what the relay enforces. The admin routes
are for operators and are left out.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from workers.api.schema import (
    ChatCompletionBody,
    ChatCompletionResponse,
    CompletionBody,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelList,
    Ready,
)

_MODELS: tuple[type[BaseModel], ...] = (CompletionBody, ChatCompletionBody, CompletionResponse,
                                        ChatCompletionResponse, ErrorResponse, ModelList, Health, Ready)
_REF = "#/components/schemas/{model}"
_ERROR_STATUSES = {
    "400": "invalid request; `param` names the field", "404": "unknown model", "408": "the body came too slowly",
    "413": "body too large", "429": "worker queue full (Retry-After)", "502": "a worker failed",
    "503": "no worker ready (Retry-After)", "504": "a worker went silent",
}


def _schemas() -> dict[str, Any]:
    _, top = models_json_schema([(m, "validation") for m in _MODELS], ref_template=_REF)
    return dict(top["$defs"])


_SCHEMAS = _schemas()  # built once: the models do not change at run time


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _errors(*statuses: str) -> dict[str, Any]:
    return {status: {"description": _ERROR_STATUSES[status],
                     "content": {"application/json": {"schema": _ref(ErrorResponse)}}} for status in statuses}


def _completion_operation(summary: str, body: type[BaseModel], response: type[BaseModel]) -> dict[str, Any]:
    headers = {name: {"description": description, "schema": {"type": "string"}} for name, description in (
        ("X-Session-ID", "the session key used"), ("X-Specgate-Worker", "the worker that served the request"),
        ("X-Specgate-Mode", "the decision, e.g. `speculative; k=6; reason=default`, "
                             "`speculative; tree=2x2+3; reason=default` or `speculative; method=ngram; k=8; "
                             "reason=default`"),
        ("X-Specgate-Route", "why that worker: `sticky`, `prefix` or `load`"))}
    return {
        "summary": summary,
        "parameters": [{"name": "X-Session-ID", "in": "header", "required": False,
                        "description": "the session key (if empty or absent: the `user` field, else a new one)",
                        "schema": {"type": "string", "maxLength": 256, "pattern": "^[\\x20-\\x7e]*$"}}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(body)}}},
        "responses": {
            "200": {"description": "the completion; a server-sent event stream of chunks ending in "
                                   "`data: [DONE]` when `stream` is true",
                    "headers": headers,
                    "content": {"application/json": {"schema": _ref(response)},
                                # Before OpenAPI 3.2 an event stream's schema describes each event.
                                "text/event-stream": {"schema": SSE_EVENT}}},
            **_errors("400", "404", "408", "413", "429", "502", "503", "504"),
        },
    }


# One server-sent event: its data a chunk's JSON, or `[DONE]` at the end.
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                              "id": {"type": "string"}, "retry": {"type": "integer"}}}


def openapi_document(model_name: str) -> dict[str, Any]:
    schemas = copy.deepcopy(_SCHEMAS)
    for body in (CompletionBody, ChatCompletionBody):
        schemas[body.__name__]["properties"]["model"]["enum"] = [model_name]

    def ok(model: type[BaseModel], description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "specgate", "version": "0.1.0",
                 "description": "OpenAI-compatible gateway with per-session speculative decoding. Parameters a "
                                "schema types to a single value are accepted at their OpenAI default only."},
        "paths": {
            "/v1/completions": {"post": _completion_operation("Text completion", CompletionBody,
                                                              CompletionResponse)},
            "/v1/chat/completions": {"post": _completion_operation("Chat completion", ChatCompletionBody,
                                                                   ChatCompletionResponse)},
            "/v1/models": {"get": {"summary": "The served model", "responses": {"200": ok(ModelList, "models")}}},
            "/health": {"get": {"summary": "The gateway is alive", "responses": {"200": ok(Health, "alive")}}},
            "/ready": {"get": {"summary": "At least one worker is ready",
                               "responses": {"200": ok(Ready, "ready"), **_errors("503")}}},
        },
        "components": {"schemas": schemas},
    }
