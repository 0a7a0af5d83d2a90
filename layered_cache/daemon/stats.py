"""The daemon's counters: one plain struct, the only place anything is counted.

``/readyz``, the ``daemon_stopped`` log line, tests and the Prometheus exposition
(``layered_cache.daemon.metrics``, which reads this struct at scrape time) all see the
same numbers, so they can't drift apart the way two sets of counters incremented side
by side did. Everything runs on the daemon's one event loop: no locks.
"""

from __future__ import annotations

import bisect

import msgspec

__all__ = ["BATCH_BUCKETS", "COUNTERS", "DaemonStats"]

#: Upper bounds (seconds) of the batch latency histogram's buckets.
BATCH_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class DaemonStats(msgspec.Struct):
    """Plain counters, read by tests, embedding code, ``/readyz`` and ``/metrics``."""

    batches: int = 0
    events: int = 0
    keys: int = 0
    names_deleted: int = 0
    tags_invalidated: int = 0  # tags given a new version (route targets { tag = ... })
    dead_letters: int = 0
    dead_letters_rejected: int = 0  # refused for good by the producer/broker: set aside
    tombstones: int = 0
    redis_retries: int = 0
    # Announcements the backplane stream refused (a full Redis under noeviction) that
    # went over pub/sub instead (``layered_cache._fallback``).
    backplane_fallbacks: int = 0
    connect_retries: int = 0
    commits: int = 0
    commit_failures: int = 0
    # Valid events per ``type`` (their sum is ``events``).
    event_types: dict[str, int] = msgspec.field(default_factory=dict)
    # Batch latency: one count per bucket of BATCH_BUCKETS, then the count above the
    # last bound (+Inf); plus the sum of every observation.
    batch_seconds: list[int] = msgspec.field(default_factory=lambda: [0] * (len(BATCH_BUCKETS) + 1))
    batch_seconds_sum: float = 0.0

    def count_events(self, types: dict[str, int]) -> None:
        for event_type, count in types.items():
            self.event_types[event_type] = self.event_types.get(event_type, 0) + count
            self.events += count

    def batch_done(self, seconds: float) -> None:
        """One more batch, and its latency (the histogram's count is ``batches``)."""
        # bisect_left: a value equal to a bound falls in that bound's bucket (le="...").
        self.batch_seconds[bisect.bisect_left(BATCH_BUCKETS, seconds)] += 1
        self.batch_seconds_sum += seconds
        self.batches += 1

    def totals(self) -> dict[str, int]:
        """The scalar counters (``/readyz`` and the ``daemon_stopped`` log line)."""
        return {name: getattr(self, name) for name in COUNTERS}


#: The scalar counters of DaemonStats, in declaration order.
COUNTERS: tuple[str, ...] = tuple(
    field.name for field in msgspec.structs.fields(DaemonStats) if field.type is int
)
