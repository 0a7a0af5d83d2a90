"""How the relay writes a reply to a client: at once while the transport's buffer is
below its high-water mark, else waiting for the client to read, for as long as it keeps
reading (``send``). A client that stops reading is dropped and its bytes released."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import sys
import termios

__all__ = ["send"]


async def send(writer: asyncio.StreamWriter, reply: bytes, patience: float) -> None:
    """Write ``reply``; past the transport's high-water mark, wait for the client to
    read it, and raise TimeoutError once it has read nothing for ``patience``.
    Unbounded, a client that sent reads and never read the replies held its connection
    and their bytes for as long as the relay ran; bounding the whole wait instead would
    drop a client reading steadily but slower than a large reply takes. Only a full
    buffer is timed: a timer per reply would cost the relay's CPU."""
    writer.write(reply)
    transport = writer.transport
    if transport.get_write_buffer_size() <= transport.get_write_buffer_limits()[1]:
        await writer.drain()  # not paused: returns at once
        return
    while True:
        before = _unsent(transport)
        try:
            async with asyncio.timeout(patience):
                await writer.drain()
            return
        except TimeoutError:
            if _unsent(transport) >= before:  # nothing read in ``patience``
                transport.abort()  # close() would wait for the unread bytes, for ever
                raise


def _unsent(transport: asyncio.WriteTransport) -> int:
    """Bytes written to ``transport`` the client has not taken yet: asyncio's buffer
    and the kernel's send queue. The buffer alone moves only when the kernel has room
    for a third of its send buffer (megabytes on loopback), so a client reading
    100 KB/s showed no progress for seconds; the queue moves with every read."""
    unsent = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError, ValueError):
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")  # Linux
        unsent += int.from_bytes(queued, sys.byteorder)
    return unsent
