"""The relay's answer to ``XINFO STREAM``: one from Redis, shared by every instance.

Why: each listener counts the entries it read against the stream's ``entries-added``
(``_stream_count``), asking ``XINFO STREAM`` up to 4 times a second while entries flow.
Forwarded one by one, a relay of 20 instances had Redis answer ~150 of them against 12
XREADs of its own in 2.4 s: the stream's master worked per instance again, which the
relay is there to prevent (docs/operations.md, "Fan-out").

Shared, an answer stays correct for what a listener does with it. Its count compares
only at a moment its position is the stream's ``last-generated-id``, and a count taken
then is consistent however old the answer: it is the stream at that ID. Its gap check
after a reconnect reads ``first-entry`` and ``max-deleted-entry-id`` against its
position, and an answer is kept at most ``MAX_AGE`` and never across a new read of the
relay's (entries arrived: the stream moved) or a reset.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

__all__ = ["MAX_AGE", "InfoCache"]

MAX_AGE = 0.25  # seconds: a listener counts at most this often anyway


class InfoCache:
    """One ``XINFO STREAM`` reply (encoded, as sent to clients) at a time. Askers of a
    stale one take turns: the first fetches, the others find its reply kept (a fetch
    that failed or was cancelled leaves the next one to try)."""

    def __init__(self, max_age: float = MAX_AGE) -> None:
        self._max_age = max_age
        self._reply: bytes | None = None
        self._taken = 0.0
        self._generation = 0  # bumped by ``stale``: a fetch begun before it is not kept
        self._turn = asyncio.Lock()

    def stale(self) -> None:
        """The stream moved (entries read) or the relay reset: ask Redis again."""
        self._reply, self._generation = None, self._generation + 1

    async def get(self, fetch: Callable[[], Awaitable[bytes]]) -> bytes:
        """The kept reply, or ``fetch()``'s, kept unless it is an error reply or went
        stale while it was fetched."""
        if (kept := self._fresh()) is not None:
            return kept
        async with self._turn:
            if (kept := self._fresh()) is not None:
                return kept
            generation = self._generation
            reply = await fetch()
            if generation == self._generation and not reply.startswith(b"-"):
                self._reply, self._taken = reply, time.monotonic()
            return reply

    def _fresh(self) -> bytes | None:
        if self._reply is not None and time.monotonic() - self._taken < self._max_age:
            return self._reply
        return None
