"""A scripted HTTP server on loopback and a WorkerHttp client to it
(tests of gateway/fleet/worker_http.py and the coalescing e2e tests)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.fleet.worker_http import Endpoint, WorkerHttp

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[bool]]


class Server:
    """Reads each request (head and Content-Length body) and lets ``reply`` answer it; reply
    returns whether to keep the connection open for another request."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if not await self.reply(reader, writer, request):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client left, or the test ended while the reply waited
        finally:
            writer.close()


async def serve(reply: Reply) -> AsyncIterator[tuple[Server, WorkerHttp]]:
    server = Server(reply)
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    http = WorkerHttp(Endpoint.from_url(f"http://127.0.0.1:{port}/prefix"), {"Authorization": "Bearer t"})
    try:
        yield server, http
    finally:
        http.close()
        listening.close()
        await listening.wait_closed()
