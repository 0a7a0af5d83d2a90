"""Scenario 1: L1 hit latency.

What: ``await cache.get_or_load("book", {"id": 42}, loader)`` when the value is in L1,
against the floor of a raw ``cachetools.TTLCache[key]`` lookup, and the peers' fastest
in-memory get-or-load: cashews (``mem://`` backend, decorator), aiocache
(``SimpleMemoryCache`` + ``@cached``), dogpile.cache (memory backend,
``get_or_create``; synchronous, so measured without an ``await``).

Why: the L1 hit is the path nearly every request takes; its cost is the library's
overhead on top of a dict lookup (key building, policy lookup, lock, expiry check).
"""

from __future__ import annotations

import time
from typing import Any

from bench.configs import make_config
from bench.env import BenchEnv, unique_prefix
from bench.floors import (
    Batch,
    async_batch,
    book_value,
    fmt_ratio,
    fmt_us,
    interleaved,
    median,
    sync_batch,
    ttlcache_floor,
)
from bench.report import Headline, Section
from layered_cache import LayeredCache

TARGET = 3.5


async def _peers(value: dict[str, Any], notes: list[str]) -> tuple[dict[str, Batch], list[Any]]:
    peers: dict[str, Batch] = {}
    closers: list[Any] = []
    try:
        from cashews import Cache

        cashews = Cache()
        cashews.setup("mem://")

        @cashews(ttl="10m")
        async def cashews_book(id: int) -> dict[str, Any]:
            return value

        await cashews_book(42)
        peers["cashews (mem, decorator)"] = async_batch(lambda: cashews_book(42))
        closers.append(cashews.close)
    except Exception as exc:  # pragma: no cover - a missing peer is reported, not fatal
        notes.append(f"cashews: n/a ({type(exc).__name__}: {exc})")
    try:
        from aiocache import SimpleMemoryCache, cached

        @cached(ttl=600, cache=SimpleMemoryCache)
        async def aiocache_book(id: int) -> dict[str, Any]:
            return value

        await aiocache_book(42)
        peers["aiocache (SimpleMemoryCache, @cached)"] = async_batch(lambda: aiocache_book(42))
    except Exception as exc:  # pragma: no cover
        notes.append(f"aiocache: n/a ({type(exc).__name__}: {exc})")
    try:
        from dogpile.cache import make_region

        region = make_region().configure("dogpile.cache.memory", expiration_time=600)
        region.get_or_create("book:42", lambda: value)
        peers["dogpile.cache (memory, get_or_create; sync)"] = sync_batch(
            lambda: region.get_or_create("book:42", lambda: value)
        )
    except Exception as exc:  # pragma: no cover
        notes.append(f"dogpile.cache: n/a ({type(exc).__name__}: {exc})")
    return peers, closers


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("l1_hit", "1. L1 hit latency (get-or-load of a present key, in memory)")
    value = book_value()
    n, repeats = (5_000, 5) if env.quick else (50_000, 9)
    config = make_config(
        env.redis_url(),
        unique_prefix("l1"),
        {"book": {"key": "book:{id}", "l1": {"ttl": "10m", "max_entries": 10_000}}},
    )

    async def loader() -> dict[str, Any]:
        return value

    async with LayeredCache.from_config(config) as cache:
        fields = {"id": 42}
        await cache.get_or_load("book", fields, loader)  # fill L1 (and L2)
        assert cache.stats()["book"]["l1_hit"] == 0

        async def ours(count: int) -> float:
            get_or_load = cache.get_or_load
            start = time.perf_counter()
            for _ in range(count):
                await get_or_load("book", fields, loader)
            return (time.perf_counter() - start) / count

        contenders: dict[str, Batch] = {
            "floor: cachetools.TTLCache[key]": ttlcache_floor(value),
            "layered_cache get_or_load (L1 hit)": ours,
        }
        peers, closers = await _peers(value, section.notes)
        contenders.update(peers)
        results = await interleaved(contenders, n, repeats)
        assert cache.stats()["book"]["load"] == 1
        for close in closers:
            await close()

    medians = {name: median(values) for name, values in results.items()}
    floor = medians["floor: cachetools.TTLCache[key]"]
    ours_s = medians["layered_cache get_or_load (L1 hit)"]
    section.columns = ["contender", "median per op", "ratio to floor", "min..max of repeats"]
    for name, values in results.items():
        section.rows.append(
            [name, fmt_us(medians[name]), fmt_ratio(medians[name], floor),
             f"{fmt_us(min(values))} .. {fmt_us(max(values))}"]
        )
    peer_medians = {k: v for k, v in medians.items() if k in peers}
    best_peer = min(peer_medians, key=peer_medians.__getitem__) if peer_medians else None
    section.notes.append(
        f"{repeats} repeats, interleaved, each a batch of ~0.15 s (at most {n:,} hits); one event loop; "
        "the same ~1 KB dict value for every contender."
    )
    if best_peer:
        section.notes.append(
            f"Fastest peer: {best_peer} at {fmt_us(peer_medians[best_peer])}: layered_cache is "
            f"{peer_medians[best_peer] / ours_s:.1f}x faster."
        )
    ratio = ours_s / floor
    section.headline.append(
        Headline(
            "L1 hit (get_or_load)",
            f"{fmt_us(ours_s)} ({ratio:.2f}x floor)",
            f"TTLCache[key] {fmt_us(floor)}"
            + (f"; fastest peer {fmt_us(peer_medians[best_peer])}" if best_peer else ""),
            f"<= {TARGET}x floor",
            "ok" if ratio <= TARGET else "MISSED",
        )
    )
    section.data = {"median_s": medians, "repeats_s": results, "n": n, "ratio": ratio}
    section.seconds = time.perf_counter() - started
    return section
