"""Cheap backplane readers for ``bench.fanout``: many per process, one connection each.

Each reader runs the library's loop (``_backplane.BackplaneListener``): ``XREAD COUNT
1000 BLOCK 1000 STREAMS <stream> <last_id>``, and the next read as soon as the reply is
handled. Why not the library or redis-py: the point is to load the stream's server, not
the readers' machine, so a reader is an ``asyncio.Protocol`` with a pre-encoded command
and a minimal RESP2 parser: no coroutine, no connection pool, no response callbacks per
read. ``bench.fanout`` reports the readers' own CPU next to the server's, so it shows
when they, not the server, were the limit.

Per received entry a reader records its delivery latency: the receive time (the
``data_received`` call) minus the publisher's ``time.time()`` in the entry's ``t``
field (one machine, one clock).

The parent drives a process over a pipe: ``reset`` starts a window, ``collect`` returns
its counts, latencies and CPU, ``stop`` closes everything.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from typing import Any

__all__ = ["parse_reply", "reader_process"]

_COUNT = b"1000"
_BLOCK_MS = b"1000"


class Incomplete(Exception):
    """The buffer ends inside a reply: wait for more bytes."""


def _parse(buf: bytes, pos: int) -> tuple[Any, int]:
    """The RESP2 value at ``pos`` and the position after it (bulk strings as bytes)."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise Incomplete
    kind = buf[pos]
    if kind == 0x24:  # $ bulk string
        size = int(buf[pos + 1 : end])
        if size < 0:
            return None, end + 2
        stop = end + 2 + size
        if len(buf) < stop + 2:
            raise Incomplete
        return buf[end + 2 : stop], stop + 2
    if kind == 0x2A:  # * array
        size = int(buf[pos + 1 : end])
        if size < 0:
            return None, end + 2
        items = []
        pos = end + 2
        for _ in range(size):
            item, pos = _parse(buf, pos)
            items.append(item)
        return items, pos
    if kind in (0x2B, 0x3A):  # + simple string, : integer
        return buf[pos + 1 : end], end + 2
    if kind == 0x2D:  # - error
        raise RuntimeError(buf[pos + 1 : end].decode(errors="replace"))
    raise RuntimeError(f"unexpected RESP type byte {kind!r}")


def parse_reply(buf: bytes) -> tuple[Any, int]:
    """One complete reply from the start of ``buf``; raises :class:`Incomplete`."""
    return _parse(buf, 0)


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


class Stats:
    """What one process's readers saw since the last ``reset``."""

    def __init__(self) -> None:
        self.latencies = array("d")
        self.reads = 0
        self.timeouts = 0
        self.cpu0 = time.process_time()
        self.wall0 = time.monotonic()


class Reader(asyncio.Protocol):
    """One instance's backplane listener, reduced to the XREAD loop."""

    def __init__(
        self, address: tuple[str, int], stream: bytes, start_id: bytes, stats: list[Stats]
    ) -> None:
        self.address = address
        self.closing = False
        self.reconnects = 0
        parts = [b"XREAD", b"COUNT", _COUNT, b"BLOCK", _BLOCK_MS, b"STREAMS", stream]
        self._prefix = b"*8\r\n" + b"".join(_bulk(p) for p in parts)
        self.last_id = start_id
        self._stats = stats  # a one-element list: reset swaps in a new Stats
        self._buf = b""
        self.entries = 0  # since the last reset, to check every reader got every entry
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._buf = b""
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        self.transport.write(self._prefix + _bulk(self.last_id))

    def data_received(self, data: bytes) -> None:
        now = time.time()
        self._buf += data
        try:
            reply, used = parse_reply(self._buf)
        except Incomplete:
            return
        self._buf = self._buf[used:]
        self._handle(reply, now)
        self._send()

    def _handle(self, reply: Any, now: float) -> None:
        stats = self._stats[0]
        stats.reads += 1
        if not reply:
            stats.timeouts += 1
            return
        entries = reply[0][1]
        for entry_id, fields in entries:
            self.last_id = entry_id
            for i in range(0, len(fields) - 1, 2):
                if fields[i] == b"t":
                    stats.latencies.append(now - float(fields[i + 1]))
        self.entries += len(entries)

    def connection_lost(self, exc: Exception | None) -> None:
        """Reconnect after 50 ms, as the library's listener does (a relay closes its
        clients while it is not following the stream yet, or after a reset)."""
        self.transport = None
        self.reconnects += 1
        if not self.closing:
            asyncio.get_running_loop().call_later(0.05, self._reconnect)

    def _reconnect(self) -> None:
        async def connect() -> None:
            try:
                await asyncio.get_running_loop().create_connection(lambda: self, *self.address)
            except OSError:
                self.connection_lost(None)

        self._buf = b""
        if not self.closing:
            asyncio.get_running_loop().create_task(connect())


async def _connect(
    targets: list[tuple[str, int]], first: int, count: int, stream: bytes, start_id: bytes,
    stats: list[Stats],
) -> list[Reader]:  # fmt: skip
    """``count`` readers; reader i (fleet-wide index ``first + i``) uses target i mod T."""
    loop = asyncio.get_running_loop()
    readers = []
    for i in range(first, first + count):
        host, port = targets[i % len(targets)]
        reader = Reader((host, port), stream, start_id, stats)
        await loop.create_connection(lambda r=reader: r, host, port)  # type: ignore[misc]
        readers.append(reader)
    return readers


def _collect(readers: list[Reader], stats: Stats) -> dict[str, Any]:
    per_reader = [r.entries for r in readers]
    return {
        "latencies": stats.latencies.tobytes(),
        "reads": stats.reads,
        "timeouts": stats.timeouts,
        "entries_min": min(per_reader),
        "entries_max": max(per_reader),
        "entries": sum(per_reader),
        "cpu": time.process_time() - stats.cpu0,
        "wall": time.monotonic() - stats.wall0,
        "disconnected": sum(1 for r in readers if r.transport is None),
        "reconnects": sum(r.reconnects for r in readers),
    }


async def _serve(conn: Any, targets: list[tuple[str, int]], first: int, count: int,
                 stream: bytes, start_id: bytes) -> None:  # fmt: skip
    stats = [Stats()]
    readers = await _connect(targets, first, count, stream, start_id, stats)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def on_command() -> None:
        command = conn.recv()
        if command == "reset":
            stats[0] = Stats()
            for reader in readers:
                reader.entries = reader.reconnects = 0
            conn.send("ok")
        elif command == "collect":
            conn.send(_collect(readers, stats[0]))
        elif not done.done():
            done.set_result(None)

    loop.add_reader(conn.fileno(), on_command)
    conn.send("ready")
    try:
        await done
    finally:
        loop.remove_reader(conn.fileno())
        for reader in readers:
            reader.closing = True
            if reader.transport is not None:
                reader.transport.close()


def reader_process(conn: Any, targets: list[tuple[str, int]], first: int, count: int,
                   stream: bytes, start_id: bytes) -> None:  # fmt: skip
    """Entry point of a reader process (spawned): ``count`` readers until ``stop``."""
    try:
        asyncio.run(_serve(conn, targets, first, count, stream, start_id))
    except Exception as exc:  # tell the parent instead of leaving it waiting
        conn.send(f"error: {type(exc).__name__}: {exc}")
