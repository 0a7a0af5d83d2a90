"""This instance's own writes that may land after their caller left.

A single-node ``set()`` is one atomic step that carries its backplane entry (or, the
stream refusing it, its pub/sub fallback message: ``WRITE_ONE_SCRIPT``). A caller
cancelled or timed out while that step is on its way to Redis leaves it unread: it may
have landed, or land later (asyncio flushes what the socket took when the connection
is dropped; a slow network or a stalled Redis holds it meanwhile). This instance's L1
is emptied when its caller leaves, but a read here before the write lands fills it
from L2 with the replaced value, and the late entry, which names this instance as its
origin, would be skipped as "already applied locally" by its own listener: the
replaced value served here for its L1 TTL while L2 and the fleet serve the new one.

So the keys of such a write are noted here, for ``WINDOW`` seconds, and this
instance's listener and fallback subscriber apply their own entries that name them,
as another instance's. A write that lands later than that (a network holding it
longer) leaves what a read here made meanwhile for its L1 TTL, the bound of a missed
invalidation. At most ``MOST`` keys are noted: a write that would note more (one
large ``set_many``, or many left at once: a timeout storm) can't forget any of them
(each may land yet), so the record is dropped and every entry of our own is applied,
whatever it names, until the window of the newest write left unread ends. Memory stays
bounded; the cost is L1 drops of keys our own writes settled (their next read goes to
L2), never a replaced value kept. A write refused before anything was sent (an open
breaker: ``Writes``) can't land and is not noted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import msgspec

from layered_cache._codec import UNDECODABLE

__all__ = ["UnsettledWrites"]


class UnsettledWrites:
    WINDOW = 60.0  # seconds a write left unread is awaited
    MOST = 10_000  # keys noted; past it, every entry of ours is applied (module doc)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until: dict[str, float] = {}  # key -> when it stops being awaited, in order
        self._all_until = 0.0  # while > 0, until then: every entry of ours is applied

    def __bool__(self) -> bool:
        """Whether any key is noted: the listener decodes its own entries only then."""
        return bool(self._until) or self._all_until > 0.0

    def add(self, keys: Iterable[str]) -> None:
        self._trim()
        until = self._clock() + self.WINDOW
        if self._all_until:
            self._all_until = until  # already applying all of ours: this write's window too
            return
        noted = self._until
        for key in keys:
            noted.pop(key, None)  # to the end: the order stays that of ``until``
            noted[key] = until
            if len(noted) > self.MOST:
                # Forgetting a key would lose a write that may land yet: every entry of
                # ours is applied instead, for the newest write's window (it ends last).
                noted.clear()
                self._all_until = until
                return

    def heard(self, raw: bytes | None, on_keys: Callable[[list[str]], None]) -> None:
        """A stream entry of ours (its ``keys`` field): ``on_keys`` with those it names
        that are noted. Nothing to decode while none is (every set() of ours is heard)."""
        if not self or raw is None:
            return
        try:
            keys = msgspec.msgpack.decode(raw, type=list[str])
        except UNDECODABLE:
            return  # not one a set() of ours wrote
        if picked := self.pick(keys):
            on_keys(picked)

    def pick(self, keys: Iterable[str]) -> list[str]:
        """Those of ``keys`` (an entry of our own) a write left unread may have named."""
        self._trim()
        if self._all_until:
            return list(keys)
        return [key for key in keys if key in self._until]

    def _trim(self) -> None:
        now, until = self._clock(), self._until
        if self._all_until and self._all_until <= now:
            self._all_until = 0.0
        while until:
            key, ends = next(iter(until.items()))
            if ends > now:
                return
            del until[key]
