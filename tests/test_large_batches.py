"""Batches far larger than a page: 10,000 keys of 3 KB at the default ``redis.timeout``
(100 ms). Sent as one pipeline (a 30 MB fill) or one MULTI/EXEC (``set_many``), the
round trip outlasted one timeout, every time: counted as a Redis failure (two open the
suite's breaker for every key), every lease released while its fill still ran, nothing
cached, and ``set_many`` raised. Found by an adversarial review (2026-12-05; at 1 KB it
failed there one run in three). Each test runs on a Redis of its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis.asyncio as redis

from layered_cache import LayeredCache
from tests.helpers import make_config
from tests.servers import RedisClusterServers, RedisServer

N = 10_000
KB = "x" * 3000
# The defaults the review ran with; a breaker of 2 failures (the suite's) is stricter.
DEFAULTS = {"timeout": "100ms", "connect_timeout": "100ms"}


async def load_many(fields_list: list[Mapping[str, object]]) -> list[Any]:
    return [{"id": fields["id"], "body": KB} for fields in fields_list]


def ids(n: int) -> list[dict[str, int]]:
    return [{"id": i} for i in range(n)]


async def test_a_batch_of_10000_misses_is_loaded_once_and_filled_within_the_default_timeout(
    prefix: str,
) -> None:
    with RedisServer() as server:
        config = make_config(server.url, prefix, redis=DEFAULTS)
        async with LayeredCache.from_config(config) as cache:
            values = await cache.get_or_load_many("book", ids(N), load_many)
            assert [v["id"] for v in values] == list(range(N))
            stats = cache.stats()["book"]
            assert stats["redis_error"] == 0 and stats["fill_revoked"] == 0, stats
        async with LayeredCache.from_config(config) as other:  # L2 has every one
            again = await other.get_many("book", ids(N))
            assert [v["id"] for v in again] == list(range(N))
            assert other.stats()["book"]["redis_error"] == 0
        admin = redis.Redis.from_url(server.url)
        assert await admin.keys(f"*{prefix}*lease*") == []
        await admin.aclose()


async def test_set_many_of_10000_values_is_written_whole_within_the_default_timeout(
    prefix: str,
) -> None:
    with RedisServer() as server:
        config = make_config(server.url, prefix, redis=DEFAULTS)
        for _ in range(2):
            await set_many_then_read_back(config)


async def test_set_many_of_10000_values_on_a_cluster_is_written_whole(prefix: str) -> None:
    """A cluster's set_many is a pipeline split per node (not atomic there): it goes in
    chunks, each under one timeout. A cluster of its own (the suite's shared one is
    busy with other tests: a chunk once waited past 100 ms there on a loaded CI), a
    timeout of 250 ms for a loaded machine, and values of 10 KB: sent whole, the 100 MB
    outlasted it every time."""
    with RedisClusterServers(3) as cluster:
        config = make_config(
            cluster.url, prefix, redis={"timeout": "250ms", "connect_timeout": "250ms",
                                        "cluster": True},
        )
        await set_many_then_read_back(config, body="x" * 10_000)


async def set_many_then_read_back(config: Any, body: str = KB) -> None:
    """set_many of N values without a Redis error, then every one read back elsewhere."""
    async with LayeredCache.from_config(config) as cache:
        await cache.set_many("book", [(f, {"id": f["id"], "body": body}) for f in ids(N)])
        assert cache.stats()["book"]["redis_error"] == 0
    async with LayeredCache.from_config(config) as other:
        again = await other.get_many("book", ids(N))
        assert [v["id"] for v in again] == list(range(N))
