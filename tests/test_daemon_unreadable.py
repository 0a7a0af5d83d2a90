"""A record aiokafka reports as larger than the fetch size: the careful pass sets aside
that record, not the one after it.

With a stand-in consumer, because no broker these tests run can produce the error:
aiokafka raises ``RecordTooLargeError`` for a partition whose fetched data is a record
batch cut short (``max_partition_fetch_bytes``), and brokers cut one only for the old
fetch versions (0-2, brokers before Kafka 0.10.1): newer ones answer the first batch
whole (KIP-74) or, for a later partition of the response, nothing. The test broker
(tansu 0.6.0) answered a 200 KB record whole with ``max_partition_fetch_bytes`` and
``fetch_max_bytes`` set to 1, under every ``api_version`` down to 0.9. The stand-in does
what aiokafka's fetcher does then: it moves the position one past the record
(``consumed_to(position + 1)``) and raises the error naming the record's offset.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from aiokafka.errors import RecordTooLargeError
from aiokafka.structs import TopicPartition

from layered_cache.daemon.dlq import Poison
from layered_cache.daemon.unreadable import read_carefully

FETCH_BYTES = 1_048_576


class _CutBatchConsumer:
    """One partition of records 0..end-1; record ``too_large`` comes in a cut batch."""

    def __init__(self, tp: TopicPartition, too_large: int, end: int) -> None:
        self.tp, self.too_large, self.end = tp, too_large, end
        self.at = 0

    def assignment(self) -> set[TopicPartition]:
        return {self.tp}

    async def getmany(
        self, *partitions: TopicPartition, timeout_ms: int, max_records: int
    ) -> dict[TopicPartition, list[Any]]:
        if self.at >= self.end:
            return {}
        if self.at == self.too_large:
            fetched_at, self.at = self.at, self.at + 1  # aiokafka: consumed_to(position + 1)
            raise RecordTooLargeError(
                "There are some messages at [Partition=Offset]: %s=%s whose size is larger "
                "than the fetch size %s and hence cannot be ever returned.",
                self.tp,
                fetched_at,
                FETCH_BYTES,
            )
        record, self.at = SimpleNamespace(offset=self.at), self.at + 1
        return {self.tp: [record]}

    async def position(self, tp: TopicPartition) -> int:
        return self.at

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.at = offset


async def test_a_record_larger_than_the_fetch_size_is_set_aside_and_the_next_one_is_read() -> None:
    """The pass took the partition's position for the unreadable record's offset. Here
    that is one past it: record 2, a valid event, was dead-lettered under a reason that
    was not its own and skipped, never applied, and record 1 was skipped unrecorded.
    (Before that, the error was not one the daemon knew as a record's: run() raised it,
    and every restart met it again.)"""
    tp = TopicPartition("catalog-events", 0)
    consumer = _CutBatchConsumer(tp, too_large=1, end=4)
    handled: list[int] = []
    set_aside: list[Poison] = []

    async def handle(records: Mapping[TopicPartition, Sequence[Any]]) -> bool:
        handled.extend(record.offset for batch in records.values() for record in batch)
        return True

    async def aside(poison: Poison, moved: TopicPartition) -> bool:  # as Daemon._set_aside
        set_aside.append(poison)
        consumer.seek(moved, poison.offset + 1)
        return True

    await read_carefully(consumer, handle, aside, 10, asyncio.Event())  # type: ignore[arg-type]

    assert handled == [0]
    assert [(p.offset, p.key, p.value) for p in set_aside] == [(1, None, None)]
    assert set_aside[0].reason.startswith("unreadable record (RecordTooLargeError")
    assert await consumer.position(tp) == 2  # the daemon's next poll reads record 2


class _BufferingCutBatchConsumer:
    """One partition, records 0..end-1, record ``too_large`` in a batch cut short. As
    aiokafka's fetcher does (fetcher.py, ``RecordTooLargeError``): the fetch from the
    record's offset is made as soon as the buffer before it is drained, and on its
    response the error is buffered and the position moved one past the record
    (``tp_state.consumed_to(tp_state.position + 1)``); getmany raises it later."""

    def __init__(self, tp: Any, too_large: int, end: int) -> None:
        self.tp, self.too_large, self.end = tp, too_large, end
        self.at = 0  # the partition's position
        self.error: BaseException | None = None  # a buffered FetchError
        self.commits: list[int] = []

    def assignment(self) -> set[Any]:
        return {self.tp}

    @property
    def _fetcher(self) -> Any:
        """aiokafka's buffer as the daemon reads it: a ``FetchError`` for the partition
        while the error waits to be raised."""
        from types import SimpleNamespace

        from aiokafka.consumer.fetcher import FetchError

        records = {} if self.error is None else {self.tp: FetchError(error=self.error, backoff=0)}
        return SimpleNamespace(_records=records)

    def _prefetch(self) -> None:
        from aiokafka.errors import RecordTooLargeError

        if self.error is None and self.at == self.too_large:
            self.error = RecordTooLargeError(
                "There are some messages at [Partition=Offset]: %s=%s whose size is larger "
                "than the fetch size %s and hence cannot be ever returned.",
                self.tp, self.at, 1_048_576,
            )
            self.at += 1  # consumed_to(position + 1), at fetch time

    async def getmany(self, *partitions: Any, timeout_ms: int, max_records: int) -> Any:
        self._prefetch()  # nothing buffered (after a seek): the fetcher fetches first
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        batch = []
        stop = self.too_large if self.at < self.too_large else self.end
        while self.at < stop and len(batch) < max_records:
            batch.append(_Rec(self.at))
            self.at += 1
        self._prefetch()  # the buffer drained: the fetcher fetches on at once
        return {self.tp: batch} if batch else {}

    async def position(self, tp: Any) -> int:
        return self.at

    def highwater(self, tp: Any) -> int:
        return self.end

    async def committed(self, tp: Any) -> int | None:
        return self.commits[-1] if self.commits else None

    async def commit(self, offsets: dict[Any, int]) -> None:
        self.commits.append(offsets[self.tp])

    def seek(self, tp: Any, offset: int) -> None:
        self.at, self.error = offset, None  # Fetcher.seek_to drops the buffered result


class _Rec:
    def __init__(self, offset: int) -> None:
        self.offset = offset


async def test_a_record_too_large_is_set_aside_though_a_catch_up_commit_ran_before_it_was_raised() -> None:
    """Daemon.run's loop with a cut batch (9101619): batch 0-1 handled and committed (2),
    then ``_catch_up``, then the poll that raises RecordTooLargeError for record 2. But
    aiokafka moved the position past record 2 when the error was *buffered*, during the
    batch's handling, not when raised; ``Commits.catch_up`` takes any position past the
    last commit for a control-record skip and commits it (3). ``rewind`` then goes back
    to 3, the careful pass starts after the record: record 2 is neither applied nor
    dead-lettered, and nothing logs it (``_offset_of`` is never reached)."""
    from aiokafka.structs import TopicPartition

    from layered_cache.daemon.commits import Commits
    from layered_cache.daemon.stats import DaemonStats
    from layered_cache.daemon.unreadable import UNREADABLE, read_carefully, rewind

    tp = TopicPartition("catalog-events", 0)
    consumer = _BufferingCutBatchConsumer(tp, too_large=2, end=5)
    owned = {tp}
    commits = Commits(DaemonStats(), asyncio.Event(), lambda: owned)
    handled: list[int] = []
    set_aside: list[int] = []

    async def handle(records: Any) -> bool:  # as Daemon._handle: apply, commit last + 1
        offsets = [r.offset for batch in records.values() for r in batch]
        handled.extend(offsets)
        await commits.commit(consumer, {tp: offsets[-1] + 1})  # type: ignore[arg-type]
        return True

    async def aside(poison: Any, moved: Any) -> bool:  # as Daemon._set_aside
        set_aside.append(poison.offset)
        consumer.seek(moved, poison.offset + 1)
        await commits.commit(consumer, {tp: poison.offset + 1})  # type: ignore[arg-type]
        return True

    for _ in range(4):  # Daemon.run's loop, stopping never set
        try:
            records = await consumer.getmany(timeout_ms=200, max_records=100)
        except UNREADABLE:
            await rewind(consumer, "earliest", asyncio.Event())  # type: ignore[arg-type]
            await read_carefully(consumer, handle, aside, 100, asyncio.Event())  # type: ignore[arg-type]
            continue
        if records and not await handle(records):
            continue
        await commits.catch_up(consumer)  # type: ignore[arg-type]

    print("handled", handled, "set aside", set_aside, "commits", consumer.commits)
    assert handled == [0, 1, 3, 4]
    assert set_aside == [2], "the too-large record 2 was skipped: neither applied nor dead-lettered"
