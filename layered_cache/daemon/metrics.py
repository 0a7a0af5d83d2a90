"""Prometheus exposition of the daemon, read from ``DaemonStats`` at scrape time.

Nothing is counted here: the collector turns the one set of counters (``DaemonStats``)
and the daemon's partition state (lag, assignment) into metric families when
``/metrics`` is scraped, the way ``layered_cache.prometheus`` exports the cache. The
registry is one per daemon (not the global one) so several daemons can run in one
process (tests, embedding) without "Duplicated timeseries" errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from layered_cache._purges import PurgeStats
from layered_cache.daemon.stats import BATCH_BUCKETS, DaemonStats

__all__ = ["COUNTER_METRICS", "DaemonMetrics", "PartitionView"]

_PREFIX = "layered_cache_daemon_"

#: (metric name without ``_total``, help, DaemonStats field) of the unlabelled counters.
COUNTER_METRICS: tuple[tuple[str, str, str], ...] = (
    ("keys_invalidated", "Cache keys invalidated (deduplicated per batch)", "keys"),
    ("keys_deleted",
     "Redis names that existed and were deleted (base keys, replicas, leases)",
     "names_deleted"),
    ("tags_invalidated", "Tags given a new version (every entry carrying them dies)",
     "tags_invalidated"),
    ("dead_letters", "Poison events written to the DLQ", "dead_letters"),
    ("dead_letters_rejected",
     "Poison events the DLQ refused for good (too large, invalid): set aside, logged",
     "dead_letters_rejected"),
    ("tombstones", "Null-value records (tombstones) skipped", "tombstones"),
    ("connect_retries", "Failed attempts to reach the Kafka broker at start (retried)",
     "connect_retries"),
    ("redis_retries", "Failed invalidation attempts (retried)", "redis_retries"),
    ("backplane_fallbacks",
     "Announcements the backplane stream refused (full Redis) sent over pub/sub instead",
     "backplane_fallbacks"),
    ("commits", "Offset commits", "commits"),
    ("commit_failures",
     "Commits refused (partition moved in a rebalance; redelivered elsewhere)",
     "commit_failures"),
)  # fmt: skip

#: The daemon's partition state at scrape time: ({(topic, partition): lag}, owned count).
PartitionView = Callable[[], tuple[Mapping[tuple[str, int], int], int]]


class DaemonMetrics(Collector):
    """``render()`` is the ``/metrics`` body; ``registry`` holds only this collector."""

    def __init__(
        self, stats: DaemonStats, partitions: PartitionView, purges: PurgeStats | None = None
    ) -> None:
        self._stats = stats
        self._partitions = partitions
        self._purges = purges or PurgeStats()  # HTTP caches ([purge]): docs/http.md
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def describe(self) -> Iterator[Metric]:
        # Families are read at scrape time: don't let register() collect at start.
        return iter(())

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        events = CounterMetricFamily(
            _PREFIX + "events", "Valid events processed, by type", labels=["type"]
        )
        for event_type, count in stats.event_types.items():
            events.add_metric([event_type], float(count))
        yield events
        for name, doc, field in COUNTER_METRICS:
            yield CounterMetricFamily(_PREFIX + name, doc, value=float(getattr(stats, field)))
        yield self._batch_seconds()
        yield from self._partition_gauges()
        purges = CounterMetricFamily(
            _PREFIX + "http_purges",
            "Keys and tags sent to HTTP caches ([purge]), by outcome; failed and dropped "
            "ones are bounded by s-maxage",
            labels=["outcome"],
        )
        for outcome in ("submitted", "delivered", "repeated", "retries", "failed", "dropped"):
            purges.add_metric([outcome], float(getattr(self._purges, outcome)))
        yield purges

    def _batch_seconds(self) -> HistogramMetricFamily:
        stats = self._stats
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for bound, count in zip((*BATCH_BUCKETS, float("inf")), stats.batch_seconds, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
        return HistogramMetricFamily(
            _PREFIX + "batch_seconds",
            "Batch latency: decode + invalidate + DLQ + commit",
            buckets=buckets,
            sum_value=stats.batch_seconds_sum,
        )

    def _partition_gauges(self) -> Iterator[Metric]:
        lag, owned = self._partitions()
        behind = GaugeMetricFamily(
            _PREFIX + "lag", "Messages behind the high watermark", labels=["topic", "partition"]
        )
        for (topic, partition), count in sorted(lag.items()):
            behind.add_metric([topic, str(partition)], float(count))
        yield behind
        yield GaugeMetricFamily(_PREFIX + "assigned_partitions", "Partitions owned", value=owned)
