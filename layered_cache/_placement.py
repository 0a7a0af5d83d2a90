"""Which replica of a hot key to read: balanced per Redis Cluster master.

CRC16 places a key's replica names on the masters unevenly, so "pick a name uniformly"
would not spread a hot key's reads evenly over the nodes, which is the point of
replicas. See ``ReplicaPlacement.pick``.
"""

from __future__ import annotations

import random
import time

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from layered_cache._clients import RedisClient
from layered_cache._keys import replica_name

__all__ = ["ReplicaPlacement"]

_PLAN_TTL = 30.0  # seconds a per-key replica placement plan is trusted
_MAX_PLANS = 4096


class ReplicaPlacement:
    def __init__(self, client: RedisClient) -> None:
        self.client = client
        self._cluster = isinstance(client, RedisCluster)
        # key -> (rebuild after, replica indexes grouped per master, replica range)
        self._plans: dict[str, tuple[float, list[list[int]], range]] = {}

    def pick(self, key: str, replicas: int) -> int:
        """Index of the replica of ``key`` to read.

        Single node: uniform. Cluster: uniform over the masters that hold a replica of
        ``key``, then uniform among that master's replicas. CRC16 places 8 names on 3
        masters unevenly (4/2/2 is typical), so a uniform choice of name would leave one
        master with 50% of the key's reads; balancing per master gives each 1/3 whenever
        every master holds a replica (~88% of keys). The plan is cached per key and
        rebuilt after ``_PLAN_TTL`` s: a stale plan after a reshard costs balance only,
        never correctness (redis-py still routes each GET by its slot, following MOVED).
        """
        if not self._cluster:
            return random.randrange(replicas)
        now = time.monotonic()
        cached = self._plans.get(key)
        if cached is None or cached[0] < now or len(cached[2]) != replicas:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()  # bounded: hot keys are few, cold ones age out here
            plan = self._plan(key, replicas)
            # No slot map yet: fall back to uniform, and look again soon.
            cached = (now + (_PLAN_TTL if plan else 1.0), plan, range(replicas))
            self._plans[key] = cached
        groups = cached[1]
        if not groups:
            return random.randrange(replicas)
        group = groups[random.randrange(len(groups))]
        return group[random.randrange(len(group))]

    def _plan(self, key: str, replicas: int) -> list[list[int]]:
        """Replica indexes grouped by the master that owns their slot ([] if the slot
        map is not known yet: the client learns it on its first command)."""
        assert isinstance(self.client, RedisCluster)
        groups: dict[str, list[int]] = {}
        try:
            for index in range(replicas):
                node = self.client.get_node_from_key(replica_name(key, index))
                if node is None:
                    return []
                groups.setdefault(node.name, []).append(index)
        except (RedisError, RedisClusterException):  # slot map unknown or changing
            return []
        return list(groups.values())
