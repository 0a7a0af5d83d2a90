"""The backplane relay: one reader of the stream per host, many instances behind it.

Why: every instance follows the one backplane stream (``_backplane``), so the stream's
master sends every entry once per instance and answers a read per instance per second
when idle: its CPU grows with the fleet, and one master has one core
(docs/operations.md, "Fan-out"). A relay follows the stream with one XREAD loop and
serves the same XREAD, from memory, to the instances of its host or pod group: the
master's load grows with the number of relays, not of instances. A relay can follow
another relay (it serves the commands it sends), which makes a tree.

Correctness stays the backplane's own. Instances keep their position (a stream ID) and
their catch-up and gap rules; the relay answers "the entries after ID X" as Redis
would, or not at all:

- from memory only for an X at or after ``_Tail.start``: the relay has read every entry
  after that point, in order, with nothing trimmed in between (after a read as long as
  a trim past its position would leave, it checks, as a listener does);
- for an older X (an instance catching up after a disconnect), by forwarding the read
  to Redis;
- the listener's other commands (``XINFO STREAM`` for its gap check, ``XREVRANGE`` for
  its start position, the start marker's ``XADD``) go to Redis as they are.

When the relay loses Redis, or may have missed entries, it forgets what it holds and
closes every instance's connection: each reconnects, checks for a gap against the
stream itself and catches up, as after any disconnect.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import structlog
from redis.exceptions import ResponseError

from layered_cache._backoff import Backoff
from layered_cache._clients import is_redis_failure, stop_if_cancelled
from layered_cache._logs import error_text
from layered_cache._relay_commands import refused_forward, xread_arguments
from layered_cache._relay_info import InfoCache
from layered_cache._relay_outage import Outage
from layered_cache._relay_send import send
from layered_cache._relay_upstream import Upstream
from layered_cache._resp import NIL_ARRAY, CommandReader, ProtocolError, encode, encode_error
from layered_cache._stream import ahead_of_clock, parse_id, trim_visible

__all__ = ["Relay", "RelayStatus"]

_log = structlog.get_logger("layered_cache.relay")

# Commands forwarded to Redis as they are, when their key is the relay's stream.
_LEFT_CHECK = 1.0  # seconds between checks that a client in a blocking XREAD is still there
_FORWARDED = {b"XINFO", b"XREVRANGE", b"XADD"}
_ACKNOWLEDGED = {b"CLIENT", b"SELECT"}  # redis-py's connection set-up
_REPLY_BYTES = 32 * 1024 * 1024  # cached XREAD replies, at most (``_Tail.remember``)


class RelayStatus(msgspec.Struct, frozen=True):
    """What ``Relay.status()`` reports (the CLI logs it)."""

    following: bool  # holds a position in the stream upstream
    last_id: str | None  # the newest entry read upstream
    clients: int  # open client connections
    entries_read: int  # entries read upstream
    replies_from_memory: int  # XREADs answered without Redis
    forwarded: int  # client commands sent on to Redis (catch-up reads, gap checks)
    resets: int  # times the relay forgot its memory and closed every client
    errors: int = 0  # bugs met while following (each a reset: logged as relay_error)


class _Tail:
    """The entries read upstream after ``start``, in order and with none missing, each
    already encoded for the reply. The oldest are dropped past ``keep``: ``start`` then
    moves to the last one dropped, and older positions are forwarded to Redis."""

    def __init__(self, start: bytes, keep: int, batch: int) -> None:
        self.start = parse_id(start)
        self.last = start
        self._keep = keep
        self._batch = batch  # at most this many entries per reply, COUNT or not
        self._ids: list[tuple[int, int]] = []
        self._encoded: list[bytes] = []
        # Whole XREAD replies by (position, count), until the next arrival: the readers
        # of a relay mostly wait at the same position, and all want the same bytes.
        self.replies: dict[tuple[tuple[int, int], int | None], bytes] = {}
        self._reply_bytes = 0

    def remember(self, key: tuple[tuple[int, int], int | None], reply: bytes) -> bytes:
        """Keep ``reply`` until the next arrival, within bounds: a client asking at many
        positions must not grow the relay's memory (it held 250 times the entries)."""
        if len(self.replies) >= 1024 or self._reply_bytes + len(reply) > _REPLY_BYTES:
            self.replies.clear()
            self._reply_bytes = 0
        self.replies[key] = reply
        self._reply_bytes += len(reply)
        return reply

    def add(self, entries: Sequence[Any]) -> None:
        self.replies.clear()
        self._reply_bytes = 0
        for entry in entries:
            self.last = bytes(entry[0])
            self._ids.append(parse_id(self.last))
            self._encoded.append(encode(entry))
        if len(self._ids) > 2 * self._keep:  # amortised: drop in chunks
            dropped = len(self._ids) - self._keep
            self.start = self._ids[dropped - 1]
            del self._ids[:dropped], self._encoded[:dropped]

    def after(self, position: tuple[int, int], count: int | None) -> list[bytes] | None:
        """The encoded entries after ``position``; None if it is older than ``start``."""
        if position < self.start:
            return None
        first = bisect.bisect_right(self._ids, position)
        # Without COUNT Redis returns them all; a reader loops from the last one anyway.
        return self._encoded[first : first + min(count or self._batch, self._batch)]


class _Unavailable(Exception):
    """The relay cannot answer as Redis would: the client's connection is closed."""


class Relay:
    """Follows ``stream`` upstream and serves XREAD on it to many clients.

    ``keep``: entries held in memory. An instance behind by more catches up from Redis
    through the relay (forwarded reads) instead of from memory. ``clock``: Redis's time
    as the relay estimates it (``cli/relay.py`` runs a ``_redisclock.RedisClock``)."""

    def __init__(
        self,
        upstream: Upstream,
        stream: str,
        *,
        clock: Callable[[], float],
        block: float = 1.0,
        batch: int = 1000,
        keep: int = 10_000,
        maxlen: int | None = None,
        send_timeout: float = 30.0,
    ) -> None:
        self._upstream = upstream
        self._stream, self._clock = stream.encode(), clock
        self._block_ms = max(1, int(block * 1000))
        self._batch = batch
        # A read this long may follow a trim past our position: ``maxlen`` is the
        # stream's configured one.
        self._trim_visible = trim_visible(batch, maxlen)
        self._keep = keep
        # How long a client may leave a full buffer of replies unread (``_send``).
        self._send_timeout = send_timeout
        self._tail: _Tail | None = None
        self._arrived = asyncio.Event()  # replaced on every arrival: waiters hold the old
        self._connections: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._follower: asyncio.Task[None] | None = None
        self._info = InfoCache()  # the listeners' XINFO STREAM, shared (``_relay_info``)
        self._entries_read = self._from_memory = self._forwarded = self._resets = 0
        self._errors = 0
        self._outage = Outage()  # says why it follows nothing (``_relay_outage``)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Listen on ``host:port`` (0: any free port) and start following; returns the
        address listened on."""
        self._server = await asyncio.start_server(self._serve, host, port)
        self._follower = asyncio.create_task(self._follow(), name="layered_cache._relay")
        address = self._server.sockets[0].getsockname()
        return str(address[0]), int(address[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
        self._forget("closing")
        await self._upstream.reset()

    def status(self) -> RelayStatus:
        tail = self._tail
        return RelayStatus(
            following=tail is not None,
            last_id=tail.last.decode() if tail is not None else None,
            clients=len(self._connections),
            entries_read=self._entries_read,
            replies_from_memory=self._from_memory,
            forwarded=self._forwarded,
            resets=self._resets,
            errors=self._errors,
        )

    # Following the stream upstream.

    async def _follow(self) -> None:
        backoff = Backoff(base=0.05, cap=2.0)
        while True:
            stop_if_cancelled()
            try:
                if self._tail is None:
                    self._tail = _Tail(await self._upstream.newest_id(), self._keep, self._batch)
                    _log.info("relay_following", last_id=self._tail.last.decode())
                    self._outage.ended()
                backoff.reset()
                if not await self._read_once(self._tail):
                    self._forget("entries_missing")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not is_redis_failure(exc):
                    # A bug (ours). A follower that died would leave its instances
                    # connected to a relay that never hands them another entry: each
                    # would read "nothing new" while its L1 kept superseded values. As
                    # for a lost upstream, the relay forgets instead (every instance
                    # reconnects and checks the stream itself) and follows again.
                    self._errors += 1
                    _log.error("relay_error", error=error_text(exc), exc_info=exc)
                else:
                    self._outage.failed(exc)
                self._forget(f"upstream_{type(exc).__name__}")
                await self._upstream.reset()
                await asyncio.sleep(backoff.next_delay())

    async def _read_once(self, tail: _Tail) -> bool:
        """One blocking XREAD upstream, its entries added to ``tail`` and the waiting
        clients woken; False, with nothing added, if entries before them may have been
        trimmed unread. Checked before anything is served: a read this long may follow
        a trim past our position (``BackplaneListener`` says why), and entries served
        from memory must be all there is after the position a client asked for."""
        before = tail.last
        reply = await self._upstream.execute(
            "XREAD", "COUNT", self._batch, "BLOCK", self._block_ms, "STREAMS", self._stream,
            before,
        )
        if not reply:
            # Idle, at a position ahead of Redis's clock: the stream's IDs went back.
            if ahead_of_clock(before, self._clock(), time.time()):
                return not await self._upstream.missed_entries(before)
            return True
        entries = reply[0][1]
        if len(entries) >= self._trim_visible and await self._upstream.missed_entries(before):
            return False
        tail.add(entries)
        self._info.stale()
        self._entries_read += len(entries)
        self._wake()
        return True

    def _wake(self) -> None:
        arrived, self._arrived = self._arrived, asyncio.Event()
        arrived.set()

    def _forget(self, reason: str) -> None:
        """Drop the memory and every client: each reconnects and checks for a gap
        against the stream itself (``_backplane``), which the relay can't do for them."""
        if self._tail is None and not self._connections:
            return
        if self._tail is not None:
            self._resets += 1
            _log.warning("relay_reset", reason=reason, last_id=self._tail.last.decode())
        self._tail = None
        self._info.stale()
        self._wake()
        for writer in list(self._connections):
            writer.close()

    # Serving clients.

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._tail is None:  # not following: nothing to answer from
            writer.close()
            return
        self._connections.add(writer)
        commands = CommandReader(reader)
        try:
            while True:
                command = await commands.next()
                if command is None or command[0].upper() == b"QUIT":
                    return
                await send(writer, await self._execute(command, reader), self._send_timeout)
        except ProtocolError as exc:
            _log.warning("relay_bad_request", error=error_text(exc))
            writer.write(encode_error(f"ERR protocol error: {exc}"))
        except TimeoutError:
            _log.warning("relay_client_not_reading", timeout=self._send_timeout)
        except (_Unavailable, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._connections.discard(writer)
            writer.close()

    async def _execute(self, command: list[bytes], client: asyncio.StreamReader) -> bytes:
        name = command[0].upper()
        if name == b"XREAD":
            return await self._xread(command[1:], client)
        if name == b"PING":
            return b"+PONG\r\n"
        if name == b"TIME":  # the clock of a relay below (``Upstream.time``): Redis's
            return await self._forward(command)
        if name == b"HELLO":
            # redis-py 8 asks for RESP3 unless told protocol=2; NOPROTO says why not.
            if len(command) > 1 and command[1] != b"2":
                return encode_error("NOPROTO the backplane relay speaks RESP2 (protocol=2)")
            return encode([b"server", b"layered-cache-relay", b"proto", 2])
        if name in _ACKNOWLEDGED:
            return b"+OK\r\n"
        if name in _FORWARDED and self._stream in command[1:3]:
            if refused := refused_forward(command, self._stream):
                return refused
            if name == b"XINFO":
                return await self._info.get(lambda: self._forward(command))
            return await self._forward(command)
        return encode_error(
            f"ERR the backplane relay serves XREAD on {self._stream.decode()!r} "
            f"(and the listener's XINFO STREAM, XREVRANGE, XADD; TIME), not {name!r}"
        )

    async def _forward(self, command: Sequence[bytes]) -> bytes:
        self._forwarded += 1
        try:
            return encode(await self._upstream.forward(*command))
        except ResponseError as exc:
            return encode_error(exc)
        except Exception as exc:
            if is_redis_failure(exc):
                raise _Unavailable from exc
            raise

    async def _xread(self, arguments: list[bytes], client: asyncio.StreamReader) -> bytes:
        try:
            count, block_ms, after = xread_arguments(arguments, self._stream)
        except ValueError as exc:
            return encode_error(f"ERR {exc}")
        loop = asyncio.get_running_loop()
        deadline = None if block_ms is None else loop.time() + (block_ms or 1e9) / 1000
        if after == b"$":
            self._forwarded += 1  # a question to Redis (``_newest``)
        position = await _newest(self._upstream) if after == b"$" else parse_id(after)
        while True:
            tail = self._tail
            if tail is None:
                raise _Unavailable
            reply = tail.replies.get((position, count))
            if reply is not None:
                self._from_memory += 1
                return reply
            served = tail.after(position, count)
            if served:
                self._from_memory += 1
                return tail.remember((position, count), _entries_reply(self._stream, served))
            if served is None:  # older than memory: Redis answers (catch-up)
                limit = min(count or self._batch, self._batch)  # as from memory
                read = [b"XREAD", b"COUNT", b"%d" % limit, b"STREAMS"]
                reply = await self._forward([*read, self._stream, b"%d-%d" % position])
                if reply != NIL_ARRAY:
                    return reply
            arrived = self._arrived
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is None or remaining <= 0:
                return NIL_ARRAY
            # asyncio.timeout, not wait_for: wait_for runs the wait as a task of its own,
            # per reader per delivery (Python 3.11), a third of the relay's CPU. Woken at
            # least every second to see whether the client left (Redis frees a blocked
            # client that disconnects; a BLOCK 0 here held it until the next entry).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, _LEFT_CHECK)):
                    await arrived.wait()
            if _left(client):
                raise ConnectionResetError("the client left during its blocking read")


def _left(client: asyncio.StreamReader) -> bool:
    """Whether the client closed its side. ``at_eof()`` stays False while bytes it sent
    sit unread: a client that pipelined a command behind ``XREAD BLOCK 0`` and left was
    held until the next entry (days on an idle stream). ``StreamReader`` has no public
    "EOF received" (CPython keeps it in ``_eof``)."""
    return client.at_eof() or bool(getattr(client, "_eof", False))


def _entries_reply(stream: bytes, entries: list[bytes]) -> bytes:
    header = b"*1\r\n*2\r\n" + encode(stream) + b"*%d\r\n" % len(entries)
    return header + b"".join(entries)


async def _newest(upstream: Upstream) -> tuple[int, int]:
    """``$``: the stream's last generated ID in Redis, asked after the command arrived,
    as Redis resolves it. Not the relay's newest (``_Tail.last``): a relay a read behind
    Redis handed out entries appended before the call as if after it; nor the newest
    entry still in the stream (an XDEL of the newest left an older one)."""
    try:
        return parse_id(await upstream.last_generated_id())
    except Exception as exc:
        if is_redis_failure(exc):
            raise _Unavailable from exc
        raise
