"""Which replica of a hot key to read: balanced per Redis Cluster master, sticky per client.

Two costs pull in opposite directions. The fleet needs a hot key's reads spread evenly
over the masters (the point of replicas). One client, though, pays for talking to a
different master on every read: each GET then goes to a node whose server process was
idle a moment ago, which cost one client 10-20% of its GETs/s on the 3-master bench
cluster (bench/hotkey.py). So a client keeps one master (and one replica on it) for a
turn of at least ``STICKY_READS`` reads and ``STICKY_SECONDS`` seconds, then moves on to
the next master of its rotation. Each client starts its rotation at a random master, so
at any moment a fleet's clients sit on all masters, and each client spends its turns on
every master in turn, so the spread holds over time even for a fleet of one.
See ``ReplicaPlacement.pick``.
"""

from __future__ import annotations

import random
import time

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from layered_cache._clients import RedisClient
from layered_cache._keys import replica_name

__all__ = ["STICKY_READS", "ReplicaPlacement"]

STICKY_READS = 64  # a turn: at least this many reads of one key on one master ...
STICKY_SECONDS = 0.25  # ... and at least this long (each move costs a cold first read)
_PLAN_TTL = 30.0  # seconds a per-key replica placement plan is trusted
_MAX_KEYS = 4096


class _Choice:
    """One hot key's rotation: the replica read now and how many reads it has left."""

    __slots__ = (
        "groups",
        "index",
        "left",
        "name",
        "plan_until",
        "position",
        "replicas",
        "turn_until",
    )

    def __init__(self, groups: list[list[int]], replicas: int, plan_until: float) -> None:
        self.groups = groups  # replica indexes grouped per master ([] = no slot map yet)
        self.replicas = replicas
        self.plan_until = plan_until
        self.position = random.randrange(len(groups)) if groups else 0  # random start
        self.left = 0
        self.turn_until = 0.0
        self.index = 0
        self.name = ""


class ReplicaPlacement:
    def __init__(self, client: RedisClient) -> None:
        self.client = client
        self._cluster = isinstance(client, RedisCluster)
        self._choices: dict[str, _Choice] = {}
        # A turn on one master; sticky_reads = 1 and sticky_seconds = 0 move on every
        # read (the bench's "before"), sticky_seconds = 0 alone counts reads only (tests).
        self.sticky_reads = STICKY_READS
        self.sticky_seconds = STICKY_SECONDS

    def pick(self, key: str, replicas: int) -> tuple[int, str]:
        """(index, name) of the replica of ``key`` to read.

        Single node: uniform per read (every replica is on the same node anyway).
        Cluster: the master in turn in this client's rotation over the masters holding a
        replica of ``key``, and a random replica on it, kept for a turn (``sticky_reads``
        reads and ``sticky_seconds``, whichever ends later).
        CRC16 places 8 names on 3 masters unevenly (4/2/2 is typical), so a uniform
        choice of name would leave one master with 50% of the key's reads; rotating per
        master gives each 1/3 whenever every master holds a replica (~88% of keys).
        The per-key plan is rebuilt after ``_PLAN_TTL`` s: a stale plan after a reshard
        costs balance only, never correctness (redis-py still routes each GET by its
        slot, following MOVED).
        """
        if not self._cluster:
            index = random.randrange(replicas)
            return index, replica_name(key, index)
        choice = self._choices.get(key)
        if choice is not None and choice.left > 0 and choice.replicas == replicas:
            choice.left -= 1
            return choice.index, choice.name
        return self._rotate(key, replicas, choice)

    def move_on(self, key: str) -> None:
        """The replica read failed or was missing: the next read of ``key`` moves to the
        next master of the rotation instead of staying on this one."""
        choice = self._choices.get(key)
        if choice is not None:
            choice.left = 0
            choice.turn_until = 0.0

    def _rotate(self, key: str, replicas: int, choice: _Choice | None) -> tuple[int, str]:
        """The turn goes on if it is younger than ``sticky_seconds``; else the next master
        of ``key``'s rotation (a new plan when there is none, its replica count changed,
        or it is older than ``_PLAN_TTL``). The clock is read here, once per
        ``sticky_reads`` reads, not on every read."""
        now = time.monotonic()
        if choice is not None and choice.replicas == replicas and now < choice.turn_until:
            choice.left = self.sticky_reads - 1
            return choice.index, choice.name
        if choice is None or choice.replicas != replicas or choice.plan_until < now:
            if len(self._choices) >= _MAX_KEYS:
                self._choices.clear()  # bounded: hot keys are few, cold ones age out here
            plan = self._plan(key, replicas)
            # No slot map yet: uniform, and look again soon.
            choice = _Choice(plan, replicas, now + (_PLAN_TTL if plan else 1.0))
            self._choices[key] = choice
        else:
            choice.position += 1
        groups = choice.groups
        if groups:
            group = groups[choice.position % len(groups)]
            index = group[random.randrange(len(group))]
        else:
            index = random.randrange(replicas)
        choice.index, choice.name = index, replica_name(key, index)
        choice.left = self.sticky_reads - 1
        choice.turn_until = now + self.sticky_seconds
        return index, choice.name

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
