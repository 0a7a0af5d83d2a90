"""Scenario 3: memory per L1 entry of a ~1 KB value.

What: tracemalloc over 100,000 entries written with ``cache.get_or_load`` into a namespace with
L1 only (``l2 = false``, so nothing leaves the process), against the floor of the same
values stored in a raw ``cachetools.TTLCache``. Values are built inside the traced window
(each entry owns its ~1 KB dict, as decoded L2 values do), so the figure is what a
service pays per cached entry; the overhead over the floor is the library's own
bookkeeping (key string, expiry, TLRU expiry ordering).

Each fill is counted twice: at the halfway mark and at the end. The second half's bytes
per entry is what one more entry costs (the headline's figure); the whole fill's also
carries what a namespace holds whatever its size - the key template's memo of up to
2,048 validated key values - spread over the entries.
"""

from __future__ import annotations

import functools
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


class _Traced:
    """Bytes allocated (after gc) at the halfway mark and at the end of one fill."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._start = self.half = self.end = 0

    def __enter__(self) -> _Traced:
        gc.collect()
        tracemalloc.start()
        self._start = tracemalloc.get_traced_memory()[0]
        return self

    def mark(self, i: int) -> None:
        """Call after entry ``i`` is stored."""
        if i == self.entries // 2 - 1:
            gc.collect()
            self.half = tracemalloc.get_traced_memory()[0] - self._start

    def __exit__(self, *exc: object) -> None:
        gc.collect()
        self.end = tracemalloc.get_traced_memory()[0] - self._start
        tracemalloc.stop()

    @property
    def per_entry(self) -> float:
        return self.end / self.entries

    @property
    def marginal(self) -> float:
        return (self.end - self.half) / (self.entries - self.entries // 2)


def _values_only(entries: int) -> _Traced:
    with _Traced(entries) as traced:
        kept = []
        for i in range(entries):
            kept.append(book_value(i))
            traced.mark(i)
    del kept
    return traced


def _floor(entries: int, prefix: str) -> _Traced:
    # The very key strings L1 holds (prefix included): a per-entry figure must not
    # count the prefix's ~17 characters against the cache.
    with _Traced(entries) as traced:
        cache: TTLCache[str, Any] = TTLCache(maxsize=entries, ttl=600)
        for i in range(entries):
            cache[f"{prefix}book:{i}"] = book_value(i)
            traced.mark(i)
    del cache
    return traced


async def _ours(entries: int, cache: LayeredCache) -> _Traced:
    with _Traced(entries) as traced:
        # get_or_load: the read-through fill most entries come from.
        for i in range(entries):
            await cache.get_or_load("book", {"id": i}, functools.partial(_value, i))
            traced.mark(i)
    return traced


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("memory", "3. Memory per L1 entry (~1 KB value, 100,000 entries)")
    entries = 20_000 if env.quick else 100_000
    prefix = unique_prefix("mem")
    value = _values_only(entries)
    floor = _floor(entries, prefix)
    config = make_config(
        env.redis_url(),
        prefix,
        {"book": {"key": "book:{id}", "l2": False,
                  "l1": {"ttl": "10m", "jitter": 0.2, "max_entries": entries}}},
        backplane=False,
    )
    async with LayeredCache.from_config(config) as cache:
        ours = await _ours(entries, cache)
        l1 = cache.namespace("book").policy.l1
        held = len(l1) if l1 is not None else 0
    assert held == entries, held
    _report(section, entries, value, floor, ours)
    section.seconds = time.perf_counter() - started
    return section


def _report(section: Section, entries: int, value: _Traced, floor: _Traced, ours: _Traced) -> None:
    section.columns = ["what", "bytes per entry (second half)",
                       "overhead over the value (second half)", "bytes per entry (whole fill)",
                       "overhead over the value (whole fill)"]
    for what, traced in (("the ~1 KB value alone (dict, built by the same code)", value),
                         ("floor: cachetools.TTLCache[key] = value", floor),
                         ("layered_cache L1 (get_or_load fill, L2 off)", ours)):
        section.rows.append([
            what, f"{traced.marginal:,.0f}",
            "-" if traced is value else f"{traced.marginal - value.marginal:,.0f}",
            f"{traced.per_entry:,.0f}",
            "-" if traced is value else f"{traced.per_entry - value.per_entry:,.0f}",
        ])
    section.notes.append(
        f"tracemalloc, {entries:,} entries, after gc; counted at {entries // 2:,} entries "
        "and at the end: the second half's bytes per entry are what one more entry costs; "
        "the whole fill's include what a namespace holds at any size (the key memo of up "
        "to 2,048 values, at most ~140 KB) spread over the entries. Both include the key strings "
        "(the same strings in both: the cache's prefix + book:<i>). "
        f"Total for layered_cache: {ours.end / 2**20:.1f} MiB."
    )
    over = ours.marginal - value.marginal
    floor_over = floor.marginal - value.marginal
    section.headline.append(
        Headline(
            f"Memory per L1 entry (~1 KB value, {entries:,} entries)",
            f"{ours.marginal:,.0f} B ({over:,.0f} B over the value; whole fill "
            f"{ours.per_entry - value.per_entry:,.0f} B with the key memo)",
            f"TTLCache {floor.marginal:,.0f} B ({floor_over:,.0f} B over; whole fill "
            f"{floor.per_entry - value.per_entry:,.0f} B)",
            "<= TTLCache's overhead",
            # Whole bytes: an entry's allocations are whole blocks; fractions are dict
            # and list growth spread over the entries, and move between runs.
            "ok" if round(over) <= round(floor_over) else "MISSED",
        )
    )
    section.data = {
        "bytes_per_entry": {"value": value.per_entry, "floor": floor.per_entry,
                            "ours": ours.per_entry},
        "bytes_per_entry_second_half": {"value": value.marginal, "floor": floor.marginal,
                                        "ours": ours.marginal},
        "entries": entries,
    }
