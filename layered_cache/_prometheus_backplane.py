"""The backplane listener's metrics (``layered_cache.prometheus``): one series per
cache instance. Imported by that module only, once prometheus-client is known to be
there."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from layered_cache._backplane import BackplaneStatus

__all__ = ["PREFIX", "BackplaneFamilies"]

PREFIX = "layered_cache"


class BackplaneFamilies:
    """Each cache's backplane listener (L1 coherence), one series per instance."""

    def __init__(self) -> None:
        def counter(suffix: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_backplane_{suffix}", doc, labels=["instance"])

        def gauge(suffix: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_backplane_{suffix}", doc, labels=["instance"])

        self.entries = counter(
            "entries_applied", "Backplane entries from the daemon or other instances applied"
        )
        self.keys = counter("keys_applied", "Keys in the backplane entries applied")
        self.gaps = counter(
            "gaps", "Whole-L1 clears: the stream was trimmed past our position, or deleted"
        )
        self.errors = counter(
            "errors", "Bugs the listener met reading or applying entries (each cleared L1)"
        )
        self.fallback_sent = counter(
            "fallback_sent",
            "Announcements the stream refused (full Redis) this instance sent over pub/sub",
        )
        self.fallback_received = counter(
            "fallback_received", "Announcements from others received over the pub/sub fallback"
        )
        self.connected = gauge("connected", "1 while the backplane listener is connected")
        self.lag = gauge(
            "lag_seconds",
            "Age of the newest backplane entry when read (0: caught up); while "
            "disconnected, at least the time since the connection was lost",
        )

    def add(self, instance: str, status: BackplaneStatus) -> None:
        self.entries.add_metric([instance], float(status.entries_applied))
        self.keys.add_metric([instance], float(status.keys_applied))
        self.gaps.add_metric([instance], float(status.gaps))
        self.errors.add_metric([instance], float(status.errors))
        self.fallback_sent.add_metric([instance], float(status.fallback_sent))
        self.fallback_received.add_metric([instance], float(status.fallback_received))
        self.connected.add_metric([instance], 1.0 if status.connected else 0.0)
        self.lag.add_metric([instance], status.lag_seconds)

    def families(self) -> Iterator[Metric]:
        yield from (self.entries, self.keys, self.gaps, self.errors, self.fallback_sent)
        yield from (self.fallback_received, self.connected, self.lag)
