"""The sync API: one async implementation on a private loop, safe under threads."""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import pytest
import redis

from layered_cache.sync import SyncLayeredCache
from tests.helpers import make_config

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class Book(msgspec.Struct):
    id: int
    title: str


class SyncLoader:
    """Counts calls (thread-safe); optionally slow."""

    def __init__(self, value: Any = "v", delay: float = 0.0) -> None:
        self.value = value
        self.delay = delay
        self.calls = 0
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self) -> Any:
        with self._lock:
            self.calls += 1
            self.threads.add(threading.current_thread().name)
        if self.delay:
            time.sleep(self.delay)
        return self.value


@pytest.fixture
def cache(redis_url: str, prefix: str) -> Iterator[SyncLayeredCache]:
    config = make_config(
        redis_url,
        prefix,
        {"book": {"key": "book:{id}"}, "stock": {"key": "stock:{id}", "cache": False}},
    )
    with SyncLayeredCache.from_config(config) as sync_cache:
        yield sync_cache


def test_50_threads_concurrent_misses_cause_one_load(cache: SyncLayeredCache) -> None:
    loader = SyncLoader({"title": "Dune"}, delay=0.2)
    barrier = threading.Barrier(50)

    def read() -> Any:
        barrier.wait(timeout=10)
        return cache.get_or_load("book", {"id": 42}, loader)

    with ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(lambda _: read(), range(50)))
    assert results == [{"title": "Dune"}] * 50
    assert loader.calls == 1
    # the sync loader ran in the loader pool, not on the event loop thread
    assert all(name.startswith("layered-cache-loader") for name in loader.threads)
    stats = cache.stats()["book"]
    assert stats["load"] == 1
    assert stats["coalesced"] + stats["lease_wait_filled"] + stats["l1_hit"] + 1 >= 50


def test_l1_hit_is_served_in_the_calling_thread(cache: SyncLayeredCache) -> None:
    loader = SyncLoader("v")
    assert cache.get_or_load("book", {"id": 1}, loader) == "v"
    assert cache._runner is not None
    loop = cache._runner.loop
    # Stall the loop thread: an L1 hit must not need it.
    release = threading.Event()
    loop.call_soon_threadsafe(lambda: release.wait(5))
    try:
        started = time.monotonic()
        for _ in range(100):
            assert cache.get_or_load("book", {"id": 1}, loader) == "v"
            assert cache.get("book", {"id": 1}) == "v"
        assert time.monotonic() - started < 2
    finally:
        release.set()
    assert loader.calls == 1
    assert cache.stats()["book"]["l1_hit"] == 200


def test_get_set_invalidate(cache: SyncLayeredCache, redis_url: str, prefix: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    assert cache.get("book", {"id": 2}) is None
    cache.set("book", {"id": 2}, {"title": "Emma"})
    assert cache.get("book", {"id": 2}) == {"title": "Emma"}
    assert admin.exists(f"{prefix}book:2") == 1
    cache.invalidate("book", {"id": 2})
    assert admin.exists(f"{prefix}book:2") == 0
    assert cache.get("book", {"id": 2}) is None
    loader = SyncLoader("fresh")
    assert cache.get_or_load("book", {"id": 2}, loader) == "fresh"
    stats = cache.stats()
    assert stats["book"]["set"] == 1 and stats["book"]["invalidated"] == 1
    assert cache.redis_status().breaker == "closed"
    assert cache.key("book", {"id": 2}) == f"{prefix}book:2"
    assert cache.hot_keys() == {}
    admin.close()


def test_bypass_namespace_always_loads(cache: SyncLayeredCache) -> None:
    loader = SyncLoader(5)
    for _ in range(3):
        assert cache.get_or_load("stock", {"id": 1}, loader) == 5
    assert loader.calls == 3


def test_cached_decorator_for_sync_functions(cache: SyncLayeredCache) -> None:
    calls: list[int] = []

    @cache.cached("book", ignore=("lang",))
    def book_detail(id: int, *, lang: str = "en") -> Book:
        calls.append(id)
        return Book(id, f"title {id} {lang}")

    assert book_detail(3) == Book(3, "title 3 en")
    assert book_detail(id=3) == Book(3, "title 3 en")
    assert book_detail(4).id == 4
    assert calls == [3, 4]
    assert book_detail.__name__ == "book_detail"
    # decoded from L2 into the return annotation by another instance
    cache.cache.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
    assert isinstance(cache.get("book", {"id": 3}), Book)

    with pytest.raises(KeyError, match="'id'"):

        @cache.cached("book")
        def wrong(book_id: int) -> str:
            return "x"

    with pytest.raises(TypeError, match="async"):

        @cache.cached("book")
        async def coro(id: int) -> str:
            return "x"


def test_loader_sees_the_callers_context_and_errors_propagate(cache: SyncLayeredCache) -> None:
    seen: list[str] = []

    def loader() -> str:
        seen.append(request_id.get())
        return "ok"

    token = request_id.set("req-7")
    try:
        assert cache.get_or_load("book", {"id": 11}, loader) == "ok"
    finally:
        request_id.reset(token)
    assert seen == ["req-7"]

    def failing() -> str:
        raise RuntimeError("db down")

    with pytest.raises(RuntimeError, match="db down"):
        cache.get_or_load("book", {"id": 12}, failing)
    with pytest.raises(KeyError, match="unknown namespace"):
        cache.get_or_load("nope", {"id": 1}, loader)
    with pytest.raises(ValueError, match="not a safe key value"):
        cache.get("book", {"id": "a b"})


def test_lifecycle(redis_url: str, prefix: str) -> None:
    sync_cache = SyncLayeredCache(make_config(redis_url, prefix))
    with pytest.raises(RuntimeError, match="not started"):
        sync_cache.get("book", {"id": 1})
    sync_cache.start()
    sync_cache.start()  # idempotent
    assert sync_cache._runner is not None
    thread = sync_cache._runner.thread
    assert thread.daemon and thread.is_alive()
    sync_cache.set("book", {"id": 1}, 1)
    sync_cache.close()
    sync_cache.close()
    thread.join(5)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="not started"):
        sync_cache.set("book", {"id": 1}, 1)


def _nested_config(redis_url: str, prefix: str) -> Any:
    return make_config(
        redis_url,
        prefix,
        {"outer": {"key": "outer:{id}"}, "inner": {"key": "inner:{id}"}},
    )


def test_64_threads_through_nested_cached_functions_never_wait_on_the_pool_they_occupy(
    redis_url: str, prefix: str
) -> None:
    """Every pool thread runs an `outer` loader that needs `inner`: were the inner loads
    queued on the same pool, nothing could ever finish (the pool has 4 threads here,
    32 by default; 64 callers exhaust either)."""
    with SyncLayeredCache.from_config(_nested_config(redis_url, prefix), max_workers=4) as cache:

        @cache.cached("inner")
        def inner(id: int) -> int:
            time.sleep(0.01)
            return id * 10

        @cache.cached("outer")
        def outer(id: int) -> int:
            time.sleep(0.01)
            return inner(id) + 1

        barrier = threading.Barrier(64)

        def call(i: int) -> int:
            barrier.wait(timeout=10)
            return outer(i)

        with ThreadPoolExecutor(max_workers=64) as callers:
            futures = [callers.submit(call, i) for i in range(64)]
            results = [future.result(timeout=30) for future in futures]
    assert results == [i * 10 + 1 for i in range(64)]


def test_a_nested_call_joining_a_load_queued_behind_the_pool_does_not_wait_for_it(
    redis_url: str, prefix: str
) -> None:
    """A's loader (the pool's only thread) needs B; B's own top-level load, from another
    thread, is queued behind A's loader on that pool. The nested call joins B's load
    (single-flight) and waited for the pool thread that waits for it, until the call
    timeout."""
    with SyncLayeredCache.from_config(
        _nested_config(redis_url, prefix), max_workers=1, timeout=4.0
    ) as cache:
        go, running = threading.Event(), threading.Event()

        def load_a() -> int:
            running.set()
            go.wait(5)
            return int(cache.get_or_load("inner", {"id": 2}, lambda: 20)) + 1

        with ThreadPoolExecutor(max_workers=2) as callers:
            a = callers.submit(cache.get_or_load, "outer", {"id": 1}, load_a)
            assert running.wait(5)
            b = callers.submit(cache.get_or_load, "inner", {"id": 2}, lambda: 20)
            time.sleep(0.3)  # B's load is queued behind A's loader
            started = time.monotonic()
            go.set()
            assert (a.result(timeout=10), b.result(timeout=10)) == (21, 20)
            assert time.monotonic() - started < 2.0


def test_a_loader_that_needs_its_own_key_raises_instead_of_waiting_forever(
    redis_url: str, prefix: str
) -> None:
    with SyncLayeredCache.from_config(_nested_config(redis_url, prefix)) as cache:

        def itself() -> int:
            return cache.get_or_load("outer", {"id": 1}, itself) + 1

        started = time.monotonic()
        with pytest.raises(RecursionError, match=r"outer:1.*needs.*outer:1"):
            cache.get_or_load("outer", {"id": 1}, itself)

        # Indirectly too: outer:2 -> inner:2 -> outer:2.
        def inner_loader() -> int:
            return cache.get_or_load("outer", {"id": 2}, outer_loader)

        def outer_loader() -> int:
            return cache.get_or_load("inner", {"id": 2}, inner_loader)

        with pytest.raises(RecursionError, match=r"outer:2 -> .*inner:2 -> .*outer:2"):
            cache.get_or_load("outer", {"id": 2}, outer_loader)
        assert time.monotonic() - started < 10
        # Nothing was left behind: the keys load normally afterwards.
        assert cache.get_or_load("outer", {"id": 1}, lambda: 7) == 7


async def test_the_sync_api_called_from_a_running_event_loop_raises_naming_the_async_api(
    redis_url: str, prefix: str
) -> None:
    cache = SyncLayeredCache.from_config(make_config(redis_url, prefix))
    cache.start()
    try:
        for call in (
            lambda: cache.get_or_load("book", {"id": 1}, lambda: 1),
            lambda: cache.get("book", {"id": 1}),
            lambda: cache.set("book", {"id": 1}, 1),
            lambda: cache.invalidate("book", {"id": 1}),
        ):
            started = time.monotonic()
            with pytest.raises(RuntimeError, match=r"running event loop.*LayeredCache"):
                call()
            assert time.monotonic() - started < 0.5  # refused, not blocked first
    finally:
        cache.close()


def test_sync_batches_and_tags_work_like_the_async_api(redis_url: str, prefix: str) -> None:
    namespaces = {"book": {"key": "book:{id}"}, "shelf": {"key": "shelf:{id}", "tags": True}}
    config = make_config(redis_url, prefix, namespaces)
    calls: list[list[int]] = []

    def load_many(fields_list: list[Any]) -> list[str]:
        calls.append([int(f["id"]) for f in fields_list])
        return [f"book {f['id']}" for f in fields_list]

    with SyncLayeredCache.from_config(config) as cache:
        cache.set_many("book", [({"id": 1}, "book 1")])
        assert cache.get_or_load_many("book", [{"id": 1}, {"id": 2}], load_many) == [
            "book 1",
            "book 2",
        ]
        assert calls == [[2]]
        assert cache.get_many("book", [{"id": 2}, {"id": 3}]) == ["book 2", None]
        shelf = cache.get_or_load("shelf", {"id": 1}, lambda: [1, 2], tags=["book:1"])
        assert shelf == [1, 2]
        cache.invalidate_tag("book:1")
        assert cache.get("shelf", {"id": 1}) is None


def test_closing_while_a_load_runs_gives_its_lease_back_and_tells_the_caller(
    redis_url: str, prefix: str
) -> None:
    """close() while another thread's loader runs: that load can no longer fill, so its
    lease must go back before Redis is closed, not stay for lease_ttl (every reader of
    the key elsewhere would wait max_wait). The caller gets a clear error. (A timeout of
    1 s: the release is one round trip, maybe on a new connection, while close() runs;
    the suite's 200 ms failed it once on a loaded CI machine.)"""
    namespaces = {"book": {"key": "book:{id}", "stampede": {"lease_ttl": "5s", "max_wait": "3s"}}}
    config = make_config(
        redis_url, prefix, namespaces, redis={"timeout": "1s", "connect_timeout": "1s"}
    )
    cache = SyncLayeredCache.from_config(config, timeout=10)
    cache.start()
    started, outcome = threading.Event(), []

    def slow() -> str:
        started.set()
        time.sleep(1.0)
        return "slow"

    def call() -> None:
        try:
            outcome.append(cache.get_or_load("book", {"id": 1}, slow))
        except Exception as exc:  # the outcome is what is checked
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert started.wait(5)
    cache.close()
    caller.join(10)
    assert isinstance(outcome[0], RuntimeError) and "closed" in str(outcome[0])
    admin = redis.Redis.from_url(redis_url)
    assert list(admin.scan_iter(f"*{prefix}book:1*lease*")) == []
    admin.close()
    with SyncLayeredCache.from_config(config, timeout=10) as other:
        started_at = time.monotonic()
        assert other.get_or_load("book", {"id": 1}, lambda: "fresh") == "fresh"
        assert time.monotonic() - started_at < 1.0


@pytest.mark.parametrize("timeout", [1e10, float(sys.maxsize)])
def test_a_timeout_past_what_a_lock_wait_takes_is_no_bound_not_an_error_at_every_call(
    redis_url: str, prefix: str, timeout: float
) -> None:
    """README: any number > 0 is a valid `timeout`. One past ``threading.TIMEOUT_MAX``
    (~292 years: "practically never") passed construction, then start() and every call
    raised OverflowError from deep in ``concurrent.futures.wait``."""
    cache = SyncLayeredCache(make_config(redis_url, prefix), timeout=timeout)
    try:
        cache.start()
        assert cache.get_or_load("book", {"id": 1}, lambda: "db") == "db"
    finally:
        cache.close()
