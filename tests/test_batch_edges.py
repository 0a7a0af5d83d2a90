"""Batches against their own promises where they meet single-key paths, late replies and
cancellation (found by a review; each failed before its fix): a batch that raised runs
nothing on; a load_many of the wrong shape is raised whichever way it was called; a
tagged load cancelled as it registers leaves nothing in the loading set."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
import redis.asyncio as redis

from layered_cache import LayeredCache
from layered_cache._keys import lease_name, loading_set_name
from tests.faults.reply_delay import ReplyDelayProxy
from tests.helpers import eventually, make_config


async def test_a_batch_that_raised_while_joining_leaves_no_join_running_that_calls_load_many(
    redis_url: str, prefix: str
) -> None:
    """README, "Batches keep every single-key guarantee": "a batch that raises leaves
    nothing running that would call `load_many` after it".

    Batch X joins two keys other callers of this process are loading (``theirs``):
    key 1 (a batch P waiting for another process's lease) and key 2 (a get_or_load whose
    loader is about to fail). P's client goes away: X's join of key 1 falls to the
    single-key path, which waits for the foreign lease. Then key 2's load fails: X
    raises at once (``asyncio.gather`` in ``BatchPath._claimed``), but its join of key 1
    runs on and, after ``max_wait``, calls X's ``load_many([key 1])`` for nobody."""
    ns = {"book": {"key": "book:{id}", "stampede": {"lease_ttl": "5s", "max_wait": "1s"}}}
    admin = redis.Redis.from_url(redis_url)
    x_calls: list[list[object]] = []

    async def load_x(missing: list[Mapping[str, object]]) -> list[str]:
        x_calls.append([f["id"] for f in missing])
        return [f"x{f['id']}" for f in missing]

    async def load_p(missing: list[Mapping[str, object]]) -> list[str]:
        return [f"p{f['id']}" for f in missing]

    fail = asyncio.Event()

    async def key2_loader() -> str:
        await fail.wait()
        raise RuntimeError("database error for key 2")

    async with LayeredCache.from_config(make_config(redis_url, prefix, ns)) as cache:
        stats = cache.namespace("book").policy.stats
        waits: list[str] = []  # keys that began waiting for a foreign lease's fill
        wait_for_fill = cache._rt.leases.wait_for_fill

        async def counted(key: str, *args: Any, **kwargs: Any) -> Any:
            waits.append(key)
            return await wait_for_fill(key, *args, **kwargs)

        cache._rt.leases.wait_for_fill = counted  # type: ignore[method-assign]
        await admin.set(lease_name(cache.key("book", {"id": 1})), "another process", px=5000)
        p = asyncio.create_task(cache.get_or_load_many("book", [{"id": 1}], load_p))
        # P waits for the other process.
        assert await eventually(lambda: len(waits) == 1, timeout=2)
        k2 = asyncio.create_task(cache.get_or_load("book", {"id": 2}, key2_loader))
        key2 = cache.key("book", {"id": 2})
        assert await eventually(lambda: cache._rt.flight.in_flight(key2), timeout=2)
        x = asyncio.create_task(cache.get_or_load_many("book", [{"id": 1}, {"id": 2}], load_x))
        assert await eventually(lambda: stats.coalesced == 2, timeout=2)  # X joined both
        p.cancel()  # P's client went away
        await asyncio.gather(p, return_exceptions=True)
        # X's key 1 waits on the lease itself.
        assert await eventually(lambda: len(waits) == 2, timeout=2)
        fail.set()
        with pytest.raises(RuntimeError, match="key 2"):
            await x
        await asyncio.gather(k2, return_exceptions=True)
        assert x_calls == []
        await asyncio.sleep(1.5)  # past max_wait
        assert x_calls == [], "X raised, yet its join called load_many after max_wait"
    await admin.aclose()


async def test_a_load_many_of_the_wrong_shape_raises_even_when_the_lease_round_trip_timed_out(
    redis_url: str, prefix: str, late_replies: ReplyDelayProxy
) -> None:
    """README: "loads the won keys in one `load_many` call (a wrong number of values is
    a clear error and caches nothing, raised even where stale values could be served".

    When the batch's SET NX round trip times out (its reply is late; Redis itself is
    fine), ``BatchLoader._load_misses`` loads through ``_load_unleased``, which catches
    every ``Exception`` - ``Misshapen`` included - and serves the stale values: the bug
    in load_many stays invisible for up to ``stale.max_age``. (The same holds for the
    tagged path, ``_loading.enter`` failing.)"""
    ns = {"book": {"key": "book:{id}", "l1": False, "l2": {"ttl": "200ms", "jitter": 0},
                   "stale": {"max_age": "1m"}}}
    config = make_config(late_replies.url, prefix, ns, redis={"breaker": {"failures": 100}})
    async with LayeredCache.from_config(config) as cache:
        await cache.set_many("book", [({"id": 1}, "old1"), ({"id": 2}, "old2")])
        await asyncio.sleep(0.4)  # both stale now

        async def wrong(missing: list[Mapping[str, object]]) -> list[str]:
            return ["only one"]

        late_replies.match, late_replies.delay = b"NX", 0.5  # the SET NX reply is late
        with pytest.raises(ValueError, match="load_many returned 1 values for 2 keys"):
            await cache.get_or_load_many("book", [{"id": 1}, {"id": 2}], wrong)


@pytest.mark.parametrize("batch", [True, False])
async def test_a_tagged_load_cancelled_as_it_registers_leaves_nothing_in_the_loading_set(
    redis_url: str, prefix: str, late_replies: ReplyDelayProxy, batch: bool
) -> None:
    """A tagged load adds its member to the loading set before calling the loader
    (docs/tags.md); a batch cancelled once its SADD had landed, the reply on its way (a
    client timeout), never took its members out: the set has no TTL, and they stayed
    until the next invalidate_tag (which then deleted those leases by name, whoever
    held them by then)."""
    ns = {"category": {"key": "category:{id}", "tags": True}}
    admin = redis.Redis.from_url(redis_url)
    fields = [{"id": 1}, {"id": 2}] if batch else [{"id": 1}]

    async def load_many(missing: list[Mapping[str, object]]) -> list[str]:
        return [f"page {f['id']}" for f in missing]

    async def load_one() -> str:
        return "page 1"

    config = make_config(late_replies.url, prefix, ns, redis={"timeout": "5s"})
    async with LayeredCache.from_config(config) as cache:
        late_replies.match, late_replies.delay = b"SADD", 2.0  # it runs; its reply waits
        call = (
            cache.get_or_load_many("category", fields, load_many, tags=["t"])
            if batch
            else cache.get_or_load("category", fields[0], load_one, tags=["t"])
        )
        task = asyncio.ensure_future(call)
        assert await eventually(lambda: late_replies.matched == 1, timeout=5)
        assert await eventually(lambda: _loading(admin, prefix, len(fields)), timeout=5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        leases = [lease_name(cache.key("category", f)) for f in fields]
        assert await eventually(lambda: _none_exist(admin, leases), timeout=3)  # given back
        assert await eventually(lambda: _loading(admin, prefix, 0), timeout=3)
    await admin.aclose()


async def _loading(admin: Any, prefix: str, count: int) -> bool:
    return bool(await admin.scard(loading_set_name(prefix)) == count)


async def _none_exist(admin: Any, names: list[str]) -> bool:
    return bool(await admin.exists(*names) == 0)


class _Unencodable:
    """The loader's own object: msgspec can't encode it, so it is stored nowhere."""

    def __init__(self, price: str) -> None:
        self.price = price


async def test_a_read_joining_a_batch_whose_tag_versions_failed_is_told_the_value_is_owned(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Promise (``Served.owned``, _served module doc; ef75f1c "a batch's flight carries
    what each key's read served"): a value that could not be encoded is the loader's own
    object, stored nowhere, and nothing may be keyed on its identity (``http.ETags``);
    the single-key path says so on every branch (``MissPath.kept_in_l1`` after a failed
    tag-version read). ``BatchFill.fill_many``'s branch for Redis failing at
    ``versions_of`` returned the values decoded back without setting ``read.owned``, so a
    read joining the batch's flight (``CachedResponses.respond`` -> ``_serve``) gets
    ``Served(owned=False)`` for the loader's own object and memoizes its ETag on it."""
    import asyncio

    import layered_cache._batch_fill as batch_fill
    from layered_cache._l2 import L2Unavailable

    namespaces = {"book": {"key": "book:{id}", "tags": True}}
    started, release = asyncio.Event(), asyncio.Event()
    mine = _Unencodable("9.90")

    async def load_many(missing: list[Any]) -> list[Any]:
        started.set()
        await release.wait()
        return [mine for _ in missing]

    async def versions_fail(*args: Any) -> Any:
        raise L2Unavailable("redis went away while the batch loaded")

    monkeypatch.setattr(batch_fill, "versions_of", versions_fail)
    async with LayeredCache.from_config(make_config(redis_url, prefix, namespaces)) as cache:
        ns = cache.namespace("book")
        key = ns.key({"id": 1})
        batch = asyncio.create_task(
            cache.get_or_load_many("book", [{"id": 1}], load_many, tags=["shelf"])
        )
        await asyncio.wait_for(started.wait(), 5)

        async def never() -> Any:
            raise AssertionError("joins the batch's flight")

        joined = asyncio.create_task(ns._serve(key, never, ["shelf"]))
        await asyncio.sleep(0.05)
        release.set()
        assert (await batch)[0] is mine
        served = await joined
    assert served.value is mine
    assert served.owned, "the loader's own object, stored nowhere, served as owned=False"


async def test_a_batch_whose_load_outlived_its_leases_says_so_with_the_fix(
    redis_url: str, prefix: str
) -> None:
    """docs/operations.md, `stampede.lease_ttl`: "a load that outlives it loses its lease:
    its fill is refused ... logged as `load_outlived_lease`". A batch's fills were
    refused (``fill_revoked``) and nothing said why: a batch of many tagged pages whose
    load and tag versions outlast ``lease_ttl`` was never cached, silently (the CI met
    one on a loaded machine)."""
    import structlog

    stampede = {"lease_ttl": "300ms", "max_wait": "3s"}
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "stampede": stampede}})

    async def slow_many(fields_list: list[Mapping[str, object]]) -> list[str]:
        await asyncio.sleep(0.5)
        return [f"v{fields['id']}" for fields in fields_list]

    with structlog.testing.capture_logs() as logs:
        async with LayeredCache.from_config(config) as cache:
            ids = [{"id": 1}, {"id": 2}]
            assert await cache.get_or_load_many("book", ids, slow_many) == ["v1", "v2"]
            assert cache.stats()["book"]["fill_revoked"] == 2
    said = [e for e in logs if e["event"] == "load_outlived_lease"]
    assert len(said) == 1 and said[0]["keys"] == 2 and said[0]["lease_ttl_s"] == 0.3
    assert "stampede.lease_ttl" in said[0]["fix"]
