"""In-process single-flight (after Go's ``golang.org/x/sync/singleflight``).

Concurrent callers asking for the same key share one execution of ``fn``: the first
caller (the leader) runs it inline and publishes the outcome on a future that everyone
else awaits. Running it inline rather than in a task of its own matters: a task costs an
extra event-loop round trip on every L1 miss, which is most of the gap between an L2 hit
and a raw GET.

A failure fails every waiter and leaves nothing behind, so the next call starts fresh.
If the leader is cancelled (a client went away), its waiters are not: they see the
cancelled future while they themselves are not being cancelled, and start over, one of
them becoming the new leader.
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

    def running(self) -> list[str]:
        """The keys with a call in flight."""
        return list(self._calls)

    def forget_all(self) -> None:
        """``forget`` every key (the backplane lost track: every load may be outdated)."""
        self._calls.clear()

    async def do(self, key: str, fn: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """Returns ``(result, shared)``; ``shared`` is True for callers that joined."""
        while (future := self._calls.get(key)) is not None:
            try:
                return await asyncio.shield(future), True
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not future.cancelled() or (task is not None and task.cancelling()):
                    raise  # we are the ones being cancelled
                # The leader was cancelled, not us: run (or join) a fresh call.
        # Leader: run fn inline (no task of its own) and publish the outcome.
        future = asyncio.get_running_loop().create_future()
        self._calls[key] = future
        try:
            result = await fn()
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it, nobody else has to
            raise
        else:
            future.set_result(result)
            return result, False
        finally:
            if self._calls.get(key) is future:
                del self._calls[key]

    # -- batches: a leader claims many keys, then settles each --------------------------

    def claim(
        self, keys: list[str]
    ) -> tuple[dict[str, asyncio.Future[T]], dict[str, asyncio.Future[T]]]:
        """(futures of the keys now ours to load, futures of keys someone else is
        loading). The caller must settle every future it got, whatever happens
        (``settle`` each, ``settle_all`` on an error or a cancellation)."""
        loop = asyncio.get_running_loop()
        ours: dict[str, asyncio.Future[T]] = {}
        theirs: dict[str, asyncio.Future[T]] = {}
        for key in keys:
            running = self._calls.get(key)
            if running is not None:
                theirs[key] = running
            else:
                ours[key] = self._calls[key] = loop.create_future()
        return ours, theirs

    def settle(self, key: str, future: asyncio.Future[T], result: T) -> None:
        """Publish ``result`` to the joiners of our call for ``key``. After a forget()
        (an invalidation), newer callers hold a newer call: only ours is resolved."""
        if not future.done():
            future.set_result(result)
        self._release(key, future)

    def settle_all(self, ours: dict[str, asyncio.Future[T]], error: BaseException) -> None:
        """Fail every claimed call still open. A cancellation cancels them: their joiners
        start over (as with a cancelled ``do`` leader) instead of seeing our cancel."""
        for key, future in ours.items():
            if not future.done():
                if isinstance(error, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(error)
                    future.exception()  # retrieved: joiners re-raise it
            self._release(key, future)

    def _release(self, key: str, future: asyncio.Future[T]) -> None:
        if self._calls.get(key) is future:
            del self._calls[key]
