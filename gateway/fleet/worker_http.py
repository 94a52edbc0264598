"""The relay's HTTP/1.1 client to a worker: keep-alive connections, a POST, a streamed body.

The hot path of every request is one POST to a worker and the read of its SSE stream.
Through aiohttp's client that was about a third of the gateway's busy time under sequential
load (py-spy): request and response objects, multidicts, URL parsing, timers and tracing
hooks the relay never uses. This client does what the relay needs and nothing else: a pool of
keep-alive connections per worker (Unix socket, TCP or TLS), a request written in one piece,
and the response parsed by httptools (llhttp, in C) into its head and its body (content-length,
chunked, or to the connection's end), handed over a network read at a time. Health polls and
metrics scrapes stay on aiohttp. (bench.overhead --ref-repo measures it against the gateway
before it: docs/relay-overhead.md.)

Errors say which side of the first response byte they happened on, because the relay's
answer differs: ``WorkerConnectError`` (nothing came back: the request may go to another
worker), ``WorkerStreamError`` (the connection broke mid-response), ``TimeoutError`` (the
worker was silent for the read timeout).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

# A response's buffered body above this pauses reading from the worker until the relay catches
# up (a slow client must not make the gateway buffer a whole generation).
_PAUSE_BYTES = 256 * 1024
_MAX_IDLE = 64  # idle keep-alive connections kept per worker


class WorkerConnectError(Exception):
    """The worker could not be reached, or closed the connection before its response began."""


class WorkerStreamError(Exception):
    """The worker's response broke off or could not be parsed."""


@dataclass(frozen=True)
class Endpoint:
    """Where a worker listens: a Unix socket, or a host and port (TLS for https)."""

    unix_path: str | None
    host: str
    port: int
    tls: bool
    host_header: str
    path_prefix: str

    @classmethod
    def from_url(cls, url: str, unix_path: str | None = None) -> Endpoint:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        host = parts.hostname or "localhost"
        return cls(unix_path, host, parts.port or (443 if tls else 80), tls, parts.netloc or host,
                   parts.path.rstrip("/"))


class _Connection(asyncio.Protocol):
    """One keep-alive connection; httptools (llhttp, in C) parses one response at a time into
    body pieces (a chunked stream decoded in C: a Python parser cost more per chunk than
    aiohttp's, bench.overhead)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.error: Exception | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._headers: dict[str, str] = {}
        self._head: asyncio.Future[tuple[int, dict[str, str]]] | None = None
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._state = "idle"  # idle, head, body, done
        self._to_close = False  # a body without a length ends with the connection
        self.keep_alive = True
        self.received_any = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        try:
            if self._state not in ("head", "body"):
                raise WorkerStreamError(f"unexpected bytes from the worker ({self._state})")
            self._parser.feed_data(data)
        except (httptools.HttpParserError, WorkerStreamError) as exc:
            self._fail(exc if isinstance(exc, WorkerStreamError) else WorkerStreamError(f"bad response: {exc}"))
            if self.transport is not None:
                self.transport.close()
        if self._buffered > _PAUSE_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._state == "body" and self._to_close:  # a body delimited by the connection's end: it ended
            self._state = "done"
        elif self._state in ("head", "body"):
            self._fail(WorkerStreamError(f"worker closed the connection mid-response: {exc or 'EOF'}"))
        self._wake()

    # -- httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self._head is None or self._head.done():
            raise WorkerStreamError("a response nobody asked for")
        status, headers = self._parser.get_status_code(), self._headers
        self.keep_alive = self._parser.should_keep_alive()
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self._to_close = "content-length" not in headers and not chunked
        self._state = "body"
        self._head.set_result((status, headers))

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        self._state = "done"

    def _fail(self, exc: Exception) -> None:
        if self.error is None:  # the first failure is the one to report
            self.error = exc
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- used by WorkerHttp and WorkerResponse
    def send(self, request: bytes) -> asyncio.Future[tuple[int, dict[str, str]]]:
        assert self.transport is not None and self._state in ("idle", "done")
        self._state, self._headers, self.received_any = "head", {}, False
        self._pieces.clear()
        self._buffered, self.error = 0, None
        self._head = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._head

    @property
    def body_done(self) -> bool:
        return self._state == "done" and not self._pieces

    async def read_piece(self, silence_s: float) -> bytes:
        """The body bytes received since the last call; b"" at the end; waits up to ``silence_s``."""
        while True:
            if self._pieces:
                data = b"".join(self._pieces)
                self._pieces.clear()
                self._buffered = 0
                if self._paused and self.transport is not None and not self.closed:
                    self._paused = False
                    self.transport.resume_reading()
                return data
            if self.error is not None:
                raise self.error
            if self._state == "done":
                return b""
            if self.closed:
                raise WorkerStreamError("worker closed the connection mid-response")
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(silence_s, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None

    def abort(self, exc: Exception) -> None:
        self._fail(exc)
        self._wake()
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class WorkerResponse:
    """A worker's response: status and headers (names lower-cased), then the body by reads."""

    def __init__(self, http: WorkerHttp, connection: _Connection, status: int, headers: dict[str, str],
                 read_timeout: float) -> None:
        self._http, self._connection = http, connection
        self.status, self.headers, self._read_timeout = status, headers, read_timeout
        self._finished = False

    async def readany(self) -> bytes:
        """The next body bytes (whatever arrived), b"" at the end of the body."""
        return await self._connection.read_piece(self._read_timeout)

    async def read(self) -> bytes:
        first = await self.readany()
        if not first or self._connection.body_done:  # it all came in one read (a short answer)
            return first
        parts = [first]
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the response: a fully read body returns the connection to the pool."""
        if not self._finished:
            self._finished = True
            self._http.put_back(self._connection)

    def abort(self, exc: Exception) -> None:
        """Ends the stream now: a pending or later read raises ``exc``; the connection is dropped."""
        if not self._finished:
            self._connection.abort(exc)

    def close(self) -> None:
        """Drops the connection (an unfinished stream: the worker sees it closed and aborts)."""
        if not self._finished:
            self._finished = True
            self._connection.close()


class WorkerHttp:
    """Keep-alive HTTP/1.1 POSTs to one worker."""

    def __init__(self, endpoint: Endpoint, headers: Mapping[str, str] | None = None) -> None:
        self.endpoint = endpoint
        self._idle: list[_Connection] = []
        self._default_headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._ssl = ssl.create_default_context() if endpoint.tls else None

    async def _connect(self, connect_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        e = self.endpoint
        try:
            async with asyncio.timeout(connect_s):
                if e.unix_path is not None:
                    _, connection = await loop.create_unix_connection(_Connection, e.unix_path)
                else:
                    _, connection = await loop.create_connection(_Connection, e.host, e.port, ssl=self._ssl)
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise WorkerConnectError(f"cannot connect to {e.unix_path or e.host_header}: "
                                     f"{exc.__class__.__name__}: {exc}") from exc
        return connection

    def _request(self, path: str, body: bytes, headers: Mapping[str, str] | None) -> bytes:
        pairs = (headers or {}).items()
        if any("\r" in text or "\n" in text for pair in pairs for text in pair):
            raise ValueError("header names and values must not contain line breaks")
        extra = "".join(f"{k}: {v}\r\n" for k, v in pairs)
        head = (f"POST {self.endpoint.path_prefix}{path} HTTP/1.1\r\nHost: {self.endpoint.host_header}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                f"{self._default_headers}{extra}\r\n")
        return head.encode("utf-8") + body

    async def post(self, path: str, body: bytes, headers: Mapping[str, str] | None = None, *,
                   connect_timeout: float = 5.0, read_timeout: float = 300.0) -> WorkerResponse:
        """Sends the request; returns once the response head arrived (or raises)."""
        request = self._request(path, body, headers)
        while True:
            reused = bool(self._idle)
            connection = self._idle.pop() if reused else await self._connect(connect_timeout)
            if connection.closed:
                continue
            head = connection.send(request)
            # A timer on the head itself (as read_piece's): asyncio.timeout's task bookkeeping
            # cost more than the wait it guards, for every request.
            timer = asyncio.get_running_loop().call_later(read_timeout, _expire, head)
            try:
                status, response_headers = await head
            except WorkerStreamError as exc:
                connection.close()
                # A reused connection the worker closed while idle (its keep-alive ran out)
                # fails before any byte comes back: the worker never read the request, so it is
                # sent again on a new one. Otherwise nothing came back: the caller decides.
                if reused and not connection.received_any:
                    continue
                if connection.received_any:
                    raise
                raise WorkerConnectError(str(exc)) from exc
            except BaseException:
                connection.close()
                raise
            finally:
                timer.cancel()
            return WorkerResponse(self, connection, status, response_headers, read_timeout)

    def put_back(self, connection: _Connection) -> None:
        if connection.body_done and connection.keep_alive and not connection.closed and len(self._idle) < _MAX_IDLE:
            self._idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()
