"""What Redis itself adds to set()'s write: raw-socket round trips, no client library.

A blocking socket sends pre-packed bytes and reads until the reply is whole, so the
figure is the network round trip plus the server's work, with next to no client work:
a bare ``SET PX`` of the value, the one-key write script set() runs (``EVALSHA`` of
``WRITE_ONE_SCRIPT``: the SET, the lease's DEL and the backplane XADD), and the same
three as ``MULTI``/.../``EXEC`` (what ``set_many`` sends: the append as an ``EVAL`` of
``APPEND_SCRIPT``, which publishes it on the fallback channel if the stream refuses it). The difference
between the first two is what the atomic write-and-announce costs on the server, which
no client can win back; ``sets`` reports it beside set()'s ratio (docs/benchmarks.md).

Runs in a thread (``asyncio.to_thread``): a blocking socket must not hold the event
loop, where the scenario's caches keep listening.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable
from urllib.parse import urlparse

from layered_cache._packing import pack_command
from layered_cache._scripts import APPEND_SCRIPT, WRITE_ONE_SCRIPT

__all__ = ["KINDS", "raw_round_trips"]

KINDS = ("SET", "EVALSHA write script", "MULTI/EXEC")
_TTL_MS = 600_000


def _packed(*args: bytes | str | int) -> bytes:
    return b"".join(pack_command(args))


class _Conn:
    def __init__(self, url: str) -> None:
        parts = urlparse(url)
        self._sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if parts.password:
            self.call(_packed("AUTH", parts.password), 1)
        if parts.path.strip("/"):
            self.call(_packed("SELECT", parts.path.strip("/")), 1)

    def call(self, data: bytes, lines: int) -> bytes:
        """Send ``data``; read until ``lines`` CRLF-terminated lines have come (each
        reply here is simple: a status, an integer, a short bulk or an array of them)."""
        self._sock.sendall(data)
        reply = b""
        while reply.count(b"\r\n") < lines or not reply.endswith(b"\r\n"):
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionError("Redis closed the connection")
            reply += chunk
        return reply

    def close(self) -> None:
        self._sock.close()


def _commands(conn: _Conn, prefix: str, value: bytes) -> dict[str, Callable[[int], None]]:
    sha = conn.call(_packed("SCRIPT", "LOAD", WRITE_ONE_SCRIPT), 2).split(b"\r\n")[1].decode()
    stream = f"{prefix}raw-stream"
    entry: list[bytes | str] = ["keys", b"\x91\xa8raw:book", "origin", "bench-raw"]

    def set_px(i: int) -> None:
        conn.call(_packed("SET", f"{prefix}raw:set:{i}", value, "PX", _TTL_MS), 1)

    def script(i: int) -> None:
        key = f"{prefix}raw:eval:{i}"
        conn.call(_packed("EVALSHA", sha, 3, key, f"{key}:lease", stream, value, _TTL_MS,
                          10_000, *entry), 1)

    def transaction(i: int) -> None:
        key = f"{prefix}raw:multi:{i}"
        data = (_packed("MULTI") + _packed("SET", key, value, "PX", _TTL_MS)
                + _packed("DEL", f"{key}:lease")
                + _packed("EVAL", APPEND_SCRIPT, 1, stream, 10_000, *entry) + _packed("EXEC"))
        conn.call(data, 8)  # +OK, 3 x +QUEUED, *3, +OK, :n, :1

    return dict(zip(KINDS, (set_px, script, transaction), strict=True))


def raw_round_trips(
    url: str, prefix: str, value: bytes, calls: int, repeats: int
) -> dict[str, list[float]]:
    """Seconds per round trip of each kind, one figure per batch of ``calls``,
    ``repeats`` batches each, interleaved."""
    conn = _Conn(url)
    try:
        commands = _commands(conn, prefix, value)
        results: dict[str, list[float]] = {kind: [] for kind in KINDS}
        counter = 0
        for _ in range(repeats):
            for kind, command in commands.items():
                start = time.perf_counter()
                for _ in range(calls):
                    counter += 1
                    command(counter)
                results[kind].append((time.perf_counter() - start) / calls)
        return results
    finally:
        conn.close()


def summary(results: dict[str, list[float]]) -> str:
    """One line for the report: each kind's median and its excess over a bare SET."""
    medians = {kind: statistics.median(values) for kind, values in results.items()}
    base = medians["SET"]
    parts = [f"SET {base * 1e6:.1f} µs"] + [
        f"{kind} {medians[kind] * 1e6:.1f} µs (+{(medians[kind] - base) * 1e6:.1f})"
        for kind in KINDS[1:]
    ]
    return "; ".join(parts)
