"""Counters of caches that left a Prometheus collector, kept in its sums.

Why: the collector (``layered_cache.prometheus``) sums ``stats()`` over the caches
registered at scrape time. When one left (``unregister_cache``, a cache closed and
garbage-collected, a ``SyncLayeredCache`` closed or restarted on a new inner cache), its
counts left the sums and every ``layered_cache_*_total`` of its namespaces went down.
Prometheus reads any decrease as a counter reset, so ``rate()``/``increase()`` reported
the surviving caches' whole totals as a burst that never happened. A leaving cache's
final counters are folded into a retired total that every scrape adds, so a counter
never decreases. Only the namespace counters: gauges (hot keys, L1 entries) say what is
there now, and the series labelled by ``instance`` (breakers, purges, backplane) end
with their instance, which Prometheus reads as a series ending, not a reset.

The namespaces' ``NamespaceStats`` objects are held, not the cache: a cache collected
without ``unregister_cache`` is folded with its final counts, read after it is gone.
Counters are per process: after a fork the parent's retired totals and caches are
dropped, so a worker counts its own requests (docs/metrics.md).
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from layered_cache._forklock import ForkSafeLock

if TYPE_CHECKING:
    from layered_cache._cache import LayeredCache
    from layered_cache._stats import NamespaceStats
    from layered_cache.sync import SyncLayeredCache

    Exported = LayeredCache | SyncLayeredCache

__all__ = ["Reads", "RetiredCounters", "Totals"]

Totals = dict[str, dict[str, int]]  # namespace -> counter name -> count
Reads = dict[tuple[str, str], int]  # (namespace, replica index) -> reads


class _Source:
    """What one exported cache is counted from: the stats of the ``LayeredCache`` that
    serves it now (a ``SyncLayeredCache``'s inner cache changes), in this process."""

    __slots__ = ("cache", "finalizer", "pid", "stats")

    def __init__(self) -> None:
        self.cache: weakref.ref[LayeredCache] | None = None
        self.stats: dict[str, NamespaceStats] = {}
        self.pid = os.getpid()
        self.finalizer: weakref.finalize[[_Source], Exported] | None = None

    def follows(self, cache: LayeredCache | None) -> bool:
        """Whether ``cache`` is the one captured (a collected one is followed by none)."""
        if self.pid != os.getpid():
            return False
        if self.cache is None:
            return cache is None
        return cache is not None and self.cache() is cache

    def capture(self, cache: LayeredCache | None) -> None:
        self.cache = None if cache is None else weakref.ref(cache)
        self.stats = {} if cache is None else {ns.name: ns.policy.stats for ns in cache}
        self.pid = os.getpid()


class _Part(NamedTuple):
    """What one namespace's stats added to the retired totals."""

    namespace: str
    counts: dict[str, int]
    reads: dict[str, int]  # replica index (as its label) -> reads


class RetiredCounters:
    """The retired totals of one collector, and the caches it may have to retire."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()  # a scrape may hold it at a fork (``_forklock``)
        self._pid = os.getpid()
        self._sources: weakref.WeakKeyDictionary[Exported, _Source] = (
            weakref.WeakKeyDictionary()
        )
        # Filled by finalizers, which run in whatever thread collects the cache, maybe
        # inside a locked section of this one: an append only, folded under the lock.
        self._gone: deque[_Source] = deque()
        self.totals: Totals = {}
        self.replica_reads: Reads = {}
        # What each namespace's stats added to the totals when retired: a cache
        # registered again is counted live again, and its retired part must go.
        self._retired_from: weakref.WeakKeyDictionary[NamespaceStats, _Part] = (
            weakref.WeakKeyDictionary()
        )

    def seen(self, exported: Exported, cache: LayeredCache | None) -> None:
        """``exported`` is served by ``cache`` now (None: closed, not built here yet).
        The cache it was served by before, if another, leaves the sums: retired."""
        with self._lock:
            source = self._sources.get(exported)
            if source is None:
                source = self._sources[exported] = _Source()
                source.finalizer = weakref.finalize(exported, self._gone.append, source)
            elif source.follows(cache):
                return
            else:
                self._fold(source)
            source.capture(cache)
            self._revive(source)

    def leave(self, exported: Exported, cache: LayeredCache | None) -> None:
        """``exported`` is no longer exported: its counters, read now, are retired."""
        with self._lock:
            source = self._sources.pop(exported, None)
            if source is None:
                return
            if source.finalizer is not None:
                source.finalizer.detach()
            if not source.follows(cache):
                self._fold(source)
                source.capture(cache)
                self._revive(source)
            self._fold(source)

    def snapshot(self) -> tuple[Totals, Reads]:
        """The retired totals (copies), the caches collected since the last call folded."""
        with self._lock:
            while self._gone:
                self._fold(self._gone.popleft())
            self._forked()
            return {ns: dict(row) for ns, row in self.totals.items()}, dict(self.replica_reads)

    def _fold(self, source: _Source) -> None:
        self._forked()
        if source.pid != self._pid:  # a parent's cache: its counts are not this process's
            return
        for namespace, stats in source.stats.items():
            counts = {n: v for n, v in stats.as_dict().items() if isinstance(v, int)}
            reads = list(stats.replica_reads.items())  # one C-level copy: a loop may count on
            part = _Part(namespace, counts, {str(i): c for i, c in reads})
            self._add(part, 1)
            self._retired_from[stats] = part
        source.stats = {}

    def _revive(self, source: _Source) -> None:
        """Stats counted live again (a cache unregistered, then registered again): what
        they added to the retired totals comes out, or they counted twice."""
        for stats in source.stats.values():
            part = self._retired_from.pop(stats, None)
            if part is not None:
                self._add(part, -1)

    def _add(self, part: _Part, sign: int) -> None:
        row = self.totals.setdefault(part.namespace, {})
        for name, value in part.counts.items():
            row[name] = row.get(name, 0) + sign * value
        for index, count in part.reads.items():
            label = (part.namespace, index)
            self.replica_reads[label] = self.replica_reads.get(label, 0) + sign * count

    def _forked(self) -> None:
        """In a forked child the parent's retired totals are not this process's."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self.totals, self.replica_reads = {}, {}
            self._retired_from = weakref.WeakKeyDictionary()
