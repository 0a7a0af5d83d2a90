"""A toxic TCP proxy on loopback, between the cache and Redis.

Modes (switchable while connections are open):
- ``pass``: forward both ways.
- ``latency``: delay every chunk from the server by ``latency`` seconds.
- ``blackhole``: accept connections and swallow bytes, never answer (a hung server).
- ``cut()``: close every open connection now (a network blip).
- ``rewrite``: a function applied to every chunk from the server (poison a reply).
- ``hold_at``: the next chunk to the server that holds these bytes is forwarded up to
  them, then the rest waits until ``release`` is set (``holding`` is set meanwhile):
  the moment before a command reaches the server, made as long as a test needs.
- ``marker`` and ``silence_marked()``: a connection whose client sent the marker's
  bytes is marked; ``silence_marked()`` makes the open marked ones pass nothing either
  way from then on, closing nothing (a NAT or firewall that dropped an idle flow
  without a reset). Connections opened later pass.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Literal

Mode = Literal["pass", "latency", "blackhole"]


class _Flow:
    """One proxied connection, for ``marker``."""

    def __init__(self) -> None:
        self.marked = False
        self.silent = False


class ToxicProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.mode: Mode = "pass"
        self.latency = 0.0
        self.rewrite: Callable[[bytes], bytes] | None = None
        self.hold_at: bytes | None = None
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self.marker: bytes | None = None
        self._flows: list[_Flow] = []
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> ToxicProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    def silence_marked(self) -> int:
        """Black-hole the open connections whose client sent ``marker``; how many."""
        marked = [flow for flow in self._flows if flow.marked]
        for flow in marked:
            flow.silent = True
        return len(marked)

    def cut(self) -> None:
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._writers.add(client_w)
        if self.mode == "blackhole":
            await self._swallow(client_r)
            return
        try:
            server_r, server_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        self._writers.add(server_w)
        flow = _Flow()
        self._flows.append(flow)
        try:
            await asyncio.gather(
                self._pipe(client_r, server_w, upstream=True, flow=flow),
                self._pipe(server_r, client_w, upstream=False, flow=flow),
                return_exceptions=True,
            )
        finally:
            self._flows.remove(flow)

    async def _swallow(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(Exception):
            while await reader.read(65536):
                pass

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: bool,
        flow: _Flow,
    ) -> None:
        try:
            while data := await reader.read(65536):
                if upstream and self.marker is not None and self.marker in data:
                    flow.marked = True
                if self.mode == "blackhole" or flow.silent:
                    continue
                if not upstream and self.mode == "latency" and self.latency:
                    await asyncio.sleep(self.latency)
                if not upstream and self.rewrite is not None:
                    data = self.rewrite(data)
                if upstream and self.hold_at is not None and self.hold_at in data:
                    at, self.hold_at = data.index(self.hold_at), None
                    writer.write(data[:at])
                    await writer.drain()
                    self.holding.set()
                    await self.release.wait()
                    data = data[at:]
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            self._writers.discard(writer)
