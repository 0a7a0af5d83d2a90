"""aiokafka clients from ``KafkaConfig``: settings (one place for security pass-through),
the consumer + DLQ producer pair the daemon opens and closes together, the poll that
gives way to ``stop()``, and where a newly assigned partition starts."""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Mapping
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.errors import IllegalStateError, KafkaError
from aiokafka.helpers import create_ssl_context
from aiokafka.structs import ConsumerRecord, TopicPartition

from layered_cache._config import KafkaConfig
from layered_cache.daemon.header_names import lenient_fetches
from layered_cache.daemon.stopping import Stopped, unless_stopped

__all__ = [
    "FETCH_MAX_WAIT_MS",
    "KafkaClients",
    "KafkaSetupError",
    "client_kwargs",
    "consumer_kwargs",
    "poll",
    "producer_kwargs",
    "uncommitted_starts",
]

FETCH_MAX_WAIT_MS = 50
# How long one poll waits for records when none are buffered: the loop's idle tick (the
# catch-up commit runs between polls).
POLL_MS = 200
# How long closing one client may take: with the broker gone, LeaveGroup and the
# producer's flush have nobody to talk to, and a SIGTERM must still end the process.
STOP_TIMEOUT = 10.0

_log = structlog.get_logger("layered_cache.daemon")


class KafkaSetupError(Exception):
    """A local setting the clients can't be built with (an unreadable ``ssl_cafile``).
    Not a connect failure: no retry makes a missing file appear, so the daemon refuses
    to start (exit 2) instead of retrying it as an unreachable broker forever."""


def client_kwargs(config: KafkaConfig) -> dict[str, Any]:
    """Connection and security settings shared by the consumer and the DLQ producer."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": config.bootstrap_servers,
        "client_id": config.client_id,
        "security_protocol": config.security_protocol,
    }
    if config.sasl_mechanism is not None:
        kwargs["sasl_mechanism"] = config.sasl_mechanism
        kwargs["sasl_plain_username"] = config.sasl_username
        kwargs["sasl_plain_password"] = config.sasl_password
    if config.security_protocol in ("SSL", "SASL_SSL"):
        try:
            kwargs["ssl_context"] = create_ssl_context(cafile=config.ssl_cafile)
        except (OSError, ssl.SSLError) as exc:
            raise KafkaSetupError(
                f"kafka.ssl_cafile: {config.ssl_cafile!r} can't be loaded as a CA file: {exc}"
            ) from None
    return kwargs


def consumer_kwargs(config: KafkaConfig) -> dict[str, Any]:
    """Manual commits only: an offset is committed after its keys are gone, never by a timer."""
    return {
        **client_kwargs(config),
        "group_id": config.group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": config.auto_offset_reset,
        "session_timeout_ms": int(config.session_timeout * 1000),
        "heartbeat_interval_ms": int(config.heartbeat_interval * 1000),
        "rebalance_timeout_ms": int(config.rebalance_timeout * 1000),
        "max_poll_records": config.max_batch,
        # Kafka's default (500 ms) lets an idle partition's fetch sit on the broker; at
        # 1,000 events/s that showed as a 250 ms p99 event->delete latency, 50 ms as 70 ms.
        "fetch_max_wait_ms": FETCH_MAX_WAIT_MS,
        # Larger than any event we accept, so an oversized one is fetched (and sent to
        # the DLQ) instead of blocking its partition.
        "max_partition_fetch_bytes": max(1_048_576, 2 * config.max_event_bytes),
    }


def producer_kwargs(config: KafkaConfig) -> dict[str, Any]:
    """The DLQ producer: acks from every in-sync replica before we commit past a poison."""
    return {**client_kwargs(config), "acks": "all"}


class KafkaClients:
    """The consumer and the DLQ producer; ``*_options`` are extra aiokafka settings."""

    def __init__(
        self,
        config: KafkaConfig,
        consumer_options: Mapping[str, Any] | None = None,
        producer_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._config = config
        self._consumer_options = dict(consumer_options or {})
        self._producer_options = dict(producer_options or {})
        self.consumer: AIOKafkaConsumer | None = None
        self.producer: AIOKafkaProducer | None = None

    async def connect(self, listener: ConsumerRebalanceListener) -> None:
        """Producer first: a consumer that joins the group must be able to dead-letter."""
        config = self._config
        self.producer = AIOKafkaProducer(**{**producer_kwargs(config), **self._producer_options})
        await self.producer.start()
        self.consumer = AIOKafkaConsumer(**{**consumer_kwargs(config), **self._consumer_options})
        self.consumer.subscribe(config.topics, listener=listener)
        with lenient_fetches():  # its fetch task, created here, reads any header name
            await self.consumer.start()

    async def disconnect(self) -> None:
        # Consumer first: its stop() sends LeaveGroup, so partitions move to the other
        # daemons now instead of after the session timeout.
        try:
            if self.consumer is not None:
                consumer, self.consumer = self.consumer, None
                await _stop(consumer, "consumer")
        finally:  # a cancel raised once the consumer closed: the producer closes too
            if self.producer is not None:
                producer, self.producer = self.producer, None
                await _stop(producer, "producer")


async def _stop(client: AIOKafkaConsumer | AIOKafkaProducer, name: str) -> None:
    """Close one client, bounded, never raising for the client's own failures.

    aiokafka's ``stop()`` re-raises the CancelledError of a background task it cancels
    (a fetch task sleeping in its retry backoff while the broker is down): that is not a
    cancellation of *this* task, and letting it out turned a SIGTERM during a Kafka
    incident into a traceback and exit 1 with nothing else closed. A cancellation of
    this task that arrives meanwhile (``cancelling()`` grew) is passed on, as it must
    be; one asked before (``run()`` cancelled, its ``finally`` closing) is not new: taken
    for one, the client's own CancelledError skipped the rest of the shutdown."""
    task = asyncio.current_task()
    requested = task.cancelling() if task is not None else 0
    # A task of its own, shielded: a cancel of ours that arrives meanwhile (a second one,
    # during shutdown) cut the stop halfway before, leaving the client's fetcher and
    # heartbeat running (the member kept its partitions). It waits for the stop
    # (bounded), then is raised.
    stopping = asyncio.ensure_future(asyncio.wait_for(client.stop(), STOP_TIMEOUT))
    cancelled = False
    while not stopping.done():
        try:
            await asyncio.shield(stopping)
        except BaseException:
            cancelled = cancelled or not stopping.done()  # ours, not the stop's outcome
    if stopping.cancelled():  # the client's own cancel, re-raised out of its stop()
        _log.warning("kafka_stop_interrupted", client=name)
    elif (exc := stopping.exception()) is not None:  # TimeoutError too: closing goes on
        _log.warning("kafka_stop_failed", client=name, error=f"{type(exc).__name__}: {exc}")
    if cancelled or (task is not None and task.cancelling() > requested):
        raise asyncio.CancelledError


async def poll(
    consumer: AIOKafkaConsumer,
    stopping: asyncio.Event,
    *partitions: TopicPartition,
    max_records: int,
) -> dict[TopicPartition, list[ConsumerRecord[Any, Any]]] | None:
    """``getmany`` of ``partitions`` (all assigned if none), or None once ``stopping``
    is set, whichever comes first; getmany's errors are raised as they are.

    Its timeout alone did not make ``stop()`` responsive: while the group rebalances,
    getmany first waits for the next assignment, whatever its timeout, as long as the
    rebalance lasts, and for ever when the broker dies before the group is formed again.
    A SIGTERM then went unseen until the SIGKILL. Cancelling getmany is safe: it takes
    records from the fetched buffer (moving the positions) only in the stretch without
    an await right before it returns, so a cancelled getmany consumed nothing. (It
    leaves aiokafka's count of polls in progress one too high, which only its
    ``max_poll_interval_ms`` check reads, on a consumer that is closed next.)"""
    try:
        return await unless_stopped(
            lambda: consumer.getmany(*partitions, timeout_ms=POLL_MS, max_records=max_records),
            stopping,
        )
    except Stopped:
        return None  # given up (``unless_stopped``): it consumed nothing


async def uncommitted_starts(
    consumer: AIOKafkaConsumer, assigned: set[TopicPartition], stopping: asyncio.Event
) -> dict[TopicPartition, int]:
    """Where each assigned partition the group never committed starts reading (its
    position, resolved by ``auto_offset_reset`` now). Under "latest" that start is
    "the end, whenever asked": left uncommitted, a daemon that fetched events and
    stopped before its first commit left the next one to start at a later end, and
    the events in between were never applied. Committed at assignment, it is owed."""
    starts: dict[TopicPartition, int] = {}
    for tp in sorted(assigned):
        try:
            # Given up on stop(): aiokafka asks a broker that doesn't answer for ever.
            if await unless_stopped(functools.partial(consumer.committed, tp), stopping) is None:
                starts[tp] = await consumer.position(tp)
        except Stopped:
            return {}  # stopping: nothing committed (the next member sees it uncommitted)
        except (IllegalStateError, KafkaError):
            continue  # moved again meanwhile, or the broker can't say: as before
    return starts

