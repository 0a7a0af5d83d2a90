"""What ``LayeredCache.start`` does before serving, each bounded so that a cache starts
(and works, falling back to the loader) even when Redis is down."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

import structlog
from redis.asyncio.cluster import RedisCluster

from layered_cache._backplane import BackplaneListener
from layered_cache._clients import REDIS_FAILURES, RedisClient
from layered_cache._config import RedisConfig
from layered_cache._invalidation import check_replica_counts
from layered_cache._namespace import Namespace

__all__ = ["check_replicas", "learn_slots", "positioned"]

_log = structlog.get_logger("layered_cache")


async def learn_slots(client: RedisClient) -> None:
    """A cluster client learns the slot map now rather than under the first burst of
    requests (if the cluster is unreachable it retries on first use)."""
    if isinstance(client, RedisCluster):
        with contextlib.suppress(*REDIS_FAILURES):
            await client.initialize()


async def check_replicas(client: RedisClient, prefix: str, namespaces: Iterable[Namespace]) -> None:
    """Refuse to start with a hot.replicas other than the fleet's (``_invalidation``):
    raises ``ReplicaCountMismatch``. Redis unreachable: start anyway, unchecked."""
    counts = {ns.name: ns.policy.replicas for ns in namespaces if ns.policy.l2}
    try:
        await check_replica_counts(client, prefix, counts)
    except REDIS_FAILURES as exc:
        _log.warning("replica_counts_unchecked", error=type(exc).__name__)


async def positioned(listener: BackplaneListener, redis: RedisConfig) -> None:
    """Wait until the backplane listener knows its position in the stream: before that,
    an invalidation announced right after a first L1 fill would be missed, and the fill
    served for its L1 TTL (every forked worker, whose cache starts on its first request,
    opened that window)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(
            listener.connected.wait(), 2 * (redis.connect_timeout + redis.timeout)
        )
