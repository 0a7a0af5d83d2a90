"""In-process single-flight (after Go's ``golang.org/x/sync/singleflight``).

Concurrent callers asking for the same key share one execution of ``fn``: the first
caller runs it, everyone else awaits the same future. A failure fails every waiter and
leaves nothing behind, so the next call starts fresh. The call runs in its own task, so a
caller that is cancelled (e.g. a client disconnect) doesn't cancel the load the others
are waiting for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

__all__ = ["SingleFlight"]

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._calls: dict[str, asyncio.Future[T]] = {}

    def in_flight(self, key: str) -> bool:
        return key in self._calls

    def forget(self, key: str) -> None:
        """Later callers start a new call instead of joining the running one (used after
        an invalidation: a load that began before it may return the old value)."""
        self._calls.pop(key, None)

    async def do(self, key: str, fn: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """Returns ``(result, shared)``; ``shared`` is True for callers that joined."""
        future = self._calls.get(key)
        if future is not None:
            return await asyncio.shield(future), True
        task: asyncio.Task[T] = asyncio.ensure_future(fn())
        self._calls[key] = task
        task.add_done_callback(lambda _: self._forget(key, task))
        return await asyncio.shield(task), False

    def _forget(self, key: str, task: asyncio.Future[T]) -> None:
        if self._calls.get(key) is task:
            del self._calls[key]
        if not task.cancelled():
            task.exception()  # mark retrieved: waiters got it, no "never retrieved" noise
