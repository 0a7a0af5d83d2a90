"""Scenario 1: L1 hit latency.

What: ``await cache.get_or_load(ns, fields, loader)`` and ``await cache.get(ns, fields)``
when the value is in L1, for an int key (``book:{id}``, 42) and a string key
(``isbn:{isbn}``, ``978-0-13-468599-1``), each against its floor: a hand-written async
cache-aside wrapper around ``cachetools.TLRUCache`` with the key built by an f-string
(``floors.cache_aside_floor``). The raw ``cachetools.TTLCache[key]`` lookup is reported
too, and the peers' fastest in-memory get-or-load: cashews (``mem://`` backend,
decorator), aiocache (``SimpleMemoryCache`` + ``@cached``), dogpile.cache (memory
backend, ``get_or_create``; synchronous, so measured without an ``await``).

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
    cache_aside_floor,
    fmt_ratio,
    fmt_us,
    interleaved,
    median,
    sync_batch,
    ttlcache_floor,
)
from bench.report import Headline, Section
from layered_cache import LayeredCache

TARGET = 1.15  # x the cache-aside wrapper (issue 17)
RAW = "floor: cachetools.TTLCache[key]"
ISBN = "978-0-13-468599-1"
# (row label, namespace, fields, template of the wrapper's f-string key)
KEYS = [("int key", "book", {"id": 42}), ("str key", "isbn", {"isbn": ISBN})]


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


def _ours(cache: LayeredCache, namespace: str, fields: dict[str, Any], loader: Any) -> dict[str, Batch]:
    async def get_or_load(count: int) -> float:
        call = cache.get_or_load
        start = time.perf_counter()
        for _ in range(count):
            await call(namespace, fields, loader)
        return (time.perf_counter() - start) / count

    async def get(count: int) -> float:
        call = cache.get
        start = time.perf_counter()
        for _ in range(count):
            await call(namespace, fields)
        return (time.perf_counter() - start) / count

    return {"get_or_load": get_or_load, "get": get}


async def _contenders(
    cache: LayeredCache, value: Any, loader: Any
) -> tuple[dict[str, Batch], dict[str, tuple[str, str]]]:
    """Every contender, and for each of ours (label -> (its floor's label, key kind))."""
    contenders: dict[str, Batch] = {RAW: ttlcache_floor(value)}
    pairs: dict[str, tuple[str, str]] = {}
    for kind, namespace, fields in KEYS:
        floor = f"floor: async cache-aside on TLRUCache, f-string key ({kind})"
        contenders[floor] = await cache_aside_floor(value, namespace, fields)
        for op, batch in _ours(cache, namespace, fields, loader).items():
            await cache.get_or_load(namespace, fields, loader)  # fill L1 (and L2)
            label = f"layered_cache {op} (L1 hit, {kind})"
            contenders[label] = batch
            pairs[label] = (floor, kind)
    return contenders, pairs


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("l1_hit", "1. L1 hit latency (get-or-load of a present key, in memory)")
    value = book_value()
    n, repeats = (20_000, 5) if env.quick else (400_000, 15)
    layer = {"l1": {"ttl": "10m", "max_entries": 10_000}}
    config = make_config(
        env.redis_url(),
        unique_prefix("l1"),
        {"book": {"key": "book:{id}", **layer}, "isbn": {"key": "isbn:{isbn}", **layer}},
    )

    async def loader() -> dict[str, Any]:
        return value

    async with LayeredCache.from_config(config) as cache:
        contenders, pairs = await _contenders(cache, value, loader)
        peers, closers = await _peers(value, section.notes)
        contenders.update(peers)
        results = await interleaved(contenders, n, repeats)
        assert cache.stats()["book"]["load"] == 1 and cache.stats()["isbn"]["load"] == 1
        for close in closers:
            await close()
    medians = {name: median(values) for name, values in results.items()}
    _table(section, results, medians, pairs)
    _headlines(section, medians, pairs, peers)
    section.notes.append(
        f"{repeats} repeats, interleaved, each a batch of ~0.15 s (at most {n:,} hits); one "
        "event loop; the same ~1 KB dict value for every contender. Each of ours is divided "
        "by the cache-aside floor of its key kind, measured in the same run."
    )
    ratios = {label: medians[label] / medians[floor] for label, (floor, _) in pairs.items()}
    section.data = {"median_s": medians, "repeats_s": results, "n": n, "ratios": ratios}
    section.seconds = time.perf_counter() - started
    return section


def _table(
    section: Section,
    results: dict[str, list[float]],
    medians: dict[str, float],
    pairs: dict[str, tuple[str, str]],
) -> None:
    raw = medians[RAW]
    section.columns = [
        "contender", "median per op", "ratio to its floor", "ratio to TTLCache[key]",
        "min..max of repeats",
    ]
    for name, values in results.items():
        floor = pairs.get(name, ("", ""))[0]
        section.rows.append(
            [name, fmt_us(medians[name]),
             fmt_ratio(medians[name], medians[floor]) if floor else "-",
             fmt_ratio(medians[name], raw),
             f"{fmt_us(min(values))} .. {fmt_us(max(values))}"]
        )


def _headlines(
    section: Section,
    medians: dict[str, float],
    pairs: dict[str, tuple[str, str]],
    peers: dict[str, Batch],
) -> None:
    raw = medians[RAW]
    peer_medians = {k: v for k, v in medians.items() if k in peers}
    best = min(peer_medians, key=peer_medians.__getitem__) if peer_medians else None
    for label, (floor, kind) in pairs.items():
        ours, base = medians[label], medians[floor]
        ratio = ours / base
        op = "get_or_load" if "get_or_load" in label else "get"
        reference = f"cache-aside TLRUCache {fmt_us(base)}; TTLCache[key] {fmt_us(raw)}"
        if best and op == "get_or_load" and kind == "int key":
            reference += f"; fastest peer {fmt_us(peer_medians[best])}"
        section.headline.append(
            Headline(
                f"L1 hit ({op}, {kind})",
                f"{fmt_us(ours)} ({ratio:.2f}x cache-aside; {ours / raw:.2f}x TTLCache[key])",
                reference,
                f"<= {TARGET}x cache-aside",
                "ok" if ratio <= TARGET else "MISSED",
            )
        )
