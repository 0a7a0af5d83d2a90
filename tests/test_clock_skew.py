"""Skewed host clocks against a real Redis: a value lives its TTL in Redis' time, not
its TTL stretched or cut by the writer's or reader's skew (``_redisclock``).

Scaled down from the report (+-30 s skew, 20 s TTL, values served 50 s old): +-4 s skew,
a 1.5 s TTL. Each case polls for a few seconds; on the old code (each host's own wall
clock) a value was served ~8 s past its life, or never served at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis.asyncio as redis

from layered_cache import Config, LayeredCache
from layered_cache._redisclock import RedisClock, redis_time
from tests.helpers import eventually, make_config
from tests.servers import RedisClusterServers, RedisServer

SKEW = 4.0
TTL = 1.5
# Slack for a loaded 2-core machine: the read's own latency and the event loop's delays
# between the freshness check and the test's timestamp. The clock error itself is the
# TIME round trip (~0.1-1 ms here); the skew under test is 4 s each way, 8 s in all.
SLACK = 0.5


def skewed(seconds: float) -> Callable[[], float]:
    return lambda: time.time() + seconds


def config(url: str, prefix: str, l1: bool) -> Config:
    namespace = {
        "key": "book:{id}",
        "l1": {"ttl": "1s", "jitter": 0.0} if l1 else False,
        "l2": {"ttl": f"{TTL}s", "jitter": 0.0},
        "stale": {"max_age": "10s"},  # Redis keeps the key long past its soft expiry
    }
    return make_config(url, prefix, {"book": namespace}, redis={"timeout": "2s"})


async def ages_served(reader: LayeredCache, written: float, until: float) -> list[float]:
    """The age of every value ``reader.get`` returns, polling until ``until`` seconds
    after ``written`` (real time)."""
    ages = []
    while time.time() < written + until:
        value = await reader.get("book", {"id": 1})
        if value is not None:
            ages.append(time.time() - value)
        await asyncio.sleep(0.02)
    return ages


@pytest.mark.parametrize("l1", [False, True], ids=["l2", "l1"])
async def test_a_writer_ahead_and_a_reader_behind_never_serve_a_value_past_its_ttl(
    redis_url: str, prefix: str, l1: bool
) -> None:
    cfg = config(redis_url, prefix, l1)
    async with (
        LayeredCache.from_config(cfg, clock=skewed(+SKEW)) as writer,
        LayeredCache.from_config(cfg, clock=skewed(-SKEW)) as reader,
    ):
        written = time.time()
        await writer.set("book", {"id": 1}, written)
        ages = await ages_served(reader, written, until=TTL + 2.0)
    assert ages, "the fresh value was never served"
    assert max(ages) <= TTL + SLACK, f"served {max(ages):.2f} s old with a {TTL} s TTL"


@pytest.mark.parametrize("l1", [False, True], ids=["l2", "l1"])
async def test_a_writer_behind_and_a_reader_ahead_still_serve_a_fresh_value(
    redis_url: str, prefix: str, l1: bool
) -> None:
    cfg = config(redis_url, prefix, l1)
    async with (
        LayeredCache.from_config(cfg, clock=skewed(-SKEW)) as writer,
        LayeredCache.from_config(cfg, clock=skewed(+SKEW)) as reader,
    ):
        written = time.time()
        await writer.set("book", {"id": 1}, written)
        served = await reader.get("book", {"id": 1})
        assert served == written, "a value written a moment ago was judged stale"
        ages = await ages_served(reader, written, until=TTL + 1.0)
    # Served for its whole life (bar the slack), not dropped early by the skew.
    assert max(ages) >= TTL - SLACK
    assert max(ages) <= TTL + SLACK


async def test_the_clock_learns_this_hosts_offset_to_redis(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    clock = RedisClock(skewed(-30.0), redis_time(client, "anchor"))
    try:
        await clock.start()
        redis_now = await redis_time(client, "anchor")()
        assert clock.error_bound is not None
        assert clock.error_bound < SLACK
        assert abs(clock.now() - redis_now) < SLACK
        assert abs(clock.offset - 30.0) < SLACK
    finally:
        await clock.stop()
        await client.aclose()


async def test_redis_down_at_start_uses_the_local_clock_then_syncs(
    redis_server: RedisServer,
) -> None:
    redis_server.stop()
    client = redis.Redis.from_url(redis_server.url, socket_connect_timeout=0.2)
    clock = RedisClock(skewed(+30.0), redis_time(client, "anchor"), timeout=0.5, retry=0.1)
    try:
        await clock.start()  # returns: Redis down must not keep the cache from starting
        assert not clock.synced
        assert clock.offset == 0.0
        redis_server.start()
        assert await eventually(lambda: clock.synced, timeout=20.0)
        assert abs(clock.offset + 30.0) < SLACK
    finally:
        await clock.stop()
        await client.aclose()


async def test_a_cluster_is_sampled_on_the_node_owning_the_anchor(
    redis_cluster: RedisClusterServers,
) -> None:
    client = redis.RedisCluster.from_url(redis_cluster.url)
    clock = RedisClock(skewed(+30.0), redis_time(client, "{anchor}"), timeout=2.0)
    try:
        await client.initialize()
        await clock.start()
        assert clock.synced
        assert abs(clock.offset + 30.0) < SLACK
    finally:
        await clock.stop()
        await client.aclose()


async def test_a_backward_correction_goes_no_further_than_the_measurement_needs() -> None:
    """A later sample that still contains the current offset leaves it alone (a backward
    step makes values look younger); one that rules it out moves it to its near edge,
    at once.
    (A scripted TIME source: a real Redis can't be made to answer these exact times.)"""
    local = [1000.0]
    replies: list[float] = []

    async def source() -> float:
        local[0] += 0.010  # every sample takes a 10 ms round trip on the local clock
        return replies.pop(0)

    clock = RedisClock(lambda: local[0], source)
    replies.append(1000.0 + 5.0 + 0.005)  # Redis read mid-trip: offset 5.0 +- 5 ms
    assert await clock.sample()
    assert clock.offset == pytest.approx(5.0)
    clock._samples.clear()
    replies.append(local[0] + 5.0 + 0.002)  # interval [4.992, 5.002]: 5.0 still inside
    assert await clock.sample()
    assert clock.offset == pytest.approx(5.0)
    # [3.995, 4.005] rules 5.0 out: a clock was stepped, and the older samples, as tight
    # as this one, no longer count (else the first, as good, would win for ~5 minutes).
    replies.append(local[0] + 4.0 + 0.005)
    assert await clock.sample()
    assert clock.offset == pytest.approx(4.005)
