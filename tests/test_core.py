"""The layered read path against a real Redis: L1 -> L2 -> loader."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
from collections import Counter
from typing import Any

import msgspec
import pytest
import redis.asyncio as redis

from layered_cache import LayeredCache
from tests.helpers import CountingLoader, eventually, make_config, start_checks_done
from tests.servers import RedisServer

# Redis timeouts for scenarios about something else than latency: on a machine loaded by
# other work a 200 ms reply deadline (the suite's default) is sometimes missed.
_PATIENT = {"timeout": "2s", "connect_timeout": "2s"}


class BookDetail(msgspec.Struct):
    id: int
    title: str
    price: str


async def test_200_concurrent_misses_cause_one_load(redis_url: str, prefix: str) -> None:
    loader = CountingLoader({"title": "Dune"}, delay=0.05)
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        results = await asyncio.gather(
            *(cache.get_or_load("book", {"id": 42}, loader) for _ in range(200))
        )
    assert loader.calls == 1
    assert results == [{"title": "Dune"}] * 200


async def test_l1_hit_does_not_touch_redis(redis_server: RedisServer, prefix: str) -> None:
    config = make_config(redis_server.url, prefix, backplane={"enabled": False})
    admin = redis.Redis.from_url(redis_server.url)
    async with LayeredCache.from_config(config) as cache:
        loader = CountingLoader("v")
        await cache.get_or_load("book", {"id": 1}, loader)
        await start_checks_done(admin)
        before = await admin.info("commandstats")
        for _ in range(100):
            assert await cache.get_or_load("book", {"id": 1}, loader) == "v"
        after = await admin.info("commandstats")
        assert cache.stats()["book"]["l1_hit"] == 100
    await admin.aclose()
    # Only our own INFO calls may show up between the two snapshots.
    changed = {k for k in after if after[k] != before.get(k) and k != "cmdstat_info"}
    assert changed == set()


async def test_l2_hit_fills_l1_in_another_instance(redis_url: str, prefix: str) -> None:
    config = make_config(redis_url, prefix)
    loader = CountingLoader({"title": "Emma"})
    async with (
        LayeredCache.from_config(config) as first,
        LayeredCache.from_config(config) as second,
    ):
        await first.get_or_load("book", {"id": 7}, loader)
        assert await second.get_or_load("book", {"id": 7}, loader) == {"title": "Emma"}
        assert await second.get_or_load("book", {"id": 7}, loader) == {"title": "Emma"}
        stats = second.stats()["book"]
    assert loader.calls == 1
    assert (stats["l2_hit"], stats["l1_hit"]) == (1, 1)


async def test_declared_value_type_decodes_from_l2(redis_url: str, prefix: str) -> None:
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    book = BookDetail(1, "Dune", "9.90")
    async with LayeredCache.from_config(config, value_types={"book": BookDetail}) as cache:
        await cache.set("book", {"id": 1}, book)
        assert await cache.get("book", {"id": 1}) == book


class Event(msgspec.Struct, frozen=True):
    starts: datetime.datetime


async def test_an_aware_datetime_comes_back_as_the_same_instant_in_utc_from_every_layer(
    redis_url: str, prefix: str
) -> None:
    """README ("A call returns the same type ..."): msgpack's timestamp carries no zone,
    so a zoned datetime is the same instant in UTC, on the loader's call, from L1 and
    from L2 alike (documented, found by a review 2026-12-06)."""
    paris = datetime.timezone(datetime.timedelta(hours=2))
    starts = datetime.datetime(2026, 6, 1, 10, 0, tzinfo=paris)
    config = make_config(redis_url, prefix)
    async with (
        LayeredCache.from_config(config, value_types={"book": Event}) as a,
        LayeredCache.from_config(config, value_types={"book": Event}) as b,
    ):
        loaded = await a.get_or_load("book", {"id": 1}, CountingLoader(Event(starts)))
        from_l1 = await a.get("book", {"id": 1})
        from_l2 = await b.get("book", {"id": 1})
    for got in (loaded, from_l1, from_l2):
        assert got.starts == starts and got.starts.utcoffset() == datetime.timedelta(0)
        assert got.starts.hour == 8


async def test_decorator_takes_key_fields_from_arguments(redis_url: str, prefix: str) -> None:
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    calls = Counter[int]()
    async with LayeredCache.from_config(config) as cache:

        @cache.cached("book", ignore=("currency",))  # every book is priced in EUR here
        async def book_detail(id: int, *, currency: str = "EUR") -> BookDetail:
            calls[id] += 1
            return BookDetail(id, f"title {id}", currency)

        first = await book_detail(3)
        again = await book_detail(id=3)
        other = await book_detail(4)
    assert first == again == BookDetail(3, "title 3", "EUR")
    assert isinstance(again, BookDetail)  # decoded from L2 into the return annotation
    assert other.id == 4
    assert calls == {3: 1, 4: 1}


async def test_decorator_without_key_parameter_is_rejected(redis_url: str, prefix: str) -> None:
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        with pytest.raises(KeyError, match="'id'"):

            @cache.cached("book")
            async def wrong(book_id: int) -> str:
                return "x"


async def test_none_is_cached_and_distinct_from_a_miss(redis_url: str, prefix: str) -> None:
    loader = CountingLoader(None)
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        assert await cache.get_or_load("book", {"id": 9}, loader) is None
        assert await cache.get_or_load("book", {"id": 9}, loader) is None
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as fresh:
        assert await fresh.get_or_load("book", {"id": 9}, loader) is None
        assert fresh.stats()["book"]["l2_hit"] == 1
    assert loader.calls == 1


async def test_bypass_namespace_always_loads(redis_url: str, prefix: str) -> None:
    config = make_config(redis_url, prefix, {"stock": {"key": "stock:{id}", "cache": False}})
    loader = CountingLoader(5)
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(config) as cache:
        for _ in range(3):
            assert await cache.get_or_load("stock", {"id": 1}, loader) == 5
        assert await cache.get("stock", {"id": 1}) is None
    assert loader.calls == 3
    assert await admin.exists(f"{prefix}stock:1") == 0
    await admin.aclose()


async def test_invalidate_removes_base_replicas_and_lease(redis_url: str, prefix: str) -> None:
    config = make_config(
        redis_url,
        prefix,
        {"book": {"key": "book:{id}", "hot": {"replicas": 8, "keys": ["book:42"]}}},
    )
    admin = redis.Redis.from_url(redis_url)
    loader = CountingLoader("old")
    async with LayeredCache.from_config(config) as cache:
        await cache.get_or_load("book", {"id": 42}, loader)
        base = f"{prefix}book:42"
        names = [base, *(f"{base}#{i}" for i in range(8))]
        assert await admin.exists(*names) == 9
        await admin.set("{" + base + "}:lease", "someone", px=5000)
        await cache.invalidate("book", {"id": 42})
        assert await admin.exists(*names, "{" + base + "}:lease") == 0
        loader.value = "new"
        assert await cache.get_or_load("book", {"id": 42}, loader) == "new"
    assert loader.calls == 2
    await admin.aclose()


async def test_undecodable_bytes_in_redis_are_a_miss_then_overwritten(
    redis_url: str, prefix: str
) -> None:
    admin = redis.Redis.from_url(redis_url)
    key = f"{prefix}book:5"
    loader = CountingLoader({"ok": True})
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        for garbage in (b"\x80\x04\x95pickle", b"not msgpack at all", b"\x95\x01"):
            await admin.set(key, garbage)
            cache.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
            assert await cache.get("book", {"id": 5}) is None
            assert await cache.get_or_load("book", {"id": 5}, loader) == {"ok": True}
            assert await admin.get(key) not in (garbage, None)
        assert cache.stats()["book"]["decode_error"] >= 3
    await admin.aclose()


async def test_ttl_jitter_spreads_10000_expiries(redis_url: str, prefix: str) -> None:
    """10,000 keys warmed at once, 600 s +- 10%: no second holds more than 130 expiries."""
    config = make_config(
        redis_url,
        prefix,
        {"book": {"key": "book:{id}", "l1": False, "l2": {"ttl": "600s", "jitter": 0.1}}},
        backplane={"enabled": False},
        redis=_PATIENT,  # about TTLs, not latency: a loaded machine must not fail the sets
    )
    admin = redis.Redis.from_url(redis_url)
    warm_started = time.monotonic()
    async with LayeredCache.from_config(config) as cache:
        for start in range(0, 10_000, 100):
            await asyncio.gather(
                *(cache.set("book", {"id": i}, i) for i in range(start, start + 100))
            )
    pipe = admin.pipeline(transaction=False)
    for i in range(10_000):
        pipe.pttl(f"{prefix}book:{i}")
    ttls = [ms / 1000 for ms in await pipe.execute()]
    elapsed = time.monotonic() - warm_started  # TTLs decay while the rest are written
    await admin.aclose()
    assert all(540 - elapsed - 1 <= ttl <= 660 for ttl in ttls), (min(ttls), max(ttls))
    busiest = max(Counter(int(ttl) for ttl in ttls).values())
    assert busiest <= 130
    assert max(ttls) - min(ttls) > 100  # actually spread, not clustered


async def test_l1_ttl_jitter_stays_in_bounds(redis_url: str, prefix: str) -> None:
    config = make_config(
        redis_url, prefix, {"book": {"key": "book:{id}", "l1": {"ttl": "10s", "jitter": 0.2}}}
    )
    async with LayeredCache.from_config(config) as cache:
        policy = cache.namespace("book").policy
        draws = [policy.l1_ttl_draw() for _ in range(10_000)]
    assert 8.0 <= min(draws) < 8.2 and 11.8 < max(draws) <= 12.0


async def test_l1_entry_never_outlives_l2_soft_expiry(redis_url: str, prefix: str) -> None:
    config = make_config(
        redis_url,
        prefix,
        {"book": {"key": "book:{id}", "l1": {"ttl": "1h"}, "l2": {"ttl": "2s", "jitter": 0}}},
    )
    async with LayeredCache.from_config(config) as cache:
        await cache.get_or_load("book", {"id": 1}, CountingLoader("v"))
        remaining = cache.namespace("book").policy.l1.remaining_ttl(f"{prefix}book:1")  # type: ignore[union-attr]
    assert remaining is not None and remaining <= 2.0


async def test_redis_stopped_mid_test_serves_loader_and_breaker_recovers(
    redis_server: RedisServer, prefix: str
) -> None:
    config = make_config(redis_server.url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    loader = CountingLoader("db", delay=0.01)
    async with LayeredCache.from_config(config) as cache:
        assert await cache.get_or_load("book", {"id": 1}, loader) == "db"
        redis_server.kill()
        results = await asyncio.gather(
            *(cache.get_or_load("book", {"id": i % 5}, loader) for i in range(50))
        )
        assert results == ["db"] * 50
        for i in range(20):
            assert await cache.get_or_load("book", {"id": 100 + i}, loader) == "db"
        assert cache.redis_status().breaker in ("open", "half_open")
        errors_while_open = cache.stats()["book"]["redis_error"]
        assert errors_while_open >= 2
        redis_server.start()

        async def closed() -> bool:
            await cache.get_or_load("book", {"id": 1}, loader)
            return cache.redis_status().breaker == "closed"

        assert await eventually(closed, timeout=10, interval=0.1)
        # L2 fills again once the breaker is closed.
        await cache.invalidate("book", {"id": 77})
        await cache.get_or_load("book", {"id": 77}, loader)
        admin = redis.Redis.from_url(redis_server.url)
        assert await admin.exists(f"{prefix}book:77") == 1
        await admin.aclose()


async def test_failing_load_fails_all_waiters_and_leaves_nothing(
    redis_url: str, prefix: str
) -> None:
    loader = CountingLoader("v", delay=0.05)
    loader.error = RuntimeError("db down")
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        results = await asyncio.gather(
            *(cache.get_or_load("book", {"id": 3}, loader) for _ in range(20)),
            return_exceptions=True,
        )
        assert all(isinstance(r, RuntimeError) for r in results)
        assert loader.calls == 1
        assert await admin.exists(f"{prefix}book:3", "{" + f"{prefix}book:3" + "}:lease") == 0
        loader.error = None
        assert await cache.get_or_load("book", {"id": 3}, loader) == "v"
    await admin.aclose()


async def test_too_large_value_is_served_but_not_cached(redis_url: str, prefix: str) -> None:
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "max_value_bytes": 100}})
    loader = CountingLoader("x" * 1000)
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(config) as cache:
        assert await cache.get_or_load("book", {"id": 1}, loader) == "x" * 1000
        assert cache.stats()["book"]["not_cached"] == 1
    assert await admin.exists(f"{prefix}book:1") == 0
    await admin.aclose()


async def test_a_value_too_large_to_store_comes_back_as_the_type_a_stored_one_does(
    redis_url: str, prefix: str
) -> None:
    """Without a declared type a stored dataclass comes back as a dict (what L2 readers
    decode); a too-large one came back as the loader's own dataclass, so one call's
    type changed with the value's size. Single keys and batches alike."""

    @dataclasses.dataclass
    class Page:
        id: int
        body: str

    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "max_value_bytes": 200}})

    async def load_many(fields_list: list[dict[str, Any]]) -> list[Page]:
        return [Page(f["id"], "x" * (10 if f["id"] == 1 else 1000)) for f in fields_list]

    async with LayeredCache.from_config(config) as cache:
        small = await cache.get_or_load("book", {"id": 1}, CountingLoader(Page(1, "x" * 10)))
        large = await cache.get_or_load("book", {"id": 2}, CountingLoader(Page(2, "x" * 1000)))
        assert small == {"id": 1, "body": "x" * 10} and large == {"id": 2, "body": "x" * 1000}
        batch = await cache.get_or_load_many("book", [{"id": 1}, {"id": 3}], load_many)
        assert batch == [{"id": 1, "body": "x" * 10}, {"id": 3, "body": "x" * 1000}]
        assert cache.stats()["book"]["not_cached"] == 2


async def test_a_value_nested_deeper_than_the_codec_goes_is_served_but_not_cached(
    redis_url: str, prefix: str
) -> None:
    deep: list[object] = []
    for _ in range(10_000):
        deep = [deep]
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        assert await cache.get_or_load("book", {"id": 1}, CountingLoader(deep)) is deep
        assert cache.stats()["book"]["not_cached"] == 1
        await cache.set("book", {"id": 2}, "old")
        await cache.set("book", {"id": 2}, deep)  # refused: the old value goes
        assert await cache.get("book", {"id": 2}) is None
    assert await admin.exists(f"{prefix}book:1", f"{prefix}book:2") == 0
    await admin.aclose()


async def test_set_in_an_l1_only_namespace_is_served_from_memory(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, {"session": {"key": "session:{id}", "l2": False}})
    async with LayeredCache.from_config(config) as cache:
        await cache.set("session", {"id": 1}, {"user": 7})
        assert await cache.get("session", {"id": 1}) == {"user": 7}
        assert cache.stats()["session"]["l1_hit"] == 1


async def test_a_set_in_an_l1_only_namespace_drops_the_other_instances_copies(
    redis_url: str, prefix: str
) -> None:
    """In an ``l2 = false`` namespace each L1 is all there is: a set() on one instance
    left the other serving its old copy for its whole L1 TTL (invalidate() did reach it).
    Found by a review (2026-12-05)."""
    namespaces = {"session": {"key": "session:{id}", "l2": False, "l1": {"ttl": "60s"}}}
    config = make_config(redis_url, prefix, namespaces, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        assert await b.get_or_load("session", {"id": 1}, CountingLoader("old")) == "old"
        await a.set("session", {"id": 1}, "new")
        assert await a.get("session", {"id": 1}) == "new"
        assert await eventually(lambda: _absent_from_l1(b, "session", {"id": 1}), timeout=5)


def _absent_from_l1(cache: LayeredCache, namespace: str, fields: dict[str, Any]) -> bool:
    l1 = cache.namespace(namespace).policy.l1
    return l1 is not None and cache.key(namespace, fields) not in l1


async def test_set_revokes_a_fill_in_flight(redis_url: str, prefix: str) -> None:
    """A slow load that read the old value must not overwrite a value set meanwhile."""
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    slow = CountingLoader("old", delay=0.2)
    async with LayeredCache.from_config(config) as cache:
        load = asyncio.create_task(cache.get_or_load("book", {"id": 1}, slow))
        await asyncio.sleep(0.05)
        await cache.set("book", {"id": 1}, "new")
        assert await load == "old"  # the caller that started before still gets its load
        assert await cache.get("book", {"id": 1}) == "new"


async def test_an_l1_hit_never_serves_a_key_to_an_equal_value_of_another_type(
    redis_url: str, prefix: str
) -> None:
    """The L1-hit path reads a one-field template's remembered keys inline (``_hits``):
    ``True == 1`` and ``42.0 == 42`` hash alike, yet once books 1 and 42 sit in L1 they
    are refused there as ``build`` refuses them, and ``"42"`` (the same key) is served."""
    config = make_config(redis_url, prefix)
    async with LayeredCache.from_config(config) as cache:
        for i in (1, 42):
            assert await cache.get_or_load("book", {"id": i}, CountingLoader(f"book {i}"))
        for bad in (True, 42.0, "4 2", None):
            with pytest.raises((ValueError, TypeError)):
                await cache.get_or_load("book", {"id": bad}, CountingLoader("wrong"))
            with pytest.raises((ValueError, TypeError)):
                await cache.get("book", {"id": bad})
        with pytest.raises(KeyError):
            await cache.get("book", {"isbn": 42})
        assert await cache.get("book", {"id": "42"}) == "book 42"
        never = CountingLoader("loaded")
        assert await cache.get_or_load("book", {"id": "1"}, never) == "book 1"
        assert never.calls == 0
