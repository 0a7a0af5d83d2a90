"""The relay's connection upstream: to the master that holds the backplane stream, or to
another relay (a tree of relays, ``_relay``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as redis
from redis.exceptions import ClusterDownError, ResponseError

from layered_cache._clients import (
    is_cluster,
    make_client,
    make_node_client,
    relay_client,
    with_timeout,
)
from layered_cache._config import RedisConfig
from layered_cache._stream import last_generated, missed_entries, parse_id, stream_info

__all__ = ["Upstream"]

# Clients' commands forwarded at once (catch-up reads older than the relay's memory, the
# listeners' XINFO/XREVRANGE/start markers). The pool opens a connection per command in
# flight: unbounded, a failover's catch-up of 40 instances held 40 connections on Redis
# for as long as the relay ran, against "one reader per relay".
FORWARDS_AT_ONCE = 2


class Upstream:
    """The relay's connection to the master that holds the stream (or to another relay).

    Replies are kept as the server sent them (RESP2, no redis-py response callback): the
    relay writes them back to its clients, whose own redis-py parses them."""

    def __init__(
        self, config: RedisConfig, stream: str, block: float, url: str | None = None
    ) -> None:
        # A blocking XREAD needs a socket timeout longer than its block time.
        self._config = with_timeout(config, block + 1.0)
        self._stream = stream
        self._url = url
        self._client: redis.Redis | None = None
        self._forwards = asyncio.Semaphore(FORWARDS_AT_ONCE)

    async def forward(self, *args: Any) -> Any:
        """A client's command, at most ``FORWARDS_AT_ONCE`` at a time (the others wait)."""
        async with self._forwards:
            return await self.execute(*args)

    async def execute(self, *args: Any) -> Any:
        if self._client is None:
            self._client = await self._connect()
        return await self._client.execute_command(*args)  # type: ignore[no-untyped-call]

    async def newest_id(self) -> bytes:
        """Where a relay starts: after the newest entry, or before everything if there
        is none yet (whatever is appended first is then read)."""
        newest = await self.execute("XREVRANGE", self._stream, "+", "-", "COUNT", 1)
        return bytes(newest[0][0]) if newest else b"0-0"

    async def last_generated_id(self) -> bytes:
        """A client's ``XREAD ... $``, as Redis resolves it: the stream's
        ``last-generated-id`` (``XINFO STREAM``), not its newest entry still there
        (``XREVRANGE``): after an ``XDEL`` of the newest entry, that older entry made
        the relay hand out the deleted one as "appended after the call". 0-0 when the
        stream is absent: Redis's ``$`` then waits for the first entry. Sent as a
        forwarded command (``FORWARDS_AT_ONCE``)."""
        info = await self._info(self.forward)
        return (last_generated(info) if info is not None else None) or b"0-0"

    async def time(self) -> float:
        """Redis's clock in seconds (``TIME``), for the relay's ``_redisclock.RedisClock``:
        stream IDs are stamped by it. From the stream's master, or through the relays
        above (each forwards ``TIME``): the round trip bounds the error, as for a cache."""
        seconds, micros = await self.forward("TIME")
        return int(seconds) + int(micros) / 1e6

    async def missed_entries(self, last: bytes) -> bool:
        """The listener's own test (``_stream.missed_entries``): were entries after
        ``last`` trimmed or deleted before the relay read them?"""
        info = await self._info(self.execute)
        return True if info is None else missed_entries(info, parse_id(last))

    async def _info(self, send: Callable[..., Awaitable[Any]]) -> dict[Any, Any] | None:
        """``XINFO STREAM`` of the stream through ``send``; None if it doesn't exist."""
        try:
            return stream_info(await send("XINFO", "STREAM", self._stream))
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return None
            raise

    async def reset(self) -> None:
        """Drop the connection; the next command finds the stream's master anew (it may
        have failed over, or the slot moved)."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _connect(self) -> redis.Redis:
        if self._url is not None:
            client = relay_client(self._url, self._config)
        else:
            client = make_node_client(self._config, await self._stream_master(), protocol=2)
        client.response_callbacks.clear()
        return client

    async def _stream_master(self) -> str | None:
        """In a cluster, the master that owns the stream's slot ("host:port")."""
        if not self._config.cluster:
            return None
        cluster = make_client(self._config)
        try:
            assert is_cluster(cluster)
            await cluster.initialize()
            node = cluster.get_node_from_key(self._stream)
            if node is None:  # the slot map had no master for it: retried by the caller
                raise ClusterDownError(f"no master holds {self._stream!r}")
            return str(node.name)
        finally:
            await cluster.aclose()
