"""Redis breaks on purpose: killed under load, slow, black-holed. Callers never see it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis

from layered_cache import Config, LayeredCache
from tests.faults.proxy import ToxicProxy
from tests.helpers import CountingLoader, eventually, make_config
from tests.servers import RedisServer


@pytest.fixture
async def proxy(redis_server: RedisServer) -> AsyncIterator[ToxicProxy]:
    toxic = await ToxicProxy("127.0.0.1", redis_server.port).start()
    yield toxic
    await toxic.stop()


async def test_redis_killed_under_load_causes_no_caller_errors(
    redis_server: RedisServer, prefix: str
) -> None:
    """50 concurrent readers for ~10 s; Redis is killed at 3 s and restarted at 6 s."""
    config = make_config(
        redis_server.url,
        prefix,
        {
            "book": {
                "key": "book:{id}",
                "l1": {"ttl": "500ms"},
                "l2": {"ttl": "2s"},
                "stale": {"max_age": "10s"},
            }
        },
        backplane={"block": "200ms"},
    )
    loader = CountingLoader("db", delay=0.005)
    errors: list[BaseException] = []
    reads = 0
    async with LayeredCache.from_config(config) as cache:
        stop_at = time.monotonic() + 10

        async def reader(n: int) -> None:
            nonlocal reads
            while time.monotonic() < stop_at:
                try:
                    assert await cache.get_or_load("book", {"id": n % 10}, loader) == "db"
                    reads += 1
                except BaseException as exc:  # the test counts every kind of failure
                    errors.append(exc)
                await asyncio.sleep(0.005)

        async def chaos() -> None:
            await asyncio.sleep(3)
            redis_server.kill()
            opened = await eventually(lambda: cache.redis_status().breaker != "closed", timeout=2)
            assert opened, "breaker did not open within its window"
            await asyncio.sleep(3)
            redis_server.start()

        await asyncio.gather(chaos(), *(reader(n) for n in range(50)))
        assert await eventually(lambda: cache.redis_status().breaker == "closed", timeout=5)
        # L2 fills again after the restart, and the backplane is reading again.
        await cache.invalidate("book", {"id": 500})
        await cache.get_or_load("book", {"id": 500}, loader)
        assert cache._backplane is not None
        assert await eventually(cache._backplane.connected.is_set, timeout=5)
        stats = cache.stats()["book"]
    admin = redis.Redis.from_url(redis_server.url)
    assert await admin.exists(f"{prefix}book:500") == 1
    await admin.aclose()
    assert errors == []
    assert reads > 1000
    assert stats["redis_error"] > 0


def _behind_proxy(proxy: ToxicProxy, prefix: str) -> Config:
    """L2 only, through the proxy: 100 ms timeouts, a breaker that stays open 5 s."""
    return make_config(
        proxy.url,
        prefix,
        {"book": {"key": "book:{id}", "l1": False}},
        redis={
            "timeout": "100ms",
            "connect_timeout": "100ms",
            "breaker": {"failures": 3, "reset": "5s"},
        },
        backplane={"enabled": False},
    )


async def test_slow_redis_latency_is_bounded_by_the_timeout(proxy: ToxicProxy, prefix: str) -> None:
    config = _behind_proxy(proxy, prefix)
    loader = CountingLoader("db", delay=0.01)
    async with LayeredCache.from_config(config) as cache:
        await cache.get_or_load("book", {"id": 1}, loader)  # warm the connection
        proxy.mode, proxy.latency = "latency", 0.5
        latencies = []
        for i in range(20):
            started = time.monotonic()
            assert await cache.get_or_load("book", {"id": 100 + i}, loader) == "db"
            latencies.append(time.monotonic() - started)
        assert cache.redis_status().breaker == "open"
    # Each request pays at most one timeout (100 ms) + the loader, never Redis' 500 ms;
    # once the breaker is open, requests skip Redis altogether.
    assert max(latencies) < 0.4
    assert sorted(latencies)[len(latencies) // 2] < 0.05


async def test_black_holed_redis_latency_is_bounded_by_the_timeout(
    proxy: ToxicProxy, prefix: str
) -> None:
    config = _behind_proxy(proxy, prefix)
    proxy.mode = "blackhole"  # connects succeed, nothing ever answers
    loader = CountingLoader("db")
    async with LayeredCache.from_config(config) as cache:
        latencies = []
        for i in range(20):
            started = time.monotonic()
            assert await cache.get_or_load("book", {"id": i}, loader) == "db"
            latencies.append(time.monotonic() - started)
    assert max(latencies) < 0.5
    assert sorted(latencies)[len(latencies) // 2] < 0.05


async def test_connection_cut_mid_stream_recovers_without_errors(
    proxy: ToxicProxy, prefix: str
) -> None:
    config = make_config(proxy.url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    loader = CountingLoader("db")
    async with LayeredCache.from_config(config) as cache:
        for i in range(30):
            if i % 10 == 5:
                proxy.cut()
            assert await cache.get_or_load("book", {"id": i % 3}, loader) == "db"
        assert await eventually(lambda: cache.redis_status().breaker == "closed", timeout=3)


async def test_a_redis_restarted_while_the_caches_connections_sat_idle_fails_no_request(
    redis_server: RedisServer, prefix: str
) -> None:
    """Redis restarts while the cache's connections sit idle: those the request path
    keeps (``_direct``) and those in redis-py's pool (batches, invalidations). Once the
    server's close has reached the process, every command runs on a new connection: no
    request fails, no Redis error is counted and the breaker stays closed. (redis-py
    8.1's pool skips its check of a pooled connection unless its maintenance
    notifications are off: ``_clients``.)"""
    config = make_config(redis_server.url, prefix, backplane={"enabled": False})
    async with LayeredCache.from_config(config) as cache:

        async def burst(first: int) -> list[object]:
            ids = range(first, first + 8)
            reads = [cache.get_or_load("book", {"id": i}, CountingLoader(i)) for i in ids]
            values = list(await asyncio.gather(*reads))
            cache.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
            assert await cache.get_many("book", [{"id": i} for i in ids]) == list(ids)  # MGET
            await asyncio.gather(*(cache.invalidate("book", {"id": i}) for i in ids[:4]))
            return values

        assert await burst(0) == list(range(8))  # connections kept, and pooled
        redis_server.stop()
        redis_server.start()
        await asyncio.sleep(0.2)  # the closes reach this process
        assert await burst(100) == list(range(100, 108))
        assert await burst(200) == list(range(200, 208))
        assert cache.stats()["book"]["redis_error"] == 0
        assert cache.redis_status().breaker == "closed"


def _l1_outlives(url: str, prefix: str) -> Config:
    """L1 30 s; a breaker that opens after 2 timeouts of 100 ms and probes every 300 ms."""
    return make_config(
        url,
        prefix,
        {"book": {"key": "book:{id}", "l1": {"ttl": "30s"}}},
        redis={
            "timeout": "100ms",
            "connect_timeout": "100ms",
            "breaker": {"failures": 2, "reset": "300ms"},
        },
    )


async def test_with_redis_down_a_key_read_ten_times_is_loaded_once_per_instance(
    redis_server: RedisServer, prefix: str
) -> None:
    """docs/operations.md: with Redis down "the database sees at most one load per key per
    instance" (per L1 TTL). The value loaded past L2 went nowhere: every read loaded."""
    loader = CountingLoader("db")
    async with LayeredCache.from_config(_l1_outlives(redis_server.url, prefix)) as cache:
        redis_server.kill()
        try:
            for _ in range(10):
                assert await cache.get_or_load("book", {"id": 1}, loader) == "db"
        finally:
            redis_server.start()
    assert loader.calls == 1


async def test_with_redis_down_a_batch_read_ten_times_loads_each_key_once_per_instance(
    redis_server: RedisServer, prefix: str
) -> None:
    loaded: list[object] = []

    async def load_many(missing: list[dict[str, object]]) -> list[str]:
        loaded.extend(fields["id"] for fields in missing)
        return [f"db{fields['id']}" for fields in missing]

    async with LayeredCache.from_config(_l1_outlives(redis_server.url, prefix)) as cache:
        redis_server.kill()
        try:
            for _ in range(10):
                ids = [{"id": 1}, {"id": 2}]
                assert await cache.get_or_load_many("book", ids, load_many) == ["db1", "db2"]
        finally:
            redis_server.start()
    assert sorted(loaded) == [1, 2]  # type: ignore[type-var]


async def test_a_value_loaded_while_cut_off_from_redis_goes_when_its_invalidation_is_heard(
    proxy: ToxicProxy, redis_server: RedisServer, prefix: str
) -> None:
    """The value an instance cut off from Redis loads is kept in its L1, not for its
    whole TTL past an invalidation: once Redis answers again, the listener reads the
    entries appended meanwhile and drops it."""
    async with (
        LayeredCache.from_config(_l1_outlives(proxy.url, prefix)) as cut_off,
        LayeredCache.from_config(_l1_outlives(redis_server.url, prefix)) as writer,
    ):
        proxy.mode = "blackhole"
        proxy.cut()
        assert await cut_off.get_or_load("book", {"id": 1}, CountingLoader("v1")) == "v1"
        await writer.set("book", {"id": 1}, "v2")  # appended while cut_off can't read
        assert await cut_off.get("book", {"id": 1}) == "v1"  # L1: as any copy held
        proxy.mode = "pass"
        proxy.cut()

        async def fresh() -> bool:
            return await cut_off.get("book", {"id": 1}) == "v2"

        assert await eventually(fresh, timeout=10)
