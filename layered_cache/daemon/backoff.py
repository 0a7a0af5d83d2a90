"""Capped exponential backoff with full jitter, for retrying Redis and Kafka writes."""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["Backoff"]


class Backoff:
    """Delays ``base * 2**n`` capped at ``cap``, each drawn uniformly from [delay/2, delay].

    Jitter matters when several daemons retry against the same recovering Redis: without
    it they reconnect in lock step and hit it together. The half-delay floor keeps a
    minimum spacing so a retry storm can't start from a lucky draw of zero.
    """

    def __init__(
        self, base: float = 0.05, cap: float = 5.0, rand: Callable[[], float] = random.random
    ) -> None:
        self.base = base
        self.cap = cap
        self._rand = rand
        self.attempt = 0

    def next_delay(self) -> float:
        delay = min(self.cap, self.base * (2**self.attempt))
        self.attempt += 1
        return float(delay * (0.5 + 0.5 * self._rand()))

    def reset(self) -> None:
        self.attempt = 0
