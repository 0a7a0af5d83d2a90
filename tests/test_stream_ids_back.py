"""A backplane stream whose IDs go back: deleted (evicted under ``allkeys-*``, FLUSHALL,
a Redis restarted empty) and created anew while Redis's clock was behind where it had
been, or an entry forged with a future ID. A reader positioned after the old IDs waited
for IDs that never came: connected, no gap, no lag, and every invalidation lost until
the clock caught up. Each scenario here failed before the fix (adversarial review,
2026-12-04); a reader must hear the next invalidation or clear its L1.
"""

from __future__ import annotations

import contextlib
import re
import time
import types
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import redis.asyncio as redis

import layered_cache._backplane as backplane_module
import layered_cache._relay as relay_module
from layered_cache import LayeredCache
from layered_cache._redisclock import RedisClock
from layered_cache._relay import Relay
from layered_cache._relay_upstream import Upstream
from tests.faults.proxy import ToxicProxy
from tests.helpers import eventually, in_l1, make_config, start_relay
from tests.servers import RedisServer

NAMESPACES = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}
AHEAD = 30.0  # a host's clock against Redis's (Redis runs on another host)


async def version(value: str) -> str:
    return value


@contextlib.asynccontextmanager
async def writer_and_reader(
    url: str, prefix: str, through_relay: bool
) -> AsyncIterator[tuple[LayeredCache, LayeredCache, redis.Redis, str]]:
    base = make_config(url, prefix, NAMESPACES, backplane={"block": "200ms"})
    reader_config, relay = base, None
    if through_relay:
        relay, relay_url = await start_relay(base)
        reader_config = make_config(
            url, prefix, NAMESPACES, backplane={"block": "200ms", "relay": relay_url}
        )
    admin = redis.Redis.from_url(url)
    try:
        async with (
            LayeredCache.from_config(base) as writer,
            LayeredCache.from_config(reader_config) as reader,
        ):
            yield writer, reader, admin, prefix + base.backplane.stream
    finally:
        if relay is not None:
            await relay.close()
        await admin.aclose()


async def _future_entry(admin: redis.Redis, stream: str, reader: LayeredCache) -> None:
    """An entry an hour ahead (Redis's clock was), read by ``reader``."""
    future = f"{int(time.time() * 1000) + 3_600_000}-0"
    await admin.xadd(stream, {"origin": "-"}, id=future)
    assert await eventually(lambda: reader.backplane_status().last_id == future)  # type: ignore[union-attr]


@pytest.mark.parametrize("through_relay", [False, True], ids=["direct", "relay"])
async def test_a_connected_reader_hears_a_stream_created_anew_with_lower_ids(
    redis_server: RedisServer, prefix: str, through_relay: bool
) -> None:
    async with writer_and_reader(redis_server.url, prefix, through_relay) as (
        writer, reader, admin, stream,
    ):
        assert await reader.get_or_load("book", {"id": 1}, lambda: version("v1")) == "v1"
        await _future_entry(admin, stream, reader)
        await admin.delete(stream)  # evicted; the clock is right again
        await writer.set("book", {"id": 1}, "v2")  # creates it anew: IDs below the old
        assert await eventually(lambda: _reads(reader, "v2"), timeout=5)
        await writer.set("book", {"id": 1}, "v3")  # and it keeps listening
        assert await eventually(lambda: _reads(reader, "v3"), timeout=5)


async def test_a_reader_that_reconnects_to_a_stream_whose_ids_went_back_follows_it(
    redis_server: RedisServer, prefix: str
) -> None:
    async with writer_and_reader(redis_server.url, prefix, False) as (
        writer, reader, admin, stream,
    ):
        await _future_entry(admin, stream, reader)
        await admin.delete(stream)
        await writer.set("book", {"id": 9}, "x")
        for client in await admin.client_list():
            if client["cmd"] == "xread":
                await admin.client_kill_filter(_id=client["id"])
        assert await eventually(lambda: reader.backplane_status().gaps >= 1)  # type: ignore[union-attr]
        assert await reader.get_or_load("book", {"id": 1}, lambda: version("v2")) == "v2"
        await writer.set("book", {"id": 1}, "v3")  # the clear was not the end of it
        assert await eventually(lambda: _reads(reader, "v3"), timeout=5)


def host_ahead() -> float:
    """The wall clock of a host AHEAD of Redis's, within what docs/operations.md,
    "Clocks", says instances correct for."""
    return time.time() + AHEAD


async def _entry_ahead_of_redis(admin: redis.Redis, stream: str) -> str:
    """An entry 20 s ahead: Redis's clock was, and stepped back. On a host 30 s ahead it
    is behind the host's clock, so only Redis's time shows the position is ahead."""
    ahead = f"{int(time.time() * 1000) + 20_000}-0"
    await admin.xadd(stream, {"origin": "-"}, id=ahead)
    return ahead


async def test_a_reader_on_a_host_ahead_of_redis_hears_a_stream_whose_ids_went_back(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listener judged its position against the host's raw clock: on a host 30 s
    ahead, a position up to 40 s ahead of Redis passed for current, and the reader stayed
    deaf (connected, no gap) while it served the old value from L1 for ~20 s."""
    # The host's clock, for the cache (``clock=``) and for the listener module.
    skewed = types.SimpleNamespace(time=host_ahead, monotonic=time.monotonic)
    monkeypatch.setattr(backplane_module, "time", skewed)
    config = make_config(redis_server.url, prefix, NAMESPACES, backplane={"block": "200ms"})
    stream = prefix + config.backplane.stream
    admin = redis.Redis.from_url(redis_server.url)
    try:
        async with (
            LayeredCache.from_config(config, clock=host_ahead) as writer,
            LayeredCache.from_config(config, clock=host_ahead) as reader,
        ):
            assert reader._backplane is not None
            assert await eventually(reader._backplane.connected.is_set)
            await writer.set("book", {"id": 1}, "v1")
            assert await reader.get_or_load("book", {"id": 1}, lambda: version("x")) == "v1"
            assert in_l1(reader, 1)
            ahead = await _entry_ahead_of_redis(admin, stream)
            assert await eventually(lambda: reader.backplane_status().last_id == ahead)  # type: ignore[union-attr]
            await admin.delete(stream)  # evicted; appends create it anew, IDs below the old
            await writer.set("book", {"id": 1}, "v2")
            assert await eventually(lambda: _reads(reader, "v2"), timeout=8)
    finally:
        await admin.aclose()


async def test_a_relay_on_a_host_ahead_of_redis_follows_a_stream_whose_ids_went_back(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay too judged its position against the host's raw clock, and its readers
    then waited on it. It runs as a process of its own, so it measures Redis's time over
    its upstream (``cli/relay.py``; behind another relay, through it: relays forward
    ``TIME``) and judges its position against that."""
    skewed = types.SimpleNamespace(time=host_ahead, monotonic=time.monotonic)
    monkeypatch.setattr(relay_module, "time", skewed)  # the host's clock, as the relay reads it
    config = make_config(redis_server.url, prefix, NAMESPACES, backplane={"block": "200ms"})
    stream = prefix + config.backplane.stream
    admin = redis.Redis.from_url(redis_server.url)
    await admin.xadd(stream, {"origin": "-"})
    upstream = Upstream(config.redis, stream, 0.2)
    clock = RedisClock(host_ahead, upstream.time)
    relay = Relay(upstream, stream, clock=clock.now, block=0.2)
    try:
        await clock.start()
        assert clock.synced and abs(clock.offset + AHEAD) < 1
        await relay.start()
        assert await eventually(lambda: relay.status().following)
        ahead = await _entry_ahead_of_redis(admin, stream)
        assert await eventually(lambda: relay.status().last_id == ahead)
        await admin.delete(stream)  # evicted; appends create it anew, IDs below the old
        new = (await admin.xadd(stream, {"origin": "-"})).decode()
        assert await eventually(lambda: relay.status().last_id == new, timeout=8), relay.status()
    finally:
        await clock.stop()
        await relay.close()
        await admin.aclose()


@pytest.mark.parametrize(
    "raw", [msgspec.json.encode(["k"]), msgspec.msgpack.encode([["k", 2]]), b"\xc1"]
)
async def test_an_entry_whose_keys_cannot_be_decoded_clears_l1(
    redis_url: str, prefix: str, raw: bytes
) -> None:
    """Another version's format, or a forged entry: the invalidations it names can't be
    applied one by one, so L1 goes whole rather than keep what they named."""
    async with writer_and_reader(redis_url, prefix, False) as (_writer, reader, admin, stream):
        assert await reader.get_or_load("book", {"id": 1}, lambda: version("v1")) == "v1"
        await admin.xadd(stream, {"keys": raw})
        assert await eventually(lambda: reader.backplane_status().gaps == 1)  # type: ignore[union-attr]
        assert not in_l1(reader, 1)


async def test_the_relay_forwards_no_xadd_but_the_listeners_start_marker(
    redis_url: str, prefix: str
) -> None:
    """Anything that reaches a relay's port could trim the stream (``MAXLEN 0``), move
    its IDs an hour ahead or forge entries, with the relay's Redis credentials."""
    base = make_config(redis_url, prefix, NAMESPACES, backplane={"block": "200ms"})
    stream = prefix + base.backplane.stream
    admin = redis.Redis.from_url(redis_url)
    for _ in range(5):
        await admin.xadd(stream, {"origin": "-"})
    relay, relay_url = await start_relay(base)
    through = redis.Redis.from_url(relay_url, protocol=2)
    try:
        future = f"{int(time.time() * 1000) + 3_600_000}-0"
        for command in (
            ("XADD", stream, "MAXLEN", "0", "*", "a", "b"),
            ("XADD", stream, future, "origin", "x"),
            ("XADD", stream, "*", "keys", msgspec.msgpack.encode(["k"])),
        ):
            with pytest.raises(redis.ResponseError, match="forwards only XADD"):
                await through.execute_command(*command)
        assert await admin.xlen(stream) == 5
        marker: Any = await through.execute_command("XADD", stream, "*", "origin", "x")
        assert marker and await admin.xlen(stream) == 6
    finally:
        await through.aclose()
        await relay.close()
        await admin.aclose()


async def _reads(cache: LayeredCache, expected: str) -> bool:
    return bool(await cache.get("book", {"id": 1}) == expected)


STEPPED = 20  # seconds Redis's clock was ahead of true time before it stepped back

_TIME_REPLY = re.compile(rb"\*2\r\n\$10\r\n(\d{10})\r\n\$(\d)\r\n(\d+)\r\n")


def _redis_clock_ahead(state: dict[str, bool]) -> Any:
    """A proxy rewrite: TIME replies read STEPPED s later while ``state['ahead']``."""

    def rewrite(data: bytes) -> bytes:
        if not state["ahead"]:
            return data
        return _TIME_REPLY.sub(
            lambda m: b"*2\r\n$10\r\n%d\r\n$%s\r\n%s\r\n"
            % (int(m.group(1)) + STEPPED, m.group(2), m.group(3)),
            data,
        )

    return rewrite


async def _reads_now(cache: LayeredCache, value: str) -> bool:
    async def other() -> str:
        return "loaded"

    return await cache.get_or_load("book", {"id": 1}, other) == value


async def test_a_reader_on_a_right_host_hears_a_stream_created_anew_after_redis_clock_stepped_back(
    redis_server: RedisServer, prefix: str
) -> None:
    """Found by a review of this session's fix (2026-12-06): judged against its Redis
    clock alone, a reader on a host with the right time, whose clock sampled Redis 20 s
    ahead just before Redis's clock stepped back, took the stream created anew (lower
    IDs) for current until its next sample (30 s), serving v1 from L1. Now it judges
    against the earlier of the two clocks."""
    state = {"ahead": True}
    proxy = await ToxicProxy("127.0.0.1", redis_server.port).start()
    proxy.rewrite = _redis_clock_ahead(state)
    base = make_config(redis_server.url, prefix, NAMESPACES, backplane={"block": "200ms"})
    via_proxy = make_config(proxy.url, prefix, NAMESPACES, backplane={"block": "200ms"})
    stream = prefix + base.backplane.stream
    admin = redis.Redis.from_url(redis_server.url)
    try:
        async with (
            LayeredCache.from_config(base) as writer,
            LayeredCache.from_config(via_proxy) as reader,
        ):
            assert reader._backplane is not None
            assert await eventually(reader._backplane.connected.is_set)
            await writer.set("book", {"id": 1}, "v1")
            assert await eventually(lambda: reader.backplane_status().entries_applied >= 1)  # type: ignore[union-attr]
            assert await _reads_now(reader, "v1")
            assert in_l1(reader, 1)
            # Redis's clock, STEPPED s ahead, stamped the stream's newest entry.
            ahead = f"{int(time.time() * 1000) + STEPPED * 1000}-0"
            await admin.xadd(stream, {"origin": "-"}, id=ahead)
            assert await eventually(lambda: reader.backplane_status().last_id == ahead)  # type: ignore[union-attr]
            # Redis's clock steps back to true time; the stream is evicted and created anew.
            state["ahead"] = False
            await admin.delete(stream)
            started = time.monotonic()
            await writer.set("book", {"id": 1}, "v2")
            heard = await eventually(lambda: _reads_now(reader, "v2"), timeout=8)
            assert heard, (
                f"the reader still served v1 from L1 {time.monotonic() - started:.1f} s after "
                f"the stream was created anew (its position {STEPPED} s ahead of true time)"
            )
    finally:
        await admin.aclose()
        await proxy.stop()


async def test_a_relay_on_a_right_host_follows_a_stream_created_anew_after_redis_clock_stepped_back(
    redis_server: RedisServer, prefix: str
) -> None:
    """The relay CLI's wiring: RedisClock(time.time, upstream.time), over a Redis whose
    clock was STEPPED s ahead when sampled, then stepped back."""
    state = {"ahead": True}
    proxy = await ToxicProxy("127.0.0.1", redis_server.port).start()
    proxy.rewrite = _redis_clock_ahead(state)
    config = make_config(proxy.url, prefix, NAMESPACES, backplane={"block": "200ms"})
    stream = prefix + config.backplane.stream
    admin = redis.Redis.from_url(redis_server.url)
    await admin.xadd(stream, {"origin": "-"})
    upstream = Upstream(config.redis, stream, 0.2)
    clock = RedisClock(time.time, upstream.time)
    relay = Relay(upstream, stream, clock=clock.now, block=0.2)
    try:
        await clock.start()
        assert clock.synced and abs(clock.offset - STEPPED) < 1  # measured Redis ahead
        await relay.start()
        assert await eventually(lambda: relay.status().following)
        ahead = f"{int(time.time() * 1000) + STEPPED * 1000}-0"
        await admin.xadd(stream, {"origin": "-"}, id=ahead)
        assert await eventually(lambda: relay.status().last_id == ahead)
        state["ahead"] = False  # Redis's clock steps back
        await admin.delete(stream)  # evicted; appends create it anew, IDs below the old
        new = (await admin.xadd(stream, {"origin": "-"})).decode()
        assert await eventually(lambda: relay.status().last_id == new, timeout=8), relay.status()
    finally:
        await clock.stop()
        await relay.close()
        await admin.aclose()
        await proxy.stop()
