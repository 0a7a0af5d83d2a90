"""What ``CachedResponses`` tells a gateway when the value it serves is not the cache's
current one: a load a write overtook (its purge already went out) must not be kept; a
value stored nowhere (not encodable) may change in place and gets its ETag from its body;
the tags header carries only tags the cache would accept. Found by a review, each failed
before its fix. Real Redis, the ASGI app through httpx."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from examples.bookstore.db import SQLiteDatabase
from layered_cache import LayeredCache, parse_config
from layered_cache.asgi import CachedResponses
from tests.helpers import eventually
from tests.test_example import _config as bookstore_config
from tests.test_example import running

pytestmark = pytest.mark.timeout(60)


class Recording:
    """A purger that records when each purge was accepted."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, list[str], list[str]]] = []

    async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
        self.calls.append((time.monotonic(), list(keys), list(tags)))


def _config(redis_url: str, prefix: str, purge: dict[str, Any] | None = None) -> Any:
    return parse_config(
        {
            "redis": {"url": redis_url, "prefix": prefix, "timeout": "2s"},
            "purge": purge or {"repeat_after": "0s"},
            "namespaces": {"book": {"key": "book:{id}", "http": {"s_maxage": "30s"}}},
        },
        env={},
    )


@contextlib.asynccontextmanager
async def _client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


async def test_a_load_an_invalidation_overtook_is_served_but_no_gateway_may_keep_it(
    redis_url: str, prefix: str
) -> None:
    """The load read the old row; the writer committed and invalidated; the purge and its
    repeat went out; then the load returned. Its caller gets the old price (its read
    began first), marked no-store: with s-maxage a gateway kept it 30 s, past every
    purge (docs/http.md: the bound with purging is the purge delay)."""
    purger = Recording()
    catalogue = {1: {"id": 1, "price": "9.90"}}
    read_old_row, release = asyncio.Event(), asyncio.Event()
    config = _config(redis_url, prefix, purge={"repeat_after": "200ms"})
    async with LayeredCache.from_config(config, purger=purger) as cache:
        responses = CachedResponses(cache)

        async def book(request: Request) -> Response:
            async def load() -> Any:
                row = dict(catalogue[1])  # the SELECT ran: it saw the old price
                read_old_row.set()
                await release.wait()  # the rest of a slow query
                return row

            return await responses.respond(request, "book", {"id": 1}, load)

        app = Starlette(routes=[Route("/books/1", book)])
        async with _client(app) as client:
            gateway_fetch = asyncio.create_task(client.get("/books/1"))
            await read_old_row.wait()
            catalogue[1]["price"] = "1.00"  # the writer: commit, then invalidate
            await cache.invalidate("book", {"id": 1})
            # The purge and its repeat are out.
            assert await eventually(lambda: cache.purge_stats().repeated == 1, timeout=5)
            release.set()
            reply = await gateway_fetch
            fresh = await client.get("/books/1")
    assert reply.status_code == 200 and reply.json()["price"] == "9.90"
    assert reply.headers["cache-control"] == "no-store"
    assert "etag" not in reply.headers
    assert fresh.json()["price"] == "1.00"
    assert fresh.headers["cache-control"] == "public, max-age=0, s-maxage=30"


async def test_a_load_a_set_of_this_instance_overtook_is_not_kept_either(
    redis_url: str, prefix: str
) -> None:
    """The same with ``set()`` as the write: it replaces the key (no fill is revoked
    when the set lands first, but this instance saw the key change while it loaded)."""
    read_old_row, release = asyncio.Event(), asyncio.Event()
    async with LayeredCache.from_config(_config(redis_url, prefix)) as cache:
        responses = CachedResponses(cache)

        async def book(request: Request) -> Response:
            async def load() -> Any:
                read_old_row.set()
                await release.wait()
                return {"id": 1, "price": "9.90"}

            return await responses.respond(request, "book", {"id": 1}, load)

        app = Starlette(routes=[Route("/books/1", book)])
        async with _client(app) as client:
            gateway_fetch = asyncio.create_task(client.get("/books/1"))
            await read_old_row.wait()
            await cache.set("book", {"id": 1}, {"id": 1, "price": "1.00"})
            release.set()
            reply = await gateway_fetch
    assert reply.json()["price"] == "9.90"
    assert reply.headers["cache-control"] == "no-store"


async def test_a_value_that_cannot_be_stored_changed_in_place_gets_a_new_etag(
    redis_url: str, prefix: str
) -> None:
    """A 128-bit int: JSON renders it, msgpack can't encode it, so nothing is cached and
    the loader's own object comes back each time. Its owner (an identity map) changed
    it in place: the ETag memo, keyed on identity, answered a 304 for a changed body."""
    catalogue = {1: {"id": 1, "uuid": 2**100, "price": "9.90"}}  # an identity map
    async with LayeredCache.from_config(_config(redis_url, prefix)) as cache:
        responses = CachedResponses(cache)

        async def book(request: Request) -> Response:
            async def load() -> Any:
                return catalogue[1]

            return await responses.respond(request, "book", {"id": 1}, load)

        app = Starlette(routes=[Route("/books/1", book)])
        async with _client(app) as client:
            first = await client.get("/books/1")
            catalogue[1]["price"] = "1.00"  # the same object, changed
            second = await client.get("/books/1")
            revalidated = await client.get(
                "/books/1", headers={"If-None-Match": first.headers["etag"]}
            )
    assert second.json()["price"] == "1.00"
    assert second.headers["etag"] != first.headers["etag"]
    assert revalidated.status_code == 200


async def test_a_tag_a_hit_would_send_unchecked_is_refused_as_a_miss_refuses_it(
    redis_url: str, prefix: str
) -> None:
    """On a hit the cache never calls the tags function: ``"scifi,poetry"`` went out as
    two tags in ``X-Cache-Tags`` (a ``BAN`` of ``scifi`` would match the page). Now it
    is the ValueError a miss raises."""
    config = parse_config(
        {
            "redis": {"url": redis_url, "prefix": prefix, "timeout": "2s"},
            "namespaces": {"category": {"key": "category:{slug}", "tags": True}},
        },
        env={},
    )
    async with LayeredCache.from_config(config) as cache:
        responses = CachedResponses(cache)
        page = {"slug": "x", "shelves": ["scifi,poetry"]}
        await cache.set("category", {"slug": "x"}, page, tags=["shelf:x"])

        async def category(request: Request) -> Response:
            return await responses.respond(
                request, "category", {"slug": "x"}, lambda: _never(), tags=lambda p: p["shelves"]
            )

        app = Starlette(routes=[Route("/categories/x", category)])
        async with _client(app) as client:
            with pytest.raises(ValueError, match="scifi,poetry"):
                await client.get("/categories/x")


async def _never() -> Any:
    raise AssertionError("a hit runs no loader")


async def test_the_bookstore_category_page_carries_its_policy_etag_and_book_tags(
    redis_url: str, prefix: str
) -> None:
    """The category page went out as bare JSON: no Cache-Control (a gateway applies its
    own default TTL), no ETag, and no X-Cache-Tags for a price change's ban to find."""
    database = SQLiteDatabase(":memory:", books=50, query_delay=0.0)
    await database.open()
    try:
        async with running(bookstore_config(redis_url, prefix), database) as client:
            reply = await client.get("/categories/scifi")
            again = await client.get(
                "/categories/scifi", headers={"If-None-Match": reply.headers["etag"]}
            )
    finally:
        await database.close()
    assert reply.status_code == 200 and reply.json()["books"]
    assert reply.headers["cache-control"] == "no-cache"
    book_ids = [book["id"] for book in reply.json()["books"]]
    assert reply.headers["x-cache-tags"] == "," + ",".join(f"book:{i}" for i in book_ids) + ","
    assert again.status_code == 304


async def test_a_response_joining_a_batch_load_an_invalidation_overtook_is_not_kept(
    redis_url: str, prefix: str
) -> None:
    """A batch (get_or_load_many) loads book 1; a CachedResponses request for book 1
    joins its flight; the book is invalidated while load_many runs (its purge goes
    out). The batch's fill is revoked, yet ``BatchPath._claimed`` settles the flight
    with ``Served(loaded[key])`` (superseded=False): the joined response goes out with
    ``s-maxage=30`` and a gateway keeps the old price past every purge. The same
    request leading its own load gets no-store (test_http_responses)."""
    started, release = asyncio.Event(), asyncio.Event()

    async def load_many(missing: list[Mapping[str, object]]) -> list[Any]:
        started.set()
        await release.wait()
        return [{"id": f["id"], "price": "9.90"} for f in missing]

    async with LayeredCache.from_config(_config(redis_url, prefix)) as cache:
        responses = CachedResponses(cache)
        stats = cache.namespace("book").policy.stats
        joined: list[str] = []
        do = cache._rt.flight.do

        async def recorded(key: str, fn: Any) -> Any:
            joined.append(key)
            return await do(key, fn)

        cache._rt.flight.do = recorded  # type: ignore[method-assign]

        async def book(request: Request) -> Response:
            async def load() -> Any:
                raise AssertionError("joins the batch's flight")

            return await responses.respond(request, "book", {"id": 1}, load)

        app = Starlette(routes=[Route("/books/1", book)])
        async with _client(app) as client:
            batch = asyncio.create_task(cache.get_or_load_many("book", [{"id": 1}], load_many))
            await started.wait()
            gateway_fetch = asyncio.create_task(client.get("/books/1"))
            # The request is in the flight's queue (it joins: the batch holds the key).
            assert await eventually(lambda: joined, timeout=5)
            await asyncio.sleep(0.05)
            await cache.invalidate("book", {"id": 1})  # the price changed: purge sent
            release.set()
            await batch
            reply = await gateway_fetch
        assert stats.coalesced == 1  # the request joined the batch's flight
        assert stats.fill_revoked == 1  # the cache itself knows the load was overtaken
    assert reply.json()["price"] == "9.90"
    assert reply.headers["cache-control"] == "no-store"


def _l1_less_config(redis_url: str, prefix: str, l1: bool = False) -> Any:
    """``book`` without L1 (``l1 = false``), a lease wait of 200 ms, purges repeated."""
    return parse_config(
        {
            "redis": {"url": redis_url, "prefix": prefix, "timeout": "2s"},
            "purge": {"repeat_after": "200ms"},
            "namespaces": {
                "book": {
                    "key": "book:{id}",
                    "l1": l1,
                    "stampede": {"max_wait": "200ms", "lease_ttl": "10s"},
                    "http": {"s_maxage": "30s"},
                }
            },
        },
        env={},
    )


async def _hold_lease(redis_url: str, key: str) -> None:
    """A load of ``key`` in another process holds its lease (a slow load of its own)."""
    other = aioredis.from_url(redis_url)
    try:
        await other.set("{" + key + "}:lease", "another-process", px=10_000)
    finally:
        await other.aclose()


async def _unleased_load_overtaken(
    redis_url: str, prefix: str, write: Callable[[LayeredCache], Awaitable[None]], l1: bool
) -> httpx.Response:
    """Our request waits ``max_wait`` on the other process's lease, then loads without
    one (nothing revokes such a load) and reads the old row; the writer commits and
    writes on this instance (its purge and the repeat go out); then the load returns."""
    read_old_row, release = asyncio.Event(), asyncio.Event()
    config = _l1_less_config(redis_url, prefix, l1)
    async with LayeredCache.from_config(config, purger=Recording()) as cache:
        responses = CachedResponses(cache)
        await _hold_lease(redis_url, cache.key("book", {"id": 1}))

        async def book(request: Request) -> Response:
            async def load() -> Any:
                row = {"id": 1, "price": "9.90"}  # the SELECT ran: the old price
                read_old_row.set()
                await release.wait()
                return row

            return await responses.respond(request, "book", {"id": 1}, load)

        app = Starlette(routes=[Route("/books/1", book)])
        async with _client(app) as client:
            gateway_fetch = asyncio.create_task(client.get("/books/1"))
            await asyncio.wait_for(read_old_row.wait(), 10)
            await write(cache)
            assert await eventually(lambda: cache.purge_stats().repeated == 1, timeout=5)
            release.set()
            return await gateway_fetch


async def _invalidate(cache: LayeredCache) -> None:
    await cache.invalidate("book", {"id": 1})


async def _set(cache: LayeredCache) -> None:
    await cache.set("book", {"id": 1}, {"id": 1, "price": "1.00"})


@pytest.mark.parametrize("l1", [False, True], ids=["without_l1", "with_l1"])
@pytest.mark.parametrize("write", [_invalidate, _set], ids=["invalidate", "set"])
async def test_an_unleased_load_a_write_of_this_instance_overtook_is_no_store_without_l1_too(
    redis_url: str, prefix: str, write: Callable[[LayeredCache], Awaitable[None]], l1: bool
) -> None:
    """With ``l1 = false`` nothing recorded "this instance saw the key invalidated" (only
    L1 tombstones did): the old price went out ``public, max-age=0, s-maxage=30`` with
    an ETag after the purge and its repeat, and a gateway kept it 30 s. With L1 it was
    no-store already (the control)."""
    reply = await _unleased_load_overtaken(redis_url, prefix, write, l1)
    assert reply.json()["price"] == "9.90"  # the caller may have it: its read began first
    assert reply.headers["cache-control"] == "no-store"
    assert "etag" not in reply.headers


async def test_without_l1_an_l2_hit_an_invalidate_of_this_instance_overtook_is_no_store(
    redis_url: str, prefix: str, late_replies: Any
) -> None:
    """The common path of an ``l1 = false`` namespace, an L2 hit: Redis answered the GET
    with the old price, the reply is late on the wire; meanwhile this instance's
    invalidate() deletes the key and its purge and repeat go out; then the reply
    arrives. It went out with ``s-maxage=30``: with L1 the tombstone marks the same
    race, without it nothing did."""
    config = _l1_less_config(late_replies.url, prefix)
    async with LayeredCache.from_config(config, purger=Recording()) as cache:
        responses = CachedResponses(cache)
        await cache.set("book", {"id": 1}, {"id": 1, "price": "9.90"})
        key = cache.key("book", {"id": 1}).encode()

        async def book(request: Request) -> Response:
            return await responses.respond(request, "book", {"id": 1}, _never)

        app = Starlette(routes=[Route("/books/1", book)])
        late_replies.match = b"GET\r\n$%d\r\n%s\r\n" % (len(key), key)
        late_replies.delay = 1.2
        async with _client(app) as client:
            gateway_fetch = asyncio.create_task(client.get("/books/1"))
            assert await eventually(lambda: late_replies.matched == 1, timeout=5)
            late_replies.match = None
            await asyncio.sleep(0.1)  # Redis has answered the GET (old price) by now
            await cache.invalidate("book", {"id": 1})  # price changed: purge sent
            assert await eventually(lambda: cache.purge_stats().repeated == 1, timeout=5)
            assert not gateway_fetch.done()
            reply = await gateway_fetch
    assert reply.json()["price"] == "9.90"
    assert reply.headers["cache-control"] == "no-store"
    assert "etag" not in reply.headers


def _tagged_config(redis_url: str, prefix: str, l1: bool) -> Any:
    """``category`` pages tagged with their books, a lease wait of 200 ms."""
    return parse_config(
        {
            "redis": {"url": redis_url, "prefix": prefix, "timeout": "2s"},
            "purge": {"repeat_after": "200ms"},
            "namespaces": {
                "category": {
                    "key": "category:{slug}",
                    "tags": True,
                    "l1": l1,
                    "stampede": {"max_wait": "200ms", "lease_ttl": "10s"},
                    "http": {"s_maxage": "30s"},
                }
            },
        },
        env={},
    )


async def _invalidate_tag_here(cache: LayeredCache, others: LayeredCache, tag: str) -> None:
    await cache.invalidate_tag(tag)  # its BAN goes out, and the repeat
    assert await eventually(lambda: cache.purge_stats().repeated == 1, timeout=5)


async def _invalidate_tag_elsewhere(cache: LayeredCache, others: LayeredCache, tag: str) -> None:
    heard = cache._rt.versions.generation
    await others.invalidate_tag(tag)  # its BAN goes out from there
    # This instance hears of it through the backplane (``Coherence.apply_tags``).
    assert await eventually(lambda: cache._rt.versions.generation > heard, timeout=10)


InvalidateTag = Callable[[LayeredCache, LayeredCache, str], Awaitable[None]]


async def _page_load_overtaken(
    redis_url: str, prefix: str, invalidate_tag: InvalidateTag, tag: str, l1: bool = True
) -> httpx.Response:
    """Another process holds the page's lease; our request loads without one after
    ``max_wait`` and reads book 1's old price; ``tag`` is invalidated (here, or on
    another instance); then the load returns."""
    read_old_rows, release = asyncio.Event(), asyncio.Event()
    config = _tagged_config(redis_url, prefix, l1)
    async with (
        LayeredCache.from_config(config, purger=Recording()) as cache,
        LayeredCache.from_config(config) as others,
    ):
        for each in (cache, others):
            assert each._backplane is not None
            await asyncio.wait_for(each._backplane.connected.wait(), 5)
        responses = CachedResponses(cache)
        await _hold_lease(redis_url, cache.key("category", {"slug": "scifi"}))

        async def category(request: Request) -> Response:
            async def load() -> Any:
                page = {"slug": "scifi", "books": [{"id": 1, "price": "9.90"}]}  # old price
                read_old_rows.set()
                await release.wait()
                return page

            return await responses.respond(
                request, "category", {"slug": "scifi"}, load,
                tags=lambda page: [f"book:{b['id']}" for b in page["books"]],
            )  # fmt: skip

        app = Starlette(routes=[Route("/categories/scifi", category)])
        async with _client(app) as client:
            gateway_fetch = asyncio.create_task(client.get("/categories/scifi"))
            await asyncio.wait_for(read_old_rows.wait(), 10)
            await invalidate_tag(cache, others, tag)  # book 1's price changed
            release.set()
            return await gateway_fetch


@pytest.mark.parametrize("l1", [True, False], ids=["with_l1", "without_l1"])
@pytest.mark.parametrize(
    "invalidate_tag", [_invalidate_tag_here, _invalidate_tag_elsewhere], ids=["here", "elsewhere"]
)
async def test_a_page_load_an_invalidate_tag_overtook_is_no_store(
    redis_url: str, prefix: str, invalidate_tag: InvalidateTag, l1: bool
) -> None:
    """A page load holding no lease (nothing revokes it) that an ``invalidate_tag()``
    of one of its tags overtook, on this instance or heard of through the backplane,
    went out with ``s-maxage=30`` and an ``X-Cache-Tags`` naming the tag, after the
    tag's BAN: ``invalidate_tag`` tombstoned only the keys L1 held, not one loading."""
    reply = await _page_load_overtaken(redis_url, prefix, invalidate_tag, "book:1", l1)
    assert reply.json()["books"][0]["price"] == "9.90"  # the caller may have it
    assert reply.headers["cache-control"] == "no-store", reply.headers.get("x-cache-tags")
    assert "etag" not in reply.headers


async def test_a_page_load_another_tags_invalidation_overtook_may_be_kept(
    redis_url: str, prefix: str
) -> None:
    """The control: a tag the page doesn't carry invalidated meanwhile leaves it as it
    was, cacheable (only the tags of what was loaded are judged)."""
    reply = await _page_load_overtaken(redis_url, prefix, _invalidate_tag_here, "book:2")
    assert reply.headers["cache-control"] == "public, max-age=0, s-maxage=30"
    assert reply.headers["x-cache-tags"] == ",book:1,"


TAGGED_PAGE = {"slug": "scifi", "books": [{"id": 1, "price": "9.90"}]}


def _untagged_l1_config(redis_url: str, prefix: str) -> Any:
    return parse_config(
        {
            "redis": {"url": redis_url, "prefix": prefix, "timeout": "2s"},
            "namespaces": {
                "category": {
                    "key": "category:{slug}",
                    "tags": True,
                    "l1": False,
                    "http": {"s_maxage": "30s"},
                }
            },
        },
        env={},
    )


async def _no_loader() -> Any:
    raise AssertionError("an L2 hit runs no loader")


def _no_list(page: Any) -> Any:
    return None  # a bug in the tags function: no list


async def test_a_tags_function_error_on_an_l2_hit_is_raised_even_if_a_tag_was_invalidated_meanwhile(
    prefix: str, late_replies: Any
) -> None:
    """Found by a review of this session's fix (2026-12-06). docs/tags.md: a tags
    function that returns no list is a TypeError, also on a hit (docs/http.md). The
    same L2 hit answered 200 no-store instead, only because an unrelated tag was
    invalidated while its GET was on the wire (``_served._tag_overtaken`` swallowed it)."""
    config = _untagged_l1_config(late_replies.url, prefix)
    async with LayeredCache.from_config(config) as cache:
        responses = CachedResponses(cache)
        await cache.set("category", {"slug": "scifi"}, TAGGED_PAGE, tags=["book:1"])
        key = cache.key("category", {"slug": "scifi"}).encode()

        async def category(request: Request) -> Response:
            return await responses.respond(
                request, "category", {"slug": "scifi"}, _no_loader, tags=_no_list
            )

        app = Starlette(routes=[Route("/categories/scifi", category)])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            # The control: a plain L2 hit raises the tags function's error.
            with pytest.raises(TypeError, match="tags function must return a list"):
                await client.get("/categories/scifi")
            # The same hit, while an unrelated tag is invalidated during its GET.
            late_replies.match = b"GET\r\n$%d\r\n%s\r\n" % (len(key), key)
            late_replies.delay = 1.0
            fetch = asyncio.create_task(client.get("/categories/scifi"))
            assert await eventually(lambda: late_replies.matched == 1, timeout=5)
            late_replies.match = None
            await cache.invalidate_tag("book:999")  # a tag this page doesn't carry
            try:
                reply = await fetch
            except TypeError:
                return  # raised, as on the plain hit: the promise holds
            pytest.fail(
                f"the tags function's TypeError was swallowed: {reply.status_code} "
                f"Cache-Control: {reply.headers.get('cache-control')}"
            )
