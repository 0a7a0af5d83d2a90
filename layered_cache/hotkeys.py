"""Hot-key detection: which keys are read from L2 faster than a threshold.

Memory must not grow with the number of distinct keys, so rates are estimated with two
count-min sketches (the current and the previous window, blended into a sliding-window
estimate) of fixed size, and only keys whose estimate crosses the threshold are
remembered, in a bounded map. A key stays hot while its rate stays above the
threshold and for ``cooldown`` seconds after; static hot keys from config are always hot.

Each instance measures its own reads; promotion happens on the read that crosses the
threshold, so within one window of the rate crossing it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

__all__ = ["HotKeyDetector"]

_DEPTH = 4
_WIDTH = 4096  # power of two: index = bits of the hash & mask
_MASK = _WIDTH - 1
_MAX_HOT = 1024


class HotKeyDetector:
    def __init__(
        self,
        threshold: float | None,
        window: float = 1.0,
        cooldown: float = 10.0,
        static: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self.window = window
        self.cooldown = cooldown
        self.static = frozenset(static)
        self._clock = clock
        self._current = [0] * (_DEPTH * _WIDTH)
        self._previous = [0] * (_DEPTH * _WIDTH)
        self._window_start = clock()
        self._hot: dict[str, tuple[float, float]] = {}  # key -> (last seen hot, rate)

    def _rotate(self, now: float) -> None:
        elapsed = now - self._window_start
        if elapsed < self.window:
            return
        if elapsed < 2 * self.window:
            self._previous = self._current
        else:  # idle for more than a window: the previous one is empty too
            self._previous = [0] * (_DEPTH * _WIDTH)
        self._current = [0] * (_DEPTH * _WIDTH)
        self._window_start += self.window * int(elapsed // self.window)

    def record(self, key: str) -> bool:
        """Count one L2 read of ``key``; returns whether the key is hot now."""
        if key in self.static:
            return True
        if self.threshold is None:
            return False
        now = self._clock()
        self._rotate(now)
        hashed = hash(key)
        current, previous = self._current, self._previous
        estimate_cur = estimate_prev = 1 << 62
        for row in range(_DEPTH):
            index = row * _WIDTH + ((hashed >> (row * 12)) & _MASK)
            count = current[index] + 1
            current[index] = count
            estimate_cur = min(estimate_cur, count)
            estimate_prev = min(estimate_prev, previous[index])
        # Sliding window: the part of the previous window still inside [now - window, now].
        overlap = 1.0 - (now - self._window_start) / self.window
        rate = (estimate_cur + estimate_prev * overlap) / self.window
        if rate >= self.threshold:
            if key in self._hot or len(self._hot) < _MAX_HOT:
                self._hot[key] = (now, rate)
            return True
        return self.is_hot(key, now)

    def is_hot(self, key: str, now: float | None = None) -> bool:
        if key in self.static:
            return True
        seen = self._hot.get(key)
        if seen is None:
            return False
        if (self._clock() if now is None else now) - seen[0] > self.cooldown:
            del self._hot[key]
            return False
        return True

    def hot_keys(self) -> dict[str, float]:
        """Current hot keys with their last measured rate (static keys: rate 0.0)."""
        now = self._clock()
        for key in [k for k, (seen, _) in self._hot.items() if now - seen > self.cooldown]:
            del self._hot[key]
        result = {key: 0.0 for key in self.static}
        result.update({key: rate for key, (_, rate) in self._hot.items()})
        return result

    def memory_cells(self) -> int:
        """Counters held, independent of the number of distinct keys seen."""
        return len(self._current) + len(self._previous) + 2 * len(self._hot)
