"""Purges of HTTP caches as background work: a bounded queue and one worker per
gateway, bounded retries, counters.

Why a queue and not an ``await`` in ``invalidate()``: the promise of ``invalidate()``
and of the daemon's offset commit is about L2 and every L1, and must not wait on a
gateway that may be slow or down. ``submit`` never blocks and never raises; the worker
delivers in order, retries a failed purge with backoff, then logs and counts it. An
undelivered purge costs freshness only up to the response's ``s-maxage``, which stays
the bound (docs/http.md).

Why a queue per gateway (``Purges``): one dead Varnish beside live ones made every purge
fail and be retried, with backoff, on the one in-order worker, and each retry held back
every later purge to the live ones too (three changes' purges 10 s late at the default
timeout). Each gateway now has its own queue, worker and retries.

A repeat (``repeat_after``) is the second purge of keys and tags already counted once,
as delivered: its own outcome is ``repeated``, or else only logged
(``http_purge_repeat_failed``, ``http_purge_repeat_dropped``), never ``failed`` or
``dropped``, which would count one purge twice (``delivered + failed + dropped`` adds up
to ``submitted``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec
import structlog

from layered_cache._config import Config
from layered_cache._redact import replace_quoted

__all__ = ["PurgeQueue", "PurgeStats", "Purger", "Purges", "purges_for"]

_log = structlog.get_logger("layered_cache")


class Purger(Protocol):
    """Tells HTTP caches to drop responses: those of cache ``keys`` and those carrying
    any of ``tags``. Raises on failure (the queue retries)."""

    async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None: ...


class PurgeStats(msgspec.Struct):
    submitted: int = 0  # keys + tags handed to the queue
    delivered: int = 0  # keys + tags the purger accepted (first purges: repeats apart)
    repeated: int = 0  # keys + tags purged once more, ``repeat_after`` later
    retries: int = 0  # attempts after a failure (first purges and repeats)
    failed: int = 0  # keys + tags given up on after every retry (logged; repeats apart)
    dropped: int = 0  # keys + tags refused by a full queue, or left at close (repeats apart)


def purges_for(
    config: Config, purger: Purger | None = None, stats: PurgeStats | None = None
) -> Purges:
    """The queues for ``purger``, else one per Varnish instance in ``[purge] urls``,
    else none (``submit`` does nothing). ``stats``: counters to count on (a restart)."""
    purgers: list[Purger] = [] if purger is None else [purger]
    owned = purger is None and bool(config.purge.urls)
    if owned:
        from layered_cache.purge import VarnishPurger  # needs httpx: only when configured

        purgers = [VarnishPurger([url], timeout=config.purge.timeout) for url in config.purge.urls]
    stats = PurgeStats() if stats is None else stats
    return Purges([
        PurgeQueue(
            each,
            max_pending=config.purge.queue,
            retries=config.purge.retries,
            repeat_after=config.purge.repeat_after,
            owned=owned,
            stats=stats,
            # A purger of the caller's (a CDN's API) is bounded by ``purge.timeout`` per
            # call; ours bound each request they send by it already.
            timeout=None if owned else config.purge.timeout,
        )
        for each in purgers
    ], stats)


class Purges:
    """One ``PurgeQueue`` per gateway (see the module doc), counted together: each
    gateway's keys and tags count once each (``delivered + failed + dropped`` adds up
    to ``submitted`` per gateway, and so in all). Without queues it is idle."""

    def __init__(self, queues: Sequence[PurgeQueue], stats: PurgeStats | None = None) -> None:
        self._queues = list(queues)
        self.stats = PurgeStats() if stats is None else stats

    @property
    def active(self) -> bool:
        """Whether anything is purged (callers skip building key names otherwise)."""
        return bool(self._queues)

    def submit(self, keys: Iterable[str] = (), tags: Iterable[str] = ()) -> None:
        """Queue a purge for every gateway; never blocks, never raises."""
        if not self._queues:
            return
        keys, tags = list(keys), list(tags)
        for queue in self._queues:
            queue.submit(keys, tags)

    def start(self) -> None:
        for queue in self._queues:
            queue.start()

    async def drain(self) -> None:
        """Wait until every gateway's queue is delivered or given up on."""
        await asyncio.gather(*(queue.drain() for queue in self._queues))

    async def close(self, grace: float = 1.0) -> None:
        """Each queue gets ``grace`` to deliver, at the same time."""
        await asyncio.gather(*(queue.close(grace) for queue in self._queues))

    def abandon(self) -> None:
        """``close`` for queues whose event loop has ended: what they hold is counted."""
        for queue in self._queues:
            queue.abandon()


class PurgeQueue:
    """One purger behind a bounded queue. ``start`` in a running loop, ``close`` to end.
    Without a purger it is idle: ``submit`` costs one comparison."""

    def __init__(
        self,
        purger: Purger | None,
        *,
        max_pending: int = 10_000,
        retries: int = 3,
        backoff: Sequence[float] = (0.1, 0.5, 2.0),
        repeat_after: float = 0.0,
        owned: bool = False,
        stats: PurgeStats | None = None,
        timeout: float | None = None,
    ) -> None:
        self.purger = purger
        self._timeout = timeout  # per call of the purger: a hung one is a failure
        self._repeat_after = repeat_after
        self._owned = owned  # built from the config: closed with the queue
        self.stats = PurgeStats() if stats is None else stats  # shared by ``Purges``
        self._retries = retries
        self._backoff = list(backoff) or [0.1]
        # Bounded by what the jobs hold (``_pending`` keys + tags), not by how many jobs:
        # one job is a whole set_many or a daemon batch (thousands of keys).
        self._queue: asyncio.Queue[tuple[list[str], list[str], bool]] = asyncio.Queue()
        self._max_pending = max_pending
        self._pending = 0
        self._worker: asyncio.Task[None] | None = None
        self._timers: dict[asyncio.TimerHandle, int] = {}  # repeats not queued yet: size
        self._current: tuple[list[str], list[str], bool] | None = None  # being delivered
        self._closed = False  # a submit after close() starts no worker nobody would stop

    def submit(self, keys: Iterable[str] = (), tags: Iterable[str] = ()) -> None:
        """Queue a purge; never blocks, never raises (a full queue drops and counts)."""
        if self.purger is None:
            return
        job = (list(keys), list(tags), False)
        size = len(job[0]) + len(job[1])
        if not size:
            return
        self.stats.submitted += size
        if self._closed:  # a write that was in flight when the cache closed
            self.stats.dropped += size
            _log.warning("http_purge_dropped", reason="closed", count=size, keys=job[0][:5])
            return
        self.start()  # in the caller's loop, at the first purge: no start() call needed
        self._put(job, size)

    def _put(self, job: tuple[list[str], list[str], bool], size: int) -> None:
        """Queue what fits under ``max_pending`` purges; the rest is dropped (counted)."""
        room = max(0, self._max_pending - self._pending)
        if size > room:
            keys, tags, repeat = job
            kept = keys[:room], tags[: max(0, room - len(keys))]
            left = keys[len(kept[0]) :], tags[len(kept[1]) :]
            self._dropped(size - room, repeat, "queue full", *left)
            job, size = (*kept, repeat), room
            if not size:
                return
        self._pending += size
        self._queue.put_nowait(job)

    def start(self) -> None:
        if self.purger is not None and self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run())

    async def drain(self) -> None:
        """Wait until every queued purge was delivered or given up on (tests, shutdown)."""
        await self._queue.join()

    async def close(self, grace: float = 1.0) -> None:
        """Deliver what is queued for up to ``grace`` seconds, then stop. A purge
        submitted during the grace is queued (a write that landed meanwhile); after it,
        dropped (counted)."""
        worker = self._worker
        if worker is None:
            self._closed = True
            return
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queue.join(), grace)
        finally:  # also when our caller's deadline cuts the grace short
            self._closed, self._worker = True, None
            for timer in self._timers:  # a repeat queued after close would wait for ever
                timer.cancel()
            worker.cancel()
            # Counted now, before any await: a deadline that cut the grace short ends
            # this call at its next one, and what was left went uncounted, unlogged.
            self._count_abandoned()
        try:
            await asyncio.wait([worker])  # its end, not its exception: ours propagates
        finally:
            aclose = getattr(self.purger, "aclose", None)
            if self._owned and aclose is not None:
                await aclose()

    def abandon(self) -> None:
        """Without awaiting (its worker's loop has ended: a warm-up under ``asyncio.run``
        before ``start()`` on the server's loop): what it holds is counted as dropped,
        as ``close`` counts it. A closed queue holds nothing."""
        if self._closed:
            return
        for timer in self._timers:
            timer.cancel()
        self._worker, self._closed = None, True
        self._count_abandoned()

    def _count_abandoned(self) -> None:
        """What ``close`` leaves undelivered (in flight, queued, repeats not yet due) is
        logged and, repeats apart, counted as dropped: a gateway that keeps those
        responses serves them until their ``s-maxage``, and an operator must be able to
        tell."""
        jobs = [] if self._current is None else [self._current]
        while not self._queue.empty():
            jobs.append(self._queue.get_nowait())
            self._queue.task_done()
        self._pending = 0
        waiting = sum(self._timers.values())  # repeats whose time had not come
        self._timers.clear()
        self._current = None
        for repeat in (False, True):
            left = [job for job in jobs if job[2] is repeat]
            keys = [key for job in left for key in job[0]]
            tags = [tag for job in left for tag in job[1]]
            size = len(keys) + len(tags) + (waiting if repeat else 0)
            if size:
                self._dropped(size, repeat, "closed", keys, tags)

    def _dropped(
        self, count: int, repeat: bool, reason: str, keys: list[str], tags: list[str]
    ) -> None:
        """``count`` keys and tags given up on unsent, logged; counted as dropped unless
        they are a repeat (see the module doc)."""
        if not repeat:
            self.stats.dropped += count
        event = "http_purge_repeat_dropped" if repeat else "http_purge_dropped"
        _log.warning(event, reason=reason, count=count, keys=keys[:5], tags=tags[:5])

    async def _run(self) -> None:
        while True:
            self._current = keys, tags, repeat = await self._queue.get()
            try:
                delivered = await self._deliver(keys, tags, repeat)
                self._current = None  # delivered or given up on: counted either way
            finally:
                self._pending -= len(keys) + len(tags)
                self._queue.task_done()
            if delivered and not repeat and self._repeat_after > 0:
                # Once more, later: another instance may still have served the old value
                # from its L1 (the backplane is a few ms behind) to a gateway that refetched
                # right after the first purge, and the gateway would keep it s-maxage long.
                self._later((keys, tags, True))

    def _later(self, job: tuple[list[str], list[str], bool]) -> None:
        size = len(job[0]) + len(job[1])

        def put() -> None:
            self._timers.pop(timer, None)
            self._put(job, size)

        timer = asyncio.get_running_loop().call_later(self._repeat_after, put)
        self._timers[timer] = size

    async def _deliver(self, keys: list[str], tags: list[str], repeat: bool) -> bool:
        size = len(keys) + len(tags)
        for attempt in range(self._retries + 1):
            try:
                await self._purge(keys, tags)
            except Exception as exc:  # any purger failure: retried, then counted
                if attempt == self._retries:
                    if not repeat:  # a repeat's keys were delivered: see the module doc
                        self.stats.failed += size
                    _log.warning(
                        "http_purge_repeat_failed" if repeat else "http_purge_failed",
                        keys=keys[:5],
                        tags=tags[:5],
                        error=_elided(repr(exc), keys[5:] + tags[5:]),
                    )
                    return False
                self.stats.retries += 1
                await asyncio.sleep(self._backoff[min(attempt, len(self._backoff) - 1)])
            else:
                if repeat:
                    self.stats.repeated += size
                else:
                    self.stats.delivered += size
                return True
        return False  # not reached: the last attempt returns or raises

    async def _purge(self, keys: list[str], tags: list[str]) -> None:
        """The purger's call. A ``CancelledError`` it raises that was not aimed at this
        worker (it awaited a task someone else cancelled) is its failure: raised on, it
        ended the only worker, and every later purge waited for ever, counted nowhere."""
        assert self.purger is not None  # no worker runs without one
        try:
            # A purger that never answered held its queue's only worker for good: every
            # later purge waited behind it until the queue was full, then was dropped.
            async with asyncio.timeout(self._timeout):
                await self.purger.purge(keys, tags)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise RuntimeError("the purger raised CancelledError") from exc
        except (Exception, KeyboardInterrupt, SystemExit):
            raise  # a failure (``_deliver``), or the process ending
        except BaseException as exc:
            # Any other non-Exception (gevent's GreenletExit, an app's own abort) ended
            # the worker as a stray CancelledError did: this purge's failure instead.
            raise RuntimeError(f"the purger raised {type(exc).__name__}") from exc


def _elided(text: str, unshown: list[str]) -> str:
    """``text`` without the keys and tags a log line doesn't show (it names five at
    most): with ``redact_keys`` the shown ones are hashed wherever quoted
    (``_logs``), and a purger's error naming the sixth key of a batch logged it raw."""
    return replace_quoted(text, unshown, lambda _: "...")
