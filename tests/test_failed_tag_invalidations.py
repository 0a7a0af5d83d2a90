"""A tag invalidation that fails part way: ``invalidate_tag`` raises ``L2Unavailable``,
the caller retries (the daemon retries a failed batch before it commits), and the
retry must still do everything the failed attempt left undone."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from layered_cache import Config, LayeredCache, _tags
from layered_cache._keys import loading_set_name
from layered_cache._l2 import L2Store, L2Unavailable
from layered_cache.daemon.deletes import Deleter
from layered_cache.daemon.stats import DaemonStats
from tests.faults.reply_delay import ReplyDelayProxy
from tests.helpers import CountingLoader, make_config

NAMESPACES = {"category": {"key": "category:{slug}", "tags": True}}


def _page(edition: int) -> dict[str, Any]:
    return {"slug": "scifi", "books": [42], "edition": edition}


def _tags_of(page: Mapping[str, Any]) -> list[str]:
    return [f"book:{b}" for b in page["books"]]


def _fail_once_after_reading_the_loading_set(store: L2Store, prefix: str, how: str) -> None:
    """The first attempt fails once it has read the loading set: the reply of that read
    is lost (it ran in Redis), or the DEL of the leases is refused."""
    loading = loading_set_name(prefix)
    real_guard, real_delete = store.guard, store.delete
    failed = False

    async def guard(operation: Any, name: str | None = None, names: Any = ()) -> Any:
        nonlocal failed
        result = await real_guard(operation, name, names)
        if how == "reply_lost" and name == loading and not failed:
            failed = True
            raise L2Unavailable("TimeoutError: Timeout reading from socket")
        return result

    async def delete(names: Sequence[str | bytes]) -> int:
        nonlocal failed
        leases = any(str(n).endswith(":lease") for n in names)
        if how == "lease_delete_failed" and leases and not failed:
            failed = True
            raise L2Unavailable("ConnectionError: Connection reset by peer")
        return await real_delete(names)

    store.guard = guard  # type: ignore[method-assign]
    store.delete = delete  # type: ignore[method-assign]


@pytest.mark.parametrize("server", ["node", "cluster"])
@pytest.mark.parametrize("via", ["cache", "daemon"])
@pytest.mark.parametrize("how", ["reply_lost", "lease_delete_failed"])
async def test_a_retried_invalidate_tag_still_revokes_the_loads_its_failed_attempt_took(
    request: pytest.FixtureRequest, prefix: str, how: str, via: str, server: str
) -> None:
    if server == "cluster":
        url, extra = request.getfixturevalue("redis_cluster").url, {"cluster": True}
    else:
        url, extra = request.getfixturevalue("redis_url"), {}
    config = make_config(url, prefix, NAMESPACES, redis=extra)
    deleter = Deleter(config)
    try:
        await _invalidate_twice_while_loading(config, deleter, how, via)
    finally:
        await deleter.close()


async def _invalidate_twice_while_loading(
    config: Config, deleter: Deleter, how: str, via: str
) -> None:
    gate, started = asyncio.Event(), asyncio.Event()

    async def old_page() -> dict[str, Any]:
        started.set()
        await gate.wait()
        return _page(1)  # read from the database before the price change

    async with (
        LayeredCache.from_config(config) as loader_side,
        LayeredCache.from_config(config) as invalidator,
        LayeredCache.from_config(config) as reader,
    ):

        async def invalidate() -> None:  # the app's call, or the daemon's batch
            if via == "cache":
                await invalidator.invalidate_tag("book:42")
            else:
                await deleter.delete([], DaemonStats(), tags=["book:42"])

        loading = asyncio.ensure_future(
            loader_side.get_or_load("category", {"slug": "scifi"}, old_page, tags=_tags_of)
        )
        await asyncio.wait_for(started.wait(), 5)
        store = invalidator._rt.store if via == "cache" else deleter._store
        _fail_once_after_reading_the_loading_set(store, config.redis.prefix, how)
        with pytest.raises(L2Unavailable):
            await invalidate()
        await invalidate()  # the documented retry (the daemon's, before it commits)
        gate.set()
        await loading
        fresh = CountingLoader(_page(2))
        page = await reader.get_or_load("category", {"slug": "scifi"}, fresh, tags=_tags_of)
        assert page["edition"] == 2, "a load that began before invalidate_tag landed"


async def test_a_failed_invalidate_tag_still_drops_the_local_copy_read_while_it_ran(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``invalidate_tag`` raises ``L2Unavailable`` "(local copies are dropped
    regardless)": also a copy a read here put in L1 while the new version was being
    written, when the announcement then fails."""
    namespaces = {"category": {"key": "category:{slug}", "tags": True, "l1": {"ttl": "60s"}}}
    config = make_config(redis_url, prefix, namespaces)
    async with LayeredCache.from_config(config) as cache:
        await cache.set("category", {"slug": "scifi"}, _page(1), tags=["book:42"])
        l1 = cache.namespace("category").policy.l1
        assert l1 is not None
        l1.clear()  # the page in L2 only
        taking, go_on = asyncio.Event(), asyncio.Event()
        real_take = _tags.take_loading

        async def paused_take(store: L2Store, prefix_: str) -> None:
            taking.set()
            await go_on.wait()
            await real_take(store, prefix_)

        async def announcement_refused(versions: Mapping[str, str]) -> bool:
            raise redis.exceptions.ConnectionError("stream and pub/sub both unreachable")

        monkeypatch.setattr(_tags, "take_loading", paused_take)
        monkeypatch.setattr(cache._rt.invalidator, "announce_tags", announcement_refused)
        invalidating = asyncio.ensure_future(cache.invalidate_tag("book:42"))
        await asyncio.wait_for(taking.wait(), 5)
        # A request reads the page meanwhile: L2 holds it, its version still current.
        assert (await cache.get("category", {"slug": "scifi"}))["edition"] == 1
        go_on.set()
        with pytest.raises(L2Unavailable):
            await invalidating
        # The new version is in Redis: another instance loads the page again...
        async with LayeredCache.from_config(config) as fresh:
            page = await fresh.get_or_load(
                "category", {"slug": "scifi"}, CountingLoader(_page(2)), tags=_tags_of
            )
            assert page["edition"] == 2
        # ...and this one does not serve the dead page from its L1.
        page = await cache.get("category", {"slug": "scifi"})
        assert page is None or page["edition"] == 2, page


async def test_an_invalidate_tag_whose_new_version_landed_unheard_serves_no_dead_entry_here(
    redis_url: str, prefix: str
) -> None:
    """The new version's SET ran but its reply was lost: invalidate_tag raised, and this
    instance went on trusting the old version it remembered, serving the dead page from
    L2 (and back into L1) until a retry, though Redis held the new one."""
    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as cache:
        page = {"slug": "scifi"}
        await cache.get_or_load("category", page, CountingLoader(_page(1)), tags=_tags_of)
        store = cache._store
        real_guard = store.guard
        seen_loading = False

        async def guard(operation: Any, name: str | None = None, names: Any = ()) -> Any:
            nonlocal seen_loading
            result = await real_guard(operation, name, names)
            if name == loading_set_name(prefix):
                seen_loading = True
            elif seen_loading and name is None:  # the new version's SET: it ran
                seen_loading = False
                raise L2Unavailable("TimeoutError: Timeout reading from socket")
            return result

        store.guard = guard  # type: ignore[method-assign]
        with pytest.raises(L2Unavailable):
            await cache.invalidate_tag("book:42")
        store.guard = real_guard  # type: ignore[method-assign]
        assert await cache.get("category", page) is None


async def test_tagged_loads_whose_registration_reply_was_late_leave_no_member_behind(
    late_replies: ReplyDelayProxy, redis_client: aioredis.Redis, prefix: str
) -> None:
    """docs/operations.md: the loading set (no TTL) holds "one member per tagged load in
    flight". A tagged load's SADD whose reply came after ``redis.timeout`` had landed,
    and the load only gave its lease back (loading without writing L2): its member
    stayed for good, until some ``invalidate_tag`` ran. 30 such loads left 30."""
    namespaces = {"book": {"key": "book:{id}", "tags": True, "l1": False}}
    config = make_config(
        late_replies.url, prefix, namespaces,
        redis={"timeout": "200ms", "breaker": {"failures": 1000, "reset": "300ms"}},
        backplane={"enabled": False},
    )
    async with LayeredCache.from_config(config) as cache:
        late_replies.match, late_replies.delay = b"SADD", 0.5
        for i in range(30):

            async def load(i: int = i) -> dict[str, int]:
                return {"id": i}

            assert await cache.get_or_load("book", {"id": i}, load, tags=[f"book:{i}"]) == {"id": i}
        late_replies.match = None
        await asyncio.sleep(1.0)  # the late replies arrive, background work settles
        members = await redis_client.scard(loading_set_name(prefix))
    assert members == 0, f"no tagged load in flight, yet the loading set holds {members}"
