"""This host's clock corrected to Redis' clock, so that every instance stamps envelopes
(``written_at``, ``soft_expiry``) and judges their freshness on one time scale.

Envelopes carry absolute times because a value's life must survive the round trip
through L2 to other hosts. Stamped and judged with each host's own wall clock, a writer
30 s ahead (or a reader 30 s behind) served values 30 s past their life. Here each
instance learns its offset to Redis' clock from ``TIME`` and adds it to its local clock:
the hit paths do the same arithmetic as before, with no extra round trip.

The offset is measured, not assumed. Redis read its clock somewhere between the local
send time ``t0`` and receive time ``t1``, so the true offset lies in
``[T - t1, T - t0]``, an interval as wide as the round trip. Sampled at ``start()`` and
every ``REFRESH`` seconds in the background (never on a read); of the last ``WINDOW``
samples, the one with the smallest round trip wins (the least queueing, the tightest
interval), and its midpoint is the estimate: the error is at most half its round trip
plus the drift since it was taken. Updates never step the clock backwards further than
the measurement requires (``_adopt``): a backward step makes stale values look fresh.

Redis unreachable: the offset stays 0 (this host's clock, as before), logged once, and
sampling retries every ``RETRY`` seconds. In a cluster, one fixed node is sampled (the
master of the backplane stream's slot), so every instance follows the same server clock:
the masters themselves must be NTP-synced (docs/operations.md, "Clocks").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import structlog
from redis.asyncio.cluster import RedisCluster

from layered_cache._clients import RedisClient, is_redis_failure, stop_if_cancelled
from layered_cache._config import Config
from layered_cache._keys import backplane_stream_name

__all__ = ["RedisClock", "redis_clock", "redis_time"]

_log = structlog.get_logger("layered_cache")

REFRESH = 30.0  # seconds between samples once synced: drift is ppm, so 30 s is plenty
RETRY = 2.0  # seconds between samples while Redis could not be sampled yet
WINDOW = 10  # samples the best one is chosen from (~5 min: recent enough to track drift)
START_SAMPLES = 3  # at start(): a few round trips, the smallest wins

TimeSource = Callable[[], Awaitable[float]]


class Sample(NamedTuple):
    low: float  # the true offset is within [low, high]
    high: float

    @property
    def rtt(self) -> float:
        return self.high - self.low

    @property
    def mid(self) -> float:
        return (self.low + self.high) / 2


def redis_time(client: RedisClient, anchor: str) -> TimeSource:
    """Redis' clock in seconds: ``TIME`` on the standalone server, or on the master that
    owns ``anchor``'s slot in a cluster (one fixed node for every instance)."""

    async def fetch() -> float:
        if isinstance(client, RedisCluster):
            node = client.get_node_from_key(anchor)
            reply = await client.execute_command("TIME", target_nodes=node)
        else:
            reply = await client.time()
        seconds, micros = reply
        return int(seconds) + int(micros) / 1e6

    return fetch


def redis_clock(local: Callable[[], float], client: RedisClient, config: Config) -> RedisClock:
    """The cache's clock: ``local`` corrected by ``TIME`` on ``client``; in a cluster, on
    the master of the backplane stream's slot (a name every instance shares)."""
    anchor = backplane_stream_name(config.redis.prefix, config.backplane.stream)
    timeout = config.redis.connect_timeout + config.redis.timeout
    return RedisClock(local, redis_time(client, anchor), timeout=timeout)


class RedisClock:
    """``now()``: the injected local clock plus the learnt offset to Redis' clock."""

    def __init__(
        self,
        local: Callable[[], float],
        source: TimeSource,
        *,
        timeout: float = 1.0,
        refresh: float = REFRESH,
        retry: float = RETRY,
    ) -> None:
        self._local = local
        self._source = source
        self._timeout = timeout  # per sample: a hung Redis must not hold the loop's task
        self._refresh = refresh
        self._retry = retry
        self._samples: deque[Sample] = deque(maxlen=WINDOW)
        self._task: asyncio.Task[None] | None = None
        self._warned = False
        self._logged_sync = False
        self.offset = 0.0  # seconds to add to the local clock to get Redis' clock
        self._best: Sample | None = None  # the sample in use; None: never synced

    def now(self) -> float:
        """Redis' time as this host estimates it (seconds since the epoch)."""
        return self._local() + self.offset

    @property
    def synced(self) -> bool:
        return self._best is not None

    @property
    def error_bound(self) -> float | None:
        """The most ``offset`` can be off by, drift since the sample aside: the distance
        to the far edge of the best sample's interval (half its round trip, usually)."""
        best = self._best
        return None if best is None else max(self.offset - best.low, best.high - self.offset)

    async def start(self, within: float | None = None) -> None:
        """Sample now (a few round trips, each bounded, all within ``within`` seconds: the
        start's one wait, ``_startup.first_steps``), then keep sampling in the background."""
        try:
            async with asyncio.timeout(within):
                for _ in range(START_SAMPLES):
                    if not await self.sample():
                        break
        except TimeoutError as exc:  # cut off: unsynced (or fewer samples) until the next
            if not self.synced and not self._warned:
                self._warned = True
                _log.warning("redis_clock_unsynced", error=type(exc).__name__, offset=self.offset)
        self._log_synced()
        task = self._task
        # A task of a loop that ended without stop() (``LayeredCache.start`` on a new
        # loop) never samples again: the clock would keep the old offset for good.
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            self._task = asyncio.ensure_future(self._run())

    def cancel(self) -> None:
        """Cancel the sampling without waiting (``LayeredCache.close`` cut short before or
        while ``stop`` ran: the clients are closed next, which it would reopen)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def sample(self) -> bool:
        """One ``TIME`` round trip; whether it succeeded (a failure is logged once)."""
        before = self._local()
        try:
            redis_now = await asyncio.wait_for(self._source(), self._timeout)
        except Exception as exc:
            if not (is_redis_failure(exc) or isinstance(exc, TimeoutError)):
                raise
            if not self._warned:
                self._warned = True
                _log.warning("redis_clock_unsynced", error=type(exc).__name__, offset=self.offset)
            return False
        after = self._local()
        new = Sample(redis_now - after, redis_now - before)
        best = self._best
        if best is not None and (new.low > best.high or new.high < best.low):
            # Disjoint from the best interval: a clock was stepped (NTP, an operator).
            # The older samples measure a clock that no longer exists: start over.
            self._samples.clear()
        self._samples.append(new)
        self._adopt(min(self._samples, key=lambda s: s.rtt))
        return True

    def _adopt(self, best: Sample) -> None:
        """Move to ``best``'s midpoint, except backwards while the current offset is still
        inside ``best``'s interval: a backward step makes values look younger (served
        longer), so it is taken only when the measurement rules the current offset out,
        and then only to the interval's edge."""
        if self._best is None or best.mid >= self.offset:
            self.offset = best.mid
        elif self.offset > best.high:
            self.offset = best.high
        self._best = best

    def _log_synced(self) -> None:
        bound = self.error_bound
        if bound is not None and not self._logged_sync:
            self._logged_sync = True
            _log.info(
                "redis_clock_synced",
                offset_ms=round(self.offset * 1000, 3),
                error_bound_ms=round(bound * 1000, 3),
            )

    async def _run(self) -> None:
        while True:
            stop_if_cancelled()
            await asyncio.sleep(self._refresh if self.synced else self._retry)
            await self.sample()
            self._log_synced()

