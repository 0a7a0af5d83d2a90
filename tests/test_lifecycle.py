"""A cache's life: started again after close() (a second lifespan of a module-level cache,
a new event loop), a start() its caller gave up on, a close() cut short, a fork after
close(), and what a cancelled write leaves for close() to wait for. Found by a review;
each failed before its fix."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as redis
from fastapi.testclient import TestClient

from layered_cache import LayeredCache
from layered_cache._runtime import BackgroundTasks
from tests.faults.proxy import ToxicProxy
from tests.helpers import eventually, in_l1, make_config
from tests.servers import RedisServer
from tests.test_fastapi import build_app


def test_a_module_level_cache_serves_a_second_lifespan_on_a_new_event_loop(
    redis_url: str, prefix: str
) -> None:
    """README, FastAPI / Starlette: "A service module creates the cache at import and
    decorates its functions there; the lifespan starts and closes it on the server's
    event loop" ("Tested as written: tests/test_fastapi.py").

    Every ``with TestClient(app)`` (and every ``asyncio.run``, every pytest-asyncio
    function loop) runs the lifespan on an event loop of its own. The first lifespan
    starts and closes the module's cache; the second one's ``start()`` raises
    ``RuntimeError: <asyncio.locks.Event ...> is bound to a different event loop``:
    ``FallbackSubscriber.subscribed`` (an ``asyncio.Event`` created once, in
    ``__init__``) was bound to the first loop by ``startup.listening``'s wait, and
    ``close()`` neither forgets it nor rebuilds the followers. (A service's test suite
    with two tests using ``TestClient(app)`` fails its second test at startup.)"""
    database = {1: "Emma"}
    queries: list[int] = []
    app = build_app(make_config(redis_url, prefix), database, queries)
    with TestClient(app) as client:  # loop 1: start() ... close()
        assert client.get("/books/1").json() == {"id": 1, "title": "Emma"}
    with TestClient(app) as client:  # loop 2: the same module-level cache
        assert client.get("/books/1").json() == {"id": 1, "title": "Emma"}


async def test_a_start_cancelled_by_its_caller_leaves_no_background_task_running(
    prefix: str,
) -> None:
    """README, "Cancellation takes effect": "A cancelled task stops at the library's
    next await"; ``BackgroundTasks``: "so no task outlives the cache or its Redis
    clients"; and ``start()`` itself closes what it started when it fails
    (``_cache.py``: ``except ReplicaCountMismatch: await self.close(); raise``).

    ``start()`` with Redis unreachable waits (bounded) for the backplane position; a
    caller that gives up first (a lifespan or readiness timeout:
    ``asyncio.wait_for(cache.start(), ...)``, or ``async with`` whose ``__aenter__`` is
    cancelled, after which ``__aexit__`` never runs) gets its CancelledError/TimeoutError,
    but the Redis clock's task, the backplane listener and the fallback subscriber it
    had already started run on, reconnecting for ever, with nobody left to close them."""
    config = make_config("redis://127.0.0.1:1/0", prefix)  # nothing listens on port 1
    cache = LayeredCache.from_config(config)
    before = asyncio.all_tasks()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(cache.start(), 0.3)
    await asyncio.sleep(0.3)
    left = [t for t in asyncio.all_tasks() - before if not t.done()]
    try:
        assert left == [], f"tasks a failed start() left running: {[t.get_name() for t in left]}"
    finally:
        await cache.close()


async def test_lease_waiters_of_a_restarted_cache_are_still_woken_when_the_fill_lands(
    redis_url: str, prefix: str
) -> None:
    """DESIGN.md, section 6: "Lease: ... the others wait for the fill (woken when it
    lands, with jittered re-reads as the fallback, never a fixed sleep)".

    ``FillNotifier.close()`` sets ``_closed = True`` for good ("no connection is opened
    again once closing began") and ``start()`` never undoes it, so after
    ``close()`` + ``start()`` (same loop) every lease waiter's SUBSCRIBE is skipped:
    the waiter first waits out the whole subscription bound (``reread_pause[1]``) for a
    confirmation that never comes, then sees the fill only at its next re-read. Here
    the fill lands ~0.2 s into the wait; a woken waiter returns at once, a restarted
    cache's waiter only after ~2 s (the pause range is made long to tell them apart)."""
    namespaces = {
        "book": {
            "key": "book:{id}",
            "stampede": {"lease_ttl": "10s", "reread_pause": ["2s", "2s"], "max_wait": "8s"},
        }
    }
    config = make_config(redis_url, prefix, namespaces)
    waiter = LayeredCache.from_config(config)
    await waiter.start()
    await waiter.close()
    await waiter.start()  # the same cache, started again on the same loop
    holder = LayeredCache.from_config(config)
    await holder.start()
    try:
        loading = asyncio.Event()

        async def slow_load() -> str:
            loading.set()
            await asyncio.sleep(0.2)
            return "db"

        async def never() -> str:
            raise AssertionError("the waiter loaded: it should have waited for the fill")

        filling = asyncio.create_task(holder.get_or_load("book", {"id": 1}, slow_load))
        await loading.wait()  # the holder has the lease
        started = asyncio.get_running_loop().time()
        assert await waiter.get_or_load("book", {"id": 1}, never) == "db"
        waited = asyncio.get_running_loop().time() - started
        await filling
        assert waited < 1.0, f"the lease waiter saw the fill only after {waited:.2f} s"
    finally:
        await holder.close()
        await waiter.close()


def _start_in_forked_child(cache: LayeredCache, out: Any) -> None:
    async def run() -> str:
        async with cache:
            await cache.set("book", {"id": 1}, "child")
            return "started"

    try:
        out.put(asyncio.run(run()))
    except BaseException as exc:
        out.put(f"{type(exc).__name__}: {exc}")
    out.close()
    out.join_thread()
    os._exit(0)


async def test_a_cache_started_and_closed_before_the_fork_starts_in_the_child(
    redis_url: str, prefix: str
) -> None:
    """README, FastAPI / Starlette: "`start()` in a process forked after construction
    takes an instance id of its own ... A cache already *started* in the master holds
    the master's connections: a worker's `start()` refuses it"; ``_startup.forked``:
    "A cache the parent had *started* holds the parent's connections and tasks:
    refused, not shared".

    A cache the master started and then *closed* (a warm-up or a check at import under
    ``gunicorn --preload``: ``asyncio.run(...)`` with ``async with cache``) holds no
    connection and no task any more, yet every worker's ``start()`` is refused with
    "its connections are that process's": ``close()`` never resets ``_started_in``
    (``_cache.py``), which ``start()`` set before doing anything."""
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}"}})
    cache = LayeredCache.from_config(config)
    await cache.start()
    await cache.close()  # nothing of this process is left in it
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_start_in_forked_child, args=(cache, out))
    child.start()
    try:
        outcome = await asyncio.to_thread(out.get, True, 30)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    assert outcome == "started", outcome


async def test_a_cluster_set_cancelled_after_its_write_still_announces_when_close_follows(
    redis_cluster: Any, prefix: str
) -> None:
    """README, "Invalidation wins everywhere": "a write whose caller is cancelled or
    times out mid-way still completes what its first command began: `invalidate()` and
    `invalidate_tag()` finish their Redis steps in a task of their own, which `close()`
    waits for (up to 5 s) rather than cutting it between its DEL and its announcement,
    and a `set()` cancelled after its write ... (where the announcement is a round trip
    of its own: a cluster) announces in the background"; ``BackgroundTasks.ORPHAN_GRACE``:
    "How long ``close`` waits for a write a cancelled caller left running ... cut off
    between its DEL and its announcement, the fleet would keep the old value in L1
    until its TTL".

    The cancelled set()'s background announcement (``_write_ends.WriteEnds.abandoned`` ->
    ``tasks.spawn``) is an ordinary task, not an orphan of ``to_completion``: the
    shutdown that follows the client's timeout (``close()``) gives it only
    ``grace=0.2`` s and cancels it before its XADD. L2 holds "new", instance b serves
    "old" from its L1 for the L1 TTL (60 s). The XADD is slowed by 0.5 s (a slow reply,
    or a slot of ``L2Store.slots`` under a burst), as in
    ``test_cancelled_writes.py::test_invalidation_left_running_by_a_cancelled_caller_is_cut_by_close``."""
    namespaces = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}
    config = make_config(
        redis_cluster.url, prefix, namespaces, redis={"cluster": True}, backplane={"block": "200ms"}
    )
    async with LayeredCache.from_config(config) as b:
        assert b._backplane is not None
        for _ in range(200):
            if b._backplane.connected.is_set():
                break
            await asyncio.sleep(0.025)
        a = LayeredCache.from_config(config)
        await a.start()
        try:
            await a.set("book", {"id": 1}, "old")
            for _ in range(200):  # b hears the set's own announcement first
                if b.backplane_status().entries_applied >= 1:  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.025)
            assert await b.get("book", {"id": 1}) == "old"  # b's L1 holds it
            invalidator = a._rt.invalidator
            real = invalidator.announce
            announcing = asyncio.Event()

            async def slow_announce(keys: Any) -> bool:
                announcing.set()
                await asyncio.sleep(0.5)  # the XADD's reply (or a slot) is slow to come
                return await real(keys)

            invalidator.announce = slow_announce  # type: ignore[method-assign]
            writer = asyncio.ensure_future(a.set("book", {"id": 1}, "new"))
            await announcing.wait()  # the SET landed; the announcement is on its way
            writer.cancel()  # the client gave up
            await asyncio.gather(writer, return_exceptions=True)
        finally:
            await a.close()  # the app shuts down right after
        await asyncio.sleep(1.5)  # ~7 x the backplane's block time
        probe = LayeredCache.from_config(config)
        await probe.start()
        try:
            assert await probe.get("book", {"id": 1}) == "new"  # what L2 holds
        finally:
            await probe.close()
        served = await b.get("book", {"id": 1})
        assert served != "old", (
            "b serves 'old' from L1 while L2 holds 'new': the cancelled set()'s "
            "announcement was cancelled by close() after 0.2 s"
        )


async def test_a_close_cut_short_by_its_callers_deadline_still_stops_the_listeners(
    redis_url: str, prefix: str
) -> None:
    """``BackgroundTasks``: "``close`` cancels and awaits, so no task outlives the cache
    or its Redis clients"; ``BackplaneListener.stop``: "stop() never hangs"; README,
    "Cancellation takes effect".

    ``close()`` runs its steps one after the other with nothing in a ``finally``: the
    backplane listener, the fallback subscriber and the hot-key reporter are stopped,
    and the clients closed, only after ``BackgroundTasks.close`` has waited up to
    ``ORPHAN_GRACE`` (5 s) for an invalidation a cancelled caller left running. A
    shutdown with a deadline shorter than that (``asyncio.wait_for(cache.close(), 1)``
    in a lifespan, a supervisor's grace period) cancels close() inside that wait, and
    the listener, the subscriber and the reporter run on (the listener XREADing, the
    reporter writing its report every second) with their connections open."""
    namespaces = {"book": {"key": "book:{id}", "hot": {"keys": ["book:1"], "threshold": "2/s"}}}
    config = make_config(redis_url, prefix, namespaces, backplane={"block": "200ms"})
    before = asyncio.all_tasks()
    a = LayeredCache.from_config(config)
    await a.start()
    publisher = a._parts.publisher
    assert publisher is not None
    real = publisher.publish

    async def slow_publish(keys: Any, tags: Any = None) -> bytes:
        await asyncio.sleep(3.0)  # a slow XADD: the orphaned invalidation is still running
        return await real(keys, tags=tags)

    publisher.publish = slow_publish  # type: ignore[method-assign]
    request = asyncio.ensure_future(a.invalidate("book", {"id": 2}))
    await asyncio.sleep(0.2)  # the DEL landed, the announcement is on its way
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(a.close(), 1.0)  # the shutdown's deadline
    await asyncio.sleep(0.2)
    names = {"layered_cache._backplane", "layered_cache._fallback", "layered_cache._hotreport"}
    left = [t for t in asyncio.all_tasks() - before if not t.done() and t.get_name() in names]
    try:
        assert left == [], f"still running after close(): {sorted(t.get_name() for t in left)}"
    finally:
        await a.close()


async def test_a_cache_started_again_drops_what_was_invalidated_while_it_was_closed(
    redis_url: str, prefix: str
) -> None:
    """``close()`` stops the listener; ``start()`` on a closed cache now builds a new one
    (``_follow``), which positions itself at the stream's tail (``last_id`` None ->
    ``_tail_id``) with no gap check, while L1 keeps what it held at close
    (``startup.reopened`` rebuilds loop-bound parts only). A write announced by another
    instance while this one was closed is never applied: the restarted cache serves the
    replaced value from L1 for its whole TTL. (Before, the same listener object was
    started again and read on from its ``last_id``; a forked start drops L1 for the same
    reason: ``startup.forked`` -> ``coherence.forget_all``.)"""

    namespaces = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}
    config = make_config(redis_url, prefix, namespaces, backplane={"block": "200ms"})
    a = LayeredCache.from_config(config)
    await a.start()
    try:
        async def old() -> str:
            return "old"

        assert await a.get_or_load("book", {"id": 1}, old) == "old"  # a's L1 holds it
        await a.close()  # a lifespan ends (a test's app, a worker's reload)
        async with LayeredCache.from_config(config) as b:
            await b.set("book", {"id": 1}, "new")  # announced on the backplane
        await a.start()  # the next lifespan
        await asyncio.sleep(0.5)  # the listener had every chance to catch up

        async def never() -> str:
            raise AssertionError("L1 or L2 holds the key")

        assert await a.get_or_load("book", {"id": 1}, never) == "new"
    finally:
        await a.close()


async def test_close_stops_an_early_refresh_whose_loader_is_still_running(
    redis_server: RedisServer, prefix: str
) -> None:
    """README, lifecycle: "A closed cache refuses calls"; ``BackgroundTasks.close``:
    "nothing outlives the clients closed next".

    close() cancelled the XFetch refresh task, whose cancel handler handed the running
    load to a new background fill (``MissPath.load_and_fill``, right for a caller that
    went away: the load fills for the others). That task was spawned after close() had
    taken its list of tasks: the user's loader ran on after close() returned, and its
    fill wrote "new" to L2 through the closed cache, on a connection opened after
    close() that nobody closed. Found by a review; failed before its fix."""
    book = {
        "key": "book:{id}",
        "l1": False,
        "l2": {"ttl": "10s", "jitter": 0},
        "stampede": {"early_refresh_beta": 1.0},
    }
    config = make_config(redis_server.url, prefix, {"book": book})
    admin = redis.Redis.from_url(redis_server.url)
    refresh_started = asyncio.Event()
    refresh_ended: list[str] = []

    async def first() -> str:
        await asyncio.sleep(0.5)  # delta 0.5 s: with the draw below every hit refreshes
        return "old"

    async def refresh_loader() -> str:
        refresh_started.set()
        try:
            await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            refresh_ended.append("cancelled")
            raise
        refresh_ended.append("finished")
        return "new"

    cache = LayeredCache.from_config(config, rand=lambda: 1 - 1e-12)
    await cache.start()
    try:
        assert await cache.get_or_load("book", {"id": 1}, first) == "old"
        # An L2 hit that starts an early refresh in the background.
        assert await cache.get_or_load("book", {"id": 1}, refresh_loader) == "old"
        await asyncio.wait_for(refresh_started.wait(), 5)
    finally:
        await cache.close()
    ended_at_close = list(refresh_ended)
    await asyncio.sleep(1.5)  # the refresh's loader would have ended by now
    raw = await admin.get(f"{prefix}book:1")
    await admin.aclose()
    assert raw is not None
    held = cache.namespace("book").policy.codec.decode(raw).value
    assert ended_at_close == ["cancelled"], "close() returned with the load in flight"
    assert refresh_ended == ["cancelled"] and held == "old", (refresh_ended, held)


async def test_close_leaves_no_task_that_a_task_it_cancelled_spawned_on_its_way_out() -> None:
    """``BackgroundTasks.close``: "nothing outlives the clients closed next". A task
    cancelled in close()'s last round (a fill, a refresh) gives its lease back in a
    task it spawns then: close() had taken its list already, and that task ran on
    after it, on the closed clients. Now close() waits for such cleanups (within the
    same grace) and cancels what is left, until a round leaves nothing new."""
    tasks = BackgroundTasks()
    tasks.ORPHAN_GRACE = 0.3  # the test's patience, not the library's
    cleaned: list[str] = []

    async def give_back() -> None:
        await asyncio.sleep(0.01)
        cleaned.append("lease given back")

    async def write() -> None:
        try:
            await asyncio.Event().wait()  # a Redis step that never answers
        except asyncio.CancelledError:
            tasks.spawn_orphan(give_back())
            tasks.spawn(asyncio.Event().wait())  # and one that would never end
            raise

    tasks.spawn(write())  # a fill's or a refresh's task
    await asyncio.sleep(0)
    before = asyncio.all_tasks()
    await tasks.close()
    left = [t for t in asyncio.all_tasks() - before if not t.done()]
    assert cleaned == ["lease given back"]
    assert left == [], left


_COHERENT = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}


async def test_a_close_cut_short_in_its_grace_leaves_no_fill_of_a_cancelled_caller_running(
    redis_server: RedisServer, prefix: str
) -> None:
    """``BackgroundTasks``: "no task outlives the cache or its Redis clients". A read
    whose caller was cancelled mid-load leaves its fill to a background task. A
    shutdown whose deadline lands in close()'s 0.2 s grace for such tasks closed the
    clients but never cancelled the task: the load finished after close() returned and
    its fill wrote L2 on a connection redis-py opened anew on the closed client."""
    config = make_config(redis_server.url, prefix, _COHERENT, backplane={"block": "200ms"})
    admin = redis.Redis.from_url(redis_server.url)
    cache = LayeredCache.from_config(config)
    await cache.start()
    gate, loading = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        loading.set()
        await gate.wait()
        return "loaded after close"

    try:
        call = asyncio.ensure_future(cache.get_or_load("book", {"id": 1}, slow))
        await asyncio.wait_for(loading.wait(), 5)
        call.cancel()  # a client's timeout: the load runs on, its fill in the background
        await asyncio.gather(call, return_exceptions=True)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(cache.close(), 0.05)  # the shutdown's deadline
        baseline = len(await admin.client_list())
        gate.set()  # the database answers after close()
        await asyncio.sleep(0.5)
        written = await admin.get(cache.key("book", {"id": 1}))
        opened = len(await admin.client_list()) - baseline
        assert (written, opened) == (None, 0), "the fill ran on after close()"
    finally:
        gate.set()
        await cache.close()
        await admin.aclose()


async def test_a_close_cancelled_while_it_stops_the_listener_stops_the_other_followers(
    redis_server: RedisServer, prefix: str
) -> None:
    """README: "a `close()` cut short by its caller's deadline has stopped the listeners
    first and still closes the clients". A cancel landing while close() stops the
    backplane listener (up to 1.2 s: a listener inside XREAD) left the fallback
    subscriber, the hot-key reporter and the Redis clock's sampler running for good,
    each reconnecting the closed clients, the reporter writing its report every second."""
    namespaces = {"book": {"key": "book:{id}", "hot": {"keys": ["book:1"], "threshold": "2/s"}}}
    config = make_config(redis_server.url, prefix, namespaces, backplane={"block": "200ms"})
    admin = redis.Redis.from_url(redis_server.url)
    before = asyncio.all_tasks()
    cache = LayeredCache.from_config(config)
    await cache.start()
    try:
        closing = asyncio.ensure_future(cache.close())
        await asyncio.sleep(0)  # close() waits for the listener's task to end
        closing.cancel()  # the shutdown's deadline
        await asyncio.gather(closing, return_exceptions=True)
        report = f"{prefix}*hot*"
        await asyncio.sleep(0.1)
        await admin.delete(*(await admin.keys(report) or [b"-"]))
        await asyncio.sleep(1.5)
        left = [t for t in asyncio.all_tasks() - before if not t.done()]
        assert left == [] and await admin.keys(report) == [], left
    finally:
        await cache.close()
        await admin.aclose()


async def test_a_cache_whose_loop_ended_mid_load_closes_cleanly_on_the_next_loop(
    redis_url: str, prefix: str
) -> None:
    """README: "`start()` closes the connections made on another event loop (... a start
    whose loop ended without `close()` ...)"; "A closed cache starts again". A lifespan
    that ended without ``close()`` while a request's load ran: ``asyncio.run`` cancels
    the request, whose fill is left to a background task that the loop's end leaves
    pending. The next lifespan's ``start()`` kept it, and its ``close()`` cancelled a
    task of the dead loop: ``RuntimeError: Event loop is closed``."""
    config = make_config(redis_url, prefix, _COHERENT, backplane={"block": "200ms"})
    cache = LayeredCache.from_config(config)

    async def slow() -> str:
        await asyncio.sleep(30)
        return "v"

    async def first_lifespan() -> None:
        await cache.start()
        request = asyncio.ensure_future(cache.get_or_load("book", {"id": 1}, slow))
        await asyncio.sleep(0.2)  # the load runs; the app ends without close()
        assert not request.done()

    async def load() -> str:
        return "v2"

    await asyncio.to_thread(asyncio.run, first_lifespan())
    await cache.start()  # the next lifespan, on this loop
    try:
        assert await cache.get_or_load("book", {"id": 2}, load) == "v2"
    finally:
        await cache.close()


# The shipped defaults: a start waits 2 x (0.5 + 0.1) = 1.2 s for a Redis that is down.
DEFAULT_TIMEOUTS = {"timeout": "100ms", "connect_timeout": "500ms", "breaker": {"failures": 3, "reset": "1s"}}
START_BOUND = 2 * (0.5 + 0.1)


@pytest.fixture
def unanswered_syn() -> Iterator[str]:
    """A Redis address whose SYNs go unanswered (a host that is down, a dropped route):
    a listening socket with a full accept queue, never accepting."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port))  # fills the queue
    yield f"redis://127.0.0.1:{port}/0"
    filler.close()
    server.close()


async def _start_time(url: str, prefix: str, **redis: Any) -> float:
    cache = LayeredCache.from_config(make_config(url, prefix, redis={**DEFAULT_TIMEOUTS, **redis}))
    started = time.monotonic()
    await cache.start()
    took = time.monotonic() - started
    await cache.close()
    return took


async def test_a_cache_started_against_a_hung_redis_serves_within_the_documented_wait(
    redis_server: RedisServer, prefix: str
) -> None:
    """README (fork safety): a new cache "starts serving only once its backplane listener
    knows its place ...; with Redis down it waits at most 2 x (`redis.connect_timeout` +
    `redis.timeout`), 1.2 s by default, then serves without L2".
    Scenario: Redis accepts connections and never answers (a black-holing proxy).
    Expected: start() returns within 1.2 s. Happened: 1.4 s: ``_start_steps`` ran the
    clock sync (TIME) and the replica-count check one after the other before the
    listener's bounded wait, each paying one redis.timeout; now they run together, each
    within that wait (``_startup.first_steps``)."""
    proxy = await ToxicProxy("127.0.0.1", redis_server.port).start()
    proxy.mode = "blackhole"
    try:
        took = await _start_time(proxy.url, prefix)
    finally:
        await proxy.stop()
    assert took <= START_BOUND + 0.1, f"start() took {took:.2f} s with a hung Redis"


async def test_a_cache_started_against_an_unreachable_redis_serves_within_the_documented_wait(
    unanswered_syn: str, prefix: str
) -> None:
    """The same promise. Scenario: Redis's host answers no SYN (each connect times out).
    Expected: start() returns within 1.2 s. Happened: 2.2 s (the clock sync and the
    replica check each paid a connect_timeout before the listener's wait)."""
    took = await _start_time(unanswered_syn, prefix)
    assert took <= START_BOUND + 0.1, f"start() took {took:.2f} s with Redis unreachable"


# A longer redis.timeout than the default's, so that the slot discovery's own (one
# timeout against a hung seed) stands out from the scheduling slack: 2 x (0.5 + 0.3).
CLUSTER_START_BOUND = 2 * (0.5 + 0.3)


async def _cluster_start_time(url: str, prefix: str) -> float:
    return await _start_time(url, prefix, timeout="300ms", cluster=True)


async def test_a_cluster_cache_started_against_a_hung_seed_serves_within_the_documented_wait(
    redis_server: RedisServer, prefix: str
) -> None:
    """The same promise, for ``redis.cluster = true``. Scenario: the seed node accepts
    connections and never answers. Expected: start() returns within 2 x
    (connect_timeout + timeout). Happened:
    the slot discovery (``learn_slots``: CLUSTER SLOTS through redis-py) ran before the
    bounded wait and paid its own timeouts on top of it."""
    proxy = await ToxicProxy("127.0.0.1", redis_server.port).start()
    proxy.mode = "blackhole"
    try:
        took = await _cluster_start_time(proxy.url, prefix)
    finally:
        await proxy.stop()
    assert took <= CLUSTER_START_BOUND + 0.1, f"start() took {took:.2f} s with a hung seed"


async def test_a_cluster_cache_started_against_an_unreachable_seed_serves_within_the_documented_wait(
    unanswered_syn: str, prefix: str
) -> None:
    """The same, the seed's host answering no SYN."""
    took = await _cluster_start_time(unanswered_syn, prefix)
    assert took <= CLUSTER_START_BOUND + 0.1, f"start() took {took:.2f} s, seed unreachable"


LONG_L1 = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}


async def _version(value: str) -> str:
    return value


async def test_an_l1_copy_filled_before_start_is_dropped_by_a_set_announced_before_start(
    redis_server: RedisServer, prefix: str
) -> None:
    """Found by a review (2026-12-06). README: a new cache "starts serving only once its
    backplane listener knows its place in the stream, so no invalidation slips between
    its first L1 fill and the listener". Scenario: a warm-up before start() on the
    cache's own loop fills L1 with v1; a writer's set(v2) returns; start() places the
    listener after that announcement. Happened: the reader served v1 for its L1 TTL.
    Now start() drops what calls before it put in L1."""
    config = make_config(redis_server.url, prefix, LONG_L1, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as writer:
        await writer.set("book", {"id": 1}, "v1")
        reader = LayeredCache.from_config(config)
        try:
            # a warm-up on this loop, before start()
            assert await reader.get_or_load("book", {"id": 1}, lambda: _version("x")) == "v1"
            assert in_l1(reader, 1)
            await writer.set("book", {"id": 1}, "v2")  # returned: announced to the fleet
            await reader.start()

            async def reads_v2() -> bool:
                return await reader.get_or_load("book", {"id": 1}, lambda: _version("x")) == "v2"

            assert await eventually(reads_v2, timeout=5), (
                "the reader still serves v1 from the L1 its warm-up filled, 5 s after the "
                "writer's set() returned and after its own start()"
            )
        finally:
            await reader.close()


async def test_a_read_filled_while_start_waits_for_its_position_is_dropped_by_a_set_announced_meanwhile(
    redis_server: RedisServer, prefix: str
) -> None:
    """Found by a review of this session's fix (2026-12-06). README (Lifecycle): a new
    cache "starts serving only once its backplane listener
    knows its place in the stream, so no invalidation slips between its first L1 fill and
    the listener", and "start() drops what calls before it (a warm-up on its loop) put in
    L1, which no listener followed".

    Scenario: a warm-up task runs beside start() on the cache's loop (``create_task(warm())``
    then ``await cache.start()``). start() drops L1 as it begins (``_rebind``), then waits
    for the listener's position, which comes late (a slow first XREVRANGE, here held).
    Meanwhile the warm-up reads v1 into L1, and a writer's set(v2) returns (announced).
    The listener then takes its position after that announcement and never hears it.
    Promised: the reader serves v2 (its L1 copy was filled before the listener had a
    position). Happens: v1 for its whole L1 TTL (60 s)."""
    config = make_config(redis_server.url, prefix, LONG_L1, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as writer:
        await writer.set("book", {"id": 1}, "v1")
        reader = LayeredCache.from_config(config)
        listener = reader._backplane
        assert listener is not None
        link = listener._link
        real_newest = link.newest_id
        release = asyncio.Event()
        asked = asyncio.Event()

        async def slow_newest_id() -> bytes | None:  # the listener's first round trip is slow
            asked.set()
            await release.wait()
            return await real_newest()

        link.newest_id = slow_newest_id  # type: ignore[method-assign]
        try:
            starting = asyncio.create_task(reader.start())
            await asyncio.wait_for(asked.wait(), 5)  # start() is waiting for the position
            # the warm-up, beside start(): fills L1 from L2
            assert await reader.get_or_load("book", {"id": 1}, lambda: _version("x")) == "v1"
            assert in_l1(reader, 1)
            await writer.set("book", {"id": 1}, "v2")  # returned: announced to the fleet
            release.set()
            await asyncio.wait_for(starting, 10)
            assert reader.backplane_status().connected  # type: ignore[union-attr]

            async def reads_v2() -> bool:
                return await reader.get_or_load("book", {"id": 1}, lambda: _version("x")) == "v2"

            assert await eventually(reads_v2, timeout=5), (
                "the reader still serves v1 from the L1 a read beside its start() filled, "
                "5 s after the writer's set() returned and after its start() returned"
            )
        finally:
            release.set()
            await reader.close()


async def test_a_second_start_of_a_running_cache_keeps_its_l1(
    redis_server: RedisServer, prefix: str
) -> None:
    """Found by a review of this session's fix (2026-12-06). README (Lifecycle): "a
    second start() overlapping the first (two lifespans sharing
    the module's cache, a lazy start hit by two requests at once) waits for it, then does
    what a second start does, nothing".

    Scenario: a started cache serves book 1 from L1; a second lifespan sharing the
    module's cache calls start() again. Promised: nothing changes. Happens: since
    a31b0be, ``_rebind`` drops the running cache's whole L1 (and its tag versions and
    in-flight loads) on every start(), so the next read of every key goes to Redis."""
    config = make_config(redis_server.url, prefix, LONG_L1)
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, "v1")
        assert await cache.get_or_load("book", {"id": 1}, lambda: _version("x")) == "v1"
        assert in_l1(cache, 1)
        hits = cache.stats()["book"]["l1_hit"]
        await cache.start()  # the second lifespan
        assert await cache.get_or_load("book", {"id": 1}, lambda: _version("x")) == "v1"
        assert cache.stats()["book"]["l1_hit"] == hits + 1, (
            "a second start() of a running cache dropped its L1: the read went to Redis"
        )


async def test_a_warm_up_copy_is_dropped_by_start_even_if_the_listener_blips_after_taking_its_place(
    redis_url: str, prefix: str
) -> None:
    """Found by a review of this session's fix (2026-12-06). README (Lifecycle): "once
    the listener has its place `start()` drops what
    calls before or beside it (a warm-up on its loop) put in L1, which no listener
    followed".

    Scenario: a warm-up before start() fills L1 with v1; a writer's set(v2) returns
    (announced). start(): the listener takes its place in the stream (after that
    announcement) while the clock's first samples still run (``first_steps`` waits for
    them together); then the listener's connection drops (a Redis blip, CLIENT KILL)
    before the start's wait ends, and its reconnect is still under way when start()
    resumes. ``startup.positioned_now`` reads "has a place" as ``connected.is_set()``:
    not set at that moment, so L1 was not dropped; the listener later reconnected at its
    old place (after the set's announcement), so nothing dropped v1: served from L1 for
    its whole TTL (60 s). Now a place taken counts, not a live connection."""
    config = make_config(redis_url, prefix, LONG_L1, backplane={"block": "200ms"})
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(config) as writer:
        await writer.set("book", {"id": 1}, "v1")
        reader = LayeredCache.from_config(config)
        clock_gate, reconnect_gate = asyncio.Event(), asyncio.Event()
        try:
            assert await reader.get_or_load("book", {"id": 1}, lambda: _version("x")) == "v1"
            assert in_l1(reader, 1)
            await writer.set("book", {"id": 1}, "v2")  # returned: announced to the fleet

            clock = reader._clock
            original_start = clock.start

            async def slow_clock_start(within: float | None = None) -> None:
                await clock_gate.wait()  # the clock's first samples take a while
                await original_start(within)

            clock.start = slow_clock_start  # type: ignore[method-assign]
            starting = asyncio.ensure_future(reader.start())
            # reader._backplane is built anew by start() (``_rebind``): wait for it.
            async def placed() -> bool:
                listener = reader._backplane
                return listener is not None and listener.connected.is_set()

            assert await eventually(placed, timeout=5)
            listener: Any = reader._backplane
            original_check = listener._check_gap

            async def slow_reconnect(position: bytes) -> None:
                await reconnect_gate.wait()  # Redis still unreachable for the listener
                await original_check(position)

            listener._check_gap = slow_reconnect
            # The blip: the listener's connection (the one blocked in XREAD) is dropped.
            for client in await admin.client_list():
                if client.get("cmd") in ("xread", "xreadgroup"):
                    await admin.client_kill_filter(_id=client["id"])

            async def dropped() -> bool:
                return not listener.connected.is_set()

            assert await eventually(dropped, timeout=5)
            clock_gate.set()
            await asyncio.wait_for(starting, 10)
            reconnect_gate.set()  # the listener is back, at its place

            async def reads_v2() -> bool:
                return await reader.get_or_load("book", {"id": 1}, lambda: _version("x")) == "v2"

            assert await eventually(reads_v2, timeout=5), (
                "the reader serves v1 from the L1 its warm-up filled, after its own start() "
                "and 5 s after the writer's set() returned"
            )
        finally:
            clock_gate.set()
            reconnect_gate.set()
            await reader.close()
            await admin.aclose()
