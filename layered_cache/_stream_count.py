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


# What ``_added_at`` answers besides a count: the stream's last ID is past the position
# (entries not read yet, or a relay's kept XINFO older than the position), or there is
# no stream ("no such key": deleted, evicted, not created again yet).
_BEHIND, _GONE = -1, -2


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
        self._settle_due = 0.0  # ``settle``'s own pace
        self._counted_at_read = 0  # the reader's total when we last asked
        self._mark: tuple[int, int] | None = None  # (entries-added, entries read) then
        self._wanted = True  # no mark since the start or the last clear (``settle``)

    async def lost(self, position: bytes, read: int) -> bool:
        """True if entries were added since the last caught-up moment that were not
        read (or the stream was created anew: fewer added than read)."""
        if read == self._counted_at_read or time.monotonic() < self._due:
            return False
        self._due, self._counted_at_read = time.monotonic() + self._every, read
        added = await self._added_at(position)
        if added == _GONE:  # deleted: the entries that make it anew are counted at once
            self._due = 0.0
        if added is None or added < 0:  # behind, or gone: the next read finds out
            return False
        mark, self._mark, self._wanted = self._mark, (added, read), False
        return mark is not None and added - mark[0] != read - mark[1]

    async def settle(self, position: bytes, read: int) -> None:
        """Take a mark at ``position`` if none was taken since the reader took its
        position or since its last clear (``forget``); the reader calls it before each
        read. Without it the first mark came at a caught-up count after an entry was
        read, and a reader that had read none since (a new instance, one in a quiet
        fleet, one idle since a clear) and then lost entries while stalled (stream
        deleted, emptied, trimmed by a writer with a smaller ``maxlen``) had no mark to
        see it by: its L1 kept what they invalidated (reviews, 2026-12-05).
        Not caught up (an entry appended since ``position``; behind a relay, its kept
        XINFO older than our position) leaves it wanted, asked again at the next read
        (at most every ``every`` seconds), or taken by ``lost`` once entries are read."""
        if not self._wanted or time.monotonic() < self._settle_due:
            return
        # Its own pace, not ``lost``'s: sharing it, a mark taken at the start held back
        # the count of the first entries read, and a loss right after them was counted
        # only after the next XREAD's BLOCK.
        self._settle_due = time.monotonic() + self._every
        added = await self._added_at(position)
        if added == _BEHIND:
            return
        self._wanted = False  # counted, or can't be (Redis < 7)
        if added == _GONE:
            # The stream made anew counts its entries from 0, and each is after our
            # position: read from the first (after a clear for a deleted stream the
            # position is 0-0, ``_check_gap``). No mark here, and an idle reader stalled
            # while the new stream's first entries were emptied away never saw it.
            added = 0
        if added is not None:
            self._mark, self._counted_at_read = (added, read), read

    async def _added_at(self, position: bytes) -> int | None:
        """The stream's ``entries-added`` if its last ID is ``position``, ``_BEHIND`` if
        it is another, ``_GONE`` if there is no stream; None if it can't be counted (an
        older Redis, an error reply). A failed link raises to the listener's
        loop, like a failed XREAD: the held connection is dropped with it, and had the
        error been swallowed here, the next read would have gone out on a fresh
        connection with no gap check - after a relay reset (or a Redis restart) that
        closed it, L1 kept what was lost."""
        try:
            info = await self._link.info()
        except ResponseError as exc:
            return _GONE if "no such key" in str(exc).lower() else None
        added, last = stream_field(info, "entries-added"), last_generated(info)
        if added is None or last is None:
            return None
        return int(added) if bytes(last) == position else _BEHIND

    def forget(self) -> None:
        """After an L1 clear: what was lost before is covered by it. A new mark is taken
        at the reader's next read (``settle``)."""
        self._mark, self._wanted = None, True
