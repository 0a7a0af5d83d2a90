"""``_direct.HeldConnection``: the backplane listener's connection, kept between its
XREADs and read by ``_replies``. What redis-py's own command path guaranteed must still
hold: replies read as redis-py reads them (both protocols, any size), an error reply
raises redis-py's exception, a read cancelled at any await or cut off by its server
never hands its late reply to the next command, and nothing stays connected after the
cache closes."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, NoScriptError, ResponseError, TimeoutError

from layered_cache import LayeredCache
from layered_cache import _direct as direct
from layered_cache._l1 import MISSING
from tests.faults.proxy import ToxicProxy
from tests.helpers import CountingLoader, eventually, make_config
from tests.servers import RedisServer


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
async def client(redis_url: str, request: pytest.FixtureRequest) -> Any:
    # As the listener's client (``_clients.listener_connection``): no retries (redis-py's
    # default retry reconnects after a cancellation that landed in its connect) and no
    # socket timeout (with one, a send queued behind other work runs in redis-py's
    # ``wait_for``, which on Python 3.11 drops a cancellation that lands as it finishes).
    client = redis.Redis.from_url(
        redis_url, protocol=request.param, retry=Retry(NoBackoff(), 0), socket_timeout=None
    )
    yield client
    await client.aclose()


@pytest.fixture
async def held(client: redis.Redis) -> Any:
    held = direct.HeldConnection(client)
    yield held
    await held.close()


def _plain(value: Any) -> Any:
    """A reply with sets as sorted lists (redis-py reads a RESP3 set as a Python set)."""
    if isinstance(value, set):
        return sorted(value)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


async def test_replies_of_every_kind_read_as_redis_pys_parser_reads_them(
    client: redis.Redis, held: direct.HeldConnection, prefix: str
) -> None:
    raw = redis.Redis(connection_pool=client.connection_pool)
    raw.response_callbacks.clear()  # redis-py's parser output, no reshaping
    await client.hset(f"{prefix}h", mapping={"a": "1", "b": "2"})
    await client.sadd(f"{prefix}s", "x", "y")
    await client.rpush(f"{prefix}l", "1", "2", "3")
    await client.zadd(f"{prefix}z", {"m": 1.5, "n": 2})
    await client.xadd(f"{prefix}x", {"keys": b"\x91\xa1k", "origin": b""})
    commands: list[tuple[Any, ...]] = [
        ("PING",),
        ("SET", f"{prefix}k", b"\x00\r\n\xff"),
        ("GET", f"{prefix}k"),
        ("GET", f"{prefix}missing"),
        ("INCRBY", f"{prefix}n", 0),  # each command runs twice: no changing ones
        ("INCRBYFLOAT", f"{prefix}f", "0"),
        ("HGETALL", f"{prefix}h"),
        ("SMEMBERS", f"{prefix}s"),
        ("LRANGE", f"{prefix}l", 0, -1),
        ("ZRANGE", f"{prefix}z", 0, -1, "WITHSCORES"),
        ("XRANGE", f"{prefix}x", "-", "+"),
        ("XREAD", "COUNT", 10, "STREAMS", f"{prefix}x", "0-0"),
        ("XREAD", "COUNT", 10, "BLOCK", 10, "STREAMS", f"{prefix}x", "$"),
        ("EXISTS", f"{prefix}k", f"{prefix}missing"),
    ]
    for command in commands:
        expected = await raw.execute_command(*command)
        assert _plain(await held.execute(*command)) == _plain(expected), command


async def test_a_large_xread_reply_arriving_in_many_reads_is_read_whole(
    client: redis.Redis, held: direct.HeldConnection, prefix: str
) -> None:
    stream = f"{prefix}big"
    for start in range(0, 300, 50):
        pipe = client.pipeline(transaction=False)
        for i in range(start, start + 50):
            pipe.xadd(stream, {"keys": bytes([i % 256]) * 10_000, "origin": str(i)})
        await pipe.execute()
    reply = await held.execute("XREAD", "COUNT", 1000, "STREAMS", stream, "0-0")
    entries = reply[stream.encode()] if isinstance(reply, dict) else reply[0][1]
    assert [fields[3] for _, fields in entries] == [str(i).encode() for i in range(300)]
    assert all(fields[1] == bytes([i % 256]) * 10_000 for i, (_, fields) in enumerate(entries))
    assert await held.execute("PING") in (b"PONG", "PONG")


async def test_an_error_reply_raises_and_the_connection_serves_the_next_command(
    client: redis.Redis, held: direct.HeldConnection, prefix: str
) -> None:
    own = await held.execute("CLIENT", "ID")
    with pytest.raises(NoScriptError):
        await held.execute("EVALSHA", "0" * 40, 0)
    await client.rpush(f"{prefix}list", "x")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await held.execute("XREAD", "STREAMS", f"{prefix}list", "0-0")
    assert await held.execute("CLIENT", "ID") == own  # the same connection, still in step


async def test_a_second_command_while_one_is_in_flight_is_refused(
    held: direct.HeldConnection, prefix: str
) -> None:
    """Two callers on one held connection would read each other's replies: the second
    is refused at once and the first gets its own reply."""
    blocked = asyncio.create_task(held.execute("XREAD", "BLOCK", 200, "STREAMS", f"{prefix}s", "$"))
    await asyncio.sleep(0.05)
    with pytest.raises(RuntimeError, match="one command at a time"):
        await held.execute("PING")
    assert await blocked is None
    assert await held.execute("PING") in (b"PONG", "PONG")


async def test_a_read_cancelled_at_every_await_never_leaks_its_reply_to_the_next(
    client: redis.Redis, held: direct.HeldConnection, prefix: str
) -> None:
    """A blocking XREAD is cancelled after 0, 1, 2, ... loop turns (while it checks out
    its connection, sends, waits), then an entry lands, which a still-pending XREAD on
    the connection would answer. Were the connection kept, the next command would read
    that reply; instead it is dropped and every GET reads its own value. (A
    cancellation that lands while redis-py connects surfaces as its TimeoutError, as in
    tests/test_direct.py; the listener asks its task whether it was cancelled.)"""
    key, stream = f"{prefix}value", f"{prefix}stream"
    await client.set(key, "mine")
    for turns in range(12):
        read = asyncio.create_task(held.execute("XREAD", "BLOCK", 5_000, "STREAMS", stream, "$"))
        for _ in range(turns):
            await asyncio.sleep(0)
        read.cancel()
        with pytest.raises((asyncio.CancelledError, TimeoutError)):
            await read
        await client.xadd(stream, {"turn": turns})
        assert await held.execute("GET", key) == b"mine", turns


async def test_a_connection_its_server_closed_in_flight_fails_one_command_and_the_next_reconnects(
    client: redis.Redis, held: direct.HeldConnection, prefix: str
) -> None:
    own = await held.execute("CLIENT", "ID")
    blocked = asyncio.create_task(held.execute("BLPOP", f"{prefix}never", 5))
    assert await eventually(lambda: _blocked_in_blpop(client, own), timeout=5)
    await client.client_kill_filter(_id=own)
    with pytest.raises(ConnectionError):
        await blocked
    assert await held.execute("CLIENT", "ID") != own
    assert await held.execute("PING") in (b"PONG", "PONG")


async def test_a_connection_its_server_closed_while_idle_is_replaced_before_the_next_command(
    client: redis.Redis, held: direct.HeldConnection
) -> None:
    """Killed between commands (Redis restarted, its ``timeout`` config, CLIENT KILL):
    once the close has reached us, the next command runs on a new connection instead
    of failing on the dead one (redis-py's pool checks the same before a checkout)."""
    own = await held.execute("CLIENT", "ID")
    await client.client_kill_filter(_id=own)
    await asyncio.sleep(0.05)  # the server's close reaches this process
    assert await held.execute("CLIENT", "ID") != own
    assert await held.execute("PING") in (b"PONG", "PONG")


async def _blocked_in_blpop(admin: redis.Redis, client_id: int) -> bool:
    clients = await admin.client_list()
    return any(int(c["id"]) == client_id and c.get("cmd") == "blpop" for c in clients)


async def test_a_closed_cache_leaves_no_connection_behind(
    redis_server: RedisServer, prefix: str
) -> None:
    """The listener's held connection goes back to the pool and is closed with it."""
    admin = redis.Redis.from_url(redis_server.url)
    alone = len(await admin.client_list())
    config = make_config(redis_server.url, prefix)
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, "v")  # the listener reads its entry
        assert await eventually(lambda: _entries_seen(cache) >= 1)
    assert await eventually(lambda: _count(admin, alone))
    await admin.aclose()


def _entries_seen(cache: LayeredCache) -> int:
    listener = cache._backplane  # the outcome is not visible otherwise
    assert listener is not None
    return listener.entries_seen


async def _count(admin: redis.Redis, expected: int) -> bool:
    return len(await admin.client_list()) == expected


@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_poisoned_xread_reply_reconnects_the_listener_and_loses_no_invalidation(
    redis_server: RedisServer, prefix: str, protocol: int
) -> None:
    """The reply carrying another instance's invalidation reaches the listener as
    bytes that are no reply at all. The listener drops the connection, reconnects, reads
    from its last position again and applies the entry: its L1 copy goes, without a
    whole-L1 clear, and later entries keep coming."""
    proxy = await ToxicProxy(redis_server.host, redis_server.port).start()
    url = f"?protocol={protocol}"
    backplane = {"block": "200ms"}
    # Long TTLs: only the backplane can drop the L1 copies within the test's waits.
    book = {"book": {"key": "book:{id}", "l1": {"ttl": "1h"}, "l2": {"ttl": "1h"}}}
    local_config = make_config(proxy.url + url, prefix, book, backplane=backplane)
    direct_url = redis_server.url.partition("?")[0] + url  # this test picks the protocol
    remote_config = make_config(direct_url, prefix, book, backplane=backplane)
    poisoned: list[bytes] = []

    def poison_the_first_xread_reply(data: bytes) -> bytes:
        if not poisoned and data.startswith((b"%1\r\n", b"*1\r\n*2\r\n")):
            poisoned.append(data)
            return b"?not a reply\r\n"
        return data

    try:
        async with (
            LayeredCache.from_config(local_config) as local,
            LayeredCache.from_config(remote_config) as remote,
        ):
            l1 = local.namespace("book").policy.l1
            assert l1 is not None
            for book in (1, 2):
                assert await local.get_or_load("book", {"id": book}, CountingLoader("old")) == "old"
            proxy.rewrite = poison_the_first_xread_reply
            await remote.set("book", {"id": 1}, "new")
            assert await eventually(lambda: l1.get(f"{prefix}book:1") is MISSING, timeout=8)
            assert poisoned, "the entry reached the listener unpoisoned"
            await remote.set("book", {"id": 2}, "new")  # and the listener reads on
            assert await eventually(lambda: l1.get(f"{prefix}book:2") is MISSING, timeout=8)
            assert await local.get("book", {"id": 1}) == "new"
            assert local.backplane_status().gaps == 0
    finally:
        await proxy.stop()


async def test_the_listener_keeps_one_connection_for_all_its_stream_commands(
    redis_server: RedisServer, prefix: str
) -> None:
    """Its start (XREVRANGE, XADD of the stream's first entry) and its gap checks (XINFO
    STREAM: after a long read, with its XREAD connection still held, and after that
    connection is killed) go over the connection its XREADs hold: no second connection
    per instance sits idle in the listener's pool (a fleet's every instance keeps one
    connection to the stream's node, not two)."""
    admin = redis.Redis.from_url(redis_server.url)
    config = make_config(redis_server.url, prefix, backplane={"block": "200ms", "maxlen": 5})
    async with LayeredCache.from_config(config) as cache:
        listener = cache._backplane  # the outcome is not visible otherwise
        assert listener is not None
        assert await eventually(lambda: _stream_commands_idle(admin))
        # A read of 5 entries or more (maxlen): entries may have been trimmed before it.
        stream = config.redis.prefix + config.backplane.stream
        pipe = admin.pipeline(transaction=False)
        for i in range(20):
            pipe.xadd(stream, {"keys": msgspec.msgpack.encode([f"{prefix}book:{i}"])})
        await pipe.execute()
        assert await eventually(lambda: listener.entries_seen >= 20)
        assert await eventually(lambda: _stream_commands_idle(admin))
        killed = await _reading(admin)
        await admin.client_kill_filter(_id=killed)
        assert await eventually(lambda: _reading(admin, other_than=killed))  # reconnected
        assert await eventually(lambda: _stream_commands_idle(admin))
        assert listener.gaps == 0
    await admin.aclose()


async def _reading(admin: redis.Redis, other_than: str | None = None) -> str | None:
    """The ID of a connection blocked in XREAD (other than ``other_than``)."""
    for client in await admin.client_list():
        if client.get("cmd") == "xread" and client["id"] != other_than:
            return str(client["id"])
    return None


async def _stream_commands_idle(admin: redis.Redis) -> bool:
    """One connection blocked in XREAD, none whose last command was one of the
    listener's others."""
    commands = [client.get("cmd") for client in await admin.client_list()]
    return commands.count("xread") == 1 and not {"xrevrange", "xinfo|stream"} & set(commands)
