"""The daemon's /healthz /readyz /metrics endpoint listens on 0.0.0.0 by default: what
anyone on the network sends it gets an HTTP answer, never an unhandled traceback."""

from __future__ import annotations

import asyncio
from typing import Any

from layered_cache.daemon.health import HealthServer


async def test_a_request_line_over_the_reader_limit_is_answered_414_without_a_traceback() -> None:
    """A request line over asyncio's 64 KiB StreamReader limit (a scanner, a broken
    client) raised ValueError out of the handler: asyncio logged "Unhandled exception in
    client_connected_cb" with a traceback at ERROR and the client got no answer."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    server = HealthServer(0, lambda: (True, {"status": "ok"}), lambda: b"", host="127.0.0.1")
    await server.start()
    try:
        assert server.bound_port
        reader, writer = await asyncio.open_connection("127.0.0.1", server.bound_port)
        writer.write(b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        # The endpoint still serves the probes afterwards.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.bound_port)
        writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
        probe = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        await asyncio.sleep(0.2)
    finally:
        await server.close()
        loop.set_exception_handler(None)
    assert answer.startswith(b"HTTP/1.1 414 "), answer[:60]
    assert probe.startswith(b"HTTP/1.1 200 ")
    assert not errors, [f"{c.get('message')} {c.get('exception')!r}" for c in errors]
