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

__all__ = [
    "NIL_ARRAY",
    "CommandReader",
    "ProtocolError",
    "encode",
    "encode_error",
    "parse_command",
]

# The relay's commands are short: an XREAD has 7 arguments of a few dozen bytes.
MAX_ARGUMENTS = 32
MAX_ARGUMENT_BYTES = 4096
_MAX_LINE = 32  # "*<count>" or "$<size>": a few digits
MAX_COMMAND_BYTES = MAX_ARGUMENTS * (MAX_ARGUMENT_BYTES + _MAX_LINE + 4) + _MAX_LINE
NIL_ARRAY = b"*-1\r\n"  # XREAD that blocked and found nothing


class ProtocolError(Exception):
    """The client sent something that is not a RESP array of bulk strings, or too much."""


class CommandReader:
    """Reads a client's commands from a stream.

    What arrives is buffered and parsed in one go: a relay serving hundreds of readers
    parses an XREAD per delivery per reader, and awaiting each line and argument of
    it separately was most of the relay's CPU (bench/fanout.py)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._buffer = bytearray()

    async def next(self) -> list[bytes] | None:
        """The next command's arguments; None when the client closed the connection
        between commands. Raises ``ProtocolError`` on malformed or oversized input and
        ``asyncio.IncompleteReadError`` on a connection closed inside a command."""
        while True:
            parsed = parse_command(self._buffer)
            if parsed is not None:
                arguments, used = parsed
                del self._buffer[:used]
                return arguments
            if len(self._buffer) > MAX_COMMAND_BYTES:
                raise ProtocolError("command too long")
            data = await self._reader.read(65536)
            if not data:
                if self._buffer:
                    raise asyncio.IncompleteReadError(bytes(self._buffer), None)
                return None
            self._buffer += data


def parse_command(buffer: bytes | bytearray) -> tuple[list[bytes], int] | None:
    """The command at the start of ``buffer`` and the bytes it takes; None while it is
    incomplete. Raises ``ProtocolError`` as soon as what is there can't be one."""
    line, position = _line_at(buffer, 0)
    if line is None:
        return None
    count = _length(line, b"*", MAX_ARGUMENTS)
    if count == 0:
        raise ProtocolError("empty command")
    arguments = []
    for _ in range(count):
        header, position = _line_at(buffer, position)
        if header is None:
            return None
        size = _length(header, b"$", MAX_ARGUMENT_BYTES)
        end = position + size
        if len(buffer) < end + 2:
            return None
        if buffer[end : end + 2] != b"\r\n":
            raise ProtocolError("bulk string not terminated by CRLF")
        arguments.append(bytes(buffer[position:end]))
        position = end + 2
    return arguments, position


def _line_at(buffer: bytes | bytearray, start: int) -> tuple[bytes | None, int]:
    end = buffer.find(b"\r\n", start)
    if end < 0:
        if len(buffer) - start > _MAX_LINE:
            raise ProtocolError("line too long")
        return None, start
    if end - start > _MAX_LINE:
        raise ProtocolError("line too long")
    return bytes(buffer[start:end]), end + 2


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
