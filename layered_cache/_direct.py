"""One command on a pooled connection of a single-node client, packed here rather than
by redis-py: the commands of the request path (the L2 GET; the miss path's lease, fill
and release; set()'s write; DEL) and the backplane listener's XREAD, whose arguments
are of known types.

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
from redis.exceptions import NoScriptError

from layered_cache._readyqueue import others_are_ready

__all__ = ["evalsha", "execute_command", "pack_command"]


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
