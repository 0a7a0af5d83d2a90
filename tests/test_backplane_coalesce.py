"""``backplane.coalesce``: after a read that returned entries, the listener waits before
its next XREAD, so a burst of writes wakes it once per interval instead of once per
entry (issue 17: a writer's own ``set()`` loop paid a second round trip per write, for
its own listener). What may not change: every entry of the burst still reaches every
other instance's L1, none later than the interval plus the usual delivery.

XREADs are counted by the server's own ``INFO commandstats``, on a Redis of the test's
own (the suite's shared one serves other tests' listeners too)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as redis

from layered_cache import LayeredCache
from tests.helpers import eventually, in_l1, make_config
from tests.servers import RedisServer

BOOK = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}
WRITES = 500


async def _xreads(admin: Any) -> int:
    stats = await admin.info("commandstats")
    return int(stats.get("cmdstat_xread", {}).get("calls", 0))


async def test_500_sets_in_a_row_wake_the_writers_listener_once_per_interval(
    prefix: str,
) -> None:
    """Without coalescing each set() woke the listener (a reply, a new XREAD): 500
    XREADs. With it, at most one per interval while the burst lasts (plus one per
    ``block`` of quiet) - however slow the machine, since the bound is in its time."""
    coalesce, block = 0.02, 1.0
    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        config = make_config(
            server.url, prefix, BOOK, backplane={"coalesce": f"{coalesce}s", "block": f"{block}s"}
        )
        async with LayeredCache.from_config(config) as cache:
            before = await _xreads(admin)
            started = time.monotonic()
            for i in range(WRITES):
                await cache.set("book", {"id": i}, {"id": i})
            elapsed = time.monotonic() - started
            reads = await _xreads(admin) - before
            newest = (await admin.xrevrange(prefix + config.backplane.stream, count=1))[0][0]
            caught_up = await eventually(
                lambda: cache.backplane_status().last_id == newest.decode()  # type: ignore[union-attr]
            )
            assert all(in_l1(cache, i) for i in range(WRITES)), "its own entries drop nothing"
        await admin.aclose()
    assert caught_up, "the listener read every entry of the burst"
    assert reads <= elapsed / coalesce + elapsed / block + 2, (reads, elapsed)
    assert reads < WRITES / 2, reads


async def test_coalesce_0_reads_again_at_once(prefix: str) -> None:
    """The old behaviour, for whoever wants every entry as soon as Redis has it: a
    burst of writes another instance makes spaced out costs one XREAD per entry."""
    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        config = make_config(server.url, prefix, BOOK, backplane={"coalesce": "0s"})
        async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config):
            before = await _xreads(admin)
            for i in range(20):
                await a.set("book", {"id": i}, i)
                await asyncio.sleep(0.01)  # each entry alone: both listeners wake for it
            await asyncio.sleep(0.05)
            reads = await _xreads(admin) - before
        await admin.aclose()
    assert reads >= 2 * 20, reads


async def test_a_burst_of_invalidations_reaches_another_l1_whole_and_within_the_interval(
    redis_url: str, prefix: str
) -> None:
    """B's listener is inside its pause (it just read A's first invalidation) while A
    invalidates 300 more keys one by one: B drops every one of them, and the last no
    later than the interval plus a delivery after A's call returned."""
    coalesce = 0.1  # the largest allowed: the pause is long enough to land in
    config = make_config(redis_url, prefix, BOOK, backplane={"coalesce": f"{coalesce}s"})
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        for i in range(301):
            await b.get_or_load("book", {"id": i}, lambda i=i: _value(i))
        await a.invalidate("book", {"id": 0})
        assert await eventually(lambda: not in_l1(b, 0), timeout=5)
        for i in range(1, 301):
            await a.invalidate("book", {"id": i})
        returned = time.monotonic()
        assert await eventually(lambda: not any(in_l1(b, i) for i in range(301)), timeout=5)
        waited = time.monotonic() - returned
        assert b.backplane_status().gaps == 0  # type: ignore[union-attr]
    assert waited < coalesce + 1.0, waited


async def _value(i: int) -> dict[str, int]:
    return {"id": i}
