"""A circuit breaker in front of Redis.

When Redis is down or slow every request would otherwise pay the full timeout before
falling through to the loader. After ``failures`` consecutive errors the breaker opens
and L2 is skipped outright; after ``reset`` seconds one request is let through as a
probe (half-open): success closes it, failure re-opens it. Transitions are logged once,
not per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Literal

import structlog

__all__ = ["CircuitBreaker"]

State = Literal["closed", "open", "half_open"]
_log = structlog.get_logger("layered_cache.breaker")


class CircuitBreaker:
    def __init__(
        self,
        failures: int,
        reset: float,
        name: str = "redis",
        clock: Callable[[], float] = time.monotonic,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self._threshold = failures
        self._reset = reset
        self._name = name
        self._clock = clock
        self._failures = 0
        self._state: State = "closed"
        self._opened_at = 0.0
        self._probing = False
        self._probe: asyncio.Task[Any] | None = None  # the task of the probe in flight
        self.transitions = 0
        # Called on every failure: a Redis Cluster client refreshes its slot map (a
        # failed node may have been replaced; ``_topology``).
        self.on_failure = on_failure

    def sibling(self, name: str) -> CircuitBreaker:
        """A new breaker with the same settings (one per Redis Cluster node)."""
        return CircuitBreaker(self._threshold, self._reset, name, self._clock, self.on_failure)

    @property
    def state(self) -> State:
        if self._state == "open" and self._clock() - self._opened_at >= self._reset:
            return "half_open"
        return self._state

    def allow(self) -> bool:
        """Whether a request may use Redis now."""
        if self._state == "closed":
            return True
        if self._state == "open":
            if self._clock() - self._opened_at < self._reset:
                return False
            self._transition("half_open")
        # half-open: exactly one probe in flight at a time
        if self._probing:
            return False
        self._probing = True
        self._probe = _current_task()
        return True

    def opened(self) -> bool:
        """Open right now, reset time or not: a request let through before it opened,
        and queued since for a connection (``L2Store.slots``), is refused, or each
        would pay the timeout of a dead Redis, max_in_flight at a time, that the breaker
        is there to spare; the probe of a half-open breaker is not."""
        return self._state == "open"

    def success(self) -> None:
        self._failures = 0
        self._probing, self._probe = False, None
        if self._state != "closed":
            self._transition("closed")

    def abandon(self) -> None:
        """The request ended without an answer from Redis (cancelled: a client timeout or
        disconnect, or any other BaseException). It proves nothing either way, but if it
        was the half-open probe the probe is over: without this ``_probing`` would stay
        True and no request would ever be let through again. Only the probe's own task
        ends it: a request let through before the breaker opened, cancelled now, would
        otherwise let a second probe through beside the first."""
        if self._probe is None or self._probe is _current_task():
            self._probing = False
            self._probe = None

    def failure(self, error: BaseException | None = None) -> None:
        if self.on_failure is not None:
            self.on_failure()
        self._probing, self._probe = False, None
        self._failures += 1
        if self._state == "half_open" or (
            self._state == "closed" and self._failures >= self._threshold
        ):
            self._opened_at = self._clock()
            self._transition("open", error)

    def _transition(self, state: State, error: BaseException | None = None) -> None:
        self._state = state
        self.transitions += 1
        _log.warning(
            "circuit_breaker",
            breaker=self._name,
            state=state,
            error=type(error).__name__ if error else None,
        )


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop: a caller outside asyncio, its own probe
        return None
