"""What stays bounded under traffic an attacker or an unlucky workload sends: the L1 tag
index with tags of unbounded kinds (a user, a query) and pages of many tags, the ETag
memo of a namespace without L1, the purge queue against whole batches. Found by a
review; each failed before its fix."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import Awaitable, Callable, Sequence

import pytest
from starlette.requests import Request

from layered_cache import LayeredCache, parse_config
from layered_cache._tagindex import TagIndex
from layered_cache.asgi import CachedResponses
from tests.helpers import make_config

pytestmark = pytest.mark.timeout(60)


def _pages(redis_url: str, prefix: str, max_entries: int) -> LayeredCache:
    namespaces = {
        "page": {"key": "page:{id}", "tags": True, "l1": {"ttl": "60s", "max_entries": max_entries}}
    }
    return LayeredCache.from_config(make_config(redis_url, prefix, namespaces))


async def test_the_l1_tag_index_forgets_tags_whose_entries_left_l1(
    redis_url: str, prefix: str
) -> None:
    """1,000 fills each tagged with its own user (``user:<i>``) into an L1 of 10: the
    index kept all 1,000 tags (~300 B each, for ever: only invalidate_tag of that very
    tag removed one), and summed every tag's keys at each fill."""
    async with _pages(redis_url, prefix, 10) as cache:
        for i in range(1000):
            await cache.get_or_load("page", {"id": i}, _value(f"v{i}"), tags=[f"user:{i}"])
        index = cache.namespace("page")._fills.tagged
        assert index is not None and len(index) <= 2 * 4 * 10
        # A tag still held by an entry in L1 is still indexed: its invalidation drops it.
        l1, key = cache.namespace("page").policy.l1, cache.key("page", {"id": 999})
        assert l1 is not None and key in l1
        await cache.invalidate_tag("user:999")
        assert key not in l1


async def test_the_l1_tag_index_is_pruned_once_per_doubling_not_at_every_fill(
    redis_url: str, prefix: str
) -> None:
    """Pages of 10 tags into an L1 of 100: the live (tag, key) pairs stay above the
    prune threshold (4 per entry), so every fill rebuilt the whole index (259 of 300
    fills; ~280 ms a fill at the default max_entries with 20-tag pages)."""
    prunes = 0
    prune = TagIndex._prune

    def counted(self: TagIndex, in_l1: object) -> None:
        nonlocal prunes
        prunes += 1
        prune(self, in_l1)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(TagIndex, "_prune", counted)
        async with _pages(redis_url, prefix, 100) as cache:
            for i in range(300):
                tags = [f"book:{(i * 7 + j) % 50}" for j in range(10)]
                await cache.get_or_load("page", {"id": i}, _value(f"v{i}"), tags=tags)
    assert prunes <= 10, f"the index was pruned on {prunes} of 300 fills"


async def test_the_etag_memo_keeps_no_values_of_a_namespace_without_l1(
    redis_url: str, prefix: str
) -> None:
    """Without L1 every read decodes a new object, so the identity memo never matched
    and only kept the last 10,000 values served alive (each up to max_value_bytes):
    600 distinct 20 KB reports served once kept ~12 MB."""
    config = parse_config(
        {
            "redis": {"url": redis_url, "prefix": prefix},
            "namespaces": {
                "report": {"key": "report:{id}", "l1": False, "http": {"s_maxage": "30s"}}
            },
        },
        env={},
    )
    async with LayeredCache.from_config(config) as cache:
        responses = CachedResponses(cache)
        request = Request(
            {"type": "http", "method": "GET", "headers": [], "path": "/", "query_string": b""}
        )
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for i in range(600):
                await responses.respond(
                    request, "report", {"id": i}, _value(f"{i:08d}" + "x" * 20_000)
                )
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
    assert held < 5_000_000, f"{held / 1e6:.1f} MB of served values still held"


async def test_the_purge_queue_holds_at_most_its_size_in_purges_whatever_the_batches(
    redis_url: str, prefix: str
) -> None:
    """``purge.queue`` counts purges (keys + tags), but the queue counted jobs, and one
    job is a whole set_many or daemon batch: with the gateway black-holed and queue =
    100, 20 set_many of 1,000 keys left 19,000 purges pending and dropped none."""

    class HungGateway:
        async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
            await asyncio.Event().wait()  # a black-holed Varnish

    config = make_config(redis_url, prefix, purge={"queue": 100})
    async with LayeredCache.from_config(config, purger=HungGateway()) as cache:
        for batch in range(20):
            await cache.set_many("book", [({"id": batch * 1000 + i}, "v") for i in range(1000)])
        queue = cache._rt.purges._queues[0]  # the one gateway's
        pending = sum(len(keys) + len(tags) for keys, tags, _ in queue._queue._queue)  # type: ignore[attr-defined, misc]
        stats = cache._rt.purges.stats
        assert pending <= 100
        assert stats.dropped >= 20_000 - 100 - 1000  # what didn't fit (one job in flight)
        assert stats.submitted == 20_000


def _value(value: str) -> Callable[[], Awaitable[str]]:
    async def load() -> str:
        return value

    return load


async def test_an_instance_holds_at_most_twice_max_connections_in_its_pool(
    redis_url: str, prefix: str
) -> None:
    """``redis.max_connections`` bounds operations in flight; connections are up to that
    many kept for the request path's single commands and as many again in redis-py's
    pool for pipelines (the README said "connection pool size": 8 for 4 here)."""
    config = make_config(redis_url, prefix, redis={"max_connections": 4, "timeout": "2s"})
    async with LayeredCache.from_config(config) as cache:

        async def load_many(fields: Sequence[object]) -> list[str]:
            await asyncio.sleep(0.01)
            return ["v" for _ in fields]

        for burst in range(3):
            await asyncio.gather(
                *(
                    cache.get_or_load_many(
                        "book", [{"id": burst * 10_000 + i * 10 + j} for j in range(10)], load_many
                    )
                    for i in range(100)
                )
            )
        pool = cache._rt.store.client.connection_pool  # type: ignore[union-attr]
        total = len(pool._available_connections) + len(pool._in_use_connections)
        assert 4 <= total <= 2 * 4
