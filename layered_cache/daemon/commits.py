"""Offset commits: the daemon's one way to commit, and what it committed.

A commit refused (the partitions moved), failed (broker trouble) or given up on stop()
(aiokafka retries a commit to a broker that does not answer with no deadline:
``stopping``) is counted and logged, never raised: the batch is read again by the next
owner, or covered by a later commit of the same partition (commits are cumulative).
``committed`` keeps what was committed per owned partition, for the watch's lag gauge.

A commit can be answered after a rebalance: aiokafka retries one answered with a
retriable error (COORDINATOR_LOAD_IN_PROGRESS) after a backoff with the generation
current *then*, and a broker checks the member and generation, not who owns the
partition. So what is recorded after a commit is only for partitions still owned: the
daemon's assignment, a new set at every revocation and assignment, must be the same set
after the commit's await (as in ``watch.broker_lag``). Recording it anyway put back the
``committed`` entries the revocation had just dropped, and the catch-up then asked
``highwater`` of a partition no longer assigned (an AssertionError that ended
``Daemon.run``) or wrote a lag series for a partition another daemon owns, for good.

Starts under ``auto_offset_reset = "latest"``: each partition the group never committed
has its start committed as it is assigned (``kafka.uncommitted_starts``). A start commit
that does not go through (REBALANCE_IN_PROGRESS when another replica's JoinGroup got
there first, broker trouble) is kept in ``unstarted`` and owed: tried again by every
catch-up, and before the partition's first records are handled, retried until it goes
through (``owe_starts``). Tried once and forgotten, the partition stayed uncommitted;
a batch fetched from it but never applied (Redis down, then a deploy) left the next
owner to start at the then end, and the batch's events were never applied.

Transactions: a transactional producer (Debezium or Kafka Streams exactly-once
outboxes, librdkafka ``transactional.id``) ends each transaction with a control record,
the commit or abort marker. aiokafka never hands it over; it only moves the position
past it. Committing last record + 1, the group stayed one short of the end for ever:
1 record of lag per partition, on the gauge and on any monitor of the group's offsets.
``catch_up`` commits the position past it, between batches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.structs import TopicPartition

from layered_cache.daemon.kafka import uncommitted_starts
from layered_cache.daemon.retry import Retrier
from layered_cache.daemon.stats import DaemonStats
from layered_cache.daemon.stopping import STOP_GRACE, Stopped, unless_stopped

__all__ = ["Commits", "StartNotCommitted"]

_log = structlog.get_logger("layered_cache.daemon")
# How long ``catch_up`` waits for a position aiokafka does not know yet (being reset).
_POSITION_WAIT = 0.5


class StartNotCommitted(Exception):
    """A "latest" start whose commit did not go through (``owe_starts`` retries it)."""


class Commits:
    """Commits offsets, counting failures; ``committed`` is what it committed.
    ``owned`` is the daemon's assignment (a new set at every rebalance)."""

    def __init__(
        self, stats: DaemonStats, stopping: asyncio.Event, owned: Callable[[], set[TopicPartition]]
    ) -> None:
        self._stats = stats
        self._stopping = stopping
        self._owned = owned
        self.committed: dict[TopicPartition, int] = {}  # per owned partition (the watch's lag)
        # "latest" only: where each partition the group never committed started, until a
        # commit of it goes through (``start``, ``owe_starts``).
        self.unstarted: dict[TopicPartition, int] = {}

    async def commit(
        self,
        consumer: AIOKafkaConsumer,
        offsets: dict[TopicPartition, int],
        mine: set[TopicPartition] | None = None,
    ) -> bool:
        """True once committed with the partitions still ours (``mine``, the assignment
        as the commit began unless given); a failure is counted and logged, never raised."""
        mine = self._owned() if mine is None else mine
        try:
            await unless_stopped(lambda: consumer.commit(offsets), self._stopping, STOP_GRACE)
        except Stopped:
            # The broker did not answer within the grace of a SIGTERM: the batch is read
            # again by the next owner (at-least-once), the daemon exits before the SIGKILL.
            self._stats.commit_failures += 1
            _log.warning("commit_given_up_stopping", waited_s=STOP_GRACE)
            return False
        except (CommitFailedError, IllegalStateError) as exc:
            # The partitions moved in a rebalance: their next owner reads this batch again
            # from the last commit and re-deletes (idempotent). Nothing is lost.
            self._stats.commit_failures += 1
            _log.warning("commit_refused_partitions_moved", error=str(exc))
            return False
        except KafkaError as exc:
            # Broker trouble: a later batch's commit of the same partition covers this one
            # (commits are cumulative); until then a restart would redeliver - harmless.
            self._stats.commit_failures += 1
            _log.warning("commit_failed", error=f"{type(exc).__name__}: {exc}")
            return False
        self._stats.commits += 1
        if self._owned() is not mine:
            return False  # answered after a rebalance: nothing of it is ours to record
        self.committed.update(offsets)
        for tp in offsets:
            self.unstarted.pop(tp, None)  # any commit of a partition is its start
        return True

    async def start(self, consumer: AIOKafkaConsumer, assigned: set[TopicPartition]) -> None:
        """At assignment, under "latest": the start of each partition the group never
        committed, committed now, or owed (``unstarted``) if that does not go through."""
        if starts := await uncommitted_starts(consumer, assigned, self._stopping):
            self.unstarted.update(starts)
            await self.commit(consumer, starts)

    def drop_starts(self, revoked: set[TopicPartition]) -> None:
        """Revoked partitions owe nothing: their next owner commits its own start. Done
        before the rebalance hook waits for the batch in flight, so a batch retrying a
        start the rebalance refuses ends at its next attempt instead of holding the
        group's rebalance for half of ``rebalance_timeout``."""
        for tp in revoked:
            self.unstarted.pop(tp, None)

    async def owe_starts(
        self, consumer: AIOKafkaConsumer, partitions: Iterable[TopicPartition], retrier: Retrier
    ) -> bool:
        """Before records of ``partitions`` are handled: the starts they still owe,
        committed, retried (``/readyz``: ``"retrying": "start_commit"``) until they are
        (True), or given up when stopping or revoked (False: not handled; uncommitted,
        the records are read again by whoever owns the partition next)."""
        owing = [tp for tp in partitions if tp in self.unstarted]

        async def attempt() -> None:
            starts = {tp: self.unstarted[tp] for tp in owing if tp in self.unstarted}
            if starts and not await self.commit(consumer, starts):
                if self._stopping.is_set():
                    raise Stopped  # until_done logs it given up
                raise StartNotCommitted(sorted(f"{tp.topic}:{tp.partition}" for tp in starts))

        return not owing or await retrier.until_done("start_commit", attempt, (StartNotCommitted,))

    async def catch_up(self, consumer: AIOKafkaConsumer) -> dict[tuple[str, int], int]:
        """Commit each partition's position where it is past our last commit; returns
        the lag (records behind the high watermark) of each partition it committed,
        none if the partitions moved meanwhile. Only between batches, the last one done
        (not abandoned): then every record below a position was handed over by
        ``getmany`` and applied, since aiokafka moves a position only as it hands
        records over (prefetched ones don't move it: ``FetchResult._update_position``)
        or skips control records. After an abandoned batch the positions are past it:
        the caller must not come here, and the next assignment starts from the
        committed offsets anyway. A start still owed (``unstarted``) is tried again."""
        mine = self._owned()  # a rebalance during any await here: nothing reported
        ahead = dict(self.unstarted)
        for tp, offset in list(self.committed.items()):
            try:
                async with asyncio.timeout(_POSITION_WAIT):
                    position = await consumer.position(tp)
            except (IllegalStateError, TimeoutError):
                continue  # moved, or being reset: the next idle poll looks again
            if position > offset and not _error_pending(consumer, tp):
                ahead[tp] = position
        if not ahead or not await self.commit(consumer, ahead, mine):
            return {}
        lag = {tp: _behind(consumer, tp, position) for tp, position in ahead.items()}
        return {(tp.topic, tp.partition): n for tp, n in lag.items() if n is not None}


def _behind(consumer: AIOKafkaConsumer, tp: TopicPartition, position: int) -> int | None:
    """Records between ``position`` and the high watermark; None for a partition no
    longer assigned (aiokafka asserts it is: an AssertionError out of here ended
    ``Daemon.run``). The caller checked ownership after its last await; this is the
    guard should aiokafka's own assignment change without one."""
    try:
        high = consumer.highwater(tp)
    except (AssertionError, IllegalStateError):
        return None
    return 0 if high is None else max(0, high - position)


def _error_pending(consumer: AIOKafkaConsumer, tp: TopicPartition) -> bool:
    """Whether aiokafka holds an error for ``tp`` that ``getmany`` has yet to raise. A
    record larger than the fetch size (``RecordTooLargeError``, old brokers) moves the
    position past it when the fetch comes back, not when the error is raised: committing
    that position skipped the record unapplied and never set aside. aiokafka has no
    public way to ask, so its fetcher's buffer is read; anything else reads as none."""
    buffered = getattr(getattr(consumer, "_fetcher", None), "_records", {}).get(tp)
    return type(buffered).__name__ == "FetchError"
