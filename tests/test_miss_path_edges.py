"""The miss path where a cancel or a slow load meets the lease: a read cancelled while it
gives back a failed load's lease, a winner cancelled between its load and its fill, a
second reader while a load_timeout background fill runs. From an adversarial review
(2026-12-05); each test failed before."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any

import redis.asyncio as redis

from layered_cache import LayeredCache
from layered_cache._keys import lease_name, loading_set_name
from tests.helpers import CountingLoader, make_config

PROMPT = 1.0  # seconds: well under max_wait (3 s) and lease_ttl (4 s)
NAMESPACES = {
    "book": {"key": "book:{id}", "stampede": {"lease_ttl": "4s", "max_wait": "3s"}},
    "category": {
        "key": "category:{slug}",
        "tags": True,
        "stampede": {"lease_ttl": "4s", "max_wait": "3s"},
    },
}


def _cancel_after(task: asyncio.Task[Any], turns: int) -> None:
    """Cancel ``task`` ``turns`` event-loop iterations from now (a chain of call_soon:
    the loop's ready queue is never empty meanwhile, as in a busy server)."""
    loop = asyncio.get_running_loop()

    def step(left: int) -> None:
        if left <= 0:
            task.cancel()
        else:
            loop.call_soon(step, left - 1)

    loop.call_soon(step, turns)


async def _timed(read: Any) -> tuple[Any, float]:
    started = time.monotonic()
    value = await read
    return value, time.monotonic() - started


# -- 1. a failed load's lease release is cut by the caller's cancel -------------------


async def test_a_read_cancelled_while_it_gives_back_the_lease_of_a_failed_load_leaves_no_lease(
    redis_url: str, prefix: str
) -> None:
    """README, "One load per key for the fleet": "a read or batch cancelled anywhere
    else gives its leases back" (test_leases_given_back.py). The loader fails; the
    caller (a client timeout) is cancelled 0-11 loop turns later, i.e. while
    ``load_and_fill`` awaits the release of its lease. No lease may be left behind:
    another instance must get the key promptly, not after lease_ttl / max_wait."""
    config = make_config(redis_url, prefix, NAMESPACES)
    admin = redis.Redis.from_url(redis_url)
    left: list[int] = []
    async with LayeredCache.from_config(config) as a:
        for turns in range(12):
            caller: asyncio.Task[Any] | None = None

            async def failing(turns: int = turns) -> str:
                assert caller is not None
                _cancel_after(caller, turns)
                raise ConnectionError("database down")

            caller = asyncio.create_task(a.get_or_load("book", {"id": turns}, failing))
            await asyncio.gather(caller, return_exceptions=True)
            await asyncio.sleep(0.05)  # any background give-back has run by now
            if await admin.get(lease_name(f"{prefix}book:{turns}")) is not None:
                left.append(turns)
        async with LayeredCache.from_config(config) as b:
            for turns in left:
                value, took = await _timed(b.get_or_load("book", {"id": turns}, lambda: _now("db")))
                assert value == "db"
                print(f"turns={turns}: the other instance waited {took:.2f} s")
    await admin.aclose()
    assert left == [], f"a failed load's lease was left behind when cancelled after {left} turns"


async def _now(value: Any) -> Any:
    return value


# -- 2. a winner cancelled as its fill begins drops the loaded value -------------------


async def test_a_winner_cancelled_as_its_fill_begins_still_fills_for_its_joiners(
    redis_url: str, prefix: str
) -> None:
    """README: "A winner whose caller is cancelled (a client timeout) lets its load run
    on and fill for the others" and "Concurrent misses in one process share one load".
    The caller's deadline fires just after the loader returned, while the fill's first
    Redis step (the tag versions) is in flight: the loaded value is thrown away, the
    lease given back, and the joiner loads the key a second time."""
    config = make_config(redis_url, prefix, NAMESPACES)
    loads = 0
    gate = asyncio.Event()

    async def loader() -> str:
        nonlocal loads
        loads += 1
        await gate.wait()
        return "page"

    async with LayeredCache.from_config(config) as a:
        leader: asyncio.Task[Any] | None = None

        def tags(value: Any) -> list[str]:
            # Called by the fill right after the load, just before its first Redis step:
            # the client's deadline lands there.
            assert leader is not None
            if not leader.done():
                asyncio.get_running_loop().call_soon(leader.cancel)
            return ["t"]

        leader = asyncio.create_task(a.get_or_load("category", {"slug": "a"}, loader, tags=tags))
        await asyncio.sleep(0.05)
        joiner = asyncio.create_task(
            _timed(a.get_or_load("category", {"slug": "a"}, loader, tags=["t"]))
        )
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(leader, return_exceptions=True)
        value, took = await joiner
    assert value == "page" and took < PROMPT
    assert loads == 1, f"{loads} loads: the cancelled winner's loaded value was not filled"


async def test_a_winner_cancelled_right_after_its_load_still_fills_for_its_joiners(
    redis_url: str, prefix: str
) -> None:
    """Same promise, untagged key: the caller's deadline lands 0-7 loop turns after the
    loader returned (at 2: the yield ``_direct`` takes before sending the fill script
    when the loop is busy). Every turn must leave exactly one load."""
    config = make_config(redis_url, prefix, NAMESPACES)
    doubled: list[int] = []
    async with LayeredCache.from_config(config) as a:
        for turns in range(8):
            loads = 0
            gate = asyncio.Event()
            leader: asyncio.Task[Any] | None = None

            async def loader(turns: int = turns, gate: asyncio.Event = gate) -> str:
                nonlocal loads
                loads += 1
                await gate.wait()
                assert leader is not None
                if not leader.done():
                    _cancel_after(leader, turns)
                return "db"

            fields = {"id": 100 + turns}
            leader = asyncio.create_task(a.get_or_load("book", fields, loader))
            await asyncio.sleep(0.05)
            joiner = asyncio.create_task(_timed(a.get_or_load("book", fields, loader)))
            await asyncio.sleep(0.05)
            gate.set()
            await asyncio.gather(leader, return_exceptions=True)
            value, took = await joiner
            assert value == "db" and took < PROMPT
            if loads != 1:
                doubled.append(turns)
    assert doubled == [], f"a second load when the winner was cancelled {doubled} turns after its load"


# -- 3. load_timeout: only the first caller gets the stale value ----------------------


async def test_a_second_read_while_a_load_timeout_background_fill_runs_serves_stale_too(
    redis_url: str, prefix: str
) -> None:
    """docs/operations.md: `stampede.load_timeout` "with `stale.max_age`: serve stale
    after this and finish the load in the background". The first read after expiry is
    answered after load_timeout. A second read of the same instance 50 ms later, with the
    same stale value at hand, waits for the whole 2 s load (the background fill holds
    the lease, so it is a lease waiter, and waiters know no load_timeout)."""
    config = make_config(
        redis_url,
        prefix,
        {
            "book": {
                "key": "book:{id}",
                "l2": {"ttl": "300ms", "jitter": 0},
                "l1": {"ttl": "100ms"},
                "stale": {"max_age": "30s"},
                "stampede": {
                    "early_refresh_beta": 0,
                    "load_timeout": "100ms",
                    "lease_ttl": "10s",
                    "max_wait": "5s",
                },
            }
        },
    )
    loader = CountingLoader("v1")
    async with LayeredCache.from_config(config) as cache:
        await cache.get_or_load("book", {"id": 1}, loader)
        await asyncio.sleep(0.4)  # stale now (soft expiry 300 ms), within max_age
        loader.value, loader.delay = "v2", 2.0
        first, took_first = await _timed(cache.get_or_load("book", {"id": 1}, loader))
        assert first == "v1" and took_first < 0.5
        await asyncio.sleep(0.05)
        second, took_second = await _timed(cache.get_or_load("book", {"id": 1}, loader))
    assert second in ("v1", "v2")
    assert took_second < 0.5, f"second read waited {took_second:.2f} s for the slow load"


STALE_NS = {
    "book": {
        "key": "book:{id}",
        "l2": {"ttl": "300ms", "jitter": 0},
        "l1": {"ttl": "100ms"},
        "stale": {"max_age": "30s"},
        "stampede": {
            "early_refresh_beta": 0,
            "load_timeout": "100ms",
            "lease_ttl": "10s",
            "max_wait": "5s",
        },
    }
}


# -- wait_or_stale: the caller's own cancel, landing while the inner wait unwinds ------


async def test_a_reader_cancelled_as_wait_or_stale_serves_stale_ends_cancelled(
    redis_url: str, prefix: str
) -> None:
    """Another instance's slow load holds the lease; a reader with a stale value at hand
    serves it after load_timeout (``wait_or_stale``). Its client's deadline lands just
    as it does, while ``wait_or_stale`` awaits the inner wait it cancelled
    (``with suppress(CancelledError): await waiting``). The caller's cancel is
    swallowed there: ``Task.cancel`` passes it to the awaited ``waiting`` task, whose
    CancelledError the suppress eats, so the read returns the stale value and the task
    runs on as if never cancelled (a handler loop does not stop, a server's shutdown
    waits on it). Every other cancel on the miss path surfaces (README)."""
    config = make_config(redis_url, prefix, STALE_NS)
    admin = redis.Redis.from_url(redis_url)
    swallowed: list[int] = []
    async with LayeredCache.from_config(config) as cache:
        miss = cache.namespace("book")._miss
        usable = miss.failsafe.usable
        for turns in range(3):
            fields = {"id": 10 + turns}
            await cache.get_or_load("book", fields, CountingLoader("v1"))
            await asyncio.sleep(0.4)  # stale (soft expiry 300 ms), within max_age
            # Another instance's slow load of the key holds its lease.
            await admin.set(lease_name(f"{prefix}book:{10 + turns}"), "theirs", px=10_000)
            caller: asyncio.Task[Any] | None = None

            async def deadline_at_serve(read: Any, turns: int = turns) -> bool:
                ok = await usable(read)
                if ok and caller is not None:
                    loop = asyncio.get_running_loop()

                    def step(left: int) -> None:
                        if left <= 0:
                            assert caller is not None
                            caller.cancel()
                        else:
                            loop.call_soon(step, left - 1)

                    loop.call_soon(step, turns)  # the client's deadline, a turn later
                return ok

            miss.failsafe.usable = deadline_at_serve  # type: ignore[method-assign]
            caller = asyncio.create_task(cache.get_or_load("book", fields, CountingLoader("v2")))
            outcome = (await asyncio.gather(caller, return_exceptions=True))[0]
            miss.failsafe.usable = usable  # type: ignore[method-assign]
            if not caller.cancelled():
                swallowed.append(turns)
                print(f"turns={turns}: returned {outcome!r}, cancelling()={caller.cancelling()}")
    await admin.aclose()
    assert swallowed == [], f"the caller's cancel was swallowed (turns {swallowed}): it returned"


# -- RecordTooLargeError: the catch-up commit skips the record before it is raised ------


TAGGED = {
    "category": {
        "key": "category:{slug}",
        "tags": True,
        "stampede": {"lease_ttl": "4s", "max_wait": "3s"},
    },
}


def _tags_of(page: Mapping[str, Any]) -> list[str]:
    return ["book:42"]


async def test_a_failed_tagged_load_cancelled_during_its_lease_release_leaves_the_loading_set(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> None:
    """e98d5e5. Scenario: a tagged load fails; while ``MissPath.load_and_fill`` awaits
    the lease's release (``tasks.to_completion``, one round trip), the caller is
    cancelled (a request deadline). Expected: as before the commit (``give_back`` then
    ``_unregister``, both synchronous), the load's member leaves the loading set.
    Actual: the CancelledError raised out of ``to_completion`` skips ``self._unregister``
    (layered_cache/_miss.py:177-178): the member stays in a set without TTL."""
    config = make_config(redis_url, prefix, TAGGED)
    async with LayeredCache.from_config(config) as cache:
        miss = cache.namespace("category")._miss
        real_release = miss.release
        releasing = asyncio.Event()

        async def slow_release(key: str, token: str, **kwargs: Any) -> None:
            releasing.set()
            await asyncio.sleep(0.2)  # a Redis round trip with some latency
            await real_release(key, token, **kwargs)

        miss.release = slow_release  # type: ignore[method-assign]

        loading = asyncio.Event()

        async def failing() -> Any:
            loading.set()
            await asyncio.sleep(0.1)
            raise RuntimeError("db down")

        reading = asyncio.ensure_future(
            cache.get_or_load("category", {"slug": "scifi"}, failing, tags=_tags_of)
        )
        await asyncio.wait_for(loading.wait(), 5)
        members_during = await redis_client.smembers(loading_set_name(prefix))
        await asyncio.wait_for(releasing.wait(), 5)
        await asyncio.sleep(0.01)
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, RuntimeError):
            await reading
        await asyncio.sleep(0.5)  # the release (orphaned) and any leave have run
        members = await redis_client.smembers(loading_set_name(prefix))
    assert members_during, "the load was registered"
    assert members == set(), f"loading-set member left behind: {members}"
