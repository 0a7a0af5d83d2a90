"""Scenario 3: memory per L1 entry of a ~1 KB value.

What: tracemalloc over 100,000 entries written with ``cache.get_or_load`` into a namespace with
L1 only (``l2 = false``, so nothing leaves the process), against the floor of the same
values stored in a raw ``cachetools.TTLCache``. Values are built inside the traced window
(each entry owns its ~1 KB dict, as decoded L2 values do), so the figure is what a
service pays per cached entry; the overhead over the floor is the library's own
bookkeeping (key string, (value, expiry) tuple, TLRU expiry ordering).
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from typing import Any

from cachetools import TTLCache

from bench.configs import make_config
from bench.env import BenchEnv, unique_prefix
from bench.floors import book_value
from bench.report import Headline, Section
from layered_cache import LayeredCache


async def _value(i: int) -> dict[str, Any]:
    return book_value(i)


def _traced(fill: Any) -> tuple[int, Any]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    keep = fill()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return after - before, keep


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("memory", "3. Memory per L1 entry (~1 KB value, 100,000 entries)")
    entries = 20_000 if env.quick else 100_000

    def values_only() -> list[dict[str, Any]]:
        return [book_value(i) for i in range(entries)]

    prefix = unique_prefix("mem")

    def floor() -> TTLCache[str, Any]:
        # The very key strings L1 holds (prefix included): a per-entry figure must not
        # count the prefix's ~17 characters against the cache.
        cache: TTLCache[str, Any] = TTLCache(maxsize=entries, ttl=600)
        for i in range(entries):
            cache[f"{prefix}book:{i}"] = book_value(i)
        return cache

    value_bytes, kept = _traced(values_only)
    del kept
    floor_bytes, kept = _traced(floor)
    del kept

    config = make_config(
        env.redis_url(),
        prefix,
        {"book": {"key": "book:{id}", "l2": False,
                  "l1": {"ttl": "10m", "jitter": 0.2, "max_entries": entries}}},
        backplane=False,
    )
    async with LayeredCache.from_config(config) as cache:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        # get_or_load, not set: set() on an L1-only namespace stores nothing (its TTL is
        # capped by the L2 soft expiry, which is "now" when L2 is off; reported upstream).
        for i in range(entries):
            await cache.get_or_load("book", {"id": i}, lambda i=i: _value(i))
        gc.collect()
        ours_bytes = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        l1 = cache.namespace("book").policy.l1
        held = len(l1) if l1 is not None else 0
    assert held == entries, held

    per = {name: b / entries for name, b in
           (("value", value_bytes), ("floor", floor_bytes), ("ours", ours_bytes))}
    section.columns = ["what", "bytes per entry", "overhead over the value alone"]
    section.rows = [
        ["the ~1 KB value alone (dict, built by the same code)", f"{per['value']:,.0f}", "-"],
        ["floor: cachetools.TTLCache[key] = value", f"{per['floor']:,.0f}",
         f"{per['floor'] - per['value']:,.0f}"],
        ["layered_cache L1 (get_or_load fill, L2 off)", f"{per['ours']:,.0f}",
         f"{per['ours'] - per['value']:,.0f}"],
    ]
    section.notes.append(
        f"tracemalloc, {entries:,} entries, after gc; includes the key strings (the same "
        "strings in both: the cache's prefix + book:<i>). "
        f"Total for layered_cache: {ours_bytes / 2**20:.1f} MiB."
    )
    section.headline.append(
        Headline(
            f"Memory per L1 entry (~1 KB value, {entries:,} entries)",
            f"{per['ours']:,.0f} B ({per['ours'] - per['value']:,.0f} B over the value)",
            f"TTLCache {per['floor']:,.0f} B ({per['floor'] - per['value']:,.0f} B over)",
            "<= TTLCache's overhead",
            "ok" if per["ours"] <= per["floor"] else "MISSED",
        )
    )
    section.data = {"bytes_per_entry": per, "entries": entries}
    section.seconds = time.perf_counter() - started
    return section
