"""Hot-key detection: which keys this instance reads from L2 faster than a threshold.

Why a sketch: an instance may read millions of distinct keys, and remembering a counter
per key would make memory grow with the key space. Rates are therefore estimated with
two count-min sketches of fixed size (``_DEPTH`` rows of ``_WIDTH`` counters): the
current window and the previous one, blended into a sliding-window estimate

    rate = (count_current + count_previous * overlap) / window

where ``overlap`` is the share of the previous window still inside ``[now - window,
now]``. Updates are *conservative* (only the row counters equal to the minimum are
raised), which keeps the over-estimate caused by colliding keys far below the plain
count-min bound. Only keys whose estimate crosses the threshold are remembered, in a
map capped at ``_MAX_HOT`` entries, so memory is constant: see ``memory_bytes()``.

Promotion happens on the read that makes the estimate cross the threshold: with a
window of at most 1 s a key read at or above the threshold is hot within 1 s. A key
stays hot while its rate stays above the threshold and ``cooldown`` seconds after its
last read above it (hysteresis: a key hovering around the threshold does not flap
between replicas and the base key). Static keys from config are always hot, and
counted like the others so that their rate is reported.

Threads: only the cache's loop thread writes (``record``, ``is_hot``, the window
rotation, demotion), lock-free on the read path. Other threads only read: a Prometheus
scrape calls ``hot_keys()`` from its server thread (and any call of the sync API's
``hot_keys()`` comes from another thread than the loop). So ``rate`` and ``hot_keys``
never mutate anything: a window over is rotated virtually in the reader's own variables
(a reader that rotated for real would rotate a second time after the loop, and throw a
window of counts away), a cooled key is left out (the loop demotes it), and the hot set
is copied in one C-level step before it is walked (the loop may add a key meanwhile).
The one multi-field update, the rotation (once per window), is made under a lock that a
reader takes to copy the three fields, so it never sees a half-rotated pair of windows.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable

from layered_cache._forklock import ForkSafeLock

__all__ = ["HotKeyDetector"]

_DEPTH = 4  # rows; each uses 12 other bits of the key's 64-bit hash
_WIDTH = 4096  # counters per row, a power of two: index = hash bits & mask
_MASK = _WIDTH - 1
_CELLS = _DEPTH * _WIDTH
_MAX_HOT = 1024  # hot keys remembered at once; more than that is a config problem


class HotKeyDetector:
    """Sliding-window rate estimate per key in constant memory, plus the hot set."""

    __slots__ = (
        "_clock",
        "_current",
        "_hot",
        "_previous",
        "_rotation",
        "_window_start",
        "cooldown",
        "static",
        "threshold",
        "window",
    )

    def __init__(
        self,
        threshold: float | None,
        window: float = 1.0,
        cooldown: float = 10.0,
        static: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window <= 0:
            raise ValueError("window must be > 0")
        self.threshold = threshold
        self.window = window
        self.cooldown = cooldown
        self.static = frozenset(static)
        self._clock = clock
        self._current = [0] * _CELLS
        self._previous = [0] * _CELLS
        self._window_start = clock()
        # key -> (when it last read above the threshold, the rate measured then)
        self._hot: dict[str, tuple[float, float]] = {}
        # Taken by the loop only to rotate (once per window), by readers to copy the
        # window fields: never on a read that stays in its window.
        self._rotation = ForkSafeLock()

    # -- counting ----------------------------------------------------------------------

    def _rotate(self, now: float) -> None:
        """Start a new window; the finished one becomes ``previous`` (loop thread only).
        Cooled keys are demoted here too, so a key hot once does not leave every later
        read paying the hot-set look-up."""
        elapsed = now - self._window_start
        fresh = [0] * _CELLS
        previous = self._current if elapsed < 2 * self.window else [0] * _CELLS
        with self._rotation:  # a reader copies these three together (``_windows``)
            self._previous = previous
            self._current = fresh
            self._window_start += self.window * int(elapsed // self.window)
        if self._hot:
            self._expire(now)

    def _windows(self) -> tuple[float, list[int], list[int], float]:
        """A reader's copy of (window start, current, previous, now), rotated in these
        variables only if the loop has not rotated yet: the detector is left as it is.
        ``now`` is read after the copy, so it is never before the copied start."""
        with self._rotation:
            start, current, previous = self._window_start, self._current, self._previous
        now = self._clock()
        elapsed = now - start
        if elapsed >= self.window:
            empty = [0] * _CELLS
            previous = current if elapsed < 2 * self.window else empty
            current = empty
            start += self.window * int(elapsed // self.window)
        return start, current, previous, now

    def record(self, key: str) -> bool:
        """Count one L2 read of ``key``; returns whether the key is hot now.

        On the read path of every L2 read, so the four row updates are unrolled (about
        a microsecond; see docs/hotkeys.md for the measured cost). A static key is
        counted too: hot whatever its rate, but ``hot_keys()`` reports its rate like
        any key's (returned before its count, it showed 0 reads/s however hard it was
        read). The static set is still looked up once per read, after the count.
        Without detection nothing is counted: that lookup is the whole cost.
        """
        threshold = self.threshold
        if threshold is None:
            return key in self.static
        now = self._clock()
        window = self.window
        if now - self._window_start >= window:
            self._rotate(now)
        hashed = hash(key)
        i0 = hashed & _MASK
        i1 = _WIDTH + ((hashed >> 12) & _MASK)
        i2 = 2 * _WIDTH + ((hashed >> 24) & _MASK)
        i3 = 3 * _WIDTH + ((hashed >> 36) & _MASK)
        cur = self._current
        c0, c1, c2, c3 = cur[i0], cur[i1], cur[i2], cur[i3]
        count = min(c0, c1, c2, c3) + 1
        # Conservative update: a counter already above our estimate holds other keys'
        # reads; raising it would only inflate their estimates.
        if c0 < count:
            cur[i0] = count
        if c1 < count:
            cur[i1] = count
        if c2 < count:
            cur[i2] = count
        if c3 < count:
            cur[i3] = count
        prev = self._previous
        previous = min(prev[i0], prev[i1], prev[i2], prev[i3])
        # _blend, inlined on the per-read path; after _rotate, 0 < overlap <= 1.
        overlap = 1.0 - (now - self._window_start) / window
        rate = (count + previous * overlap) / window
        if rate >= threshold:
            self._remember(key, now, rate)
            return True
        return self.is_hot(key, now) if self._hot else key in self.static

    def _blend(self, current: int, previous: int, now: float, start: float) -> float:
        """Sliding window: all of this window plus the part of the previous one that
        still lies inside ``[now - window, now]``."""
        overlap = 1.0 - (now - start) / self.window
        return (current + previous * max(0.0, overlap)) / self.window

    def _remember(self, key: str, now: float, rate: float) -> None:
        if key in self.static:
            return  # hot anyway: it takes no slot of the hot set
        hot = self._hot
        if key not in hot and len(hot) >= _MAX_HOT:
            self._expire(now)
            if len(hot) >= _MAX_HOT:
                return  # still hot for this read (record returns True), just not listed
        hot[key] = (now, rate)

    def rate(self, key: str) -> float:
        """Estimated reads/s of ``key`` over the sliding window (never under-estimates
        the key's own reads; collisions can only add). Read-only: any thread."""
        start, current_window, previous_window, now = self._windows()
        hashed = hash(key)
        rows = [row * _WIDTH + ((hashed >> (12 * row)) & _MASK) for row in range(_DEPTH)]
        current = min(current_window[i] for i in rows)
        previous = min(previous_window[i] for i in rows)
        return self._blend(current, previous, now, start)

    # -- the hot set -------------------------------------------------------------------

    def is_hot(self, key: str, now: float | None = None) -> bool:
        """Hot without counting a read (used by fills: write replicas or not)."""
        if key in self.static:
            return True
        seen = self._hot.get(key)
        if seen is None:
            return False
        if (self._clock() if now is None else now) - seen[0] > self.cooldown:
            self._hot.pop(key, None)  # cooled down: demoted
            return False
        return True

    def _expire(self, now: float) -> None:
        """Demote the cooled keys (loop thread only)."""
        cooldown = self.cooldown
        for key in [k for k, (seen, _) in list(self._hot.items()) if now - seen > cooldown]:
            self._hot.pop(key, None)

    def hot_keys(self) -> dict[str, float]:
        """Current hot keys with their current estimated rate in reads/s.

        Static keys are included, with their rate counted as any key's (0.0 without
        detection: then nothing is counted); the ``layered-cache hotkeys`` CLI lists
        them once, as static, not again as detected. Read-only (module doc): a cooled
        key is left out, not demoted, and the hot set is walked on a copy.
        """
        now = self._clock()
        hot = list(self._hot.items())  # one C-level copy: the loop may add keys meanwhile
        measure = self.threshold is not None
        result = {key: self.rate(key) if measure else 0.0 for key in self.static}
        for key, (seen, peak) in hot:
            if now - seen <= self.cooldown:
                result[key] = max(self.rate(key), 0.0) if measure else peak
        return result

    # -- memory ------------------------------------------------------------------------

    def memory_cells(self) -> int:
        """Counters and hot-set slots held: independent of the distinct keys seen."""
        return len(self._current) + len(self._previous) + 2 * len(self._hot)

    def memory_bytes(self) -> int:
        """Bytes held by the sketches and the hot set (shallow: counters are small ints
        shared by the interpreter, hot keys are the caller's strings). At most about
        2 * 8 * _CELLS + the dict of _MAX_HOT entries, ~0.35 MB."""
        return (
            sys.getsizeof(self._current)
            + sys.getsizeof(self._previous)
            + sys.getsizeof(self._hot)
            + sum(sys.getsizeof(v) for v in list(self._hot.values()))
        )
