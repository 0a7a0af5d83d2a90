"""Scenario: writes. ``set()`` and ``set_many()`` against a raw redis-py floor.

What: sequential ``await cache.set("book", {"id": i}, value)`` against the floor
``await r.set(key, encode(value), px=ttl)`` (redis-py, msgspec encode of the same ~1 KB
value); ``set_many`` of 100 items against one non-transactional pipeline of the same 100
``SET PX``. Each floor is measured twice: with a default client, and with the cache's own
socket timeout (1 s: redis-py then wraps every read in ``asyncio.wait_for``).

Why: a ``set()`` also revokes the key's lease (a fill in flight must not land after it),
announces the key on the backplane (every other instance drops its L1 copy) and fills
this instance's L1; this measures what those guarantees cost on top of the write.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgspec
from redis.asyncio import Redis

from bench.configs import make_config
from bench.env import BenchEnv, unique_prefix
from bench.floors import Batch, book_value, fmt_ratio, fmt_us, interleaved, median
from bench.report import Headline, Section
from layered_cache import LayeredCache

TARGET = 1.2
BATCH = 100  # items per set_many call
TTL_MS = 600_000


def _floors(client: Redis, prefix: str, value: Any, tag: str) -> dict[str, Batch]:
    encode = msgspec.msgpack.Encoder().encode
    counter = itertools.count()

    async def single(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            await client.set(f"{prefix}raw:{next(counter)}", encode(value), px=TTL_MS)
        return (time.perf_counter() - start) / n

    async def pipelined(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            pipe = client.pipeline(transaction=False)
            for _ in range(BATCH):
                pipe.set(f"{prefix}raw:{next(counter)}", encode(value), px=TTL_MS)
            await pipe.execute()
        return (time.perf_counter() - start) / n

    return {
        f"floor: SET PX + encode ({tag})": single,
        f"floor: pipelined SET PX x{BATCH} + encode ({tag})": pipelined,
    }


def _ours(cache: LayeredCache, value: Any) -> dict[str, Batch]:
    counter = itertools.count()

    async def single(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            await cache.set("book", {"id": next(counter)}, value)
        return (time.perf_counter() - start) / n

    async def many(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            await cache.set_many("book", [({"id": next(counter)}, value) for _ in range(BATCH)])
        return (time.perf_counter() - start) / n

    return {"layered_cache set()": single, f"layered_cache set_many ({BATCH} items)": many}


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("sets", "Writes: set() and set_many() vs raw SET PX (+ encode)")
    value = book_value()
    n, repeats = (300, 3) if env.quick else (2_000, 9)
    prefix = unique_prefix("sets")
    url = env.redis_url()
    config = make_config(
        url, prefix, {"book": {"key": "book:{id}", "l1": {"ttl": "10m", "max_entries": 10_000}}}
    )
    plain = Redis.from_url(url)
    timed = Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        async with LayeredCache.from_config(config) as cache:
            contenders = _floors(plain, prefix, value, "default client")
            contenders.update(_floors(timed, prefix, value, "1 s socket timeout"))
            contenders.update(_ours(cache, value))
            results = await interleaved(contenders, n, repeats)
    finally:
        await plain.aclose()
        await timed.aclose()
    medians = {name: median(values) for name, values in results.items()}
    _report(section, results, medians)
    section.notes.append(
        f"{repeats} repeats, interleaved, each a batch of ~0.15 s (at most {n:,} calls); "
        "sequential awaits on one event loop; a fresh key per call; the cache has L1 and the "
        "backplane on (the backplane listener of the same process reads every entry). "
        "On a single node set() is one script (SET, DEL lease, XADD: one command, one reply), "
        "packed by layered_cache._direct; the listener pauses backplane.coalesce (1 ms) "
        "after a read that returned entries."
    )
    section.data = {"median_s": medians, "repeats_s": results, "n": n}
    section.seconds = time.perf_counter() - started
    return section


def _report(
    section: Section, results: dict[str, list[float]], medians: dict[str, float]
) -> None:
    pairs = {
        "layered_cache set()": "floor: SET PX + encode ({})",
        f"layered_cache set_many ({BATCH} items)": f"floor: pipelined SET PX x{BATCH} + encode ({{}})",
    }
    section.columns = ["contender", "median per call", "ratio to floor (default client)",
                       "ratio to floor (1 s timeout)", "min..max of repeats"]
    for name, values in results.items():
        floor = pairs.get(name)
        section.rows.append([
            name, fmt_us(medians[name]),
            fmt_ratio(medians[name], medians[floor.format("default client")]) if floor else "-",
            fmt_ratio(medians[name], medians[floor.format("1 s socket timeout")]) if floor else "-",
            f"{fmt_us(min(values))} .. {fmt_us(max(values))}",
        ])
    for name, floor in pairs.items():
        base = medians[floor.format("default client")]
        same = medians[floor.format("1 s socket timeout")]
        ratio = medians[name] / base
        what = "set()" if name.endswith("set()") else f"set_many of {BATCH}"
        section.headline.append(
            Headline(
                f"{what} (sequential, L1 + backplane on)",
                f"{fmt_us(medians[name])} ({ratio:.2f}x floor; "
                f"{medians[name] / same:.2f}x with the same socket timeout)",
                f"{floor.format('default client').removeprefix('floor: ')} {fmt_us(base)}",
                f"<= {TARGET}x floor",
                "ok" if ratio <= TARGET else "MISSED",
            )
        )
