"""Which circuit breaker guards a Redis operation.

In a cluster each master gets its own breaker: one dead master must not make every
instance skip the healthy ones (all their reads would fall through to the database
during a failover), nor refuse their writes (a key's ``set()`` and ``invalidate()``
touch the key and its lease, one slot: that master's breaker). Operations on names of
several masters, a single node, and a slot map not known yet use the shared breaker; a
batch splits its names by master first (``by_master``, ``_l2batch``).
Breakers of masters that left the slot map are dropped, so a failed-over master doesn't
show "open" in ``redis_status()`` and the metrics forever.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from layered_cache._breaker import CircuitBreaker
from layered_cache._clients import RedisClient

__all__ = ["NodeBreakers"]


class NodeBreakers:
    """The shared breaker, and in a cluster one per master (``by_node``, by host:port)."""

    def __init__(self, client: RedisClient, shared: CircuitBreaker) -> None:
        self.shared = shared
        self.by_node: dict[str, CircuitBreaker] = {}
        self._cluster = client if isinstance(client, RedisCluster) else None

    def for_name(self, name: str | None) -> CircuitBreaker:
        """The breaker guarding the node that holds ``name`` (None: a multi-key
        operation, guarded by the shared breaker)."""
        if self._cluster is None or name is None:
            return self.shared
        node = self._node_of(name)
        return self.shared if node is None else self._of_node(node)

    def for_names(self, names: Iterable[str | bytes]) -> CircuitBreaker:
        """``for_name`` for an operation on several names: the breaker of their master
        if they all live on one (a key and its lease), else the shared one."""
        if self._cluster is None:
            return self.shared
        nodes = {self._node_of(name) for name in names}
        node = nodes.pop() if len(nodes) == 1 else None
        return self.shared if node is None else self._of_node(node)

    def by_master(self, names: Sequence[str | bytes]) -> list[list[int]]:
        """The positions of ``names`` grouped by the master holding them, in order: each
        group's operation is guarded by that master's breaker (``for_names``). One group
        on a single node; names whose slot the map doesn't know yet form one more (the
        shared breaker's). No group for no names."""
        if self._cluster is None:
            return [list(range(len(names)))] if names else []
        groups: dict[str | None, list[int]] = {}
        for position, name in enumerate(names):
            groups.setdefault(self._node_of(name), []).append(position)
        return list(groups.values())

    def _node_of(self, name: str | bytes) -> str | None:
        assert self._cluster is not None
        raw = name.encode() if isinstance(name, str) else name
        nodes = self._cluster.nodes_manager.slots_cache.get(key_slot(raw))
        return nodes[0].name if nodes else None

    def _of_node(self, node: str) -> CircuitBreaker:
        breaker = self.by_node.get(node)
        if breaker is None:
            breaker = self.by_node[node] = self.shared.sibling(f"redis {node}")
        return breaker

    def drop_gone(self) -> None:
        """Forget the breakers of masters no longer in the slot map (run after each
        slot-map refresh). A master that comes back gets a fresh breaker on its first
        request."""
        if self._cluster is None:
            return
        slots = self._cluster.nodes_manager.slots_cache
        masters = {nodes[0].name for nodes in slots.values() if nodes}
        for node in set(self.by_node) - masters:
            del self.by_node[node]
