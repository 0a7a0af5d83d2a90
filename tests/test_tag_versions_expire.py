"""Tag token keys expire: one key per tag ever used must not stay in Redis for ever (a
search query or a user as a tag would fill it; under a ``volatile-*`` policy nothing
could evict them), and an expired or evicted token must neither revive entries nor
leave an instance taking every newer entry for dead. Against a real Redis."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as redis

from layered_cache import LayeredCache
from layered_cache._config import parse_config
from layered_cache._keys import tag_version_name
from layered_cache._tags import VERSION_TTL_FLOOR, version_ttl
from layered_cache.daemon.deletes import Deleter
from layered_cache.daemon.stats import DaemonStats
from tests.helpers import CountingLoader, make_config

NAMESPACES = {"category": {"key": "category:{slug}", "tags": True}}
DAY_MS = int(VERSION_TTL_FLOOR * 1000)


def _page(edition: int = 1) -> dict[str, Any]:
    return {"books": [42], "edition": edition}


async def _pttl(admin: redis.Redis, prefix: str, tag: str) -> int:
    return int(await admin.pttl(tag_version_name(prefix, tag)))


@pytest.fixture
async def admin(redis_url: str) -> Any:
    client = redis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_a_tag_used_by_a_load_a_set_or_an_invalidation_leaves_a_key_that_expires(
    redis_url: str, prefix: str, admin: redis.Redis
) -> None:
    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as cache:
        loader = CountingLoader(_page())
        await cache.get_or_load("category", {"slug": "a"}, loader, tags=["book:1"])
        await cache.set("category", {"slug": "b"}, _page(), tags=["book:2"])
        await cache.invalidate_tag("book:3")
        for tag in ("book:1", "book:2", "book:3"):
            assert DAY_MS - 60_000 < await _pttl(admin, prefix, tag) <= DAY_MS, tag


async def test_the_daemons_tag_invalidation_leaves_a_key_that_expires(
    redis_url: str, prefix: str, admin: redis.Redis
) -> None:
    config = make_config(redis_url, prefix, NAMESPACES)
    deleter = Deleter(config)
    try:
        await deleter.delete([], DaemonStats(), tags=["book:9"])
    finally:
        await deleter.close()
    assert DAY_MS - 60_000 < await _pttl(admin, prefix, "book:9") <= DAY_MS


async def test_a_token_key_from_before_tokens_expired_keeps_its_token_and_gets_a_ttl(
    redis_url: str, prefix: str, admin: redis.Redis
) -> None:
    """Keys written by an older version have no TTL: the next fetch gives them one, and
    the entries carrying their token stay alive (no reload on upgrade)."""
    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as old:
        await old.set("category", {"slug": "a"}, _page(), tags=["book:42"])
    name = tag_version_name(prefix, "book:42")
    await admin.persist(name)
    assert await admin.pttl(name) == -1
    loader = CountingLoader(_page(edition=2))
    async with LayeredCache.from_config(config) as upgraded:
        got = await upgraded.get_or_load("category", {"slug": "a"}, loader, tags=["book:42"])
    assert got == _page() and loader.calls == 0
    assert DAY_MS - 60_000 < await admin.pttl(name) <= DAY_MS


async def test_a_fetch_never_shortens_a_key_another_instance_made_live_longer(
    redis_url: str, prefix: str, admin: redis.Redis
) -> None:
    """Instances of other configs may need the token longer (entries with a longer
    TTL): a fetch only ever extends the key's life."""
    config = make_config(redis_url, prefix, NAMESPACES)
    name = tag_version_name(prefix, "book:42")
    await admin.set(name, "0123456789abcdef", px=10 * DAY_MS)  # a token as ours are
    async with LayeredCache.from_config(config) as cache:
        await cache.set("category", {"slug": "a"}, _page(), tags=["book:42"])
    assert await admin.get(name) == b"0123456789abcdef"
    assert await admin.pttl(name) > 9 * DAY_MS


async def test_after_its_token_expired_an_instance_holding_it_accepts_newer_entries_again(
    redis_url: str, prefix: str, admin: redis.Redis
) -> None:
    """A holds the token of book:42; the key expires (or is evicted: no invalidation
    announces it) and B, fetching, creates a new one for its entries. A must not take
    B's entries for dead for ever (it would reload on every read, and its fills, written
    with the old token, would be dead for everyone else): it trusts a token for a
    quarter of the key's life (an hour at most), then fetches it again."""
    config = make_config(redis_url, prefix, NAMESPACES)
    now = [0.0]
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        a._rt.versions._clock = lambda: now[0]  # the test's clock: a day in a line
        a._rt.versions._trusted_until = now[0] + a._rt.versions._trust
        await a.set("category", {"slug": "a"}, _page(), tags=["book:42"])  # A holds a token
        await admin.delete(tag_version_name(prefix, "book:42"))  # expired
        await b.set("category", {"slug": "b"}, _page(edition=2), tags=["book:42"])
        now[0] += a._rt.versions._trust  # A's trust in its token runs out (an hour here)
        loader = CountingLoader(_page(edition=3))
        got = await a.get_or_load("category", {"slug": "b"}, loader, tags=["book:42"])
        assert got == _page(edition=2) and loader.calls == 0
        # ... and A's entry, written with the lost token, is dead in L2: never revived
        # (A's own L1 copy may serve to its L1 TTL: nothing invalidated its data).
        assert await b.get("category", {"slug": "a"}) is None


def _config(namespaces: dict[str, Any]) -> Any:
    return parse_config({"namespaces": namespaces}, source="<test>", env={})


@pytest.mark.parametrize(
    ("namespaces", "expected"),
    [
        ({}, VERSION_TTL_FLOOR),
        ({"c": {"key": "c:{id}", "tags": True}}, VERSION_TTL_FLOOR),  # 10 min L2
        # 1 day L2 TTL, 10 % jitter, 1 h stale window: twice 27.4 h.
        (
            {"c": {"key": "c:{id}", "tags": True, "l2": {"ttl": "1d"}, "stale": {"max_age": "1h"}}},
            2 * (86_400 * 1.1 + 3_600),
        ),
        # Untagged namespaces don't count; an L1-only tagged one counts its L1 TTL.
        (
            {
                "u": {"key": "u:{id}", "l2": {"ttl": "30d"}},
                "c": {"key": "c:{id}", "tags": True, "l2": False, "l1": {"ttl": "2d", "jitter": 0}},
            },
            4 * 86_400,
        ),
    ],
)
def test_a_token_key_lives_twice_the_longest_tagged_entry_and_at_least_a_day(
    namespaces: dict[str, Any], expected: float
) -> None:
    assert version_ttl(_config(namespaces)) == pytest.approx(expected)
