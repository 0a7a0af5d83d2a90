"""Redis commands as the bytes a client sends: RESP arrays of bulk strings, packed by
the library for the commands ``_direct`` sends itself (why: its module docstring).
The chunks are not copied into one buffer: the socket takes the list as it is."""

from __future__ import annotations

from typing import cast

import msgspec

__all__ = ["Packed", "pack_command"]


def pack_command(args: tuple[bytes | str | int, ...]) -> list[bytes]:
    """RESP2/3 request: an array of bulk strings. Values are not copied into one buffer
    (the socket takes the list as it is). Exact types are dispatched by identity, half
    the cost of an ``isinstance`` chain (set()'s 16 arguments: ~8 -> ~4 µs on the bench
    VM); subclasses take ``_other``."""
    chunks = [b"*%d\r\n" % len(args)]
    for arg in args:
        kind = type(arg)
        # mypy doesn't narrow on ``type(x) is T``: the casts say what the test proved.
        if kind is bytes:
            data = cast(bytes, arg)
        elif kind is str:
            data = cast(str, arg).encode()
        elif kind is int:
            data = b"%d" % cast(int, arg)
        else:
            data = _other(arg)
        chunks += (b"$%d\r\n" % len(data), data, b"\r\n")
    return chunks


class Packed(msgspec.Struct):
    """Commands packed one after another for a single send: their bytes, how many
    commands (one reply each) they are, and the bytes of the values among them (what
    makes a send long: ``_direct`` stretches its deadline by it)."""

    chunks: list[bytes] = msgspec.field(default_factory=list)
    count: int = 0
    value_bytes: int = 0

    def add(self, args: tuple[bytes | str | int, ...]) -> None:
        self.chunks += pack_command(args)
        self.count += 1

    def add_set(self, name: str, data: bytes, ttl_ms: int) -> None:
        """``SET name data PX ttl_ms``, packed in three formats rather than five
        arguments' worth (a ``set_many`` of 100 packed its SETs in ~50 µs, not ~115)."""
        key, ttl = name.encode(), b"%d" % ttl_ms
        self.chunks += (
            b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(key), key, len(data)),
            data,
            b"\r\n$2\r\nPX\r\n$%d\r\n%b\r\n" % (len(ttl), ttl),
        )
        self.count += 1
        self.value_bytes += len(data)


def _other(arg: object) -> bytes:
    if isinstance(arg, bytes):
        return bytes(arg)
    if isinstance(arg, str):
        return arg.encode()  # a (str, Enum) member: its value, not str()'s "Kind.NAME"
    if isinstance(arg, int) and not isinstance(arg, bool):
        return b"%d" % int(arg)
    kind = type(arg).__name__
    raise TypeError(f"a command argument must be bytes, str or int, not {kind}")
