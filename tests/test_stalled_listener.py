"""A listener that is connected but stalled (a busy loop, a GC pause, a starved pod)
while entries it had not read were lost: trimmed by a writer with a smaller
``backplane.maxlen``, the stream emptied (``XTRIM MAXLEN 0``), or deleted (eviction) and
created anew. Its position tests need the position before the loss, and it had read
past it by the time it looked; counting entries (``_stream_count``) finds the loss at
the first count after entries flow again, and L1 is cleared. Found by an adversarial
review (2026-12-05); each test failed before."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from layered_cache import LayeredCache
from layered_cache._stream_count import EntryCount
from tests.helpers import CountingLoader, eventually, in_l1, make_config, stall_listener

_NAMESPACES = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}


@contextlib.asynccontextmanager
async def _pair(
    redis_url: str, prefix: str, a_backplane: dict[str, Any], b_backplane: dict[str, Any]
) -> AsyncIterator[tuple[LayeredCache, LayeredCache]]:
    a_config = make_config(redis_url, prefix, _NAMESPACES, backplane={"block": "200ms", **a_backplane})
    b_config = make_config(redis_url, prefix, _NAMESPACES, backplane={"block": "200ms", **b_backplane})
    async with LayeredCache.from_config(a_config) as a, LayeredCache.from_config(b_config) as b:
        assert a._backplane is not None and b._backplane is not None
        assert await eventually(a._backplane.connected.is_set)
        assert await eventually(b._backplane.connected.is_set)
        yield a, b


async def test_a_stalled_listener_sees_a_trim_by_a_writer_with_a_smaller_maxlen(
    redis_url: str, prefix: str
) -> None:
    """Was broken (a review, 2026-12-05): "one that fell behind the stream's retention (disconnected, or connected
    but stalled) ... clears its whole L1".

    Instance A (or the daemon) appends with ``backplane.maxlen = 10``; instance B runs
    the default 100,000. Nothing checks that the fleet agrees on maxlen (hot.replicas is
    checked at start-up, maxlen isn't). B stalls briefly; A's burst trims the stream past
    B's position. B's next XREAD returns < 1,000 entries, below B's
    ``trim_visible = min(batch, its own maxlen)``, so B never runs the XINFO gap check.
    Observed: B keeps book 2 (invalidated by A, entry trimmed unread) in L1 with
    gaps == 0. Expected: B detects the trim and clears L1.
    Cause: _stream.trim_visible / BackplaneListener._read_once trust the local maxlen."""
    async with _pair(redis_url, prefix, {"maxlen": 10}, {}) as (a, b):
        for book_id in (1, 2):
            await b.get_or_load("book", {"id": book_id}, CountingLoader(f"v{book_id}"))
        gate = stall_listener(b)
        await a.invalidate("book", {"id": 1})  # ends the XREAD B was blocked in
        assert await eventually(lambda: not in_l1(b, 1), timeout=5)
        await a.invalidate("book", {"id": 2})  # B is held at the gate: unread
        for book_id in range(1000, 1300):
            await a.invalidate("book", {"id": book_id})
        length = await a._store.client.xlen(prefix + a.config.backplane.stream)
        assert length < 300
        gate.set()
        await asyncio.sleep(1.0)
        assert b._backplane is not None
        assert not in_l1(b, 2), (
            f"B serves book 2 from L1 after its invalidation was trimmed unread "
            f"(gaps={b._backplane.gaps}, stream length {length})"
        )
        assert await b.get("book", {"id": 2}) is None


async def _stalled_listener_then(redis_url: str, prefix: str, wipe: str) -> None:
    async with _pair(redis_url, prefix, {}, {}) as (a, b):
        for book_id in (1, 2):
            await b.get_or_load("book", {"id": book_id}, CountingLoader(f"v{book_id}"))
        gate = stall_listener(b)
        await a.invalidate("book", {"id": 1})
        assert await eventually(lambda: not in_l1(b, 1), timeout=5)
        await a.invalidate("book", {"id": 2})  # B is held at the gate: unread
        stream = prefix + a.config.backplane.stream
        admin = aioredis.from_url(redis_url)
        try:
            if wipe == "del":
                await admin.delete(stream)  # an eviction (allkeys-*), an operator's DEL
            else:
                await admin.xtrim(stream, maxlen=0, approximate=False)
        finally:
            await admin.aclose()
        gate.set()
        await asyncio.sleep(0.5)
        await a.invalidate("book", {"id": 3})  # life goes on: new entries, read by B
        await asyncio.sleep(0.5)
        assert b._backplane is not None
        assert not in_l1(b, 2), (
            f"B serves book 2 from L1 although its invalidation was removed unread "
            f"({wipe}); gaps={b._backplane.gaps}"
        )


async def test_a_stalled_listener_sees_the_stream_emptied_under_it(
    redis_url: str, prefix: str
) -> None:
    """Was broken (a review, 2026-12-05): "... or finds the stream deleted or emptied (`XTRIM MAXLEN 0`), clears
    its whole L1".

    B's listener is connected but behind (held before its XREAD: a busy loop) when the
    stream is emptied with an unread entry for book 2. Its next XREAD after its old
    position just blocks (nothing newer) and later returns A's newer entries: a read
    shorter than ``trim_visible`` never runs the XINFO check, and an empty idle read
    checks only for IDs in the future. Observed: book 2 stays in B's L1 (gaps == 0).
    Expected: L1 cleared, as on the reconnect path (``_check_gap``)."""
    await _stalled_listener_then(redis_url, prefix, "xtrim0")


async def test_a_stalled_listener_sees_the_stream_deleted_and_created_anew(
    redis_url: str, prefix: str
) -> None:
    """Was broken (a review, 2026-12-05): "... or finds the stream deleted ... clears its whole L1".

    As above with the stream key deleted (evicted by an ``allkeys-*`` policy on a cache
    Redis, or DEL by an operator) and re-created by A's next invalidation. Observed:
    book 2 (its entry deleted unread) stays in B's L1, gaps == 0. Expected: L1 cleared.
    Cause: BackplaneListener._read_once checks for a gap only after a read of
    >= trim_visible entries or when idle at a future ID; a stream that was re-created
    (entries-added / first-entry / a missing key seen while reading) is not checked."""
    await _stalled_listener_then(redis_url, prefix, "del")


async def test_a_stalled_listener_sees_the_stream_emptied_under_it_after_an_earlier_l1_clear(
    redis_url: str, prefix: str
) -> None:
    """Was broken (a review, 2026-12-07): the same promise, for a listener that had
    cleared L1 once before (here: the stream evicted while its connection dropped).

    The clear dropped the entry count's mark (what was lost before it is covered), and a
    new one was taken only at a caught-up count after an entry was read: an idle
    listener had none. Stalled later while an unread entry was emptied away, it took its
    first mark after the loss and never saw it. Observed: book 1 (set to v2 by A, its
    entry emptied unread) served as v1 from B's L1, no second gap. Expected: L1
    cleared. Cause: ``EntryCount.forget`` left no mark until entries flowed."""
    async with _pair(redis_url, prefix, {}, {}) as (a, b):
        listener, stream = b._backplane, prefix + a.config.backplane.stream
        assert listener is not None
        admin = aioredis.from_url(redis_url)
        try:
            await admin.delete(stream)  # an earlier incident, seen on reconnect: a clear
            for client in await admin.client_list():
                if client["cmd"] == "xread":
                    await admin.client_kill_filter(_id=client["id"])
            assert await eventually(lambda: listener.gaps >= 1, timeout=5)
            assert await eventually(listener.connected.is_set, timeout=5)
            await asyncio.sleep(0.5)  # B reads on, idle: nothing appended since
            gate = stall_listener(b)
            await asyncio.sleep(0.5)  # B is held at its next XREAD
            assert await b.get_or_load("book", {"id": 1}, CountingLoader("v1")) == "v1"
            await a.set("book", {"id": 1}, "v2")
            await admin.xtrim(stream, maxlen=0, approximate=False)
        finally:
            await admin.aclose()
        await a.set("book", {"id": 2}, "x")  # entries flow again
        gate.set()
        await asyncio.sleep(1.0)
        await a.set("book", {"id": 3}, "y")  # more entries, more counts
        await asyncio.sleep(1.0)
        served = await b.get("book", {"id": 1})
        assert served == "v2" or not in_l1(b, 1), (
            f"B serves book 1 = {served!r} from L1 though A set v2 and its entry was "
            f"emptied unread while B stalled (gaps={listener.gaps})"
        )


class _Stream:
    """What ``EntryCount`` asks of a link: the stream's XINFO, or "no such key"."""

    def __init__(self) -> None:
        self.info_reply: dict[str, Any] | None = None

    async def info(self) -> dict[str, Any]:
        if self.info_reply is None:
            raise ResponseError("ERR no such key")
        return self.info_reply


async def test_entries_that_make_a_deleted_stream_anew_are_counted_at_once() -> None:
    """The CI caught it twice (``test_a_stalled_listener_sees_the_stream_deleted_and_created_anew``):
    the mark taken at the start held back the count of the first entry read (one pace
    for both), so the empty XREAD after the stream's deletion counted instead, found
    the stream gone and held the next count back a pace: the entry that made the stream
    anew, read just after, went uncounted until the next XREAD's BLOCK ended, and L1
    kept what the deleted entries invalidated that much longer. The steps of that run,
    in order, against a stand-in for the stream."""
    stream, every = _Stream(), 0.05
    count = EntryCount(stream, every=every)
    stream.info_reply = {"entries-added": 1, "last-generated-id": b"1-0"}
    await count.settle(b"1-0", 0)  # the start: a mark at the marker entry
    stream.info_reply = {"entries-added": 2, "last-generated-id": b"2-0"}
    assert not await count.lost(b"2-0", 1)  # entry 2 read at once: nothing lost
    await asyncio.sleep(every * 1.5)
    stream.info_reply = None  # deleted, entry 3 with it, unread
    assert not await count.lost(b"2-0", 1)  # an empty XREAD: nothing read since
    stream.info_reply = {"entries-added": 1, "last-generated-id": b"9-0"}
    assert await count.lost(b"9-0", 2), "entry 9 made the stream anew: not counted at once"
