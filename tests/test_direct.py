"""``_direct``: commands the library packs itself (set()'s write script on a single
node). Whatever redis-py's ``execute_command`` guaranteed must still hold: arguments
arrive byte for byte, error replies raise redis-py's exceptions, and a command whose
reply was not read - cancelled at any await, or timed out - never hands that late reply
to the next command on the pool."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import time
from typing import Any, cast

import pytest
import redis.asyncio as redis
from redis.exceptions import NoScriptError, ResponseError, TimeoutError

from layered_cache import LayeredCache
from layered_cache import _direct as direct
from layered_cache._backplane import Announcement
from layered_cache._write_commands import Append, run_transaction
from tests.faults.proxy import ToxicProxy
from tests.helpers import eventually, make_config
from tests.servers import RedisServer, with_protocol


@pytest.fixture
async def one_connection(redis_url: str) -> Any:
    """One kept connection, from a pool of one: a reply left unread on it would be read
    next."""
    client = redis.Redis.from_url(redis_url, max_connections=1, socket_timeout=2.0)
    commands = direct.DirectClient(client)
    yield commands
    await commands.close()
    await client.aclose()


async def test_arguments_arrive_byte_for_byte(
    one_connection: direct.DirectClient, redis_client: redis.Redis, prefix: str
) -> None:
    key = f"{prefix}ключ:\r\n:1"
    value = bytes(range(256)) + b"\r\n$3\r\n" + b"x" * 100_000
    assert await direct.execute_command(one_connection, "SET", key, value, "PX", 60_000) == b"OK"
    assert await redis_client.get(key) == value  # read by redis-py, on another connection
    assert await direct.execute_command(one_connection, "SET", key, -5) == b"OK"
    assert await direct.execute_command(one_connection, "GET", key) == b"-5"
    assert await direct.execute_command(one_connection, "SET", key, b"") == b"OK"
    assert await redis_client.get(key) == b""


class _Slug(str, enum.Enum):  # noqa: UP042  # the mixin users write; str() of it is "_Slug.ONE"
    ONE = "slug"


class _Shelf(enum.IntEnum):
    TOP = 7


async def test_subclasses_of_str_bytes_and_int_are_sent_as_their_values(
    one_connection: direct.DirectClient, redis_client: redis.Redis, prefix: str
) -> None:
    assert await direct.execute_command(one_connection, "SET", _Slug.ONE, _Shelf.TOP) == b"OK"
    assert await redis_client.get("slug") == b"7"
    assert await direct.execute_command(one_connection, "APPEND", _Slug.ONE, _Raw(b"!")) == 2
    assert await redis_client.getdel("slug") == b"7!"


class _Raw(bytes):
    pass


@pytest.mark.parametrize("bad", [True, 1.5, None, ["list"]])
async def test_an_argument_of_another_type_is_refused_before_anything_is_sent(
    one_connection: direct.DirectClient, prefix: str, bad: object
) -> None:
    with pytest.raises(TypeError, match="bytes, str or int"):
        await direct.execute_command(one_connection, "SET", f"{prefix}k", bad)  # type: ignore[arg-type]
    assert await direct.execute_command(one_connection, "PING") == b"PONG"


async def test_error_replies_raise_redis_pys_exceptions(
    one_connection: direct.DirectClient, redis_client: redis.Redis, prefix: str
) -> None:
    with pytest.raises(NoScriptError):
        await direct.execute_command(one_connection, "EVALSHA", "0" * 40, 0)
    await redis_client.lpush(f"{prefix}list", "x")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await direct.execute_command(one_connection, "INCR", f"{prefix}list")
    assert await direct.execute_command(one_connection, "PING") == b"PONG"


async def test_a_command_cancelled_at_every_await_never_leaks_its_reply_to_the_next(
    redis_url: str, one_connection: direct.DirectClient, prefix: str
) -> None:
    """A BLPOP is cancelled after 0, 1, 2, ... loop turns (before it has a connection,
    while it sends, while it waits); then an item is pushed. Were the connection
    returned to the pool with the BLPOP still pending, the server would hand it the item
    and the next GET would read that reply. Instead the connection is dropped: the item
    stays in the list and every GET reads its own value. (A cancellation that lands
    while redis-py connects surfaces as its TimeoutError: redis-py's own
    ``execute_command`` does the same; the cache's calls resurface it, see
    tests/test_cancellation.py.)"""
    pusher = redis.Redis.from_url(redis_url)
    key = f"{prefix}value"
    await pusher.set(key, "mine")
    for turns in range(12):
        queue = f"{prefix}queue:{turns}"
        task = asyncio.create_task(direct.execute_command(one_connection, "BLPOP", queue, 5))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises((asyncio.CancelledError, TimeoutError)):
            await task
        # The close reaches the server a moment later: a push before it would be taken
        # by the BLPOP of a connection already dropped here (not the race under test).
        assert await eventually(lambda: _blpop_gone(pusher), timeout=5), turns
        await pusher.rpush(queue, f"item {turns}")
        assert await direct.execute_command(one_connection, "GET", key) == b"mine", turns
        assert await pusher.llen(queue) == 1, f"the BLPOP cancelled after {turns} turns took it"
    await pusher.aclose()


async def test_a_timed_out_command_never_leaks_its_reply_to_the_next(
    redis_url: str, prefix: str
) -> None:
    client = redis.Redis.from_url(redis_url, max_connections=1, socket_timeout=0.2)
    commands = direct.DirectClient(client)
    pusher = redis.Redis.from_url(redis_url)
    queue, key = f"{prefix}queue", f"{prefix}value"
    await pusher.set(key, "mine")
    with pytest.raises(TimeoutError):
        await direct.execute_command(commands, "BLPOP", queue, 2)
    assert await eventually(lambda: _blpop_gone(pusher), timeout=5)
    await pusher.rpush(queue, "item")
    assert await direct.execute_command(commands, "GET", key) == b"mine"
    assert await pusher.llen(queue) == 1
    await client.aclose()
    await pusher.aclose()


async def test_a_send_into_a_redis_that_stopped_reading_ends_at_the_socket_timeout(
    redis_server: RedisServer, prefix: str
) -> None:
    """``_direct`` sends without redis-py's per-send ``wait_for`` (``_send``), keeping
    the socket timeout as a deadline of its own. A Redis that stops reading (SIGSTOP)
    lets a large command fill the socket buffers, and then the write itself waits: it
    must end at the timeout, give up the connection, and leave the pool fit for the
    next command once Redis is back. (Whether the timed-out SET lands is not promised,
    as for any command that timed out: asyncio's ``close()`` of the given-up transport
    still flushes what it buffered, so Redis may yet read the whole command - seen in
    one run, where it overwrote a later SET of the same key.)"""
    client = redis.Redis.from_url(redis_server.url, max_connections=1, socket_timeout=0.3)
    commands = direct.DirectClient(client)
    assert await direct.execute_command(commands, "PING") == b"PONG"  # connected
    redis_server.pause()
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises((TimeoutError, asyncio.TimeoutError)):
            await direct.execute_command(commands, "SET", f"{prefix}big", b"x" * 64_000_000)
        assert asyncio.get_running_loop().time() - started < 3
    finally:
        redis_server.resume()
    key = f"{prefix}after"
    assert await direct.execute_command(commands, "SET", key, b"small") == b"OK"
    assert await direct.execute_command(commands, "GET", key) == b"small"
    await client.aclose()


async def test_a_new_connection_whose_handshake_outlasts_the_socket_timeout_still_connects(
    redis_server: RedisServer, prefix: str
) -> None:
    """The send's deadline is one socket timeout; a new connection's connect and
    handshake stay redis-py's (connect timeout, then each handshake read bounded by the
    socket timeout), never inside that deadline. Every reply 0.2 s late, socket timeout
    0.3 s: each read fits, the RESP3 handshake (HELLO, then redis-py's CLIENT SETINFO:
    ~0.8 s here) does not fit in one 0.3 s, and the first command on a new connection
    must still succeed."""
    proxy = await ToxicProxy(redis_server.host, redis_server.port).start()
    proxy.mode, proxy.latency = "latency", 0.2
    client = redis.Redis.from_url(
        proxy.url, protocol=3, socket_timeout=0.3, socket_connect_timeout=2.0
    )
    commands = direct.DirectClient(client)
    try:
        key = f"{prefix}slow"
        assert await direct.execute_command(commands, "SET", key, b"v") == b"OK"
        assert await direct.execute_command(commands, "GET", key) == b"v"
    finally:
        await client.aclose()
        await proxy.stop()


@pytest.mark.parametrize("command", ["get", "invalidate"])
async def test_a_command_sent_while_other_work_is_queued_waits_only_for_its_own_reply(
    redis_url: str, prefix: str, command: str
) -> None:
    """A busy loop must not time out our commands: 0.3 s of other work already queued
    when a GET (or an invalidation's DEL) is sent, and a 0.1 s Redis timeout. Sent at
    once with its read timeout started, the command would find its deadline passed by
    the time the loop read the reply (a ``gather`` of 100 invalidations timed out this
    way on a slow CI machine); with work queued it sends as redis-py does, after that
    work ran (``_readyqueue``). Outcome: the value is read and no Redis error counted."""
    config = make_config(redis_url, prefix, redis={"timeout": "100ms"})
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, "v1")
        cache.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
        asyncio.get_running_loop().call_soon(time.sleep, 0.3)  # the queued work
        if command == "get":
            assert await cache.get("book", {"id": 1}) == "v1"
        else:
            await cache.invalidate("book", {"id": 1})
        assert cache.stats()["book"]["redis_error"] == 0
        assert cache.redis_status().breaker == "closed"


async def _blpop_gone(admin: redis.Redis) -> bool:
    """No connection is blocked in a BLPOP (this file is the suite's only BLPOP user)."""
    clients = await admin.client_list()
    return not any(client.get("cmd") == "blpop" and "b" in client.get("flags", "") for client in clients)


async def test_set_after_the_servers_scripts_were_flushed_loads_its_script_and_lands(
    redis_url: str, prefix: str
) -> None:
    """A Redis restarted (or SCRIPT FLUSH) forgets the write script: set() loads it
    through redis-py and writes, and a second instance reads the value."""
    config = make_config(redis_url, prefix)
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        await a.set("book", {"id": 1}, "first")
        admin = redis.Redis.from_url(redis_url)
        await admin.script_flush()
        await admin.aclose()
        await a.set("book", {"id": 1}, "second")
        assert await b.get("book", {"id": 1}) == "second"


async def test_commands_in_sequence_share_one_kept_connection_and_a_burst_reuses_its_own(
    redis_url: str,
) -> None:
    """``DirectClient`` keeps its connections out of redis-py's pool between commands:
    commands in sequence run on one, a burst of 8 on at most 8, the next burst on the
    same ones, and ``close`` gives them all back (the pool holds 8: redis-py's own
    commands then use them again, where a connection not given back would make it
    refuse the 8th)."""
    client = redis.Redis.from_url(redis_url, max_connections=8, socket_timeout=2.0)
    commands = direct.DirectClient(client)

    async def burst() -> set[int]:
        replies = [direct.execute_command(commands, "CLIENT", "ID") for _ in range(8)]
        return set(await asyncio.gather(*replies))

    in_sequence = {await direct.execute_command(commands, "CLIENT", "ID") for _ in range(20)}
    assert len(in_sequence) == 1
    first = await burst()
    assert in_sequence <= first and len(first) == 8
    assert await burst() <= first
    await commands.close()
    by_redis_py = [client.execute_command("CLIENT", "ID") for _ in range(8)]
    assert set(await asyncio.gather(*by_redis_py)) <= first
    await client.aclose()


async def test_a_request_paths_command_is_seen_once_by_a_wrapper_of_the_module(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The explorer and the race tests make every command a yield point and a fault
    point by wrapping ``_direct.execute_command`` (the request path) and
    ``HeldConnection.execute`` (the listener). A request-path command must pass through
    exactly one of them, or it would be two yield points and two chances of a fault."""
    seen: list[str] = []

    def counting(original: Any, label: str) -> Any:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            seen.append(label)
            return await original(*args, **kwargs)

        return wrapper

    config = make_config(redis_url, prefix, backplane={"enabled": False})
    async with LayeredCache.from_config(config) as cache:
        # Loads the write script: on a Redis that hasn't seen it yet, EVALSHA's NOSCRIPT,
        # the SCRIPT LOAD and the second EVALSHA are three commands, each seen once.
        await cache.set("book", {"id": 0}, "warm-up")
        monkeypatch.setattr(direct, "execute_command", counting(direct.execute_command, "module"))
        held = counting(direct.HeldConnection.execute, "held")
        monkeypatch.setattr(direct.HeldConnection, "execute", held)
        await cache.set("book", {"id": 1}, "v")  # set()'s write script
        cache.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
        assert await cache.get("book", {"id": 1}) == "v"  # the L2 GET
    assert seen == ["module", "module"]


async def test_reads_and_writes_cancelled_at_every_await_never_hand_one_key_the_value_of_another(
    redis_url: str, prefix: str
) -> None:
    """The cache's L2 reads and writes, cancelled after 0, 1, 2, ... loop turns, on
    connections the request path keeps between commands: a reply left unread on a kept
    connection would be read by the next command on it - one key served another key's
    value, across tenants. After every cancellation, each of 8 keys still reads its own
    value, concurrently (so the kept connections are all used), and the breaker stays
    closed (a cancellation is not a Redis failure)."""
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    async with LayeredCache.from_config(config) as cache:
        for i in range(8):
            await cache.set("book", {"id": i}, f"value {i}")
        for turns in range(16):
            for operation in ("get", "set"):
                if operation == "get":
                    call = cache.get("book", {"id": turns % 8})
                else:
                    call = cache.set("book", {"id": turns % 8}, f"value {turns % 8}")
                task = asyncio.create_task(call)
                for _ in range(turns):
                    await asyncio.sleep(0)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                reads = await asyncio.gather(*(cache.get("book", {"id": i}) for i in range(8)))
                assert reads == [f"value {i}" for i in range(8)], (operation, turns)
        assert cache.redis_status().breaker == "closed"


async def test_a_redis_on_a_unix_socket_serves_reads_writes_and_the_backplane() -> None:
    """``redis.url = unix://...`` (a sidecar Redis): the request path's kept connections
    and the listener's held one are redis-py's ``UnixDomainSocketConnection``, whose
    socket reader the library reads too. Reads, writes, an invalidation another
    instance hears, and a restart while the connections sit idle."""
    server = RedisServer(extra_args=["--unixsocketperm", "700"])
    socket = server.dir / "redis.sock"
    server.extra_args += ["--unixsocket", str(socket)]
    with server:
        url = with_protocol(f"unix://{socket}?db=0")
        config = make_config(url, "unix:", {"book": {"key": "book:{id}", "l1": {"ttl": "5m"}}})
        async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
            await a.set("book", {"id": 1}, "first")
            assert await b.get("book", {"id": 1}) == "first"  # b's L1 holds it now
            await a.set("book", {"id": 1}, "second")
            assert await eventually(lambda: _reads(b, "second"), timeout=5)  # b heard it
            server.stop()
            server.start()
            await asyncio.sleep(0.2)  # the closes reach this process
            await a.set("book", {"id": 2}, "after the restart")
            a.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
            assert await a.get("book", {"id": 2}) == "after the restart"
            assert a.stats()["book"]["redis_error"] == 0


async def _reads(cache: LayeredCache, expected: str) -> bool:
    return await cache.get("book", {"id": 1}) == expected


async def test_a_cancelled_mget_leaves_no_partial_reply_in_memory(
    redis_server: RedisServer, prefix: str
) -> None:
    """Found by review: a command cancelled mid-reply dropped its connection but kept
    what its parser had read, until that kept connection next carried a command, which
    a stack of them may never give it. With get_many's MGET on this path, megabytes of
    values stayed pinned. A proxy stops the MGET's reply after 1 MB (a stalled link),
    so the cancel lands mid-reply on any machine, Redis or Valkey."""
    proxy = await ToxicProxy(redis_server.host, redis_server.port).start()
    forwarded, stalled = 0, asyncio.Event()

    def stall_after_1_mb(chunk: bytes) -> bytes:
        nonlocal forwarded
        if stalled.is_set():
            return chunk if chunk.startswith(b"+PONG") else b""  # other connections pass
        forwarded += len(chunk)
        if forwarded > 1_000_000:
            stalled.set()
        return chunk

    admin = redis.Redis.from_url(redis_server.url)
    client = redis.Redis.from_url(proxy.url, socket_timeout=5.0)
    commands = direct.DirectClient(client, 0.0001)
    names = [f"{prefix}big:{i}" for i in range(40)]
    await admin.mset({name: b"v" * 500_000 for name in names})  # a 20 MB reply
    try:
        # Two kept connections, connected before the stall (their handshakes pass).
        ping_twice = [direct.execute_command(commands, "PING") for _ in range(2)]
        assert await asyncio.gather(*ping_twice) == [b"PONG", b"PONG"]
        proxy.rewrite = stall_after_1_mb
        mget = asyncio.create_task(direct.execute_command(commands, "MGET", *names))
        await asyncio.wait_for(stalled.wait(), 5)
        await asyncio.sleep(0.1)  # the client reads what came through
        ping = asyncio.create_task(direct.execute_command(commands, "PING"))
        await asyncio.sleep(0)  # sent; its reply comes back through the proxy later
        mget.cancel()
        with pytest.raises(asyncio.CancelledError):
            await mget
        assert await ping == b"PONG"  # its connection now tops the stack
        for _ in range(20):  # sequential commands take the top of the stack
            assert await direct.execute_command(commands, "PING") == b"PONG"
        held = sum(h._parser.buffered() for h in commands._idle if h._connection is None)
        assert held == 0, f"bytes kept by dropped connections' parsers: {held}"
    finally:
        await commands.close()
        await client.aclose()
        await proxy.stop()
        await admin.delete(*names)
        await admin.aclose()


# -- transactions (set_many's write, a hot key's) -----------------------------------------


async def test_a_transaction_returns_each_commands_reply_and_an_error_in_its_place(
    one_connection: direct.DirectClient, redis_client: redis.Redis, prefix: str
) -> None:
    """An error while EXEC runs (WRONGTYPE) is that command's reply: the commands
    before and after it ran, as Redis's transactions promise."""
    await redis_client.lpush(f"{prefix}list", "x")
    commands = direct.Packed()
    commands.add_set(f"{prefix}a", b"\x00one\r\n", 60_000)
    commands.add(("INCR", f"{prefix}list"))
    commands.add(("GET", f"{prefix}a"))
    first, failed, read = await direct.execute_transaction(one_connection, commands)
    assert (first, read) == (b"OK", b"\x00one\r\n")
    assert isinstance(failed, ResponseError) and "WRONGTYPE" in str(failed)
    assert 0 < await redis_client.pttl(f"{prefix}a") <= 60_000
    assert await direct.execute_command(one_connection, "PING") == b"PONG"


async def test_a_command_refused_while_queued_aborts_the_transaction_and_is_raised(
    one_connection: direct.DirectClient, redis_client: redis.Redis, prefix: str
) -> None:
    """A command Redis refuses to queue (here a wrong arity; on a full noeviction Redis,
    OOM) aborts the whole transaction: nothing ran, its error is raised, and every reply
    was read, so the connection serves the next command."""
    commands = direct.Packed()
    commands.add_set(f"{prefix}a", b"1", 60_000)
    commands.add(("SET", f"{prefix}b"))
    commands.add_set(f"{prefix}c", b"3", 60_000)
    with pytest.raises(ResponseError, match="wrong number of arguments"):
        await direct.execute_transaction(one_connection, commands)
    assert await redis_client.exists(f"{prefix}a", f"{prefix}c") == 0
    assert await direct.execute_command(one_connection, "GET", f"{prefix}a") is None


async def test_a_transaction_of_thousands_of_commands_reads_every_reply(
    one_connection: direct.DirectClient, redis_client: redis.Redis, prefix: str
) -> None:
    """Its replies (a +QUEUED per command, then EXEC's array) span many socket reads."""
    commands = direct.Packed()
    for i in range(5_000):
        commands.add_set(f"{prefix}k:{i}", b"v%d" % i * 50, 60_000)
    replies = await direct.execute_transaction(one_connection, commands)
    assert replies == [b"OK"] * 5_000
    assert await redis_client.get(f"{prefix}k:4999") == b"v4999" * 50
    assert await direct.execute_command(one_connection, "GET", f"{prefix}k:7") == b"v7" * 50


async def test_a_transaction_cancelled_at_every_await_ran_whole_or_not_at_all(
    redis_server: RedisServer, prefix: str
) -> None:
    """Cancelled after 0, 1, 2, ... loop turns and then after growing real delays
    (connecting, sending, waiting for its replies; a loaded machine may still be
    connecting after a dozen turns): its connection is dropped, so no reply of it is
    read as the next command's, and Redis ran either all of it or none of it (a client
    that goes away mid-transaction has it discarded). A Redis of the test's own: the
    test waits until the dropped connection is gone from CLIENT LIST."""
    admin = redis.Redis.from_url(redis_server.url)
    client = redis.Redis.from_url(redis_server.url, max_connections=1, socket_timeout=2.0)
    commands = direct.DirectClient(client)
    await admin.set(f"{prefix}mine", "mine")
    outcomes = set()
    try:
        delays = [0.0] * 12 + [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2]
        for turns, delay in enumerate(delays):
            packed = direct.Packed()
            for i in range(200):
                packed.add_set(f"{prefix}{turns}:{i}", b"x" * 1_000, 60_000)
            task = asyncio.create_task(direct.execute_transaction(commands, packed))
            for _ in range(turns):
                await asyncio.sleep(0)
            await asyncio.sleep(delay)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await task
            assert await eventually(lambda: _no_dropped_connection(admin, client), 5), turns
            written = await admin.exists(*(f"{prefix}{turns}:{i}" for i in range(200)))
            assert written in (0, 200), f"cancelled after {turns} turns, {written} of 200 ran"
            outcomes.add(written)
            assert await direct.execute_command(commands, "GET", f"{prefix}mine") == b"mine"
    finally:
        await commands.close()
        await client.aclose()
        await admin.aclose()
    assert outcomes == {0, 200}, "the cancellations never landed both before and after EXEC"


async def _no_dropped_connection(admin: redis.Redis, client: redis.Redis) -> bool:
    """Redis lists no connection but ``admin``'s and the pool's connected ones: a
    connection dropped in flight is gone, its transaction run or discarded. (A cancel
    while connecting may leave a connected one in the pool, idle.)"""
    pool: Any = client.connection_pool
    pooled = [*pool._available_connections, *pool._in_use_connections]
    connected = sum(1 for c in pooled if c.is_connected)
    return len(await admin.client_list()) == 1 + connected


async def test_a_write_whose_set_fails_as_exec_runs_raises_even_when_its_append_landed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A corner no real server reaches today (a SET overwrites any type, and its PX is
    at least 1): were a SET of set_many's transaction to fail as EXEC ran, the write
    must not pass for landed because the append after it did."""
    failed = ResponseError("ERR invalid expire time in 'set' command")

    async def executed(client: Any, commands: direct.Packed) -> list[Any]:
        return [b"OK", failed, 1, b"1-1"]

    monkeypatch.setattr(direct, "execute_transaction", executed)
    writes = [(["a", "b"], ["{a}:lease", "{b}:lease"], b"v", 1_000)]
    announcement = Announcement("stream", 1000, [b"keys", b"x"])
    with pytest.raises(ResponseError, match="invalid expire"):
        await run_transaction(cast(Any, None), writes, announcement)
    refused = ResponseError("WRONGTYPE Operation against a key holding the wrong kind")

    async def append_refused(client: Any, commands: direct.Packed) -> list[Any]:
        return [b"OK", b"OK", 2, refused]

    monkeypatch.setattr(direct, "execute_transaction", append_refused)
    assert await run_transaction(cast(Any, None), writes, announcement) is Append.REFUSED

    async def append_published(client: Any, commands: direct.Packed) -> list[Any]:
        return [b"OK", b"OK", 2, [b"WRONGTYPE Operation against a key"]]  # APPEND_SCRIPT's

    monkeypatch.setattr(direct, "execute_transaction", append_published)
    assert await run_transaction(cast(Any, None), writes, announcement) is Append.PUBLISHED


@pytest.mark.parametrize("busy_poll", [0.0001, None], ids=["request-path", "listener"])
async def test_a_kept_connection_whose_redis_restarted_before_the_loop_noticed_is_replaced(
    redis_server: RedisServer, busy_poll: float | None
) -> None:
    """A kept connection is checked before each command, but the check read what the
    event loop had taken in: a Redis restarted while nothing awaited (a busy loop, or
    this test's blocking restart) left its FIN unread, and the next command went out on
    the dead connection and failed. An idle kept connection with anything to read (its
    server's FIN or RST: no reply is pending) is replaced before the command: unseen on
    the request path; the backplane listener's raises ConnectionError instead (it must
    check the stream for a gap: a relay closes its clients for that), and its next
    command goes out on a new connection."""
    client = redis.Redis.from_url(with_protocol(redis_server.url), socket_timeout=2.0)
    if busy_poll is None:
        held = direct.HeldConnection(client, quiet_reconnect=False)  # the listener's kind
        run = held.execute
    else:
        commands = direct.DirectClient(client, busy_poll)
        run = functools.partial(direct.execute_command, commands)
    try:
        assert await run("SET", "k", "before") == b"OK"
        redis_server.stop()  # blocking: the loop runs nothing until the PING below
        redis_server.start()
        if busy_poll is None:
            with pytest.raises(redis.ConnectionError, match="closed by server while idle"):
                await run("PING")
        assert await run("PING") == b"PONG"
        assert await run("GET", "k") in (b"before", None)  # whatever the restart kept
    finally:
        await (held.close() if busy_poll is None else commands.close())
        await client.aclose()
