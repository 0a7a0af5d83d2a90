"""The relay against clients that don't play by the listener's rules, and the listener's
own failures around a relay reset (found by a review; each failed before its fix)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as redis
from redis.exceptions import ResponseError

from layered_cache import ConfigError, LayeredCache, parse_config
from layered_cache._relay import Relay
from layered_cache._relay_upstream import Upstream
from tests.helpers import eventually, in_l1, make_config, stall_listener, start_relay
from tests.servers import RedisServer

pytestmark = pytest.mark.timeout(60)

BLOCK = "200ms"


async def _value(value: str) -> str:
    return value


async def test_a_relay_reset_while_a_listener_counts_entries_still_makes_it_check_for_a_gap(
    redis_server: RedisServer, prefix: str
) -> None:
    """B's entry count (``EntryCount``: an XINFO after a read) was on its way when Redis
    restarted empty and the relay reset, closing B's connection. The count swallowed the
    ConnectionError, B's next read went out on a fresh connection with no gap check, and
    B's L1 kept book 1, invalidated before the restart, for its whole TTL."""
    base = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    relay, relay_url = await start_relay(base)
    reader_config = make_config(
        redis_server.url, prefix, backplane={"block": BLOCK, "relay": relay_url}
    )
    forward = relay._forward
    xinfo_armed, xinfo_held, xinfo_release = False, asyncio.Event(), asyncio.Event()

    async def gated_forward(command: Any) -> bytes:
        nonlocal xinfo_armed
        if xinfo_armed and command[0].upper() == b"XINFO":
            xinfo_armed = False
            xinfo_held.set()
            await xinfo_release.wait()
        return await forward(command)

    relay._forward = gated_forward  # type: ignore[method-assign]
    try:
        async with (
            LayeredCache.from_config(base) as writer,
            LayeredCache.from_config(reader_config) as reader,
        ):
            listener = reader._backplane
            assert listener is not None
            assert await eventually(listener.connected.is_set)
            assert await reader.get_or_load("book", {"id": 1}, lambda: _value("v1")) == "v1"
            assert in_l1(reader, 1)

            xinfo_armed = True
            await writer.invalidate("book", {"id": 99})  # B reads it, then counts (XINFO)
            assert await asyncio.wait_for(xinfo_held.wait(), 5)
            gate = stall_listener(reader)  # B's loop is busy for a moment after this

            await writer.invalidate("book", {"id": 1})  # returned: L2 gone, entry appended
            redis_server.kill()  # Redis restarts empty: the relay loses it, resets
            redis_server.start()
            assert await eventually(lambda: relay.status().resets >= 1, timeout=10)
            xinfo_release.set()
            assert await eventually(lambda: relay.status().following, timeout=10)

            gate.set()  # B reads on
            await asyncio.sleep(1.5)  # several idle reads (block 200 ms)
            status = reader.backplane_status()
            assert status is not None
            assert not in_l1(reader, 1), (
                f"B still holds book 1's value invalidated before Redis restarted "
                f"(connected={status.connected}, gaps={status.gaps}, "
                f"relay resets={relay.status().resets})"
            )
    finally:
        await relay.close()


async def test_a_relay_port_hands_out_at_most_its_batch_and_only_the_listeners_commands(
    redis_server: RedisServer, prefix: str
) -> None:
    """A read older than the relay's memory was forwarded with the client's own COUNT,
    and XRANGE or XINFO FULL as they came: any client of the port had the relay parse
    and re-encode the whole stream (up to ``maxlen`` entries) per request."""
    config = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    stream = config.redis.prefix + config.backplane.stream
    direct = redis.Redis.from_url(redis_server.url, protocol=2)
    await direct.xadd(stream, {"origin": "-"})
    relay = Relay(
        Upstream(config.redis, stream, 0.2), stream, clock=time.time, block=0.2, batch=5, keep=5
    )
    host, port = await relay.start("127.0.0.1", 0)
    through = redis.Redis.from_url(f"redis://{host}:{port}/0", protocol=2)
    try:
        assert await eventually(lambda: relay.status().following)
        ids = [await direct.xadd(stream, {"keys": f"k{i}"}) for i in range(40)]
        assert await eventually(lambda: relay.status().last_id == ids[-1].decode())
        (forwarded,) = await through.xread({stream: "0-0"}, count=1000)
        assert len(forwarded[1]) == 5
        for command in (
            ("XRANGE", stream, "-", "+"),
            ("XREVRANGE", stream, "+", "-"),
            ("XREVRANGE", stream, "+", "-", "COUNT", 1000),
            ("XINFO", "STREAM", stream, "FULL"),
        ):
            with pytest.raises(ResponseError, match=r"forwards only|serves XREAD"):
                await through.execute_command(*command)
        # The listener's own commands still go through.
        newest = await through.execute_command("XREVRANGE", stream, "+", "-", "COUNT", 1)
        assert newest[0][0] == ids[-1]
        assert await through.execute_command("XINFO", "STREAM", stream)
    finally:
        await through.aclose()
        await relay.close()
        await direct.aclose()


@pytest.mark.parametrize(
    ("query", "refused"),
    [
        ("?protocol=3", "takes no options"),
        ("?username=u", "takes no options"),
        ("?password=secret", "takes no options"),
        ("", None),
        ("?db=0", None),
    ],
)
def test_a_relay_url_with_options_or_credentials_is_refused_at_load(
    query: str, refused: str | None
) -> None:
    """redis-py lets a URL's query win over the client's settings: ``?protocol=3`` sent
    HELLO 3 and a password AUTH at each connect, both refused by the relay, and the
    listener never connected while the cache started and served."""
    raw = {"backplane": {"relay": f"redis://127.0.0.1:6390{query}"}}
    if refused is None:
        assert parse_config(raw, env={}).backplane.relay.endswith(f"6390{query}")
        return
    with pytest.raises(ConfigError, match=rf"backplane\.relay: .*{refused}"):
        parse_config(raw, env={})
    with pytest.raises(ConfigError, match="no credentials"):
        parse_config({"backplane": {"relay": "redis://u:Hunter2Secret@h:1"}}, env={})


async def _command_calls(url: str, *names: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in names)


async def test_behind_a_relay_redis_answers_the_instances_entry_counts_once_per_relay(
    redis_server: RedisServer, prefix: str
) -> None:
    """Each listener counts entries against ``XINFO STREAM`` (``EntryCount``, up to 4 a
    second while entries flow), and the relay forwarded every one: 20 instances, 8
    entries in 2.4 s, and Redis answered ~150 XINFOs against ~12 XREADs of the relay,
    growing with the instances behind it. The relay now shares one answer
    (``_relay_info``): Redis sees one reader per relay again."""
    base = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    relay, relay_url = await start_relay(base)
    reader_config = make_config(
        redis_server.url, prefix, backplane={"block": BLOCK, "relay": relay_url}
    )
    readers = [LayeredCache.from_config(reader_config) for _ in range(20)]
    try:
        async with LayeredCache.from_config(base) as writer:
            for reader in readers:
                await reader.start()
            for reader in readers:
                assert await eventually(reader._backplane.connected.is_set)  # type: ignore[union-attr]
            await asyncio.sleep(0.5)
            xinfo_before = await _command_calls(redis_server.url, "xinfo|stream", "xinfo")
            xread_before = await _command_calls(redis_server.url, "xread")
            for book in range(8):
                await writer.invalidate("book", {"id": 1000 + book})
                await asyncio.sleep(0.3)
            xinfo = await _command_calls(redis_server.url, "xinfo|stream", "xinfo") - xinfo_before
            xread = await _command_calls(redis_server.url, "xread") - xread_before
            # One relay: a reader's worth of stream reads on Redis (its XREADs, plus at
            # most a check of its own per read), not one per instance.
            assert xinfo <= xread + 8, (
                f"Redis answered {xinfo} XINFO STREAM (from 20 instances behind one relay) "
                f"and {xread} XREAD in 2.4 s of 8 entries"
            )
    finally:
        for reader in readers:
            await reader.close()
        await relay.close()


async def test_an_instance_whose_first_count_through_a_relay_is_older_than_its_position_still_sees_a_loss(
    redis_server: RedisServer, prefix: str
) -> None:
    """Was broken (a review, 2026-12-07): README, "The L1 bound": a listener that stayed
    connected but stalled while entries it had not read were lost clears L1 at the
    first count after the loss, also behind a relay.

    A new instance takes its position (XREVRANGE, forwarded) and its count's first mark
    (XINFO STREAM, which the relay answers with one it keeps up to 0.25 s): kept from
    before the newest entry, the reply's last ID was not the position, so no mark was
    taken, and none until a count after an entry was read. Idle, then stalled until the
    relay held no more its position (``keep``: its reads forwarded to Redis) while its
    first unread entry was emptied away, the instance took its first mark after the
    loss. Observed: book 1 served as v1 from B's L1 after A set v2. Expected: L1
    cleared. Cause: ``EntryCount.start`` asked once; ``settle`` asks again."""
    namespaces = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}
    base = make_config(redis_server.url, prefix, namespaces, backplane={"block": BLOCK})
    relay, relay_url = await start_relay(base, keep=1)  # the relay holds 1 to 2 entries
    reader_config = make_config(
        redis_server.url, prefix, namespaces, backplane={"block": BLOCK, "relay": relay_url}
    )
    stream = (prefix + base.backplane.stream).encode()
    forward = relay._forward
    try:
        async with LayeredCache.from_config(base) as writer:
            older = await forward([b"XINFO", b"STREAM", stream])
            await writer.invalidate("book", {"id": 99})  # the newest entry, past ``older``
            kept = [older]

            async def kept_first(command: Any) -> bytes:
                if command[0].upper() == b"XINFO" and kept:
                    return kept.pop()  # the relay's kept reply, from before that entry
                return await forward(command)

            relay._forward = kept_first  # type: ignore[method-assign]
            async with LayeredCache.from_config(reader_config) as reader:
                listener = reader._backplane
                assert listener is not None
                assert await eventually(listener.connected.is_set)
                assert not kept
                await asyncio.sleep(0.6)  # B reads on, idle
                gate = stall_listener(reader)
                await asyncio.sleep(0.3)  # B is held at its next XREAD
                assert await reader.get_or_load("book", {"id": 1}, lambda: _value("v1")) == "v1"
                await writer.set("book", {"id": 1}, "v2")
                await writer._store.client.xtrim(stream, maxlen=0, approximate=False)
                for book in (2, 4, 5):  # entries flow again: B's position leaves the relay
                    await writer.set("book", {"id": book}, "x")
                gate.set()
                await asyncio.sleep(1.0)
                await writer.set("book", {"id": 3}, "y")  # more entries, more counts
                await asyncio.sleep(1.0)
                served = await reader.get("book", {"id": 1})
                assert served == "v2" or not in_l1(reader, 1), (
                    f"B serves book 1 = {served!r} from L1 though A set v2 and its entry "
                    f"was emptied unread while B stalled (gaps={listener.gaps})"
                )
    finally:
        await relay.close()


async def test_xread_dollar_through_a_lagging_relay_answers_only_entries_after_the_call(
    redis_server: RedisServer, prefix: str
) -> None:
    """docs/operations.md, "Fan-out: the backplane relay": "the relay answers 'the
    entries after ID X' exactly as Redis would, or closes the connection".

    The relay's follower is held between two of its upstream XREADs (a relay a few ms
    behind Redis, as any reader is). An entry E is appended to Redis; then a client asks,
    through the relay and from Redis, ``XREAD BLOCK 1500 STREAMS <stream> $`` (what an
    operator types in redis-cli to watch the stream). The follower goes on; nothing else
    is appended. Redis answers nothing (E is older than the call); the relay answered
    [E]: ``Relay._xread`` resolved ``$`` to the newest entry it had read itself, not the
    stream's. It now asks Redis for the newest ID once the command is in. An entry
    appended after such a call is served, as from Redis.
    """
    config = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    stream = config.redis.prefix + config.backplane.stream
    direct = redis.Redis.from_url(redis_server.url, protocol=2)
    await direct.xadd(stream, {"origin": "-"})
    relay, relay_url = await start_relay(config)
    through = redis.Redis.from_url(relay_url, protocol=2)
    gate, parked = asyncio.Event(), asyncio.Event()
    upstream = relay._upstream
    original = upstream.execute

    async def gated(*args: Any) -> Any:
        task = asyncio.current_task()
        if args[0] == "XREAD" and task is not None and task.get_name() == "layered_cache._relay":
            parked.set()
            await gate.wait()
        return await original(*args)

    try:
        upstream.execute = gated  # type: ignore[method-assign]
        await asyncio.wait_for(parked.wait(), 5)  # the follower waits before its next read
        entry = await direct.xadd(stream, {"keys": "k1"})
        via_relay = asyncio.ensure_future(through.xread({stream: "$"}, block=1500))
        via_redis = asyncio.ensure_future(direct.xread({stream: "$"}, block=1500))
        await asyncio.sleep(0.2)  # both calls are in (the relay's resolved "$")
        gate.set()
        expected, got = await via_redis, await via_relay
        assert expected == []  # Redis: nothing after the call
        assert got == expected, f"relay answered {got!r}; E={entry!r} predates the call"

        waiting = asyncio.ensure_future(through.xread({stream: "$"}, block=3000))
        await asyncio.sleep(0.2)  # the call is in
        later = await direct.xadd(stream, {"keys": "k2"})
        ((name, entries),) = await waiting
        assert (name, [entry_id for entry_id, _ in entries]) == (stream.encode(), [later])
    finally:
        gate.set()
        await through.aclose()
        await direct.aclose()
        await relay.close()


async def test_xread_dollar_through_the_relay_after_the_newest_entry_was_deleted(
    redis_server: RedisServer, prefix: str
) -> None:
    """docs/operations.md, "Fan-out: the backplane relay": "the relay answers 'the
    entries after ID X' exactly as Redis would, or closes the connection"; "`$` ... is
    the stream's newest ID when the command arrived, as in Redis".
    Scenario: entries E1, E2, E3 appended; the relay has followed them (caught up).
    Then the newest entry is removed in Redis (an operator's ``XDEL`` of E3); nothing
    else is appended. A client asks Redis and the relay
    ``XREAD BLOCK 500 STREAMS <stream> $``.
    Expected: as Redis, nothing (``$`` is the stream's last generated ID, E3: no entry
    after it is appended).
    Happened: the relay answered [E3], which predates the call and which Redis no
    longer holds. Cause: ``_relay._newest`` resolved ``$`` by ``XREVRANGE + - COUNT 1``
    - the newest entry *still in* the stream, not Redis's ``$`` (the stream's
    last-generated-id, ``XINFO STREAM``) - and the relay then served from its own memory
    the entries after that. It now asks Redis for the last-generated-id."""
    config = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    stream = config.redis.prefix + config.backplane.stream
    direct = redis.Redis.from_url(redis_server.url, protocol=2)
    await direct.xadd(stream, {"origin": "-"})
    relay, relay_url = await start_relay(config)
    through = redis.Redis.from_url(relay_url, protocol=2)
    try:
        ids = [await direct.xadd(stream, {"keys": f"k{i}"}) for i in range(3)]
        # The relay has read them all (it is caught up).
        assert await eventually(
            lambda: _relay_has(through, stream, ids[-1]), timeout=5
        ), "relay never caught up"
        await direct.xdel(stream, ids[-1])
        via_redis = asyncio.ensure_future(direct.xread({stream: "$"}, block=500))
        via_relay = asyncio.ensure_future(through.xread({stream: "$"}, block=500))
        expected, got = await via_redis, await via_relay
        assert expected == []
        assert got == expected, f"relay answered {got!r} for $ (Redis: nothing)"
    finally:
        await through.aclose()
        await direct.aclose()
        await relay.close()


async def _relay_has(client: redis.Redis, stream: str, entry: bytes) -> bool:
    """Whether an XREAD from just before ``entry`` through the relay returns it."""
    ms, seq = entry.decode().split("-")
    before = f"{ms}-{int(seq) - 1}" if int(seq) > 0 else f"{int(ms) - 1}-18446744073709551615"
    reply = await client.xread({stream: before}, count=1)
    return bool(reply) and reply[0][1][0][0] == entry
