"""A batch's background fill (stale served after load_timeout) and its leases: given back
when close() stops the fill, kept for the fill when the batch's caller is cancelled
after serving stale. From an adversarial review (2026-12-05); each test failed before."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from layered_cache import LayeredCache
from layered_cache._keys import lease_name
from tests.helpers import CountingLoader, make_config
from tests.test_batch_trials import _stale_books
from tests.test_invalidation_wins import Gate


async def test_close_during_a_batchs_background_fill_gives_its_leases_back(
    redis_url: str, prefix: str, redis_client: aioredis.Redis
) -> None:
    """README ("Leases are given back"): "one that served stale after load_timeout fills
    in the background, and gives them back if its load fails or close() stops it".
    Scenario: a batch served stale after load_timeout; its load ends, its fill pipeline is
    slow (held at ``L2Batch.fill_many``); close() cancels the background fill there.
    Expected: the leases go back (as ``MissPath.fill`` gives a cancelled fill's back).
    Actual: ``BatchFill._fill_loaded`` (layered_cache/_batch_fill.py:142) releases only on
    ``Exception``; a CancelledError passes, both leases stay for lease_ttl (5 s) and every
    reader of those keys, fleet-wide, waits max_wait."""
    config = _stale_books(redis_url, prefix, "50ms")
    loaded = asyncio.Event()

    async def load_many(fields_list: list[Mapping[str, object]]) -> list[Any]:
        await loaded.wait()
        return [f"new{fields['id']}" for fields in fields_list]

    cache = LayeredCache.from_config(config)
    await cache.start()
    try:
        await cache.set_many("book", [({"id": i}, f"old{i}") for i in (1, 2)])
        await asyncio.sleep(0.3)  # past the soft expiry, within stale.max_age
        l2batch = cache.namespace("book")._batch._loader._batch
        gate = Gate(l2batch.fill_many)
        l2batch.fill_many = gate  # type: ignore[method-assign]
        books = [{"id": 1}, {"id": 2}]
        assert await asyncio.wait_for(cache.get_or_load_many("book", books, load_many), 5) == [
            "old1", "old2",
        ]
        loaded.set()
        await asyncio.wait_for(gate.entered.wait(), 5)  # the background fill is under way
    finally:
        await cache.close()
    await asyncio.sleep(0.1)
    keys = [cache.key("book", book) for book in books]
    held = [await redis_client.exists(lease_name(key)) for key in keys]
    assert held == [0, 0], "leases kept after close() stopped the background fill"


async def test_a_batch_cancelled_after_serving_stale_keeps_the_leases_of_its_background_fill(
    redis_url: str, prefix: str, redis_client: aioredis.Redis
) -> None:
    """README: "a key another process is loading is waited for, not loaded again";
    "one that served stale after load_timeout fills in the background".
    Scenario: a batch of books 1, 2 (stale at hand) and 3 (no value; another process holds
    its lease). After load_timeout books 1 and 2 are served stale and their load goes on
    in the background under their leases; the batch still waits for book 3's holder, and
    its caller is cancelled (a client timeout).
    Expected: the background load keeps its leases and fills: another reader of book 1
    waits for it (serves stale) instead of loading it again, and L2 gets the new value.
    Actual: ``BatchLoader._load_misses`` (layered_cache/_batch_load.py:398-401) gives back
    every won lease on any exception of ``all_or_none``, also those a background fill
    (``BatchFill._finish``) still loads under: the other reader takes the lease and
    loads again, the background fill is refused (fill_revoked)."""
    config = _stale_books(redis_url, prefix, "50ms")
    calls = 0

    async def load_many(fields_list: list[Mapping[str, object]]) -> list[Any]:
        nonlocal calls
        calls += 1
        await asyncio.sleep(1.0)  # a slow database
        return [f"new{fields['id']}" for fields in fields_list]

    async with (
        LayeredCache.from_config(config) as cache,
        LayeredCache.from_config(config) as other,
    ):
        await cache.set_many("book", [({"id": i}, f"old{i}") for i in (1, 2)])
        await asyncio.sleep(0.3)  # past the soft expiry, within stale.max_age
        await redis_client.set(lease_name(cache.key("book", {"id": 3})), "another", px=5000)
        books = [{"id": 1}, {"id": 2}, {"id": 3}]
        reading = asyncio.ensure_future(cache.get_or_load_many("book", books, load_many))
        await asyncio.sleep(0.3)  # 1 and 2 were served stale; the batch waits for 3
        assert calls == 1 and not reading.done()
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await asyncio.sleep(0.05)
        lease = await redis_client.get(lease_name(cache.key("book", {"id": 1})))
        reloaded = CountingLoader("other1")
        value = await other.get_or_load("book", {"id": 1}, reloaded)
        await asyncio.sleep(1.2)  # the background load ends and fills
        revoked = cache.stats()["book"]["fill_revoked"]
    assert (lease is not None, value, reloaded.calls, revoked) == (True, "old1", 0, 0), (
        "lease held by the background fill", lease, value, reloaded.calls, revoked,
    )


async def test_a_batch_cancelled_during_its_fill_returns_without_awaiting_the_lease_release(
    redis_url: str, prefix: str
) -> None:
    """c0a45bc. ``MissPath.give_back``: a caller being cancelled "can't await" the release,
    it goes in the background. Scenario: a batch's load is done, its fill pipeline is slow
    (Redis late: held at ``L2Batch.fill_many``) and the caller's deadline (0.3 s) lands
    there; the lease release is slow as well (1 s). Expected: the caller gets its
    TimeoutError at the deadline, the leases go back in the background (``_load_misses``'s
    ``give_back``), as before the commit. Actual: ``BatchFill._fill_loaded``
    (layered_cache/_batch_fill.py:144-150) now catches the CancelledError too and awaits
    the release before re-raising: the deadline overshoots by the release's round trip
    (up to redis.timeout when Redis is slow, which is when deadlines fire)."""
    import time

    from tests.test_invalidation_wins import Gate

    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}"}})
    async with LayeredCache.from_config(config) as cache:
        l2batch = cache.namespace("book")._batch._loader._batch
        gate = Gate(l2batch.fill_many)
        l2batch.fill_many = gate  # type: ignore[method-assign]
        real_release = l2batch.release_many

        async def slow_release(leases: Any, token: str) -> Any:
            if leases:  # not ``filled_meanwhile``'s empty one
                await asyncio.sleep(1.0)
            return await real_release(leases, token)

        l2batch.release_many = slow_release  # type: ignore[method-assign]

        async def load_many(fields_list: list[Mapping[str, object]]) -> list[Any]:
            return [f"v{fields['id']}" for fields in fields_list]

        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.3):
                await cache.get_or_load_many("book", [{"id": 1}, {"id": 2}], load_many)
        took = time.monotonic() - started
        entered = gate.entered.is_set()
        gate.release()
    assert entered, "the deadline did not land in the fill"
    assert took < 0.7, f"the cancelled batch returned after {took:.2f} s (deadline 0.3 s)"


async def test_close_leaves_no_lease_release_running_after_it_returns(
    redis_url: str, prefix: str, redis_client: aioredis.Redis
) -> None:
    """853913e. ``BackgroundTasks``: "close cancels and awaits [its tasks], so no task
    outlives the cache or its Redis clients". Scenario: close() stops a batch's background
    fill held in its fill pipeline; the fill's CancelledError now spawns the lease release
    as an orphan (``_batch_fill.py:149``), and Redis is slow (the release hangs). Expected:
    when close() returns, nothing of the cache still runs (its clients are closed next).
    Actual: ``BackgroundTasks.close`` (``_runtime.py:113-114``) only *waits* ORPHAN_GRACE for
    the orphans its cancels spawned, never cancels them: the release is still running
    against the closed clients after close() returned."""
    config = _stale_books(redis_url, prefix, "50ms")
    loaded = asyncio.Event()

    async def load_many(fields_list: list[Mapping[str, object]]) -> list[Any]:
        await loaded.wait()
        return [f"new{fields['id']}" for fields in fields_list]

    cache = LayeredCache.from_config(config)
    await cache.start()
    cache._rt.tasks.ORPHAN_GRACE = 0.3  # type: ignore[misc]  # keep the test short
    releasing = asyncio.Event()
    ended = asyncio.Event()
    try:
        await cache.set_many("book", [({"id": i}, f"old{i}") for i in (1, 2)])
        await asyncio.sleep(0.3)
        l2batch = cache.namespace("book")._batch._loader._batch
        gate = Gate(l2batch.fill_many)
        l2batch.fill_many = gate  # type: ignore[method-assign]
        real_release = l2batch.release_many

        async def hung_release(leases: Any, token: str) -> Any:
            if not leases:
                return await real_release(leases, token)
            releasing.set()
            try:
                await asyncio.sleep(2.0)  # Redis late (bounded by redis.timeout)
                return await real_release(leases, token)
            finally:
                ended.set()

        l2batch.release_many = hung_release  # type: ignore[method-assign]
        books = [{"id": 1}, {"id": 2}]
        assert await asyncio.wait_for(cache.get_or_load_many("book", books, load_many), 5) == [
            "old1", "old2",
        ]
        loaded.set()
        await asyncio.wait_for(gate.entered.wait(), 5)
    finally:
        await cache.close()
    still_running = releasing.is_set() and not ended.is_set()
    await asyncio.sleep(2.2)  # let it end before the loop closes
    assert releasing.is_set(), "close() did not cancel the fill into a release"
    assert not still_running, "a lease release of the cache was still running after close()"
