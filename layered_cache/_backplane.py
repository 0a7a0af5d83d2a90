"""The L1 backplane: a Redis Stream of invalidated keys that every instance follows.

Whoever deletes L2 keys (the daemon or ``cache.invalidate()``) appends them to the
stream *afterwards*, so an instance that drops its L1 copy can only refill it from the
new L2 state. Every instance reads the stream from the last ID it has seen (XREAD
BLOCK), so after a disconnect it catches up instead of losing messages. The stream is
trimmed (``MAXLEN ~``); an instance whose position was trimmed away can't know what it
missed and clears its whole L1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import structlog
from redis.exceptions import OutOfMemoryError, RedisError

from layered_cache._backoff import Backoff
from layered_cache._clients import (
    RedisClient,
    is_redis_failure,
    resurface_cancel,
    stop_if_cancelled,
)
from layered_cache._codec import UNDECODABLE
from layered_cache._stream import (
    Entry,
    ahead_of_clock,
    last_generated,
    missed_entries,
    oldest_entry,
    parse_id,
    trim_visible,
)
from layered_cache._stream_count import EntryCount
from layered_cache._stream_link import StreamLink
from layered_cache._unsettled import UnsettledWrites

__all__ = [
    "BackplaneListener",
    "BackplanePublisher",
    "BackplaneStatus",
]

_log = structlog.get_logger("layered_cache.backplane")
# Reconnect delays: from 50 ms, doubling up to 2 s (jittered, see layered_cache._backoff).
_RECONNECT_BASE = 0.05
_RECONNECT_CAP = 2.0


class BackplaneStatus(msgspec.Struct, frozen=True):
    """This instance's view of the backplane (``LayeredCache.backplane_status()``).

    ``lag_seconds``: how old the newest invalidation this instance read was when it read
    it (0 once a read finds nothing new: caught up); while disconnected, at least the
    time since the connection was lost. Entry ages come from the entry ID (Redis's
    clock) against this host's clock: NTP-level skew shows up as lag.
    """

    connected: bool
    last_id: str | None  # the newest stream entry read
    entries_applied: int  # entries from others (daemon, other instances) applied to L1
    keys_applied: int  # keys in those entries
    gaps: int  # whole-L1 clears: our position was trimmed, or the stream was deleted
    lag_seconds: float
    # Announcements that went over pub/sub because the stream refused them (a full
    # Redis under noeviction: ``_fallback``): sent by this instance, received from others.
    fallback_sent: int = 0
    fallback_received: int = 0
    # Bugs met reading or applying entries (the listener) or fallback messages; each
    # cleared L1.
    errors: int = 0


class BackplanePublisher:
    """Appends invalidated keys to the stream (one XADD per batch of keys)."""

    def __init__(self, client: RedisClient, stream: str, maxlen: int, origin: str = "") -> None:
        self.client = client
        self.stream = stream
        self._maxlen = maxlen
        self.origin = origin

    async def publish(self, keys: Sequence[str], tags: Mapping[str, str] | None = None) -> bytes:
        """Raises redis errors: the caller decides (the daemon retries, the facade reports).
        ``tags``: new versions of invalidated tags (``_tags``)."""
        task = asyncio.current_task()
        requested = task.cancelling() if task is not None else 0
        entry_id: Any = await self.queue(self.client, keys, tags)
        resurface_cancel(task, requested)
        return entry_id.encode() if isinstance(entry_id, str) else bytes(entry_id)

    def queue(self, target: Any, keys: Sequence[str], tags: Mapping[str, str] | None = None) -> Any:
        """The XADD of one entry on ``target``: the client (``publish``) or a pipeline."""
        fields = self._fields(keys, tags)
        return target.xadd(self.stream, fields, maxlen=self._maxlen, approximate=True)

    def announcement(self, keys: Sequence[str]) -> Announcement:
        """The entry for ``keys``, for a single-node ``set()`` to append in the same
        atomic step as its SETs (``_write_commands``): one round trip, and still after them."""
        pairs: list[bytes | str] = []
        for field, value in self._fields(keys, None).items():
            pairs += [field, value]
        return Announcement(self.stream, self._maxlen, pairs)

    def _fields(
        self, keys: Sequence[str], tags: Mapping[str, str] | None
    ) -> dict[str, bytes | str]:
        fields: dict[str, bytes | str] = {"keys": msgspec.msgpack.encode(list(keys))}
        if tags:
            fields["tags"] = msgspec.msgpack.encode(dict(tags))
        if self.origin:
            fields["origin"] = self.origin
        return fields


class Announcement(msgspec.Struct, frozen=True):
    """A backplane entry to append along with other writes (``L2Store.write_many``)."""

    stream: str
    maxlen: int
    fields: list[bytes | str]  # flat field/value pairs, as XADD takes them


class BackplaneListener:
    """Background reader that calls ``on_keys`` for every entry and ``on_gap`` when the
    stream was trimmed past our position (the owner then clears L1)."""

    def __init__(
        self,
        client: RedisClient,
        stream: str,
        on_keys: Callable[[list[str]], None],
        on_gap: Callable[[], None],
        *,
        clock: Callable[[], float],
        block: float = 1.0,
        batch: int = 1000,
        origin: str = "",
        on_tags: Callable[[dict[str, str]], None] | None = None,
        coalesce: float = 0.0,
        maxlen: int | None = None,
        timeout: float = 1.5,
        unsettled: UnsettledWrites | None = None,
    ) -> None:
        self._client, self._stream = client, stream
        self._unsettled = UnsettledWrites() if unsettled is None else unsettled
        # Each command within block + ``timeout`` (a connect and the reply): ``StreamLink``.
        self._link = StreamLink(client, stream, block, batch, block + timeout)
        self._on_keys, self._on_gap, self._on_tags = on_keys, on_gap, on_tags
        self._coalesce = coalesce
        self._clock = clock  # Redis's time as measured here: stream IDs are its clock's
        self._trim_visible = trim_visible(batch, maxlen)
        self._cleared_through = (0, 0)  # entries up to this one are covered by an L1 clear
        self._counted = EntryCount(self._link)  # entries lost unread while connected
        self._origin = origin.encode()
        self.last_id: bytes | None = None
        self.connected = asyncio.Event()
        self._serving_unpositioned = False  # before it first knew its place (``late``)
        self._task: asyncio.Task[None] | None = None
        self.entries_seen = 0  # every entry read, our own included
        self.entries_applied = self.keys_applied = self.gaps = 0
        self.errors = 0  # bugs met while reading or applying entries (``_failed``)
        self._lag = 0.0
        self._down_since: float | None = None  # monotonic time the connection was lost

    def known_as_of(self) -> float:
        """As of when every invalidation has reached this instance (``_tags``)."""
        return self._link.known_as_of(live=self.connected.is_set())

    def status(self) -> BackplaneStatus:
        down = 0.0 if self._down_since is None else time.monotonic() - self._down_since
        return BackplaneStatus(
            connected=self.connected.is_set(),
            last_id=self.last_id.decode() if self.last_id is not None else None,
            entries_applied=self.entries_applied, keys_applied=self.keys_applied,
            gaps=self.gaps, lag_seconds=max(self._lag, down), errors=self.errors,
        )

    def late(self) -> None:
        """The cache serves before this listener has a position (``_startup.positioned``):
        its first one, the newest entry, is after what L1 may have missed. Clear then."""
        if not self.connected.is_set():
            self._serving_unpositioned = True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="layered_cache._backplane")

    async def stop(self) -> None:
        """Cancel the reader. A task cancelled inside a blocking XREAD may not wake up
        until the socket closes (seen with redis-py 8), so after a short grace period
        the connections are closed to unblock it; stop() never hangs."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait({task}, timeout=0.2)
        if not task.done():
            with contextlib.suppress(Exception):
                await self._client.aclose()
            await asyncio.wait({task}, timeout=1.0)
        if task.done() and not task.cancelled():
            task.exception()
        with contextlib.suppress(Exception):
            await self._link.close()

    async def _run(self) -> None:
        backoff = Backoff(base=_RECONNECT_BASE, cap=_RECONNECT_CAP)
        check_from: bytes | None = None  # a position whose successors may be trimmed
        while True:
            stop_if_cancelled()
            try:
                if self.last_id is None:
                    self.last_id = await self._tail_id()
                    # At once: were the XINFO below to fail, no later round comes here.
                    if self._serving_unpositioned:
                        self._serving_unpositioned = False
                        self._gap("positioned_after_serving")
                elif check_from is not None:
                    await self._check_gap(check_from)
                check_from = None
                await self._counted.settle(self.last_id, self.entries_seen)  # after a clear too
                self.connected.set()
                self._down_since = None
                backoff.reset()
                before = self.last_id
                read = await self._read_once()
                if read >= self._trim_visible:
                    # As many entries as a trim past ``before`` would have left: the
                    # entries right after it may be gone (``trim_visible`` says why).
                    check_from = before
                counted = check_from is None  # else checked by position first (next round)
                if counted and await self._counted.lost(self.last_id, self.entries_seen):
                    self._gap("entries_unread")
                if read and self._coalesce and check_from is None:
                    # Let a burst gather before the next XREAD: a blocked XREAD returns
                    # as soon as one entry lands, so a writer's own set() loop would
                    # otherwise wake this reader (a reply to parse, a new XREAD to send)
                    # once per set(), doubling the process's work per write (issue 17).
                    await asyncio.sleep(self._coalesce)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not is_redis_failure(exc):
                    self._failed(exc)
                    await asyncio.sleep(backoff.next_delay())
                    continue
                if self.connected.is_set():
                    _log.warning("backplane_disconnected", error=type(exc).__name__)
                if self._down_since is None:
                    self._down_since = time.monotonic()
                self.connected.clear()
                check_from = check_from or self.last_id
                await asyncio.sleep(backoff.next_delay())

    async def _xread(self, after: bytes) -> list[Entry]:
        """One blocking XREAD (``StreamLink.xread``); its own method: tests hold a read."""
        return await self._link.xread(after)

    def _apply_tags(self, raw: bytes | None) -> None:
        if raw is None or self._on_tags is None:
            return
        try:
            versions = msgspec.msgpack.decode(raw, type=dict[str, str])
        except UNDECODABLE:
            self._unreadable()
            return
        self._on_tags(versions)

    def _unreadable(self) -> None:
        """An entry we can't decode (another version's format, a forged one): L1 goes whole."""
        assert self.last_id is not None
        _log.warning("backplane_bad_entry", entry_id=self.last_id.decode())
        self._gap("bad_entry")

    async def _tail_id(self) -> bytes:
        """Start after the newest entry: a new instance's L1 is empty anyway.

        No stream (or an empty one) yet: create it with an entry that carries no keys
        (readers skip it). From then on a missing stream means it was deleted - a gap -
        rather than "nothing was invalidated yet", so a fleet that never invalidates
        doesn't clear L1 after every blip."""
        newest = await self._link.newest_id()
        if newest is not None:
            return newest
        try:
            return await self._link.add(self._origin or b"-")
        except OutOfMemoryError:
            # A Redis full under noeviction refuses even the marker (the first instances
            # of a fleet on a full Redis): start before everything instead, so whatever
            # entry creates the stream is read; meanwhile invalidations come over the
            # pub/sub fallback (``_fallback``), which needs no memory.
            _log.warning("backplane_stream_not_created_redis_full", stream=self._stream)
            return b"0-0"

    async def _check_gap(self, position: bytes) -> None:
        """After a disconnect or a long read: were entries after ``position`` trimmed?"""
        try:
            info = await self._link.info()
        except RedisError as exc:
            if "no such key" not in str(exc).lower():
                raise
            # The stream is gone (DEL, eviction, a Redis restarted empty) while we
            # weren't reading: whatever it held after our position is lost. (It existed:
            # we created it at start if nobody had.) Whatever creates it anew is read
            # from its first entry: its IDs may be below our old position.
            self._gap("stream_missing")
            self.last_id = b"0-0"
            return
        # Entries older than a clear are accounted for by it: the long read that follows
        # a reconnect's clear starts from the old position again, and must not clear
        # again for the same trimmed entries.
        if missed_entries(info, max(parse_id(position), self._cleared_through)):
            self._cleared_through = oldest_entry(info)
            self._gap("entries_missing")
            last = last_generated(info)
            if last is not None and parse_id(last) < parse_id(position):
                # IDs went back (the stream was deleted and created anew, Redis's clock
                # stepped back): reading after our old position would wait for IDs that
                # may never come. The clear covers everything up to the stream's last ID.
                self.last_id = last

    def _failed(self, exc: Exception) -> None:
        """A bug (ours, or in a hook) raised while the listener read or applied entries.
        Letting the task die would stop this instance hearing invalidations while
        ``status()`` still said connected: L1 would serve superseded values for their
        TTL with nothing to show it. So: an error log with the traceback, a count in
        ``status().errors``, and a whole-L1 clear - whatever the failed entry was to drop
        goes with it - before reading on after that entry (``last_id`` already names it;
        the entries after it in the same read are read again)."""
        self.errors += 1
        _log.error("backplane_listener_error", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        if self.last_id is not None:
            self._gap("listener_error")

    def _gap(self, reason: str) -> None:
        assert self.last_id is not None
        self._counted.forget()
        self.gaps += 1
        _log.warning("backplane_gap_clearing_l1", last_id=self.last_id.decode(), reason=reason)
        self._on_gap()

    async def _read_once(self) -> int:
        """One XREAD, its entries applied; returns how many entries it read."""
        assert self.last_id is not None
        entries = await self._xread(self.last_id)
        if not entries:
            self._lag = 0.0  # blocked and nothing came: caught up
            if ahead_of_clock(self.last_id, self._clock(), time.time()):  # IDs went back
                await self._check_gap(self.last_id)
            return 0
        for entry_id, fields in entries:
            self.last_id = bytes(entry_id)
            self.entries_seen += 1
            if self._origin and fields.get(b"origin") == self._origin:
                self._unsettled.heard(fields.get(b"keys"), self._on_keys)  # ``_unsettled``
                continue  # our own invalidation: already applied locally
            self._apply_tags(fields.get(b"tags"))
            raw = fields.get(b"keys")
            if raw is None:  # a start marker (``origin`` alone) names nothing; other
                if fields.keys() - {b"origin"}:  # formats may name what we can't read
                    self._unreadable()
                continue
            try:
                keys = msgspec.msgpack.decode(raw, type=list[str])
            except UNDECODABLE:
                self._unreadable()
                continue
            self._on_keys(keys)
            self.entries_applied += 1
            self.keys_applied += len(keys)
        self._lag = max(0.0, time.time() - parse_id(self.last_id)[0] / 1000)
        return len(entries)
