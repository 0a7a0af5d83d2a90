"""Invalidations lost on their way to an instance, and what it does about them: an
entry the stream lost before a new instance read anything (deleted, emptied, trimmed
by a writer with a smaller maxlen), a fallback message or a stream entry in a format
it can't read. Each must clear L1 rather than leave copies the lost entries named
(README "How it works": a connected instance's L1 is stale at most the backplane's
latency; DESIGN.md "Invalidation wins everywhere"; docs/operations.md)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from layered_cache import LayeredCache
from layered_cache._fallback import fallback_channel
from tests.helpers import CountingLoader, eventually, in_l1, make_config, stall_listener

_NAMESPACES = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}


@contextlib.asynccontextmanager
async def _pair(
    redis_url: str, prefix: str, a_backplane: dict[str, Any], b_backplane: dict[str, Any]
) -> AsyncIterator[tuple[LayeredCache, LayeredCache]]:
    a_config = make_config(
        redis_url, prefix, _NAMESPACES, backplane={"block": "200ms", **a_backplane}
    )
    b_config = make_config(
        redis_url, prefix, _NAMESPACES, backplane={"block": "200ms", **b_backplane}
    )
    async with LayeredCache.from_config(a_config) as a, LayeredCache.from_config(b_config) as b:
        assert a._backplane is not None and b._backplane is not None
        assert await eventually(a._backplane.connected.is_set)
        assert await eventually(b._backplane.connected.is_set)
        yield a, b


async def _wipe(redis_url: str, stream: str, how: str, a: LayeredCache) -> None:
    if how == "smaller_maxlen":
        # A writer (another instance, the daemon) configured with backplane.maxlen = 10:
        # its burst trims the stream past B's unread entry.
        for book_id in range(1000, 1300):
            await a.invalidate("book", {"id": book_id})
        return
    admin = aioredis.from_url(redis_url)
    try:
        if how == "del":
            await admin.delete(stream)  # evicted (allkeys-*), an operator's DEL
        else:
            await admin.xtrim(stream, maxlen=0, approximate=False)
    finally:
        await admin.aclose()


@pytest.mark.parametrize("how", ["del", "xtrim0", "smaller_maxlen"])
async def test_a_new_instance_whose_first_unread_entry_is_lost_still_clears_l1(
    redis_url: str, prefix: str, how: str
) -> None:
    """A freshly started instance B (it has read no entry yet: "an instance started while
    invalidations are in flight") fills book 2, and its listener is held for a moment
    (a busy loop) while A invalidates book 2 and that entry is lost unread: the stream
    evicted and created anew, emptied, or trimmed by a writer with a smaller maxlen.
    The same losses are caught for an instance that had read an entry before
    (tests/test_stalled_listener.py); here B's entry count has no mark yet
    (``EntryCount.lost`` only records one at its first count), so the loss passes
    unseen and B serves book 2's old value for its whole L1 TTL (60 s)."""
    a_backplane = {"maxlen": 10} if how == "smaller_maxlen" else {}
    async with _pair(redis_url, prefix, a_backplane, {}) as (a, b):
        assert b._backplane is not None and b._backplane.entries_seen == 0
        await b.get_or_load("book", {"id": 2}, CountingLoader("old"))
        gate = stall_listener(b)
        await asyncio.sleep(0.5)  # B's blocked XREAD times out; the next one waits at the gate
        await a.invalidate("book", {"id": 2})  # unread by B
        await _wipe(redis_url, prefix + a.config.backplane.stream, how, a)
        await a.invalidate("book", {"id": 3})  # life goes on: a new entry, read by B
        gate.set()
        await asyncio.sleep(1.0)
        assert not in_l1(b, 2), (
            f"B serves book 2 from L1 although its invalidation was lost unread ({how}); "
            f"gaps={b._backplane.gaps}"
        )
        assert await b.get("book", {"id": 2}) is None



@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # not msgpack at all
        msgspec.msgpack.encode({"keys": [["book:2", 2]]}),  # another version's format
        msgspec.json.encode({"keys": ["book:2"]}),  # another client's JSON
    ],
    ids=["garbage", "other_format", "json"],
)
async def test_a_fallback_message_that_cannot_be_decoded_clears_l1(
    redis_url: str, prefix: str, raw: bytes
) -> None:
    """The stream's listener clears L1 on an entry it can't decode ("An entry whose
    ``keys`` or ``tags`` can't be decoded (another version's format, a forged entry)
    clears L1 too, rather than keep what it named", docs/operations.md;
    ``BackplaneListener._unreadable``). The fallback channel carries the same
    invalidations when the stream refuses them, but ``FallbackSubscriber._apply`` only
    logs ``backplane_bad_fallback_message`` and keeps L1: B serves book 2 for its whole
    L1 TTL after an invalidation it received and could not read."""
    async with _pair(redis_url, prefix, {}, {}) as (_a, b):
        fallback = b._fallback
        assert fallback is not None
        assert await eventually(fallback.subscribed.is_set)
        await b.get_or_load("book", {"id": 2}, CountingLoader("old"))
        admin = aioredis.from_url(redis_url)
        try:
            receivers = await admin.publish(fallback_channel(prefix + b.config.backplane.stream), raw)
        finally:
            await admin.aclose()
        assert receivers >= 1
        await asyncio.sleep(0.5)
        assert not in_l1(b, 2), "B kept its L1 after a fallback message it could not decode"


@pytest.mark.parametrize("field", ["key", "keys_v2"])
async def test_an_entry_in_another_format_without_a_keys_field_clears_l1(
    redis_url: str, prefix: str, field: str
) -> None:
    """docs/operations.md: "An entry whose ``keys`` or ``tags`` can't be decoded
    (another version's format, a forged entry) clears L1 too, rather than keep what it
    named." An entry that names its keys under another field (a newer version's
    layout, another client writing the stream) can't be decoded either, but
    ``BackplaneListener._read_once`` reads it as a start marker (no ``keys``: skipped)
    and B keeps book 2, which the entry names, for its whole L1 TTL. A marker is
    ``origin`` alone; anything else without ``keys``/``tags`` is not one."""
    async with _pair(redis_url, prefix, {}, {}) as (_a, b):
        assert b._backplane is not None
        await b.get_or_load("book", {"id": 2}, CountingLoader("old"))
        key = b.key("book", {"id": 2})
        admin = aioredis.from_url(redis_url)
        try:
            await admin.xadd(
                prefix + b.config.backplane.stream,
                {field: msgspec.msgpack.encode([key]), "origin": "other-client"},
            )
        finally:
            await admin.aclose()
        assert await eventually(lambda: b._backplane.entries_seen >= 1, timeout=5)  # type: ignore[union-attr]
        await asyncio.sleep(0.3)
        assert not in_l1(b, 2), (
            f"B read an entry it could not interpret ({field!r}) and kept book 2 in L1; "
            f"gaps={b._backplane.gaps}"
        )


async def test_an_undecodable_fallback_message_counts_as_a_whole_l1_clear_not_as_a_bug(
    redis_url: str, prefix: str
) -> None:
    """5498a41 counts an undecodable fallback message (another version's format in a
    rolling upgrade, or anyone's PUBLISH on the channel) in ``errors``, which
    docs/metrics.md defines as "bugs ... logged as backplane_fallback_error with the
    traceback ... Any increase is a bug to report" and pages on
    (``increase(layered_cache_backplane_errors_total[15m]) > 0``: "the backplane
    listener met a bug"). Its stream twin, an undecodable entry, is counted where
    metrics.md puts whole-L1 clears, ``gaps`` (``_unreadable`` -> ``_gap``), with
    ``errors`` untouched. Same event, two counters; one of them a false bug alert."""
    config = make_config(redis_url, prefix, _NAMESPACES, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as cache:
        assert cache._fallback is not None
        assert await eventually(cache._fallback.subscribed.is_set)
        await cache.get_or_load("book", {"id": 2}, CountingLoader("old"))
        admin = aioredis.from_url(redis_url)
        try:
            channel = fallback_channel(prefix + cache.config.backplane.stream)
            assert await admin.publish(channel, b"\xc1not msgpack") >= 1
        finally:
            await admin.aclose()
        assert await eventually(lambda: not in_l1(cache, 2), timeout=3)
        status = cache.backplane_status()
        assert status is not None
        assert (status.gaps, status.errors) == (1, 0), (
            f"an unreadable message is not a bug, it is a whole-L1 clear: {status}"
        )
