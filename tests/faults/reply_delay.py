"""A TCP proxy that makes chosen Redis replies late: the command reaches Redis and runs
at once, only its reply waits (a slow network path, a GC pause in the client, a full
socket buffer). What a socket timeout looks like from the client when the server did
the work: the case where a client must assume its command may have landed."""

from __future__ import annotations

import asyncio

__all__ = ["ReplyDelayProxy"]


class ReplyDelayProxy:
    """Delays the reply to the next command whose bytes contain ``match`` (per
    connection) by ``delay`` seconds; ``latency`` delays every reply."""

    def __init__(self, port: int) -> None:
        self.upstream = ("127.0.0.1", port)
        self.match: bytes | None = None
        self.delay = 0.0
        self.latency = 0.0
        self.port = 0
        self.matched = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> ReplyDelayProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            self._server.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(*self.upstream)
        self._writers |= {client_w, server_w}
        pending: list[float] = []

        async def up() -> None:
            while data := await client_r.read(65536):
                if self.match is not None and self.match in data:
                    pending.append(self.delay)
                    self.matched += 1
                server_w.write(data)
                await server_w.drain()
            server_w.close()

        async def down() -> None:
            while data := await server_r.read(65536):
                if self.latency:
                    await asyncio.sleep(self.latency)
                if pending:
                    await asyncio.sleep(pending.pop(0))
                client_w.write(data)
                await client_w.drain()
            client_w.close()

        await asyncio.gather(up(), down(), return_exceptions=True)
