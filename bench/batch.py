"""Scenario 10: ``get_many`` of 50 warm L2 keys (L1 off), loopback Redis, ~1 KB values.

What: one ``get_many`` of 50 keys present in Redis with ``l1 = false``, against
- the floor: a raw ``redis.asyncio`` ``MGET`` of the same 50 keys + ``msgspec`` decode of
  each of the very bytes the cache stored (one round trip, what a batch can't beat);
- 50 sequential ``get`` calls of the same keys (50 round trips: what a page of 50 costs
  without batches).
Plus the round trips of one ``get_many``, counted on the client (``bench/sends.py``).

Why: a list page reads its 50 books at once; the batch must cost about one round trip
(target <= 1.3x the floor) and be >= 10x faster than reading the books one by one.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import redis.asyncio as aioredis

from bench.configs import make_config
from bench.env import BenchEnv, unique_prefix
from bench.floors import Batch, book_value, fmt_ratio, fmt_us, interleaved, median
from bench.loopwork import loop_work
from bench.report import Headline, Section
from bench.sends import count_sends, drop_prefix
from layered_cache import LayeredCache

KEYS = 50
FLOOR_TARGET = 1.3
SPEEDUP_TARGET = 10.0
FLOOR = "floor: redis.asyncio MGET of 50 + msgspec decode of each"
OURS = "layered_cache get_many(50) (L2 hits, L1 off)"
SEQUENTIAL = "50 sequential layered_cache get (L2 hits, L1 off)"


def mget_floor(client: Any, keys: list[str]) -> Batch:
    decode = msgspec.msgpack.Decoder().decode

    async def batch(n: int) -> float:
        mget = client.mget
        start = time.perf_counter()
        for _ in range(n):
            [decode(v) for v in await mget(keys)]
        return (time.perf_counter() - start) / n

    return batch


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("batch", "10. get_many of 50 warm L2 keys (L1 off, loopback Redis, ~1 KB values)")
    url = env.redis_url()
    prefix = unique_prefix("batch")
    n, repeats = (100, 5) if env.quick else (1_000, 9)
    config = make_config(url, prefix, {"book": {"key": "book:{id}", "l1": False}}, backplane=False)
    raw = aioredis.Redis.from_url(url)
    fields = [{"id": i} for i in range(KEYS)]
    async with LayeredCache.from_config(config) as cache:
        await cache.set_many("book", [(f, book_value(f["id"])) for f in fields])
        keys = [cache.key("book", f) for f in fields]
        stored = [v for v in await raw.mget(keys) if isinstance(v, bytes)]
        assert len(stored) == KEYS
        assert await cache.get_many("book", fields) == [book_value(i) for i in range(KEYS)]

        async def ours(count: int) -> float:
            get_many = cache.get_many
            start = time.perf_counter()
            for _ in range(count):
                await get_many("book", fields)
            return (time.perf_counter() - start) / count

        async def sequential(count: int) -> float:
            get = cache.get
            start = time.perf_counter()
            for _ in range(count):
                for f in fields:
                    await get("book", f)
            return (time.perf_counter() - start) / count

        contenders: dict[str, Batch] = {FLOOR: mget_floor(raw, keys), OURS: ours,
                                        SEQUENTIAL: sequential}
        results = await interleaved(contenders, n, repeats, batch_seconds=0.25)
        with count_sends() as sends:
            await cache.get_many("book", fields)
        work = await loop_work(lambda: cache.get_many("book", fields), n=100)
        stats = cache.stats()["book"]
    await drop_prefix(raw, prefix)
    await raw.aclose()

    medians = {name: median(values) for name, values in results.items()}
    floor, ours_s, seq = medians[FLOOR], medians[OURS], medians[SEQUENTIAL]
    ratio, speedup = ours_s / floor, seq / ours_s
    section.columns = ["contender", "median per 50 keys", "per key", "ratio to floor",
                       "min..max of repeats"]
    for name, values in results.items():
        section.rows.append([name, fmt_us(medians[name]), fmt_us(medians[name] / KEYS),
                             fmt_ratio(medians[name], floor),
                             f"{fmt_us(min(values))} .. {fmt_us(max(values))}"])
    round_trips = sum(sends.values())
    section.notes += [
        f"get_many is {speedup:.1f}x faster than 50 sequential gets; one get_many = "
        f"{round_trips} round trip(s) (client sends, `bench/sends.py`).",
        f"Stored envelopes: {sum(len(v) for v in stored):,} bytes for the 50 keys. {repeats} "
        "repeats, interleaved, batches of ~0.25 s; one request at a time on one connection.",
        "Event-loop work per get_many: " + ", ".join(f"{v:.1f} {k}" for k, v in work.items())
        + " (cProfile).",
        f"Counters after the run: l2_hit {stats['l2_hit']:,}, miss {stats['miss']:,}.",
    ]
    section.headline += [
        Headline("get_many of 50 warm L2 keys (L1 off)",
                 f"{fmt_us(ours_s)} ({ratio:.2f}x floor; {round_trips} round trip)",
                 f"MGET+decode {fmt_us(floor)}", f"<= {FLOOR_TARGET}x floor",
                 "ok" if ratio <= FLOOR_TARGET else "MISSED"),
        Headline("get_many of 50 vs 50 sequential get (L2 hits, L1 off)",
                 f"{speedup:.1f}x faster", f"50 gets {fmt_us(seq)}", f">= {SPEEDUP_TARGET:.0f}x",
                 "ok" if speedup >= SPEEDUP_TARGET else "MISSED"),
    ]
    section.data = {"median_s": medians, "repeats_s": results, "ratio": ratio,
                    "speedup_vs_sequential": speedup, "round_trips": dict(sends),
                    "bytes": sum(len(v) for v in stored), "loop_work": work}
    section.seconds = time.perf_counter() - started
    return section
