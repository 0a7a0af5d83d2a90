"""A cache that can't keep its L1 coherent refuses calls instead of serving: after
close() (no listener hears invalidations any more, and each call opened a connection
nobody closed), and in a child forked from the process that started it (its sockets are
the parent's: the parent then read the child's reply as its own, another key's value).
A close() that overtakes start() leaves nothing running. Found by an adversarial review
(2026-12-05); each test failed before."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from layered_cache import LayeredCache
from layered_cache._keys import lease_name
from tests.faults.proxy import ToxicProxy
from tests.helpers import eventually, in_l1, make_config, open_cache
from tests.test_purge import Recording

_COHERENT = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}


async def test_a_closed_cache_does_not_serve_from_l1_a_value_another_instance_replaced(
    redis_url: str, prefix: str
) -> None:
    """README, "L1 coherence": every instance drops its L1 copy when another writes;
    ``close()`` stops the backplane listener, but nothing stops the closed cache from
    answering (``_cache.py``: no call checks ``_closed``). A request still running
    when the lifespan closes the cache (uvicorn's graceful-shutdown timeout, a
    background job, a second ``TestClient`` block's helper) is served the old value
    from L1 for its whole TTL, silently. Expected: refused (RuntimeError, as
    ``SyncLayeredCache`` does after close) or the current value."""
    config = make_config(redis_url, prefix, _COHERENT, backplane={"block": "200ms"})
    a = LayeredCache.from_config(config)
    await a.start()

    async def old() -> str:
        return "old"

    assert await a.get_or_load("book", {"id": 1}, old) == "old"  # in a's L1
    await a.close()
    async with LayeredCache.from_config(config) as b:
        await b.set("book", {"id": 1}, "new")
    await asyncio.sleep(0.5)
    try:
        served = await a.get("book", {"id": 1})
    except RuntimeError:
        served = "refused"
    finally:
        await a.close()
    assert served in ("new", "refused"), f"the closed cache served {served!r}"


async def test_calls_after_close_leave_no_connection_open(redis_server: Any, prefix: str) -> None:
    """``close()``: "... then the clients"; ``BackgroundTasks``: "no task outlives the
    cache or its Redis clients". A closed cache reconnects on the next call (redis-py
    opens a fresh connection on a closed client) and keeps what it opened: one call
    per key of a burst holds one connection each, open until the process ends (nobody
    closes the cache twice). 50 late requests: 50 connections left on Redis."""
    config = make_config(redis_server.url, prefix, _COHERENT)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        baseline = len(await admin.client_list())
        cache = LayeredCache.from_config(config)
        await cache.start()
        await cache.close()

        async def load() -> str:
            return "v"

        calls = [cache.get_or_load("book", {"id": i}, load) for i in range(50)]
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            assert isinstance(outcome, RuntimeError) and "closed" in str(outcome)
        await asyncio.sleep(0.2)
        left = len(await admin.client_list()) - baseline
        await cache.close()  # the test's own cleanup
        assert left == 0, f"{left} connections opened after close() and left open"
    finally:
        await admin.aclose()


async def test_a_close_that_overtakes_start_leaves_no_background_task_running(
    redis_url: str, prefix: str
) -> None:
    """``close()``: "Followers first, then background work ... then the clients";
    ``BackgroundTasks``: "no task outlives the cache". A shutdown that arrives while
    ``start()`` is still waiting on Redis (a SIGTERM during a slow start, a supervisor
    that closes what it opened when a sibling fails) returns from ``close()`` before
    ``start()`` resumes; ``start()`` then starts the listener, the fallback subscriber,
    the hot-key reporter and the clock's task on the closed cache (``_cache.py``
    ``_start_steps`` never looks at ``_closed``), reconnecting, never stopped."""
    namespaces = {"book": {"key": "book:{id}", "hot": {"keys": ["book:1"], "threshold": "2/s"}}}
    config = make_config(redis_url, prefix, namespaces, backplane={"block": "200ms"})
    before = asyncio.all_tasks()
    cache = LayeredCache.from_config(config)
    starting = asyncio.ensure_future(cache.start())
    await asyncio.sleep(0)  # start() is on its first round trip
    await cache.close()
    await asyncio.gather(starting, return_exceptions=True)
    await asyncio.sleep(0.5)
    left = sorted(t.get_name() for t in asyncio.all_tasks() - before if not t.done())
    try:
        assert left == [], f"running after close() returned: {left}"
    finally:
        await cache.close()


def _read_in_forked_child(cache: LayeredCache, written: Any, out: Any) -> None:
    async def read() -> Any:
        try:
            return await asyncio.wait_for(cache.get("book", {"id": 1}), 5)
        except RuntimeError as exc:
            return f"refused: {exc}"

    try:
        written.wait(10)
        out.put(asyncio.run(read()))
    except BaseException as exc:
        out.put(f"{type(exc).__name__}: {exc}")
    out.close()
    out.join_thread()
    os._exit(0)


async def test_a_child_forked_from_a_started_cache_does_not_serve_the_parents_l1(
    redis_url: str, prefix: str
) -> None:
    """README (FastAPI): "A cache already *started* in the master holds the master's
    connections: a worker's `start()` refuses it"; ``_startup.forked``: "refused, not
    shared"; README (Fork-safe, the sync API): the child "drops the L1 it was born with
    (it missed every invalidation since the fork)".

    Only ``start()`` checks the pid: a forked child (``multiprocessing`` with fork, a
    ``ProcessPoolExecutor`` job using the module's cache through ``asyncio.run``) that
    calls the cache directly is answered from the L1 copied at the fork, which no
    listener keeps coherent in the child: the parent's ``set("new")``, after the fork,
    is never seen; the child serves "old" for the L1 TTL. Expected: refused with the
    same clear RuntimeError as ``start()``, or "new"."""
    import multiprocessing

    config = make_config(redis_url, prefix, _COHERENT, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, "old")  # in the parent's L1
        ctx = multiprocessing.get_context("fork")
        written, out = ctx.Event(), ctx.Queue()
        child = ctx.Process(target=_read_in_forked_child, args=(cache, written, out))
        child.start()
        try:
            await cache.set("book", {"id": 1}, "new")  # after the fork
            written.set()
            outcome = await asyncio.to_thread(out.get, True, 30)
        finally:
            await asyncio.to_thread(child.join, 10)
            if child.is_alive():
                child.kill()
    assert outcome == "new" or str(outcome).startswith("refused"), outcome


def _read_book_2_in_forked_child(cache: LayeredCache, out: Any) -> None:
    async def read() -> Any:
        try:
            return await asyncio.wait_for(cache.get("book", {"id": 2}), 5)
        except BaseException as exc:
            return f"{type(exc).__name__}: {exc}"[:200]

    try:
        out.put(asyncio.run(read()))
    except BaseException as exc:
        out.put(f"{type(exc).__name__}: {exc}")
    out.close()
    out.join_thread()
    os._exit(0)


async def test_a_forked_child_using_the_cache_does_not_make_the_parent_serve_another_keys_value(
    redis_url: str, prefix: str
) -> None:
    """DESIGN.md 4: "One name per value"; ``_startup.forked``: a started cache's
    "connections are that process's ... refused, not shared"; ``_direct``: "a late
    reply is never read as the next command's".

    A service process with a started cache forks (``multiprocessing``'s default start
    method on Linux, a ``ProcessPoolExecutor`` job that reads the module's cache with
    ``asyncio.run``). Nothing but ``start()`` checks the pid, and redis-py's asyncio
    pools don't either: the child's GET of book 2 is written on the socket the parent
    holds (``DirectClient``'s kept connection), the child fails reading it ("attached
    to a different loop"), and the parent's event loop buffers the stray reply in the
    connection's ``StreamReader``, where ``HeldConnection._connected``'s idle check
    (it polls the socket, not the reader's buffer) does not see it. The parent's next
    read, of book 7, returns book 2's value."""
    import multiprocessing

    namespaces = {"book": {"key": "book:{id}", "l1": False}}
    config = make_config(redis_url, prefix, namespaces, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as writer:
        for book_id in range(10):
            await writer.set("book", {"id": book_id}, f"v{book_id}")
    served: list[Any] = []
    async with LayeredCache.from_config(config) as cache:
        assert await cache.get("book", {"id": 3}) == "v3"  # a kept connection
        ctx = multiprocessing.get_context("fork")
        for _ in range(3):  # a fork now and then, as a pool's jobs come
            out = ctx.Queue()
            child = ctx.Process(target=_read_book_2_in_forked_child, args=(cache, out))
            child.start()
            try:
                await asyncio.to_thread(out.get, True, 30)
            finally:
                await asyncio.to_thread(child.join, 10)
                if child.is_alive():
                    child.kill()
            await asyncio.sleep(0.1)  # the parent's loop goes on serving meanwhile
            served += [await cache.get("book", {"id": book_id}) for book_id in (7, 8, 9)]
    assert served == ["v7", "v8", "v9"] * 3, f"the parent served {served} for books 7, 8, 9"


async def test_a_set_in_flight_when_the_cache_closes_leaves_no_purge_worker_running(
    redis_url: str, prefix: str
) -> None:
    """``close()``: "Calls are refused from here on"; ``BackgroundTasks``: "no task
    outlives the cache"; docs/http.md: purges left "when the cache closes ... are
    dropped" and counted. A set() still running when the lifespan closes the cache
    (uvicorn's graceful-shutdown timeout; the case test_closed_and_forked.py names)
    passed ``check_open`` before close(); its ``finally`` submits its purge to the
    closed ``Purges`` afterwards, and ``PurgeQueue.submit`` starts a new worker
    (``self.start()``: "no start() call needed"): a task nobody closes, on a cache that
    is closed, counted in ``submitted`` and never in ``dropped``."""
    address = urlsplit(redis_url)
    proxy = await ToxicProxy(address.hostname or "127.0.0.1", address.port or 6379).start()
    proxied_url = redis_url.replace(f":{address.port}/", f":{proxy.port}/", 1)
    gateway = Recording(hang=True)  # a gateway that never answers
    config = make_config(
        proxied_url, prefix, {"book": {"key": "book:{id}"}},
        redis={"timeout": "2s"}, purge={"repeat_after": "0s", "retries": 0},
    )  # fmt: skip
    before = asyncio.all_tasks()
    try:
        cache = LayeredCache.from_config(config, purger=gateway)
        await cache.start()
        proxy.hold_at = b"EVALSHA"
        writing = asyncio.ensure_future(cache.set("book", {"id": 1}, "v"))
        await asyncio.wait_for(proxy.holding.wait(), 5)
        closing = asyncio.ensure_future(cache.close())
        await asyncio.sleep(0.3)
        proxy.release.set()
        await asyncio.gather(writing, closing, return_exceptions=True)
        await asyncio.sleep(0.3)
        stats = cache.purge_stats()
        left = sorted(t.get_coro().__qualname__ for t in asyncio.all_tasks() - before if not t.done())
        for task in asyncio.all_tasks() - before:
            task.cancel()
        assert left == [], f"running after close() returned: {left}; purges {stats}"
        assert stats.delivered + stats.failed + stats.dropped == stats.submitted, stats
    finally:
        proxy.release.set()
        await proxy.stop()


class _GatedGateway:
    """A purger whose first purge waits for ``gate``; records every key purged."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.keys: list[str] = []

    async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
        if not self.keys:
            await self.gate.wait()
        self.keys += keys


async def test_a_set_that_lands_during_the_close_grace_still_gets_its_purge_delivered(
    redis_url: str, prefix: str
) -> None:
    """docs/http.md: purges "still queued (or in flight) when the cache closes (close()
    gives them 1 s)" go out within that second. 59cfc9d sets ``PurgeQueue._closed`` at the
    *start* of ``close()``, before the grace: a set() in flight at shutdown (uvicorn's
    graceful timeout) whose write lands while the worker is still delivering the backlog
    now has its purge dropped, where before it was queued behind the backlog and
    delivered in the grace. The gateway keeps the old response for its s-maxage."""
    address = urlsplit(redis_url)
    proxy = await ToxicProxy(address.hostname or "127.0.0.1", address.port or 6379).start()
    proxied_url = redis_url.replace(f":{address.port}/", f":{proxy.port}/", 1)
    gateway = _GatedGateway()
    config = make_config(
        proxied_url, prefix, {"book": {"key": "book:{id}"}},
        redis={"timeout": "2s"}, purge={"repeat_after": "0s", "retries": 0},
    )  # fmt: skip
    try:
        cache = LayeredCache.from_config(config, purger=gateway)
        await cache.start()
        await cache.set("book", {"id": 0}, "v0")  # its purge waits at the gateway
        proxy.hold_at = b"EVALSHA"
        writing = asyncio.ensure_future(cache.set("book", {"id": 1}, "v1"))
        await asyncio.wait_for(proxy.holding.wait(), 5)
        queue = cache._rt.purges._queues[0]
        in_grace, close_queue = asyncio.Event(), queue.close

        async def close_with_grace(grace: float = 1.0) -> None:
            in_grace.set()
            await close_queue(grace)

        queue.close = close_with_grace  # type: ignore[method-assign]
        closing = asyncio.ensure_future(cache.close())
        await asyncio.wait_for(in_grace.wait(), 5)  # close() gives the purges their grace
        proxy.release.set()
        await asyncio.wait_for(writing, 5)  # landed: its purge submitted, worker alive
        gateway.gate.set()  # the backlog goes out, well within the grace
        await asyncio.wait_for(closing, 5)
        stats = cache.purge_stats()
        assert cache.key("book", {"id": 1}) in gateway.keys, (
            f"purged {gateway.keys}; the write that landed in the grace was dropped: {stats}"
        )
    finally:
        proxy.release.set()
        await proxy.stop()


async def test_two_overlapping_starts_leave_a_started_cache_and_blame_no_close(
    redis_url: str, prefix: str
) -> None:
    """A second ``start()`` of a started cache does nothing. Two that overlap (two
    lifespans sharing the module's cache, a lazy "start on first request" hit by two
    requests at once), with no ``close()`` at all: the second counted as a close for
    the first, which raised "close() ran while start() was starting" and closed the
    cache; the second then raised the same. Now the second waits for the first."""
    config = make_config(redis_url, prefix, _COHERENT, backplane={"block": "200ms"})
    cache = LayeredCache.from_config(config)
    outcomes = await asyncio.gather(cache.start(), cache.start(), return_exceptions=True)

    async def load() -> str:
        return "v"

    try:
        assert outcomes == [None, None]
        assert await cache.get_or_load("book", {"id": 1}, load) == "v"
    finally:
        await cache.close()


async def test_a_start_overtaken_by_close_raises_and_the_next_start_serves(
    redis_url: str, prefix: str
) -> None:
    """README: "A `close()` that overtakes a `start()` still waiting on Redis leaves
    nothing running: that `start()` raises"; a start() that came after that close()
    starts the cache (it waited for the overtaken one to end)."""
    config = make_config(redis_url, prefix, _COHERENT, backplane={"block": "200ms"})
    cache = LayeredCache.from_config(config)
    first = asyncio.ensure_future(cache.start())
    await asyncio.sleep(0)  # start() is on its first round trip
    await cache.close()
    second = asyncio.ensure_future(cache.start())
    outcomes = await asyncio.gather(first, second, return_exceptions=True)

    async def load() -> str:
        return "v"

    try:
        assert isinstance(outcomes[0], RuntimeError) and "close() ran" in str(outcomes[0])
        assert outcomes[1] is None
        assert await cache.get_or_load("book", {"id": 1}, load) == "v"
    finally:
        await cache.close()


async def test_a_load_that_ends_after_close_returns_its_value_and_writes_nothing(
    redis_server: Any, prefix: str
) -> None:
    """A load running when close() is called used to fill L2 after close() returned,
    on a connection redis-py opened anew on the closed client, open for the life of the
    process. Its caller now gets the value; nothing reaches Redis."""
    config = make_config(redis_server.url, prefix, _COHERENT, backplane={"block": "200ms"})
    admin = aioredis.Redis.from_url(redis_server.url)
    cache = LayeredCache.from_config(config)
    gate, loading = asyncio.Event(), asyncio.Event()

    async def load() -> str:
        loading.set()
        await gate.wait()
        return "v"

    try:
        baseline = len(await admin.client_list())
        await cache.start()
        call = asyncio.ensure_future(cache.get_or_load("book", {"id": 1}, load))
        await asyncio.wait_for(loading.wait(), 5)
        await cache.close()
        gate.set()
        served = await call
        await asyncio.sleep(0.3)
        opened = len(await admin.client_list()) - baseline
        written = await admin.get(cache.key("book", {"id": 1}))
        assert (served, written, opened) == ("v", None, 0)
    finally:
        gate.set()
        await cache.close()
        await admin.aclose()


async def test_a_read_waiting_on_a_lease_when_its_cache_closes_raises_the_closed_error(
    redis_url: str, prefix: str
) -> None:
    """README: "A closed cache refuses calls". A read waiting on another instance's
    lease when its cache closed was not stopped: it went on re-reading L2 (reconnecting
    the closed client) until ``max_wait``, then called its own loader, seconds after
    close() returned. Now close() ends the wait: the read raises the closed error at
    once, its loader never called."""
    namespaces = {"book": {"key": "book:{id}", "stampede": {"max_wait": "1500ms"}}}
    config = make_config(redis_url, prefix, namespaces, backplane={"block": "200ms"})
    a, b = LayeredCache.from_config(config), LayeredCache.from_config(config)
    await a.start()
    await b.start()
    gate, loading = asyncio.Event(), asyncio.Event()
    called: list[str] = []

    async def slow() -> str:  # b's load holds the lease
        loading.set()
        await gate.wait()
        return "b"

    async def mine() -> str:
        called.append("a's loader")
        return "a"

    try:
        held = asyncio.ensure_future(b.get_or_load("book", {"id": 1}, slow))
        await asyncio.wait_for(loading.wait(), 5)
        waiting = asyncio.ensure_future(a.get_or_load("book", {"id": 1}, mine))
        await asyncio.sleep(0.3)  # a lost the lease and waits for b's fill
        await a.close()
        done, _ = await asyncio.wait({waiting}, timeout=0.5)
        assert done, "the read still waits after close() returned"
        with pytest.raises(RuntimeError, match="this LayeredCache is closed"):
            waiting.result()
        assert called == []
        gate.set()
        assert await held == "b"
    finally:
        gate.set()
        await a.close()
        await b.close()


_TAKEN_OVER_NAMESPACES = {
    "book": {
        "key": "book:{id}",
        "stampede": {"lease_ttl": "20s", "max_wait": "5s", "reread_pause": ["20ms", "30ms"]},
    }
}


async def test_a_lease_taken_over_while_close_runs_is_given_back(
    redis_url: str, prefix: str
) -> None:
    """A read waiting on another instance's lease takes it over (the holder gone) with
    a SET NX whose reply is on its way when close() runs: the wait hands the token back,
    the read raises the closed error, and the lease stayed for ``lease_ttl`` (every
    instance's miss of the key waited ``max_wait``). It goes back now."""
    config = make_config(redis_url, prefix, _TAKEN_OVER_NAMESPACES)
    admin = aioredis.Redis.from_url(redis_url)
    cache = LayeredCache.from_config(config)
    await cache.start()
    key = cache.key("book", {"id": 1})
    lease = lease_name(key)
    await admin.set(lease, "another-instance", px=20_000)  # another instance is loading
    leases = cache._rt.leases
    real_acquire = leases.try_acquire
    calls, reached, gate = 0, asyncio.Event(), asyncio.Event()

    async def acquire(name: str, ttl: float, token: str | None = None) -> str | None:
        nonlocal calls
        calls += 1
        if calls == 1:
            return await real_acquire(name, ttl, token)  # lost: the reader waits
        await admin.delete(name)  # the other instance's load died, its lease gone
        won = await real_acquire(name, ttl, token)  # our SET NX lands...
        reached.set()
        await gate.wait()  # ...its reply is on the way when close() runs
        return won

    leases.try_acquire = acquire  # type: ignore[method-assign]

    async def loader() -> str:
        return "v"

    try:
        read = asyncio.ensure_future(cache.get_or_load("book", {"id": 1}, loader))
        await asyncio.wait_for(reached.wait(), 5)
        closing = asyncio.ensure_future(cache.close())
        await asyncio.sleep(0)  # close() has begun (end_waits)
        gate.set()
        await asyncio.wait_for(closing, 10)
        outcome = (await asyncio.gather(read, return_exceptions=True))[0]
        await asyncio.sleep(0.3)
        held = await admin.get(lease)
        ttl = await admin.pttl(lease)
        assert held is None, (
            f"the read ended with {outcome!r} and left the lease {held!r} held for {ttl} ms"
        )
    finally:
        gate.set()
        await cache.close()
        await admin.delete(lease)
        await admin.aclose()


async def _assert_caches(cache: LayeredCache, admin: aioredis.Redis) -> None:
    """The cache takes calls and stores what it loads: the second read is a hit, and L2
    holds the value."""
    loads: list[str] = []

    async def loader() -> str:
        loads.append("v")
        return "v"

    assert await cache.get_or_load("book", {"id": 1}, loader) == "v"  # not refused
    assert await cache.get_or_load("book", {"id": 1}, loader) == "v"
    stored = await admin.get(cache.key("book", {"id": 1}))
    assert (len(loads), stored is not None) == (1, True), (loads, stored, cache._rt.ended)


def _pause_first_close(cache: LayeredCache) -> tuple[asyncio.Event, asyncio.Event]:
    """The first close() of ``cache`` pauses at its purge-queue step: ``reached`` is set
    there, and it goes on once ``gate`` is set; later closes don't pause."""
    reached, gate = asyncio.Event(), asyncio.Event()
    real_close = cache._rt.purges.close

    async def held_purges_close() -> None:
        if not reached.is_set():
            reached.set()
            await gate.wait()
        await real_close()

    cache._rt.purges.close = held_purges_close  # type: ignore[method-assign]
    return reached, gate


async def test_a_start_made_while_a_close_is_still_running_leaves_a_cache_that_caches(
    redis_url: str, prefix: str
) -> None:
    """Two lifespans sharing a module's cache: one shuts down (its close() paused at an
    await) while the next starts. The start returned at once, then the close's end undid
    it: its followers cancelled and every later load stored nowhere, in L1 or L2, for as
    long as the cache ran. A start() now waits for a close() in progress."""
    config = make_config(redis_url, prefix, _COHERENT)
    admin = aioredis.Redis.from_url(redis_url)
    cache = LayeredCache.from_config(config)
    await cache.start()
    reached, gate = _pause_first_close(cache)
    try:
        closing = asyncio.ensure_future(cache.close())  # app A's shutdown
        await asyncio.wait_for(reached.wait(), 5)
        starting = asyncio.ensure_future(cache.start())  # app B's startup
        await asyncio.sleep(0.2)
        gate.set()
        await asyncio.wait_for(closing, 10)
        await asyncio.wait_for(starting, 10)
        await _assert_caches(cache, admin)
    finally:
        gate.set()
        await cache.close()
        await admin.aclose()


async def test_a_start_waits_for_every_close_still_running_also_one_that_failed_a_start(
    redis_url: str, prefix: str
) -> None:
    """A close() overtakes a start(), which then fails and closes too: two close() calls
    at once. The failed start's close ending first cleared the one mark of a close in
    progress, and a start() made then returned before the first close's end undid it."""
    config = make_config(redis_url, prefix, _COHERENT)
    admin = aioredis.Redis.from_url(redis_url)
    cache = LayeredCache.from_config(config)
    real_steps = cache._start_steps
    a_held, a_gate = asyncio.Event(), asyncio.Event()

    async def held_steps(start: int) -> None:  # start A waits on Redis
        a_held.set()
        await a_gate.wait()
        await real_steps(start)

    cache._start_steps = held_steps  # type: ignore[method-assign]
    c_reached, c_gate = _pause_first_close(cache)
    try:
        starting_a = asyncio.ensure_future(cache.start())
        await asyncio.wait_for(a_held.wait(), 5)
        closing = asyncio.ensure_future(cache.close())  # overtakes start A
        await asyncio.wait_for(c_reached.wait(), 5)
        cache._start_steps = real_steps  # type: ignore[method-assign]
        a_gate.set()
        with pytest.raises(RuntimeError, match="close"):
            await asyncio.wait_for(starting_a, 10)  # it failed, and closed once more
        starting_b = asyncio.ensure_future(cache.start())
        await asyncio.sleep(0.2)
        c_gate.set()
        await asyncio.wait_for(closing, 10)
        await asyncio.wait_for(starting_b, 10)
        await _assert_caches(cache, admin)
    finally:
        a_gate.set()
        c_gate.set()
        await cache.close()
        await admin.aclose()


async def test_a_batch_load_that_ends_after_close_returns_its_values_and_writes_nothing(
    redis_server: Any, prefix: str
) -> None:
    """As for a single read: a ``get_or_load_many`` whose ``load_many`` ran when close()
    was called filled L2 after close() returned, on a connection redis-py opened anew on
    the closed client. Its caller now gets the values; nothing reaches Redis."""
    config = make_config(redis_server.url, prefix, _COHERENT, backplane={"block": "200ms"})
    admin = aioredis.Redis.from_url(redis_server.url)
    cache = LayeredCache.from_config(config)
    gate, loading = asyncio.Event(), asyncio.Event()

    async def load_many(missing: Sequence[Any]) -> list[str]:
        loading.set()
        await gate.wait()
        return [f"v{fields['id']}" for fields in missing]

    try:
        baseline = len(await admin.client_list())
        await cache.start()
        call = asyncio.ensure_future(
            cache.get_or_load_many("book", [{"id": 1}, {"id": 2}], load_many)
        )
        await asyncio.wait_for(loading.wait(), 5)
        await cache.close()
        gate.set()
        served = await call
        await asyncio.sleep(0.3)
        opened = len(await admin.client_list()) - baseline
        written = await admin.get(cache.key("book", {"id": 1}))
        assert (served, written, opened) == (["v1", "v2"], None, 0)
    finally:
        gate.set()
        await cache.close()
        await admin.aclose()


class HangingPurger:
    """A gateway that never answers (until released)."""

    def __init__(self) -> None:
        self.called = asyncio.Event()
        self.release = asyncio.Event()

    async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
        self.called.set()
        await self.release.wait()


def _loader_of(value: str) -> Any:
    async def load() -> str:
        return value

    return load


async def test_an_instance_closing_serves_no_l1_copy_another_instance_replaced(
    redis_url: str, prefix: str
) -> None:
    """Found by a review (2026-12-06). ``close()``: "Calls are refused from here on, L1
    dropped". Scenario: A holds book:1 in L1; a purge to a gateway that hangs keeps A's
    close() in its grace (1 s) after its listener stopped; meanwhile B set()s book:1.
    Happened: A's get() served the replaced value from L1 (dropped only at close()'s
    end; an L1 hit takes no check). Now L1 is dropped as close() begins."""
    config = make_config(
        redis_url, prefix, {"book": {"key": "book:{id}", "l1": {"ttl": "60s", "jitter": 0}}}
    )
    purger = HangingPurger()
    a = open_cache(config, purger=purger)
    b = open_cache(config)
    await a.start()
    await b.start()
    try:
        assert await a.get_or_load("book", {"id": 1}, _loader_of("v1")) == "v1"
        await a.invalidate("book", {"id": 2})  # queues a purge the gateway never answers
        await asyncio.wait_for(purger.called.wait(), 5)

        closing = asyncio.create_task(a.close())
        listener = a._backplane
        assert listener is not None
        # close() has stopped the listener and now waits for the purge queue (1 s grace).
        assert await eventually(lambda: listener._task is None or listener._task.done(), 2)
        assert not closing.done()

        await b.set("book", {"id": 1}, "v2")  # returned: every instance was told
        try:
            seen = await a.get("book", {"id": 1})
        except RuntimeError:
            seen = "refused"
        closed_before = closing.done()
        purger.release.set()
        await closing
        assert closed_before is False, "the window closed before the read: test inconclusive"
        assert seen != "v1", (
            "a get() on the closing instance, after another instance's set() returned, "
            "served the replaced value from L1"
        )
    finally:
        purger.release.set()
        await a.close()
        await b.close()


async def test_a_load_that_ends_during_the_close_grace_fills_l2_for_the_others_not_l1(
    redis_server: Any, prefix: str
) -> None:
    """README (Lifecycle), found by a review of this session's fix (2026-12-06): close()
    drops L1 as it begins; a get_or_load whose load ends during close()'s grace (a slow
    gateway's purges), while the client is still open, fills L2 under its lease for the
    other instances (its waiters would else wait max_wait), never the dropped L1."""
    config = make_config(
        redis_server.url, prefix, _COHERENT, backplane={"block": "200ms"},
        purge={"repeat_after": "0s", "retries": 0},
    )  # fmt: skip
    admin = aioredis.Redis.from_url(redis_server.url)
    gateway = _GatedGateway()
    cache = LayeredCache.from_config(config, purger=gateway)
    gate, loading = asyncio.Event(), asyncio.Event()

    async def load() -> str:
        loading.set()
        await gate.wait()
        return "v"

    try:
        await cache.start()
        await cache.set("book", {"id": 0}, "v0")  # its purge waits at the gateway
        call = asyncio.ensure_future(cache.get_or_load("book", {"id": 1}, load))
        await asyncio.wait_for(loading.wait(), 5)
        closing = asyncio.ensure_future(cache.close())
        await asyncio.sleep(0.4)  # close() began (L1 dropped) and is in its purge grace
        assert not closing.done()
        gate.set()
        served = await asyncio.wait_for(call, 5)
        await asyncio.wait_for(closing, 5)
        written = await admin.get(cache.key("book", {"id": 1}))
        assert served == "v" and written is not None  # L2: filled under its lease
        assert not in_l1(cache, 1)
    finally:
        gate.set()
        gateway.gate.set()
        await cache.close()
        await admin.aclose()
