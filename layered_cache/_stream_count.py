"""Whether a connected stream reader lost entries it never saw, by count.

The listener's position tests (``_stream.missed_entries``) must be asked about the
position *before* the lost entries. A reader that stalled while the stream was emptied
(``XTRIM MAXLEN 0``), deleted (eviction) and created anew, or trimmed by a writer with
a smaller ``backplane.maxlen``, and then read a few newer entries, had moved past the
loss and never saw it: its L1 kept what the lost entries invalidated (found by a
review, 2026-12-05). Counts don't depend on when they are taken: the stream's
``entries-added`` (every XADD ever, Redis 7+) against the entries the reader read,
between two moments it was caught up (its position the stream's last ID), bracket
whatever was lost between them.
"""

from __future__ import annotations

import time

from redis.exceptions import ResponseError

from layered_cache._stream import last_generated, stream_field
from layered_cache._stream_link import StreamLink

__all__ = ["EntryCount"]


class EntryCount:
    """One XINFO at most every ``every`` seconds, and only after entries were read
    since the last one: an idle reader sends nothing more. So a loss is seen at the
    first count after entries flow again (a reader that stays idle has nothing newer
    to serve wrongly than what it held before, and its next invalidation is what
    brings the count)."""

    def __init__(self, link: StreamLink, every: float = 0.25) -> None:
        self._link = link
        self._every = every
        self._due = 0.0
        self._counted_at_read = 0  # the reader's total when we last asked
        self._mark: tuple[int, int] | None = None  # (entries-added, entries read) then

    async def lost(self, position: bytes, read: int) -> bool:
        """True if entries were added since the last caught-up moment that were not
        read (or the stream was created anew: fewer added than read)."""
        if read == self._counted_at_read or time.monotonic() < self._due:
            return False
        self._due, self._counted_at_read = time.monotonic() + self._every, read
        added = await self._added_if_caught_up(position)
        if added is None:
            return False
        mark, self._mark = self._mark, (added, read)
        return mark is not None and added - mark[0] != read - mark[1]

    async def start(self, position: bytes, read: int) -> None:
        """The first mark, when the reader takes its position: otherwise the first one
        came at its first caught-up read, and a new instance (or one in a quiet fleet)
        that lost the entries before it (stream deleted, emptied, trimmed by a writer
        with a smaller ``maxlen``) while it had read none had no mark to see it by: its
        L1 kept what they invalidated, with ``gaps`` 0 (review, 2026-12-05). One XINFO,
        at start only; an entry appended since ``position`` leaves no mark, as before."""
        added = await self._added_if_caught_up(position)
        if added is not None:
            self._mark, self._counted_at_read = (added, read), read

    async def _added_if_caught_up(self, position: bytes) -> int | None:
        """The stream's ``entries-added`` if its last ID is ``position``; None if it is
        gone meanwhile ("no such key": the next read finds out), on an older Redis, or
        not caught up (no comparable moment). A failed link raises to the listener's
        loop, like a failed XREAD: the held connection is dropped with it, and had the
        error been swallowed here, the next read would have gone out on a fresh
        connection with no gap check - after a relay reset (or a Redis restart) that
        closed it, L1 kept what was lost."""
        try:
            info = await self._link.info()
        except ResponseError:
            return None
        added, last = stream_field(info, "entries-added"), last_generated(info)
        if added is None or last is None or bytes(last) != position:
            return None
        return int(added)

    def forget(self) -> None:
        """After an L1 clear: what was lost before is covered by it."""
        self._mark = None
