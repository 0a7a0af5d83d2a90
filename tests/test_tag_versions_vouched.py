"""A tag invalidation that has not reached an instance stops its dead entries within the
bound a key invalidation has there (its L1 TTL), not after the hour a tag version is
otherwise held: an instance trusts a held version only while its backplane listener
vouches that every invalidation since has reached it (``_namespace_versions``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError

from layered_cache import LayeredCache
from layered_cache._fallback import PING_EVERY
from tests.faults.proxy import ToxicProxy
from tests.faults.reply_delay import ReplyDelayProxy
from tests.helpers import CountingLoader, eventually, make_config, stall_listener

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


async def _connected(*caches: LayeredCache) -> None:
    for cache in caches:
        assert cache._backplane is not None
        await asyncio.wait_for(cache._backplane.connected.wait(), 5)


def _count_fetches(cache: LayeredCache) -> list[int]:
    """How many times ``cache`` asks Redis for tag versions from now on."""
    versions = cache._rt.versions
    real_fetch, counted = versions._fetch, [0]

    async def fetch(tags: list[str], create: bool) -> dict[str, str]:
        counted[0] += 1
        return await real_fetch(tags, create)

    versions._fetch = fetch  # type: ignore[method-assign]
    return counted


async def _price_change(cache: LayeredCache) -> None:
    """Book 42's price changes: the book and every page showing it are invalidated."""
    await cache.invalidate("book", {"id": 42})
    await cache.invalidate_tag("book:42")


async def _book_and_page_gone_within_l1_ttl(cache: LayeredCache) -> None:
    """The key invalidation's bound (its L1 copy's TTL), and the tag's: the same."""
    await asyncio.sleep(3 * L1_TTL)
    assert await cache.get("book", {"id": 42}) is None
    assert await cache.get("category", {"slug": "scifi"}) is None


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
        await _book_and_page_gone_within_l1_ttl(b)


async def test_an_instance_whose_listener_is_stalled_stops_serving_a_dead_tagged_entry(
    redis_url: str, prefix: str
) -> None:
    """Backplane on, B's listener held (a starved pod, a relay restarting, the stream's
    master failing over while the keys' masters answer): as with the backplane off."""
    config = make_config(redis_url, prefix, NAMESPACES, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        await _connected(a, b)
        await _cached_book_and_page(b)
        gate = stall_listener(b)
        try:
            await asyncio.sleep(0.4)  # B's listener is held at its next XREAD
            await _price_change(a)
            await _book_and_page_gone_within_l1_ttl(b)
        finally:
            gate.set()


async def test_while_the_listener_vouches_a_held_version_is_not_fetched_again(
    redis_url: str, prefix: str
) -> None:
    """The cost side: past its L1 TTL, an L2 hit of a tagged entry asks Redis for its
    tags' versions only when the backplane can't vouch for them."""
    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as cache:
        await _connected(cache)
        await _cached_book_and_page(cache)
        fetches = _count_fetches(cache)
        for _ in range(3):
            await asyncio.sleep(1.5 * L1_TTL)  # L1 expired: an L2 hit checks the tags
            assert await cache.get("category", {"slug": "scifi"}) == _page("scifi", [42])
        assert fetches[0] == 0


async def test_a_tag_invalidation_missed_over_the_pubsub_fallback_is_bounded_too(
    redis_url: str, prefix: str
) -> None:
    """A's XADD is refused (a Redis full under noeviction), so its invalidations go over
    pub/sub, which B's fallback subscriber, reconnecting, misses. B's stream listener
    vouched alone: the page was served for the hour. Both vouch now, as of the older."""
    config = make_config(redis_url, prefix, NAMESPACES, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        await _connected(a, b)
        await _cached_book_and_page(b)
        assert b._fallback is not None
        await b._fallback.stop()
        _refuse_appends(a)
        await _price_change(a)
        status = a.backplane_status()
        assert status is not None and status.fallback_sent >= 1
        await _book_and_page_gone_within_l1_ttl(b)



def _refuse_appends(cache: LayeredCache) -> None:
    """``cache``'s XADDs are refused (a Redis full under noeviction): its announcements
    go over the pub/sub fallback."""

    async def refused(*args: Any, **kwargs: Any) -> bytes:
        raise OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")

    publisher = cache._parts.publisher
    assert publisher is not None
    publisher.publish = refused  # type: ignore[method-assign]


def _hold_subscriptions(cache: LayeredCache) -> asyncio.Event:
    """``cache``'s fallback subscriber's next SUBSCRIBE waits for the returned gate."""
    fallback = cache._fallback
    assert fallback is not None
    gate, real_pubsub = asyncio.Event(), fallback._client.pubsub

    def gated_pubsub(**kwargs: Any) -> Any:
        pubsub = real_pubsub(**kwargs)
        real_subscribe = pubsub.subscribe

        async def subscribe(*args: Any, **kw: Any) -> Any:
            await gate.wait()
            return await real_subscribe(*args, **kw)

        pubsub.subscribe = subscribe
        return pubsub

    fallback._client.pubsub = gated_pubsub  # type: ignore[method-assign]
    return gate


async def test_a_tag_invalidation_missed_while_the_fallback_subscriber_reconnected_is_bounded(
    redis_url: str, prefix: str, redis_client: aioredis.Redis
) -> None:
    """Was broken (a review, 2026-12-07): B's fallback subscription dropped (a network
    blip, a proxy restart) and A's tag invalidation went over pub/sub before B
    subscribed again. Subscribed, B vouched "now" for every version it held, the one
    fetched before the gap too: the page was served for the hour a version is held.
    Expected: within the L1 TTL, as a key invalidation missed so. Now the versions held
    when a subscription is confirmed are forgotten (``FallbackSubscriber``)."""
    config = make_config(redis_url, prefix, NAMESPACES, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        await _connected(a, b)
        fallback = b._fallback
        assert fallback is not None
        await asyncio.wait_for(fallback.subscribed.wait(), 5)
        await _cached_book_and_page(b)
        gate = _hold_subscriptions(b)
        await redis_client.client_kill_filter(_type="pubsub")
        assert await eventually(lambda: not fallback.subscribed.is_set()), "never lost"
        _refuse_appends(a)
        await _price_change(a)  # over pub/sub: B, not subscribed, misses it
        status = a.backplane_status()
        assert status is not None and status.fallback_sent >= 1
        gate.set()
        assert await eventually(fallback.subscribed.is_set), "never subscribed again"
        await _book_and_page_gone_within_l1_ttl(b)


async def test_a_tag_invalidation_missed_on_a_silently_dead_fallback_connection_is_bounded(
    redis_url: str, prefix: str
) -> None:
    """Was broken (a review, 2026-12-07): B's pub/sub connection died without a reset (a
    NAT or firewall dropping an idle flow: it is idle until a full Redis refuses an
    XADD, unlike the listener's, which reads every ``block``). Nothing checked it: B
    stayed "subscribed", vouched "now" for every version it held, and served the page
    A's tag invalidation (over pub/sub) had killed, for the hour a version is held.
    Expected: the subscriber PINGs every ``PING_EVERY`` seconds; with no PONG within
    ``redis.timeout`` it stops vouching and subscribes again (its versions forgotten)."""
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = await ToxicProxy("127.0.0.1", port).start()
    proxy.marker = b"SUBSCRIBE"
    a_config = make_config(redis_url, prefix, NAMESPACES, backplane={"block": "200ms"})
    b_config = make_config(proxy.url, prefix, NAMESPACES, backplane={"block": "200ms"})
    try:
        async with (
            LayeredCache.from_config(a_config) as a,
            LayeredCache.from_config(b_config) as b,
        ):
            await _connected(a, b)
            fallback = b._fallback
            assert fallback is not None
            await asyncio.wait_for(fallback.subscribed.wait(), 5)
            await _cached_book_and_page(b)
            assert proxy.silence_marked() >= 1  # B's subscription: gone, without a word
            _refuse_appends(a)
            await _price_change(a)  # over pub/sub: lost on the way to B
            await asyncio.sleep(PING_EVERY + 0.5)  # found dead within PING_EVERY + timeout
            await _book_and_page_gone_within_l1_ttl(b)
    finally:
        await proxy.stop()

async def test_a_listener_whose_xread_reply_is_late_stops_vouching(
    redis_url: str, prefix: str, late_replies: ReplyDelayProxy
) -> None:
    """Stalled inside its XREAD rather than before it (a congested link, a relay holding
    replies; a connection that died silently looks the same until the deadline): an
    XREAD in flight vouched "now" however old. Past its BLOCK it no longer does."""
    a_config = make_config(redis_url, prefix, NAMESPACES, backplane={"block": "200ms"})
    b_config = make_config(late_replies.url, prefix, NAMESPACES, backplane={"block": "200ms"})
    async with LayeredCache.from_config(a_config) as a, LayeredCache.from_config(b_config) as b:
        await _connected(a, b)
        await _cached_book_and_page(b)
        late_replies.match, late_replies.delay = b"XREAD", 1.0
        await asyncio.sleep(0.5)  # B's listener waits for a late reply
        await _price_change(a)
        await _book_and_page_gone_within_l1_ttl(b)


async def test_a_namespace_without_l1_asks_nothing_again_while_the_fleet_writes(
    redis_url: str, prefix: str
) -> None:
    """Without L1 a version was trusted only while an XREAD waited: each entry any
    instance wrote opened a window (applying it, the coalesce pause) in which B's reads
    asked Redis again, ~1 in 5 reads. Such a namespace now allows ``NO_L1_ALLOWANCE``
    (50 ms) past the listener's last word. (A few asks are tolerated: a starved CI
    machine can stretch that window past 50 ms.)"""
    namespaces = {
        "book": {"key": "book:{id}", "l1": False},
        "category": {"key": "category:{slug}", "tags": True, "l1": False},
    }
    config = make_config(redis_url, prefix, namespaces)
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        await _connected(a, b)
        page = _page("scifi", [42])
        await b.get_or_load("category", {"slug": "scifi"}, CountingLoader(page), tags=_tags_of)
        fetches = _count_fetches(b)
        for i in range(100):
            await a.set("book", {"id": i}, {"id": i})  # another instance writes: an entry
            for pause in (0.0, 0.0005, 0.001, 0.002):  # reads at any moment after it
                await asyncio.sleep(pause)
                assert await b.get("category", {"slug": "scifi"}) == page
        assert fetches[0] <= 8  # of 400 reads (before: 67-100)


# The L1 copy of a tagged L2 hit (``Fills.fill_l1``): a 1 s L1 TTL, so that the read late
# in the versions' trust and the check past the key invalidation's bound are far apart.
SLOW_L1_TTL = 1.0
SLOW_NAMESPACES = {
    name: {**spec, "l1": {"ttl": f"{SLOW_L1_TTL}s", "jitter": 0}}
    for name, spec in NAMESPACES.items()
}


async def _sleep_until(moment: float) -> None:
    await asyncio.sleep(max(0.0, moment - time.monotonic()))


async def _read_poetry(cache: LayeredCache, many: bool) -> Any:
    if many:
        return (await cache.get_many("category", [{"slug": "poetry"}]))[0]
    return await cache.get("category", {"slug": "poetry"})


async def _dead_page_gone_with_the_book(b: LayeredCache, invalidated: float) -> None:
    """At 1.25 x the L1 TTL after the price change the book is gone from B (the key
    invalidation's bound), and the dead page with it."""
    await _sleep_until(invalidated + 1.25 * SLOW_L1_TTL)
    assert await b.get("book", {"id": 42}) is None
    page = await b.get("category", {"slug": "poetry"})
    assert page is None, (
        f"{time.monotonic() - invalidated:.2f}s after invalidate_tag (L1 TTL {SLOW_L1_TTL}s)"
        f" B still serves the dead page {page}"
    )


@pytest.mark.parametrize("many", [False, True], ids=["get", "get_many"])
async def test_without_the_backplane_a_tagged_l2_hit_copied_late_in_its_versions_trust_dies_in_time(
    redis_url: str, prefix: str, many: bool
) -> None:
    """docs/tags.md: "with the backplane off, [...] a tag invalidation stops the dead L2
    entry within the namespace's L1 TTL, as a key invalidation does".

    B caches book 42 and page scifi tagged book:42 (fetching the tag's version at f). A
    writes page poetry tagged book:42, then invalidates the book and the tag at T. Just
    before f + L1 TTL B reads poetry from L2: its version still trusted, it is served
    and copied into B's L1. At T + 1.25 x the L1 TTL the book is gone from B; the page
    was still served from L1, until about f + 2 x the L1 TTL: ``Fills.fill_l1`` gave
    the copy a whole L1 TTL from the read, though the version it was judged by was
    trusted only for what was left of the L1 TTL since its fetch. The copy now lives
    its L1 TTL counted from the fetch (``TagVersions.unvouched_for``)."""
    config = make_config(redis_url, prefix, SLOW_NAMESPACES, backplane={"enabled": False})
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        await _cached_book_and_page(b)
        fetched = b._rt.versions._fetched_at["book:42"]
        await a.set("category", {"slug": "poetry"}, _page("poetry", [42]), tags=["book:42"])
        await _price_change(a)
        invalidated = time.monotonic()
        await _sleep_until(fetched + 0.8 * SLOW_L1_TTL)
        assert time.monotonic() < fetched + SLOW_L1_TTL
        assert await _read_poetry(b, many) is not None  # an L2 hit B still trusts
        await _dead_page_gone_with_the_book(b, invalidated)


async def test_with_a_stalled_listener_a_tagged_l2_hit_copied_late_in_its_versions_trust_dies_in_time(
    redis_url: str, prefix: str
) -> None:
    """docs/tags.md: "with [...] this instance's listener stalled [...] a tag
    invalidation stops the dead L2 entry within the namespace's L1 TTL".

    B's listener held at its next XREAD; A writes page poetry tagged book:42 and
    invalidates the book and the tag at T. B trusts its version until its fetch or the
    listener's last caught-up read, the later, plus the L1 TTL; just before that it
    reads poetry from L2 and copies it into L1. The copy lived a whole L1 TTL from the
    read, past T + 1.25 x the L1 TTL when the book was long gone; it now lives the L1
    TTL counted from the listener's last word."""
    config = make_config(redis_url, prefix, SLOW_NAMESPACES, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        await _connected(a, b)
        await _cached_book_and_page(b)
        gate = stall_listener(b)
        try:
            await asyncio.sleep(0.4)  # B's listener is held at its next XREAD
            assert b._backplane is not None
            fetched = b._rt.versions._fetched_at["book:42"]
            vouched_until = max(fetched, b._backplane._link._caught_up_at) + SLOW_L1_TTL
            await a.set("category", {"slug": "poetry"}, _page("poetry", [42]), tags=["book:42"])
            await _price_change(a)
            invalidated = time.monotonic()
            await _sleep_until(vouched_until - 0.15)
            assert time.monotonic() < vouched_until
            assert await _read_poetry(b, many=False) is not None  # an L2 hit B trusts
            await _dead_page_gone_with_the_book(b, invalidated)
        finally:
            gate.set()


async def test_a_vouched_l2_hit_or_a_fresh_load_keeps_its_whole_l1_ttl(
    redis_url: str, prefix: str
) -> None:
    """What the L1 copy's shortening leaves alone: with a healthy backplane a tagged L2
    hit is copied for its whole L1 TTL (the listener vouches as of now), and so, with
    the backplane off, is a value just loaded here late in its version's trust (loaded
    under a lease ``invalidate_tag`` revokes: not a dead entry)."""
    healthy = make_config(redis_url, prefix, SLOW_NAMESPACES)
    off = make_config(redis_url, prefix, SLOW_NAMESPACES, backplane={"enabled": False})
    async with LayeredCache.from_config(healthy) as a, LayeredCache.from_config(off) as b:
        await _connected(a)
        await _cached_book_and_page(a)
        a.namespace("category").policy.l1.clear()  # type: ignore[union-attr]
        await asyncio.sleep(0.5 * SLOW_L1_TTL)  # the version fetched a while ago
        assert await a.get("category", {"slug": "scifi"}) is not None  # an L2 hit
        assert _l1_ttl_left(a, f"{prefix}category:scifi") > 0.9 * SLOW_L1_TTL
        await _cached_book_and_page(b)
        fetched = b._rt.versions._fetched_at["book:42"]
        await _sleep_until(fetched + 0.8 * SLOW_L1_TTL)
        page = CountingLoader(_page("poetry", [42]))
        await b.get_or_load("category", {"slug": "poetry"}, page, tags=_tags_of)
        assert _l1_ttl_left(b, f"{prefix}category:poetry") > 0.9 * SLOW_L1_TTL


def _l1_ttl_left(cache: LayeredCache, key: str) -> float:
    l1 = cache.namespace("category").policy.l1
    assert l1 is not None
    remaining = l1.remaining_ttl(key)
    assert remaining is not None
    return remaining


async def test_a_tagged_set_into_an_l1_only_namespace_late_in_its_versions_trust_keeps_its_l1_ttl(
    redis_url: str, prefix: str
) -> None:
    """With `l2 = false` L1 is all there is: a tagged `set()` whose versions were held
    (fetched 0.8 of the L1 TTL ago, backplane off) stored its values for the fifth of
    the L1 TTL left on them, as if they were dead entries judged late: written values
    are not judged (``fill_l1(loaded=True)``, as a load's)."""
    local = {"key": "page:{slug}", "tags": True, "l2": False,
             "l1": {"ttl": f"{SLOW_L1_TTL}s", "jitter": 0}}
    off = make_config(redis_url, prefix, {"page": local}, backplane={"enabled": False})
    async with LayeredCache.from_config(off) as cache:
        await cache.set("page", {"slug": "a"}, 1, tags=["book:42"])
        fetched = cache._rt.versions._fetched_at["book:42"]
        await _sleep_until(fetched + 0.8 * SLOW_L1_TTL)
        await cache.set("page", {"slug": "b"}, 2, tags=["book:42"])
        l1 = cache.namespace("page").policy.l1
        assert l1 is not None
        assert (l1.remaining_ttl(f"{prefix}page:b") or 0) > 0.9 * SLOW_L1_TTL
