"""The daemon's two retry loops: reaching the broker at start, and finishing a batch
(with what is in flight, for the rebalance listener to wait on or abandon).

Both draw their delays from ``layered_cache._backoff.Backoff`` (the one backoff of the
library and the daemon) and wait with ``asyncio.wait_for(stopping.wait(), delay)``, so
``stop()`` ends a wait at once instead of after the delay. Everything here runs on the
daemon's event loop; ``retrying`` and ``abandon`` are plain attributes read and written
between awaits, never from another thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator

import structlog

from layered_cache._backoff import Backoff
from layered_cache._logs import exception_types
from layered_cache.daemon.deletes import DELETE_FAILURES
from layered_cache.daemon.dlq import cap_text
from layered_cache.daemon.stats import DaemonStats
from layered_cache.daemon.stopping import Stopped, unless_stopped

__all__ = ["Retrier"]

_log = structlog.get_logger("layered_cache.daemon")
# The first broker connect retry waits 200 ms: a broker coming up takes seconds anyway.
_CONNECT_BASE = 0.2


class Retrier:
    """Retries until success, ``stop`` or a revocation; tells ``/readyz`` what it retries.

    ``retrying`` names the step being retried (None when all is well). ``abandon`` is
    set by the rebalance listener (``settle``) when the batch in flight lost its
    partitions: the batch loop then gives up (uncommitted) at its next wake-up instead
    of retrying for a partition another daemon now owns.
    """

    def __init__(
        self,
        stopping: asyncio.Event,
        stats: DaemonStats,
        max_backoff: float,
        *,
        redact_keys: bool = False,
    ) -> None:
        self._stopping = stopping
        self._stats = stats
        self._max_backoff = max_backoff
        self._redact_keys = redact_keys  # ``logging.redact_keys``: see ``_error``
        self.retrying: str | None = None
        self.abandon = False
        self._idle = asyncio.Event()  # clear while a batch (or a set-aside) is in flight
        self._idle.set()

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Around everything that ends in a commit: a batch, an unreadable record's
        set-aside. ``settle`` waits for it and may abandon it; anything outside (the
        set-aside was) goes on retrying for partitions another daemon owns."""
        self._idle.clear()
        self.abandon = False
        try:
            yield
        finally:
            self._idle.set()

    async def settle(self, limit: float) -> bool:
        """Wait up to ``limit`` s for the work in flight to end (True); then abandon it
        (False): its retries give up at their next wake-up, uncommitted."""
        try:
            await asyncio.wait_for(self._idle.wait(), limit)
        except TimeoutError:
            self.abandon = True
            return False
        return True

    async def connect(
        self,
        connect: Callable[[], Awaitable[None]],
        disconnect: Callable[[], Awaitable[None]],
        failures: tuple[type[BaseException], ...],
    ) -> bool:
        """``connect`` until it works (True) or ``stop()`` is called (False).

        An unreachable broker at start is the normal case in a fleet coming up (the
        broker, DNS or the network may follow the daemon): retry, /readyz says 503. An
        attempt gives way to ``stop()`` at once: aiokafka's bootstrap waits 40 s for a
        broker that accepts connections and never answers, and a SIGTERM went unseen
        past the SIGKILL. What it started is closed by the caller's shutdown."""
        backoff = Backoff(base=_CONNECT_BASE, cap=max(_CONNECT_BASE, self._max_backoff))
        while not self._stopping.is_set():
            try:
                await unless_stopped(connect, self._stopping)
            except Stopped:
                return False
            except failures as exc:
                await disconnect()
                self.retrying = "connect"
                self._stats.connect_retries += 1
                delay = backoff.next_delay()
                _log.warning(
                    "kafka_connect_failed_retrying",
                    error=f"{type(exc).__name__}: {exc}",
                    attempt=backoff.attempt,
                    retry_in=round(delay, 3),
                )
                await self._pause(delay)
                continue
            self.retrying = None
            return True
        return False

    async def until_done(
        self,
        what: str,
        attempt: Callable[[], Awaitable[None]],
        failures: tuple[type[BaseException], ...],
    ) -> bool:
        """Run ``attempt`` until it succeeds (True) or we must give up (False): on stop,
        or when the rebalance listener abandoned this batch (its partitions moved)."""
        backoff = Backoff(cap=self._max_backoff)
        try:
            while True:
                try:
                    await attempt()
                except Stopped:  # the attempt gave way to stop() (``unless_stopped``)
                    _log.warning(f"{what}_abandoned_uncommitted", reason="stopping")
                    return False
                except failures as exc:
                    self.retrying = what
                    self._stats.redis_retries += what == "invalidate"
                    delay = backoff.next_delay()
                    _log.warning(
                        f"{what}_failed_retrying",
                        error=self._error(exc),
                        attempt=backoff.attempt,
                        retry_in=round(delay, 3),
                    )
                    await self._pause(delay)
                    if self._stopping.is_set() or self.abandon:
                        _log.warning(
                            f"{what}_abandoned_uncommitted",
                            reason="stopping" if self._stopping.is_set() else "revoked",
                        )
                        return False
                    continue
                return True
        finally:
            # On every way out (done, abandoned, stopped, cancelled): nothing is retried
            # any more. Left set after an abandoned batch, it kept a standby that lost
            # its partitions mid-retry at /readyz 503 forever - no later batch ran on it
            # to clear the flag.
            self.retrying = None

    def _error(self, exc: BaseException) -> str:
        """``Type: message``; a Redis failure's with ``logging.redact_keys``, its types
        only (``L2Unavailable: ConnectionError``): redis-py's messages quote the commands
        that failed with their arguments (``Command # 2 (DEL {p:book:52}:lease) of
        pipeline caused error: ...``), and the log hashes keys in its ``key``/``keys``
        fields only. A cluster master dying put raw keys in every retry's log line."""
        if not (self._redact_keys and isinstance(exc, DELETE_FAILURES)):
            return cap_text(f"{type(exc).__name__}: {exc}")
        return exception_types(exc)

    async def _pause(self, delay: float) -> None:
        """Sleep ``delay`` seconds, or less if ``stop()`` is called meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)
