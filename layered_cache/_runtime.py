"""What every namespace of one cache shares: the L2 store, the lease, the in-process
single-flight, the invalidator, the background tasks, the instrumentation hooks and the
clocks.

Namespaces share one ``SingleFlight`` because an invalidation arriving from the
backplane names Redis keys, not namespaces: one ``forget(key)`` must detach the in-flight
load whichever namespace started it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from layered_cache._giveback import GiveBacks
from layered_cache._invalidation import Invalidator
from layered_cache._l2 import L2Store
from layered_cache._logs import error_text
from layered_cache._purges import Purges
from layered_cache._singleflight import SingleFlight
from layered_cache._stampede import LeaseWaiter
from layered_cache._tags import TagVersions
from layered_cache._unsettled import UnsettledWrites

__all__ = ["BackgroundTasks", "Hooks", "Loader", "Runtime"]

Loader = Callable[[], Awaitable[Any]]
T = TypeVar("T")

_log = structlog.get_logger("layered_cache")


def _log_orphan_failure(task: asyncio.Task[Any]) -> None:
    """An invalidation's steps, a write's announcement or a load's fill (``to_completion``,
    ``spawn_orphan``) that failed once its caller had gone: named by its coroutine."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        _log.warning(
            "background_step_failed_after_its_caller_left",
            step=task.get_coro().__qualname__,  # type: ignore[union-attr]
            error=error_text(exc),
        )


@dataclass(slots=True, eq=False)
class Hooks:
    """Instrumentation (``layered_cache.prometheus``, ``layered_cache._tracing``): called
    on loads and L2 reads only, never on an L1 hit; empty lists and None cost nothing."""

    load_observers: list[Callable[[str, float, bool], None]] = field(default_factory=list)
    l2_observers: list[Callable[[str, float], None]] = field(default_factory=list)
    load_wrapper: Callable[[str, Loader], Awaitable[Any]] | None = None


class BackgroundTasks:
    """Fire-and-forget work (XFetch refreshes, replica copies, slow fills) that ``close``
    cancels and awaits, so no task outlives the cache or its Redis clients."""

    # How long ``close`` waits for a write a cancelled caller left running: its steps
    # are Redis round trips, each bounded by redis.timeout; cut off between its DEL and
    # its announcement, the fleet would keep the old value in L1 until its TTL.
    ORPHAN_GRACE = 5.0

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._orphans: set[asyncio.Task[Any]] = set()  # ``to_completion``'s, a subset

    async def to_completion(self, work: Coroutine[Any, Any, T]) -> T:
        """Await ``work`` in a task of its own that a cancelled caller leaves running.
        For the steps of an invalidation: once its first command may have reached Redis
        (a DEL, a new tag version), the rest (the announcement, the local drop) must
        follow, or the fleet keeps copies that L2 no longer holds, until their TTL.
        A failure nobody is left to hear is logged."""
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                self.spawn_orphan(task)
            raise

    def spawn_orphan(self, work: Awaitable[Any]) -> None:
        """``spawn`` for the rest of a write whose caller was cancelled (an announcement
        of what may have landed): ``close`` waits ``ORPHAN_GRACE`` for it, not the 0.2 s
        other work gets; a failure nobody is left to hear is logged."""
        task = asyncio.ensure_future(work)
        task.add_done_callback(_log_orphan_failure)
        self.spawn(task)
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # a strong reference: the loop keeps only weak ones
        task.add_done_callback(self._tasks.discard)

    async def close(self, grace: float = 0.2) -> None:
        """Let the tasks finish for up to ``grace`` seconds (a lease given back is one
        round trip), the writes cancelled callers left running up to ``ORPHAN_GRACE``,
        then cancel what is left."""
        await asyncio.sleep(0)  # a call cancelled just before us spawns its cleanup first
        loop = asyncio.get_running_loop()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace)
        until = loop.time() + self.ORPHAN_GRACE  # one grace for every orphan, however made
        if self._orphans:
            await asyncio.wait(list(self._orphans), timeout=self.ORPHAN_GRACE)
        await self._cancel(list(self._tasks))
        # What each cancelled round left to finish (a lease given back: one round trip,
        # ``grace`` at least), then cancelled, until a round leaves nothing new: a task
        # cancelled in the last round could spawn its cleanup after it, which outlived
        # the clients closed next. Bounded: a cleanup that spawns another each time is
        # cut off.
        for _ in range(3):
            left = [task for task in self._tasks if not task.done()]
            if not left:
                return
            await asyncio.wait(left, timeout=max(grace, until - loop.time()))
            await self._cancel(left)

    def forget_other_loops(self) -> None:
        """Drop the tasks of an event loop other than the running one: one that ended
        without ``close`` (``asyncio.run`` returning mid-load) left them pending for
        good, and cancelling one raised "Event loop is closed" in the next ``close``.
        In place: each task's done callback discards it from these very sets."""
        loop = asyncio.get_running_loop()
        for tasks in (self._tasks, self._orphans):
            tasks.difference_update([task for task in tasks if task.get_loop() is not loop])

    async def cancel_all(self, grace: float = 0.2) -> None:
        """Cancel every task now, with no grace to finish first, and what they spawn on
        their way out: ``close`` cut short by its caller's deadline, whose clients are
        closed next (a task left running reopened them). Each round waits up to
        ``grace`` for the cancelled tasks' own cleanup (a lease given back) to end."""
        for _ in range(3):
            left = [task for task in self._tasks if not task.done()]
            if not left:
                return
            for task in left:
                task.cancel()
            await asyncio.wait(left, timeout=grace)

    async def _cancel(self, tasks: list[asyncio.Task[Any]]) -> None:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


@dataclass(slots=True, eq=False)
class Runtime:
    store: L2Store
    leases: LeaseWaiter
    invalidator: Invalidator
    clock: Callable[[], float]
    rand: Callable[[], float]
    versions: TagVersions  # tag versions as this instance knows them (``_tags``)
    prefix: str
    flight: SingleFlight[Any] = field(default_factory=SingleFlight)
    tasks: BackgroundTasks = field(default_factory=BackgroundTasks)
    hooks: Hooks = field(default_factory=Hooks)
    # HTTP caches told after every local invalidation and set (``_purges``); idle if none.
    purges: Purges = field(default_factory=lambda: Purges([]))
    # Keys of our single-node set() calls whose caller left before the write's reply
    # (``_unsettled``): our listener applies our own entries naming them.
    unsettled: UnsettledWrites = field(default_factory=UnsettledWrites)
    # Admission of writes (set, set_many) and of the first L2 read of an L1 miss: taken
    # before the work, not only around its Redis call. ``asyncio.gather`` of 10,000
    # set() calls (or cold reads) otherwise runs every call's CPU work in one event-loop
    # pass before any connection is served, and the first connections' timeouts expire
    # on the starved loop: a burst of our own making would open the breaker. Never held
    # across a loader call (a slow database must not block other reads). Separate from
    # ``L2Store.slots`` (taken inside): holders of this one never wait for it again, so
    # the two can't deadlock.
    admission: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(64))
    # Why calls are refused (``check_open``), None while they may run: set by close()
    # and in a child forked from the process that started the cache, cleared by start().
    refusal: str | None = None
    # Set once close() dropped L1 and closes the clients, cleared by start(): a load that
    # ends now (its call was in flight) stores nothing, which reopened a closed client.
    ended: bool = False
    # The event loop calls last reached Redis on (``check_open``; ``start``), and whether
    # an earlier one did since the last (re)build: a start on another loop, or after
    # calls on two, closes the connections the other loop left (``LayeredCache._rebind``).
    loop: asyncio.AbstractEventLoop | None = None
    other_loop: bool = False
    # Leases the open breaker refused to give back, sent past it (``_giveback``).
    give_backs: GiveBacks = field(init=False)

    def __post_init__(self) -> None:
        self.give_backs = GiveBacks(self.store, self.tasks.spawn_orphan)

    def check_open(self) -> None:
        """Before anything that would reach Redis or fill L1 (an L1 miss, a write, an
        invalidation). A closed cache hears no invalidations: serving on, it kept
        superseded copies, and each call opened a connection nobody closed. A child
        forked from the process that started the cache would talk on that process's
        sockets: the parent then read the child's reply as its own (another key's
        value). L1 hits need no check: both empty L1 (``LayeredCache.close``,
        ``LayeredCache._after_fork``)."""
        if self.refusal is not None:
            raise RuntimeError(self.refusal)
        loop = asyncio.get_running_loop()
        if loop is not self.loop:
            self.other_loop, self.loop = self.other_loop or self.loop is not None, loop
