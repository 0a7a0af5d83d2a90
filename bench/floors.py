"""Shared measurement helpers and the floors every latency figure is divided by.

Floors are the cheapest thing that does the same job, measured in the same run on the
same machine: a raw ``cachetools.TTLCache[key]`` lookup for an L1 hit, and a raw
``redis.asyncio`` GET + ``msgspec`` decode of the same bytes for an L2 hit. A ratio to a
floor is what stays comparable between machines; absolute microseconds are not.

Contenders are measured *interleaved* (repeat 1 of every contender, then repeat 2, ...)
so that a slow phase of the machine (another process, CPU frequency) hits all of them
alike instead of biasing whichever ran during it; the figure is the median of repeats.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = [
    "Batch",
    "book_value",
    "cache_aside_floor",
    "fmt_ratio",
    "fmt_us",
    "interleaved",
    "percentile",
    "raw_l2_floor",
    "ttlcache_floor",
    "with_cpu",
]

#: One timed batch: runs ``n`` operations and returns seconds per operation.
Batch = Callable[[int], Awaitable[float]]


_DESCRIPTION = ("A practical book about layered caches and stampedes. " * 16)[:812]


def book_value(i: int = 42) -> dict[str, Any]:
    """A ~1 KB bookstore value (msgpack-encoded it is ~1,000 bytes)."""
    return {
        "id": i,
        "isbn": f"978-3-16-{i:06d}-0",
        "title": f"The Art of Caching, volume {i}",
        "author": {"id": i % 977, "name": "Ada Lovelace"},
        "price": "12.90",
        "currency": "EUR",
        "stock": 17,
        "tags": ["cache", "redis", "python", "distributed-systems"],
        # A fresh string per value (not a shared constant), so each entry owns its ~1 KB.
        "description": f"#{i} " + _DESCRIPTION,
    }


def encoded_size(value: Any) -> int:
    return len(msgspec.msgpack.encode(value))


#: What a batch against a real server may raise on a loaded machine (a client with a
#: 100 ms socket timeout, a connection reset): that batch is measured again.
TRANSIENT = (TimeoutError, OSError, RedisTimeoutError, RedisConnectionError)
_ATTEMPTS = 3


async def _measured(name: str, batch: Batch, n: int, retried: dict[str, int]) -> float:
    """``batch(n)``, again after a transient failure (at most ``_ATTEMPTS`` in all,
    counted in ``retried``): one timeout of one contender's client under a neighbour's
    load ended the whole scenario, every other contender's figures with it."""
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            return await batch(n)
        except TRANSIENT:
            if attempt == _ATTEMPTS:
                raise
            retried[name] = retried.get(name, 0) + 1
    raise AssertionError("unreachable")


async def interleaved(
    contenders: dict[str, Batch],
    n: int,
    repeats: int,
    batch_seconds: float = 0.15,
    retried: dict[str, int] | None = None,
) -> dict[str, list[float]]:
    """Per-op seconds of every contender, ``repeats`` times, interleaved.

    Each contender's batch size is calibrated from a warm-up so a batch lasts about
    ``batch_seconds`` (at most ``n`` ops): a 100 µs peer doesn't need 50,000 ops to
    be measured well. GC is off during a batch (and run between batches) to cut noise.
    A batch that fails transiently is measured again (``retried``: how often, by name).
    """
    retried = {} if retried is None else retried
    sizes: dict[str, int] = {}
    for name, batch in contenders.items():
        per_op = await batch(max(20, min(n, 500)))
        sizes[name] = int(max(50, min(n, batch_seconds / max(per_op, 1e-9))))
        await batch(max(10, sizes[name] // 10))
    results: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, batch in contenders.items():
            gc.collect()
            gc.disable()
            try:
                results[name].append(await _measured(name, batch, sizes[name], retried))
            finally:
                gc.enable()
    return results


def with_cpu(batch: Batch, log: list[float]) -> Batch:
    """``batch``, with its process CPU per op (``time.process_time``: the event loop and
    the kernel's share of its syscalls included) appended to ``log``. The calibration
    batches of ``interleaved`` are logged too: the last ``repeats`` are the measured ones.
    On a shared VM the CPU ratio moves much less than the wall ratio, which also holds
    the time the process sleeps in epoll waiting for Redis (and waking from it)."""

    async def timed(n: int) -> float:
        start = time.process_time()
        per_op = await batch(n)
        log.append((time.process_time() - start) / n)
        return per_op

    return timed


def median(values: list[float]) -> float:
    return statistics.median(values)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def fmt_us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.2f} µs" if us < 10 else f"{us:.1f} µs" if us < 100 else f"{us:.0f} µs"


def fmt_ratio(value: float, floor: float) -> str:
    return f"{value / floor:.2f}x" if floor > 0 else "n/a"


# -- floors ----------------------------------------------------------------------------


def ttlcache_floor(value: Any, key: str = "book:42") -> Batch:
    """Raw ``cachetools.TTLCache[key]`` of a present key: what an L1 hit can't beat."""
    from cachetools import TTLCache

    cache: TTLCache[str, Any] = TTLCache(maxsize=10_000, ttl=600)
    cache[key] = value

    async def batch(n: int) -> float:
        c, k = cache, key
        start = time.perf_counter()
        for _ in range(n):
            c[k]
        return (time.perf_counter() - start) / n

    return batch


async def cache_aside_floor(value: Any, template: str, fields: dict[str, Any]) -> Batch:
    """A hand-written async cache-aside wrapper around ``cachetools.TLRUCache`` (the
    structure L1 uses), the key built from the fields by an f-string: the plain
    baseline an L1 hit of ``get_or_load`` (or ``get``) is divided by (issue 17)::

        async def get_or_load(key, loader):
            try:
                return cache[key]
            except KeyError:
                v = await loader(); cache[key] = v; return v
    """
    from cachetools import TLRUCache

    cache: TLRUCache[str, Any] = TLRUCache(maxsize=10_000, ttu=lambda _k, _v, now: now + 600)
    (name,) = fields  # one field, as in ``book:{id}`` / ``isbn:{isbn}``

    async def loader() -> Any:
        return value

    async def get_or_load(key: str, load: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return cache[key]
        except KeyError:
            v = await load()
            cache[key] = v
            return v

    await get_or_load(f"{template}:{fields[name]}", loader)

    async def batch(n: int) -> float:
        call = get_or_load
        start = time.perf_counter()
        for _ in range(n):
            await call(f"{template}:{fields[name]}", loader)
        return (time.perf_counter() - start) / n

    return batch


def raw_l2_floor(client: Any, key: str) -> Batch:
    """Raw ``await redis.asyncio.get(key)`` + ``msgspec.msgpack.decode`` of the bytes:
    one round trip plus decoding, what an L2 hit can't beat."""
    decode = msgspec.msgpack.Decoder().decode

    async def batch(n: int) -> float:
        get = client.get
        start = time.perf_counter()
        for _ in range(n):
            decode(await get(key))
        return (time.perf_counter() - start) / n

    return batch


def sync_batch(op: Callable[[], Any]) -> Batch:
    """Wrap a synchronous operation (dogpile.cache) as a batch."""

    async def batch(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            op()
        return (time.perf_counter() - start) / n

    return batch


def async_batch(op: Callable[[], Awaitable[Any]]) -> Batch:
    async def batch(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            await op()
        return (time.perf_counter() - start) / n

    return batch
