"""Commands of a single-node client packed, sent and read here rather than by redis-py:
the commands of the request path (the L2 GET and get_many's MGET; the miss path's
lease, fill and release; set()'s write; DEL), whose arguments are of known types, and
the backplane listener's.

Why: ``set()``'s write is one EVALSHA of ~16 arguments and ``set_many``'s of ~6 per
item (``_scripts.write_args``). ``Redis.execute_command`` runs each argument through
its generic encoder and wraps the call in retry, event and metrics machinery that this
client doesn't use (it has no retries: ``_clients.make_client``). Its pool's checkout
and return cost ~12 µs per command (``DirectClient``), its per-send ``wait_for`` a Task
and three event-loop iterations (``HeldConnection._within``), and its parser awaits the
stream for every line of a reply (``_replies``). On the bench VM, all of that was about
as much CPU as the rest of a ``set()`` (issue 17, docs/benchmarks.md).

``HeldConnection`` keeps one connection checked out of the pool between commands and
parses its replies in one pass (``_replies``, or hiredis's C reader whenever redis-py
uses it: ``_hiredis``); ``DirectClient`` is a stack of them, one
per command in flight at the busiest moment so far. What stays redis-py's: the pool,
connecting (AUTH, HELLO, health checks), its error classes (``OutOfMemoryError``,
``NoScriptError``, ...), and the rule that a connection whose reply was not read is
dropped: any exception while a command is in flight (a timeout, a cancellation)
disconnects it, so a late reply is never read as the next command's.

Callers go through the module (``_direct.execute_command(direct_client, ...)``), never
a name imported from it: the schedule explorer and the race tests wrap it (and
``HeldConnection.execute``) as they wrap redis-py's ``execute_command``, so these
commands stay yield points and fault points.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from redis._parsers import BaseParser
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ExecAbortError, NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from layered_cache._busypoll import AVAILABLE, BusyPoll, SocketPoll
from layered_cache._chunks import CHUNK_BYTES, CHUNK_ITEMS
from layered_cache._hiredis import Parser, new_parser
from layered_cache._packing import Packed, pack_command
from layered_cache._readyqueue import others_are_ready

__all__ = [
    "DirectClient",
    "HeldConnection",
    "Packed",
    "ReplyTooLarge",
    "evalsha",
    "execute_command",
    "execute_transaction",
    "pack_command",
]

_READ_SIZE = 65536
_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
_EXEC = b"*1\r\n$4\r\nEXEC\r\n"


class ReplyTooLarge(Exception):
    """A reply longer than its command's ``reply_cap``: the connection was dropped with
    the rest unread, so the cost stays the cap's, not the value's."""


async def execute_command(
    direct: DirectClient, *args: bytes | str | int, reply_cap: int = 0
) -> Any:
    """Send ``args`` on one of ``direct``'s kept connections and return the parsed
    reply; an error reply raises redis-py's exception for it. ``reply_cap`` (bytes, 0:
    none) raises ``ReplyTooLarge`` for a longer reply."""
    return await direct.execute(args, reply_cap)


async def evalsha(
    direct: DirectClient, script: AsyncScript, keys: list[str], args: list[bytes | str | int]
) -> Any:
    """``script`` by an EVALSHA packed here. On NOSCRIPT (a Redis restarted, SCRIPT
    FLUSH) it is loaded and run again, on the same kept connections: after a restart
    redis-py's pooled connections may all be dead, and redis-py 8.1's pool, with
    RESP3's maintenance notifications on, hands them out unchecked (``can_read`` is
    skipped), so a load through redis-py's script object failed the first calls after
    every restart (tests/faults/test_redis_faults.py)."""
    command = ("EVALSHA", script.sha, len(keys), *keys, *args)
    try:
        return await execute_command(direct, *command)
    except NoScriptError:
        source = script.script
        text = bytes(source) if isinstance(source, memoryview) else source
        await execute_command(direct, "SCRIPT", "LOAD", text)
        return await execute_command(direct, *command)


async def execute_transaction(direct: DirectClient, commands: Packed) -> list[Any]:
    """``commands`` between MULTI and EXEC, sent at once; EXEC's replies, one per command
    (an error reply as an exception object in its place: the others ran). A command
    refused while queued (a full ``noeviction`` Redis: ``OOM``) aborts them all: its
    error is raised and nothing ran."""
    return await direct.transaction(commands)


def _cause(aborted: ExecAbortError) -> Exception:
    """The error an EXECABORT names ("... discarded because of: OOM command not
    allowed ..."), as redis-py would raise it; the EXECABORT itself if it names none."""
    _, found, cause = str(aborted).partition("because of: ")
    if not found:
        return aborted
    error: Exception = BaseParser.parse_error(cause)  # type: ignore[no-untyped-call]
    return error


def _stretched(timeout: float, count: int, value_bytes: int) -> float:
    """A transaction (``set_many``) can't be split into round trips without losing its
    atomicity, so its deadline grows with it instead: one ``redis.timeout`` more per
    CHUNK_ITEMS commands and per CHUNK_BYTES of values (10,000 values of 3 KB, 30 MB in
    one MULTI/EXEC, outlasted the default 100 ms every time). The rest is cut
    (``_chunks``)."""
    return timeout * (1 + count // CHUNK_ITEMS + value_bytes // CHUNK_BYTES)


class HeldConnection:
    """A connection of ``client``'s pool held from one command to the next, for a caller
    that sends one command at a time, on and on: the backplane listener, whose every
    wake is one XREAD (``_stream_link``).

    Why: the listener wakes for every burst of entries the fleet appends, and per wake
    redis-py's pool checkout and return cost ~16-19 µs of CPU (redis-py 8: a lock,
    counters, an event dispatch), and its parser ~19 µs per entry (``_replies`` says
    why). Here the connection stays checked out and the reply is read from its socket
    in as few reads as it arrived in, then parsed in one pass.

    Any exception while a command is in flight (a deadline's cancellation included)
    disconnects and returns the connection, as redis-py does: its unread reply must
    never be read as the next command's. The next command checks out a fresh one. An
    error reply raises redis-py's exception for it and keeps the connection (the reply
    was read whole). Reading the socket uses the connection's ``_reader`` (redis-py's
    asyncio ``StreamReader``, which its own parsers read too): pinned by
    ``tests/test_held_connection.py``, which ``make test`` also runs on the oldest
    redis-py it supports, with hiredis."""

    def __init__(
        self, client: Redis, busy_poll: BusyPoll | None = None, *, quiet_reconnect: bool = True
    ) -> None:
        self._client = client
        # False for the backplane listener: a connection the server closed between its
        # reads is an error it must see (it then checks the stream for a gap: a relay
        # closes its clients for exactly that), not one to swap for a new one unseen.
        self._quiet_reconnect = quiet_reconnect
        self._connection: AbstractConnection | None = None
        self._parser: Parser = new_parser()
        self._busy = False
        self._reply_cap = 0  # the command in flight's (``execute_command``)
        self._busy_poll = busy_poll  # None: a command that may block (XREAD BLOCK)
        self._socket: SocketPoll | None = None
        self._socket_of: object = None  # the StreamWriter ``_socket`` polls for

    async def execute(self, *args: bytes | str | int) -> Any:
        """Send ``args`` and return the reply. One command at a time: a second caller
        while one is in flight would read the first one's reply, so it is refused."""
        return await self.run(args)

    async def run(self, args: tuple[bytes | str | int, ...], reply_cap: int = 0) -> Any:
        """``execute`` for ``DirectClient``: the explorer and the race tests wrap
        ``execute`` (the listener's commands) and ``execute_command`` (the request
        path's), each command once."""
        if self._busy:
            raise RuntimeError("HeldConnection runs one command at a time")
        self._busy, self._reply_cap = True, reply_cap
        try:
            reply = await self._round_trip(pack_command(args))
        finally:
            self._busy, self._reply_cap = False, 0
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def run_transaction(self, commands: Packed) -> list[Any]:
        """``execute_transaction`` on this connection: MULTI, ``commands``, EXEC in one
        send; every reply is read (the connection stays in step) before an error is
        raised."""
        if self._busy:
            raise RuntimeError("HeldConnection runs one command at a time")
        self._busy = True
        try:
            chunks = [_MULTI, *commands.chunks, _EXEC]
            replies = await self._round_trip(chunks, commands.count + 2, commands.value_bytes)
        finally:
            self._busy = False
        for reply in replies[:-1]:  # MULTI's OK, then a QUEUED per command
            if isinstance(reply, Exception):
                raise reply  # refused while queued (then EXEC says EXECABORT)
        executed = replies[-1]
        if isinstance(executed, ExecAbortError):
            # Every command was queued, then EXEC itself was refused: a Redis that went
            # over maxmemory in between (its queue takes memory too) discards it all.
            # Redis names the cause after the EXECABORT; raised as its own error, so
            # that a caller can tell a full Redis (``OutOfMemoryError``) from a failure.
            raise _cause(executed) from executed
        if isinstance(executed, Exception):
            raise executed
        return cast(list[Any], executed)

    async def _round_trip(self, chunks: list[bytes], count: int = 0, value_bytes: int = 0) -> Any:
        """Send ``chunks`` and read their reply or, with ``count``, a list of that many."""
        connection = await self._connected()
        timeout = connection.socket_timeout
        if timeout and count:
            timeout = _stretched(timeout, count, value_bytes)
        if timeout and others_are_ready():
            # A burst (``_readyqueue``): the deadline starts once every queued call
            # has run, as it did behind redis-py's per-send ``wait_for``.
            await asyncio.sleep(0)
        try:
            if not timeout:
                await connection.send_packed_command(chunks)
                return await self._replies(connection, count)
            return await self._within(connection, chunks, timeout, count)
        except BaseException:
            await self.close()
            raise

    async def _replies(self, connection: AbstractConnection, count: int) -> Any:
        if not count:
            return await self._read(connection)
        parser = self._parser
        replies = [await self._read(connection)]
        while len(replies) < count:
            # The replies of one send mostly arrive together: take what is whole in
            # one pass before awaiting the socket again.
            replies += parser.whole_replies(count - len(replies))
            if len(replies) < count:
                replies.append(await self._read(connection, poll=False))
        return replies

    async def _within(
        self, connection: AbstractConnection, chunks: list[bytes], seconds: float, count: int
    ) -> Any:
        """Send and read under one deadline of one socket timeout.

        Why one: redis-py bounds the send with ``asyncio.wait_for`` (on Python 3.11 a
        Task of its own and three more event-loop iterations, for a write that almost
        never waits: the socket takes it at once) and then the read with a timer of
        its own. One ``asyncio.timeout`` around both is one timer per command; the
        connection's timeout is lifted meanwhile, so redis-py's send takes its
        no-timeout path (same error handling: any exception disconnects)."""
        connection.socket_timeout = None
        try:
            async with asyncio.timeout(seconds):
                await connection.send_packed_command(chunks)
                return await self._replies(connection, count)
        except TimeoutError:
            # Ours alone: an outer deadline or cancellation arrives as CancelledError.
            raise RedisTimeoutError(f"Timeout after {seconds} s on a direct command") from None
        finally:
            connection.socket_timeout = seconds

    async def _connected(self) -> AbstractConnection:
        """The held connection, or one checked out of the pool (connected by redis-py,
        its handshake outside our deadline) when there is none or the server closed
        the held one while it sat idle (Redis restarted, ``timeout`` config, CLIENT
        KILL): it would only fail the command. The reader shows a close the event loop
        has taken in; one it hasn't yet (a restart while nothing awaited) shows as a
        socket with something to read while no reply is pending (one poll, ~0.3 µs)."""
        held = self._connection
        if held is not None:
            reader = held._reader
            if (
                reader is not None
                and not reader.at_eof()
                and reader.exception() is None
                and not self._stirred(held)
            ):
                return held
            await self.close()
            if not self._quiet_reconnect:
                raise RedisConnectionError("Connection closed by server while idle.")
        pool = self._client.connection_pool
        connection: AbstractConnection = await pool.get_connection()  # type: ignore[no-untyped-call]
        self._connection, self._parser = connection, new_parser()
        return connection

    async def _read(self, connection: AbstractConnection, poll: bool = True) -> Any:
        parser = self._parser
        spin = self._busy_poll if poll else None
        fed = 0
        while True:
            done, reply = parser.reply()
            if done:
                return reply
            if spin is not None and spin.loop_is_idle():
                # Once, before the loop is first asked to wait: see ``_busypoll``.
                socket = self._polled(connection)
                if socket is not None:
                    spin.wait(socket)
            spin = None
            reader = connection._reader
            data = await reader.read(_READ_SIZE) if reader is not None else b""
            if not data:
                raise RedisConnectionError("Connection closed by server.")
            parser.feed(data)
            fed += len(data)
            if self._reply_cap and fed > self._reply_cap:
                raise ReplyTooLarge(f"a reply of more than {self._reply_cap} bytes")

    def _stirred(self, connection: AbstractConnection) -> bool:
        """Whether the idle ``connection`` has bytes (or a FIN, an RST) to read: no
        reply is pending, so it is the server closing it, or bytes no command asked for;
        either way it can't carry the next command."""
        socket = self._polled(connection) if AVAILABLE else None
        return socket is not None and socket.ready()

    def _polled(self, connection: AbstractConnection) -> SocketPoll | None:
        """The readability check of ``connection``'s socket, made again when redis-py
        reconnected it (a new writer, a new socket)."""
        writer = connection._writer
        if writer is not self._socket_of:
            sock = writer.get_extra_info("socket") if writer is not None else None
            fileno = sock.fileno() if sock is not None else -1
            self._socket = SocketPoll(fileno) if fileno >= 0 else None
            self._socket_of = writer
        return self._socket

    async def close(self) -> None:
        """Disconnect the held connection (if any) and return it to the pool. What its
        reader and parser hold of an unread reply goes too: this object may sit in
        ``DirectClient``'s stack for long, and a cancelled MGET's part can be megabytes."""
        connection, self._connection = self._connection, None
        self._parser, self._socket, self._socket_of = new_parser(), None, None
        if connection is not None:
            try:
                await connection.disconnect(nowait=True)
            finally:
                await self._client.connection_pool.release(connection)

    async def release(self) -> None:
        """Return the held connection (if any) to the pool as it is: connected, with no
        reply pending (only between commands)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            await self._client.connection_pool.release(connection)


class DirectClient:
    """A single-node client's request-path commands (``execute_command``), each on a
    connection this object keeps checked out of the client's pool between commands: a
    stack of ``HeldConnection``, one per command in flight at the busiest moment so far.

    Why keep them: redis-py 8's pool checkout and return cost ~12 µs of CPU per command
    on the bench VM (a lock, four observability calls, an event dispatch, and a
    zero-timeout read that checks the connection has no stray data), as much as the
    whole of the cache's own work on an L2 hit. A kept connection is checked instead
    for what that read would find: a server that closed it (``HeldConnection``). Its
    replies are always read whole, or the connection is dropped, so no stray reply can
    sit on it. The stack never exceeds the commands in flight at once, which
    ``L2Store.slots`` bounds; ``close`` gives them back to the pool."""

    def __init__(self, client: Redis, busy_poll: float = 0.0) -> None:
        self.client = client
        self._idle: list[HeldConnection] = []
        # One for all the connections: they reach the same server (``_busypoll``).
        self.busy_poll = BusyPoll(busy_poll) if busy_poll > 0 and AVAILABLE else None

    async def execute(self, args: tuple[bytes | str | int, ...], reply_cap: int = 0) -> Any:
        held = self._checkout()
        try:
            return await held.run(args, reply_cap)
        finally:
            self._checkin(held)

    async def transaction(self, commands: Packed) -> list[Any]:
        held = self._checkout()
        try:
            return await held.run_transaction(commands)
        finally:
            self._checkin(held)

    def _checkout(self) -> HeldConnection:
        idle = self._idle
        held = idle.pop() if idle else HeldConnection(self.client, self.busy_poll)
        if self.busy_poll is not None:
            self.busy_poll.in_flight += 1
        return held

    def _checkin(self, held: HeldConnection) -> None:
        # Even after a failure: a command that failed in flight dropped the connection,
        # and the next command on this one checks out a new one.
        self._idle.append(held)
        if self.busy_poll is not None:
            self.busy_poll.in_flight -= 1

    async def close(self) -> None:
        """Give every kept connection back to the pool (before the client closes)."""
        idle, self._idle = self._idle, []
        for held in idle:
            await held.release()
