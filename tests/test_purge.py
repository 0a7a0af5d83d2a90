"""The purge queue (layered_cache._purges) around a purger, with a real Redis: a slow,
hanging or failing HTTP cache never blocks ``invalidate()``; undeliverable purges are
retried, then counted; a full queue drops and counts. (Against a real Varnish:
tests/test_varnish.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from layered_cache import LayeredCache, parse_config
from layered_cache._purges import PurgeQueue
from layered_cache.prometheus import register_cache, render_metrics
from layered_cache.purge import VarnishPurger
from tests.helpers import eventually
from tests.servers import free_port

pytestmark = pytest.mark.timeout(60)


class Recording:
    def __init__(self, fail: int = 0, hang: bool = False) -> None:
        self.calls: list[tuple[list[str], list[str]]] = []
        self.fail, self.hang = fail, hang

    async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
        self.calls.append((list(keys), list(tags)))
        if self.hang:
            await asyncio.Event().wait()
        if self.fail:
            self.fail -= 1
            raise ConnectionError("gateway down")


def _cache(redis_url: str, prefix: str, purger: Recording, **purge: object) -> LayeredCache:
    config = parse_config(
        {
            "redis": {"url": redis_url, "prefix": prefix, "timeout": "2s"},
            "purge": {"repeat_after": "0s", **purge},
            "namespaces": {
                "book": {"key": "book:{id}"},
                "category": {"key": "category:{slug}", "tags": True},
            },
        },
        env={},
    )
    return LayeredCache.from_config(config, purger=purger)


async def test_invalidate_invalidate_tag_and_set_purge_the_key_or_tag_in_the_background(
    redis_url: str, prefix: str
) -> None:
    purger = Recording()
    async with _cache(redis_url, prefix, purger) as cache:
        await cache.invalidate("book", {"id": 1})
        await cache.invalidate_tag("book:1")
        await cache.set("book", {"id": 2}, {"price": "9.90"})
        assert await eventually(lambda: len(purger.calls) == 3)
        key1, key2 = cache.key("book", {"id": 1}), cache.key("book", {"id": 2})
        assert purger.calls == [([key1], []), ([], ["book:1"]), ([key2], [])]
        assert cache.purge_stats().delivered == 3


async def test_a_hanging_gateway_never_blocks_invalidate_and_a_full_queue_drops_and_counts(
    redis_url: str, prefix: str
) -> None:
    purger = Recording(hang=True)
    async with _cache(redis_url, prefix, purger, queue=5) as cache:
        await cache.get_or_load("book", {"id": 1}, lambda: asyncio.sleep(0, "v"))
        # 50 invalidations with a purge that never returns: each completes on its own.
        for i in range(50):
            await asyncio.wait_for(cache.invalidate("book", {"id": i}), 10)
        assert await cache.get("book", {"id": 1}) is None  # the key itself is gone
        stats = cache.purge_stats()
        assert stats.submitted == 50 and stats.dropped >= 50 - 5 - 1 and stats.delivered == 0


class _HangsOnce(Recording):
    """A CDN API that never answers one request (no timeout of its own), then does."""

    async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
        self.calls.append((list(keys), list(tags)))
        if len(self.calls) == 1:
            await asyncio.Event().wait()


async def test_a_purger_of_our_own_that_never_answers_is_cut_off_at_the_timeout_and_retried(
    redis_url: str, prefix: str
) -> None:
    """``purge.timeout`` bounded only the Varnish purger's requests: a purger given
    to ``from_config`` that never answered held its queue's only worker for good, and
    every later purge waited behind it until the queue was full, then was dropped."""
    purger = _HangsOnce()
    async with _cache(redis_url, prefix, purger, timeout="200ms") as cache:
        await cache.invalidate("book", {"id": 1})
        assert await eventually(lambda: cache.purge_stats().delivered == 1, timeout=5)
        assert len(purger.calls) == 2 and cache.purge_stats().retries == 1


async def test_an_undeliverable_purge_is_retried_then_counted_as_failed(
    redis_url: str, prefix: str
) -> None:
    purger = Recording(fail=100)
    async with _cache(redis_url, prefix, purger, retries=2) as cache:
        await cache.invalidate("book", {"id": 1})
        assert await eventually(lambda: cache.purge_stats().failed == 1, timeout=10)
        assert len(purger.calls) == 3 and cache.purge_stats().retries == 2
        purger.fail = 1  # one failure, then the gateway is back: delivered on the retry
        await cache.invalidate("book", {"id": 2})
        assert await eventually(lambda: cache.purge_stats().delivered == 1, timeout=10)
        registry = CollectorRegistry()
        register_cache(cache, registry)
        body = render_metrics(registry)[0].decode()
        for outcome, value in (("failed", 1.0), ("delivered", 1.0), ("retries", 3.0)):
            line = f'layered_cache_http_purges_total{{instance="{cache.instance_id}",'
            assert f'{line}outcome="{outcome}"}} {value}' in body, body


async def test_the_varnish_purger_to_a_gateway_that_is_down_fails_and_counts() -> None:
    purger = VarnishPurger([f"http://127.0.0.1:{free_port()}"], timeout=0.5)
    queue = PurgeQueue(purger, retries=1, backoff=[0.01], owned=True)
    queue.submit(["book:1"], ["book:1"])
    await asyncio.wait_for(queue.drain(), 10)
    assert queue.stats.failed == 2 and queue.stats.retries == 1
    await queue.close()


async def test_each_purge_is_sent_again_after_repeat_after() -> None:
    purger = Recording()
    queue = PurgeQueue(purger, repeat_after=0.05)
    queue.submit(["book:1"])
    assert await eventually(lambda: len(purger.calls) == 2, timeout=5)
    await asyncio.sleep(0.2)
    assert len(purger.calls) == 2  # once more, not forever
    await queue.close()
    assert queue.stats.delivered == 1 and queue.stats.repeated == 1  # counters add up
    assert queue.stats.submitted == queue.stats.delivered


async def test_a_repeat_still_waiting_when_the_queue_closes_is_dropped() -> None:
    purger = Recording()
    queue = PurgeQueue(purger, repeat_after=0.2)
    queue.submit(["book:1"])
    assert await eventually(lambda: len(purger.calls) == 1, timeout=5)
    await queue.close()
    await asyncio.sleep(0.3)  # the repeat's time came: nothing is queued after close
    assert len(purger.calls) == 1 and queue._queue.qsize() == 0


async def test_a_gateway_that_trickles_its_answer_fails_the_purge_within_the_timeout() -> None:
    """httpx's timeout bounds each read: a gateway sending one byte every 0.2 s held the
    purge (and every purge queued after it) for ever, counted nowhere."""

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        with contextlib.suppress(ConnectionError):
            while True:
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(0.2)

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    purger = VarnishPurger([f"http://127.0.0.1:{port}"], timeout=0.5)
    queue = PurgeQueue(purger, retries=1, backoff=[0.01], owned=True)
    queue.submit(["book:1"])
    queue.submit(["book:2"])
    await asyncio.wait_for(queue.drain(), 10)
    assert queue.stats.failed == 2 and queue.stats.delivered == 0
    await queue.close()
    server.close()


async def test_a_tag_invalidate_tag_refuses_is_never_purged(
    redis_url: str, prefix: str
) -> None:
    """A refused tag reached the gateway's BAN: ``|`` as ``obj.http.X-Cache-Tags ~ ,|,``
    banned every tagged page in a real Varnish."""
    purger = Recording()
    async with _cache(redis_url, prefix, purger) as cache:
        for tag in ("|", "a b", "a,b", "a*", "(a"):
            with pytest.raises(ValueError, match="tag"):
                await cache.invalidate_tag(tag)
        await cache._rt.purges.drain()
    assert purger.calls == []


async def test_a_set_cancelled_after_its_write_still_purges(redis_url: str, prefix: str) -> None:
    purger = Recording()
    async with _cache(redis_url, prefix, purger) as cache:
        for turns in range(12):
            task = asyncio.create_task(cache.set("book", {"id": turns}, "new"))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await cache._rt.purges.drain()
        purged = {key for keys, _ in purger.calls for key in keys}
        for turns in range(12):
            if await cache.get("book", {"id": turns}) == "new":  # the write landed
                assert cache.key("book", {"id": turns}) in purged, turns


async def test_purges_still_queued_when_the_queue_closes_are_counted_as_dropped() -> None:
    """A slow gateway and a close (``LayeredCache.close`` gives the queue 1 s): the purge
    in flight and the queued ones vanished, neither delivered, failed nor dropped, and
    unlogged. Every submitted purge is now accounted for."""
    purger = Recording(hang=True)
    queue = PurgeQueue(purger, repeat_after=0.0)
    for book_id in range(6):
        queue.submit([f"book:{book_id}"])
    assert await eventually(lambda: len(purger.calls) == 1, timeout=5)
    await queue.close(grace=0.1)
    stats = queue.stats
    assert stats.submitted == 6 and stats.delivered == 0
    assert stats.dropped == 6  # one in flight, five queued


# -- a repeat is the second purge of one submitted: never a second outcome for it -------


class FirstOnly:
    """A gateway that accepts the first purge and then goes down."""

    def __init__(self) -> None:
        self.calls = 0

    async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("gateway down")


def _outcomes(queue: PurgeQueue) -> int:
    return queue.stats.delivered + queue.stats.failed + queue.stats.dropped


async def test_a_delivered_purge_whose_repeat_fails_is_not_counted_as_failed_too() -> None:
    """docs/metrics.md: ``delivered + failed + dropped`` add up to ``submitted``. A
    purge the gateway took, whose repeat failed, was counted delivered *and* failed: an
    alert on ``failed`` reported a purge lost that was delivered."""
    gateway = FirstOnly()
    queue = PurgeQueue(gateway, retries=0, backoff=[0.01], repeat_after=0.05)
    queue.submit(["shop:book:1"])
    assert await eventually(lambda: gateway.calls == 2, timeout=5)  # the repeat, failing
    await queue.drain()
    await queue.close()
    assert queue.stats.failed == 0 and _outcomes(queue) == queue.stats.submitted == 1, (
        queue.stats
    )


async def test_a_repeat_still_waiting_at_close_is_not_counted_as_a_dropped_purge() -> None:
    """The same sum at close: the key and tag were delivered; their repeat, not due
    yet, was counted dropped as well."""
    queue = PurgeQueue(Recording(), repeat_after=30.0)
    queue.submit(["shop:book:1"], ["book:1"])
    await queue.drain()
    await queue.close(grace=0.1)
    assert queue.stats.dropped == 0 and _outcomes(queue) == queue.stats.submitted == 2, (
        queue.stats
    )


async def test_a_repeat_a_full_queue_refuses_is_not_counted_as_a_dropped_purge() -> None:
    """Room for one purge: book:2 hangs at the gateway (then is left at close, dropped)
    when book:1's repeat is due. The repeat is refused, but book:1 was delivered: only
    book:2 counts as dropped."""

    class HangsOnBook2(Recording):
        async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
            self.calls.append((list(keys), list(tags)))
            if "book:2" in keys:
                await asyncio.Event().wait()

    gateway = HangsOnBook2()
    queue = PurgeQueue(gateway, max_pending=1, repeat_after=0.2)
    queue.submit(["book:1"])
    assert await eventually(lambda: len(gateway.calls) == 1, timeout=5)
    queue.submit(["book:2"])
    assert await eventually(lambda: len(gateway.calls) == 2, timeout=5)
    await asyncio.sleep(0.4)  # book:1's repeat came due and found the queue full
    await queue.close(grace=0.1)
    stats = queue.stats
    assert (stats.delivered, stats.dropped) == (1, 1) and _outcomes(queue) == 2, stats


class NeverAnswers:
    def __init__(self) -> None:
        self.calls = 0

    async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
        self.calls += 1
        await asyncio.Event().wait()  # a gateway that never answers


async def test_purges_a_close_cut_short_leaves_are_counted_as_dropped(
    redis_url: str, prefix: str
) -> None:
    """Found by a review (2026-12-06). docs/http.md: purges still queued or in flight
    when the cache closes are dropped, "logged and counted in cache.purge_stats()".
    Happened: a close() cut short by its caller's deadline (a lifespan's shutdown
    timeout) left both uncounted: the cancel ended close() before it counted them."""
    purger = NeverAnswers()
    config = parse_config(
        {
            "redis": {"url": redis_url, "prefix": prefix, "timeout": "2s"},
            "purge": {"repeat_after": "0s", "timeout": "10s"},
            "namespaces": {"book": {"key": "book:{id}"}},
        },
        env={},
    )
    cache = LayeredCache.from_config(config, purger=purger)
    await cache.start()
    await cache.invalidate("book", {"id": 1})
    await cache.invalidate("book", {"id": 2})  # queued behind the first, in flight
    assert await eventually(lambda: purger.calls == 1, timeout=5)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(cache.close(), 0.3)  # the lifespan's shutdown deadline
    stats = cache.purge_stats()
    assert stats.submitted == 2
    assert stats.delivered + stats.failed + stats.dropped == stats.submitted, stats


class Aborted(BaseException):
    """Like gevent's GreenletExit: a BaseException, not an Exception."""


class AbortsOnce:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[str]]] = []

    async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
        self.calls.append((list(keys), list(tags)))
        if len(self.calls) == 1:
            raise Aborted("the CDN client's greenlet was killed")


async def test_a_purger_raising_a_base_exception_fails_that_purge_and_later_ones_go_out(
    redis_url: str, prefix: str
) -> None:
    """Found by a review (2026-12-06). docs/http.md: a purger's error fails that purge.
    A purger raising a BaseException that is not an Exception (gevent's GreenletExit)
    ended the queue's only worker: every later purge waited for ever, counted nowhere,
    and close() raised it."""
    purger = AbortsOnce()
    config = parse_config(
        {
            "redis": {"url": redis_url, "prefix": prefix, "timeout": "2s"},
            "purge": {"repeat_after": "0s", "retries": 0},
            "namespaces": {"book": {"key": "book:{id}"}},
        },
        env={},
    )
    cache = LayeredCache.from_config(config, purger=purger)
    await cache.start()
    try:
        await cache.invalidate("book", {"id": 1})  # its purge: the purger aborts
        await asyncio.sleep(0.2)
        await cache.invalidate("book", {"id": 2})  # a later change: must still go out
        delivered = await eventually(
            lambda: any(keys == [cache.key("book", {"id": 2})] for keys, _ in purger.calls),
            timeout=5,
        )
        stats = cache.purge_stats()
    finally:
        try:
            await cache.close()
            closed: BaseException | None = None
        except BaseException as exc:  # what close() raised is checked below
            closed = exc
    assert delivered, f"the second purge never reached the purger: {purger.calls}, {stats}"
    assert stats.delivered + stats.failed + stats.dropped == stats.submitted, stats
    assert closed is None, f"close() raised the dead worker's {closed!r}"
