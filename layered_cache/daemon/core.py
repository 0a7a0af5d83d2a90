"""The invalidation daemon: consume events, delete their keys, then commit.

Per batch (one ``getmany``):

1. decode every message (``EventDecoder``, total: any failure makes the message poison
   with a reason naming it); tombstones (null value) are counted and skipped;
2. invalidate all keys of the batch: base key, every replica and the lease, in pipelined
   round trips, then the backplane entry (``Invalidator``) - retried with capped,
   jittered backoff while Redis fails;
3. write poison messages to the dead-letter topic (retried the same way, but only for
   failures that can pass: a record the producer or broker refuses for good is set
   aside with a log line and a counter);
4. only then commit the batch's offsets (and, between batches, positions past the
   markers that end transactions: ``commits``).

Committing last is the whole delivery guarantee: if the process dies anywhere before
step 4, the batch is read again and re-deleted (deleting is idempotent), so an event is
never lost, at worst applied twice (at-least-once). A batch that can't be finished is
never committed, and since commits are per partition and cumulative, no later commit
can skip over it either: the partition is not read past it until it succeeds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import (
    IllegalStateError,
    KafkaError,
    NoOffsetForPartitionError,
    OffsetOutOfRangeError,
)
from aiokafka.structs import TopicPartition

from layered_cache._config import Config
from layered_cache._config.validate import daemon_start_problem
from layered_cache._events import EventDecoder
from layered_cache._purges import purges_for
from layered_cache.daemon.batch import account, decode_batch
from layered_cache.daemon.closing import Step, close_in_order
from layered_cache.daemon.commits import Commits
from layered_cache.daemon.deletes import DELETE_FAILURES, Deleter
from layered_cache.daemon.dlq import DeadLetters, Poison, dead_letter
from layered_cache.daemon.health import HealthServer
from layered_cache.daemon.kafka import KafkaClients, KafkaSetupError, poll
from layered_cache.daemon.metrics import DaemonMetrics
from layered_cache.daemon.retry import Retrier
from layered_cache.daemon.stats import DaemonStats
from layered_cache.daemon.stopping import STOP_GRACE, unless_stopped
from layered_cache.daemon.unreadable import UNREADABLE, read_carefully, rewind
from layered_cache.daemon.watch import Watch, broker_lag

__all__ = ["Daemon", "DaemonStartError", "DaemonStats"]

_log = structlog.get_logger("layered_cache.daemon")
# Failures of a broker connect at start: retried until stop().
_CONNECT_FAILURES = (TimeoutError, KafkaError, OSError)


class DaemonStartError(Exception):
    """The daemon cannot start for a reason no retry fixes (e.g. its health port is taken)."""


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Before partitions move, let the batch in flight finish and commit (its keys are
    being deleted anyway), so the next owner starts after it instead of redoing it."""

    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._daemon._drain(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._daemon._assigned(assigned)


class Daemon:
    """Run with ``await daemon.run()``; ``daemon.stop()`` ends it gracefully.

    ``health_port`` overrides ``kafka.health_port`` (0 = ephemeral, negative = off);
    ``consumer_options`` / ``producer_options`` are extra aiokafka settings (tests, tuning).
    ``stats`` is the one set of counters; ``metrics`` renders it for ``/metrics``.
    """

    def __init__(
        self,
        config: Config,
        *,
        health_port: int | None = None,
        consumer_options: Mapping[str, Any] | None = None,
        producer_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.decoder = EventDecoder(config)
        self.stats = DaemonStats()
        self.lag: dict[tuple[str, int], int] = {}  # per owned partition: last batch, or watch
        self._stopping = asyncio.Event()
        # Commits, and what was committed (the watch's lag).
        self._commits = Commits(self.stats, self._stopping, lambda: self.assignment)
        # Replaced, never changed in place, at every rebalance: the watch's ``broker_lag``
        # tells by the set's identity that a rebalance happened during its round trips.
        self.assignment: set[TopicPartition] = set()
        self._health_port = config.kafka.health_port if health_port is None else health_port
        self._kafka = KafkaClients(config.kafka, consumer_options, producer_options)
        self._retrier = Retrier(
            self._stopping, self.stats, config.kafka.retry_max_backoff,
            redact_keys=config.logging.redact_keys,
        )
        self.started = asyncio.Event()
        self.health: HealthServer | None = None
        self._deleter: Deleter | None = None
        # HTTP caches ([purge] urls): told in the background, never before the commit.
        self.purges = purges_for(config)
        # Broker and Redis reachability for /readyz, and the lag gauge between batches.
        self.watch = Watch({"kafka": self._probe_kafka, "redis": self._probe_redis})
        self.metrics = DaemonMetrics(
            self.stats, lambda: (self.lag, len(self.assignment)), self.purges.stats
        )

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        """Finish the current batch, commit it, leave the group (safe from a signal handler)."""
        self._stopping.set()

    async def run(self) -> None:
        """Raises ``DaemonStartError`` for a start-up problem no retry fixes; a broker
        that can't be reached is retried (``/readyz`` stays 503 meanwhile)."""
        try:
            if not await self._start():
                return  # stopped before the broker could be reached
            self.started.set()
            self.watch.start()
            consumer = self._kafka.consumer
            assert consumer is not None
            kafka = self.config.kafka
            _log.info(
                "daemon_started",
                topics=kafka.topics,
                group=kafka.group_id,
                health_port=self.health.bound_port if self.health else None,
            )
            while not self._stopping.is_set():
                try:
                    records = await poll(consumer, self._stopping, max_records=kafka.max_batch)
                except UNREADABLE as exc:
                    # A record aiokafka can't unpack (``unreadable``): record by record
                    # until it is found and set aside, the records around it handled.
                    _log.warning("unreadable_fetch", error=f"{type(exc).__name__}: {exc}")
                    unstarted = self._commits.unstarted  # "latest" starts not committed yet
                    await rewind(consumer, kafka.auto_offset_reset, self._stopping, unstarted)
                    await read_carefully(
                        consumer,
                        self._handle,
                        self._set_aside,
                        kafka.max_batch,
                        self._stopping,
                    )
                    continue
                except (NoOffsetForPartitionError, OffsetOutOfRangeError) as exc:
                    raise DaemonStartError(_no_position(exc)) from None
                if records is None:
                    break  # stop() during the poll (a rebalance may hold it: ``poll``)
                if records and not await self._handle(records):
                    continue  # abandoned: its partitions' positions are past it, see Commits
                await self._catch_up(consumer)
        finally:
            await self._shutdown()

    async def _start(self) -> bool:
        if problem := daemon_start_problem(self.config.kafka):
            # Not a failure a retry fixes: say which setting, exit 2 (``config check``
            # refuses the same).
            raise DaemonStartError(f"config error: {problem}")
        self._deleter = Deleter(self.config)
        await self._deleter.check_replicas()  # refuses a fleet-inconsistent config
        await self._deleter.check_memory_policy()  # logs what a full Redis will do
        if self._health_port >= 0:
            await self._start_health()
        self.purges.start()
        try:
            return await self._retrier.connect(
                lambda: self._kafka.connect(_Rebalance(self)),
                self._kafka.disconnect,
                _CONNECT_FAILURES,
            )
        except KafkaSetupError as exc:
            raise DaemonStartError(str(exc)) from None

    async def _start_health(self) -> None:
        host = self.config.kafka.health_host
        self.health = HealthServer(self._health_port, self._status, self.metrics.render, host=host)
        try:
            await self.health.start()
        except OSError as exc:
            self.health = None
            raise DaemonStartError(
                f"health server can't listen on {host}:{self._health_port} "
                f"(kafka.health_host/health_port): {exc.strerror or exc}"
            ) from None

    async def _shutdown(self) -> None:
        """Close every part even if one fails or the task is cancelled (``closing``),
        and log ``daemon_stopped`` (the line operators look for after a SIGTERM)."""
        steps: list[Step] = [
            ("watch", self.watch.close),
            ("kafka", self._kafka.disconnect),
            ("purges", self.purges.close),
            ("health", self.health.close if self.health is not None else None),
            ("redis", self._deleter.close if self._deleter is not None else None),
        ]
        try:
            await close_in_order(steps)
        finally:
            _log.info("daemon_stopped", **self.stats.totals())

    # -- one batch -------------------------------------------------------------------------

    async def _handle(self, records: Mapping[TopicPartition, Sequence[Any]]) -> bool:
        """Delete, dead-letter, commit; False if the batch was abandoned uncommitted."""
        consumer, deleter = self._kafka.consumer, self._deleter
        assert consumer is not None and deleter is not None
        started = time.perf_counter()
        with self._retrier.in_flight():
            batch = decode_batch(self.decoder, records, consumer.highwater)
            keys = list(batch.keys.items())
            if not await self._commits.owe_starts(consumer, records, self._retrier):
                return False  # stopping or revoked before its start was committed
            # Invalidate before the DLQ: valid events' latency does not wait on Kafka.
            if not await self._retrier.until_done(
                "invalidate", lambda: deleter.delete(keys, self.stats, batch.tags), DELETE_FAILURES
            ):
                return False  # stopping or partitions revoked: not committed, read again later
            self.purges.submit((key for key, _ in keys), batch.tags)  # queued, never awaited
            letters = DeadLetters(batch.poison)
            if letters.pending and not await self._dead_letter(letters):
                return False
            await self._commit(batch.offsets)
        self.lag.update(_owned_lag(batch.lag, self.assignment))
        account(self.stats, batch, len(keys), time.perf_counter() - started)
        return True

    async def _set_aside(self, poison: Poison, tp: TopicPartition) -> bool:
        """An unreadable record (``unreadable``): dead-lettered, then skipped and
        committed, as a poison event is. Everything before it was handled and committed
        already (``read_carefully`` reads one record at a time). In flight like a batch:
        outside, a revocation never stopped its dead-letter retries (they went on for a
        partition another daemon owned, ours starving) and its seek then crashed us."""
        consumer = self._kafka.consumer
        assert consumer is not None
        with self._retrier.in_flight():
            if not await self._commits.owe_starts(consumer, [tp], self._retrier):
                return False  # stopping or revoked before its start was committed
            if not await self._dead_letter(DeadLetters([poison])):
                return False  # stopping or partitions revoked: read again later
            try:
                consumer.seek(tp, poison.offset + 1)
            except IllegalStateError:
                return False  # written as it moved: its owner reads it again (a duplicate)
            await self._commit({tp: poison.offset + 1})
        return True

    async def _dead_letter(self, letters: DeadLetters) -> bool:
        """Retried while it may pass; False if given up (stopping, revoked). An attempt
        gives way to ``stop()`` after STOP_GRACE (``stopping``): with the broker gone it
        waits for the topic's metadata and the acks, a SIGTERM unseen until the SIGKILL."""
        write = partial(dead_letter, self._kafka.producer, self.config.kafka, letters, self.stats)
        attempt = partial(unless_stopped, write, self._stopping, STOP_GRACE)
        return await self._retrier.until_done("dead_letter", attempt, (Exception,))

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        assert self._kafka.consumer is not None
        await self._commits.commit(self._kafka.consumer, offsets)

    async def _catch_up(self, consumer: AIOKafkaConsumer) -> None:
        """Between batches: positions past our commits (transaction markers) committed,
        and their lag. Not once stopping: the batch's commit had its grace already."""
        if not self._stopping.is_set():
            self.lag.update(await self._commits.catch_up(consumer))  # partitions still ours

    # -- rebalance and health --------------------------------------------------------------

    async def _drain(self, revoked: set[TopicPartition]) -> None:
        """Called by aiokafka before giving partitions away. The batch in flight commits
        itself when done; wait for that, bounded so a Redis outage can't stall the whole
        group's rebalance (then the batch is abandoned uncommitted: the new owner redoes it)."""
        _log.info("partitions_revoked", partitions=_names(revoked))
        self._commits.drop_starts(revoked)  # first: see ``Commits.drop_starts``
        limit = max(0.1, self.config.kafka.rebalance_timeout / 2)
        if not await self._retrier.settle(limit):
            _log.warning("rebalance_abandoned_batch_in_flight", waited_s=limit)
        for tp in revoked:
            self.lag.pop((tp.topic, tp.partition), None)
            self._commits.committed.pop(tp, None)  # the next owner commits it now
        self.assignment = set()

    async def _assigned(self, assigned: set[TopicPartition]) -> None:
        self.assignment = set(assigned)
        _log.info("partitions_assigned", partitions=_names(assigned))
        if self._kafka.consumer is not None and self.config.kafka.auto_offset_reset == "latest":
            await self._commits.start(self._kafka.consumer, assigned)  # owed until committed

    async def _probe_kafka(self) -> None:
        if (consumer := self._kafka.consumer) is not None:
            owned, committed = (lambda: self.assignment), self._commits.committed
            self.lag.update(await broker_lag(consumer, owned, committed))

    async def _probe_redis(self) -> None:
        if self._deleter is not None:
            await self._deleter.ping()  # every master of a cluster, not only one

    def _status(self) -> tuple[bool, dict[str, object]]:
        retrying = self._retrier.retrying or self.watch.failing()
        ready = self.started.is_set() and retrying is None and not self._stopping.is_set()
        return ready, {
            "status": "ok" if ready else "degraded",
            "retrying": retrying,
            "partitions": _names(self.assignment),
            **self.stats.totals(),
        }


def _names(partitions: set[TopicPartition]) -> list[str]:
    return sorted(f"{tp.topic}:{tp.partition}" for tp in partitions)


def _owned_lag(
    lag: Mapping[TopicPartition, int], owned: set[TopicPartition]
) -> dict[tuple[str, int], int]:
    """Only partitions still ours: a batch abandoned in a rebalance may end after it, and
    its lag series stayed for good (the watch updates owned partitions only)."""
    return {(tp.topic, tp.partition): behind for tp, behind in lag.items() if tp in owned}


def _no_position(exc: KafkaError) -> str:
    """Under ``auto_offset_reset = "none"`` aiokafka raises where a partition has no
    position to read from; said as the setting it is, with the ways out, not as a crash
    (a restart loop can't fix it)."""
    return (
        f'kafka.auto_offset_reset = "none": no position to read from ({exc!r}): the group '
        "never committed this partition, or its committed offset is no longer retained. "
        'Set kafka.auto_offset_reset = "earliest" (re-deletes what is retained: always '
        "safe) or commit a start for the group (kafka-consumer-groups --reset-offsets)"
    )
