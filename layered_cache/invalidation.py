"""Invalidation: delete a key everywhere it may live, then tell every instance.

For each key: the base key, every replica name the namespace may have written (whether
or not this process thinks the key is hot: another instance may have), and the lease
(so an in-flight fill that read the database before this invalidation can no longer
write: its compare-and-write sees a missing lease). All names go out in one pipelined
round trip per node. Only then are the keys appended to the backplane stream: an
instance that drops its L1 copy on that message can only refill from the new L2 state.

Idempotent: deleting missing names is harmless, so at-least-once delivery is fine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from layered_cache.backplane import BackplanePublisher
from layered_cache.keys import lease_name, replica_names
from layered_cache.l2 import L2Store

__all__ = ["Invalidator", "names_to_delete"]


def names_to_delete(key: str, replicas: int) -> list[str]:
    return [key, *replica_names(key, replicas), lease_name(key)]


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
        names: list[str] = []
        for key, replicas in targets:
            keys.append(key)
            names.extend(names_to_delete(key, replicas))
        if not keys:
            return 0
        deleted = await self._l2.delete(names)
        await self.announce(keys)
        return deleted

    async def announce(self, keys: Sequence[str]) -> None:
        if self._backplane is not None and keys:
            await self._backplane.publish(keys)
