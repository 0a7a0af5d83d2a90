"""Scenario 4: stampede in one process: 200 concurrent requests for one cold key,
a 50 ms loader.

What: how many times the loader runs and the wall time until all 200 have their value,
for plain cache-aside (``GET`` miss -> load -> ``SET``, redis.asyncio), layered_cache,
and the peers at their stampede settings: cashews ``@cache(..., lock=True)`` (Redis),
aiocache ``@cached_stampede`` (Redis), dogpile.cache ``get_or_create`` (Redis backend;
synchronous, so 200 threads).

Why: a cold or just-expired popular key is the moment a cache either protects the
database or multiplies its load by the concurrency.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench.configs import make_config
from bench.env import BenchEnv, unique_prefix
from bench.floors import book_value, median
from bench.plots import bar_chart
from bench.report import Headline, Section
from layered_cache import LayeredCache

CONCURRENCY = 200
LOAD_S = 0.05


class Counter:
    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def hit(self) -> None:
        with self._lock:
            self.calls += 1


async def _gather(call: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    results = await asyncio.gather(*(call() for _ in range(CONCURRENCY)))
    assert all(r is not None for r in results)
    return time.perf_counter() - start


async def plain(url: str, key: str, value: Any, counter: Counter) -> float:
    """Cache-aside as most services write it: no coordination at all."""
    import msgspec

    client = aioredis.Redis.from_url(url, max_connections=CONCURRENCY + 10)

    async def call() -> Any:
        data = await client.get(key)
        if data is not None:
            return msgspec.msgpack.decode(data)
        counter.hit()
        await asyncio.sleep(LOAD_S)
        await client.set(key, msgspec.msgpack.encode(value), ex=600)
        return value

    await asyncio.gather(*(client.get(key + ":warm") for _ in range(CONCURRENCY)))  # pool up
    try:
        return await _gather(call)
    finally:
        await client.aclose()


async def layered(url: str, key: str, value: Any, counter: Counter) -> float:
    config = make_config(url, key, {"book": {"key": "book:{id}"}})

    async def loader() -> Any:
        counter.hit()
        await asyncio.sleep(LOAD_S)
        return value

    async with LayeredCache.from_config(config) as cache:
        await cache.get("book", {"id": 0})  # connect first: the stampede, not the connect
        return await _gather(lambda: cache.get_or_load("book", {"id": 42}, loader))


async def cashews_lock(url: str, key: str, value: Any, counter: Counter) -> float:
    from cashews import Cache

    cache = Cache()
    cache.setup(url, client_side=False)

    @cache(ttl="10m", lock=True, prefix=key)
    async def book(id: int) -> Any:
        counter.hit()
        await asyncio.sleep(LOAD_S)
        return value

    await cache.get(key + ":warmup")
    try:
        return await _gather(lambda: book(42))
    finally:
        await cache.close()


async def aiocache_stampede(url: str, key: str, value: Any, counter: Counter) -> float:
    from aiocache import RedisCache, cached_stampede

    parsed = urllib.parse.urlparse(url)
    deco = cached_stampede(
        lease=2, ttl=600, cache=RedisCache, endpoint=parsed.hostname, port=parsed.port,
        namespace=key, pool_max_size=CONCURRENCY + 10,
    )

    async def _book(id: int) -> Any:
        counter.hit()
        await asyncio.sleep(LOAD_S)
        return value

    book = deco(_book)
    await deco.cache.get("warm")
    try:
        return await _gather(lambda: book(42))
    finally:
        if getattr(deco, "cache", None) is not None:
            await deco.cache.close()


async def dogpile_threads(url: str, key: str, value: Any, counter: Counter) -> float:
    from dogpile.cache import make_region

    region = make_region().configure(
        "dogpile.cache.redis", expiration_time=600, arguments={"url": url}
    )

    def creator() -> Any:
        counter.hit()
        time.sleep(LOAD_S)
        return value

    def call() -> Any:
        return region.get_or_create(key + ":book:42", creator)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(lambda _: region.get(key + ":warm"), range(CONCURRENCY)))  # threads up
        start = time.perf_counter()
        results = list(pool.map(lambda _: call(), range(CONCURRENCY)))
        wall = time.perf_counter() - start
    assert all(r is not None for r in results)
    return wall


CONTENDERS: dict[str, Callable[[str, str, Any, Counter], Awaitable[float]]] = {
    "plain cache-aside (redis.asyncio)": plain,
    "layered_cache": layered,
    "cashews (redis, lock=True)": cashews_lock,
    "aiocache (redis, cached_stampede)": aiocache_stampede,
    "dogpile.cache (redis, 200 threads)": dogpile_threads,
}


# What an error means, for the note under the plot.
_HINTS = {
    "MaxConnectionsError": "redis-py 8's default pool holds 100 connections, fewer than "
    "its 200 threads",
}


def missing_note(failed: dict[str, str]) -> str:
    """Why a contender has no bar: the plot must not drop one silently."""
    notes = []
    for name, reason in failed.items():
        hint = _HINTS.get(reason.split(":", 1)[0])
        notes.append(
            f"Not shown: {name}, which failed ({reason}{'; ' + hint if hint else ''}); "
            "the 4-process plot has it."
        )
    return " ".join(notes)


def plot_loads(loads: dict[str, list[int]], failed: dict[str, str], path: Path) -> str:
    return bar_chart(
        {name.split(" (")[0]: median([float(c) for c in counts]) for name, counts in loads.items()},
        "Loads per stampede, 1 process x 200 concurrent (cold key)", "loader calls (log)",
        path, log=True, note=missing_note(failed),
    )


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("stampede_local", "4. Stampede, 1 process: 200 concurrent misses, 50 ms loader")
    url = env.redis_url()
    value = book_value()
    repeats = 1 if env.quick else 3
    loads: dict[str, list[int]] = {name: [] for name in CONTENDERS}
    walls: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    failed: dict[str, str] = {}  # contender -> its first error: not on the plot, say why
    for _ in range(repeats):
        for name, fn in CONTENDERS.items():
            counter = Counter()
            try:
                wall = await fn(url, unique_prefix("st1"), value, counter)
            except Exception as exc:
                section.notes.append(f"{name}: n/a ({type(exc).__name__}: {exc})")
                failed.setdefault(name, f"{type(exc).__name__}: {exc}")
                loads.pop(name, None)
                continue
            if name in loads:
                loads[name].append(counter.calls)
                walls[name].append(wall)
    section.columns = ["library", "loads (median)", "loads (max)", "wall (median)", "wall / load time"]
    for name, counts in loads.items():
        wall = median(walls[name])
        section.rows.append(
            [name, f"{median([float(c) for c in counts]):g}", str(max(counts)),
             f"{wall * 1000:.0f} ms", f"{wall / LOAD_S:.2f}x"]
        )
    section.notes.append(
        f"{repeats} repeat(s), each on a fresh key; wall = first request issued to last answered."
    )
    plot = plot_loads(loads, failed, env.plot_path("stampede_1proc_loads.png"))
    section.data = {"loads": loads, "walls_s": walls, "failed": failed, "plots": [plot]}
    ours = loads.get("layered_cache", [])
    plain_loads = loads.get("plain cache-aside (redis.asyncio)", [])
    section.headline.append(
        Headline(
            "Stampede, 1 process x 200, 50 ms loader: loads",
            f"{max(ours) if ours else 'n/a'} (wall {median(walls['layered_cache']) * 1000:.0f} ms)"
            if ours else "n/a",
            f"plain cache-aside {median([float(c) for c in plain_loads]):g}" if plain_loads else "n/a",
            "1 load",
            "ok" if ours and max(ours) == 1 else "MISSED",
        )
    )
    section.seconds = time.perf_counter() - started
    return section
