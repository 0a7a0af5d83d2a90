"""Scenario 3b: what the cache costs Redis, per entry and for the backplane stream.

What: ``MEMORY USAGE`` of entries written with ``cache.set`` (~1 KB value: the envelope
with its metadata, the key with its prefix, a TTL) against a raw ``SET`` of the same
value bytes (msgpack of the same value, same TTL) under a key of the same length: the
difference is the library's own overhead in L2. Then the backplane stream at its
``maxlen``: entries of one key each, as ``invalidate()`` appends them, trimmed with
``MAXLEN ~`` as the publisher does, measured with ``MEMORY USAGE ... SAMPLES 0`` (every
node counted). Sizing ``backplane.maxlen`` (docs/operations.md): events/s x catch-up
window; this gives the memory that costs.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import redis.asyncio as redis

from bench.configs import make_config
from bench.env import BenchEnv, unique_prefix
from bench.floors import book_value
from bench.report import Headline, Section
from layered_cache import LayeredCache

_DEFAULT_MAXLEN = 100_000


async def _usage(client: redis.Redis, names: list[str]) -> float:
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.memory_usage(name, samples=0)
    sizes: list[Any] = await pipe.execute()
    return sum(int(size or 0) for size in sizes) / len(names)


async def _entries(env: BenchEnv, client: redis.Redis, entries: int) -> dict[str, float]:
    prefix = unique_prefix("l2mem")
    config = make_config(
        env.redis_url(), prefix, {"book": {"key": "book:{id}", "l2": {"ttl": "10m"}}}
    )
    async with LayeredCache.from_config(config) as cache:
        for i in range(entries):
            await cache.set("book", {"id": i}, book_value(i))
    ours = [f"{prefix}book:{i}" for i in range(entries)]
    raw = [f"{prefix}raw0:{i}" for i in range(entries)]  # same length as "book:"
    pipe = client.pipeline(transaction=False)
    for name, i in zip(raw, range(entries), strict=True):
        pipe.set(name, msgspec.msgpack.encode(book_value(i)), px=600_000)
    await pipe.execute()
    value = sum(len(msgspec.msgpack.encode(book_value(i))) for i in range(entries)) / entries
    result = {"value": value, "ours": await _usage(client, ours), "raw": await _usage(client, raw)}
    await client.delete(*ours, *raw)
    return result


async def _stream(client: redis.Redis, maxlen: int) -> float:
    """Bytes of a stream trimmed to ``maxlen`` entries of one ~20-byte key each."""
    name = unique_prefix("l2mem") + "backplane"
    origin = "0123456789ab"  # an instance id: 12 hex characters
    for start in range(0, maxlen + maxlen // 10, 1000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, start + 1000):
            keys = msgspec.msgpack.encode([f"shop:book:{i:010d}"])
            fields = {"keys": keys, "origin": origin}
            pipe.xadd(name, fields, maxlen=maxlen, approximate=True)  # type: ignore[arg-type]
        await pipe.execute()
    size = int(await client.memory_usage(name, samples=0) or 0)
    await client.delete(name)
    return float(size)


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("l2_memory", "3b. Redis memory: L2 bytes per entry, backplane stream")
    entries = 2_000 if env.quick else 10_000
    maxlen = 10_000 if env.quick else _DEFAULT_MAXLEN
    client = redis.Redis.from_url(env.redis_url())
    try:
        per = await _entries(env, client, entries)
        stream = await _stream(client, maxlen)
    finally:
        await client.aclose()
    overhead = per["ours"] - per["raw"]
    section.columns = ["what", "bytes", "note"]
    section.rows = [
        ["the ~1 KB value, msgpack", f"{per['value']:,.0f}", "what the loader returned"],
        ["raw SET of those bytes (TTL, same key length)", f"{per['raw']:,.0f}",
         "MEMORY USAGE per key: the floor"],
        ["layered_cache L2 entry (cache.set)", f"{per['ours']:,.0f}",
         f"{overhead:,.0f} B over the raw SET: the envelope (written_at, soft expiry, "
         "delta), which can push the allocation into the next jemalloc size class"],
        [f"backplane stream at maxlen {maxlen:,} (1 key per entry)", f"{stream:,.0f}",
         f"{stream / maxlen:,.1f} B per entry; {stream / 2**20:,.1f} MiB"],
    ]  # fmt: skip
    section.notes.append(
        f"MEMORY USAGE SAMPLES 0, mean over {entries:,} entries; the stream filled with "
        f"{maxlen + maxlen // 10:,} XADD MAXLEN ~ {maxlen:,} (trimmed by whole nodes, so it "
        "may hold a little more than maxlen). Size backplane.maxlen with "
        "docs/operations.md: entries/s x catch-up window x 2."
    )
    section.headline.append(
        Headline(
            "L2 bytes per entry (~1 KB value)",
            f"{per['ours']:,.0f} B ({overhead:,.0f} B over a raw SET)",
            f"raw SET {per['raw']:,.0f} B",
            "reported",
            "info",
        )
    )
    section.data = {
        "bytes_per_entry": per,
        "entries": entries,
        "stream_bytes": stream,
        "stream_maxlen": maxlen,
    }
    section.seconds = time.perf_counter() - started
    return section
