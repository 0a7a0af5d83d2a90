"""Build a cache's parts from its config: Redis clients, the guarded L2 store, the
fill-notification connection and the backplane publisher.

``LayeredCache.from_config`` calls ``build_parts``; the constructor takes the parts, so
a test (or an application with its own clients) can inject them. Nothing here does I/O:
clients connect on first use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster

from layered_cache._backplane import BackplanePublisher
from layered_cache._breaker import CircuitBreaker
from layered_cache._clients import RedisClient, listener_connection, make_client, make_node_client
from layered_cache._config import Config
from layered_cache._keys import backplane_stream_name
from layered_cache._l2 import L2Store
from layered_cache._notify import ClusterFillNotifier, FillNotifier, Notifier

__all__ = ["CacheParts", "build_parts", "new_instance_id", "read_cap"]


@dataclass(slots=True, eq=False)
class CacheParts:
    instance_id: str  # names this process in backplane entries and fleet reports
    client: RedisClient
    store: L2Store
    notifier: Notifier
    publisher: BackplanePublisher | None  # None: backplane switched off
    listener_client: RedisClient | None  # its own client: XREAD blocks a connection
    stream: str | None  # the backplane stream's name
    # Its own pub/sub connection for the backplane's fallback channel (``_fallback``).
    fallback_client: redis.Redis | None = None

    async def close(self) -> None:
        await self.notifier.close()
        if self.store.direct is not None:  # its kept connections go back to the pool
            await self.store.direct.close()
        for client in (self.client, self.listener_client, self.fallback_client):
            if client is not None:
                try:
                    await client.aclose()
                except Exception:  # closing must not mask the error that made us close
                    continue


def new_instance_id() -> str:
    """Names one process's cache in backplane entries (their ``origin``: a listener skips
    its own) and fleet hot-key reports."""
    return os.urandom(6).hex()


def read_cap(config: Config) -> int:
    """The most a single-key GET reads (``L2Store.get``): no namespace writes an envelope
    over its ``max_value_bytes``, so anything far longer is not ours. Read whole, a
    foreign 100 MB string took 250-390 ms, past ``redis.timeout``: a Redis failure for
    the breaker of every key, at every read, and never replaced. Twice the largest
    limit: values written before a limit was lowered are still read."""
    largest = max((ns.max_value_bytes for ns in config.namespaces.values()), default=0)
    return 2 * largest + 65_536


def build_parts(config: Config) -> CacheParts:
    instance_id = new_instance_id()
    breaker = CircuitBreaker(config.redis.breaker.failures, config.redis.breaker.reset)
    client = make_client(config.redis)
    # A cluster operation's overall deadline: one connect (a cold or re-established
    # connection) plus one command, the bound each single step already had.
    deadline = config.redis.connect_timeout + config.redis.timeout
    store = L2Store(
        client, breaker, config.redis.max_connections, deadline, config.redis.busy_poll,
        reply_cap=read_cap(config),
    )
    publisher = listener_client = stream = fallback_client = None
    if config.backplane.enabled:
        stream = backplane_stream_name(config.redis.prefix, config.backplane.stream)
        publisher = BackplanePublisher(client, stream, config.backplane.maxlen, instance_id)
        listener_client = listener_connection(config.redis, config.backplane)
        fallback_client = make_node_client(config.redis)
    return CacheParts(
        instance_id=instance_id,
        client=client,
        store=store,
        notifier=_notifier(config, client),
        publisher=publisher,
        listener_client=listener_client,
        stream=stream,
        fallback_client=fallback_client,
    )


def _notifier(config: Config, client: RedisClient) -> Notifier:
    """Fill notifications: one connection to the URL's node, or in a cluster one per
    master for sharded pub/sub (see ``_notify``)."""
    if isinstance(client, RedisCluster):
        return ClusterFillNotifier(client, lambda node: make_node_client(config.redis, node))
    return FillNotifier(make_node_client(config.redis))
