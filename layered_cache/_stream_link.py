"""The backplane listener's commands on its stream, each within the listener's deadline.

On a single node (or a relay) they all go over one connection the listener holds
(``_direct.HeldConnection``): the blocking XREAD of every wake, and the XREVRANGE,
XADD and XINFO STREAM of its start position and gap checks. Those run between two
XREADs of the same task, so they need no second connection: every instance of a fleet
keeps one connection to the stream's node, not two.

In a cluster they go through redis-py, the XREAD straight to the master that owns the
stream's slot (``xread`` says why).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from layered_cache import _direct as direct
from layered_cache._clients import RedisClient, as_single_node, is_cluster
from layered_cache._stream import Entry, stream_info, xread_entries

__all__ = ["StreamLink"]

# An XREAD waiting longer than its BLOCK and this is late (a congested link, a dead one
# not yet timed out, a relay holding replies): it no longer vouches for "now".
_LATE = 0.5


class StreamLink:
    def __init__(
        self, client: RedisClient, stream: str, block: float, batch: int, deadline: float
    ) -> None:
        self._client = client
        self._stream = stream
        self._xread_args = ("XREAD", "COUNT", batch, "BLOCK", max(1, int(block * 1000)))
        # One command's deadline: the listener's client has no socket timeout on a
        # single node or a relay (``_clients.listener_connection``): this is the only
        # bound there.
        self._deadline = deadline
        self._batch, self._block = batch, block
        self._sent_at: float | None = None  # monotonic time of the XREAD waiting now
        self._caught_up_at = float("-inf")  # when a read that left nothing came back
        self._timely = True  # the last reply came within BLOCK + _LATE of its XREAD
        self._held = (
            None
            if is_cluster(client)
            else direct.HeldConnection(as_single_node(client), quiet_reconnect=False)
        )

    async def xread(self, after: bytes) -> list[Entry]:
        """One blocking XREAD; its entries (none when the block timed out).

        On a single node (or a relay) on the held connection, parsed in one pass: every
        instance's listener wakes for the fleet's writes, and redis-py's ``xread()``
        (its command machinery, pool checkout, a parser that awaits each element, a
        reply callback building a dict per entry) was most of the listener's CPU per
        entry on the bench machine (docs/benchmarks.md, "set()"). In a cluster it goes
        straight to the master that owns the stream's slot: redis-py can't tell XREAD's
        key from its position in the command (its keys move), so it asked the server
        with ``COMMAND GETKEYS`` before every read, one extra round trip per read per
        instance (issue 20). After a failover or resharding the node answers MOVED:
        redis-py refreshes its slot map, the read fails like a dropped connection, and
        the next one asks the map again."""
        self._sent_at = sent = time.monotonic()
        try:
            entries = await self._xread(after)
        finally:
            self._sent_at = None
        now = time.monotonic()
        self._timely = now - sent < self._block + _LATE
        if len(entries) < self._batch:
            # Every entry added before Redis answered is in this reply, and its reader
            # applies them as soon as this returns, before any other task runs. A timely
            # reply answered moments ago; a late one may have answered when it was sent.
            self._caught_up_at = now if self._timely else sent
        return entries

    def known_as_of(self, live: bool) -> float:
        """The (monotonic) time as of which every entry has been read: now while an
        XREAD waits on a ``live`` connection, and not late (an entry wakes it at once),
        else when the last read that left nothing behind came back."""
        now, sent = time.monotonic(), self._sent_at
        if live and self._timely and sent is not None and now - sent < self._block + _LATE:
            return now  # the link answered in time last, and this read is not late yet
        return self._caught_up_at

    async def _xread(self, after: bytes) -> list[Entry]:
        client, args = self._client, (*self._xread_args, "STREAMS", self._stream, after)
        async with asyncio.timeout(self._deadline):
            if self._held is not None:
                return xread_entries(await self._held.execute(*args))
            assert is_cluster(client)
            node = client.get_node_from_key(self._stream)
            response = await client.execute_command(*args, target_nodes=node)
        return list(response[0][1]) if response else []

    async def newest_id(self) -> bytes | None:
        """The ID of the stream's newest entry; None if it has none (or doesn't exist)."""
        async with asyncio.timeout(self._deadline):
            if self._held is not None:
                newest = await self._held.execute("XREVRANGE", self._stream, "+", "-", "COUNT", 1)
            else:
                newest = await self._client.xrevrange(self._stream, count=1)
        return bytes(newest[0][0]) if newest else None

    async def add(self, origin: bytes) -> bytes:
        """Append an entry that carries no keys (``origin`` only); its ID."""
        async with asyncio.timeout(self._deadline):
            if self._held is not None:
                added = await self._held.execute("XADD", self._stream, "*", "origin", origin)
            else:
                added = await self._client.xadd(self._stream, {"origin": origin})
        return added.encode() if isinstance(added, str) else bytes(added)

    async def info(self) -> dict[Any, Any]:
        """XINFO STREAM as a mapping (``_stream.stream_info``); a stream that doesn't
        exist raises redis-py's ``ResponseError`` ("no such key")."""
        async with asyncio.timeout(self._deadline):
            if self._held is not None:
                return stream_info(await self._held.execute("XINFO", "STREAM", self._stream))
            return stream_info(await self._client.xinfo_stream(self._stream))

    async def close(self) -> None:
        """Give the held connection back (disconnected); the next command takes another."""
        if self._held is not None:
            await self._held.close()
