"""A tiny HTTP endpoint: ``/healthz`` (alive), ``/readyz`` (working), ``/metrics``.

Plain asyncio instead of prometheus-client's thread server: it runs on the daemon's own
loop, so ``/readyz`` reads the daemon's state without locks, and it stops with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import msgspec

__all__ = ["HealthServer"]

_REASONS = {
    200: "OK",
    404: "Not Found",
    414: "URI Too Long",
    503: "Service Unavailable",
}
# What is read and thrown away after refusing an over-long request line, so the answer
# reaches the client (closing with its unread bytes in our buffer resets the connection,
# and the 414 with it) without letting a client make us read forever.
_DISCARD_BYTES = 1 << 20
_DISCARD_SECONDS = 1.0


class HealthServer:
    """Serves on ``port`` (0 = an ephemeral port, see ``bound_port``)."""

    def __init__(
        self,
        port: int,
        status: Callable[[], tuple[bool, dict[str, object]]],
        metrics: Callable[[], bytes],
        host: str = "0.0.0.0",
    ) -> None:
        self._port = port
        self._host = host
        self._status = status
        self._metrics = metrics
        self._server: asyncio.Server | None = None
        self.bound_port: int | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)
        self.bound_port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                request = await asyncio.wait_for(reader.readline(), 5.0)
            except ValueError:
                # Over the StreamReader's limit (64 KiB): a scanner or a broken client,
                # not a probe. Answered, not left to asyncio's unhandled-error traceback.
                await _answer(writer, 414, b"request line too long\n", "text/plain")
                if writer.can_write_eof():
                    writer.write_eof()  # the client sees the answer's end at once
                await _discard(reader)
                return
            parts = request.decode("latin-1").split()
            path = parts[1] if len(parts) >= 2 else "/"
            await _answer(writer, *self._route(path.split("?")[0]))
        except (OSError, TimeoutError, UnicodeDecodeError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _route(self, path: str) -> tuple[int, bytes, str]:
        if path == "/metrics":
            return 200, self._metrics(), "text/plain; version=0.0.4; charset=utf-8"
        if path in ("/healthz", "/readyz"):
            ready, detail = self._status()
            # Liveness only says the loop answers; readiness says keys are being deleted.
            code = 200 if path == "/healthz" or ready else 503
            return code, msgspec.json.encode(detail), "application/json"
        return 404, b"not found\n", "text/plain"


async def _answer(writer: asyncio.StreamWriter, code: int, body: bytes, kind: str) -> None:
    head = (
        f"HTTP/1.1 {code} {_REASONS[code]}\r\nContent-Type: {kind}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()


async def _discard(reader: asyncio.StreamReader) -> None:
    """Read what the client still sends, bounded in bytes and time (see _DISCARD_BYTES)."""
    left = _DISCARD_BYTES
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(_DISCARD_SECONDS):
            while left > 0 and (chunk := await reader.read(min(left, 65536))):
                left -= len(chunk)
