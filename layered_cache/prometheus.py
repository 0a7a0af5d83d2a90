"""Prometheus export of the cache's counters, breaker state, hot keys and latencies.

    from layered_cache.prometheus import register_cache, render_metrics
    register_cache(cache)                  # once, after creating the cache
    body, content_type = render_metrics()  # in the /metrics handler

Counters cost nothing extra per request: ``CacheCollector`` reads every registered
cache's ``stats()`` when Prometheus scrapes. The two histograms (load time, L2 read
latency) are observed through the cache's hooks, i.e. only on loads and L2 reads, never
on an L1 hit; they are kept as plain bucket counts here and exported at scrape time too.

Several caches registered on one registry are summed per namespace (the breaker gauge
keeps one series per cache, labelled with its ``instance`` id); a cache that leaves
stays in the sums (``_prometheus_retired``). Names and labels: docs/metrics.md.

A ``SyncLayeredCache`` builds a new inner cache in a forked worker and after ``close()``
+ ``start()``: registered (itself, or its inner cache), it is read through the inner
cache it runs now, and its hooks go on with each (``layered_cache._sync_inner``). So a
``gunicorn --preload`` worker's ``/metrics`` counts that worker's requests, not the
master's counters frozen at the fork.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from layered_cache._cache import LayeredCache
from layered_cache._extras import missing_extra
from layered_cache._forklock import ForkSafeLock
from layered_cache._sync_inner import facade_of
from layered_cache.sync import SyncLayeredCache

try:
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        REGISTRY,
        CollectorRegistry,
        generate_latest,
    )
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector
except ImportError as exc:  # an extra: pip install 'layered-cache[prometheus]'
    raise missing_extra("layered_cache.prometheus", "prometheus", exc) from exc

from layered_cache._prometheus_backplane import PREFIX, BackplaneFamilies  # needs the above
from layered_cache._prometheus_retired import Reads, RetiredCounters, Totals

if TYPE_CHECKING:
    from layered_cache._cache import RedisStatus

__all__ = [
    "L2_BUCKETS",
    "LOAD_BUCKETS",
    "CacheCollector",
    "register_cache",
    "render_metrics",
    "unregister_cache",
]

LOAD_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
L2_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
BREAKER_STATES = ("closed", "open", "half_open")

# (metric suffix, help, stats counter); each becomes ``layered_cache_<suffix>_total{namespace}``.
SIMPLE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("loads", "Loader calls (database reads)", "load"),
    ("load_errors", "Loader calls that raised", "load_error"),
    ("coalesced", "Requests that joined another request's in-flight load (single-flight)",
     "coalesced"),
    ("early_refreshes", "XFetch early refreshes started", "early_refresh"),
    ("stale_served", "Stale values served because the loader failed or was slow",
     "stale_served"),
    ("redis_errors", "Redis failures (error, timeout, breaker open) on the read path",
     "redis_error"),
    ("decode_errors", "L2 values that could not be decoded (treated as a miss)",
     "decode_error"),
    ("not_cached", "Values not cached (not encodable, too large, refused by a full Redis)",
     "not_cached"),
    ("refused_full", "Values a full Redis (noeviction) refused: keys dropped", "refused_full"),
    ("fills_revoked", "Fills dropped because an invalidation revoked the lease",
     "fill_revoked"),
    ("l1_fills_discarded", "L1 fills discarded because the key was invalidated meanwhile",
     "l1_fill_discarded"),
    ("replica_misses", "Hot-key replica reads that found no replica", "replica_miss"),
    ("invalidations", "Keys invalidated by this instance's invalidate() calls", "invalidated"),
    ("backplane_l1_dropped",
     "L1 entries dropped because a backplane entry (the daemon, another instance) "
     "invalidated their key", "backplane_l1_dropped"),
    ("sets", "Explicit set() calls", "set"),
)  # fmt: skip
REQUEST_RESULTS = ("l1_hit", "l2_hit", "miss")
LEASE_OUTCOMES = (
    ("won", "lease_won"),
    ("lost", "lease_lost"),
    ("wait_filled", "lease_wait_filled"),
    ("timeout_load", "lease_timeout_load"),
)


class _Histogram:
    """Bucket counts per label value; observe() is a bisect and two additions."""

    __slots__ = ("_lock", "bounds", "series")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.series: dict[tuple[str, ...], list[float]] = {}
        self._lock = ForkSafeLock()  # several loops (sync API); released after a fork

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        with self._lock:
            row = self.series.get(labels)
            if row is None:
                # buckets..., +Inf count, sum
                row = self.series[labels] = [0.0] * (len(self.bounds) + 2)
            row[bisect.bisect_left(self.bounds, value)] += 1
            row[-1] += value

    def family(self, name: str, doc: str, label_names: Sequence[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=list(label_names))
        with self._lock:
            snapshot = {labels: list(row) for labels, row in self.series.items()}
        for labels, row in sorted(snapshot.items()):
            cumulative = 0.0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip((*self.bounds, float("inf")), row[:-1], strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric(list(labels), buckets, row[-1])
        return family


class CacheCollector(Collector):
    """Reads the registered caches at scrape time. One per registry (``register_cache``)."""

    def __init__(self) -> None:
        self._caches: weakref.WeakSet[LayeredCache | SyncLayeredCache] = weakref.WeakSet()
        self._retired = RetiredCounters()
        self.load_seconds = _Histogram(LOAD_BUCKETS)
        self.l2_read_seconds = _Histogram(L2_BUCKETS)

    # hooks called by LayeredCache (``cache.hooks``: load and L2-read observers)
    def observe_load(self, namespace: str, seconds: float, ok: bool) -> None:
        self.load_seconds.observe((namespace, "ok" if ok else "error"), seconds)

    def observe_l2_read(self, namespace: str, seconds: float) -> None:
        self.l2_read_seconds.observe((namespace,), seconds)

    def add(self, cache: LayeredCache | SyncLayeredCache) -> None:
        """Export ``cache``; an inner cache of a ``SyncLayeredCache`` is exported as that
        facade (module doc). Idempotent: each hook is added once."""
        cache = _exported(cache)
        self._caches.add(cache)
        self._retired.seen(cache, _running(cache))
        hooks = cache.hooks
        if self.observe_load not in hooks.load_observers:
            hooks.load_observers.append(self.observe_load)
        if self.observe_l2_read not in hooks.l2_observers:
            hooks.l2_observers.append(self.observe_l2_read)

    def remove(self, cache: LayeredCache | SyncLayeredCache) -> None:
        cache = _exported(cache)
        if cache in self._caches:
            self._retired.leave(cache, _running(cache))
        self._caches.discard(cache)
        while self.observe_load in cache.hooks.load_observers:
            cache.hooks.load_observers.remove(self.observe_load)
        while self.observe_l2_read in cache.hooks.l2_observers:
            cache.hooks.l2_observers.remove(self.observe_l2_read)

    def describe(self) -> Iterator[Metric]:
        # Families are dynamic (namespaces come from caches added later): don't let the
        # registry call collect() at register time.
        return iter(())

    def collect(self) -> Iterator[Metric]:
        scrape = _Scrape()
        for exported in list(self._caches):
            cache = _running(exported)
            self._retired.seen(exported, cache)  # a facade's previous inner cache: retired
            if cache is not None:  # None: a facade closed, or not yet used in this worker
                scrape.add(cache)
        scrape.add_counts(*self._retired.snapshot())
        yield from scrape.counter_families()
        yield from scrape.gauge_families()
        yield self.load_seconds.family(
            f"{PREFIX}_load_seconds", "Loader duration", ["namespace", "outcome"]
        )
        yield self.l2_read_seconds.family(
            f"{PREFIX}_l2_read_seconds",
            "L2 read latency (Redis round trip(s) + decode) on the read path",
            ["namespace"],
        )


class _Scrape:
    """One scrape: every registered cache read once, summed per namespace."""

    def __init__(self) -> None:
        self.totals: dict[str, dict[str, int]] = {}
        self.replica_reads: dict[tuple[str, str], int] = {}
        self.hot_keys: dict[str, int] = {}
        self.l1_entries: dict[str, int] = {}
        self.breaker = GaugeMetricFamily(
            f"{PREFIX}_breaker_state",
            "Circuit breakers in front of Redis: 1 for the current state (node: a Redis "
            "Cluster master's own breaker, or 'default' for the shared one)",
            labels=["instance", "node", "state"],
        )
        self.transitions = CounterMetricFamily(
            f"{PREFIX}_breaker_transitions",
            "Circuit breaker state changes",
            labels=["instance"],
        )
        self.backplane = BackplaneFamilies()
        self.purges = CounterMetricFamily(
            f"{PREFIX}_http_purges",
            "Keys and tags sent to HTTP caches ([purge], docs/http.md), by outcome",
            labels=["instance", "outcome"],
        )

    def add(self, cache: LayeredCache) -> None:
        stats = cache.stats()
        self._add_breakers(cache.instance_id, cache.redis_status())
        purges = cache.purge_stats()
        for outcome in ("submitted", "delivered", "repeated", "retries", "failed", "dropped"):
            self.purges.add_metric([cache.instance_id, outcome], float(getattr(purges, outcome)))
        backplane = cache.backplane_status()
        if backplane is not None:
            self.backplane.add(cache.instance_id, backplane)
        for namespace, counters in stats.items():
            row = self.totals.setdefault(namespace, {})
            for name, value in counters.items():
                if isinstance(value, int):
                    row[name] = row.get(name, 0) + value
            reads = counters.get("replica_reads")
            if isinstance(reads, dict):
                self.add_counts({}, {(namespace, str(i)): int(n) for i, n in reads.items()})
        for namespace, keys in _hot_keys(cache).items():
            self.hot_keys[namespace] = self.hot_keys.get(namespace, 0) + len(keys)
        for namespace, entries in _l1_entries(cache).items():
            self.l1_entries[namespace] = self.l1_entries.get(namespace, 0) + entries

    def add_counts(self, totals: Totals, reads: Reads) -> None:
        """Namespace counters from elsewhere: the caches that left (retired)."""
        for namespace, counters in totals.items():
            row = self.totals.setdefault(namespace, {})
            for name, value in counters.items():
                row[name] = row.get(name, 0) + value
        for label, count in reads.items():
            self.replica_reads[label] = self.replica_reads.get(label, 0) + count

    def _add_breakers(self, instance: str, status: RedisStatus) -> None:
        # Every breaker, not only the shared one: in a cluster each master has its own,
        # and an alert on the shared one alone stays silent while masters are skipped.
        states = {"default": status.breaker, **status.node_breakers}
        for node, state in states.items():
            for candidate in BREAKER_STATES:
                self.breaker.add_metric(
                    [instance, node, candidate], 1.0 if state == candidate else 0.0
                )
        self.transitions.add_metric([instance], float(status.breaker_transitions))

    def counter_families(self) -> Iterator[Metric]:
        """Requests, lease outcomes, the simple counters and replica reads."""
        requests = CounterMetricFamily(
            f"{PREFIX}_requests",
            "Cache reads by the layer that answered (miss: went to the loader)",
            labels=["namespace", "result"],
        )
        leases = CounterMetricFamily(
            f"{PREFIX}_lease",
            "Lease (stampede lock) outcomes on an L2 miss",
            labels=["namespace", "outcome"],
        )
        for namespace, row in sorted(self.totals.items()):
            for result in REQUEST_RESULTS:
                requests.add_metric([namespace, result], float(row.get(result, 0)))
            for outcome, counter in LEASE_OUTCOMES:
                leases.add_metric([namespace, outcome], float(row.get(counter, 0)))
        yield requests
        yield leases
        for suffix, doc, counter in SIMPLE_COUNTERS:
            family = CounterMetricFamily(f"{PREFIX}_{suffix}", doc, labels=["namespace"])
            for namespace, row in sorted(self.totals.items()):
                family.add_metric([namespace], float(row.get(counter, 0)))
            yield family
        replicas = CounterMetricFamily(
            f"{PREFIX}_replica_reads",
            "Hot-key reads served by each replica shard",
            labels=["namespace", "replica"],
        )
        for labels, count in sorted(self.replica_reads.items()):
            replicas.add_metric(list(labels), float(count))
        yield replicas

    def gauge_families(self) -> Iterator[Metric]:
        """Hot keys and L1 sizes per namespace, then the breakers."""
        hot = GaugeMetricFamily(
            f"{PREFIX}_hot_keys",
            "Keys currently treated as hot by this process (detected + static)",
            labels=["namespace"],
        )
        for namespace, count in sorted(self.hot_keys.items()):
            hot.add_metric([namespace], float(count))
        yield hot
        l1_gauge = GaugeMetricFamily(
            f"{PREFIX}_l1_entries", "Entries in the in-process L1", labels=["namespace"]
        )
        for namespace, count in sorted(self.l1_entries.items()):
            l1_gauge.add_metric([namespace], float(count))
        yield l1_gauge
        yield self.breaker
        yield self.transitions
        yield self.purges
        yield from self.backplane.families()


def _exported(cache: LayeredCache | SyncLayeredCache) -> LayeredCache | SyncLayeredCache:
    """What the collector holds for ``cache``: the facade that built it, if one did."""
    if isinstance(cache, LayeredCache):
        return facade_of(cache) or cache
    return cache


def _running(exported: LayeredCache | SyncLayeredCache) -> LayeredCache | None:
    """The cache that serves ``exported`` in this process now (None: a facade closed, or
    not yet used in this worker)."""
    return exported.running_cache() if isinstance(exported, SyncLayeredCache) else exported


def _hot_keys(cache: LayeredCache) -> dict[str, Any]:
    try:
        return cache.hot_keys()
    except Exception:  # a scrape must never fail because of one cache
        return {}


def _l1_entries(cache: LayeredCache) -> dict[str, int]:
    result: dict[str, int] = {}
    for namespace in cache:
        l1 = namespace.policy.l1
        if l1 is not None:
            result[namespace.name] = len(l1)
    return result


_collectors: weakref.WeakKeyDictionary[CollectorRegistry, CacheCollector] = (
    weakref.WeakKeyDictionary()
)
_collectors_lock = ForkSafeLock()  # renewed in a forked child (``_forklock``)


def register_cache(
    cache: LayeredCache | SyncLayeredCache, registry: CollectorRegistry = REGISTRY
) -> CacheCollector | None:
    """Export ``cache`` on ``registry`` (default: the global one). Idempotent. A
    ``SyncLayeredCache`` (or its ``.cache``) is exported through whichever inner cache it
    runs at scrape time (module doc).

    Returns the registry's collector, or None when ``metrics.enabled = false``.
    """
    if not cache.config.metrics.enabled:
        return None
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = CacheCollector()
            registry.register(collector)
            _collectors[registry] = collector
    collector.add(cache)
    return collector


def unregister_cache(
    cache: LayeredCache | SyncLayeredCache, registry: CollectorRegistry = REGISTRY
) -> None:
    """Stop exporting ``cache``. Its counters stay in the sums as they are now (retired:
    a counter never decreases), and so do its histograms."""
    collector = _collectors.get(registry)
    if collector is not None:
        collector.remove(cache)


def render_metrics(registry: CollectorRegistry = REGISTRY) -> tuple[bytes, str]:
    """The body and Content-Type for a ``/metrics`` response."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
