"""The purge queue (layered_cache._purges) around a purger, with a real Redis: a slow,
hanging or failing HTTP cache never blocks ``invalidate()``; undeliverable purges are
retried, then counted; a full queue drops and counts. (Against a real Varnish:
tests/test_varnish.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from layered_cache import LayeredCache, parse_config
from layered_cache._purges import PurgeQueue
from layered_cache.prometheus import register_cache, render_metrics
from layered_cache.purge import VarnishPurger
from tests.helpers import eventually
from tests.servers import free_port

pytestmark = pytest.mark.timeout(60)


class Recording:
    def __init__(self, fail: int = 0, hang: bool = False) -> None:
        self.calls: list[tuple[list[str], list[str]]] = []
        self.fail, self.hang = fail, hang

    async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
        self.calls.append((list(keys), list(tags)))
        if self.hang:
            await asyncio.Event().wait()
        if self.fail:
            self.fail -= 1
            raise ConnectionError("gateway down")


def _cache(redis_url: str, prefix: str, purger: Recording, **purge: object) -> LayeredCache:
    config = parse_config(
        {
            "redis": {"url": redis_url, "prefix": prefix, "timeout": "2s"},
            "purge": {"repeat_after": "0s", **purge},
            "namespaces": {
                "book": {"key": "book:{id}"},
                "category": {"key": "category:{slug}", "tags": True},
            },
        },
        env={},
    )
    return LayeredCache.from_config(config, purger=purger)


async def test_invalidate_invalidate_tag_and_set_purge_the_key_or_tag_in_the_background(
    redis_url: str, prefix: str
) -> None:
    purger = Recording()
    async with _cache(redis_url, prefix, purger) as cache:
        await cache.invalidate("book", {"id": 1})
        await cache.invalidate_tag("book:1")
        await cache.set("book", {"id": 2}, {"price": "9.90"})
        assert await eventually(lambda: len(purger.calls) == 3)
        key1, key2 = cache.key("book", {"id": 1}), cache.key("book", {"id": 2})
        assert purger.calls == [([key1], []), ([], ["book:1"]), ([key2], [])]
        assert cache.purge_stats().delivered == 3


async def test_a_hanging_gateway_never_blocks_invalidate_and_a_full_queue_drops_and_counts(
    redis_url: str, prefix: str
) -> None:
    purger = Recording(hang=True)
    async with _cache(redis_url, prefix, purger, queue=5) as cache:
        await cache.get_or_load("book", {"id": 1}, lambda: asyncio.sleep(0, "v"))
        # 50 invalidations with a purge that never returns: each completes on its own.
        for i in range(50):
            await asyncio.wait_for(cache.invalidate("book", {"id": i}), 10)
        assert await cache.get("book", {"id": 1}) is None  # the key itself is gone
        stats = cache.purge_stats()
        assert stats.submitted == 50 and stats.dropped >= 50 - 5 - 1 and stats.delivered == 0


async def test_an_undeliverable_purge_is_retried_then_counted_as_failed(
    redis_url: str, prefix: str
) -> None:
    purger = Recording(fail=100)
    async with _cache(redis_url, prefix, purger, retries=2) as cache:
        await cache.invalidate("book", {"id": 1})
        assert await eventually(lambda: cache.purge_stats().failed == 1, timeout=10)
        assert len(purger.calls) == 3 and cache.purge_stats().retries == 2
        purger.fail = 1  # one failure, then the gateway is back: delivered on the retry
        await cache.invalidate("book", {"id": 2})
        assert await eventually(lambda: cache.purge_stats().delivered == 1, timeout=10)
        registry = CollectorRegistry()
        register_cache(cache, registry)
        body = render_metrics(registry)[0].decode()
        for outcome, value in (("failed", 1.0), ("delivered", 1.0), ("retries", 3.0)):
            line = f'layered_cache_http_purges_total{{instance="{cache.instance_id}",'
            assert f'{line}outcome="{outcome}"}} {value}' in body, body


async def test_the_varnish_purger_to_a_gateway_that_is_down_fails_and_counts() -> None:
    purger = VarnishPurger([f"http://127.0.0.1:{free_port()}"], timeout=0.5)
    queue = PurgeQueue(purger, retries=1, backoff=[0.01], owned=True)
    queue.submit(["book:1"], ["book:1"])
    await asyncio.wait_for(queue.drain(), 10)
    assert queue.stats.failed == 2 and queue.stats.retries == 1
    await queue.close()


async def test_each_purge_is_sent_again_after_repeat_after() -> None:
    purger = Recording()
    queue = PurgeQueue(purger, repeat_after=0.05)
    queue.submit(["book:1"])
    assert await eventually(lambda: len(purger.calls) == 2, timeout=5)
    await asyncio.sleep(0.2)
    assert len(purger.calls) == 2  # once more, not forever
    await queue.close()
