"""The daemon's Redis side: the client, the fleet check at start, the chunked deletes.

The client is the library's (``clients.make_client``) with a longer timeout
(``clients.with_timeout``): one wiring for the library, the CLI and the daemon.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import structlog

from layered_cache._backplane import BackplanePublisher
from layered_cache._breaker import CircuitBreaker
from layered_cache._clients import (
    REDIS_FAILURES,
    RedisClient,
    make_client,
    ping_every_master,
    with_timeout,
)
from layered_cache._config import Config
from layered_cache._invalidation import Invalidator, check_replica_counts, replica_counts
from layered_cache._keys import backplane_stream_name
from layered_cache._l2 import L2Store, L2Unavailable
from layered_cache._memory_policy import log_memory_policies, tagged_namespaces
from layered_cache._tags import invalidate_tags, version_ttl
from layered_cache.daemon.stats import DaemonStats

__all__ = ["DELETE_FAILURES", "Deleter"]

_log = structlog.get_logger("layered_cache.daemon")
#: What makes an invalidation attempt fail and be retried (Redis down, breaker open...).
DELETE_FAILURES: tuple[type[BaseException], ...] = (L2Unavailable, *REDIS_FAILURES)
# Keys per Invalidator call: bounds one DEL/pipeline (x replicas + lease) and one XADD.
_CHUNK = 1000
# The daemon is not on a request path: give Redis time rather than retrying a big batch.
_MIN_REDIS_TIMEOUT = 2.0


class Deleter:
    """Deletes a batch's keys (base, replicas, lease), then appends them to the backplane."""

    def __init__(self, config: Config) -> None:
        redis = config.redis
        self.client: RedisClient = make_client(
            with_timeout(redis, max(redis.timeout, _MIN_REDIS_TIMEOUT))
        )
        self._config = config
        self._version_ttl = version_ttl(config)  # tag token keys' life (``_tags``)
        breaker = CircuitBreaker(redis.breaker.failures, redis.breaker.reset)
        publisher = None
        if config.backplane.enabled:
            stream = backplane_stream_name(redis.prefix, config.backplane.stream)
            publisher = BackplanePublisher(self.client, stream, config.backplane.maxlen)
        self._store = L2Store(self.client, breaker)
        self._invalidator = Invalidator(self._store, publisher)
        self._replicas_checked = False

    async def check_replicas(self) -> None:
        """Raise ReplicaCountMismatch if this config's hot.replicas differ from the fleet's:
        the daemon would leave replicas behind. Redis unreachable: start, and check
        before the first delete (``delete``)."""
        try:
            await self._check_replicas()
        except REDIS_FAILURES as exc:
            _log.warning(
                "replica_counts_unchecked", error=type(exc).__name__, until="first_delete"
            )

    async def _check_replicas(self) -> None:
        config = self._config
        await check_replica_counts(self.client, config.redis.prefix, replica_counts(config))
        self._replicas_checked = True

    async def check_memory_policy(self) -> None:
        """Log each master's maxmemory-policy and what it means when Redis is full."""
        redis = self._config.redis
        tagged = tagged_namespaces(self._config)
        await log_memory_policies(self.client, 2 * (redis.connect_timeout + redis.timeout), tagged)

    async def delete(
        self, keys: list[tuple[str, int]], stats: DaemonStats, tags: Sequence[str] = ()
    ) -> None:
        """Raises DELETE_FAILURES; the chunks done before a failure stay done (and are
        redone by the retry: deleting is idempotent, and so is a new tag version).
        Raises ReplicaCountMismatch (the daemon stops) before deleting anything if the
        count could not be checked at start and differs from the fleet's."""
        if not self._replicas_checked:
            # Redis was down at start. Unchecked, a daemon with another hot.replicas
            # deleted a key's replicas up to its own count and committed: the fleet's
            # others served the old value for their TTL. The library starts unchecked
            # (it must work without Redis); the daemon can't delete without it anyway.
            # A Redis failure here is retried with the batch, nothing committed before.
            await self._check_replicas()
        invalidator = self._invalidator
        for start in range(0, len(keys), _CHUNK):
            before = invalidator.fallback_deliveries
            stats.names_deleted += await invalidator.invalidate(keys[start : start + _CHUNK])
            # The stream refused the append (a full Redis under noeviction) and pub/sub
            # carried it: done (no retry), but counted (``_fallback``).
            stats.backplane_fallbacks += invalidator.fallback_deliveries - before
        unique = list(dict.fromkeys(tags))
        for start in range(0, len(unique), _CHUNK):
            versions = await invalidate_tags(
                self._store,
                self._config.redis.prefix,
                unique[start : start + _CHUNK],
                self._version_ttl,
            )
            if await invalidator.announce_tags(versions):
                stats.backplane_fallbacks += 1
            stats.tags_invalidated += len(versions)

    async def ping(self) -> None:
        """Raise unless every master can take a delete (the watch's Redis probe):
        ``_clients.ping_every_master`` (a cluster client's PING asks its default node
        only: with another master dead, its slots' deletes all failing, an idle daemon
        said ready for good)."""
        await ping_every_master(self.client)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.aclose()
