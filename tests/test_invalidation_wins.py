"""Invalidation wins everywhere (issue 12): each scenario forces one interleaving that
once let a superseded copy outlive an invalidation (or switched Redis off), against a
real Redis. Interleavings are forced from the test side: loaders that wait on an
``asyncio.Event`` and wrappers around the store's methods, never production hooks."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import decimal
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster

from layered_cache import L2Unavailable, LayeredCache, ReplicaCountMismatch
from layered_cache._keys import replica_record_name
from layered_cache._l1 import MISSING
from tests.faults.proxy import ToxicProxy
from tests.helpers import CountingLoader, eventually, hold_fill_messages, make_config
from tests.servers import RedisServer


async def test_cancelled_half_open_probe_does_not_stick_the_breaker(
    redis_server: RedisServer, prefix: str
) -> None:
    config = make_config(redis_server.url, prefix, backplane={"enabled": False})
    async with LayeredCache.from_config(config) as cache:
        redis_server.pause()  # hung: every command times out (200 ms)
        try:
            for _ in range(2):
                await cache.get("book", {"id": 1})
            assert cache.redis_status().breaker == "open"
            await asyncio.sleep(0.35)  # past reset: the next request is the probe
            assert cache.redis_status().breaker == "half_open"
            # The probe's caller goes away (client timeout) while Redis hangs.
            probe = asyncio.ensure_future(cache.get("book", {"id": 1}))
            await asyncio.sleep(0.05)
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)
        finally:
            redis_server.resume()
        await cache.set("book", {"id": 2}, "v2")  # raised L2Unavailable forever before
        await cache.invalidate("book", {"id": 2})
        loader = CountingLoader("db")
        for _ in range(5):
            cache.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
            assert await cache.get_or_load("book", {"id": 3}, loader) == "db"
        assert loader.calls == 1  # later reads were L2 hits, not loads
        assert cache.redis_status().breaker == "closed"


async def test_a_request_let_through_before_the_breaker_opened_cannot_free_the_probes_slot() -> (
    None
):
    """A request admitted while closed, cancelled during half-open, cleared the flag of
    the probe in flight: a second probe went through beside it (against "exactly one
    probe at a time"), and in a burst of such requests, many."""
    from layered_cache._breaker import CircuitBreaker

    now = [0.0]
    breaker = CircuitBreaker(failures=1, reset=1.0, clock=lambda: now[0])
    old_done, probe_done = asyncio.Event(), asyncio.Event()

    async def request(done: asyncio.Event, ends: str) -> None:
        assert breaker.allow()
        await done.wait()
        if ends == "abandon":
            breaker.abandon()
        else:
            breaker.success()

    old = asyncio.ensure_future(request(old_done, "abandon"))  # let through while closed
    await asyncio.sleep(0)
    breaker.failure()  # another request failed: open
    now[0] = 1.0  # past reset: half-open
    probe = asyncio.ensure_future(request(probe_done, "success"))
    await asyncio.sleep(0)
    assert not breaker.allow()  # the probe is in flight
    old_done.set()  # the old request's caller went away
    await old
    assert not breaker.allow()  # still one probe at a time
    probe_done.set()
    await probe
    assert breaker.state == "closed" and breaker.allow()


async def test_wrong_type_key_is_a_miss_that_the_next_fill_repairs(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    admin = redis.Redis.from_url(redis_url)
    await admin.rpush(f"{prefix}book:666", "not", "a", "string")
    loader = CountingLoader("db")
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, "healthy")
        for _ in range(5):  # failures=2 opened the instance-wide breaker before
            assert await cache.get_or_load("book", {"id": 666}, loader) == "db"
            assert await cache.get("book", {"id": 1}) == "healthy"
        stats, status = cache.stats(), cache.redis_status()
    assert status.breaker == "closed"
    assert await admin.type(f"{prefix}book:666") == b"string"  # the fill overwrote it
    assert loader.calls == 1  # the repaired key served the later reads from L2
    assert stats["book"]["l2_hit"] == 5 + 4
    await admin.aclose()


class Gate:
    """Wraps an async method: callers block after (or before) the real call until
    ``release()``; ``entered`` tells the test a caller got there."""

    def __init__(self, method: Any, *, after: bool = False) -> None:
        self.method = method
        self.after = after
        self.entered = asyncio.Event()
        self.opened = asyncio.Event()

    def release(self) -> None:
        self.opened.set()

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.after:
            self.entered.set()
            await self.opened.wait()
            return await self.method(*args, **kwargs)
        result = await self.method(*args, **kwargs)
        self.entered.set()
        await self.opened.wait()
        return result


HOT = {"book": {"key": "book:{id}", "hot": {"replicas": 4, "keys": ["book:1"]}}}


async def test_set_revokes_a_hot_fill_in_flight_from_every_replica(
    redis_url: str, prefix: str
) -> None:
    admin = redis.Redis.from_url(redis_url)
    await _set_during_hot_fill(make_config(redis_url, prefix, HOT), admin)
    await admin.aclose()


async def test_set_revokes_a_hot_fill_in_flight_from_every_replica_in_a_cluster(
    redis_cluster: Any, prefix: str
) -> None:
    config = make_config(redis_cluster.url, prefix, HOT, redis={"cluster": True, "timeout": "1s"})
    admin = RedisCluster.from_url(redis_cluster.url)
    await _set_during_hot_fill(config, admin)
    await admin.aclose()


async def _set_during_hot_fill(config: Any, admin: Any) -> None:
    prefix = config.redis.prefix
    async with (
        LayeredCache.from_config(config) as filler,
        LayeredCache.from_config(config) as writer,
    ):
        gate = Gate(filler._store.fill_replicas)
        filler._store.fill_replicas = gate  # type: ignore[method-assign]
        # The fill passed its base-lease check and wrote the base key; its replica
        # writes are still to come when set() runs.
        load = asyncio.ensure_future(filler.get_or_load("book", {"id": 1}, CountingLoader("old")))
        await asyncio.wait_for(gate.entered.wait(), 5)
        await writer.set("book", {"id": 1}, "new")
        gate.release()
        assert await load == "old"  # its caller may have it: it read before the set
        codec = writer.namespace("book").policy.codec
        for index in range(4):
            data = await admin.get(f"{prefix}book:1#{index}")
            assert data is None or codec.decode(data).value == "new", index
        assert codec.decode(await admin.get(f"{prefix}book:1")).value == "new"


async def _backplane_delivered(cache: LayeredCache, seen: int) -> None:
    backplane = cache._backplane
    assert backplane is not None
    assert await eventually(lambda: backplane.entries_seen > seen, interval=0.005)


async def test_set_does_not_fill_l1_after_a_remote_invalidation_overtook_it(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix)
    async with (
        LayeredCache.from_config(config) as local,
        LayeredCache.from_config(config) as remote,
    ):
        assert local._backplane is not None
        await asyncio.wait_for(local._backplane.connected.wait(), 5)
        gate = Gate(local._store.write_many, after=True)
        local._store.write_many = gate  # type: ignore[method-assign]
        writing = asyncio.ensure_future(local.set("book", {"id": 1}, "ours"))
        await asyncio.wait_for(gate.entered.wait(), 5)  # L2 written, L1 not yet
        seen = local._backplane.entries_seen
        await remote.invalidate("book", {"id": 1})
        await _backplane_delivered(local, seen)
        gate.release()
        await writing
        # The invalidation came after our write: no copy of "ours" may be served.
        assert await local.get("book", {"id": 1}) is None


class GatedLoader:
    """A loader that blocks until ``release()``, then returns ``value`` (or raises)."""

    def __init__(self, value: Any = "fresh", error: Exception | None = None) -> None:
        self.value = value
        self.error = error
        self.started = asyncio.Event()
        self.opened = asyncio.Event()
        self.calls = 0

    def release(self) -> None:
        self.opened.set()

    async def __call__(self) -> Any:
        self.calls += 1
        self.started.set()
        await self.opened.wait()
        if self.error is not None:
            raise self.error
        return self.value


STALE = {
    "book": {
        "key": "book:{id}",
        "l2": {"ttl": "200ms", "jitter": 0},
        "stale": {"max_age": "1m"},
        "stampede": {"load_timeout": "50ms"},
    }
}


async def test_load_timeout_background_fill_does_not_fill_l1_after_an_invalidation(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, STALE)
    async with (
        LayeredCache.from_config(config) as local,
        LayeredCache.from_config(config) as remote,
    ):
        assert local._backplane is not None
        await asyncio.wait_for(local._backplane.connected.wait(), 5)
        await remote.set("book", {"id": 1}, "stale")
        await asyncio.sleep(0.3)  # past the soft expiry: stale, within stale.max_age
        gate = Gate(local._store.fill, after=True)
        local._store.fill = gate  # type: ignore[method-assign]
        loader = GatedLoader("fresh")
        # Slow loader: the caller gets the stale value, the load goes on in background.
        assert await local.get_or_load("book", {"id": 1}, loader) == "stale"
        loader.release()
        await asyncio.wait_for(gate.entered.wait(), 5)  # L2 filled, L1 not yet
        seen = local._backplane.entries_seen
        await remote.invalidate("book", {"id": 1})
        await _backplane_delivered(local, seen)
        gate.release()
        await asyncio.sleep(0.05)
        assert await local.get("book", {"id": 1}) is None


async def test_load_timeout_background_fill_of_a_batch_does_not_fill_l1_after_an_invalidation(
    redis_url: str, prefix: str
) -> None:
    """The batch's load_timeout (as a single read's, above): the caller gets the stale
    values, the fill runs on in the background with the request's L1 sequence, so an
    invalidation delivered between its L2 write and its L1 fill keeps that key out of L1."""
    config = make_config(redis_url, prefix, STALE)
    opened = asyncio.Event()

    async def load_many(fields_list: list[Any]) -> list[str]:
        await opened.wait()
        return [f"fresh{fields['id']}" for fields in fields_list]

    async with (
        LayeredCache.from_config(config) as local,
        LayeredCache.from_config(config) as remote,
    ):
        assert local._backplane is not None
        await asyncio.wait_for(local._backplane.connected.wait(), 5)
        await remote.set_many("book", [({"id": 1}, "stale1"), ({"id": 2}, "stale2")])
        await asyncio.sleep(0.3)  # past the soft expiry: stale, within stale.max_age
        l2batch = local.namespace("book")._batch._loader._batch
        gate = Gate(l2batch.fill_many, after=True)
        l2batch.fill_many = gate  # type: ignore[method-assign]
        books = [{"id": 1}, {"id": 2}]
        reading = local.get_or_load_many("book", books, load_many)
        assert await asyncio.wait_for(reading, 5) == ["stale1", "stale2"]
        opened.set()
        await asyncio.wait_for(gate.entered.wait(), 5)  # L2 filled, L1 not yet
        seen = local._backplane.entries_seen
        await remote.invalidate("book", {"id": 1})
        await _backplane_delivered(local, seen)
        gate.release()
        await asyncio.sleep(0.05)
        assert await local.get("book", {"id": 1}) is None
        assert await local.get("book", {"id": 2}) == "fresh2"  # not invalidated: filled


async def test_callers_after_a_remote_invalidation_do_not_join_the_older_load(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix)
    async with (
        LayeredCache.from_config(config) as local,
        LayeredCache.from_config(config) as remote,
    ):
        assert local._backplane is not None
        await asyncio.wait_for(local._backplane.connected.wait(), 5)
        old_load = GatedLoader("old")
        first = asyncio.ensure_future(local.get_or_load("book", {"id": 1}, old_load))
        await asyncio.wait_for(old_load.started.wait(), 5)
        seen = local._backplane.entries_seen
        await remote.invalidate("book", {"id": 1})  # e.g. the daemon: via the backplane
        await _backplane_delivered(local, seen)
        later = asyncio.ensure_future(local.get_or_load("book", {"id": 1}, CountingLoader("new")))
        await asyncio.sleep(0.05)
        old_load.release()
        assert await first == "old"  # began before the invalidation: allowed
        assert await later == "new"
        assert await local.get("book", {"id": 1}) == "new"
        assert await remote.get("book", {"id": 1}) == "new"


def _stale_config(redis_url: str, prefix: str, load_timeout: str | None = None) -> Any:
    book: dict[str, Any] = {**STALE["book"], "stampede": {}}
    if load_timeout is not None:
        book["stampede"] = {"load_timeout": load_timeout}
    return make_config(redis_url, prefix, {"book": book})


async def test_loader_failure_after_an_invalidation_does_not_serve_the_stale_value(
    redis_url: str, prefix: str
) -> None:
    async with (
        LayeredCache.from_config(_stale_config(redis_url, prefix)) as local,
        LayeredCache.from_config(_stale_config(redis_url, prefix)) as remote,
    ):
        await remote.set("book", {"id": 1}, "stale")
        await asyncio.sleep(0.3)  # past the soft expiry, within stale.max_age
        loader = GatedLoader(error=RuntimeError("database down"))
        reading = asyncio.ensure_future(local.get_or_load("book", {"id": 1}, loader))
        await asyncio.wait_for(loader.started.wait(), 5)  # it has read the stale value
        await remote.invalidate("book", {"id": 1})
        loader.release()
        with pytest.raises(RuntimeError, match="database down"):
            await reading  # served the invalidated "stale" before


async def test_lease_waiter_does_not_fall_back_to_an_invalidated_stale_value(
    redis_url: str, prefix: str
) -> None:
    config = _stale_config(redis_url, prefix)
    async with (
        LayeredCache.from_config(config) as waiter,
        LayeredCache.from_config(config) as winner,
    ):
        await winner.set("book", {"id": 1}, "stale")
        await asyncio.sleep(0.3)
        slow = GatedLoader("fresh")
        winning = asyncio.ensure_future(winner.get_or_load("book", {"id": 1}, slow))
        await asyncio.wait_for(slow.started.wait(), 5)  # holds the lease
        failing = GatedLoader(error=RuntimeError("database down"))
        waiting = asyncio.ensure_future(waiter.get_or_load("book", {"id": 1}, failing))
        await asyncio.sleep(0.1)  # read the stale value, lost the lease, waits
        await winner.invalidate("book", {"id": 1})
        failing.release()
        with pytest.raises(RuntimeError, match="database down"):
            await waiting
        slow.release()
        assert await winning == "fresh"


async def test_load_timeout_does_not_serve_an_invalidated_stale_value(
    redis_url: str, prefix: str
) -> None:
    config = _stale_config(redis_url, prefix, load_timeout="300ms")
    async with (
        LayeredCache.from_config(config) as local,
        LayeredCache.from_config(config) as remote,
    ):
        await remote.set("book", {"id": 1}, "stale")
        await asyncio.sleep(0.3)
        loader = GatedLoader("fresh")
        reading = asyncio.ensure_future(local.get_or_load("book", {"id": 1}, loader))
        await asyncio.wait_for(loader.started.wait(), 5)
        await remote.invalidate("book", {"id": 1})  # before load_timeout fires
        await asyncio.sleep(0.4)  # load_timeout passed: "stale" was served here before
        assert not reading.done()
        loader.release()
        assert await reading == "fresh"


async def test_a_batch_load_timeout_does_not_serve_an_invalidated_stale_value(
    redis_url: str, prefix: str
) -> None:
    """The batch's load_timeout checks each stale value as a single read's does: one
    invalidated since the read, and the batch waits for its load."""
    config = _stale_config(redis_url, prefix, load_timeout="300ms")
    started, opened = asyncio.Event(), asyncio.Event()

    async def load_many(fields_list: list[Any]) -> list[str]:
        started.set()
        await opened.wait()
        return [f"fresh{fields['id']}" for fields in fields_list]

    async with (
        LayeredCache.from_config(config) as local,
        LayeredCache.from_config(config) as remote,
    ):
        await remote.set_many("book", [({"id": 1}, "stale1"), ({"id": 2}, "stale2")])
        await asyncio.sleep(0.3)
        books = [{"id": 1}, {"id": 2}]
        reading = asyncio.ensure_future(local.get_or_load_many("book", books, load_many))
        await asyncio.wait_for(started.wait(), 5)
        await remote.invalidate("book", {"id": 1})  # before load_timeout fires
        await asyncio.sleep(0.4)
        assert not reading.done()
        opened.set()
        assert await reading == ["fresh1", "fresh2"]


@pytest.fixture
async def proxy(redis_url: str) -> AsyncIterator[ToxicProxy]:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    toxic = await ToxicProxy("127.0.0.1", port).start()
    yield toxic
    await toxic.stop()


@pytest.mark.parametrize("emptied_by", ["DEL", "XTRIM MAXLEN 0"])
async def test_stream_emptied_while_disconnected_clears_l1_on_reconnect(
    redis_url: str, prefix: str, proxy: ToxicProxy, emptied_by: str
) -> None:
    backplane = {"block": "200ms"}
    local_config = make_config(proxy.url, prefix, backplane=backplane)
    config = make_config(redis_url, prefix, backplane=backplane)
    admin = redis.Redis.from_url(redis_url)
    async with (
        LayeredCache.from_config(local_config) as local,
        LayeredCache.from_config(config) as remote,
    ):
        assert local._backplane is not None
        await remote.invalidate("book", {"id": 0})  # the stream exists, local saw it
        assert await local.get_or_load("book", {"id": 1}, CountingLoader("v1")) == "v1"
        proxy.mode = "blackhole"
        proxy.cut()  # local is disconnected (and can't reconnect) from here
        await asyncio.sleep(0.3)
        await remote.invalidate("book", {"id": 1})  # local misses this entry...
        stream = remote.config.redis.prefix + remote.config.backplane.stream
        if emptied_by == "DEL":  # ... and the stream forgets it
            await admin.delete(stream)
        else:
            await admin.xtrim(stream, maxlen=0)
        proxy.mode = "pass"
        l1 = local.namespace("book").policy.l1
        assert l1 is not None
        assert await eventually(lambda: l1.get(f"{prefix}book:1") is MISSING, timeout=8)
        assert local._backplane.gaps >= 1
    await admin.aclose()


async def test_lease_waiter_connecting_to_a_hung_redis_waits_at_most_max_wait(
    redis_url: str, prefix: str, proxy: ToxicProxy
) -> None:
    book = {"key": "book:{id}", "stampede": {"max_wait": "1s"}}
    hung = {"timeout": "100ms", "connect_timeout": "100ms", "breaker": {"failures": 100}}
    waiter_config = make_config(
        proxy.url, prefix, {"book": book}, redis=hung, backplane={"enabled": False}
    )
    config = make_config(redis_url, prefix, {"book": book})
    async with (
        LayeredCache.from_config(waiter_config) as waiter,
        LayeredCache.from_config(config) as winner,
    ):
        slow = GatedLoader("winner's")
        winning = asyncio.ensure_future(winner.get_or_load("book", {"id": 1}, slow))
        await asyncio.wait_for(slow.started.wait(), 5)  # holds the lease
        acquire = waiter._store.acquire_lease

        async def lose_then_hang(*args: Any) -> bool:
            won: bool = await acquire(*args)
            proxy.mode = "blackhole"  # Redis hangs right when the waiter subscribes
            return won

        waiter._store.acquire_lease = lose_then_hang  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        started = loop.time()
        value = await asyncio.wait_for(
            waiter.get_or_load("book", {"id": 1}, CountingLoader("own")), 10
        )
        elapsed = loop.time() - started
        assert value == "own"
        assert elapsed < 1.3, elapsed  # max_wait 1 s (took 6 s and more before)
        proxy.mode = "pass"
        slow.release()
        await winning


@dataclasses.dataclass
class Edition:
    isbn: uuid.UUID
    price: decimal.Decimal
    published: datetime.date
    formats: tuple[str, ...]
    tags: set[str]


async def test_a_call_returns_the_same_type_from_loader_l1_and_l2(
    redis_url: str, prefix: str
) -> None:
    """No value_types declared: every layer returns what L2 decodes to."""
    edition = Edition(
        uuid.uuid4(),
        decimal.Decimal("9.90"),
        datetime.date(2026, 1, 2),
        ("paper", "ebook"),
        {"scifi"},
    )
    config = make_config(redis_url, prefix)
    async with (
        LayeredCache.from_config(config) as first,
        LayeredCache.from_config(config) as second,
    ):
        loaded = await first.get_or_load("book", {"id": 1}, CountingLoader(edition))
        from_l1 = await first.get_or_load("book", {"id": 1}, CountingLoader(edition))
        from_l2 = await second.get_or_load("book", {"id": 1}, CountingLoader(edition))
        assert first.stats()["book"]["l1_hit"] == 1
        assert second.stats()["book"]["l2_hit"] == 1
        await first.set("book", {"id": 2}, edition)
        after_set = await first.get("book", {"id": 2})  # L1
    expected = {
        "isbn": str(edition.isbn),
        "price": "9.90",
        "published": "2026-01-02",
        "formats": ["paper", "ebook"],
        "tags": ["scifi"],
    }
    for value in (loaded, from_l1, from_l2, after_set):
        assert value == expected
        assert [type(v) for v in value.values()] == [str, str, str, list, list]


async def test_instance_with_another_replica_count_refuses_to_start(
    redis_url: str, prefix: str
) -> None:
    hot = make_config(redis_url, prefix, HOT)  # book: 4 replicas
    plain = make_config(redis_url, prefix)  # book: no hot section = 0 replicas
    async with LayeredCache.from_config(hot) as first:
        await first.set("book", {"id": 1}, "v")
        with pytest.raises(ReplicaCountMismatch, match=r"'book': hot.replicas = 0 here, 4"):
            async with LayeredCache.from_config(plain):
                pass
        async with LayeredCache.from_config(hot) as same:  # same count: starts
            assert await same.get("book", {"id": 1}) == "v"
    admin = redis.Redis.from_url(redis_url)
    recorded = await admin.hgetall(replica_record_name(prefix))
    assert recorded == {b"book": b"4", b"template:book:{id}": b"4", b"shape:book:{}": b"4"}
    await admin.aclose()


async def test_after_redis_restarts_empty_an_instance_with_another_replica_count_is_refused(
    redis_server: RedisServer, prefix: str
) -> None:
    """The fleet's record of hot.replicas was written only as each process started:
    after Redis restarted without its data, a process with another count recorded its
    own and started, and its invalidations left the replicas it doesn't know of, served
    by the others. The running fleet's listeners find the lost stream (a gap) and record
    their counts again (found by a review, 2026-12-05)."""
    hot = make_config(redis_server.url, prefix, HOT)  # book: 4 replicas
    plain = make_config(redis_server.url, prefix)  # 0
    async with LayeredCache.from_config(hot) as fleet:
        assert fleet._backplane is not None
        await fleet.set("book", {"id": 1}, "v")
        redis_server.stop()
        redis_server.start()  # back, empty: no persistence
        admin = redis.Redis.from_url(redis_server.url)

        async def recorded_again() -> bool:
            return bool(await admin.hget(replica_record_name(prefix), "book") == b"4")

        assert await eventually(recorded_again, timeout=10)
        assert fleet._backplane.gaps >= 1
        with pytest.raises(ReplicaCountMismatch, match=r"'book': hot.replicas = 0 here, 4"):
            async with LayeredCache.from_config(plain):
                pass
        await admin.aclose()


async def test_a_namespace_renamed_with_another_replica_count_refuses_to_start(
    redis_url: str, prefix: str
) -> None:
    """The record was keyed by namespace name only: a namespace renamed in a rolling
    deploy (same keys, no hot section) started unchecked, and its invalidations left
    the replicas the old name's instances kept writing and serving."""
    hot = make_config(redis_url, prefix, HOT)  # book:{id} with 4 replicas
    renamed = make_config(redis_url, prefix, {"books": {"key": "book:{id}"}})  # 0
    async with LayeredCache.from_config(hot):
        with pytest.raises(
            ReplicaCountMismatch, match=r"key template 'book:\{id\}': hot.replicas = 0 here, 4"
        ):
            async with LayeredCache.from_config(renamed):
                pass


async def test_a_namespace_and_placeholder_renamed_with_another_replica_count_refuses_to_start(
    redis_url: str, prefix: str
) -> None:
    """``book``/``book:{id}`` renamed ``books``/``book:{book_id}`` builds the same names
    (``book:42``), but the record was keyed by namespace and raw template text, both
    new: the renamed process started unchecked, and its invalidations left the replicas
    the old instances kept serving (found by a review, 2026-12-05)."""
    hot = {"replicas": 4, "keys": ["book:1"]}
    fleet_config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": False, "hot": hot}})
    renamed = {"key": "book:{book_id}", "l1": False}
    async with LayeredCache.from_config(fleet_config) as fleet:
        await fleet.set("book", {"id": 1}, "old")  # base + 4 replicas
        with pytest.raises(
            ReplicaCountMismatch, match=r"shape 'book:\{\}' .*hot.replicas = 0 here, 4"
        ):
            async with LayeredCache.from_config(make_config(redis_url, prefix, {"books": renamed})):
                pass
        # Renamed again, keeping the fleet's count: starts, and deletes every replica.
        same = {"titles": {"key": "book:{isbn}", "l1": False, "hot": {"replicas": 4}}}
        async with LayeredCache.from_config(make_config(redis_url, prefix, same)) as titles:
            await titles.invalidate("titles", {"isbn": 1})
        assert {await fleet.get("book", {"id": 1}) for _ in range(40)} == {None}


async def test_namespaces_named_like_the_replica_records_fields_are_refused(
    redis_url: str, prefix: str
) -> None:
    """PROMISE (docs/hotkeys.md, "Record the count and refuse a mismatch"): each process
    records `hot.replicas` under its key template's shape (`shape:book:{}`), under its
    key template (`template:book:{id}`) and under its name; "a process whose count
    differs refuses to start with `ReplicaCountMismatch`".

    SCENARIO: the fleet runs `book` = `book:{id}` with 4 replicas. A second config serves
    the same keys as `books` with 1 replica, plus namespaces *named* `shape:book:{}` and
    `template:book:{id}` (keys `s:{id}`, `t:{id}`, 4 replicas each).

    WAS: it loaded and started: its counts' `shape:book:{}` and `template:book:{id}`
    entries (1) were overwritten by the two namespaces' name entries (4), every field
    matched the fleet's record, and its `invalidate` left replicas #1..#3 serving the old
    value. `_invalidation.recorded_counts` keeps names in the hash of the shape and
    template fields, and namespace names were never checked ("", a tab, `a:b` loaded).

    NOW: a namespace name is letters, digits, `_`, `-`, `.`: such names are refused at
    load, and in a Config replaced in code, naming the namespace; without them, `books`
    is refused with `ReplicaCountMismatch`."""
    import msgspec

    from layered_cache import ConfigError

    hot = {"replicas": 4, "keys": ["book:1"]}
    fleet_config = make_config(
        redis_url, prefix, {"book": {"key": "book:{id}", "l1": False, "hot": hot}}
    )
    books = {"books": {"key": "book:{id}", "l1": False, "hot": {"replicas": 1}}}
    aliases = {
        "shape:book:{}": {"key": "s:{id}", "l1": False, "hot": {"replicas": 4}},
        "template:book:{id}": {"key": "t:{id}", "l1": False, "hot": {"replicas": 4}},
    }
    with pytest.raises(ConfigError, match=r"namespaces: 'shape:book:\{\}' is not a namespace"):
        make_config(redis_url, prefix, {**books, **aliases})
    other = make_config(redis_url, prefix, books)
    renamed = {**other.namespaces, "template:book:{id}": other.namespaces["books"]}
    with pytest.raises(ConfigError, match=r"'template:book:\{id\}' is not a namespace name"):
        LayeredCache.from_config(msgspec.structs.replace(other, namespaces=renamed))
    async with LayeredCache.from_config(fleet_config) as fleet:
        await fleet.set("book", {"id": 1}, "old")  # base + 4 replicas
        with pytest.raises(ReplicaCountMismatch, match=r"hot.replicas = 1 here, 4"):
            async with LayeredCache.from_config(other):
                pass


async def test_a_process_refused_for_its_replica_count_records_nothing_and_starts_once_corrected(
    redis_url: str, prefix: str
) -> None:
    """Recorded field by field, a refused process left the fields it was first to write
    (its new name and template, with its wrong count), and once corrected to the fleet's
    count it was refused by those leftovers until an operator deleted them."""
    hot = {"replicas": 4}
    fleet_config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "hot": hot}})
    async with LayeredCache.from_config(fleet_config):
        wrong = make_config(redis_url, prefix, {"books": {"key": "book:{book_id}"}})
        with pytest.raises(ReplicaCountMismatch, match=r"hot\.replicas = 0 here, 4"):
            async with LayeredCache.from_config(wrong):
                pass
        right = {"books": {"key": "book:{book_id}", "hot": hot}}
        async with LayeredCache.from_config(make_config(redis_url, prefix, right)) as renamed:
            await renamed.invalidate("books", {"book_id": 1})


async def test_blip_in_a_fleet_that_never_invalidated_keeps_l1(
    redis_url: str, prefix: str, proxy: ToxicProxy
) -> None:
    """The listener creates the stream at start, so "no stream" after a blip means it
    was deleted (a gap), not "nothing was invalidated yet" (no reason to clear L1)."""
    config = make_config(proxy.url, prefix, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as cache:
        backplane = cache._backplane
        assert backplane is not None
        await asyncio.wait_for(backplane.connected.wait(), 5)
        assert await cache.get_or_load("book", {"id": 1}, CountingLoader("v1")) == "v1"
        proxy.mode = "blackhole"  # a blip long enough to be seen
        proxy.cut()
        assert await eventually(lambda: not backplane.connected.is_set())
        proxy.mode = "pass"
        assert await eventually(backplane.connected.is_set)
        await asyncio.sleep(0.3)
        assert backplane.gaps == 0
        assert cache.namespace("book").policy.l1.get(f"{prefix}book:1") == "v1"  # type: ignore[union-attr]


async def test_daemon_with_another_replica_count_refuses_to_start(
    redis_url: str, prefix: str
) -> None:
    from consumers.daemon import Daemon

    async with LayeredCache.from_config(make_config(redis_url, prefix, HOT)):
        pass  # the fleet recorded book: 4 replicas
    daemon = Daemon(make_config(redis_url, prefix))  # book without hot keys: 0
    with pytest.raises(ReplicaCountMismatch, match=r"'book': hot.replicas = 0 here, 4"):
        await daemon.run()  # refused before it connects to Kafka


@pytest.mark.parametrize("l1", [True, False])
async def test_load_that_began_during_a_set_is_not_served_after_it(
    redis_url: str, prefix: str, l1: bool
) -> None:
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": l1}})
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, "old")
        if cache.namespace("book").policy.l1 is not None:
            cache.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
        write = Gate(cache._store.write_many)  # set() has begun, its write not sent yet
        cache._store.write_many = write  # type: ignore[method-assign]
        setting = asyncio.ensure_future(cache.set("book", {"id": 1}, "new"))
        await asyncio.wait_for(write.entered.wait(), 5)
        read = Gate(cache._store.get, after=True)  # a load reads "old", resumes late
        cache._store.get = read  # type: ignore[method-assign]
        reading = asyncio.ensure_future(cache.get_or_load("book", {"id": 1}, CountingLoader()))
        await asyncio.wait_for(read.entered.wait(), 5)
        cache._store.get = read.method  # type: ignore[method-assign]
        write.release()
        await setting
        # set() returned: a caller now must not join the load that read "old" ...
        later = asyncio.ensure_future(cache.get_or_load("book", {"id": 1}, CountingLoader()))
        await asyncio.sleep(0.05)
        read.release()
        assert await reading == "old"  # it began before the set() returned: allowed
        assert await later == "new"
        # ... and that load's L1 fill, landing after the set(), is refused.
        assert await cache.get("book", {"id": 1}) == "new"


async def test_set_whose_backplane_append_fails_reaches_the_other_l1_over_pubsub(
    redis_url: str, prefix: str
) -> None:
    """Found by the schedule explorer under load: set() wrote L2, its XADD failed, and it
    returned normally while another instance kept serving its old L1 copy. The refused
    announcement now goes over the pub/sub fallback (``_fallback``): set() returns only
    once it was sent, and the other instance drops its copy."""
    config = make_config(redis_url, prefix)
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        assert await b.get_or_load("book", {"id": 1}, CountingLoader("old")) == "old"
        stream = config.redis.prefix + config.backplane.stream
        await admin.delete(stream)
        await admin.set(stream, "not a stream")  # every XADD now fails (WRONGTYPE)
        await a.set("book", {"id": 1}, "new")
        assert await eventually(lambda: _l1_missing(b, f"{prefix}book:1"))
        assert await b.get("book", {"id": 1}) == "new"
        status = a.backplane_status()
        assert status is not None and status.fallback_sent == 1
        await admin.delete(stream)
    await admin.aclose()


async def test_set_many_whose_backplane_append_fails_reaches_the_other_l1_over_pubsub(
    redis_url: str, prefix: str
) -> None:
    """The same for set_many, whose write is a MULTI/EXEC: the XADD failing inside EXEC
    leaves the SETs in place, and the announcement takes the fallback."""
    config = make_config(redis_url, prefix)
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        for i in (1, 2, 3):
            assert await b.get_or_load("book", {"id": i}, CountingLoader("old")) == "old"
        stream = config.redis.prefix + config.backplane.stream
        await admin.delete(stream)
        await admin.set(stream, "not a stream")  # every XADD now fails (WRONGTYPE)
        await a.set_many("book", [({"id": i}, f"new {i}") for i in (1, 2, 3)])
        for i in (1, 2, 3):
            assert await eventually(lambda i=i: _l1_missing(b, f"{prefix}book:{i}"))
            assert await b.get("book", {"id": i}) == f"new {i}"
        status = a.backplane_status()
        assert status is not None and status.fallback_sent == 1
        await admin.delete(stream)
    await admin.aclose()


@pytest.mark.parametrize("call", ["set", "set_many"])
async def test_set_whose_announcement_no_channel_takes_raises(
    redis_server: RedisServer, prefix: str, call: str
) -> None:
    """Neither the stream nor pub/sub took the announcement: set() must not return as if
    the write had reached every instance. The user may not PUBLISH (an ACL): neither
    set()'s script, which publishes a refused append itself, nor the caller can."""
    admin = redis.Redis.from_url(redis_server.url)
    await admin.execute_command(
        "ACL", "SETUSER", "nopublish", "on", ">secret", "~*", "&*", "+@all", "-publish"
    )
    parts = urllib.parse.urlsplit(redis_server.url)
    url = parts._replace(netloc=f"nopublish:secret@{parts.hostname}:{parts.port}").geturl()
    config = make_config(url, prefix)
    async with LayeredCache.from_config(config) as a:
        stream = config.redis.prefix + config.backplane.stream
        await admin.delete(stream)
        await admin.set(stream, "not a stream")  # every XADD now fails (WRONGTYPE)
        with pytest.raises(L2Unavailable, match="could not announce"):
            if call == "set":
                await a.set("book", {"id": 1}, "new")
            else:
                await a.set_many("book", [({"id": 1}, "new"), ({"id": 2}, "new")])
        # L2 holds the new value; A doesn't keep it in L1 as if the write were everywhere.
        assert _l1_missing(a, f"{prefix}book:1")
        assert await a.get("book", {"id": 1}) == "new"
        await admin.delete(stream)
    await admin.aclose()


def _l1_missing(cache: LayeredCache, key: str) -> bool:
    l1 = cache.namespace("book").policy.l1
    return l1 is not None and l1.get(key) is MISSING


async def test_set_many_with_a_key_twice_keeps_its_last_value_even_one_that_cannot_be_stored(
    redis_url: str, prefix: str
) -> None:
    """As a sequence of set() calls would: the last value of a key wins. When it can't
    be stored, the key goes; the earlier value in the same call used to be kept."""
    book = {"key": "book:{id}", "max_value_bytes": 200}
    config = make_config(redis_url, prefix, {"book": book})
    async with (
        LayeredCache.from_config(config) as writer,
        LayeredCache.from_config(config) as reader,
    ):
        await writer.set_many("book", [({"id": 1}, "first"), ({"id": 1}, "x" * 1000)])
        await writer.set_many("book", [({"id": 2}, "first"), ({"id": 2}, "last")])
        assert await writer.get("book", {"id": 1}) is None
        assert await writer.get("book", {"id": 2}) == "last"
        assert await reader.get("book", {"id": 1}) is None
        assert await reader.get("book", {"id": 2}) == "last"


async def test_set_of_a_value_that_cannot_be_stored_drops_the_old_one_everywhere(
    redis_url: str, prefix: str
) -> None:
    """A set() whose value is refused (too large, not encodable) must not leave the
    previous value to be served in its place, here or in another instance's L1."""
    config = make_config(
        redis_url, prefix, {"book": {"key": "book:{id}", "max_value_bytes": 200}}
    )
    async with (
        LayeredCache.from_config(config) as writer,
        LayeredCache.from_config(config) as reader,
    ):
        await writer.set("book", {"id": 1}, "old price")
        assert await reader.get("book", {"id": 1}) == "old price"  # in reader's L1 now
        await writer.set("book", {"id": 1}, "x" * 1000)  # over max_value_bytes
        assert writer.stats()["book"]["not_cached"] == 1
        assert await writer.get("book", {"id": 1}) is None
        for _ in range(100):
            if await reader.get("book", {"id": 1}) is None:
                break
            await asyncio.sleep(0.02)
        assert await reader.get("book", {"id": 1}) is None


def _l1_value(cache: LayeredCache, fields: dict[str, Any]) -> Any:
    l1 = cache.namespace("book").policy.l1
    assert l1 is not None
    return l1.get(cache.namespace("book").key(fields))


@pytest.mark.parametrize("refused", ["not encodable", "redis full"])
async def test_a_set_whose_value_is_refused_leaves_no_old_copy_in_the_l1_of_a_racing_read(
    prefix: str, refused: str
) -> None:
    """A set() whose new value can't be stored drops the key everywhere instead. A read
    that began after the set() did and read L2 before its DEL filled the old value into
    this instance's L1, and nothing dropped it again (our listener skips our own
    announcement): after set() returned, L2 was empty and L1 served the old value."""
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as server:
        admin = redis.Redis.from_url(server.url)
        async with LayeredCache.from_config(make_config(server.url, prefix)) as cache:
            await cache.set("book", {"id": 1}, "old")
            cache.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
            if refused == "redis full":
                await admin.config_set("maxmemory", 1)  # every write refused
            invalidator = cache._rt.invalidator
            gate = Gate(invalidator.invalidate)  # the drop's DEL not sent yet
            invalidator.invalidate = gate  # type: ignore[method-assign]
            new = object() if refused == "not encodable" else "new"
            setting = asyncio.ensure_future(cache.set("book", {"id": 1}, new))
            await asyncio.wait_for(gate.entered.wait(), 5)
            assert await cache.get("book", {"id": 1}) == "old"  # read during the set()
            gate.release()
            await setting
            assert await admin.get(cache.namespace("book").key({"id": 1})) is None
            assert await cache.get("book", {"id": 1}) is None
        await admin.aclose()


async def test_a_set_whose_value_is_refused_cancelled_after_its_delete_still_tells_the_others(
    redis_url: str, prefix: str
) -> None:
    """The drop's DEL and its announcement run to completion, as invalidate()'s do: a
    caller that timed out between the two left the other instances their old copies."""
    config = make_config(redis_url, prefix)
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        await a.set("book", {"id": 1}, "old")
        assert await b.get("book", {"id": 1}) == "old"  # in b's L1
        invalidator = a._rt.invalidator
        gate = Gate(invalidator.announce)  # the DEL landed, the announcement not sent
        invalidator.announce = gate  # type: ignore[method-assign]
        setting = asyncio.ensure_future(a.set("book", {"id": 1}, object()))
        await asyncio.wait_for(gate.entered.wait(), 5)
        setting.cancel()  # the caller timed out
        await asyncio.gather(setting, return_exceptions=True)
        gate.release()
        assert await a._store.get(a.namespace("book").key({"id": 1})) is None
        assert await eventually(lambda: _l1_value(b, {"id": 1}) is MISSING, timeout=1.5)


def _hold_deletes_and_refuse_announcements(
    cache: LayeredCache,
) -> tuple[asyncio.Event, asyncio.Event]:
    """Every DEL of ``cache`` waits for ``go_on`` (``deleting`` set as it starts), and
    every announcement fails as if the stream and pub/sub were both unreachable."""
    store, invalidator = cache._rt.store, cache._rt.invalidator
    deleting, go_on = asyncio.Event(), asyncio.Event()
    real_delete = store.delete_in_order

    async def paused_delete(groups: Any) -> int:
        deleting.set()
        await go_on.wait()
        return await real_delete(groups)

    async def announcement_refused(keys: Any) -> bool:
        raise redis.ConnectionError("stream and pub/sub both unreachable")

    store.delete_in_order = paused_delete  # type: ignore[method-assign]
    invalidator.announce = announcement_refused  # type: ignore[method-assign]
    return deleting, go_on


async def test_a_failed_invalidate_still_drops_the_local_copy_read_while_it_ran(
    redis_url: str, prefix: str
) -> None:
    """``invalidate`` raises ``L2Unavailable`` when its announcement fails after the DEL
    landed: a read of this instance that filled L1 from L2 before the DEL (after the
    first drop) must not keep serving the deleted value from L1 for its TTL."""
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}})
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, "old")
        l1 = cache.namespace("book").policy.l1
        assert l1 is not None
        l1.clear()  # the value in L2 only
        deleting, go_on = _hold_deletes_and_refuse_announcements(cache)
        invalidating = asyncio.ensure_future(cache.invalidate("book", {"id": 1}))
        await asyncio.wait_for(deleting.wait(), 5)
        assert await cache.get("book", {"id": 1}) == "old"  # read meanwhile, into L1
        go_on.set()
        with pytest.raises(L2Unavailable):
            await invalidating
        assert await cache.get("book", {"id": 1}) is None  # deleted in L2, dropped here


@pytest.mark.parametrize("refused", ["too large", "not encodable"])
async def test_a_failed_drop_of_a_refused_set_still_drops_the_local_copy_read_while_it_ran(
    redis_url: str, prefix: str, refused: str
) -> None:
    """README "Invalidation wins everywhere": a set() whose value can't be stored "drops
    the key as invalidate() does: ... its own L1 drops the key again after the DEL, so a
    read that raced it keeps no old copy" - also when the drop raises after its DEL
    landed, as the failed invalidate() above does. Scenario: L2 holds "old", L1 empty; a
    set() of a refused value begins, its drop's DEL is held; a read here fills "old"
    into L1; the DEL lands, the announcement fails (set() raises). Once, the second drop
    ran only after a successful invalidation (no ``finally`` in ``Writes._drop_steps``):
    L1 served "old" for its 60 s TTL while L2 had deleted it."""
    config = make_config(
        redis_url, prefix,
        {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}, "max_value_bytes": 200}},
    )  # fmt: skip
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, "old")
        l1 = cache.namespace("book").policy.l1
        assert l1 is not None
        l1.clear()  # the value in L2 only
        deleting, go_on = _hold_deletes_and_refuse_announcements(cache)
        new = "x" * 1000 if refused == "too large" else object()
        setting = asyncio.ensure_future(cache.set("book", {"id": 1}, new))
        await asyncio.wait_for(deleting.wait(), 5)
        assert await cache.get("book", {"id": 1}) == "old"  # read meanwhile, into L1
        go_on.set()
        with pytest.raises(L2Unavailable):
            await setting
        assert await admin.get(cache.key("book", {"id": 1})) is None  # deleted in L2
        assert await cache.get("book", {"id": 1}) is None  # and dropped here again
    await admin.aclose()


def _gated(value: str, gate: asyncio.Event, started: asyncio.Event) -> Any:
    async def load() -> str:
        started.set()
        await gate.wait()
        return value

    return load


async def test_a_lease_waiter_that_began_after_an_invalidation_is_not_handed_the_invalidated_fill(
    redis_server: RedisServer, prefix: str
) -> None:
    """A read of B joins the fill subscription an older waiter of B holds (its channel
    subscribed already) while B's reader still holds the fill message of the value an
    invalidation since killed: handed that message, the read (begun after B applied the
    invalidation) returned it and kept it in B's L1 for the L1 TTL, L2 holding the newer
    value. A waiter takes only messages read after the PONG of a PING it sent (``_notify``)."""
    namespaces = {
        "book": {
            "key": "book:{id}",
            "l1": {"ttl": "60s"},
            # long re-read pauses: waiters are woken by the notification alone here
            "stampede": {"max_wait": "20s", "reread_pause": ["8s", "8s"]},
        }
    }
    config = make_config(redis_server.url, prefix, namespaces, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        assert b._backplane is not None
        assert await eventually(b._backplane.connected.is_set)
        key, never = {"id": 1}, asyncio.Event()
        # A wins the lease and loads v1; an earlier read of B waits for that fill.
        g1, s1 = asyncio.Event(), asyncio.Event()
        fill_v1 = asyncio.create_task(a.get_or_load("book", key, _gated("v1", g1, s1)))
        await asyncio.wait_for(s1.wait(), 5)
        older = asyncio.create_task(b.get_or_load("book", key, _gated("b", never, asyncio.Event())))
        notifier = b._parts.notifier
        channel = "{" + b.key("book", key) + "}:filled"
        assert await eventually(lambda: channel in notifier._waiters)  # type: ignore[attr-defined]
        await asyncio.sleep(0.3)  # its subscription confirmed
        held, release = hold_fill_messages(notifier._pubsub)  # type: ignore[attr-defined]
        await asyncio.sleep(1.5)  # the reader's current get_message (1 s timeout) ends
        g1.set()
        assert await fill_v1 == "v1"
        await asyncio.wait_for(held.wait(), 5)
        # v1 is invalidated, and B hears it.
        before = b.backplane_status().entries_applied
        await a.invalidate("book", key)
        assert await eventually(lambda: b.backplane_status().entries_applied > before)
        # A new load begins on A; then a new read of B, which waits on that load's lease.
        g2, s2 = asyncio.Event(), asyncio.Event()
        fill_v2 = asyncio.create_task(a.get_or_load("book", key, _gated("v2", g2, s2)))
        await asyncio.wait_for(s2.wait(), 5)
        newer = asyncio.create_task(b.get_or_load("book", key, _gated("b2", never, asyncio.Event())))
        await asyncio.sleep(0.5)
        release.set()  # the reader catches up: v1's message reaches the older waiter only
        await asyncio.sleep(0.5)
        assert not newer.done(), f"the newer read of B returned {newer.result()!r}"
        g2.set()
        assert await fill_v2 == "v2"
        assert await asyncio.wait_for(newer, 5) == "v2"  # woken by v2's fill
        older.cancel()
        assert await b.get_or_load("book", key, _gated("b3", never, asyncio.Event())) == "v2"
