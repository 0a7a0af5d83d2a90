"""Counters per namespace: plain integer attributes, so counting costs one attribute
increment on the hot path. Exporters (Prometheus) read them at scrape time."""

from __future__ import annotations

from collections import Counter

__all__ = ["COUNTERS", "NamespaceStats"]

COUNTERS = (
    "l1_hit",
    "l2_hit",
    "miss",
    "load",
    "load_error",
    "coalesced",
    "lease_won",
    "lease_lost",
    "lease_wait_filled",
    "lease_timeout_load",
    "early_refresh",
    "stale_served",
    "redis_error",
    "decode_error",
    "not_cached",
    "fill_revoked",
    "l1_fill_discarded",
    "replica_miss",
    "invalidated",
    "set",
)


class NamespaceStats:
    __slots__ = (*COUNTERS, "replica_reads")

    def __init__(self) -> None:
        for name in COUNTERS:
            setattr(self, name, 0)
        self.replica_reads: Counter[int] = Counter()

    def as_dict(self) -> dict[str, int | dict[int, int]]:
        result: dict[str, int | dict[int, int]] = {
            name: getattr(self, name) for name in COUNTERS
        }
        result["replica_reads"] = dict(sorted(self.replica_reads.items()))
        return result
