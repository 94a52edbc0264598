"""Serving an aiohttp app so that even requests aiohttp refuses itself get OpenAI error objects.

aiohttp parses the request line and headers before any middleware runs; a header line over
its limit, too many headers or a malformed request line are answered by the connection's
``RequestHandler.handle_error`` with a plain-text 400, logged at ERROR with a traceback.
Clients of an OpenAI API expect ``{"error": {...}}`` everywhere, and a malformed request is
the client's fault, not a server error. So the app runs behind a ``RequestHandler`` whose
``handle_error`` answers an OpenAI error object (431 for oversized headers, 400 otherwise)
and logs client faults at INFO.

aiohttp has no public hook to choose the connection handler class: ``Server.__call__`` builds
``RequestHandler`` from the server's own keyword arguments, so ``_OpenAIServer`` overrides
``__call__`` and the runner hands out that server. tests/e2e/test_hostile_http.py pins the
behaviour with a raw socket, so an aiohttp upgrade that moves these internals fails loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, ContentEncodingError, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler

from policies import bounded_text
from workers.api.errors import ApiError, BadRequest, HeadersTooLarge, WorkerTimeout
from workers.api.web_common import encoding_refused, error_response, unsupported_encoding

log = logging.getLogger(__name__)
MAX_LINE_BYTES = 8190  # aiohttp's defaults, named here so the error message can state them
MAX_HEADERS = 128


def _client_error(exc: BaseException | None, message: str | None, encoding: str | None) -> ApiError:
    if isinstance(exc, ContentEncodingError):  # aiohttp's own message names a package to install
        # The parser fails before the request exists, so its headers may be unknown here.
        return unsupported_encoding(encoding) or encoding_refused("of this body")
    if isinstance(exc, LineTooLong):
        return HeadersTooLarge(f"a request line or header is longer than {MAX_LINE_BYTES} bytes")
    if isinstance(exc, BadHttpMessage) and "too many headers" in str(exc).lower():
        return HeadersTooLarge(f"more than {MAX_HEADERS} request headers")
    detail = exc.message if isinstance(exc, HttpProcessingError) else (message or "")
    return BadRequest(f"malformed HTTP request: {bounded_text(str(detail))}")


class _OpenAIRequestHandler(RequestHandler):
    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        error: ApiError
        if status < 500:
            headers = getattr(request, "headers", None)
            error = _client_error(exc, message, headers.get("Content-Encoding") if headers is not None else None)
            log.info("refused a malformed request from %s: %s", request.remote, error.message)
        else:
            if status == 504:  # a handler timed out
                error = WorkerTimeout("the request timed out")
            else:
                self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
                error = ApiError("internal error; see the server log")
        if request.writer.output_size > 0:  # as aiohttp does: a response has started, no second one
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        response = error_response(error)
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # After a handler refused a body that failed to decode (400), aiohttp still drains
        # the rest and hits the same decoding error: the client's fault, already answered.
        exc = kw.get("exc_info")
        if isinstance(exc, web.RequestPayloadError | HttpProcessingError):
            log.info("dropped an undecodable request body: %s", bounded_text(" ".join(str(exc).split())))
            return
        super().log_exception(*args, **kw)


class _OpenAIServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _OpenAIRequestHandler(self, loop=self._loop, **self._kwargs)


class OpenAIAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer aiohttp's own refusals as OpenAI errors."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _OpenAIServer  # same state; only the connection handler class differs
        return server


class Drainer(Protocol):
    async def drain(self) -> None:
        """Runs between a shutdown signal and the cleanup, while the listener still answers."""

    def hurry(self) -> None:
        """A second signal during ``drain``: finish it now."""


def run_app(app: web.Application, *, host: str | None = None, port: int | None = None,
            path: Path | None = None, drainer: Drainer | None = None) -> None:
    """``web.run_app`` (SIGINT/SIGTERM stop it gracefully, cleanup contexts run) with OpenAIAppRunner.

    With a ``drainer``, the first SIGINT/SIGTERM starts ``drainer.drain()`` and the cleanup
    follows once it returns; a second signal calls ``drainer.hurry()``.
    """

    async def serve() -> None:
        runner = OpenAIAppRunner(app, handle_signals=drainer is None, access_log=None)
        await runner.setup()
        try:
            site = web.UnixSite(runner, str(path)) if path is not None else web.TCPSite(runner, host, port)
            await site.start()
            if drainer is None:
                await asyncio.Event().wait()  # until a signal raises GracefulExit
            else:
                await _until_signal_then_drain(drainer)
        finally:
            await runner.cleanup()

    # GracefulExit leaves asyncio.run, which then cancels serve(), whose finally runs the cleanup.
    with contextlib.suppress(web.GracefulExit, KeyboardInterrupt):
        asyncio.run(serve())


async def _until_signal_then_drain(drainer: Drainer) -> None:
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()

    def on_signal() -> None:
        if signalled.is_set():
            drainer.hurry()
        signalled.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await signalled.wait()
        await drainer.drain()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
