"""The L1 backplane across a real network cut: catch up from the last ID, or clear L1
when the stream was trimmed past it.

Instance B talks to Redis through a TCP proxy the test can cut (live connections reset,
new ones refused), so only B is disconnected while instance A keeps invalidating.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from layered_cache import LayeredCache
from layered_cache._fallback import FallbackMessage, fallback_channel
from tests.helpers import CountingLoader, eventually, in_l1, make_config, stall_listener
from tests.servers import RedisServer


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to Redis until ``cut()``; ``restore()`` lets clients back."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._open = True
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()

    def cut(self) -> None:
        self._open = False
        for writer in list(self._writers):
            writer.transport.abort()  # RST: the client sees the connection die at once
        self._writers.clear()

    def restore(self) -> None:
        self._open = True

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._open:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        with contextlib.suppress(asyncio.CancelledError):  # the loop shutting down
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()
        self._writers.discard(writer)


def _host_port(url: str) -> tuple[str, int]:
    hostport = url.split("//", 1)[1].split("@")[-1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    return host, int(port)


@contextlib.asynccontextmanager
async def two_instances(
    redis_url: str, prefix: str, **backplane: Any
) -> AsyncIterator[tuple[LayeredCache, LayeredCache, CuttableProxy]]:
    """A (direct) and B (behind the proxy); long L1 TTLs so only invalidations remove."""
    proxy = CuttableProxy(*_host_port(redis_url))
    await proxy.start()
    namespaces = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}
    sections = {"backplane": {"block": "200ms", **backplane}}
    a_config = make_config(redis_url, prefix, namespaces, **sections)
    b_url = f"redis://127.0.0.1:{proxy.port}/0"
    b_config = make_config(b_url, prefix, namespaces, **sections)
    try:
        async with LayeredCache.from_config(a_config) as a, LayeredCache.from_config(b_config) as b:
            assert a._backplane is not None and b._backplane is not None
            assert await eventually(a._backplane.connected.is_set)
            assert await eventually(b._backplane.connected.is_set)
            yield a, b, proxy
    finally:
        await proxy.close()


async def cut_off(b: LayeredCache, proxy: CuttableProxy) -> None:
    proxy.cut()
    assert b._backplane is not None
    assert await eventually(lambda: not b._backplane.connected.is_set(), timeout=5)  # type: ignore[union-attr]


async def test_disconnected_instance_catches_up_on_reconnect(redis_url: str, prefix: str) -> None:
    async with two_instances(redis_url, prefix) as (a, b, proxy):
        for book_id in [*range(20), 99]:
            await b.get_or_load("book", {"id": book_id}, CountingLoader(f"v{book_id}"))
        await cut_off(b, proxy)

        for book_id in range(20):
            await a.invalidate("book", {"id": book_id})
        assert all(in_l1(b, i) for i in range(20))  # B can't have heard yet

        proxy.restore()
        assert await eventually(lambda: not any(in_l1(b, i) for i in range(20)), timeout=5)
        assert in_l1(b, 99), "caught up entry by entry, not by clearing everything"
        assert b._backplane is not None and b._backplane.gaps == 0


async def test_instance_whose_position_was_trimmed_clears_its_l1(
    redis_url: str, prefix: str
) -> None:
    # MAXLEN ~ trims whole stream nodes (100 entries by default): 300 entries with a
    # maxlen of 10 are sure to trim past B's position.
    async with two_instances(redis_url, prefix, maxlen=10) as (a, b, proxy):
        for book_id in [1, 2, 99]:
            await b.get_or_load("book", {"id": book_id}, CountingLoader(f"v{book_id}"))
        await cut_off(b, proxy)

        for book_id in range(1000, 1300):
            await a.invalidate("book", {"id": book_id})  # keys B never held
        length = await a._store.client.xlen(prefix + a.config.backplane.stream)
        assert length < 300
        assert in_l1(b, 99)

        proxy.restore()
        assert await eventually(lambda: not any(in_l1(b, i) for i in (1, 2, 99)), timeout=5)
        assert b._backplane is not None and b._backplane.gaps == 1
        status = b.backplane_status()
        assert status is not None and status.gaps == 1


async def test_a_connected_instance_that_fell_behind_past_maxlen_clears_its_l1(
    redis_url: str, prefix: str
) -> None:
    """No disconnect this time: B's listener is only slow (a stalled loop, a GC pause),
    and while it stands still the stream is trimmed past its position. Its next read
    returns what is left - fewer entries than a full batch - with B's key's entry gone
    among the trimmed. B can't tell from the entries; it must check the stream and clear
    L1, not keep the stale copy for its TTL."""
    async with two_instances(redis_url, prefix, maxlen=10) as (a, b, _proxy):
        for book_id in [1, 2, 99]:
            await b.get_or_load("book", {"id": book_id}, CountingLoader(f"v{book_id}"))
        gate = stall_listener(b)
        await a.invalidate("book", {"id": 1})  # ends the XREAD B was blocked in
        assert await eventually(lambda: not in_l1(b, 1), timeout=5)
        await a.invalidate("book", {"id": 2})  # B stands at the gate: not read yet
        for book_id in range(1000, 1300):
            await a.invalidate("book", {"id": book_id})  # keys B never held
        length = await a._store.client.xlen(prefix + a.config.backplane.stream)
        assert 10 <= length < 300, length
        assert in_l1(b, 2) and b.backplane_status().connected  # type: ignore[union-attr]

        gate.set()
        assert await eventually(lambda: not any(in_l1(b, i) for i in (2, 99)), timeout=5)
        assert b.backplane_status().gaps == 1  # type: ignore[union-attr]


# -- what a person looks at: counters, connection state and lag ---------------------------


def _scrape(cache: LayeredCache) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One real scrape of ``cache`` alone (layered_cache.prometheus, its own registry)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from layered_cache.prometheus import register_cache, render_metrics

    registry = CollectorRegistry()
    register_cache(cache, registry)
    body, _ = render_metrics(registry)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


async def test_remote_invalidations_are_counted_apart_from_local_ones(
    redis_url: str, prefix: str
) -> None:
    """B applies A's invalidations: B counts them as backplane entries/keys applied and
    the L1 copies it dropped; ``invalidated`` stays the local invalidate() calls."""
    async with two_instances(redis_url, prefix) as (a, b, _proxy):
        for book_id in (1, 2, 3):
            await b.get_or_load("book", {"id": book_id}, CountingLoader(f"v{book_id}"))
        await a.invalidate("book", {"id": 1})
        await a.invalidate("book", {"id": 2})
        await a.invalidate("book", {"id": 50})  # not in B's L1: applied, nothing dropped
        assert await eventually(lambda: b.backplane_status().entries_applied == 3)  # type: ignore[union-attr]
        assert in_l1(b, 3) and not in_l1(b, 1) and not in_l1(b, 2)

        status = b.backplane_status()
        assert status is not None
        assert (status.entries_applied, status.keys_applied, status.gaps) == (3, 3, 0)
        assert status.connected and status.last_id is not None
        assert 0 <= status.lag_seconds < 5
        assert b.stats()["book"]["backplane_l1_dropped"] == 2
        assert b.stats()["book"]["invalidated"] == 0
        assert a.stats()["book"]["invalidated"] == 3
        mine = a.backplane_status()
        assert mine is not None and mine.entries_applied == 0  # its own entries: skipped

        data = _scrape(b)
        instance = (("instance", b.instance_id),)
        book = (("namespace", "book"),)
        assert data[("layered_cache_backplane_entries_applied_total", instance)] == 3
        assert data[("layered_cache_backplane_keys_applied_total", instance)] == 3
        assert data[("layered_cache_backplane_gaps_total", instance)] == 0
        assert data[("layered_cache_backplane_connected", instance)] == 1
        assert 0 <= data[("layered_cache_backplane_lag_seconds", instance)] < 5
        assert data[("layered_cache_backplane_l1_dropped_total", book)] == 2
        assert data[("layered_cache_invalidations_total", book)] == 0
        assert _scrape(a)[("layered_cache_invalidations_total", book)] == 3


async def test_a_cut_shows_as_disconnected_with_growing_lag_until_caught_up(
    redis_url: str, prefix: str
) -> None:
    async with two_instances(redis_url, prefix) as (a, b, proxy):
        await b.get_or_load("book", {"id": 1}, CountingLoader("v1"))
        await cut_off(b, proxy)
        await a.invalidate("book", {"id": 1})
        await asyncio.sleep(0.3)
        status = b.backplane_status()
        assert status is not None and not status.connected
        assert status.lag_seconds >= 0.3
        data = _scrape(b)
        instance = (("instance", b.instance_id),)
        assert data[("layered_cache_backplane_connected", instance)] == 0
        assert data[("layered_cache_backplane_lag_seconds", instance)] >= 0.3

        proxy.restore()
        assert await eventually(lambda: not in_l1(b, 1), timeout=5)
        # Caught up: the next read finds nothing new (block = 200 ms) and the lag is 0.
        assert await eventually(lambda: b.backplane_status().lag_seconds == 0, timeout=5)  # type: ignore[union-attr]
        status = b.backplane_status()
        assert status is not None and status.connected and status.entries_applied == 1


async def test_listener_of_a_redis_that_stops_answering_gives_up_its_read_and_catches_up(
    redis_server: RedisServer, prefix: str
) -> None:
    """The listener's client has no socket timeout (``_clients.listener_connection``:
    redis-py's per-send ``wait_for`` costs every instance three loop iterations per
    wake); each command carries its own deadline instead: block + connect_timeout + 1 s.
    A Redis that hangs (SIGSTOP: connections stay open, nothing answers) must cut the
    blocked XREAD and the reconnect's handshake at that deadline, not hold them forever;
    once it answers again the listener is back and hears the next invalidation."""
    namespaces = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}
    config = make_config(redis_server.url, prefix, namespaces, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        assert b._backplane is not None
        assert await eventually(b._backplane.connected.is_set)
        await b.get_or_load("book", {"id": 1}, CountingLoader("v1"))
        redis_server.pause()
        try:
            started = asyncio.get_running_loop().time()
            # Deadline 0.2 + 0.2 + 1.0 s; a read that never ends would never get here.
            assert await eventually(lambda: not b._backplane.connected.is_set(), timeout=6)  # type: ignore[union-attr]
            assert asyncio.get_running_loop().time() - started < 5
        finally:
            redis_server.resume()
        assert await eventually(b._backplane.connected.is_set, timeout=10)
        assert in_l1(b, 1)
        await a.invalidate("book", {"id": 1})
        assert await eventually(lambda: not in_l1(b, 1), timeout=5)


def _fail_once(monkeypatch: Any, cache: LayeredCache, bug: Exception) -> None:
    """The next L1 drop of ``cache``'s book namespace raises ``bug`` (a bug in applying
    an invalidation); the ones after it work."""
    l1 = cache.namespace("book").policy.l1
    assert l1 is not None
    discard, failures = l1.discard, [bug]

    def buggy_discard(keys: Any) -> int:
        if failures:
            raise failures.pop()
        return discard(keys)

    monkeypatch.setattr(l1, "discard", buggy_discard)


async def test_a_bug_while_applying_an_entry_clears_l1_and_the_listener_goes_on(
    redis_url: str, prefix: str, monkeypatch: Any
) -> None:
    """A listener that died on a bug would leave status() saying connected while this
    instance never heard another invalidation: its L1 would serve superseded values
    for their TTL. It clears L1 instead, says so, and keeps listening."""
    async with two_instances(redis_url, prefix) as (a, b, _proxy):
        for book_id in (1, 2, 3):
            await b.get_or_load("book", {"id": book_id}, CountingLoader(f"v{book_id}"))
        _fail_once(monkeypatch, b, RuntimeError("a bug in applying an entry"))
        await a.invalidate("book", {"id": 1})

        assert await eventually(lambda: not any(in_l1(b, i) for i in (1, 2, 3)), timeout=5)
        status = b.backplane_status()
        assert status is not None and (status.errors, status.gaps) == (1, 1)
        assert _scrape(b)[("layered_cache_backplane_errors_total", (("instance", b.instance_id),))] == 1

        # Still listening: the next invalidation reaches B's L1 as before.
        await b.get_or_load("book", {"id": 2}, CountingLoader("v2"))
        assert in_l1(b, 2)
        await a.invalidate("book", {"id": 2})
        assert await eventually(lambda: not in_l1(b, 2), timeout=5)
        assert b.backplane_status().errors == 1  # type: ignore[union-attr]


async def test_a_bug_while_applying_a_fallback_message_clears_l1_and_the_subscriber_goes_on(
    redis_url: str, prefix: str, monkeypatch: Any
) -> None:
    """The pub/sub fallback (a full Redis refused the stream's append) is read by a task
    of its own: a bug there must not end it unseen either."""
    async with two_instances(redis_url, prefix) as (a, b, _proxy):
        for book_id in (1, 2, 3):
            await b.get_or_load("book", {"id": book_id}, CountingLoader(f"v{book_id}"))
        assert b._fallback is not None
        assert await eventually(b._fallback.subscribed.is_set)
        _fail_once(monkeypatch, b, RuntimeError("a bug in applying a message"))
        channel = fallback_channel(prefix + a.config.backplane.stream)
        client = a._store.client

        async def announce(book_id: int) -> None:
            message = FallbackMessage(keys=[f"{prefix}book:{book_id}"], origin="another")
            await client.publish(channel, msgspec.msgpack.encode(message))

        await announce(1)
        assert await eventually(lambda: not any(in_l1(b, i) for i in (1, 2, 3)), timeout=5)
        status = b.backplane_status()
        assert status is not None and status.errors == 1

        await b.get_or_load("book", {"id": 2}, CountingLoader("v2"))
        await announce(2)
        assert await eventually(lambda: not in_l1(b, 2), timeout=5)
        status = b.backplane_status()
        assert status is not None and (status.errors, status.fallback_received) == (1, 1)
