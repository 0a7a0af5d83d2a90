"""Which keys this instance saw invalidated or written, and when: a read takes the
sequence number as it begins (``begin_read``) and, once done, asks whether its key was
tombstoned since (``invalidated_since``). L1 refuses such a read's fill with it
(``L1Cache``, which keeps its tombstones here); ``_served`` answers such a read
``no-store``, and a namespace without L1 keeps a ``KeyTombstones`` for that alone.

Bounded: past ``MAX_TOMBSTONES`` they are replaced by a floor, and every read begun
before it counts as overtaken: conservative, never wrong."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["MAX_TOMBSTONES", "KeyTombstones", "Tombstones"]

MAX_TOMBSTONES = 10_000


class Tombstones:
    """The record itself. Not locked here: ``L1Cache`` changes it under its own lock."""

    def __init__(self) -> None:
        self._seq = 0
        self._floor = 0
        self._tombstones: dict[str, int] = {}

    def begin_read(self) -> int:
        """Call before reading L2 for a fill; pass the result to ``invalidated_since``."""
        return self._seq

    def invalidated_since(self, key: str, read_seq: int) -> bool:
        """Whether ``key`` was invalidated (or everything forgotten) after ``begin_read``
        returned ``read_seq``."""
        return read_seq < self._floor or self._tombstones.get(key, -1) > read_seq

    def _bound_tombstones(self, seq: int) -> None:
        """Too many tombstones become a floor at ``seq``."""
        if len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.clear()
            self._floor = seq

    def _overtake_all(self) -> None:
        """Every read begun before now counts as overtaken."""
        self._seq += 1
        self._tombstones.clear()
        self._floor = self._seq


class KeyTombstones(Tombstones):
    """For a namespace without L1 (``Policy.marks``): else nothing recorded a write or an
    invalidation here, and a read it overtook went out with ``s-maxage`` after the
    write's purge. No lock: unlike L1 (whose hits the sync API reads from its callers'
    threads), it is read and changed on the cache's event loop only, where reads and
    invalidations (local, or from the backplane listener) run."""

    def discard(self, keys: Iterable[str]) -> int:
        """Tombstone ``keys``; 0: nothing held was dropped (``L1Cache.discard``'s count)."""
        self._seq += 1
        seq, tombstones = self._seq, self._tombstones
        for key in keys:
            tombstones[key] = seq
        self._bound_tombstones(seq)
        return 0

    def clear(self) -> None:
        """Every read in flight counts as overtaken (the backplane lost track)."""
        self._overtake_all()
