"""The Django backend from async code (an async view): the sync methods refused at once,
without touching the loop; the async methods keeping the promises of the sync ones."""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import Iterator

import pytest

from tests import djangoconf

djangoconf.configure()

from layered_cache.django import LayeredCacheBackend, UncacheableValue  # noqa: E402
from tests.test_django_contract import _close_shared, backend  # noqa: E402, F401


@pytest.fixture
def silent_redis() -> Iterator[str]:
    """A Redis that accepts connections and never answers (a hung server)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    server.close()


def test_a_first_sync_call_in_an_async_view_is_refused_without_freezing_the_loop(
    silent_redis: str, prefix: str
) -> None:
    """docs/django.md, the API table: "the sync methods (``cache.get``) refuse to run
    inside a running event loop with a ``RuntimeError``, even for an L1 hit (they would
    block the loop)".

    Scenario: an async view's first use of the backend is the sync ``cache.get``, Redis
    hung; a ticker task on the same loop measures how long the loop froze. It was
    refused only after ~3 s, the loop frozen all along: the backend built and started
    the shared ``SyncLayeredCache`` (connect, backplane positioning) from inside the
    loop before ``SyncLayeredCache.get`` refused. Now ``_django_setup.shared`` refuses
    before it builds anything."""
    config = {"redis": {"timeout": "0.5s", "connect_timeout": "0.5s"}}
    cache = backend(silent_redis, prefix, config=config)

    async def view() -> tuple[float, float, str]:
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        started = time.monotonic()
        try:
            cache.get("answer")
            outcome = "no error"
        except RuntimeError as exc:
            outcome = str(exc)
        took = time.monotonic() - started
        await asyncio.sleep(0.05)
        tick.cancel()
        return took, max(gaps), outcome

    took, longest_freeze, outcome = asyncio.run(view())
    assert outcome.startswith("SyncLayeredCache called from a running event loop")
    assert took < 0.2 and longest_freeze < 0.2, (took, longest_freeze)


def test_aincr_from_concurrent_async_views_in_two_processes_loses_no_increment(
    redis_url: str, prefix: str
) -> None:
    """docs/django.md, the API table: ``incr``/``decr`` "atomic as ``add``: 20 threads
    over two processes, 100 increments, 100 counted"; "``aget``, ``aset``, ... | the
    backend's own sync methods (``sync_to_async``)".

    Scenario: two processes each run 10 concurrent async views doing ``await
    cache.aincr("hits")`` on a counter at 0. Most increments were lost (each read 0 and
    wrote 1): Django's generic ``BaseCache.aincr`` is ``aget`` + ``aset``, not the
    backend's locked ``incr``. Now ``aincr`` is ``incr`` on ``sync_to_async``."""
    a, b = backend(redis_url, prefix), backend(redis_url, prefix, timeout=19.0)
    a.set("hits", 0, timeout=None)

    async def views() -> list[int]:
        calls = [cache.aincr("hits") for _ in range(10) for cache in (a, b)]
        calls += [cache.adecr("hits", -1) for _ in range(5) for cache in (a, b)]
        return list(await asyncio.gather(*calls))

    counts = asyncio.run(views())
    fresh = backend(redis_url, prefix, timeout=18.0)
    assert (sorted(counts), fresh.get("hits")) == (list(range(1, 31)), 30)


def test_aincr_keeps_the_remaining_timeout(redis_url: str, prefix: str) -> None:
    """docs/django.md, Timeouts: "``incr``/``decr`` keep the remaining timeout (Django's
    generic ``incr`` resets it)".

    Scenario: ``set("hits", 1, timeout=1)``, ``await cache.aincr("hits", 5)``, then past
    the second. The counter was still there: Django's generic ``aincr`` re-set it with
    the default TIMEOUT (300 s)."""
    cache = backend(redis_url, prefix)
    cache.set("hits", 1, timeout=1)
    assert asyncio.run(cache.aincr("hits", 5)) == 6
    time.sleep(1.2)
    assert cache.get("hits") is None


def test_aset_many_with_an_uncacheable_value_writes_none(redis_url: str, prefix: str) -> None:
    """docs/django.md, Values: "raises ``UncacheableValue`` ... before anything is
    written: ``set_many`` with one such value writes none".

    Scenario: ``await cache.aset_many({"a": 1, "b": object(), "c": 3})``. "a" was
    written before the error: Django's generic ``aset_many`` is one ``aset`` per key."""
    cache = backend(redis_url, prefix)
    with pytest.raises(UncacheableValue):
        asyncio.run(cache.aset_many({"a": 1, "b": object(), "c": 3}))
    assert cache.get_many(["a", "c"]) == {}


def test_aset_many_returns_the_key_too_large_to_insert(redis_url: str, prefix: str) -> None:
    """docs/django.md, the API table: "``set_many`` returns the keys it could not insert
    (over ``max_value_bytes``: each deleted, as a failed ``set`` is)".

    Scenario: ``await cache.aset_many({"small": "x", "big": "x" * 5000})`` with
    ``max_value_bytes = 2000``. It returned ``[]``: Django's generic ``aset_many``
    returns ``[]`` whatever each ``aset`` did."""
    config = {"namespaces": {"django": {"key": "django:{key}", "max_value_bytes": 2000}}}
    cache = backend(redis_url, prefix, config=config)
    assert asyncio.run(cache.aset_many({"small": "x", "big": "x" * 5000})) == ["big"]
    assert cache.get_many(["small", "big"]) == {"small": "x"}


def test_every_async_method_of_djangos_base_cache_is_the_backends_own_sync_one() -> None:
    """docs/django.md, the API table: each async method is the backend's own sync method
    on ``sync_to_async``: none of Django's compositions of others (``aincr`` = ``aget``
    + ``aset``, ...) is left to bypass it, in this Django or a later one that adds one
    (``aclose``: ``close`` does nothing)."""
    from django.core.cache.backends.base import BaseCache

    generic = {
        name
        for name, member in vars(BaseCache).items()
        if name.startswith("a") and inspect.iscoroutinefunction(member)
    }
    own = {name for name in generic if getattr(LayeredCacheBackend, name) is not vars(BaseCache)[name]}
    assert generic - own == {"aclose"}
