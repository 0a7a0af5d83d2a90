"""Invalidation: delete a key everywhere it may live, then tell every instance.

For each key: the base key, every replica name the namespace may have written (whether
or not this process thinks the key is hot: another instance may have), the lease (so an
in-flight fill that read the database before this invalidation can no longer write: its
compare-and-write sees a missing lease) and each replica's own lease ``{key#i}:lease``.
Only then are the keys appended to the backplane stream: an instance that drops its L1
copy on that message can only refill from the new L2 state.

Order matters for replicas (stale-set safety of hot fills, see ``LayeredCache._fill``):
phase 1 deletes the base key with its lease, phase 2 - strictly afterwards - every
replica with its replica lease. A fill whose lease check on the base key succeeded did so
before phase 1, and it reserved its replica leases before that check, so phase 2 deletes
those reservations and any replica written under them. Each phase is one pipelined round
trip per node (in a cluster: one DEL per slot, a key and its lease in one command); on a
single node both phases are one atomic DEL.

Idempotent: deleting missing names is harmless, so at-least-once delivery is fine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from layered_cache.backplane import BackplanePublisher
from layered_cache.keys import lease_name, replica_names
from layered_cache.l2 import L2Store

__all__ = ["Invalidator", "delete_phases", "names_to_delete"]


def delete_phases(key: str, replicas: int) -> tuple[list[str], list[str]]:
    """(base key and lease, replicas and their leases): deleted in this order."""
    shards = replica_names(key, replicas)
    return [key, lease_name(key)], [name for shard in shards for name in (shard, lease_name(shard))]


def names_to_delete(key: str, replicas: int) -> list[str]:
    base, shards = delete_phases(key, replicas)
    return base + shards


class Invalidator:
    def __init__(self, l2: L2Store, backplane: BackplanePublisher | None) -> None:
        self._l2 = l2
        self._backplane = backplane

    async def invalidate(self, targets: Iterable[tuple[str, int]]) -> int:
        """``targets``: (full key, replica count). Returns how many names existed.

        Raises ``L2Unavailable`` or a Redis error when Redis fails: the caller retries
        (nothing is reported done before the keys are gone).
        """
        keys: list[str] = []
        bases: list[str] = []
        shards: list[str] = []
        for key, replicas in targets:
            keys.append(key)
            base, replica_shards = delete_phases(key, replicas)
            bases.extend(base)
            shards.extend(replica_shards)
        if not keys:
            return 0
        deleted = await self._l2.delete_in_order([bases, shards] if shards else [bases])
        await self.announce(keys)
        return deleted

    async def announce(self, keys: Sequence[str]) -> None:
        if self._backplane is not None and keys:
            # Through the store's concurrency bound: a burst of set()/invalidate() must
            # not open a connection per caller (the pool itself is uncapped).
            async with self._l2.slots:
                await self._backplane.publish(keys)
