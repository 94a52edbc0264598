"""gateway/fleet/worker_http.py, the relay's HTTP client to workers, against real loopback servers
that answer with crafted bytes: framing split anywhere, keep-alive reuse, a keep-alive the
server dropped, refused and cut connections, silence, and aborts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.fleet.worker_http import Endpoint, WorkerConnectError, WorkerHttp, WorkerStreamError
from tests.unit.worker_http_server import Server, serve


def sse(*events: bytes) -> bytes:
    """A chunked response carrying one chunk per event, then the terminator."""
    body = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events)
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    return head + body + b"0\r\n\r\n"


async def read_all(http: WorkerHttp, **kwargs: float) -> tuple[int, bytes]:
    response = await http.post("/v1/completions", b'{"x": 1}', {"X-Request-ID": "r1"}, **kwargs)
    body = await response.read()
    response.release()
    return response.status, body


async def test_chunked_stream_split_byte_by_byte_then_the_connection_is_reused() -> None:
    async def byte_by_byte(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> bool:
        for i, byte in enumerate(sse(b"data: one\n\n", b"data: two\n\n")):
            writer.write(bytes([byte]))
            if i % 7 == 0:
                await writer.drain()
                await asyncio.sleep(0)
        await writer.drain()
        return True

    async for server, http in serve(byte_by_byte):
        for _ in range(3):
            assert await read_all(http) == (200, b"data: one\n\ndata: two\n\n")
        assert server.connections == 1 and len(server.requests) == 3
        # What the worker got: the path under the URL's prefix, the request's headers, the body.
        head, body = server.requests[0].split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /prefix/v1/completions HTTP/1.1" and body == b'{"x": 1}'
        assert {b"Authorization: Bearer t", b"X-Request-ID: r1", b"Content-Length: 8"} <= set(lines)


async def test_content_length_and_connection_close_bodies() -> None:
    replies = iter([b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 5\r\nRetry-After: 3\r\n\r\nslow!",
                    b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end"])

    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> bool:
        data = next(replies)
        writer.write(data)
        await writer.drain()
        return b"close" not in data

    async for server, http in serve(answer):
        response = await http.post("/v1/completions", b"{}")
        assert (response.status, response.headers["retry-after"], await response.read()) == (429, "3", b"slow!")
        response.release()
        assert await read_all(http) == (200, b"until the end")  # the same connection, kept alive
        assert server.connections == 1


async def test_a_keep_alive_the_worker_dropped_is_replaced_transparently() -> None:
    async def once(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> bool:
        writer.write(sse(b"data: hi\n\n"))
        await writer.drain()
        return False  # then the server closes the connection, as a keep-alive timeout would

    async for server, http in serve(once):
        assert await read_all(http) == (200, b"data: hi\n\n")
        await asyncio.sleep(0.05)  # the close reaches the pooled connection
        assert await read_all(http) == (200, b"data: hi\n\n")
        assert server.connections == 2


async def test_refused_cut_silent_and_aborted_streams() -> None:
    # Nothing listening: a connect error, which the relay may retry on another worker.
    refused = WorkerHttp(Endpoint.from_url("http://127.0.0.1:9"))
    with pytest.raises(WorkerConnectError):
        await refused.post("/v1/completions", b"{}", connect_timeout=2)

    async def cut(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nb\r\ndata: one\n\n\r\n")
        await writer.drain()
        return False  # closed mid-stream

    async for _, http in serve(cut):
        response = await http.post("/v1/completions", b"{}")
        assert await response.readany() == b"data: one\n\n"
        with pytest.raises(WorkerStreamError, match="mid-response"):
            await response.readany()
        response.close()

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)
        return False

    async for _, http in serve(silent):
        response = await http.post("/v1/completions", b"{}", read_timeout=0.2)
        with pytest.raises(TimeoutError):
            await response.readany()
        response.close()
        # An abort wakes a pending read with the caller's exception.
        response = await http.post("/v1/completions", b"{}", read_timeout=5)
        pending = asyncio.ensure_future(response.readany())
        await asyncio.sleep(0.05)
        response.abort(LookupError("shutting down"))
        with pytest.raises(LookupError, match="shutting down"):
            await pending

    async def mute(_: asyncio.StreamReader, __: asyncio.StreamWriter, ___: bytes) -> bool:
        await asyncio.sleep(5)
        return False

    async for _, http in serve(mute):
        with pytest.raises(TimeoutError):  # no response head within the read timeout
            await http.post("/v1/completions", b"{}", read_timeout=0.1)


async def test_garbage_and_line_breaks_in_headers_are_refused() -> None:
    async def garbage(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        await writer.drain()
        return True

    async for _, http in serve(garbage):
        response = await http.post("/v1/completions", b"{}")
        with pytest.raises(WorkerStreamError, match="bad response"):
            await response.readany()
        response.close()
        with pytest.raises(ValueError, match="line breaks"):
            await http.post("/v1/completions", b"{}", {"X-Session-ID": "a\r\nX-Evil: 1"})


async def test_unix_socket_endpoint(tmp_path: Path) -> None:
    server = Server(lambda _, writer, __: _reply_once(writer))
    path = tmp_path / "w.sock"
    listening = await asyncio.start_unix_server(server.handle, str(path))
    http = WorkerHttp(Endpoint.from_url("http://worker", unix_path=str(path)))
    try:
        assert await read_all(http) == (200, b"data: unix\n\n")
        assert server.requests[0].split(b"\r\n")[:2] == [b"POST /v1/completions HTTP/1.1", b"Host: worker"]
    finally:
        http.close()
        listening.close()
        await listening.wait_closed()


async def _reply_once(writer: asyncio.StreamWriter) -> bool:
    writer.write(sse(b"data: unix\n\n"))
    await writer.drain()
    return True
