"""A small asyncio Redis client for the session store: GET, pipelined SETs with expiry, one connection.

redis-py's per-command machinery (pool checkout, packing, response callbacks) cost the relay a
quarter of its busy time at 32 concurrent (docs/scaleout-bench.md). As gateway/fleet/worker_http.py
for HTTP, this does only what the store needs: ONE connection, commands written without waiting
for earlier replies, RESP2 replies parsed as they arrive and each handed to the oldest waiter
(Redis answers a connection's commands in order). ``RedisDown`` and ``RedisTimeout`` fail every
waiter and drop the connection (the next call connects again); an error reply fails its command.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

Reply = Any  # str (simple string), bytes | None (bulk), int, RedisReplyError, or a list of them
Arg = bytes | str | int


class RedisDown(ConnectionError):
    """The connection failed or closed, or Redis refused AUTH/SELECT: every pending command failed."""


class RedisTimeout(RedisDown, TimeoutError):
    """No reply within the client's timeout; the connection was dropped (its replies are stale now)."""


class RedisReplyError(Exception):
    """Redis answered this command with an error."""


class RedisWrongType(RedisReplyError):
    """WRONGTYPE: the key holds another type (another program's key, not an outage)."""


@dataclass(frozen=True)
class RedisTarget:
    """Where and how to connect: what ``state.redis_url`` says (redis://, rediss:// or unix://)."""

    host: str
    port: int
    unix_path: str | None
    tls: bool
    db: int
    username: str | None
    password: str | None

    @classmethod
    def from_url(cls, url: str) -> RedisTarget:
        """``redis[s]://[[user]:password@]host[:port][/db]`` or ``unix://[[user]:password@]/path[?db=N]``."""
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"not a redis://, rediss:// or unix:// URL: {url!r}")
        db_text = parts.path.strip("/") if parts.scheme != "unix" else ""
        db_text = db_text or parse_qs(parts.query).get("db", [""])[0]
        return cls(host=parts.hostname or "localhost", port=parts.port or 6379,
                   unix_path=unquote(parts.path) if parts.scheme == "unix" else None, tls=parts.scheme == "rediss",
                   db=int(db_text or 0), username=unquote(parts.username) if parts.username else None,
                   password=unquote(parts.password) if parts.password else None)

    def __str__(self) -> str:
        return f"unix://{self.unix_path}" if self.unix_path else f"{self.host}:{self.port}"


def pack(*args: Arg) -> bytes:
    """One command as a RESP array of bulk strings (what Redis reads from clients)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def parse_reply(buffer: bytes | bytearray, pos: int) -> tuple[Reply, int]:
    """One RESP2 reply starting at ``pos``: (value, where the next begins); (None, -1) if incomplete.
    Error replies are values (``RedisReplyError``), so one command's error fails only that command."""
    eol = buffer.find(b"\r\n", pos)
    if eol < 0:
        return None, -1
    kind, line = buffer[pos], buffer[pos + 1:eol]
    if kind == 0x24:  # $ bulk string; $-1 is the null reply (a GET of an absent key)
        length = int(line)
        if length < 0:
            return None, eol + 2
        end = eol + 2 + length
        if len(buffer) < end + 2:  # the rest of it is in a later read
            return None, -1
        return bytes(buffer[eol + 2:end]), end + 2
    if kind == 0x2B:  # + simple string
        return line.decode(), eol + 2
    if kind == 0x3A:  # : integer
        return int(line), eol + 2
    if kind == 0x2D:  # - error
        text = line.decode(errors="replace")
        return (RedisWrongType if text.startswith("WRONGTYPE") else RedisReplyError)(text), eol + 2
    if kind == 0x2A:  # * array; *-1 is a null array
        count, at = int(line), eol + 2
        if count < 0:
            return None, at
        items = []
        for _ in range(count):
            item, at = parse_reply(buffer, at)
            if at < 0:
                return None, -1
            items.append(item)
        return items, at
    raise ValueError(f"not a RESP2 reply type: {bytes([kind])!r}")


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[Reply]
    count: int  # 0: one reply, its value; n: a pipelined batch's n replies, a list
    replies: list[Reply] = field(default_factory=list)


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._pending: deque[_Waiter] = deque()
        self._buffer = bytearray()
        self._outgoing: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        if self._buffer:
            self._buffer += data
            view: bytes | bytearray = self._buffer
        else:
            view = data  # the usual case: whole replies in one read, nothing copied
        pos = 0
        try:
            while pos < len(view):
                value, end = parse_reply(view, pos)
                if end < 0:
                    break
                pos = end
                self._deliver(value)
        except (ValueError, IndexError) as exc:
            self.fail(RedisDown(f"unreadable reply from redis: {exc}"))
            return
        if view is self._buffer:
            del self._buffer[:pos]
        elif pos < len(view):
            self._buffer = bytearray(view[pos:])

    def _deliver(self, value: Reply) -> None:
        if not self._pending:
            raise ValueError("a reply nobody asked for")
        waiter = self._pending[0]
        if waiter.count:
            waiter.replies.append(value)
            if len(waiter.replies) < waiter.count:
                return
        self._pending.popleft()
        # A cancelled caller's reply is still consumed here, so the next reply goes to the next waiter.
        if not waiter.future.done():
            waiter.future.set_result(waiter.replies if waiter.count else value)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisDown(f"connection to redis lost: {exc or 'closed'}"))

    def send(self, payload: bytes, count: int) -> asyncio.Future[Reply]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Reply] = loop.create_future()
        self._pending.append(_Waiter(future, count))
        # Commands sent in one turn of the loop go out in one write: a write per GET was a system
        # call per request, the client's largest cost under concurrent load (py-spy).
        if not self._outgoing:
            loop.call_soon(self._write)
        self._outgoing.append(payload)
        return future

    def _write(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(b"".join(self._outgoing))
        self._outgoing.clear()

    def expire(self, future: asyncio.Future[Reply], timeout_s: float) -> None:
        if not future.done():  # the replies behind a missing one would be read late, by nobody: drop it all
            self.fail(RedisTimeout(f"no reply from redis within {timeout_s:g} s"))

    def fail(self, exc: RedisDown) -> None:
        self.closed = True
        while self._pending:
            future = self._pending.popleft().future
            if not future.done():
                future.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


class RedisClient:
    """GET, pipelined SETs with expiry, and any other command, over one connection made on first use.
    Every call (connecting included) waits at most ``timeout_s``. ``wrong_type`` is the exception
    a WRONGTYPE reply raises (a caller may narrow it to a subclass that means something to it)."""

    def __init__(self, url: str, timeout_s: float, wrong_type: type[Exception] = RedisWrongType) -> None:
        self.target = RedisTarget.from_url(url)
        self.timeout_s, self.wrong_type = timeout_s, wrong_type
        self._connection: _Connection | None = None
        self._lock = asyncio.Lock()
        self._attempts = self._failures = 0  # connections tried; of those, failed
        self._last_error: RedisDown | None = None
        self._ssl = ssl.create_default_context() if self.target.tls else None

    async def get(self, key: str) -> bytes | None:
        data = key.encode()
        reply = await self._call(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(data), data), 0)
        return cast(bytes | None, self._check(reply))

    async def set_many(self, items: list[tuple[str, bytes, int]]) -> None:
        """``SET key value PX ttl_ms`` for each item, written in one piece (a pipeline, no MULTI)."""
        if items:
            payload = b"".join(pack(b"SET", key, value, b"PX", ttl_ms) for key, value, ttl_ms in items)
            for reply in await self._call(payload, len(items)):
                self._check(reply)

    async def ping(self) -> None:
        self._check(await self._call(pack(b"PING"), 0))

    async def execute(self, *args: Arg) -> Reply:
        return self._check(await self._call(pack(*args), 0))

    async def set(self, key: str, value: Arg, px: int | None = None) -> Reply:
        return await self.execute("SET", key, value, *(("PX", px) if px is not None else ()))

    async def pttl(self, key: str) -> int:
        return cast(int, await self.execute("PTTL", key))

    async def hset(self, key: str, field: str, value: Arg) -> int:
        return cast(int, await self.execute("HSET", key, field, value))

    async def close(self) -> None:
        if self._connection is not None:
            self._connection.fail(RedisDown("client closed"))
            self._connection = None

    def _check(self, reply: Reply) -> Reply:
        if isinstance(reply, RedisReplyError):
            raise self.wrong_type(str(reply)) if isinstance(reply, RedisWrongType) else reply
        return reply

    async def _call(self, payload: bytes, count: int) -> Reply:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        connection = self._connection
        if connection is None or connection.closed:
            connection = await self._connect(deadline)
        future = connection.send(payload, count)
        # A timer on the future itself: asyncio.timeout's task bookkeeping costs more (worker_http.py).
        timer = loop.call_at(deadline, connection.expire, future, self.timeout_s)
        try:
            return await future
        finally:
            timer.cancel()

    async def _connect(self, deadline: float) -> _Connection:
        loop, failures, target = asyncio.get_running_loop(), self._failures, self.target
        async with self._lock:  # one connection, however many callers find none
            if self._connection is not None and not self._connection.closed:
                return self._connection
            if self._failures != failures and self._last_error is not None:
                # An attempt failed while this caller waited: fail now rather than spend a timeout more.
                raise type(self._last_error)(str(self._last_error))
            self._attempts += 1
            connection: _Connection | None = None
            try:
                async with asyncio.timeout_at(deadline):
                    _, connection = await (
                        loop.create_unix_connection(_Connection, target.unix_path) if target.unix_path is not None
                        else loop.create_connection(_Connection, target.host, target.port, ssl=self._ssl))
                    credentials = [text for text in (target.username, target.password) if text]
                    hello = [pack(b"AUTH", *credentials)] if target.password else []
                    hello += [pack(b"SELECT", target.db)] if target.db else []  # answered before any command
                    for reply in await connection.send(b"".join(hello), len(hello)) if hello else ():
                        if isinstance(reply, RedisReplyError):
                            raise RedisDown(f"redis refused AUTH or SELECT: {reply}")
            except TimeoutError:
                error: RedisDown = RedisTimeout(f"connecting to redis at {target} took over {self.timeout_s:g} s")
            except OSError as exc:  # refused, unreachable, ssl.SSLError, or RedisDown: AUTH or SELECT refused
                error = exc if isinstance(exc, RedisDown) else RedisDown(
                    f"cannot connect to redis at {self.target}: {type(exc).__name__}: {exc}")
            else:
                assert connection is not None
                self._connection, self._last_error = connection, None
                return connection
            if connection is not None:
                connection.fail(error)
            self._last_error, self._failures = error, self._failures + 1
            raise error
