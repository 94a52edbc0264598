"""aiohttp pieces the gateway and the workers share: OpenAI error responses, bounded request
bodies, client disconnects, and SSE. No torch."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from policies import bounded_text
from workers.api.errors import (
    ApiError,
    BadRequest,
    ClientDisconnected,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
)
from workers.api.limits import DEFAULT_BODY_TIMEOUT_S, InputRefused, loads_json

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Seconds a request body may take to arrive (server.body_timeout_s); DEFAULT_BODY_TIMEOUT_S if unset.
BODY_TIMEOUT_KEY = web.AppKey("body_timeout_s", float)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"


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
    except ClientDisconnected as error:
        return _client_gone(request, error.message)
    except ApiError as error:
        response = error_response(error)
        if isinstance(error, RequestTimeout):
            response.force_close()  # the rest of the body may still be on its way
        return response
    except web.HTTPRequestEntityTooLarge:
        return error_response(PayloadTooLarge(f"request body exceeds {request.client_max_size} bytes"))
    except web.HTTPNotFound:
        return error_response(NotFound(f"no route for {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed:
        return error_response(MethodNotAllowed(f"method {request.method} not allowed on {request.path}"))
    except web.HTTPException:
        raise
    except ConnectionResetError as exc:  # writing to a client that has gone
        if request.transport is None or request.transport.is_closing():
            return _client_gone(request, str(exc))
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ApiError("internal error; see the server log"))
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ApiError("internal error; see the server log"))


def _client_gone(request: web.Request, detail: str) -> web.Response:
    """A client that leaves is not a server error: INFO, and 499 for the request counter.

    Nobody reads the response; aiohttp drops it on the closed connection.
    """
    log.info("client went away during %s %s: %s", request.method, request.path, detail)
    return web.Response(status=CLIENT_CLOSED_REQUEST)


# What aiohttp decodes without optional packages (br needs Brotli, zstd zstandard: neither is
# installed, so neither is offered).
CONTENT_ENCODINGS = ("identity", "gzip", "deflate")


def unsupported_encoding(header: str | None) -> BadRequest | None:
    """The 400 for a Content-Encoding this server does not decode, naming it and the ones it
    does; None where every coding listed is supported."""
    unsupported = [e.strip() for e in (header or "").split(",") if e.strip() and e.strip().lower() not in
                   CONTENT_ENCODINGS]
    return encoding_refused(', '.join(unsupported)) if unsupported else None


def encoding_refused(what: str) -> BadRequest:
    return BadRequest(f"Content-Encoding {bounded_text(what)} is not supported; "
                      f"send the body as {', '.join(CONTENT_ENCODINGS)}")


async def read_body(request: web.Request, max_bytes: int | None = None) -> bytes:
    """The whole body, within the size limit and the body timeout; every failure is an ApiError."""
    limit = request.client_max_size if max_bytes is None else min(max_bytes, request.client_max_size)
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    timeout_s = request.app.get(BODY_TIMEOUT_KEY, DEFAULT_BODY_TIMEOUT_S)
    refused = unsupported_encoding(request.headers.get("Content-Encoding"))
    if refused is not None:
        raise refused
    try:
        if request.content.is_eof():
            # The whole body came with the headers (the usual small request): nothing to wait
            # for, so no timer (arming one was about 2% of the gateway's CPU per request).
            raw = await request.read()
        else:
            async with asyncio.timeout(timeout_s):
                raw = await request.read()
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {timeout_s:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes") from None
    except (web.RequestPayloadError, HttpProcessingError) as exc:  # e.g. Content-Encoding: gzip that is not
        raise BadRequest(f"request body could not be decoded: {bounded_text(' '.join(str(exc).split()))}") from None
    if len(raw) > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    return raw


async def read_json(request: web.Request) -> Any:
    raw = await read_body(request)
    try:
        return loads_json(raw)
    except InputRefused as exc:
        raise BadRequest(str(exc), param=exc.param) from None


def sse_event(payload: Mapping[str, Any] | str, comment: bytes = b"") -> bytes:
    """One SSE event; ``comment`` (a whole comment event, ``: ...\\n\\n``) goes just before it."""
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"%bdata: %b\n\n" % (comment, data)


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def start_sse(request: web.Request, headers: Mapping[str, str] | None = None) -> web.StreamResponse:
    response = web.StreamResponse(headers={**SSE_HEADERS, **(headers or {})})
    await response.prepare(request)
    return response


def model_list(name: str, max_model_len: int | None = None) -> web.Response:
    """``GET /v1/models`` for a server that serves one model; ``max_model_len`` (vLLM's card
    field: prompt + output tokens a request may use) where known."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "specgate"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})
