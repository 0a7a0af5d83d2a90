"""Counters per namespace: plain integer attributes, so counting costs one attribute
increment on the hot path. Exporters (Prometheus) read them at scrape time."""

from __future__ import annotations

import dataclasses
from collections import Counter

__all__ = ["COUNTERS", "NamespaceStats"]


# weakref_slot and identity (eq=False: hashable): the Prometheus collector remembers
# what it retired of each (``_prometheus_retired``), and forgets it with the cache.
@dataclasses.dataclass(slots=True, weakref_slot=True, eq=False)
class NamespaceStats:
    l1_hit: int = 0  # served from this instance's memory
    l2_hit: int = 0  # served from Redis (fresh)
    miss: int = 0  # neither layer had a fresh value
    load: int = 0  # loader calls
    load_error: int = 0  # loader raised
    coalesced: int = 0  # joined an in-process load of the same key (single-flight)
    lease_won: int = 0  # took the fleet-wide lease and loaded
    lease_lost: int = 0  # another process held the lease
    lease_wait_filled: int = 0  # waited on another's lease and got its fill
    lease_timeout_load: int = 0  # waited max_wait, then loaded without writing L2
    early_refresh: int = 0  # XFetch background refreshes
    stale_served: int = 0  # fail-safe: stale value served (loader failed or too slow)
    redis_error: int = 0  # Redis failed or the breaker was open
    decode_error: int = 0  # undecodable value in Redis (treated as a miss)
    not_cached: int = 0  # value not encodable, over max_value_bytes, or refused_full
    refused_full: int = 0  # values a Redis full under noeviction refused (keys dropped)
    fill_revoked: int = 0  # fill dropped: lease revoked by an invalidation meanwhile
    l1_fill_discarded: int = 0  # L1 fill dropped: key invalidated after the read began
    replica_miss: int = 0  # hot-key replica missing, read the base key
    invalidated: int = 0  # invalidate() calls on this instance (not remote ones)
    backplane_l1_dropped: int = 0  # L1 entries dropped for a backplane entry (remote)
    set: int = 0  # set() calls
    replica_reads: Counter[int] = dataclasses.field(default_factory=Counter)

    def as_dict(self) -> dict[str, int | dict[int, int]]:
        result: dict[str, int | dict[int, int]] = {
            name: getattr(self, name) for name in COUNTERS
        }
        result["replica_reads"] = dict(sorted(self.replica_reads.items()))
        return result


COUNTERS: tuple[str, ...] = tuple(
    field.name for field in dataclasses.fields(NamespaceStats) if field.type in ("int", int)
)
