"""A Redis Cluster client whose slot map, once known, is refreshed off the request path.

Why (issue 21, a master failover stalled every request for 3-4 s): redis-py refreshes
the slot map *on the request path*. After any connection error or timeout it flags the
client, and the next command of *any* key, on any master, waits on one lock while
CLUSTER SLOTS is asked of the startup nodes (a dead one first costs its connect
timeout); the refresh then marks every connection for reconnect. With its default
retries (each one a refresh, plus a 0.25 s sleep after closing every connection on
CLUSTERDOWN) a dead master's keys waited seconds and healthy masters' keys up to 0.85 s.

Here the first discovery still blocks (there is nothing to route with yet). Every later
refresh runs in one background task, at most one every ``MIN_GAP`` seconds, while
requests keep routing with the map they have: a key whose master is gone fails fast on
its node's breaker and falls through to the loader, keys on healthy masters are
untouched. Listeners (``L2Store`` drops the breakers of masters that left the map) run
after each refresh.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.cluster import PRIMARY, get_node_name

from layered_cache._logs import error_text

__all__ = ["MIN_GAP", "RefreshingCluster"]

MIN_GAP = 0.25  # seconds between background refreshes: each one reconnects every node
_log = structlog.get_logger("layered_cache.cluster")


class RefreshingCluster(RedisCluster):
    """``RedisCluster`` that refreshes a known slot map in the background."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refresher: asyncio.Task[None] | None = None
        self._last_refresh = 0.0
        self.refresh_listeners: list[Callable[[], None]] = []
        self._unmapped: dict[str, ClusterNode] = {}  # redirect targets no map lists

    def get_node(
        self, host: str | None = None, port: int | None = None, node_name: str | None = None
    ) -> ClusterNode | None:
        """``RedisCluster.get_node``; a node by address that no slot map lists is made
        (and kept, one per address, closed with the client). Why: a master just added to
        the cluster owns no slot until its first one has moved to it, so no map lists
        it, and redis-py followed an ASK there by calling a method on None (an
        AttributeError, counted against the source master's breaker:
        redis/redis-py#4015). redis-py 8.2 asks by host and port, 8.0 by "host:port";
        its cluster pub/sub, which asks whether a node is still known the same way, is
        not used here (fill notifications hold a client per master)."""
        node = super().get_node(host, port, node_name)
        if node is not None:
            return node
        if host and port:
            name = get_node_name(host, port)
        elif node_name and ":" in node_name:  # redis-py 8.0 asks by "host:port"
            name = node_name
        else:
            return None
        if name not in self._unmapped:
            address, _, number = name.rpartition(":")
            kwargs = self.nodes_manager.connection_kwargs
            self._unmapped[name] = ClusterNode(address, int(number), PRIMARY, **kwargs)
        return self._unmapped[name]

    async def initialize(
        self,
        additional_startup_nodes_info: list[tuple[str, int]] | None = None,
        last_failed_node_name: str | None = None,
    ) -> RefreshingCluster:
        """redis-py calls this before a command whenever it flagged the map as stale."""
        if not self._initialize or not self.nodes_manager.slots_cache:
            await super().initialize(additional_startup_nodes_info, last_failed_node_name)
            return self
        # A map is known: serve with it, refresh it behind the requests.
        self._initialize = False
        if self.nodes_manager.default_node is None and self.get_primaries():
            # redis-py's reset (aclose on CLUSTERDOWN) cleared it; failed nodes are at the
            # end of its node list, so the first primary is the likeliest healthy one.
            self.nodes_manager.default_node = self.get_primaries()[0]
        self.refresh_soon()
        return self

    def refresh_soon(self) -> None:
        """Start a background refresh unless one is pending (single flight)."""
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        await asyncio.sleep(max(0.0, self._last_refresh + MIN_GAP - time.monotonic()))
        self._last_refresh = time.monotonic()
        try:
            await self.nodes_manager.initialize()
        except Exception as exc:  # no startup node answered: the next failure asks again
            self._initialize = True
            _log.warning("cluster_refresh_failed", error=error_text(exc))
            return
        for listener in self.refresh_listeners:
            listener()

    async def aclose(self) -> None:
        # Also called by redis-py itself to reset the client (CLUSTERDOWN): a refresh in
        # flight is then stale too, and the next command starts a new one.
        if self._refresher is not None and not self._refresher.done():
            self._refresher.cancel()
        unmapped, self._unmapped = list(self._unmapped.values()), {}
        for node in unmapped:
            await node.disconnect()
        await super().aclose()
