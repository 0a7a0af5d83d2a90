"""Round trips counted on the client side: every ``send_packed_command`` of a
``redis.asyncio`` connection is one write of one or more commands (a pipeline is one
send per node), so sends per node are round trips per node."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

from redis.asyncio.connection import AbstractConnection

__all__ = ["Sends", "count_sends", "drop_prefix"]


class Sends(Counter[str]):
    """Sends per ``host:port``, and the first command of each send, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.commands: list[str] = []


def _first_command(packed: Any) -> str:
    data = packed if isinstance(packed, (bytes, bytearray)) else b"".join(
        bytes(p) for p in packed
    )
    parts = bytes(data[:200]).split(b"\r\n")
    return parts[2].decode(errors="replace").upper() if len(parts) > 2 else "?"


@contextlib.contextmanager
def count_sends() -> Iterator[Sends]:
    """Counts sends per ``host:port`` while the block runs (every client in the process)."""
    sends = Sends()
    original = AbstractConnection.send_packed_command

    async def counting(self: Any, command: Any, check_health: bool = True) -> None:
        sends[f"{getattr(self, 'host', '?')}:{getattr(self, 'port', '?')}"] += 1
        sends.commands.append(_first_command(command))
        await original(self, command, check_health)

    AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
    try:
        yield sends
    finally:
        AbstractConnection.send_packed_command = original  # type: ignore[method-assign]


async def drop_prefix(client: Any, prefix: str) -> None:
    """Delete the keys a scenario left under its unique prefix (a shared Redis)."""
    batch: list[Any] = []
    async for key in client.scan_iter(match=prefix + "*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            await client.unlink(*batch)
            batch.clear()
    if batch:
        await client.unlink(*batch)
