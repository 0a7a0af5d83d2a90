"""What the daemon checks between batches: can it reach its broker and its Redis, and
how far behind the high watermark is each owned partition.

Why a watch of its own: the batch loop alone can't tell. With the broker gone aiokafka's
``getmany`` just returns nothing, so an idle daemon looked ready forever; with Redis gone
an idle daemon has no delete to fail; and the lag gauge was only written after a batch
committed, so during a Redis outage (the batch retried, never finishing) it froze at its
pre-outage value while events piled up. Every ``interval`` seconds the watch asks the
broker for the owned partitions' end offsets (a metadata request when it owns none) and
PINGs Redis (asks every master of a cluster: ``Deleter.ping``), each under ``timeout``;
``/readyz`` reports ``"retrying": "kafka"`` / ``"redis"`` after ``FAILURES_TO_REPORT``
failures in a row (one slow answer is no outage).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from layered_cache._redact import redact

__all__ = ["FAILURES_TO_REPORT", "Watch", "broker_lag"]

_log = structlog.get_logger("layered_cache.daemon")

INTERVAL = 2.0
TIMEOUT = 3.0
FAILURES_TO_REPORT = 2

Probe = Callable[[], Awaitable[object]]


class Watch:
    """Runs ``probes`` (name -> probe) every ``interval`` s in a task of its own."""

    def __init__(
        self, probes: dict[str, Probe], interval: float = INTERVAL, timeout: float = TIMEOUT
    ) -> None:
        self._probes = probes
        self._interval = interval
        self._timeout = timeout
        self._failures = dict.fromkeys(probes, 0)
        self._task: asyncio.Task[None] | None = None

    def failing(self) -> str | None:
        """The first dependency that failed ``FAILURES_TO_REPORT`` probes in a row."""
        return next((n for n, count in self._failures.items() if count >= FAILURES_TO_REPORT), None)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="layered_cache.daemon.watch")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        current = asyncio.current_task()
        while True:
            for name, probe in self._probes.items():
                await self._probe(name, probe)
                # close()'s cancel may never reach us as an error: a probe's wait_for
                # (aiokafka's, Python 3.11's) returns a result that came with the cancel and
                # drops it, or a client turns it into its own error. Unseen, the watch ran
                # on and close() waited for good (a daemon stopped as it started hung).
                if current is not None and current.cancelling():
                    raise asyncio.CancelledError
            await asyncio.sleep(self._interval)

    async def _probe(self, name: str, probe: Probe) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                await probe()
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # close(): the watch ends
            self._failed(name, "CancelledError")  # aiokafka's own, not ours
        except Exception as exc:  # whatever it is, the dependency did not answer
            self._failed(name, redact(f"{type(exc).__name__}: {exc}"))
        else:
            if self._failures[name] >= FAILURES_TO_REPORT:
                _log.info(f"{name}_reachable_again")
            self._failures[name] = 0

    def _failed(self, name: str, error: str) -> None:
        self._failures[name] += 1
        if self._failures[name] == FAILURES_TO_REPORT:
            _log.warning(f"{name}_unreachable", error=error[:300])


async def broker_lag(
    consumer: AIOKafkaConsumer,
    owned: Callable[[], set[TopicPartition]],
    committed: dict[TopicPartition, int],
) -> dict[tuple[str, int], int]:
    """Records between each owned partition's committed offset and its end, asked of the
    broker now (so it grows while a batch is being retried). ``committed`` caches the
    group's offsets: the daemon records its own commits there, the broker is asked once
    for a partition it has not committed since it got it. A partition never committed
    is left out (the last batch's figure stands).

    A rebalance can happen during any of the round trips here. ``owned()`` is the
    daemon's assignment, a new set at every revocation and assignment, so the same set
    after the last await means none happened; otherwise nothing is reported or cached
    this round. Checking each partition as it came, the lag of one worked out before a
    later round trip came back after its revocation (which alone clears the gauge): the
    gauge showed a partition another daemon owned, for good, and a cached offset went
    stale for when it came back."""
    mine = owned()
    if not mine:
        await consumer.topics()  # a standby: one metadata round trip says the broker answers
        return {}
    ends = await consumer.end_offsets(sorted(mine))
    for tp in ends:
        if tp not in committed and (offset := await consumer.committed(tp)) is not None:
            if owned() is not mine:
                return {}  # moved meanwhile: this answer may be older than its new owner's
            committed[tp] = offset
    if owned() is not mine:
        return {}
    lag = {tp: max(0, end - committed[tp]) for tp, end in ends.items() if tp in committed}
    return {(tp.topic, tp.partition): behind for tp, behind in lag.items()}
