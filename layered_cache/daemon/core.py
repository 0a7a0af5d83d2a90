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
4. only then commit the batch's offsets.

Committing last is the whole delivery guarantee: if the process dies anywhere before
step 4, the batch is read again and re-deleted (deleting is idempotent), so an event is
never lost, at worst applied twice (at-least-once). A batch that can't be finished is
never committed, and since commits are per partition and cumulative, no later commit
can skip over it either: the partition is not read past it until it succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.structs import TopicPartition

from layered_cache.backoff import Backoff
from layered_cache.backplane import BackplanePublisher
from layered_cache.breaker import CircuitBreaker
from layered_cache.clients import REDIS_FAILURES, RedisClient, make_client, with_timeout
from layered_cache.config import Config
from layered_cache.daemon.dlq import Poison, cap_text, send_dead_letters
from layered_cache.daemon.health import HealthServer
from layered_cache.daemon.kafka import consumer_kwargs, producer_kwargs
from layered_cache.daemon.metrics import DaemonMetrics
from layered_cache.daemon.stats import DaemonStats
from layered_cache.events import EventDecoder, PoisonEvent, Target, unique_targets
from layered_cache.invalidation import Invalidator, check_replica_counts, replica_counts
from layered_cache.l2 import L2Store, L2Unavailable

__all__ = ["Daemon", "DaemonStartError", "DaemonStats"]

_log = structlog.get_logger("layered_cache.daemon")
_REDIS_FAILURES = (L2Unavailable, *REDIS_FAILURES)
# Keys per Invalidator call: bounds one DEL/pipeline (x replicas + lease) and one XADD.
_CHUNK = 1000
# The daemon is not on a request path: give Redis time rather than retrying a big batch.
_MIN_REDIS_TIMEOUT = 2.0


class DaemonStartError(Exception):
    """The daemon cannot start for a reason no retry fixes (e.g. its health port is taken)."""


class _Batch(msgspec.Struct):
    targets: list[Target]
    poison: list[Poison]
    tombstones: int
    types: dict[str, int]
    offsets: dict[TopicPartition, int]  # next offset to read = last + 1
    lag: dict[TopicPartition, int]


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Before partitions move, let the batch in flight finish and commit (its keys are
    being deleted anyway), so the next owner starts after it instead of redoing it."""

    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._daemon._drain(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._daemon._assigned(assigned)


class Daemon:
    """Run with ``await daemon.run()``; ``daemon.stop()`` ends it gracefully.

    ``health_port`` overrides ``kafka.health_port`` (0 = ephemeral, negative = off);
    ``consumer_options`` / ``producer_options`` are extra aiokafka settings (tests, tuning).
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
        self.lag: dict[tuple[str, int], int] = {}  # per owned partition, from the last batch
        self.assignment: set[TopicPartition] = set()
        self.metrics = DaemonMetrics(self.stats, lambda: (self.lag, len(self.assignment)))
        self._health_port = config.kafka.health_port if health_port is None else health_port
        self._consumer_options = dict(consumer_options or {})
        self._producer_options = dict(producer_options or {})
        self._stopping = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._abandon = False
        self._retrying: str | None = None  # what is being retried, for /readyz
        self.started = asyncio.Event()
        self.health: HealthServer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._redis: RedisClient | None = None
        self._invalidator: Invalidator | None = None

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
            assert self._consumer is not None
            kafka = self.config.kafka
            _log.info(
                "daemon_started",
                topics=kafka.topics,
                group=kafka.group_id,
                health_port=self.health.bound_port if self.health else None,
            )
            while not self._stopping.is_set():
                # A short poll timeout keeps stop() responsive without a second task.
                records = await self._consumer.getmany(timeout_ms=200, max_records=kafka.max_batch)
                if records:
                    await self._handle(records)
        finally:
            await self._shutdown()

    async def _start(self) -> bool:
        config = self.config
        redis_config = with_timeout(config.redis, max(config.redis.timeout, _MIN_REDIS_TIMEOUT))
        self._redis = make_client(redis_config)
        await _check_replicas(self._redis, config)  # refuses a fleet-inconsistent config
        breaker = CircuitBreaker(config.redis.breaker.failures, config.redis.breaker.reset)
        publisher = None
        if config.backplane.enabled:
            stream = config.redis.prefix + config.backplane.stream
            publisher = BackplanePublisher(self._redis, stream, config.backplane.maxlen)
        self._invalidator = Invalidator(L2Store(self._redis, breaker), publisher)
        if self._health_port >= 0:
            host = config.kafka.health_host
            self.health = HealthServer(
                self._health_port, self._status, self.metrics.render, host=host
            )
            try:
                await self.health.start()
            except OSError as exc:
                self.health = None
                raise DaemonStartError(
                    f"health server can't listen on {host}:{self._health_port} "
                    f"(kafka.health_host/health_port): {exc.strerror or exc}"
                ) from None
        # An unreachable broker at start is the normal case in a fleet coming up (the
        # broker, DNS or the network may follow the daemon): retry, /readyz says 503.
        backoff = Backoff(base=0.2, cap=max(0.2, config.kafka.retry_max_backoff))
        while not self._stopping.is_set():
            try:
                await self._connect()
            except (TimeoutError, KafkaError, OSError) as exc:
                await self._disconnect()
                self._retrying = "connect"
                self.stats.connect_retries += 1
                delay = backoff.next_delay()
                _log.warning(
                    "kafka_connect_failed_retrying",
                    error=f"{type(exc).__name__}: {exc}",
                    attempt=backoff.attempt,
                    retry_in=round(delay, 3),
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
                continue
            self._retrying = None
            return True
        return False

    async def _connect(self) -> None:
        kafka = self.config.kafka
        self._producer = AIOKafkaProducer(**{**producer_kwargs(kafka), **self._producer_options})
        await self._producer.start()
        options = {**consumer_kwargs(kafka), **self._consumer_options}
        self._consumer = AIOKafkaConsumer(**options)
        self._consumer.subscribe(kafka.topics, listener=_Rebalance(self))
        await self._consumer.start()

    async def _disconnect(self) -> None:
        # Consumer first: its stop() sends LeaveGroup, so partitions move to the other
        # daemons now instead of after the session timeout.
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.stop()
            self._consumer = None
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self._producer.stop()
            self._producer = None

    async def _shutdown(self) -> None:
        await self._disconnect()
        if self.health is not None:
            await self.health.close()
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()
        _log.info("daemon_stopped", **self.stats.totals())

    # -- one batch -------------------------------------------------------------------------

    async def _handle(self, records: Mapping[TopicPartition, Sequence[Any]]) -> None:
        started = time.perf_counter()
        self._idle.clear()
        self._abandon = False
        try:
            batch = self._decode(records)
            keys = unique_targets(batch.targets)
            # Invalidate before the DLQ: valid events' latency does not wait on Kafka.
            if not await self._retry("invalidate", lambda: self._invalidate(keys)):
                return  # stopping or partitions revoked: not committed, read again later
            pending = list(batch.poison)
            if pending and not await self._retry(
                "dead_letter", lambda: self._dead_letter(pending), (Exception,)
            ):
                return
            await self._commit(batch.offsets)
        finally:
            self._idle.set()
        elapsed = time.perf_counter() - started
        self._account(batch, len(keys), elapsed)

    def _decode(self, records: Mapping[TopicPartition, Sequence[Any]]) -> _Batch:
        targets: list[Target] = []
        poison: list[Poison] = []
        tombstones = 0
        types: Tally[str] = Tally()
        offsets: dict[TopicPartition, int] = {}
        lag: dict[TopicPartition, int] = {}
        assert self._consumer is not None
        for tp, messages in records.items():
            for message in messages:
                if message.value is None:
                    # A tombstone (compacted topics write them to delete a key): it
                    # carries no event, so there is nothing to invalidate or to set aside.
                    tombstones += 1
                    continue
                reason: str
                event_type: str | None = None
                try:
                    event = self.decoder.decode(message.value)
                except PoisonEvent as exc:
                    reason, event_type = exc.reason, exc.event_type
                except Exception as exc:  # the decoder is total; this is the last net
                    reason = f"{type(exc).__name__} while decoding"
                else:
                    types[event.event_type] += 1
                    targets.extend(event.targets)
                    continue
                poison.append(
                    Poison(
                        topic=tp.topic,
                        partition=tp.partition,
                        offset=message.offset,
                        timestamp=message.timestamp,
                        key=message.key,
                        value=message.value,
                        headers=tuple(message.headers or ()),
                        reason=cap_text(reason),
                        event_type=None if event_type is None else cap_text(event_type),
                    )
                )
            if messages:
                offsets[tp] = messages[-1].offset + 1
                highwater = self._consumer.highwater(tp)
                if highwater is not None:
                    lag[tp] = max(0, highwater - offsets[tp])
        return _Batch(targets, poison, tombstones, dict(types), offsets, lag)

    async def _invalidate(self, keys: list[tuple[str, int]]) -> None:
        assert self._invalidator is not None
        for start in range(0, len(keys), _CHUNK):
            deleted = await self._invalidator.invalidate(keys[start : start + _CHUNK])
            self.stats.names_deleted += deleted

    async def _dead_letter(self, pending: list[Poison]) -> None:
        """Write ``pending`` to the DLQ; it is emptied as records are settled (see
        ``send_dead_letters``), so a retry resends only what failed transiently."""
        kafka = self.config.kafka
        sent = list(pending)
        rejected: set[int] = set()

        def set_aside(item: Poison, error: BaseException) -> None:
            rejected.add(id(item))
            self.stats.dead_letters_rejected += 1
            _log.error(
                "dead_letter_rejected_skipped",
                error=cap_text(f"{type(error).__name__}: {error}"),
                reason=item.reason,
                topic=item.topic,
                partition=item.partition,
                offset=item.offset,
                size=len(item.value or b""),
            )

        try:
            await send_dead_letters(
                self._producer, kafka.dead_letter_topic, pending, kafka.max_event_bytes, set_aside
            )
        finally:
            still = {id(item) for item in pending}
            for item in sent:
                if id(item) in still or id(item) in rejected:
                    continue
                self.stats.dead_letters += 1
                _log.warning(
                    "event_dead_lettered",
                    reason=item.reason,
                    event_type=item.event_type,
                    topic=item.topic,
                    partition=item.partition,
                    offset=item.offset,
                )

    async def _retry(
        self,
        what: str,
        attempt: Callable[[], Awaitable[None]],
        failures: tuple[type[BaseException], ...] | None = None,
    ) -> bool:
        """Run ``attempt`` until it succeeds (True) or we must give up (False): on stop,
        or when the rebalance listener abandoned this batch (its partitions moved)."""
        caught = failures or _REDIS_FAILURES
        backoff = Backoff(cap=self.config.kafka.retry_max_backoff)
        while True:
            try:
                await attempt()
            except caught as exc:
                self._retrying = what
                self.stats.redis_retries += what == "invalidate"
                delay = backoff.next_delay()
                _log.warning(
                    f"{what}_failed_retrying",
                    error=cap_text(f"{type(exc).__name__}: {exc}"),
                    attempt=backoff.attempt,
                    retry_in=round(delay, 3),
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
                if self._stopping.is_set() or self._abandon:
                    _log.warning(
                        f"{what}_abandoned_uncommitted",
                        reason="stopping" if self._stopping.is_set() else "revoked",
                    )
                    return False
                continue
            self._retrying = None
            return True

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        assert self._consumer is not None
        try:
            await self._consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # The partitions moved in a rebalance: their next owner reads this batch again
            # from the last commit and re-deletes (idempotent). Nothing is lost.
            self.stats.commit_failures += 1
            _log.warning("commit_refused_partitions_moved", error=str(exc))
            return
        except KafkaError as exc:
            # Broker trouble: a later batch's commit of the same partition covers this one
            # (commits are cumulative); until then a restart would redeliver - harmless.
            self.stats.commit_failures += 1
            _log.warning("commit_failed", error=f"{type(exc).__name__}: {exc}")
            return
        self.stats.commits += 1

    def _account(self, batch: _Batch, keys: int, elapsed: float) -> None:
        events = sum(batch.types.values())
        self.stats.count_events(batch.types)
        self.stats.keys += keys
        self.stats.tombstones += batch.tombstones
        self.stats.batch_done(elapsed)
        self.lag.update({(tp.topic, tp.partition): behind for tp, behind in batch.lag.items()})
        _log.info(
            "batch_done",
            events=events,
            event_types=batch.types,
            keys=keys,
            dead_letters=len(batch.poison),
            tombstones=batch.tombstones,
            lag=sum(batch.lag.values()),
            latency_ms=round(elapsed * 1000, 2),
        )

    # -- rebalance and health --------------------------------------------------------------

    async def _drain(self, revoked: set[TopicPartition]) -> None:
        """Called by aiokafka before giving partitions away. The batch in flight commits
        itself when done; wait for that, bounded so a Redis outage can't stall the whole
        group's rebalance (then the batch is abandoned uncommitted: the new owner redoes it)."""
        _log.info("partitions_revoked", partitions=_names(revoked))
        limit = max(0.1, self.config.kafka.rebalance_timeout / 2)
        try:
            await asyncio.wait_for(self._idle.wait(), limit)
        except TimeoutError:
            self._abandon = True
            _log.warning("rebalance_abandoned_batch_in_flight", waited_s=limit)
        for tp in revoked:
            self.lag.pop((tp.topic, tp.partition), None)
        self.assignment = set()

    def _assigned(self, assigned: set[TopicPartition]) -> None:
        self.assignment = set(assigned)
        _log.info("partitions_assigned", partitions=_names(assigned))

    def _status(self) -> tuple[bool, dict[str, object]]:
        ready = self.started.is_set() and self._retrying is None and not self._stopping.is_set()
        return ready, {
            "status": "ok" if ready else "degraded",
            "retrying": self._retrying,
            "partitions": _names(self.assignment),
            **self.stats.totals(),
        }


async def _check_replicas(client: RedisClient, config: Config) -> None:
    """Raise ReplicaCountMismatch if this config's hot.replicas differ from the fleet's:
    the daemon would leave replicas behind. Redis unreachable: start unchecked."""
    try:
        await check_replica_counts(client, config.redis.prefix, replica_counts(config))
    except REDIS_FAILURES as exc:
        _log.warning("replica_counts_unchecked", error=type(exc).__name__)


def _names(partitions: set[TopicPartition]) -> list[str]:
    return sorted(f"{tp.topic}:{tp.partition}" for tp in partitions)
