"""gateway/sessions/redis_resp.py: the session store's Redis client, against a real redis-server.

The parser on its own (replies fed in pieces, as reads split them), then one pipelined
connection: replies matched to callers in order under many concurrent calls and a cancelled
one, AUTH and SELECT from the URL, WRONGTYPE apart from other errors, and a Redis that dies
(every waiter fails with RedisDown) and comes back on the same port (the next call reconnects).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.sessions.redis_resp import (
    RedisClient,
    RedisDown,
    RedisReplyError,
    RedisTarget,
    RedisTimeout,
    RedisWrongType,
    _Connection,
    parse_reply,
)
from tests.e2e.redis_harness import RedisServer, start_redis


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    directory = tmp_path_factory.mktemp("r")
    server = start_redis(directory, extra_args=("--unixsocket", str(directory / "redis.sock")))
    yield server
    server.stop()


def key() -> str:
    return f"resp-{uuid.uuid4().hex}"


# -- the parser ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "value"), [
    (b"+OK\r\n", "OK"),
    (b":-42\r\n", -42),
    (b"$5\r\nhe\r\no\r\n", b"he\r\no"),  # a bulk string's length, not a line break, ends it
    (b"$0\r\n\r\n", b""),
    (b"$-1\r\n", None),
    (b"*-1\r\n", None),
    (b"*0\r\n", []),
    (b"*3\r\n:1\r\n$-1\r\n*1\r\n+x\r\n", [1, None, ["x"]]),
])
def test_each_reply_parses_whole_and_not_from_any_prefix(raw: bytes, value: Any) -> None:
    assert parse_reply(raw, 0) == (value, len(raw))
    assert parse_reply(b"junk" + raw, 4) == (value, len(raw) + 4)
    for cut in range(len(raw)):
        assert parse_reply(raw[:cut], 0) == (None, -1), cut


def test_error_replies_are_values_and_wrongtype_is_its_own_class() -> None:
    error, end = parse_reply(b"-ERR unknown command\r\n", 0)
    assert type(error) is RedisReplyError and str(error) == "ERR unknown command" and end == 22
    wrong, _ = parse_reply(b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n", 0)
    assert type(wrong) is RedisWrongType
    with pytest.raises(ValueError):
        parse_reply(b"!3\r\nabc\r\n", 0)


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True


async def test_replies_split_across_reads_reach_their_waiters_in_order() -> None:
    connection = _Connection()
    connection.connection_made(_Transport())  # type: ignore[arg-type]
    first, batch, third = connection.send(b"", 0), connection.send(b"", 3), connection.send(b"", 0)
    stream = b"$12\r\nhello\r\nworld\r\n+OK\r\n-ERR no\r\n:7\r\n$-1\r\n"
    for byte in range(len(stream)):  # one byte a read: the worst split there is
        connection.data_received(stream[byte:byte + 1])
    assert first.result() == b"hello\r\nworld"
    ok, error, seven = batch.result()
    assert ok == "OK" and isinstance(error, RedisReplyError) and seven == 7
    assert third.done() and third.result() is None


async def test_a_reply_nobody_asked_for_fails_the_connection() -> None:
    connection = _Connection()
    transport = _Transport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    connection.data_received(b"+OK\r\n")
    assert connection.closed and transport.closed


@pytest.mark.parametrize(("url", "target"), [
    ("redis://localhost:6379/0", RedisTarget("localhost", 6379, None, False, 0, None, None)),
    ("redis://r.internal", RedisTarget("r.internal", 6379, None, False, 0, None, None)),
    ("redis://:p%40ss@10.0.0.1:6380/2", RedisTarget("10.0.0.1", 6380, None, False, 2, None, "p@ss")),
    ("redis://alice:pw@h/3", RedisTarget("h", 6379, None, False, 3, "alice", "pw")),
    ("redis://h?db=4", RedisTarget("h", 6379, None, False, 4, None, None)),
    ("rediss://h:6390/1", RedisTarget("h", 6390, None, True, 1, None, None)),
    ("unix:///run/redis.sock?db=5", RedisTarget("localhost", 6379, "/run/redis.sock", False, 5, None, None)),
    ("unix://:pw@/run/redis.sock", RedisTarget("localhost", 6379, "/run/redis.sock", False, 0, None, "pw")),
])
def test_the_urls_state_redis_url_accepts(url: str, target: RedisTarget) -> None:
    assert RedisTarget.from_url(url) == target


# -- against a real Redis --------------------------------------------------------------------------
async def test_get_and_set_round_trip_with_expiry_and_null(redis_server: RedisServer) -> None:
    client = RedisClient(redis_server.url, timeout_s=5.0)
    try:
        await client.ping()
        one, two = key(), key()
        assert await client.get(one) is None
        await client.set_many([(one, b"\x00\xffbinary\r\n", 60_000), (two, b"", 1_000)])
        assert await client.get(one) == b"\x00\xffbinary\r\n"
        assert await client.get(two) == b""
        assert 59_000 < await client.pttl(one) <= 60_000
        await client.set_many([(one, b"single", 60_000)])
        assert await client.get(one) == b"single"
        await client.set_many([])
    finally:
        await client.close()


async def test_many_concurrent_calls_on_one_connection_each_get_their_own_reply(redis_server: RedisServer) -> None:
    client = RedisClient(redis_server.url, timeout_s=10.0)
    try:
        keys = [key() for _ in range(300)]
        await client.set_many([(k, k.encode(), 60_000) for k in keys[::2]])  # every other key absent
        values = await asyncio.gather(*(client.get(k) for k in keys), client.set_many([(keys[1], b"x", 60_000)]),
                                      *(client.get(k) for k in reversed(keys)))
        assert values[:300] == [k.encode() if i % 2 == 0 else None for i, k in enumerate(keys)]
        assert values[301:] == [b"x" if k == keys[1] else k.encode() if i % 2 == 0 else None
                                for i, k in reversed(list(enumerate(keys)))]
        assert client._attempts == 1  # one connection throughout
    finally:
        await client.close()


async def test_a_cancelled_caller_does_not_shift_the_replies_of_the_others(redis_server: RedisServer) -> None:
    client = RedisClient(redis_server.url, timeout_s=10.0)
    try:
        names = [key() for _ in range(3)]
        await client.set_many([(name, name.encode(), 60_000) for name in names])
        # BLPOP holds the connection's replies back for 0.2 s: the GETs behind it wait in line.
        blocked = asyncio.ensure_future(client.execute("BLPOP", key(), "0.2"))
        cancelled = asyncio.ensure_future(client.get(names[0]))
        kept = asyncio.ensure_future(client.get(names[1]))
        await asyncio.sleep(0.05)  # all three written
        cancelled.cancel()
        blocked.cancel()
        assert await kept == names[1].encode()
        assert await client.get(names[2]) == names[2].encode()
        assert cancelled.cancelled() and blocked.cancelled()
    finally:
        await client.close()


async def test_wrongtype_is_its_own_error_and_leaves_the_connection_usable(redis_server: RedisServer) -> None:
    sync = redis.Redis(port=redis_server.port)
    name = key()
    sync.hset(name, "field", "value")

    class Corrupt(ValueError):
        pass

    client = RedisClient(redis_server.url, timeout_s=5.0)
    narrowed = RedisClient(redis_server.url, timeout_s=5.0, wrong_type=Corrupt)
    try:
        with pytest.raises(RedisWrongType, match=r"^WRONGTYPE"):
            await client.get(name)
        with pytest.raises(Corrupt):
            await narrowed.get(name)
        with pytest.raises(RedisReplyError) as other:
            await client.execute("NO-SUCH-COMMAND")
        assert type(other.value) is RedisReplyError
        await client.set_many([(name, b"mine now", 60_000)])  # SET replaces a key of any type
        assert await client.get(name) == b"mine now"
    finally:
        await client.close()
        await narrowed.close()


async def test_auth_and_select_from_the_url(tmp_path: Path) -> None:
    server = start_redis(tmp_path)
    try:
        admin = redis.Redis(port=server.port)
        admin.acl_setuser("alice", enabled=True, passwords=["+alice-pw"], keys=["*"], commands=["+@all"])
        admin.config_set("requirepass", "s3cret")
        name = key()
        client = RedisClient(f"redis://:s3cret@127.0.0.1:{server.port}/3", timeout_s=5.0)
        alice = RedisClient(f"redis://alice:alice-pw@127.0.0.1:{server.port}?db=4", timeout_s=5.0)
        try:
            await client.set_many([(name, b"in db 3", 60_000)])
            await alice.set_many([(name, b"in db 4", 60_000)])
            inspect = {db: redis.Redis(port=server.port, password="s3cret", db=db) for db in (0, 3, 4)}
            assert [inspect[db].get(name) for db in (0, 3, 4)] == [None, b"in db 3", b"in db 4"]
        finally:
            await client.close()
            await alice.close()
        for url in (f"redis://:wrong@127.0.0.1:{server.port}/0", f"redis://127.0.0.1:{server.port}/0"):
            refused = RedisClient(url, timeout_s=5.0)
            with pytest.raises(RedisDown if "wrong" in url else RedisReplyError):
                await refused.get(name)  # a wrong password fails the connection; none, the command (NOAUTH)
            await refused.close()
    finally:
        server.stop()


async def test_a_unix_socket_url(redis_server: RedisServer) -> None:
    client = RedisClient(f"unix://{redis_server.directory / 'redis.sock'}?db=1", timeout_s=5.0)
    try:
        name = key()
        await client.set_many([(name, b"over the socket", 60_000)])
        assert redis.Redis(port=redis_server.port, db=1).get(name) == b"over the socket"
    finally:
        await client.close()


async def test_a_dead_redis_fails_every_waiter_and_the_next_call_reconnects(tmp_path: Path) -> None:
    server = start_redis(tmp_path)
    client = RedisClient(server.url, timeout_s=10.0)
    try:
        name = key()
        await client.set_many([(name, b"before", 60_000)])
        waiters = [asyncio.ensure_future(client.execute("BLPOP", key(), "0"))]  # holds the replies back
        waiters += [asyncio.ensure_future(client.get(name)) for _ in range(5)]
        await asyncio.sleep(0.05)
        await asyncio.to_thread(server.stop)
        outcomes = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(type(outcome) is RedisDown for outcome in outcomes), outcomes
        with pytest.raises(RedisDown, match="cannot connect"):
            await client.get(name)  # still down: refused

        await asyncio.to_thread(server.start)  # the same port, empty
        assert await client.get(name) is None
        await client.set_many([(name, b"after", 60_000)])
        assert await client.get(name) == b"after"
    finally:
        await client.close()
        server.stop()


async def test_no_reply_within_the_timeout_fails_every_waiter_as_a_timeout(redis_server: RedisServer) -> None:
    client = RedisClient(redis_server.url, timeout_s=0.2)
    try:
        await client.ping()
        slow = asyncio.ensure_future(client.execute("BLPOP", key(), "2"))  # answers after 2 s
        behind = asyncio.ensure_future(client.get(key()))
        for waiter in (slow, behind):
            with pytest.raises(RedisTimeout) as raised:
                await waiter
            assert isinstance(raised.value, TimeoutError)  # the store counts reason="timeout"
        assert await client.get(key()) is None  # a new connection: the stale reply never arrives on it
        assert client._attempts == 2
    finally:
        await client.close()


async def test_callers_waiting_for_a_connection_share_one_attempt() -> None:
    client = RedisClient("redis://127.0.0.1:1/0", timeout_s=5.0)  # nothing listens on port 1
    outcomes = await asyncio.gather(*(client.get("k") for _ in range(8)), return_exceptions=True)
    assert all(type(outcome) is RedisDown for outcome in outcomes)
    assert client._attempts == 1
