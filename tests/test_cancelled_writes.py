"""A write whose caller is cancelled mid-way still leaves every layer agreeing with L2.

Between an L2 write or delete and what must follow it (the announcement on the
backplane, the writer's own settle) a client timeout used to leave a window: L2 changed,
but other instances kept serving their L1 copies for their TTL, or (for a tag) served
the dead entries from L2 until their TTL. The interleavings are forced from the test
side by slowing one reply, as tests/test_invalidation_wins.py does. Found by an
adversarial review (2026-12-04); each cancelled scenario failed before the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

import msgspec
import pytest
import redis.asyncio as aioredis

from layered_cache import L2Unavailable, LayeredCache, _replicas, _tags, parse_config
from layered_cache import _direct as direct
from layered_cache._unsettled import UnsettledWrites
from tests.faults.proxy import ToxicProxy
from tests.helpers import CountingLoader, eventually, make_config

NS: dict[str, dict[str, Any]] = {
    "book": {"key": "book:{id}", "l1": {"ttl": "60s"}},
    "category": {"key": "category:{slug}", "tags": True, "l1": {"ttl": "60s"}},
}


async def _connected(*caches: LayeredCache) -> None:
    for cache in caches:
        assert cache._backplane is not None
        await asyncio.wait_for(cache._backplane.connected.wait(), 5)


@contextlib.contextmanager
def _slow_announcements(cache: LayeredCache) -> Iterator[list[Any]]:
    """``cache``'s backplane appends answer 200 ms late; yields the keys announced."""
    invalidator = cache._rt.invalidator
    original, calls = invalidator.announce, []

    async def slow_announce(keys: Any) -> bool:
        calls.append(keys)
        await asyncio.sleep(0.2)
        return await original(keys)

    invalidator.announce = slow_announce  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        invalidator.announce = original  # type: ignore[method-assign]


async def test_an_invalidate_whose_caller_timed_out_after_the_delete_still_reaches_the_other_l1(
    redis_url: str, prefix: str, redis_client: Any
) -> None:
    config = make_config(redis_url, prefix, NS)
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        await _connected(a, b)
        await a.set("book", {"id": 1}, "old")
        await _heard(b, 1)  # b applied the set's own announcement first
        assert await b.get("book", {"id": 1}) == "old"  # b's L1 holds it
        with _slow_announcements(a), contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.1):  # the request's deadline
                await a.invalidate("book", {"id": 1})
        assert not await redis_client.exists(a.key("book", {"id": 1}))  # L2: deleted
        assert await eventually(lambda: _is(b, None), timeout=1.5), (
            f"b still serves {await b.get('book', {'id': 1})!r}, deleted from L2"
        )


async def _heard(cache: LayeredCache, entries: int) -> None:
    status = cache.backplane_status
    assert await eventually(lambda: status().entries_applied >= entries, timeout=3)  # type: ignore[union-attr]


async def _is(cache: LayeredCache, expected: Any, ns: str = "book", fields: Any = None) -> bool:
    return await cache.get(ns, fields or {"id": 1}) == expected


async def test_an_invalidate_tag_whose_caller_timed_out_still_kills_the_entry_everywhere(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(redis_url, prefix, NS)
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        await _connected(a, b)
        page = {"slug": "scifi"}
        await a.set("category", page, "old page", tags=["book:42"])
        await _heard(b, 1)
        assert await b.get("category", page) == "old page"
        original = _tags.take_loading

        async def slow_take_loading(store: Any, prefix: str) -> None:
            await asyncio.sleep(0.2)  # the loading-set script's reply is slow
            await original(store, prefix)

        monkeypatch.setattr(_tags, "take_loading", slow_take_loading)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.1):
                await a.invalidate_tag("book:42")  # timed out revoking the loads in flight
        monkeypatch.setattr(_tags, "take_loading", original)
        # The rest runs on: a fresh instance agrees the entry is dead once Redis holds
        # the new version.
        async with LayeredCache.from_config(config) as c:
            assert await eventually(
                lambda: _missing(c, page), timeout=2
            ), "the invalidation stopped with its caller"
        await asyncio.sleep(1.5)  # well past the backplane's latency
        for cache in (a, b):  # L1 dropped: read L2 again
            cache.namespace("category").policy.l1.clear()  # type: ignore[union-attr]
        served = {
            "a": await a.get("category", page),
            "b": await b.get("category", page),
        }
        assert served == {"a": None, "b": None}, f"a tag-invalidated entry is still served: {served}"


@pytest.mark.parametrize("cancel", [True, False], ids=["cancelled", "control"])
async def test_a_set_cancelled_after_its_write_keeps_no_load_that_read_the_replaced_value(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch, cancel: bool
) -> None:
    """README: set() re-tombstones the key once its write landed, so a read that began
    during the write (and read the replaced value) is not kept in L1. Cancelled between
    the write's reply and that step, the writer's own L1 kept the replaced value."""
    config = make_config(redis_url, prefix, NS)
    async with LayeredCache.from_config(config) as a:
        await a.set("book", {"id": 1}, "old")
        a.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
        write_may_go = asyncio.Event()
        written = asyncio.Event()
        original = direct.execute_command

        async def gated(client: Any, *args: Any, **kwargs: Any) -> Any:
            if args and args[0] == "EVALSHA" and not written.is_set():
                await write_may_go.wait()
                reply = await original(client, *args, **kwargs)
                written.set()
                await asyncio.sleep(0.2)  # the reply is slow to come back
                return reply
            return await original(client, *args, **kwargs)

        monkeypatch.setattr(direct, "execute_command", gated)
        writer = asyncio.create_task(a.set("book", {"id": 1}, "new"))
        await asyncio.sleep(0.01)  # set() began: L1 tombstoned, its write is on its way
        assert await a.get("book", {"id": 1}) == "old"  # a read during the write
        write_may_go.set()
        await written.wait()
        if cancel:
            writer.cancel()  # the writer's client goes away before set() returns
        await asyncio.gather(writer, return_exceptions=True)
        monkeypatch.setattr(direct, "execute_command", original)
        assert await eventually(lambda: _is(a, "new"), timeout=1.5), (
            f"L2 holds 'new', a serves {await a.get('book', {'id': 1})!r}"
        )


async def test_a_cluster_set_whose_caller_timed_out_after_its_write_still_reaches_the_other_l1(
    redis_cluster: Any, prefix: str
) -> None:
    config = make_config(redis_cluster.url, prefix, NS, redis={"cluster": True})
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        await _connected(a, b)
        await a.set("book", {"id": 1}, "old")
        await _heard(b, 1)  # b applied the set's own announcement first
        assert await b.get("book", {"id": 1}) == "old"  # b's L1 holds it
        # The XADD after the SETs is slow.
        with _slow_announcements(a) as calls, contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.1):
                await a.set("book", {"id": 1}, "new")
        assert calls, "set() did not announce after its write"
        a.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
        assert await a.get("book", {"id": 1}) == "new"  # what L2 holds
        assert await eventually(lambda: _is(b, "new"), timeout=1.5), (
            f"L2 holds 'new', b serves {await b.get('book', {'id': 1})!r}"
        )


async def test_a_cluster_set_of_a_hot_key_cancelled_between_its_phases_leaves_no_old_replica(
    redis_cluster: Any, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster set() of a hot key is two round trips (``_replicas.write_many``): the
    base keys, then the replica leases and replicas. Cancelled between them, the base
    held the new value and every replica the old one for the whole L2 TTL: hot readers
    served the old value, cold ones the new (found by a review, 2026-12-05)."""
    hot = {"replicas": 8, "keys": ["book:1"]}
    ns = {"book": {"key": "book:{id}", "l1": False, "hot": hot}}
    with_l1 = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}, "hot": hot}}
    cluster = {"cluster": True, "timeout": "2s"}
    config = make_config(redis_cluster.url, prefix, ns, redis=cluster)
    other = make_config(redis_cluster.url, prefix, with_l1, redis=cluster)
    base_written = asyncio.Event()
    original = _replicas._write_bases

    async def write_bases_then_pause(store: Any, writes: Any) -> None:
        await original(store, writes)
        base_written.set()
        await asyncio.sleep(0.05)  # the await between the phases, widened: a cancel lands

    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(other) as b:
        await _connected(a, b)
        await a.set("book", {"id": 1}, "old")  # base + 8 replicas
        await _heard(b, 1)
        assert await b.get("book", {"id": 1}) == "old"  # b's L1 holds it
        monkeypatch.setattr(_replicas, "_write_bases", write_bases_then_pause)
        writer = asyncio.ensure_future(a.set("book", {"id": 1}, "new"))
        await asyncio.wait_for(base_written.wait(), 5)
        writer.cancel()  # e.g. the HTTP request's deadline
        (outcome,) = await asyncio.gather(writer, return_exceptions=True)
        assert isinstance(outcome, asyncio.CancelledError)  # the caller sees its cancel
        monkeypatch.setattr(_replicas, "_write_bases", original)
        await asyncio.sleep(0.3)  # the write left running has finished
        served = [await a.get("book", {"id": 1}) for _ in range(64)]
        assert served == ["new"] * 64, f"{served.count('old')}/64 reads served 'old'"
        assert await eventually(lambda: _is(b, "new"), timeout=1.5), (  # announced
            f"L2 holds 'new', b serves {await b.get('book', {'id': 1})!r}"
        )


async def _missing(cache: LayeredCache, page: dict[str, str]) -> bool:
    return await cache.get("category", page) is None


async def test_invalidation_left_running_by_a_cancelled_caller_is_cut_by_close(
    redis_url: str, prefix: str
) -> None:
    """Was broken: "a write whose caller is cancelled or times out mid-way still completes
    what its first command began: `invalidate()` ... finish[es] their Redis steps in a
    task of their own" / "a DEL without its announcement would leave other instances
    serving the old value for their L1 TTL" (_coherence.invalidate).

    A request calls invalidate(); the DEL lands; the announcement waits (a slow Redis
    reply, or a free ``L2Store.slots`` under a burst: simulated with a 0.5 s pause in the
    XADD); the request is cancelled (client timeout / graceful shutdown), and the app
    shuts down: ``LayeredCache.close()`` -> ``BackgroundTasks.close(grace=0.2)`` cancels
    the orphaned invalidation before its XADD. Observed: L2 is deleted but no entry is
    appended; instance B serves the old value from L1 (60 s TTL). Expected: close()
    lets the to-completion steps of an invalidation finish (bounded by its Redis
    timeouts), or the orphan is at least not cancelled between DEL and announcement.
    Cause: _runtime.BackgroundTasks.close cancels to_completion orphans after 0.2 s."""
    namespaces = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}
    config = make_config(redis_url, prefix, namespaces, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as b:
        assert b._backplane is not None
        assert await eventually(b._backplane.connected.is_set)
        await b.get_or_load("book", {"id": 1}, CountingLoader("old"))
        a = LayeredCache.from_config(config)
        await a.start()
        try:
            publisher = a._parts.publisher
            assert publisher is not None
            real = publisher.publish

            async def slow_publish(keys: Any, tags: Any = None) -> bytes:
                await asyncio.sleep(0.5)  # the XADD's reply (or a slot) is slow to come
                return await real(keys, tags=tags)

            publisher.publish = slow_publish  # type: ignore[method-assign]
            admin = aioredis.from_url(redis_url)
            key = a.key("book", {"id": 1})
            try:
                request = asyncio.ensure_future(a.invalidate("book", {"id": 1}))
                assert await eventually(
                    lambda: _gone(admin, key), timeout=5
                ), "the DEL never landed"
                request.cancel()  # the client gave up: invalidate() promised to finish
                with contextlib.suppress(asyncio.CancelledError):
                    await request
            finally:
                await admin.aclose()
        finally:
            await a.close()  # the app shuts down
        await asyncio.sleep(1.0)
        value = await b.get("book", {"id": 1})
        assert value is None, (
            f"B serves {value!r} from L1: A's invalidation deleted L2 but its announcement "
            "was cancelled by close()"
        )


async def _gone(admin: Any, key: str) -> bool:
    return not await admin.exists(key)


_HOT_BOOK = {"book": {"key": "book:{id}", "l1": False, "hot": {"replicas": 8, "keys": ["book:1"]}}}


class _FilledByTheReplicas:
    """A hot key's cluster cache whose masters fill up (noeviction) once its bases are
    written: the second phase of a ``set()`` is refused. ``served()``: what 64 reads of
    the key return afterwards."""

    def __init__(self, redis_cluster: Any, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.config = make_config(
            redis_cluster.url, prefix, _HOT_BOOK, redis={"cluster": True, "timeout": "2s"}
        )
        self.masters = [aioredis.Redis(host=h, port=p) for h, p in redis_cluster.nodes]
        self.original_bases = _replicas._write_bases
        self._monkeypatch = monkeypatch

    async def write_bases_then_fill_redis(self, store: Any, writes: Any) -> None:
        await self.original_bases(store, writes)
        for master in self.masters:  # full before the replicas: the second phase is refused
            await master.config_set("maxmemory-policy", "noeviction")
            await master.config_set("maxmemory", 1)

    def arm(self, **patches: Any) -> None:
        """Fill Redis between the phases (and whatever else ``patches`` of ``_replicas``)."""
        self._monkeypatch.setattr(_replicas, "_write_bases", self.write_bases_then_fill_redis)
        for name, replacement in patches.items():
            self._monkeypatch.setattr(_replicas, name, replacement)

    def disarm(self) -> None:
        self._monkeypatch.undo()

    @staticmethod
    async def served(cache: LayeredCache) -> set[Any]:
        await asyncio.sleep(0.5)  # whatever was left running has finished
        return {await cache.get("book", {"id": 1}) for _ in range(64)}

    async def close(self) -> None:
        for master in self.masters:
            await master.config_set("maxmemory", 0)
            await master.aclose()


async def test_a_cancelled_cluster_set_whose_replicas_a_full_redis_refused_drops_the_key(
    redis_cluster: Any, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled between the phases of a hot key's cluster write, with Redis full by the
    second (noeviction): the bases held the new value, every replica the old one. The
    caller, not cancelled, drops the key everywhere on that refusal; the write left
    running only announced it, and hot readers kept serving the old value."""
    full = _FilledByTheReplicas(redis_cluster, prefix, monkeypatch)
    fill = full.write_bases_then_fill_redis

    async def write_bases_then_fill_redis(store: Any, writes: Any) -> None:
        await fill(store, writes)
        await asyncio.sleep(0.05)  # the await between the phases, widened: a cancel lands

    try:
        async with LayeredCache.from_config(full.config) as cache:
            await cache.set("book", {"id": 1}, "old")  # base + 8 replicas
            full.arm(_write_bases=write_bases_then_fill_redis)
            writer = asyncio.ensure_future(cache.set("book", {"id": 1}, "new"))
            await asyncio.sleep(0.02)
            writer.cancel()
            (outcome,) = await asyncio.gather(writer, return_exceptions=True)
            assert isinstance(outcome, asyncio.CancelledError)
            full.disarm()
            served = await full.served(cache)
            assert "old" not in served, served
    finally:
        await full.close()


async def test_a_cancelled_cluster_set_purges_http_caches_again_once_its_write_is_done(
    redis_cluster: Any, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """set_many purges gateways from its ``finally``: cancelled while its cluster write
    runs on, that purge left before the write landed, and a gateway refilled from L2
    meanwhile kept the old value for its s-maxage."""
    from tests.test_purge import Recording

    hot = {"replicas": 8, "keys": ["book:1"]}
    raw = {
        "redis": {"url": redis_cluster.url, "prefix": prefix, "cluster": True, "timeout": "2s"},
        "purge": {"repeat_after": "0s"},
        "namespaces": {"book": {"key": "book:{id}", "l1": False, "hot": hot}},
    }
    purger = Recording()
    original = _replicas._write_bases
    purged_during_write: list[int] = []

    async def write_bases_then_pause(store: Any, writes: Any) -> None:
        await original(store, writes)
        await asyncio.sleep(0.05)  # the await between the phases, widened: a cancel lands
        purged_during_write.append(len(purger.calls))

    config = parse_config(raw, env={})
    async with LayeredCache.from_config(config, purger=purger) as cache:
        monkeypatch.setattr(_replicas, "_write_bases", write_bases_then_pause)
        writer = asyncio.ensure_future(cache.set("book", {"id": 1}, "new"))
        await asyncio.sleep(0.02)
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        assert await eventually(lambda: len(purger.calls) >= 2, timeout=2)
    assert purged_during_write == [1]  # the caller's, sent before the write landed
    assert purger.calls[-1] == ([f"{prefix}book:1"], [])  # and again once it did


async def test_a_cluster_set_cancelled_just_after_its_refused_write_finished_drops_the_key(
    redis_cluster: Any, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same refusal, the cancel reaching the caller after the write's task ended and
    before the caller resumed: its "the write is done" branch only announced, and the
    replicas kept the old value (found by a review of the fix above, 2026-12-05)."""
    full = _FilledByTheReplicas(redis_cluster, prefix, monkeypatch)
    original_many = _replicas.write_many
    writer: asyncio.Future[Any] | None = None

    async def write_many_cancel_on_refusal(*args: Any, **kwargs: Any) -> bool:
        try:
            return await original_many(*args, **kwargs)
        except L2Unavailable:
            assert writer is not None  # the cancel lands once this task is done
            asyncio.get_running_loop().call_soon(writer.cancel)
            raise

    try:
        async with LayeredCache.from_config(full.config) as cache:
            await cache.set("book", {"id": 1}, "old")  # base + 8 replicas
            full.arm(write_many=write_many_cancel_on_refusal)
            writer = asyncio.ensure_future(cache.set("book", {"id": 1}, "new"))
            (outcome,) = await asyncio.gather(writer, return_exceptions=True)
            assert isinstance(outcome, asyncio.CancelledError), outcome
            full.disarm()
            served = await full.served(cache)
            assert "old" not in served, served
    finally:
        await full.close()


WRITES = {  # each call of a set(), and the command its write is held at
    "set": (b"EVALSHA", lambda cache, value: cache.set("book", {"id": 1}, value)),
    "set_many": (
        b"MULTI",
        lambda cache, value: cache.set_many("book", [({"id": i}, value) for i in (1, 2)]),
    ),
}


@contextlib.asynccontextmanager
async def _proxied_writer(
    redis_url: str, prefix: str, how: str, ns: dict[str, Any] = NS
) -> AsyncIterator[tuple[ToxicProxy, LayeredCache, LayeredCache]]:
    """Instances a (through a proxy that can hold a command before Redis: a slow
    network) and b, both connected to the backplane; a's ``redis.timeout`` is 300 ms if
    its caller is to time out, else 5 s."""
    address = urlsplit(redis_url)
    proxy = await ToxicProxy(address.hostname or "127.0.0.1", address.port or 6379).start()
    proxied = redis_url.replace(f":{address.port}/", f":{proxy.port}/", 1)
    timeout = "300ms" if how == "timed_out" else "5s"
    try:
        async with (
            LayeredCache.from_config(make_config(proxied, prefix, ns, redis={"timeout": timeout}))
            as a,
            LayeredCache.from_config(make_config(redis_url, prefix, ns)) as b,
        ):
            await _connected(a, b)
            yield proxy, a, b
    finally:
        proxy.release.set()
        await proxy.stop()


async def _leave_held_write(proxy: ToxicProxy, writing: Awaitable[None], how: str) -> None:
    """``writing`` is sent, held by ``proxy`` before Redis, and its caller leaves:
    cancelled (a request's deadline) or timed out (``L2Unavailable``)."""
    writer = asyncio.ensure_future(writing)
    await asyncio.wait_for(proxy.holding.wait(), 5)  # the write is on its way
    if how == "cancelled":
        await asyncio.sleep(0.05)
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
    else:
        with pytest.raises(L2Unavailable):
            await writer


async def _landed(admin: Any, cache: LayeredCache, ids: Iterable[int], value: bytes) -> bool:
    for i in ids:
        raw = await admin.get(cache.key("book", {"id": i}))
        if raw is None or value not in raw:
            return False
    return True


@pytest.mark.parametrize("how", ["cancelled", "timed_out"])
@pytest.mark.parametrize("call", ["set", "set_many"])
async def test_a_set_that_lands_after_its_caller_left_on_a_stream_refusing_appends_still_reaches_the_other_l1(
    redis_url: str, prefix: str, call: str, how: str
) -> None:
    """README "Invalidation wins everywhere": "set() and invalidate() return only once
    the backplane entry is appended or, if Redis refuses the append after the L2 write
    ..., published on the pub/sub fallback channel", and "a write whose caller is
    cancelled or times out mid-way still completes what its first command began".

    Scenario: b holds "old" in L1; the stream's name holds a string (every XADD is
    refused: WRONGTYPE); a's set() is held before Redis and its caller leaves; then the
    write lands: the SETs land, the XADD is refused. Once, nobody announced it: with no
    reply read, the write counted as appended (``_Write.unannounced``), and b served
    "old" from L1 for its 60 s TTL. Now the write's append (set()'s script, or a
    transaction's EVAL of the same Lua) publishes a refused append on the fallback
    channel itself, in the same step, whenever it lands."""
    held_at, write = WRITES[call]
    ids = (1, 2) if call == "set_many" else (1,)
    admin = aioredis.Redis.from_url(redis_url)
    config = make_config(redis_url, prefix, NS)
    stream = config.redis.prefix + config.backplane.stream
    async with _proxied_writer(redis_url, prefix, how) as (proxy, a, b):
        try:
            await write(a, "old")
            for i in ids:
                assert await eventually(lambda i=i: _is(b, "old", fields={"id": i}), timeout=3)
            await admin.delete(stream)
            await admin.set(stream, "not a stream")  # every XADD now fails (WRONGTYPE)
            proxy.hold_at = held_at
            await _leave_held_write(proxy, write(a, "new"), how)
            proxy.release.set()  # the write reaches Redis: the SETs land, XADD refused
            assert await eventually(lambda: _landed(admin, a, ids, b"new"), timeout=3)
            for i in ids:
                assert await eventually(lambda i=i: _is(b, "new", fields={"id": i}), timeout=3)
        finally:
            await admin.delete(stream)
            await admin.aclose()


@pytest.mark.parametrize("how", ["cancelled", "timed_out"])
@pytest.mark.parametrize(
    ("call", "stream"),
    [("set", "appending"), ("set_many", "appending"), ("set", "refusing")],
)
async def test_a_set_that_lands_after_its_caller_left_leaves_no_replaced_value_in_the_writer_l1(
    redis_url: str, prefix: str, call: str, stream: str, how: str
) -> None:
    """README "Invalidation wins everywhere": a write whose caller is cancelled or times
    out mid-way "... once its caller was cancelled, leaves its own L1 empty";
    docs/operations.md ("Redis"): a set() that timed out "leaves its outcome unknown
    ...: this instance's L1 is left empty either way, so its next read goes to L2".

    Scenario: a (through a proxy) and b hold "old"; a's set("new") is held before Redis
    and its caller leaves; a read on a then fills "old" from L2 into a's L1; the write
    lands, with its backplane entry (or, the stream refusing it, its fallback message)
    naming a as its origin. Once, a's listener skipped it as "already applied locally"
    and a served "old" for its 60 s L1 TTL while L2 and b served "new". Now the keys of
    a write left unread are noted (``_unsettled``), and a's own entries naming them
    are applied as another instance's."""
    held_at, write = WRITES[call]
    ids = (1, 2) if call == "set_many" else (1,)
    admin = aioredis.Redis.from_url(redis_url)
    config = make_config(redis_url, prefix, NS)
    name = config.redis.prefix + config.backplane.stream
    async with _proxied_writer(redis_url, prefix, how) as (proxy, a, b):
        try:
            await write(a, "old")
            for i in ids:
                assert await eventually(lambda i=i: _is(b, "old", fields={"id": i}), timeout=3)
            if stream == "refusing":
                await admin.delete(name)
                await admin.set(name, "not a stream")  # every XADD now fails (WRONGTYPE)
            proxy.hold_at = held_at
            await _leave_held_write(proxy, write(a, "new"), how)
            for i in ids:  # read on a after its set() left: L2 still holds "old"
                assert await a.get("book", {"id": i}) == "old"
            proxy.release.set()  # the write reaches Redis now
            assert await eventually(lambda: _landed(admin, a, ids, b"new"), timeout=3)
            for i in ids:
                assert await eventually(lambda i=i: _is(a, "new", fields={"id": i}), timeout=3)
                assert await eventually(lambda i=i: _is(b, "new", fields={"id": i}), timeout=3)
        finally:
            await admin.delete(name)
            await admin.aclose()


HOT_NS = {"book": {**NS["book"], "hot": {"replicas": 3, "keys": ["book:1"]}}}
TRANSACTIONS = {  # the namespaces, the call (held at its MULTI), and the ids it writes
    "set_many": (NS, WRITES["set_many"][1], (1, 2)),
    "hot_set": (HOT_NS, WRITES["set"][1], (1,)),  # a hot key: its replicas, a transaction
}


@pytest.mark.parametrize("how", ["cancelled", "timed_out"])
@pytest.mark.parametrize("call", list(TRANSACTIONS))
async def test_a_transaction_write_that_lands_after_its_caller_left_on_a_refusing_stream_leaves_no_replaced_value_in_the_writer_l1(
    redis_url: str, prefix: str, call: str, how: str
) -> None:
    """docs/operations.md ("Redis"): a set() that timed out "... this instance's L1 is
    left empty either way, so its next read goes to L2, and a write that lands later
    (within 60 s) drops what such a read filled here"; README "Invalidation wins
    everywhere": "A single-node write whose caller left before its reply may land later
    still ...: for 60 s this instance applies its own entries naming those keys ..., so
    a read here in between keeps no replaced copy".

    Scenario (a transaction on a refusing stream): a's set_many("new"), or set() of a
    hot key (its replicas: a MULTI/EXEC too), is held before Redis (proxy at MULTI) and
    its caller leaves; the stream's name holds a string (XADD refused). A read on a
    then fills "old" from L2; the transaction lands: its SETs, and a refused append.
    Expected: a serves "new" soon. Happened: "old" from L1 for its 60 s TTL while L2
    held "new": a transaction whose reply nobody read was announced once, at once, in
    the background (``_Write.unannounced``), before it landed, and its refused XADD
    published nothing when it did land, so no entry naming the keys came after the
    read. Now its append is an EVAL of the set() script's own append
    (``APPEND_SCRIPT``), which publishes a refused entry on the fallback channel in the
    same step, whenever that lands."""
    ns, write, ids = TRANSACTIONS[call]
    admin = aioredis.Redis.from_url(redis_url)
    config = make_config(redis_url, prefix, NS)
    name = config.redis.prefix + config.backplane.stream
    async with _proxied_writer(redis_url, prefix, how, ns) as (proxy, a, b):
        try:
            await write(a, "old")
            for i in ids:
                assert await eventually(lambda i=i: _is(b, "old", fields={"id": i}), timeout=3)
            await admin.delete(name)
            await admin.set(name, "not a stream")  # every XADD now fails (WRONGTYPE)
            proxy.hold_at = b"MULTI"
            await _leave_held_write(proxy, write(a, "new"), how)
            await asyncio.sleep(0.3)  # an announcement sent now has gone round by then
            for i in ids:  # read on a after its write's caller left: L2 still holds "old"
                assert await a.get("book", {"id": i}) == "old"
            proxy.release.set()  # the write reaches Redis now: SETs land, XADD refused
            assert await eventually(lambda: _landed(admin, a, ids, b"new"), timeout=3)
            for i in ids:
                assert await eventually(
                    lambda i=i: _is(a, "new", fields={"id": i}), timeout=5
                ), f"a still serves {await a.get('book', {'id': i})!r}; L2 holds 'new'"
                assert await eventually(lambda i=i: _is(b, "new", fields={"id": i}), timeout=3)
        finally:
            await admin.delete(name)
            await admin.aclose()


def test_the_keys_of_writes_left_unread_are_awaited_for_a_window_and_past_the_bound_all_are() -> None:
    """``UnsettledWrites``: a key is applied from our own entries for ``WINDOW`` seconds
    after its write's caller left (noted again, from then). No more than ``MOST`` keys
    are held, and none is forgotten for it: a write that would note more switches to
    applying every entry of ours until the newest window ends (bounded memory, only
    extra L1 drops), then back to the noted keys."""
    now = [0.0]
    unsettled = UnsettledWrites(clock=lambda: now[0])
    assert not unsettled
    unsettled.add(["a", "b"])
    now[0] = UnsettledWrites.WINDOW / 2
    unsettled.add(["a"])  # a second write of "a" left unread
    now[0] = UnsettledWrites.WINDOW + 1
    assert unsettled.pick(["a", "b", "c"]) == ["a"]
    heard: list[list[str]] = []
    unsettled.heard(msgspec.msgpack.encode(["a", "c"]), heard.append)
    unsettled.heard(b"\xc1", heard.append)  # not msgpack: nothing of ours
    assert heard == [["a"]]
    now[0] = 2 * UnsettledWrites.WINDOW
    assert unsettled.pick(["a"]) == [] and not unsettled
    unsettled.add(["x"])
    now[0] += 1
    unsettled.add(str(i) for i in range(UnsettledWrites.MOST + 1))  # past the bound
    assert len(unsettled._until) <= UnsettledWrites.MOST
    assert unsettled.pick(["0", "x", "never noted"]) == ["0", "x", "never noted"]
    now[0] += UnsettledWrites.WINDOW / 2
    unsettled.add(["y"])  # while all are applied: until this write's window ends
    now[0] += UnsettledWrites.WINDOW / 2 + 1
    assert unsettled.pick(["0", "y"]) == ["0", "y"]
    now[0] += UnsettledWrites.WINDOW / 2
    assert unsettled.pick(["0", "y"]) == [] and not unsettled
    unsettled.add(["z"])  # back to noting keys
    assert unsettled.pick(["0", "z"]) == ["z"]


async def test_a_large_set_many_that_lands_after_its_caller_left_leaves_no_replaced_value_in_the_writer_l1(
    redis_url: str, prefix: str
) -> None:
    """README "Invalidation wins everywhere": "A single-node write whose caller left
    before its reply may land later still, with its backplane entry: for 60 s this
    instance applies its own entries naming those keys, as another instance's, so a
    read here in between keeps no replaced copy"; docs/operations.md: "a write that
    lands later (within 60 s) drops what such a read filled here".

    Scenario: a's set_many of ``MOST`` + 1 keys ("new") is held before Redis (proxy at
    its EXEC: a large transaction held at MULTI never landed whole) and its caller is
    cancelled; a read on a of the first key fills "old" from L2; the transaction lands
    with its backplane entry naming every key. Expected: a serves "new" for the first
    key. Happened: "old" from L1 for its 60 s TTL: ``UnsettledWrites.add`` kept at most
    ``MOST`` keys, dropping the oldest, so the first key of the set_many was forgotten
    by the same call that noted it, and ``heard`` skipped it. Now past the bound every
    entry of ours is applied for the window."""
    count = UnsettledWrites.MOST + 1
    admin = aioredis.Redis.from_url(redis_url)

    def write(cache: Any, value: str) -> Any:
        return cache.set_many("book", [({"id": i}, value) for i in range(count)])

    async with _proxied_writer(redis_url, prefix, "cancelled") as (proxy, a, _):
        try:
            await write(a, "old")
            assert a._backplane is not None
            seen = a._backplane.entries_seen
            proxy.hold_at = b"EXEC"  # everything before it reaches Redis (queued)
            await _leave_held_write(proxy, write(a, "new"), "cancelled")
            await asyncio.sleep(0.2)
            assert await a.get("book", {"id": 0}) == "old"  # L2 still holds "old"
            proxy.release.set()  # the transaction lands, with its entry
            assert await eventually(lambda: _landed(admin, a, (0, count - 1), b"new"), timeout=5)
            assert await eventually(lambda: _seen(a, seen + 1), timeout=5)
            assert await eventually(
                lambda: _is(a, "new", fields={"id": 0}), timeout=3
            ), f"a still serves {await a.get('book', {'id': 0})!r}; L2 holds 'new'"
        finally:
            await admin.aclose()


async def _seen(cache: LayeredCache, entries: int) -> bool:
    assert cache._backplane is not None
    return cache._backplane.entries_seen >= entries


async def test_a_set_refused_by_an_open_breaker_is_not_awaited_as_a_write_that_may_land(
    redis_url: str, prefix: str
) -> None:
    """``_unsettled``: only a write that was sent may land after its caller left. One an
    open breaker refused sent nothing; noted, a storm of them filled the record (and
    then every entry of ours is applied: needless L1 drops)."""
    async with LayeredCache.from_config(make_config(redis_url, prefix, NS)) as cache:
        for _ in range(cache._store.breaker._threshold):
            cache._store.breaker.failure()
        with pytest.raises(L2Unavailable, match="breaker"):
            await cache.set("book", {"id": 1}, "new")
        with pytest.raises(L2Unavailable, match="breaker"):
            await cache.set_many("book", [({"id": i}, "new") for i in (1, 2)])
        assert not cache._rt.unsettled


async def test_a_cluster_set_of_a_hot_key_whose_reservations_a_full_redis_refuses_drops_the_key(
    redis_cluster: Any, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster set() of a hot key first reserves the replica leases
    (``_replicas.write_many``): with Redis full (noeviction) that first step is refused,
    nothing is written, and the key is dropped everywhere, as a refused set() does: no
    reader serves the old value."""
    full = _FilledByTheReplicas(redis_cluster, prefix, monkeypatch)
    try:
        async with LayeredCache.from_config(full.config) as cache:
            await cache.set("book", {"id": 1}, "old")  # base + 8 replicas
            for master in full.masters:
                await master.config_set("maxmemory-policy", "noeviction")
                await master.config_set("maxmemory", 1)
            await cache.set("book", {"id": 1}, "new")  # refused: returns, the key dropped
            assert cache.stats()["book"]["refused_full"] == 1
            assert await full.served(cache) == {None}
    finally:
        await full.close()
