"""aiohttp pieces the gateway and the workers share: OpenAI error responses and SSE. No torch."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from workers.protocol import ApiError, BadRequest, MethodNotAllowed, NotFound, PayloadTooLarge

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(error: ApiError) -> web.Response:
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return web.json_response(error.body(), status=error.status, headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI error object with the right status; never a traceback."""
    try:
        return await handler(request)
    except ApiError as error:
        return error_response(error)
    except web.HTTPRequestEntityTooLarge:
        return error_response(PayloadTooLarge(f"request body exceeds {request.client_max_size} bytes"))
    except web.HTTPNotFound:
        return error_response(NotFound(f"no route for {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed:
        return error_response(MethodNotAllowed(f"method {request.method} not allowed on {request.path}"))
    except web.HTTPException:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ApiError("internal error; see the server log"))


async def read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds {request.client_max_size} bytes") from None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


def sse_event(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def start_sse(request: web.Request, headers: Mapping[str, str] | None = None) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **(headers or {})})
    await response.prepare(request)
    return response


def model_list(name: str) -> web.Response:
    """``GET /v1/models`` for a server that serves one model."""
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "specgate"}]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})
