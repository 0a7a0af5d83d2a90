"""L1: the in-process cache (cachetools TLRUCache, one expiry per entry).

Each entry gets its own jittered TTL, capped by its L2 soft expiry, so an instance never
serves a value from memory longer than Redis would consider it fresh.

Invalidation races: a reader that began its L2 read *before* an invalidation of a key
may finish *after* the backplane dropped that key; filling L1 then would resurrect the
old value. Each invalidation bumps a sequence number and leaves a tombstone; a fill
carries the sequence number seen when its read began and is discarded if the key was
invalidated since. Tombstones are bounded: when there are too many, they are replaced
by a floor (every fill that began before the floor is discarded), which is conservative
and never wrong.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from cachetools import TLRUCache

from layered_cache._tombstones import Tombstones

__all__ = ["MISSING", "L1Cache"]


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()
class L1Cache(Tombstones):
    """Thread-safe TLRU cache of decoded values; ``get`` returns ``MISSING`` on a miss."""

    def __init__(self, max_entries: int, timer: Callable[[], float] = time.monotonic) -> None:
        super().__init__()  # the tombstones (``_tombstones``), changed under ``_lock``
        self._timer = timer
        self.max_entries = max_entries
        # Entries hold the bare value: TLRUCache keeps each entry's expiry in its own
        # record, and a (value, expiry) tuple beside it cost ~80 B per entry and an index
        # per hit. ``put`` hands the expiry over in ``_expiry`` (under ``_lock``), which
        # TLRUCache asks ``_ttu`` for while it stores the entry.
        self._expiry = 0.0
        self._entries: TLRUCache[str, Any] = TLRUCache(
            maxsize=max_entries, ttu=self._ttu, timer=timer
        )
        # cachetools caches are not thread-safe: writes (and, without a GIL, reads) lock.
        self._lock = threading.Lock()
        self._free_threaded = not getattr(sys, "_is_gil_enabled", lambda: True)()

    def _ttu(self, _key: str, _value: Any, _now: float) -> float:
        return self._expiry

    def lock_free_entries(self) -> TLRUCache[str, Any] | None:
        """The entries, for a caller that inlines ``get`` on the L1-hit path
        (``Namespace.get_or_load``): ``entries[key]`` or ``KeyError``, no lock, as
        ``get`` reads them. None on a free-threaded build, where every read locks."""
        return None if self._free_threaded else self._entries

    def get(self, key: str) -> Any:
        """The value, or ``MISSING``.

        Reads take no lock (this is the hottest path of the library): TLRUCache's
        ``__getitem__`` is a dict lookup, an ``OrderedDict.move_to_end`` and a second
        dict lookup, each a single C-level operation that the GIL makes atomic. A writer
        racing a reader (under ``_lock``) can at worst make the key vanish between two
        of those steps, which surfaces as ``KeyError``: a spurious miss, never a wrong
        value or a corrupted structure. On a free-threaded build every read locks.
        ``cache[key]`` + KeyError, not ``cache.get``: get() would check expiry twice.
        """
        if self._free_threaded:
            with self._lock:
                return self._read(key)
        return self._read(key)

    def _read(self, key: str) -> Any:
        try:
            return self._entries[key]
        except KeyError:
            return MISSING

    def put(self, key: str, value: Any, ttl: float, read_seq: int | None = None) -> bool:
        """Store ``value`` for ``ttl`` seconds unless the key was invalidated since ``read_seq``."""
        if ttl <= 0:
            return False
        with self._lock:
            if read_seq is not None and self.invalidated_since(key, read_seq):
                return False
            self._expiry = self._timer() + ttl
            self._entries[key] = value
        return True

    def replace_many(
        self,
        items: Sequence[tuple[str, Any, float]],
        read_seq: int,
        held: frozenset[str] = frozenset(),
    ) -> int:
        """A write's last step in L1 (``set``, ``set_many``), under one lock and one clock
        reading: each (key, value, ttl) takes the key's place and tombstones it, so a
        fill that began while the write was in flight (it may carry the value the write
        replaced) is refused. A key invalidated since ``read_seq`` (another write or an
        invalidation overtook this one: whose L2 write landed last is unknown) or whose
        TTL is spent is dropped and tombstoned instead, before anything is stored (a
        full L1 then has their room, rather than evicting an unrelated entry). Returns
        how many were overtaken. ``items`` holds each key once.

        Writes don't allocate: a key L1 doesn't hold, nor held as the write began
        (``held``), is stored only while L1 has room. Into a full L1 each new key evicted
        an entry reads put there (a bulk ``set_many`` flushed the writer's hot set), at
        ~3.5 us in cachetools' eviction, more than the rest of its write to Redis."""
        with self._lock:
            self._seq += 1
            seq, entries, tombstones = self._seq, self._entries, self._tombstones
            overtaken, dropped, kept = 0, [], []
            for key, value, ttl in items:  # judged before any tombstone of this pass
                if self.invalidated_since(key, read_seq):
                    overtaken += 1
                    dropped.append(key)
                elif ttl > 0:
                    kept.append((key, value, ttl))
                else:
                    dropped.append(key)
            with entries.timer as now:  # frozen: see ``discard``
                for key in dropped:
                    if key in entries:
                        del entries[key]
                    tombstones[key] = seq
                entries.expire(now)  # expired entries make room first
                # Room for new keys: what held keys, back in their place, leave free.
                back = sum(1 for key, _, _ in kept if key in held and key not in entries)
                room = entries.maxsize - entries.currsize - back
                for key, value, ttl in kept:
                    tombstones[key] = seq
                    if key not in entries and key not in held:
                        if room <= 0:
                            continue  # full: no eviction for a write (see above)
                        room -= 1
                    self._expiry = now + ttl
                    entries[key] = value
            self._bound_tombstones(seq)
        return overtaken

    def discard(self, keys: Iterable[str], dropped_keys: list[str] | None = None) -> int:
        """Drop keys and tombstone them so in-flight fills of them are discarded.
        Returns how many live entries were dropped; ``dropped_keys`` gets them."""
        dropped = 0
        with self._lock:
            self._seq += 1
            seq = self._seq
            entries = self._entries
            # One clock reading for the whole drop: TLRUCache's ``in`` and ``del`` each
            # read the clock, and an entry that expires between the two makes ``del``
            # raise KeyError. Inside ``with entries.timer`` both see the same time.
            with entries.timer:
                for key in keys:
                    # ``in`` + ``del`` rather than ``pop`` (TLRUCache.pop looks the key
                    # up three times: a tag invalidation drops thousands of keys in one
                    # go) or ``del`` + KeyError (raising costs more than a lookup, and a
                    # set() discards a key that is usually absent, twice).
                    if key in entries:
                        del entries[key]
                        dropped += 1
                        if dropped_keys is not None:
                            dropped_keys.append(key)
                    self._tombstones[key] = seq
            self._bound_tombstones(seq)
        return dropped

    def after_fork(self) -> None:
        """In a child process: a fresh lock (a thread of the parent may have held ours
        at the fork, and no thread is left here to release it), then nothing held: the
        copy missed every invalidation since the fork."""
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        """Drop everything (the backplane fell behind): every in-flight fill is discarded."""
        with self._lock:
            self._entries.clear()
            self._overtake_all()

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has an entry (no LRU touch: for bookkeeping, not reads)."""
        return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            self._entries.expire()
            return len(self._entries)

    def remaining_ttl(self, key: str) -> float | None:
        """For tests and debugging: reads the expiry TLRUCache keeps per entry (a private
        record; keeping a copy of our own would cost every entry memory)."""
        with self._lock:
            records = getattr(self._entries, "_TLRUCache__items", {})
            record = records.get(key) if key in self._entries else None
            return None if record is None else float(record.expires) - self._timer()
