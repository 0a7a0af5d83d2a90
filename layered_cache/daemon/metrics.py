"""Prometheus metrics of the daemon, on a registry of its own.

A registry per daemon (not the global one) so several daemons can run in one process
(tests, embedding) without "Duplicated timeseries" errors.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["DaemonMetrics"]

_PREFIX = "layered_cache_daemon_"


class DaemonMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events = Counter(
            _PREFIX + "events_total", "Valid events processed, by type", ["type"], registry=r
        )
        self.keys_invalidated = Counter(
            _PREFIX + "keys_invalidated_total",
            "Cache keys invalidated (deduplicated per batch)",
            registry=r,
        )
        self.names_deleted = Counter(
            _PREFIX + "keys_deleted_total",
            "Redis names that existed and were deleted (base keys, replicas, leases)",
            registry=r,
        )
        self.dead_letters = Counter(
            _PREFIX + "dead_letters_total", "Poison events written to the DLQ", registry=r
        )
        self.dead_letters_rejected = Counter(
            _PREFIX + "dead_letters_rejected_total",
            "Poison events the DLQ refused for good (too large, invalid): set aside, logged",
            registry=r,
        )
        self.tombstones = Counter(
            _PREFIX + "tombstones_total", "Null-value records (tombstones) skipped", registry=r
        )
        self.connect_retries = Counter(
            _PREFIX + "connect_retries_total",
            "Failed attempts to reach the Kafka broker at start (retried)",
            registry=r,
        )
        self.redis_retries = Counter(
            _PREFIX + "redis_retries_total", "Failed invalidation attempts (retried)", registry=r
        )
        self.commits = Counter(_PREFIX + "commits_total", "Offset commits", registry=r)
        self.commit_failures = Counter(
            _PREFIX + "commit_failures_total",
            "Commits refused (partition moved in a rebalance; redelivered elsewhere)",
            registry=r,
        )
        self.batch_seconds = Histogram(
            _PREFIX + "batch_seconds",
            "Batch latency: decode + invalidate + DLQ + commit",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.lag = Gauge(
            _PREFIX + "lag",
            "Messages behind the high watermark",
            ["topic", "partition"],
            registry=r,
        )
        self.assigned = Gauge(_PREFIX + "assigned_partitions", "Partitions owned", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
