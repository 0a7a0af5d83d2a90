"""The slice of the Redis protocol (RESP2) the backplane relay speaks: reading a client's
commands, and writing replies.

Only what a redis-py client sends to the relay has to parse: arrays of bulk strings.
Everything is bounded (argument count and size) because the relay listens on a socket
that anything may connect to: a client that sends garbage or an endless argument gets
``ProtocolError`` and its connection closed, and nothing is allocated for it first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from redis.exceptions import ResponseError

__all__ = ["NIL_ARRAY", "ProtocolError", "encode", "encode_error", "read_command"]

# The relay's commands are short: an XREAD has 7 arguments of a few dozen bytes.
MAX_ARGUMENTS = 32
MAX_ARGUMENT_BYTES = 4096
NIL_ARRAY = b"*-1\r\n"  # XREAD that blocked and found nothing


class ProtocolError(Exception):
    """The client sent something that is not a RESP array of bulk strings, or too much."""


async def read_command(reader: asyncio.StreamReader) -> list[bytes] | None:
    """The next command's arguments; None when the client closed the connection
    between commands. Raises ``ProtocolError`` on malformed or oversized input and
    ``asyncio.IncompleteReadError`` on a connection closed inside a command."""
    line = await _line(reader)
    if line is None:
        return None
    count = _length(line, b"*", MAX_ARGUMENTS)
    if count == 0:
        raise ProtocolError("empty command")
    arguments = []
    for _ in range(count):
        header = await _line(reader)
        if header is None:
            raise asyncio.IncompleteReadError(b"", None)
        size = _length(header, b"$", MAX_ARGUMENT_BYTES)
        data = await reader.readexactly(size + 2)
        if data[-2:] != b"\r\n":
            raise ProtocolError("bulk string not terminated by CRLF")
        arguments.append(data[:-2])
    return arguments


async def _line(reader: asyncio.StreamReader) -> bytes | None:
    try:
        line = await reader.readuntil(b"\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    except asyncio.LimitOverrunError as exc:  # a line longer than the reader's limit
        raise ProtocolError("line too long") from exc
    return line[:-2]


def _length(line: bytes, kind: bytes, limit: int) -> int:
    if line[:1] != kind:
        raise ProtocolError(f"expected {kind.decode()!r}, got {line[:16]!r}")
    try:
        value = int(line[1:])
    except ValueError:
        raise ProtocolError(f"bad length {line[:16]!r}") from None
    if not 0 <= value <= limit:
        raise ProtocolError(f"length {value} out of range (0..{limit})")
    return value


def encode(value: object) -> bytes:
    """A reply as RESP2: what redis-py parsed with no response callback (bytes, int,
    None, nested lists) written back as the server sent it."""
    if isinstance(value, bytes):
        return b"$%d\r\n%b\r\n" % (len(value), value)
    if isinstance(value, str):
        return encode(value.encode())
    if isinstance(value, bool):
        return b":%d\r\n" % int(value)
    if isinstance(value, int):
        return b":%d\r\n" % value
    if value is None:
        return NIL_ARRAY
    if isinstance(value, Sequence):
        return b"*%d\r\n" % len(value) + b"".join(encode(item) for item in value)
    raise TypeError(f"cannot encode {type(value).__name__} as RESP")


def encode_error(error: ResponseError | str) -> bytes:
    """An error reply. A redis-py ``ResponseError`` is written back with the code the
    server sent (redis-py strips a known code such as ``OOM`` from the message and keeps
    it as ``status_code``; an unknown one stays in the message), so the client raises
    the same exception class as it would have from Redis itself."""
    if isinstance(error, str):
        message = error
    else:
        code = getattr(error, "status_code", None)
        message = f"{code} {error}" if code else str(error)
    return b"-%b\r\n" % message.replace("\r", " ").replace("\n", " ").encode()
