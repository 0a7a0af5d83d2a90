"""A tag invalidation that has not reached an instance stops its dead entries within the
bound a key invalidation has there (its L1 TTL), not after the hour a tag version is
otherwise held: an instance trusts a held version only while its backplane listener
vouches that every invalidation since has reached it (``_namespace_versions``)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from layered_cache import LayeredCache
from tests.helpers import CountingLoader, make_config, stall_listener

L1_TTL = 0.3
NAMESPACES = {
    "book": {"key": "book:{id}", "l1": {"ttl": f"{L1_TTL}s", "jitter": 0}},
    "category": {"key": "category:{slug}", "tags": True, "l1": {"ttl": f"{L1_TTL}s", "jitter": 0}},
}


def _page(slug: str, books: list[int]) -> dict[str, Any]:
    return {"slug": slug, "books": books}


def _tags_of(page: Mapping[str, Any]) -> list[str]:
    return [f"book:{b}" for b in page["books"]]


async def _cached_book_and_page(cache: LayeredCache) -> None:
    await cache.get_or_load("book", {"id": 42}, CountingLoader({"id": 42, "price": "49.99"}))
    page = CountingLoader(_page("scifi", [42]))
    await cache.get_or_load("category", {"slug": "scifi"}, page, tags=_tags_of)


async def _price_change(cache: LayeredCache) -> None:
    """Book 42's price changes: the book and every page showing it are invalidated."""
    await cache.invalidate("book", {"id": 42})
    await cache.invalidate_tag("book:42")


async def test_without_the_backplane_a_tag_invalidation_is_bounded_like_a_key_one(
    redis_url: str, prefix: str
) -> None:
    """Backplane off: B's copy of the book lives at most its L1 TTL, and so does its view
    of the page. B held the tag's version for an hour and served the dead L2 page,
    refilling its L1 from it, all that time."""
    config = make_config(redis_url, prefix, NAMESPACES, backplane={"enabled": False})
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        await _cached_book_and_page(b)
        await _price_change(a)
        await asyncio.sleep(3 * L1_TTL)
        assert await b.get("book", {"id": 42}) is None
        assert await b.get("category", {"slug": "scifi"}) is None


async def test_an_instance_whose_listener_is_stalled_stops_serving_a_dead_tagged_entry(
    redis_url: str, prefix: str
) -> None:
    """Backplane on, B's listener held (a starved pod, a relay restarting, the stream's
    master failing over while the keys' masters answer): as with the backplane off."""
    config = make_config(redis_url, prefix, NAMESPACES, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        for cache in (a, b):
            assert cache._backplane is not None
            await asyncio.wait_for(cache._backplane.connected.wait(), 5)
        await _cached_book_and_page(b)
        gate = stall_listener(b)
        try:
            await asyncio.sleep(0.4)  # B's listener is held at its next XREAD
            await _price_change(a)
            await asyncio.sleep(3 * L1_TTL)
            assert await b.get("book", {"id": 42}) is None
            assert await b.get("category", {"slug": "scifi"}) is None
        finally:
            gate.set()


async def test_while_the_listener_vouches_a_held_version_is_not_fetched_again(
    redis_url: str, prefix: str
) -> None:
    """The cost side: past its L1 TTL, an L2 hit of a tagged entry asks Redis for its
    tags' versions only when the backplane can't vouch for them."""
    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as cache:
        assert cache._backplane is not None
        await asyncio.wait_for(cache._backplane.connected.wait(), 5)
        await _cached_book_and_page(cache)
        fetches = 0
        versions = cache._rt.versions
        real_fetch = versions._fetch

        async def counted(tags: list[str], create: bool) -> dict[str, str]:
            nonlocal fetches
            fetches += 1
            return await real_fetch(tags, create)

        versions._fetch = counted  # type: ignore[method-assign]
        for _ in range(3):
            await asyncio.sleep(1.5 * L1_TTL)  # L1 expired: an L2 hit checks the tags
            assert await cache.get("category", {"slug": "scifi"}) == _page("scifi", [42])
        assert fetches == 0
