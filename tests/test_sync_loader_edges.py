"""The sync API's loaders at their edges: what they raise, what they return, the threads
they start of their own, and calls that are wrong whichever layer would answer them."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from layered_cache.sync import SyncLayeredCache, SyncTimeoutError
from tests.helpers import make_config

NAMESPACES = {
    "book": {"key": "book:{id}", "stampede": {"lease_ttl": "10s", "max_wait": "3s"}},
    "outer": {"key": "outer:{id}"},
    "inner": {"key": "inner:{id}"},
}
PROMPT = 1.0  # seconds: well under max_wait and the call timeout


class Abort(BaseException):
    """Not an ``Exception``: gevent's ``GreenletExit``, a framework's own abort."""


def _leases(redis_url: str, prefix: str) -> list[bytes]:
    admin = redis.Redis.from_url(redis_url)
    try:
        return [k for k in admin.scan_iter(f"{prefix}*lease*")]
    finally:
        admin.close()


@pytest.fixture
def cache(redis_url: str, prefix: str) -> Iterator[SyncLayeredCache]:
    config = make_config(redis_url, prefix, NAMESPACES)
    with SyncLayeredCache.from_config(config, timeout=4) as sync_cache:
        yield sync_cache


@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt(), Abort("aborted")])
def test_a_loader_raising_what_is_not_an_exception_fails_its_call_and_the_cache_goes_on(
    cache: SyncLayeredCache, redis_url: str, prefix: str, raised: BaseException
) -> None:
    """Handed to the loop as is, SystemExit or KeyboardInterrupt stopped the loop thread
    (asyncio re-raises both out of the loop): that call and every later one in the
    process waited out the timeout. Now the caller's thread gets what the loader raised,
    the lease goes back, and the next call loads at once."""

    def loader() -> str:
        raise raised

    with pytest.raises(type(raised)):
        cache.get_or_load("book", {"id": 1}, loader)
    assert _leases(redis_url, prefix) == []
    started = time.monotonic()
    assert cache.get_or_load("book", {"id": 1}, lambda: "fresh") == "fresh"
    assert cache.get_or_load("book", {"id": 2}, lambda: "other") == "other"
    assert time.monotonic() - started < PROMPT


def test_a_batch_loader_raising_what_is_not_an_exception_fails_its_call_only(
    cache: SyncLayeredCache, redis_url: str, prefix: str
) -> None:
    def load_many(missing: list[Any]) -> list[str]:
        raise SystemExit(3)

    with pytest.raises(SystemExit):
        cache.get_or_load_many("book", [{"id": 1}, {"id": 2}], load_many)
    assert _leases(redis_url, prefix) == []
    assert cache.get_or_load_many("book", [{"id": 1}], lambda m: ["ok"] * len(m)) == ["ok"]


def test_an_async_function_given_to_the_sync_api_is_a_clear_error(
    cache: SyncLayeredCache,
) -> None:
    """It returned a coroutine object as "the value" (nothing cached, the database never
    asked); now a TypeError before anything runs, naming the async API."""

    async def load_book() -> dict[str, Any]:
        return {"title": "Dune"}

    async def load_books(missing: list[Any]) -> list[Any]:
        return [{"title": "Dune"}] * len(missing)

    with pytest.raises(TypeError, match="async API"):
        cache.get_or_load("book", {"id": 1}, load_book)
    with pytest.raises(TypeError, match="async API"):
        cache.get_or_load_many("book", [{"id": 1}], load_books)
    assert cache.get("book", {"id": 1}) is None


def test_a_loader_returning_an_awaitable_is_a_clear_error_and_caches_nothing(
    cache: SyncLayeredCache, redis_url: str, prefix: str
) -> None:
    """A plain function (a lambda, a partial) that returns a coroutine: refused where the
    value comes back, the coroutine closed (no "never awaited" warning), the lease back."""

    async def load_book() -> str:
        return "Dune"

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine never awaited would warn
        with pytest.raises(TypeError, match="returned an awaitable"):
            cache.get_or_load("book", {"id": 1}, lambda: load_book())
    assert cache.get("book", {"id": 1}) is None
    assert _leases(redis_url, prefix) == []


def test_a_loader_fanning_out_to_threads_of_its_own_does_not_wait_on_the_pool_it_fills(
    redis_url: str, prefix: str
) -> None:
    """A loader that fetches its parts on a ThreadPoolExecutor of its own: those threads'
    calls can't be told from any other caller's. With every pool thread taken by such
    loaders (one thread here), their parts' loads queued behind them for good; a load
    that finds the pool full now runs on a thread of its own."""
    config = make_config(redis_url, prefix, NAMESPACES)
    with SyncLayeredCache.from_config(config, max_workers=1, timeout=4) as cache:

        def part(j: int) -> int:
            return cache.get_or_load("inner", {"id": j}, lambda: j * 10)

        def load_outer() -> int:
            with ThreadPoolExecutor(2) as fan:
                return sum(fan.map(part, range(3)))

        started = time.monotonic()
        assert cache.get_or_load("outer", {"id": 1}, load_outer) == 30
        assert time.monotonic() - started < PROMPT


def test_32_threads_of_loaders_fanning_out_all_finish(redis_url: str, prefix: str) -> None:
    """A cold start after a deploy: every pool thread runs such a loader at once."""
    config = make_config(redis_url, prefix, NAMESPACES)
    with SyncLayeredCache.from_config(config, max_workers=4, timeout=10) as cache:

        def load_outer(i: int) -> int:
            with ThreadPoolExecutor(2) as fan:
                parts = fan.map(
                    lambda j: cache.get_or_load("inner", {"id": i * 10 + j}, lambda: j), range(2)
                )
                return sum(parts)

        with ThreadPoolExecutor(32) as callers:
            results = list(
                callers.map(
                    lambda i: cache.get_or_load("outer", {"id": i}, lambda: load_outer(i)),
                    range(32),
                )
            )
        assert results == [1] * 32


def test_a_loader_needing_its_own_key_through_a_thread_in_its_context_raises(
    cache: SyncLayeredCache,
) -> None:
    """A helper thread that runs in the loader's context (``copy_context().run``, as
    ``asyncio.to_thread`` does) carries the loader's mark: asking for the key being
    loaded is a RecursionError, not a wait for itself until the timeout."""

    def itself() -> int:
        context = contextvars.copy_context()
        with ThreadPoolExecutor(1) as helper:
            future = helper.submit(
                context.run, cache.get_or_load, "outer", {"id": 1}, lambda: 1
            )
            return future.result()

    started = time.monotonic()
    with pytest.raises(RecursionError, match=r"outer:1' itself"):
        cache.get_or_load("outer", {"id": 1}, itself)
    assert time.monotonic() - started < PROMPT


def test_tags_given_to_a_namespace_without_tags_are_refused_on_an_l1_hit_too(
    cache: SyncLayeredCache,
) -> None:
    """The sync API answers L1 hits in the calling thread; the same wrong call raised on
    a miss and passed on a hit."""
    with pytest.raises(ValueError, match="takes no tags"):
        cache.get_or_load("book", {"id": 1}, lambda: "v", tags=["book:1"])
    cache.set("book", {"id": 1}, "v")
    assert cache.get_or_load("book", {"id": 1}, lambda: "v") == "v"  # an L1 hit
    with pytest.raises(ValueError, match="takes no tags"):
        cache.get_or_load("book", {"id": 1}, lambda: "v", tags=["book:1"])


def test_the_loop_thread_survives_every_loader_above(cache: SyncLayeredCache) -> None:
    """After a loader raised SystemExit, the cache's own thread still runs."""

    def loader() -> str:
        raise SystemExit(1)

    with pytest.raises(SystemExit):
        cache.get_or_load("book", {"id": 9}, loader)
    names = {thread.name for thread in threading.enumerate()}
    assert "layered-cache-loop" in names
    assert cache.get_or_load("book", {"id": 9}, lambda: "after") == "after"


def test_get_or_load_many_reads_a_generator_of_fields_once(cache: SyncLayeredCache) -> None:
    """The sync API built the keys from it first, then handed the spent generator to the
    async call: [] and no error."""

    def load_many(fields_list: list[Any]) -> list[str]:
        return [f"v{f['id']}" for f in fields_list]

    fields = ({"id": i} for i in range(3))
    assert cache.get_or_load_many("book", fields, load_many) == ["v0", "v1", "v2"]


@contextlib.contextmanager
def _released(hung: threading.Event) -> Iterator[None]:
    """The database answers at the end whatever happened (a loader left waiting holds
    its pool thread, and the interpreter's exit would wait for it for ever)."""
    try:
        yield
    finally:
        hung.set()


def _loader_threads() -> int:
    return sum(t.name.startswith("layered-cache-loader") for t in threading.enumerate())


def test_a_hung_database_can_not_grow_loader_threads_past_the_pool_and_its_overflow(
    redis_url: str, prefix: str
) -> None:
    """Every call of another key times out against a database that hangs, and each left
    its loader running on one more thread of its own: 40 calls, 40 threads, without
    bound. Now threads beyond the pool are capped (``max_overflow``): past them a load
    fails at once with LoaderThreadsExhausted, and once the database answers the cache
    loads again."""
    from layered_cache.sync import LoaderThreadsExhausted

    hung = threading.Event()
    config = make_config(redis_url, prefix, NAMESPACES)
    before = _loader_threads()
    with (
        SyncLayeredCache.from_config(config, max_workers=2, max_overflow=3, timeout=0.2) as cache,
        _released(hung),
    ):
        outcomes = []
        for i in range(40):
            try:
                cache.get_or_load("book", {"id": i}, hung.wait)
            except Exception as exc:
                outcomes.append(type(exc).__name__)
        assert _loader_threads() - before <= 2 + 3
        assert outcomes.count("SyncTimeoutError") == 5  # the pool's 2 and the overflow's 3
        assert outcomes.count("LoaderThreadsExhausted") == 35
        hung.set()
        deadline = time.monotonic() + PROMPT
        while time.monotonic() < deadline:  # the abandoned loaders finish, their threads end
            try:
                assert cache.get_or_load("book", {"id": 100}, lambda: "loaded") == "loaded"
                break
            except LoaderThreadsExhausted:
                time.sleep(0.01)
        assert cache.get_or_load("book", {"id": 101}, lambda: "loaded too") == "loaded too"


def test_a_load_refused_for_want_of_threads_serves_the_stale_value_it_may(
    redis_url: str, prefix: str
) -> None:
    """LoaderThreadsExhausted is a failed load like any other: the fail-safe serves the
    expired value within ``stale.max_age``."""
    hung = threading.Event()
    namespaces = {
        "book": {"key": "book:{id}", "l1": False, "l2": {"ttl": "200ms"},
                 "stale": {"max_age": "60s"}}
    }
    config = make_config(redis_url, prefix, namespaces)
    with SyncLayeredCache.from_config(config, max_workers=1, max_overflow=1, timeout=0.2) as cache:
        cache.set("book", {"id": 1}, "old price")
        for i in (2, 3):  # the pool's thread and the one overflow thread hang
            with pytest.raises(TimeoutError):
                cache.get_or_load("book", {"id": i}, hung.wait)
        time.sleep(0.3)  # book 1 is past its soft expiry
        try:
            assert cache.get_or_load("book", {"id": 1}, lambda: "new price") == "old price"
        finally:
            hung.set()


def _threads_of_loaders() -> int:
    """The pool's, the overflow's, the nested and the unqueued loaders' threads."""
    return sum(
        t.name.startswith("layered-cache-") and "loader" in t.name for t in threading.enumerate()
    )


def test_a_hung_database_can_not_grow_nested_loader_threads_without_bound(
    redis_url: str, prefix: str
) -> None:
    """A page's loader reads its author through the cache, and the database hangs. Each
    page call timed out; its loader timed out on the nested call too, raised and freed its
    pool thread, but the nested author loader stayed hung on a thread of its own, counted
    nowhere: one more thread per request. Now nested threads are counted until they
    end, capped (apart from the overflow) at ``max_workers + max_overflow``, past which
    a nested load fails at once."""
    hung = threading.Event()
    config = make_config(redis_url, prefix, NAMESPACES)
    before = _threads_of_loaders()
    with (
        SyncLayeredCache.from_config(config, max_workers=2, max_overflow=3, timeout=0.15) as cache,
        _released(hung),
    ):

        def page_loader(i: int) -> Any:
            return lambda: {"author": cache.get_or_load("inner", {"id": i}, hung.wait)}

        outcomes = []
        for i in range(40):
            try:
                cache.get_or_load("outer", {"id": i}, page_loader(i))
            except Exception as exc:
                outcomes.append(type(exc).__name__)
            time.sleep(0.2)  # the page's loader gave up on its author meanwhile
        assert _threads_of_loaders() - before <= 2 + 3 + (2 + 3), outcomes  # + nested
        assert "LoaderThreadsExhausted" in outcomes
        hung.set()
        deadline = time.monotonic() + PROMPT
        while time.monotonic() < deadline:  # the hung authors finish, their threads end
            with contextlib.suppress(Exception):
                if cache.get_or_load("outer", {"id": 100}, page_loader(100)):
                    break
            time.sleep(0.01)
        assert cache.get_or_load("outer", {"id": 101}, page_loader(101)) == {"author": True}


async def test_loaders_unqueued_for_a_nested_call_take_no_threads_past_max_overflow() -> None:
    """When a nested call begins, the loaders queued for the pool get threads of their
    own (the nested call may join one); those threads were counted nowhere. They count
    with the nested ones now (capped at ``max_workers + max_overflow``: here 3), and two
    loaders queued behind a pool whose thread hangs get theirs, no more."""
    from layered_cache._sync_loaders import LoaderThreads

    hung = threading.Event()
    threads = LoaderThreads(pool_size=2, max_overflow=1)
    with ThreadPoolExecutor(max_workers=1) as pool, _released(hung):
        pool.submit(hung.wait)  # the pool's thread is taken: the two loaders wait
        before = _threads_of_loaders()
        queued = [asyncio.ensure_future(threads.wrap(k, hung.wait, pool)()) for k in "ab"]
        await asyncio.sleep(0.05)

        def page() -> str:  # a nested call begins
            threads.wrap("author", hung.wait, None)
            return "page"

        assert await threads.wrap("page", page, pool)() == "page"  # the pool is full: overflow
        done, _ = await asyncio.wait(queued, timeout=0.2)
        assert not done  # each on a thread of its own, waiting on the hung database
        assert _threads_of_loaders() - before <= 3
        hung.set()
        assert await asyncio.wait_for(asyncio.gather(*queued), 5) == [True, True]


def test_a_loader_raising_stopiteration_fails_its_call_at_once(cache: SyncLayeredCache) -> None:
    """``next(iter(rows))`` on an empty result: asyncio's futures refuse StopIteration
    (a TypeError inside the loop's callback), so the call's future never settled and the
    call waited out its timeout holding the lease. Now a RuntimeError whose cause is the
    StopIteration, at once, and the next call loads."""
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="StopIteration") as raised:
        cache.get_or_load("book", {"id": 1}, lambda: next(iter([])))
    assert time.monotonic() - started < PROMPT
    assert isinstance(raised.value.__cause__, StopIteration)
    assert cache.get_or_load("book", {"id": 1}, lambda: "loaded") == "loaded"


def test_a_loaders_own_timeout_error_reaches_the_caller_as_it_was(
    cache: SyncLayeredCache,
) -> None:
    """The builtin TimeoutError is also what ``Future.result(timeout)`` raises when time
    runs out: a loader's database read timeout, raised in 2 ms, was reported as "did not
    finish within 4 s" with the loader's error dropped."""

    def loader() -> str:
        raise TimeoutError("database read timed out")  # socket.timeout, a driver's read timeout

    with pytest.raises(TimeoutError, match="database read timed out") as raised:
        cache.get_or_load("book", {"id": 1}, loader)
    assert not isinstance(raised.value, SyncTimeoutError)


@pytest.mark.parametrize(
    "limits", [{"max_overflow": "8"}, {"max_overflow": -1}, {"max_workers": 0}, {"max_workers": True}]
)
def test_loader_thread_limits_that_make_no_sense_are_refused_at_construction(
    redis_url: str, prefix: str, limits: dict[str, Any]
) -> None:
    """A string from Django's OPTIONS failed only once the pool was full, mid-request."""
    with pytest.raises(ValueError, match="must be an int"):
        SyncLayeredCache.from_config(make_config(redis_url, prefix, NAMESPACES), **limits)


@pytest.mark.parametrize("timeout", ["5", 0, -1, True, float("nan")])
def test_a_call_timeout_that_makes_no_sense_is_refused_at_construction(
    redis_url: str, prefix: str, timeout: Any
) -> None:
    """A string timeout failed every call with a TypeError from inside ``threading``;
    0 or less failed every call with "starting the cache did not finish within 0 s"."""
    with pytest.raises(ValueError, match="timeout must be None or a number of seconds > 0"):
        SyncLayeredCache.from_config(make_config(redis_url, prefix, NAMESPACES), timeout=timeout)


def test_a_nested_cached_call_works_with_max_overflow_zero(redis_url: str, prefix: str) -> None:
    """``max_overflow=0`` ("no thread beyond the pool") with cached functions that nest:
    nested threads capped by that same number, every nested load failed at once on an
    idle cache and a healthy database. They are capped at ``max_workers + max_overflow``."""
    namespaces = {"outer": {"key": "outer:{id}"}, "inner": {"key": "inner:{id}"}}
    config = make_config(redis_url, prefix, namespaces)
    with SyncLayeredCache.from_config(config, max_workers=4, max_overflow=0, timeout=5) as cache:

        def page() -> Any:
            return {"author": cache.get_or_load("inner", {"id": 1}, lambda: "ann")}

        assert cache.get_or_load("outer", {"id": 1}, page) == {"author": "ann"}
