"""How a batch is cut into round trips: at most ``CHUNK_ITEMS`` keys and, where the
values are known, about ``CHUNK_BYTES`` of them per round trip.

Each round trip is bounded by one ``redis.timeout``. Sent whole, 10,000 keys of 3 KB
(a 30 MB pipeline) outlasted the default 100 ms every time: a Redis failure (the breaker
opens for every key), leases released while their fills still ran, nothing cached. Only
operations that are not atomic across keys are cut (a batch's leases, fills, releases
and MGET; a cluster's ``set_many``, a pipeline split per node anyway): chunks change
nothing a caller can see. A single node's ``set_many`` is one MULTI/EXEC, which can't
be cut: its deadline grows instead (``_direct``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

__all__ = ["CHUNK_BYTES", "CHUNK_ITEMS", "by_count", "by_size"]

CHUNK_ITEMS = 1_000
CHUNK_BYTES = 1 << 20

T = TypeVar("T")


def by_count(items: Sequence[T]) -> Iterator[Sequence[T]]:
    """Runs of at most CHUNK_ITEMS items, in order."""
    for start in range(0, len(items), CHUNK_ITEMS):
        yield items[start : start + CHUNK_ITEMS]


def by_size(items: Sequence[T], size: Callable[[T], int]) -> Iterator[Sequence[T]]:
    """Runs of at most CHUNK_ITEMS items and about CHUNK_BYTES (an item larger than
    that goes alone), in order."""
    start, total = 0, 0
    for end, item in enumerate(items):
        if end > start and (end - start >= CHUNK_ITEMS or total + size(item) > CHUNK_BYTES):
            yield items[start:end]
            start, total = end, 0
        total += size(item)
    if start < len(items):
        yield items[start:]
