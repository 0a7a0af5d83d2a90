"""One command on a pooled connection of a single-node client, packed here rather than
by redis-py: the commands of the request path (the L2 GET; the miss path's lease, fill
and release; set()'s write; DEL), whose arguments are of known types.

Why: ``set()``'s write is one EVALSHA of ~16 arguments and ``set_many``'s of ~6 per
item (``_scripts.write_args``). ``Redis.execute_command`` runs each argument through
its generic encoder and wraps the call in retry, event and metrics machinery that this
client doesn't use (it has no retries: ``_clients.make_client``). Packing bytes, str and
int here and sending on the pooled connection cost ~40 µs less per ``set()`` and ~450 µs
less per ``set_many`` of 100 on the bench machine (issue 17, docs/benchmarks.md).

What stays redis-py's: the pool, connecting (AUTH, HELLO, health checks), the read's
socket timeout, the reply parser and its error classes (``OutOfMemoryError``,
``NoScriptError``, ...), and dropping a connection whose reply was not read: its
``send_packed_command`` and ``read_response`` disconnect on any exception (a timeout, a
cancellation), so a late reply is never read as the next command's. The send's socket
timeout becomes an ``asyncio.timeout`` (``_send`` says why).

``HeldConnection`` is the same for a caller that sends one command at a time for as long
as it lives (the backplane listener: ``_stream_link``): it keeps its connection between
commands and parses replies itself (``_replies``).

Callers go through the module (``_direct.execute_command(client, ...)``), never a name
imported from it: the schedule explorer and the race tests wrap it as they wrap
redis-py's ``execute_command``, so these commands stay yield points and fault points.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from layered_cache._readyqueue import others_are_ready
from layered_cache._replies import ReplyParser

__all__ = ["HeldConnection", "evalsha", "execute_command", "pack_command"]

_READ_SIZE = 65536


def pack_command(args: tuple[bytes | str | int, ...]) -> list[bytes]:
    """RESP2/3 request: an array of bulk strings. Values are not copied into one buffer
    (the socket takes the list as it is)."""
    chunks = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int) and not isinstance(arg, bool):
            data = b"%d" % arg
        else:
            kind = type(arg).__name__
            raise TypeError(f"a command argument must be bytes, str or int, not {kind}")
        chunks += (b"$%d\r\n" % len(data), data, b"\r\n")
    return chunks


async def execute_command(client: Redis, *args: bytes | str | int) -> Any:
    """Send ``args`` and return the parsed reply; an error reply raises redis-py's
    exception for it."""
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        await _send(connection, pack_command(args))
        return await connection.read_response()
    finally:
        await pool.release(connection)


async def _send(connection: AbstractConnection, chunks: list[bytes]) -> None:
    """redis-py's ``send_packed_command``, its socket timeout kept as an
    ``asyncio.timeout`` around it instead of its ``asyncio.wait_for``.

    Why: with a socket timeout set, redis-py runs every send in ``wait_for``, which on
    Python 3.11 makes the send a Task of its own: three more event-loop iterations per
    command (counted: 5 instead of 2 for a SET), each a round of syscalls, for a
    write that almost never waits (the socket takes it at once; ``drain`` only waits
    when Redis stops reading). With the timeout lifted for the call, redis-py sends on
    its own no-timeout path (same error handling: any exception, the deadline's
    cancellation included, disconnects the connection) and the deadline still holds.
    The connection is ours alone between ``get_connection`` and ``release``, and the
    read that follows uses the restored timeout. redis-py's pool connects a connection
    before handing it out; one that is not connected anyway takes redis-py's own path:
    a connect (bounded by ``connect_timeout``) and its handshake (HELLO, AUTH, each
    read bounded by the socket timeout) need not fit in one socket timeout, and a TLS
    connect to a distant Redis would not."""
    timeout = connection.socket_timeout
    if not timeout or not connection.is_connected or others_are_ready():
        # A burst (``_readyqueue``): redis-py's ``wait_for`` yields before the send,
        # so the read timeouts start once every queued call has run.
        await connection.send_packed_command(chunks)
        return
    connection.socket_timeout = None
    try:
        async with asyncio.timeout(timeout):
            await connection.send_packed_command(chunks)
    finally:
        connection.socket_timeout = timeout


async def evalsha(
    client: Redis, script: AsyncScript, keys: list[str], args: list[bytes | str | int]
) -> Any:
    """``script`` (registered on ``client``) by an EVALSHA packed here; on NOSCRIPT (a
    Redis restarted, SCRIPT FLUSH) through redis-py's script object, which loads it."""
    try:
        return await execute_command(client, "EVALSHA", script.sha, len(keys), *keys, *args)
    except NoScriptError:
        return await script(keys=keys, args=args)


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

    def __init__(self, client: Redis) -> None:
        self._client = client
        self._connection: AbstractConnection | None = None
        self._parser = ReplyParser()
        self._busy = False

    async def execute(self, *args: bytes | str | int) -> Any:
        """Send ``args`` and return the reply. One command at a time: a second caller
        while one is in flight would read the first one's reply, so it is refused."""
        if self._busy:
            raise RuntimeError("HeldConnection runs one command at a time")
        self._busy = True
        try:
            reply = await self._round_trip(args)
        finally:
            self._busy = False
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def _round_trip(self, args: tuple[bytes | str | int, ...]) -> Any:
        connection = self._connection
        if connection is None:
            connection = await self._client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
            self._connection, self._parser = connection, ReplyParser()
        try:
            await _send(connection, pack_command(args))
            return await self._read(connection)
        except BaseException:
            await self.close()
            raise

    async def _read(self, connection: AbstractConnection) -> Any:
        parser = self._parser
        while True:
            done, reply = parser.reply()
            if done:
                return reply
            reader = connection._reader
            data = await reader.read(_READ_SIZE) if reader is not None else b""
            if not data:
                raise RedisConnectionError("Connection closed by server.")
            parser.feed(data)

    async def close(self) -> None:
        """Disconnect the held connection (if any) and return it to the pool."""
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                await connection.disconnect(nowait=True)
            finally:
                await self._client.connection_pool.release(connection)
