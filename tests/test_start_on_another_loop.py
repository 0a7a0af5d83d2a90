"""A cache started on another event loop than the one its connections were made on: a
warm-up at import under asyncio.run, then the server's lifespan (also under a real
gunicorn --preload with uvicorn workers), or a loop that ended without close(). start()
closes what those loops left and starts anew; the first requests used to fail with
"Event loop is closed". Found by an adversarial review (2026-12-05); each failed before."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import textwrap
import time
from pathlib import Path

from layered_cache import LayeredCache
from tests.helpers import eventually, in_l1, make_config
from tests.servers import free_port
from tests.test_purge import Recording
from tests.test_sync_fork import ROOT, _get, _serving

_COHERENT = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}


async def test_a_cache_used_at_import_serves_every_request_once_started_on_the_servers_loop(
    redis_url: str, prefix: str
) -> None:
    """README, FastAPI: "A service module creates the cache at import ... the lifespan
    starts and closes it on the server's event loop"; the cache works before
    ``start()`` (README: "at import: the cache need not be started yet"), so a module
    may warm it at import with ``asyncio.run(...)``. The connections that warm-up left
    in the pools (``DirectClient``'s kept connections, redis-py's pool) are bound to
    that loop, now closed; ``start()`` on the server's loop rebuilds only for a forked
    or closed cache (``_cache.py`` ``start``: ``if forked or self._closed``), so the
    first requests, one per kept connection, fail with ``RuntimeError: Event loop is
    closed`` instead of being served. Under ``gunicorn --preload`` with uvicorn
    workers every worker inherits them."""
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    cache = LayeredCache.from_config(config)

    async def load() -> str:
        return "v"

    async def warm_up() -> None:  # at import, on a loop of its own
        await asyncio.gather(*(cache.get_or_load("book", {"id": i}, load) for i in range(8)))

    await asyncio.to_thread(asyncio.run, warm_up())
    await cache.start()  # the lifespan, on the server's loop
    try:
        calls = [cache.get_or_load("book", {"id": i}, load) for i in range(20)]
        results = await asyncio.gather(*calls, return_exceptions=True)
    finally:
        await cache.close()
    failed = [repr(r) for r in results if isinstance(r, BaseException)]
    assert failed == [], f"{len(failed)} of 20 requests failed: {failed[:2]}"


async def test_a_cache_whose_loop_ended_without_close_starts_on_a_new_loop(
    redis_url: str, prefix: str
) -> None:
    """README: "A closed cache starts again: a second lifespan of the module's cache
    ... builds anew what was bound to the old loop". A lifespan that never reached its
    ``close()`` (the app crashed, a test's loop torn down, ``asyncio.run(cache.start())``
    as an import-time check) leaves a cache that ``start()`` on the next loop does not
    rebuild (``_cache.py``: only ``if forked or self._closed``): its first command (the
    clock's TIME) runs on a connection bound to the dead loop and ``start()`` fails with
    a bare ``RuntimeError: Event loop is closed`` naming neither the cache nor the fix
    (and past that, the dead listener task is still recorded, ``BackplaneListener.start``
    would be a no-op). Expected: it starts (and follows the backplane), or refuses
    saying it was started on another loop and not closed."""
    config = make_config(redis_url, prefix, _COHERENT, backplane={"block": "200ms"})
    cache = LayeredCache.from_config(config)
    await asyncio.to_thread(asyncio.run, cache.start())  # loop 1 ends, close() never ran
    try:
        await cache.start()
    except RuntimeError as exc:
        assert "loop" in str(exc) and "cache" in str(exc).lower(), f"unclear: {exc!r}"
        return
    try:
        async def old() -> str:
            return "old"

        assert await cache.get_or_load("book", {"id": 1}, old) == "old"
        async with LayeredCache.from_config(config) as other:
            await other.set("book", {"id": 1}, "new")
        await asyncio.sleep(1.0)
        assert await cache.get("book", {"id": 1}) == "new"
    finally:
        await cache.close()


_PRELOADED_ASGI_APP = '''
"""README's FastAPI pattern, warmed at import: gunicorn --preload's master runs this."""
import asyncio, os
from contextlib import asynccontextmanager
from fastapi import FastAPI
from layered_cache import LayeredCache, parse_config

config = parse_config(
    {"redis": {"url": os.environ["LC_REDIS_URL"], "prefix": os.environ["LC_PREFIX"]},
     "namespaces": {"book": {"key": "book:{id}", "l1": False}}},
    source="<preloaded_asgi>", env={},
)
cache = LayeredCache.from_config(config)

@cache.cached("book")                # "at import: the cache need not be started yet"
async def book_detail(id: int) -> str:
    return f"title {id}"

async def _warm() -> None:           # a warm-up at import, on a loop of its own
    await asyncio.gather(*(book_detail(i) for i in range(8)))

asyncio.run(_warm())

@asynccontextmanager
async def lifespan(app):
    await cache.start()
    yield
    await cache.close()

app = FastAPI(lifespan=lifespan)

@app.get("/book/{id}")
async def get_book(id: int) -> dict:
    try:
        return {"pid": os.getpid(), "title": await book_detail(id)}
    except Exception as exc:
        return {"pid": os.getpid(), "error": repr(exc)}

@app.get("/loads")
async def loads() -> dict:
    return {"pid": os.getpid()}
'''


def test_gunicorn_preload_uvicorn_worker_serves_the_first_requests_of_a_cache_warmed_at_import(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """The same as ``test_a_cache_used_at_import_serves_every_request_once_started_on_
    the_servers_loop``, under a real ``gunicorn --preload -k uvicorn.workers.UvicornWorker``:
    the worker's lifespan ``start()`` (README: it "takes an instance id of its own ...
    and drops the L1 it was born with") keeps the pool connections the master's warm-up
    left, bound to the master's finished loop; the worker's first requests fail with
    ``RuntimeError('Event loop is closed')``."""
    (tmp_path / "preloaded_asgi.py").write_text(textwrap.dedent(_PRELOADED_ASGI_APP))
    port = free_port()
    env = {**os.environ, "LC_REDIS_URL": redis_url, "LC_PREFIX": prefix,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}  # fmt: skip
    command = [sys.executable, "-m", "gunicorn", "--preload", "-w", "1", "--timeout", "30",
               "-k", "uvicorn.workers.UvicornWorker",
               "-b", f"127.0.0.1:{port}", "preloaded_asgi:app"]  # fmt: skip
    with _serving(command, port, env, tmp_path / "gunicorn.log") as base:
        answers = [_get(f"{base}/book/{book_id}") for book_id in range(20)]
    errors = [a["error"] for a in answers if "error" in a]
    assert errors == [], f"{len(errors)} of 20 requests failed: {errors[:2]}"


async def test_a_purge_queued_before_start_is_closed_and_counted_with_the_cache(
    redis_url: str, prefix: str
) -> None:
    """README: the cache works before ``start()`` ("at import: the cache need not be
    started yet"); docs/http.md: "Purges still queued (or in flight ...) when the cache
    closes (close() gives them 1 s) are dropped. Each case is logged and counted";
    docs/metrics.md: "delivered + failed + dropped add up to submitted". Since e0965f8
    the *first* ``start()`` runs ``startup.reopened`` too (``_rebind``: ``cache._loop``
    is None), which replaces ``runtime.purges`` without closing the old ``Purges``: a
    purge a set() queued before start() (a warm-up, a fixture's seed) is never closed,
    never counted, and its worker task outlives ``close()`` (an owned VarnishPurger's
    httpx client is never closed either)."""
    config = make_config(
        redis_url, prefix, {"book": {"key": "book:{id}"}},
        purge={"repeat_after": "0s", "retries": 0},
    )  # fmt: skip
    before = asyncio.all_tasks()
    gateway = Recording(hang=True)  # a gateway that never answers
    cache = LayeredCache.from_config(config, purger=gateway)
    await cache.set("book", {"id": 1}, "v")  # before start(): allowed
    await eventually(lambda: len(gateway.calls) == 1, timeout=3)
    await cache.start()
    await cache.close()
    await asyncio.sleep(0.1)
    stats = cache.purge_stats()
    left = sorted(t.get_coro().__qualname__ for t in asyncio.all_tasks() - before if not t.done())
    for task in asyncio.all_tasks() - before:  # the test's own cleanup
        task.cancel()
    assert stats.delivered + stats.failed + stats.dropped == stats.submitted, (
        f"purge queued before start() never counted after close(): {stats}"
    )
    assert left == [], f"running after close() returned: {left}"


async def test_a_cache_whose_loop_ended_without_close_keeps_its_clock_synced_on_the_new_loop(
    redis_url: str, prefix: str
) -> None:
    """e0965f8 claims start() "closes what those loops left and starts anew" for "a loop
    that ended without close()". The Redis clock's sampling task is not among it:
    ``asyncio.run`` cancelled it with loop 1, ``RedisClock.start`` only makes a task
    ``if self._task is None``, and ``_rebind`` never resets it. On the new loop the
    clock never samples again (``_redisclock``: "keep sampling in the background"),
    so a host clock stepped by NTP (the case ``RedisClock.sample`` handles) is never
    corrected: an hour's step and every value is judged an hour off (all L2 hits
    expired, or values served an hour past their TTL)."""
    skew = [0.0]
    config = make_config(redis_url, prefix, _COHERENT, backplane={"block": "200ms"})
    cache = LayeredCache.from_config(config, clock=lambda: time.time() + skew[0])
    cache._clock._refresh = 0.1  # 30 s in production: the test does not wait that long
    await asyncio.to_thread(asyncio.run, cache.start())  # loop 1 ends, close() never ran
    await cache.start()
    try:
        skew[0] = 3600.0  # NTP steps the host clock an hour ahead
        await asyncio.sleep(1.0)  # ten refresh periods
        off = cache._rt.clock() - time.time()  # Redis runs on this host: its TIME is ours
    finally:
        await cache.close()
    assert abs(off) < 5, f"the cache's Redis clock is {off:.0f} s off after the step"


async def test_a_call_on_the_new_loop_before_start_makes_start_keep_what_the_dead_loop_left(
    redis_url: str, prefix: str
) -> None:
    """b5542c6: ``check_open`` records the loop of every call (``Runtime.loop``) and
    ``_rebind`` rebuilds only if that loop is not start()'s. A cache started on loop 1
    that ended without close() (``asyncio.run(cache.start())``, the case
    test_start_on_another_loop.py accepts), then one call on the server's loop before
    its lifespan's start() (a warm-up; the docstring: "Calls before a start on their
    own loop (a lifespan's) keep what they made"): the call overwrote ``Runtime.loop``
    with the new loop, so start() rebuilds nothing. The listener task recorded is loop
    1's: start() fails with a bare ``RuntimeError: Event loop is closed`` (the fallback's
    Event, the listener task, pooled connections of loop 1). Before b5542c6 ``_loop``
    was set only by start() and this start rebuilt."""
    config = make_config(redis_url, prefix, _COHERENT, backplane={"block": "200ms"})
    cache = LayeredCache.from_config(config)
    await asyncio.to_thread(asyncio.run, cache.start())  # loop 1 ends, close() never ran

    async def old() -> str:
        return "old"

    with contextlib.suppress(Exception):  # the lifespan's warm-up, before its start()
        await cache.get_or_load("book", {"id": 2}, old)
    await cache.start()
    try:
        assert await cache.get_or_load("book", {"id": 1}, old) == "old"
        async with LayeredCache.from_config(config) as other:
            await other.set("book", {"id": 1}, "new")
        await eventually(lambda: not in_l1(cache, 1), timeout=3)
        assert await cache.get("book", {"id": 1}) == "new", "L1 never heard the set()"
    finally:
        await cache.close()


async def test_a_purge_queued_by_a_warm_up_on_another_loop_is_counted_when_start_rebuilds(
    redis_url: str, prefix: str
) -> None:
    """README's pattern: a warm-up at import under ``asyncio.run``, then the lifespan's
    start() on the server's loop. b5542c6 fixed the count for a warm-up on the *same*
    loop only: on another loop ``_rebind`` still replaces ``runtime.purges``
    (``startup.reopened``) without counting what the old queues held (the purge in
    flight when loop 1 ended). docs/http.md / Purges: "delivered + failed + dropped adds
    up to submitted"."""
    config = make_config(
        redis_url, prefix, {"book": {"key": "book:{id}"}},
        purge={"repeat_after": "0s", "retries": 0},
    )  # fmt: skip
    gateway = Recording(hang=True)  # a gateway that never answers
    cache = LayeredCache.from_config(config, purger=gateway)

    async def warm_up() -> None:  # at import, on a loop of its own
        await cache.set("book", {"id": 1}, "v")
        await eventually(lambda: len(gateway.calls) == 1, timeout=3)

    await asyncio.to_thread(asyncio.run, warm_up())
    await cache.start()  # the lifespan, on the server's loop
    await cache.close()
    stats = cache.purge_stats()
    assert stats.delivered + stats.failed + stats.dropped == stats.submitted, (
        f"the warm-up's purge vanished uncounted: {stats}"
    )
