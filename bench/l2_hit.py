"""Scenario 2: L2 hit latency (L1 disabled), loopback Redis, ~1 KB value.

What: ``get_or_load`` of a key present in Redis with ``l1 = false``, against the floor of
a raw ``redis.asyncio`` GET + ``msgspec.msgpack`` decode of the very bytes the cache stored,
one request at a time (latency, not throughput). Peers with a Redis backend: cashews
(``redis://``, decorator, ``client_side`` off), aiocache (``RedisCache`` + ``@cached``),
dogpile.cache (``dogpile.cache.redis``, synchronous, pickle).

Why: with L1 off or missed, every read pays this path. Beyond the round trip the library
adds the breaker, envelope decoding, the soft-expiry and XFetch checks: that overhead
should stay within 10 % of the raw call.
"""

from __future__ import annotations

import time
import urllib.parse
from typing import Any

import msgspec
import redis.asyncio as aioredis

from bench.configs import make_config
from bench.env import BenchEnv, unique_prefix
from bench.floors import (
    Batch,
    async_batch,
    book_value,
    encoded_size,
    fmt_ratio,
    fmt_us,
    interleaved,
    median,
    raw_l2_floor,
    sync_batch,
    with_cpu,
)
from bench.loopwork import loop_work
from bench.report import Headline, Section
from layered_cache import LayeredCache

TARGET = 1.1
FLOOR = "floor: redis.asyncio GET + msgspec decode"
FLOOR_TIMEOUT = "floor with the cache's socket timeout (100 ms)"
OURS = "layered_cache get_or_load (L2 hit, L1 off)"
UNPOLLED = "layered_cache get_or_load (L2 hit, L1 off), busy_poll off"


async def _peers(url: str, prefix: str, value: Any, notes: list[str]) -> tuple[dict[str, Batch], list[Any]]:
    peers: dict[str, Batch] = {}
    closers: list[Any] = []
    parsed = urllib.parse.urlparse(url)
    try:
        from cashews import Cache

        cashews = Cache()
        cashews.setup(url, client_side=False)

        @cashews(ttl="10m", prefix=prefix + "cashews")
        async def cashews_book(id: int) -> Any:
            return value

        await cashews_book(42)
        peers["cashews (redis, decorator)"] = async_batch(lambda: cashews_book(42))
        closers.append(cashews.close)
    except Exception as exc:  # pragma: no cover
        notes.append(f"cashews: n/a ({type(exc).__name__}: {exc})")
    try:
        from aiocache import RedisCache, cached

        deco = cached(
            ttl=600, cache=RedisCache, endpoint=parsed.hostname, port=parsed.port,
            namespace=prefix + "aiocache",
        )

        async def _book(id: int) -> Any:
            return value

        aiocache_book = deco(_book)
        await aiocache_book(42)
        peers["aiocache (RedisCache, @cached)"] = async_batch(lambda: aiocache_book(42))
        if hasattr(deco, "cache") and deco.cache is not None:
            closers.append(deco.cache.close)
    except Exception as exc:  # pragma: no cover
        notes.append(f"aiocache: n/a ({type(exc).__name__}: {exc})")
    try:
        from dogpile.cache import make_region

        region = make_region().configure(
            "dogpile.cache.redis", expiration_time=600, arguments={"url": url}
        )
        key = prefix + "dogpile:book:42"
        region.get_or_create(key, lambda: value)
        peers["dogpile.cache (redis, get_or_create; sync)"] = sync_batch(
            lambda: region.get_or_create(key, lambda: value)
        )
    except Exception as exc:  # pragma: no cover
        notes.append(f"dogpile.cache: n/a ({type(exc).__name__}: {exc})")
    return peers, closers


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("l2_hit", "2. L2 hit latency (L1 off, loopback Redis, ~1 KB value)")
    value = book_value()
    url = env.redis_url()
    prefix = unique_prefix("l2")
    n, repeats = (300, 5) if env.quick else (3_000, 9)
    config = make_config(url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    # The same with redis.busy_poll = 0s: it sleeps in epoll for each reply, as the floor.
    sleepy_config = make_config(
        url, prefix, {"book": {"key": "book:{id}", "l1": False}}, busy_poll="0s"
    )
    raw = aioredis.Redis.from_url(url)
    # The same client with the per-operation timeout the cache must have: redis-py then
    # arms a timer per read, which the bare floor doesn't pay.
    raw_timeout = aioredis.Redis.from_url(url, socket_timeout=0.1)

    async def loader() -> Any:
        return value

    async with (
        LayeredCache.from_config(config) as cache,
        LayeredCache.from_config(sleepy_config) as sleepy,
    ):
        fields = {"id": 42}
        await cache.get_or_load("book", fields, loader)
        key = cache.key("book", fields)
        stored = await raw.get(key)
        assert stored is not None

        def reads(of: LayeredCache) -> Batch:
            async def batch(count: int) -> float:
                get_or_load = of.get_or_load
                start = time.perf_counter()
                for _ in range(count):
                    await get_or_load("book", fields, loader)
                return (time.perf_counter() - start) / count

            return batch

        ours = reads(cache)

        cpu: dict[str, list[float]] = {FLOOR: [], OURS: []}
        contenders: dict[str, Batch] = {
            FLOOR: with_cpu(raw_l2_floor(raw, key), cpu[FLOOR]),
            FLOOR_TIMEOUT: raw_l2_floor(raw_timeout, key),
            OURS: with_cpu(ours, cpu[OURS]),
            UNPOLLED: reads(sleepy),
        }
        peers, closers = await _peers(url, prefix, value, section.notes)
        contenders.update(peers)
        retried: dict[str, int] = {}
        results = await interleaved(contenders, n, repeats, batch_seconds=0.25, retried=retried)
        for name, count in retried.items():
            section.notes.append(f"{name}: {count} batch(es) measured again after a timeout")
        decode = msgspec.msgpack.Decoder().decode

        async def floor_op() -> Any:
            return decode(await raw.get(key))

        work = {
            FLOOR: await loop_work(floor_op),
            OURS: await loop_work(lambda: cache.get_or_load("book", fields, loader)),
        }
        stats = cache.stats()["book"]
        assert stats["load"] == 1, stats
        for close in closers:
            await close()
    await raw.aclose()
    await raw_timeout.aclose()

    medians = {name: median(values) for name, values in results.items()}
    floor, ours_s = medians[FLOOR], medians[OURS]
    section.columns = ["contender", "median per op", "ratio to floor", "min..max of repeats"]
    for name, values in results.items():
        section.rows.append(
            [name, fmt_us(medians[name]), fmt_ratio(medians[name], floor),
             f"{fmt_us(min(values))} .. {fmt_us(max(values))}"]
        )
    section.notes.append(
        f"Stored envelope: {len(stored)} bytes (value alone {encoded_size(value)} bytes msgpack). "
        f"{repeats} repeats, interleaved, batches of ~0.25 s; sequential requests on one connection."
    )
    section.notes.append(
        "Peers store their own serialization (cashews/dogpile pickle, aiocache JSON), so their "
        "payload size differs slightly; all are one GET per hit."
    )
    for name, counts in work.items():
        section.notes.append(
            f"Event-loop work per op ({name}): "
            + ", ".join(f"{v:.1f} {k}" for k, v in counts.items())
            + " (counted with cProfile: deterministic, unlike wall time on a busy machine)."
        )
    ratio = ours_s / floor
    ratio_timeout = ours_s / medians[FLOOR_TIMEOUT]
    cpu_ratio = median(cpu[OURS][-repeats:]) / median(cpu[FLOOR][-repeats:])
    peer_medians = {k: v for k, v in medians.items() if k in peers}
    best = min(peer_medians.values()) if peer_medians else None
    section.headline.append(
        Headline(
            "L2 hit, L1 off (get_or_load)",
            f"{fmt_us(ours_s)} ({ratio:.2f}x floor; {ratio_timeout:.2f}x the floor with the "
            f"same socket timeout; CPU {cpu_ratio:.2f}x; busy_poll off "
            f"{medians[UNPOLLED] / floor:.2f}x)",
            f"GET+decode {fmt_us(floor)}" + (f"; fastest peer {fmt_us(best)}" if best else ""),
            f"<= {TARGET}x floor",
            "ok" if ratio <= TARGET else "MISSED",
        )
    )
    section.data = {"median_s": medians, "repeats_s": results, "ratio": ratio,
                    "ratio_same_timeout": ratio_timeout, "cpu_ratio": cpu_ratio,
                    "bytes": len(stored),
                    "loop_work": work}
    section.seconds = time.perf_counter() - started
    return section
